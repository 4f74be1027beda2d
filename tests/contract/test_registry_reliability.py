"""Reliability of the registry under concurrency, cancellation, corruption and crashes of its dependencies. Every
test uses real servers; the crash tests start private Valkey / SeaweedFS instances and SIGKILL them."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from loraplane.config import Settings
from loraplane.local.processes import seaweed_s3_server, valkey_server, wait_until
from loraplane.v1 import registry_pb2 as E
from loraplane.v1 import registry_pb2_grpc
from tests.fixtures.registry import (
    adapter_blob,
    all_events,
    bucket_objects,
    create_adapter,
    download,
    multipart_uploads,
    publish,
    publish_requests,
    sha256_hex,
    start_live_registry,
    versions_of,
)


def test_concurrent_publishers_get_versions_without_gap_or_duplicate(registry):
    stub = registry.stub()
    create_adapter(stub, "busy")
    publishers, per_publisher = 8, 25

    def run(worker: int) -> list[tuple[int, str]]:
        own = registry.stub()  # each publisher on its own channel, as separate processes would be
        results = []
        for index in range(per_publisher):
            blob = adapter_blob(1000)
            reply = publish(own, "busy", blob, metadata={"worker": str(worker)})
            results.append((reply.version.version, sha256_hex(blob)))
        return results

    with ThreadPoolExecutor(publishers) as pool:
        results = [item for batch in pool.map(run, range(publishers)) for item in batch]
    numbers = sorted(version for version, _ in results)
    assert numbers == list(range(1, publishers * per_publisher + 1))
    stored = {v.version: v.sha256 for v in stub.ListVersions(E.ListVersionsRequest(adapter="busy",
                                                                                   page_size=1000)).versions}
    assert stored == dict(results)  # each reply's version holds exactly that publisher's bytes
    published = [e.version for e in all_events(stub, adapter="busy") if e.type == E.EVENT_TYPE_VERSION_PUBLISHED]
    assert published == list(range(1, 201))  # events in commit order


def test_a_cancelled_upload_leaves_no_version_and_no_blob(registry):
    stub = registry.stub()
    create_adapter(stub, "cancel")
    blob = adapter_blob(20 * 1024 * 1024)
    release = threading.Event()

    def stalled_stream():
        sent = 0
        for request in publish_requests("cancel", blob):
            yield request
            if request.HasField("chunk"):
                sent += len(request.chunk)
                if sent >= 12 * 1024 * 1024:
                    release.wait(30)  # the client stalls mid-upload, then gives up
                    return

    future = stub.PublishVersion.future(stalled_stream(), timeout=60)
    # The server has started streaming into S3 (a multipart upload is open) before the client cancels.
    wait_until(lambda: multipart_uploads(registry.settings) != [], 20, "multipart upload to start")
    future.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    wait_until(lambda: multipart_uploads(registry.settings) == [], 20, "multipart upload to be aborted")
    assert bucket_objects(registry.settings) == {}
    assert versions_of(stub, "cancel") == []
    assert [e.type for e in all_events(stub, adapter="cancel")] == [E.EVENT_TYPE_ADAPTER_CREATED]
    # The registry is still healthy and the same content publishes fine afterwards.
    assert publish(stub, "cancel", blob).version.version == 1


def test_a_wrong_sha256_is_data_loss_and_commits_nothing(registry):
    stub = registry.stub()
    create_adapter(stub, "integrity")
    blob = adapter_blob(20 * 1024 * 1024)  # multipart: two parts, both sent to S3 before the digest check
    claimed = sha256_hex(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(grpc.RpcError) as caught:
        publish(stub, "integrity", blob, sha256=claimed)
    # DATA_LOSS, as DESIGN.md specifies for integrity failures.
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert "header.sha256" in caught.value.details() and claimed in caught.value.details()
    assert versions_of(stub, "integrity") == []
    assert bucket_objects(registry.settings) == {}
    assert multipart_uploads(registry.settings) == []


class Watcher:
    """A watcher that reconnects from its last cursor after any error, like the sampler's adapter manager."""

    def __init__(self, address: str, **filters):
        self.address, self.filters = address, filters
        self.events: list[E.Event] = []
        self.errors: list[grpc.StatusCode] = []
        self.cursor = ""
        self._stop = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with grpc.insecure_channel(self.address) as channel:
                stub = registry_pb2_grpc.AdapterRegistryServiceStub(channel)
                self._call = stub.WatchEvents(E.WatchEventsRequest(after_cursor=self.cursor, **self.filters))
                try:
                    for reply in self._call:
                        self.events.append(reply.event)
                        self.cursor = reply.event.cursor
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        self.errors.append(exc.code())
            self._stop.wait(0.2)

    def disconnect(self) -> None:
        if self._call is not None:
            self._call.cancel()

    def wait_for(self, count: int, timeout: float = 30) -> None:
        wait_until(lambda: len(self.events) >= count, timeout, f"{count} events (have {len(self.events)})")

    def stop(self) -> None:
        self._stop.set()
        self.disconnect()
        self._thread.join(10)


