"""The gateway's own time on /metrics (per route and per future), and a local poll served by the future itself."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

import tinker

from gateway_svc.futures import Futures
from gateway_svc.store import Store
from tests.gateway.conftest import free_port


def test_the_gateway_serves_its_route_and_future_times_on_its_metrics_port(cluster):
    port = free_port()
    gateway = cluster.another_gateway(metrics_port=port)
    try:
        service = tinker.ServiceClient(base_url=gateway.base_url)
        training = service.create_lora_training_client(base_model="tiny", rank=2, seed=1).result()
        assert training.get_info().model_data.model_name == "tiny"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        lines = [line for line in text.splitlines() if line.startswith("loraplane_rpc_seconds_count{")]
        assert any('method="/api/v1/create_model"' in line and 'service="gateway"' in line for line in lines)
        assert any('method="future:create_model"' in line and 'service="gateway"' in line for line in lines)
    finally:
        gateway.stop()


class CountingStore(Store):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = 0

    async def get_future(self, request_id):
        record = await super().get_future(request_id)
        self.reads += 1  # counted once answered: the caller then runs on until it next waits
        return record


def test_a_poll_on_the_running_replica_takes_the_reply_without_reading_redis_back(valkey):
    async def scenario():
        store = CountingStore(valkey.url, f"lpgw-test-{uuid.uuid4().hex[:8]}:")
        release = asyncio.Event()

        async def runner(spec):
            await release.wait()
            return "application/json", json.dumps({"echo": spec["x"]}).encode()

        futures = Futures(store, runner, long_poll_s=10.0, lease_s=5.0)
        await futures.submit("r1", {"kind": "echo", "x": 3})
        poll = asyncio.create_task(futures.retrieve("r1"))
        while store.reads < 1:  # the poll has read "pending" and waits for the run
            await asyncio.sleep(0.01)
        release.set()
        reply = await poll
        assert reply.state == "done" and json.loads(reply.body) == {"echo": 3}
        assert store.reads == 1  # the poll's first look; the result came from the run, not a second read
        # The stored copy is what another replica (or a later poll) reads.
        assert json.loads((await futures.retrieve("r1")).body) == {"echo": 3}
        await futures.close()
        await store.close()

    asyncio.run(scenario())
