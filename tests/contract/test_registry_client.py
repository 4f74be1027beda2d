"""loraplane.registry_client.RegistryClient (used by the trainer, the sampler and the SDK) against a live registry:
the streaming protocol is hidden and every failure arrives as a domain error."""

from __future__ import annotations

import asyncio

import pytest

from loraplane import errors
from loraplane.local.processes import free_port
from loraplane.registry_client import EventType, RegistryClient, RegistryEvent, VersionKind
from loraplane.v1 import common_pb2
from tests.fixtures.registry import TEST_LORA, adapter_blob, sha256_hex


async def test_client_round_trip(registry):
    async with RegistryClient(registry.address) as client:
        lora = common_pb2.LoraConfig(rank=4, alpha=8)
        made = await client.create_adapter("team/c1", lora_config=lora, base_model="tiny", keep_last=5,
                                           metadata={"a": "b"})
        assert made.lora_config == lora and made.keep_last == 5
        again = await client.create_adapter("team/c1", lora_config=lora, base_model="tiny", exist_ok=True)
        assert again == made
        with pytest.raises(errors.AlreadyExists):
            await client.create_adapter("team/c1", lora_config=lora, base_model="tiny")

        blob = adapter_blob(6 * 1024 * 1024 + 5)
        first = await client.publish("team/c1", blob, training_step=3, aliases=["prod"], idempotency_key="k1")
        assert (first.version, first.sha256, first.size_bytes) == (1, sha256_hex(blob), len(blob))
        assert (await client.publish("team/c1", blob, idempotency_key="k1")).version == 1
        state = await client.publish("team/c1", adapter_blob(2000, training_state=True),
                                    kind=common_pb2.VERSION_KIND_TRAINING_STATE)
        assert state.version == 2

        described, data = await client.download("team/c1", alias="prod")
        assert data == blob and (described.version, described.kind) == (1, VersionKind.WEIGHTS)
        assert described.aliases == ("prod",) and described.create_time
        assert (await client.get_version("team/c1")).version == 1  # latest weights
        assert [v.version for v in await client.list_versions("team/c1")] == [1, 2]
        assert [a.name for a in await client.list_adapters(prefix="team/")] == ["team/c1"]
        assert dict((await client.set_alias("team/c1", "prod", 0)).aliases) == {}

        events = []
        async for event in client.watch(adapter="team/c1"):
            events.append(event)
            if len(events) == 4:
                break
        assert all(isinstance(e, RegistryEvent) and e.cursor and e.time for e in events)
        assert [(e.type, e.version, e.kind) for e in events] == [
            (EventType.ADAPTER_CREATED, 0, VersionKind.UNSPECIFIED),
            (EventType.VERSION_PUBLISHED, 1, VersionKind.WEIGHTS),
            (EventType.ALIAS_SET, 1, VersionKind.WEIGHTS),
            (EventType.VERSION_PUBLISHED, 2, VersionKind.TRAINING_STATE)]
        await client.delete_version("team/c1", 2)
        await client.delete_adapter("team/c1")
        with pytest.raises(errors.NotFound):
            await client.get_adapter("team/c1")


async def test_client_maps_failures_to_domain_errors(registry):
    async with RegistryClient(registry.address) as client:
        with pytest.raises(errors.NotFound, match="ghost"):
            await client.get_version("ghost")
        with pytest.raises(errors.InvalidArgument, match="adapter.name"):
            await client.create_adapter("Not Valid")
        with pytest.raises(errors.InvalidArgument, match="ref"):
            await client.get_version("x", version=1, alias="y")
    async with RegistryClient(f"127.0.0.1:{free_port()}", timeout=2) as nowhere:
        with pytest.raises(errors.Unavailable):
            await nowhere.get_adapter("x")


async def test_watch_is_cancellable_while_blocked(registry):
    async with RegistryClient(registry.address) as client:
        async def first_event():
            async for event in client.watch(start_at_end=True):
                return event

        task = asyncio.create_task(first_event())
        await asyncio.sleep(0.3)
        assert not task.done()  # blocked: nothing happened after the call started
        await client.create_adapter("late", lora_config=TEST_LORA, base_model="tiny")
        event = await asyncio.wait_for(task, 10)
        assert (event.type, event.adapter) == (EventType.ADAPTER_CREATED, "late")


async def test_downloads_come_straight_from_s3_are_checked_and_fall_back_to_the_stream(registry, caplog,
                                                                                       monkeypatch):
    """The client takes the blob from the presigned S3 URL (no warning, the stream never used), checks it like
    streamed bytes (a corrupted object is DataLoss), and when S3 is unreachable from it streams through the
    registry, from then on without asking for URLs. The unreachable S3 is a mock: a network that lets a client reach
    the registry but not the S3 server the registry itself uses cannot be made on one loopback host."""
    import io
    import urllib.error

    from loraplane import registry_client
    from tests.fixtures.registry import s3_client

    lora = common_pb2.LoraConfig(rank=4, alpha=8)
    blob = adapter_blob(5 * 1024 * 1024 + 3)
    async with RegistryClient(registry.address) as client:
        await client.create_adapter("team/d", lora_config=lora, base_model="tiny")
        await client.publish("team/d", blob)
        with caplog.at_level("WARNING", logger="loraplane.registry_client"):
            described, data = await client.download("team/d", 1)
        assert data == blob and described.sha256 == sha256_hex(blob)
        assert not [r for r in caplog.records if r.name == "loraplane.registry_client"]

        rotten = adapter_blob(4000, seed=3)
        await client.publish("team/d", rotten)
        s3_client(registry.settings).put_object(registry.settings.s3_bucket, f"blobs/sha256/{sha256_hex(rotten)}",
                                                io.BytesIO(b"\0" * len(rotten)), len(rotten))
        with pytest.raises(errors.DataLoss, match="corrupt"):
            await client.download("team/d", 2)

        asked = []
        real_stream = client._download_stream

        async def recorded(request, name):
            asked.append(request.direct)
            return await real_stream(request, name)

        def unreachable(url, timeout):
            raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

        monkeypatch.setattr(client, "_download_stream", recorded)
        monkeypatch.setattr(registry_client.urllib.request, "urlopen", unreachable)
        assert (await client.download("team/d", 1))[1] == blob
        assert (await client.download("team/d", 1))[1] == blob
        assert asked == [True, False, False]  # asked for the URL once, then streamed
