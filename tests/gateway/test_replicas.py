"""Gateway state lives in Redis: a second replica answers for the first, a restarted gateway carries on with the
same SDK clients, and a future whose gateway died is finished by the replica that polls it next."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import uuid

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from gateway_svc.futures import Futures
from gateway_svc.store import Store
from gateway_svc.wire import tinker_wire_pb2
from tests.fixtures.sampler import start_live_sampler
from tests.gateway.test_tinker_sdk import datum


def test_a_second_replica_and_a_restart_lose_nothing(cluster):
    service = tinker.ServiceClient(base_url=cluster.base_url)
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    seq = list(range(10, 31))
    training.forward_backward([datum(seq)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampling = training.save_weights_and_get_sampling_client().result()
    before = sampling.compute_logprobs(types.ModelInput.from_ints(seq)).result()

    # Replica B sees A's session, model, checkpoints and futures.
    replica = cluster.another_gateway()
    try:
        http = httpx.Client(base_url=replica.base_url + "/api/v1", timeout=30)
        # A sample on A's sampling session, submitted through B (a seq_id the SDK's own counter never reaches) ...
        accepted = http.post("/asample", json={
            "sampling_session_id": sampling._sampling_session_id, "seq_id": 10**15, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": seq}]}, "prompt_logprobs": True,
            "sampling_params": {"max_tokens": 1}, "type": "sample"})
        assert accepted.status_code == 200, accepted.text
        # ... and its result read through A.
        done = httpx.post(cluster.base_url + "/api/v1/retrieve_future",
                          json={"request_id": accepted.json()["request_id"]}, timeout=30)
        assert done.headers["content-type"] == "application/x-protobuf"
        reply = tinker_wire_pb2.SampleResponse.FromString(done.content)
        np.testing.assert_allclose(np.frombuffer(reply.prompt_logprobs, "<f4")[1:], before[1:], atol=1e-6)
        remote = tinker.RestClient(base_url=replica.base_url)
        assert remote.get_training_run(training.model_id).result().lora_rank == 4
    finally:
        replica.stop()

    # Restart the gateway on the same port: the same SDK clients carry on (the SDK resumes its seq_ids at 5).
    cluster.gateway.stop()
    cluster.gateway.start()
    after = sampling.compute_logprobs(types.ModelInput.from_ints(seq)).result()
    np.testing.assert_allclose(after[1:], before[1:], atol=1e-6)
    training_after = training.forward_backward([datum(seq)], "cross_entropy").result()
    assert np.isfinite(training_after.metrics["loss:sum"])
    assert training.optim_step(types.AdamParams(learning_rate=5e-2)).result().metrics["step:mean"] == 2.0
    service.close("success")


def test_a_sample_waits_out_a_sampler_restart(cluster):
    """The sampler is down when the sample is accepted; the gateway retries the unreachable sampler and the
    future completes once it is back (instead of failing the caller's sample)."""
    service = tinker.ServiceClient(base_url=cluster.base_url)
    sampling = service.create_sampling_client(base_model="tiny").result()
    port = int(cluster.sampler.address.rsplit(":", 1)[1])
    cluster.sampler.close()
    pending = sampling.sample(types.ModelInput.from_ints([10, 11, 12]), 1, types.SamplingParams(max_tokens=3, seed=5))
    # Still pending a second later (had the gateway given up, result() would raise RequestFailedError).
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(timeout=1.0)
    cluster.sampler = start_live_sampler(cluster.registry.settings, cluster.sampler.loop, cluster.registry.address,
                                         port=port)
    reply = pending.result(timeout=60)
    assert len(reply.sequences) == 1
    assert len(reply.sequences[0].tokens) == 3 or reply.sequences[0].stop_reason == "stop"
    service.close("success")


def test_a_future_whose_gateway_died_is_taken_over(valkey):
    async def scenario():
        store = Store(valkey.url, f"lpgw-test-{uuid.uuid4().hex[:8]}:")
        ran: list[dict] = []

        async def runner(spec):
            ran.append(spec)
            return "application/json", json.dumps({"echo": spec["x"]}).encode()

        # A dead replica accepted the request (the future is pending, nobody holds its lease) ...
        await store.create_future("r1", {"kind": "echo", "x": 7}, "dead-replica", 0.05)
        await asyncio.sleep(0.1)
        survivor = Futures(store, runner, long_poll_s=2.0, lease_s=1.0)
        # ... the next poll, on another replica, runs it from its stored spec.
        reply = await survivor.retrieve("r1")
        assert reply.state == "done" and json.loads(reply.body) == {"echo": 7}
        assert ran == [{"kind": "echo", "x": 7}]
        # Polling again reads the stored result; it does not run twice.
        assert (await survivor.retrieve("r1")).state == "done" and len(ran) == 1
        # A future held by a live owner is left alone: the poll waits and answers try-again.
        assert await store.create_future("r2", {"kind": "echo", "x": 8}, "someone-alive", 30)
        assert (await survivor.retrieve("r2", wait_s=0.2)).state == "pending" and len(ran) == 1
        assert await survivor.retrieve("missing", wait_s=0.1) is None
        await survivor.close()
        await store.close()

    asyncio.run(scenario())
