"""A sampler process SIGKILLed in the middle of a stream of publishes resumes from its persisted cursor."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from loraplane.local.processes import free_port
from loraplane.registry_client import RegistryClient
from loraplane.rpc import check_health
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
from tests.fixtures.sampler import adapter_blob

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = ("rs-a", "rs-b")
VERSIONS = 6


def start_sampler_process(registry, port: int, log_path: Path) -> subprocess.Popen:
    settings = registry.settings
    env = dict(os.environ, LORAPLANE_REDIS_URL=settings.redis_url, LORAPLANE_KEY_PREFIX=settings.key_prefix,
               PYTHONPATH=str(REPO))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sampler_svc", "--registry-address", registry.address, "--port", str(port),
             "--instance-id", "restartable", "--keep-versions", "2", "--base-model", "tiny"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while not check_health(f"127.0.0.1:{port}", timeout=0.5):
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "sampler process did not become healthy"
        time.sleep(0.1)
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def all_events(address: str) -> list:
    async def collect():
        client = RegistryClient(address)
        events = []
        try:
            stream = client.watch()
            while True:
                try:
                    events.append(await asyncio.wait_for(stream.__anext__(), 1.0))
                except (TimeoutError, StopAsyncIteration):
                    break
            await stream.aclose()
        finally:
            await client.close()
        return events

    return asyncio.run(collect())


def test_sigkill_mid_publish_stream_then_restart_loads_exactly_the_right_versions(registry, tmp_path):
    port = free_port()
    log_path = tmp_path / "sampler.log"
    proc = start_sampler_process(registry, port, log_path)
    address = f"127.0.0.1:{port}"

    async def publish_all(kill_after: int):
        client = RegistryClient(registry.address)
        published = 0
        try:
            for name in ADAPTERS:
                await client.create_adapter(name, base_model="tiny", lora_config=common_pb2.LoraConfig(rank=4))
            for version in range(1, VERSIONS + 1):
                for index, name in enumerate(ADAPTERS):
                    await client.publish(name, adapter_blob(version * 10 + index))
                    published += 1
                    if published == kill_after:
                        # Give the sampler time to be mid-way through applying events, then kill it hard.
                        await asyncio.sleep(0.3)
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait(10)
        finally:
            await client.close()

    try:
        asyncio.run(publish_all(kill_after=7))
        state_key = f"{registry.settings.key_prefix}sampler:restartable:state"
        persisted = json.loads(redis.Redis.from_url(registry.settings.redis_url).get(state_key))
        events = all_events(registry.address)
        cursors = [e.cursor for e in events]
        # It had applied some but not all events when it died.
        assert persisted["cursor"] in cursors and persisted["cursor"] != cursors[-1]

        proc = start_sampler_process(registry, port, log_path)
        expected = {(name, v) for name in ADAPTERS for v in (VERSIONS - 1, VERSIONS)}
        with __import__("grpc").insecure_channel(address) as channel:
            stub = sampler_pb2_grpc.SamplerServiceStub(channel)
            deadline = time.monotonic() + 60
            while True:
                status = stub.GetStatus(sampler_pb2.GetStatusRequest())
                loaded = {(a.adapter, a.version) for a in status.loaded}
                if loaded == expected and status.watch_cursor == cursors[-1]:
                    break
                assert time.monotonic() < deadline, f"loaded {sorted(loaded)} at cursor {status.watch_cursor}"
                time.sleep(0.1)
            assert status.registry_connected
            # And they serve: the newest version answers "latest".
            reply = stub.Sample(sampler_pb2.SampleRequest(
                adapter={"name": "rs-b"}, prompt_tokens=[5, 6, 7]))
            assert reply.served_version == VERSIONS
        log = log_path.read_text()
        # Resumed after the persisted cursor: the versions before it were restored, not replayed as events.
        assert "restored sampler state" in log
    finally:
        stop_process(proc)


def test_versions_deleted_while_the_sampler_is_down_are_never_served_even_when_their_events_are_trimmed(
        registry, tmp_path):
    """The sampler persisted that it holds v1 (pinned, aliased) and v2 of an adapter; while it is down both are
    deleted (the alias removed first), v3 is published, and the registry's event stream is trimmed (retention), so the delete events are gone
    by the time it comes back. It must ask the registry rather than trust its persisted list."""
    port = free_port()
    log_path = tmp_path / "sampler.log"
    proc = start_sampler_process(registry, port, log_path)
    address = f"127.0.0.1:{port}"
    grpc = __import__("grpc")

    async def registry_calls(*calls):
        client = RegistryClient(registry.address)
        try:
            for call in calls:
                await call(client)
        finally:
            await client.close()

    def loaded(stub) -> set[tuple[str, int]]:
        return {(a.adapter, a.version) for a in stub.GetStatus(sampler_pb2.GetStatusRequest()).loaded}

    def wait_loaded(stub, expected: set[tuple[str, int]]) -> None:
        deadline = time.monotonic() + 60
        while (got := loaded(stub)) != expected:
            assert time.monotonic() < deadline, f"loaded {sorted(got)}, expected {sorted(expected)}"
            time.sleep(0.1)

    try:
        asyncio.run(registry_calls(
            lambda c: c.create_adapter("gone", base_model="tiny", lora_config=common_pb2.LoraConfig(rank=4)),
            lambda c: c.publish("gone", adapter_blob(1)),
            lambda c: c.publish("gone", adapter_blob(2)),
            lambda c: c.set_alias("gone", "stable", 1)))
        with grpc.insecure_channel(address) as channel:
            stub = sampler_pb2_grpc.SamplerServiceStub(channel)
            stub.LoadAdapter(sampler_pb2.LoadAdapterRequest(adapter={"name": "gone", "version": 1}))
            wait_loaded(stub, {("gone", 1), ("gone", 2)})
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

        asyncio.run(registry_calls(
            lambda c: c.delete_version("gone", 2),
            lambda c: c.set_alias("gone", "stable", 0),  # the registry refuses to delete an alias's target
            lambda c: c.delete_version("gone", 1),
            lambda c: c.publish("gone", adapter_blob(3))))
        events_key = f"{registry.settings.key_prefix}events"
        redis_client = redis.Redis.from_url(registry.settings.redis_url)
        redis_client.xtrim(events_key, maxlen=0, approximate=False)
        assert redis_client.xlen(events_key) == 0

        proc = start_sampler_process(registry, port, log_path)
        with grpc.insecure_channel(address) as channel:
            stub = sampler_pb2_grpc.SamplerServiceStub(channel)
            for ref in ({"name": "gone", "version": 1}, {"name": "gone", "version": 2},
                        {"name": "gone", "alias": "stable"}):
                try:
                    stub.Sample(sampler_pb2.SampleRequest(adapter=ref, prompt_tokens=[5, 6, 7]))
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, (ref, exc.details())
                else:
                    raise AssertionError(f"{ref} was served after its version was deleted")
            assert not {("gone", 1), ("gone", 2)} & loaded(stub)
            latest = stub.Sample(sampler_pb2.SampleRequest(adapter={"name": "gone"}, prompt_tokens=[5, 6, 7]))
            assert latest.served_version == 3
    finally:
        stop_process(proc)