def test_a_watcher_that_reconnects_from_its_cursor_sees_every_event_once_in_order(registry):
    stub = registry.stub()
    create_adapter(stub, "w")
    watcher = Watcher(registry.address, adapter="w")
    try:
        for round_ in range(4):
            for index in range(5):
                publish(stub, "w", adapter_blob(1000))
            watcher.wait_for(1 + 5 * (round_ + 1))
            watcher.disconnect()  # drops the stream; publishes of the next round happen while it reconnects
        time.sleep(0.3)
    finally:
        watcher.stop()
    assert [e.version for e in watcher.events] == [0, *range(1, 21)]
    assert [e.cursor for e in watcher.events] == [e.cursor for e in all_events(stub, adapter="w")]


def private_settings(redis_url: str, s3) -> Settings:
    suffix = uuid.uuid4().hex[:10]
    return Settings(redis_url=redis_url, s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                    s3_secret_key=s3.secret_key, s3_bucket=f"lp-rel-{suffix}", key_prefix=f"lprel:{suffix}:")


def test_valkey_killed_and_restarted_loses_nothing_and_watchers_resume(tmp_path, seaweed, background_loop):
    valkey = valkey_server(tmp_path / "valkey")  # AOF with fsync on every write
    valkey.start()
    live = start_live_registry(private_settings(valkey.url, seaweed), background_loop)
    watcher = Watcher(live.address)
    try:
        stub = live.stub()
        create_adapter(stub, "durable", keep_last=0)
        blobs = [adapter_blob(1000 + i) for i in range(5)]
        for blob in blobs[:3]:
            publish(stub, "durable", blob)
        watcher.wait_for(4)

        valkey.kill()  # SIGKILL: a crash
        with pytest.raises(grpc.RpcError) as caught:
            publish(stub, "durable", blobs[3])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in caught.value.details() and valkey.url in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetAdapter(E.GetAdapterRequest(name="durable"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

        valkey.start()  # same port, same data directory; the registry reconnects by itself
        for blob in blobs[3:]:
            publish(stub, "durable", blob)
        watcher.wait_for(6)
        time.sleep(0.3)
        assert versions_of(stub, "durable") == [1, 2, 3, 4, 5]
        for number, blob in enumerate(blobs, start=1):
            assert download(stub, "durable", version=number)[1] == blob
    finally:
        watcher.stop()
        live.close()
        valkey.stop()
    assert [(e.type, e.version) for e in watcher.events] == [
        (E.EVENT_TYPE_ADAPTER_CREATED, 0), *[(E.EVENT_TYPE_VERSION_PUBLISHED, v) for v in range(1, 6)]]
    assert grpc.StatusCode.UNAVAILABLE in watcher.errors  # it did lose its stream, and resumed from its cursor


def test_valkey_restart_keeps_committed_versions(tmp_path, seaweed, background_loop):
    valkey = valkey_server(tmp_path / "valkey")
    valkey.start()
    live = start_live_registry(private_settings(valkey.url, seaweed), background_loop)
    try:
        stub = live.stub()
        create_adapter(stub, "kept")
        blobs = [adapter_blob(2000 + i) for i in range(4)]
        for blob in blobs:
            publish(stub, "kept", blob, aliases=["last"])
        valkey.kill()
        valkey.start()
        assert versions_of(stub, "kept") == [1, 2, 3, 4]
        assert stub.GetAdapter(E.GetAdapterRequest(name="kept")).adapter.aliases["last"] == 4
        for number, blob in enumerate(blobs, start=1):
            assert download(stub, "kept", version=number)[1] == blob
        assert publish(stub, "kept", adapter_blob(1000)).version.version == 5  # the counter survived too
    finally:
        live.close()
        valkey.stop()


def test_s3_down_is_unavailable_with_a_clear_message_and_the_registry_recovers(tmp_path, valkey, background_loop):
    s3 = seaweed_s3_server(tmp_path / "seaweed")
    s3.start()
    live = start_live_registry(private_settings(valkey.url, s3), background_loop)
    try:
        stub = live.stub()
        create_adapter(stub, "s3")
        before = adapter_blob(7 * 1024 * 1024)
        publish(stub, "s3", before)

        s3.kill()
        for attempt, blob in (("small", adapter_blob(100)), ("multipart", adapter_blob(6 * 1024 * 1024))):
            with pytest.raises(grpc.RpcError) as caught:
                publish(stub, "s3", blob)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, attempt
            assert "S3" in caught.value.details() and s3.endpoint in caught.value.details(), attempt
        with pytest.raises(grpc.RpcError) as caught:
            download(stub, "s3", version=1)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "S3" in caught.value.details() and s3.endpoint in caught.value.details()
        assert versions_of(stub, "s3") == [1]  # metadata still answers; nothing was committed

        s3.start()  # same port, same data directory; no registry restart
        after = adapter_blob(6 * 1024 * 1024)
        assert publish(stub, "s3", after).version.version == 2
        assert download(stub, "s3", version=1)[1] == before
        assert download(stub, "s3", version=2)[1] == after
    finally:
        live.close()
        s3.kill()  # its data lives in tmp_path; a graceful stop of `weed server` takes 10 s
