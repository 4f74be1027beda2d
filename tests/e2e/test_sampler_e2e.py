"""Sampler end to end: real registry (Valkey + SeaweedFS), real sampler server, torch engine, `tiny` model."""

from __future__ import annotations

import concurrent.futures
import math
import time

import grpc
import pytest
import torch

from loraplane.adapter_format import parse_adapter
from loraplane.lora import AdapterTensors, lora_routing
from loraplane.v1 import common_pb2, sampler_pb2
from tests.fixtures.sampler import adapter_blob, start_live_sampler, tiny_base

PROMPT = [17, 42, 99, 7, 120, 64]


def sample(stub, name="", *, version=0, prompt=PROMPT, max_tokens=12, temperature=None, seed=None, n=1,
           prompt_logprobs=False, **params):
    ref = common_pb2.AdapterRef(name=name)
    if version:
        ref.version = version
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, **params)
    if temperature is not None:
        sampling.temperature = temperature
    if seed is not None:
        sampling.seed = seed
    return stub.Sample(sampler_pb2.SampleRequest(adapter=ref, prompt_tokens=prompt, num_samples=n,
                                                 sampling_params=sampling,
                                                 include_prompt_logprobs=prompt_logprobs), timeout=60)


def reference_logits(tokens: list[int], blob: bytes | None) -> torch.Tensor:
    """The plain HF model forward over the whole sequence with the shared LoRA routing (what the trainer's
    Forward computes): logits [T, V]."""
    base = tiny_base()
    adapter = None
    if blob is not None:
        params, spec, _ = parse_adapter(blob)
        adapter = AdapterTensors.from_params(params, spec)
    with torch.no_grad(), lora_routing(base.model, [adapter]):
        return base.model(torch.tensor([tokens])).logits[0].float()


def test_greedy_equals_full_recompute_argmax_and_logprobs_equal_forward(sampler):
    blob = adapter_blob(11)
    sampler.create_adapter("cons")
    sampler.publish("cons", blob)
    sampler.wait_loaded({"cons@v1"})
    stub = sampler.stub()

    greedy = sample(stub, "cons", temperature=0.0, max_tokens=16).sequences[0]
    eos = set(tiny_base().eos_token_ids)
    tokens = list(PROMPT)
    expected: list[int] = []
    for _ in range(16):
        token = int(torch.argmax(reference_logits(tokens, blob)[-1]))
        expected.append(token)
        tokens.append(token)
        if token in eos:
            break
    assert list(greedy.tokens) == expected

    sampled = sample(stub, "cons", temperature=1.0, seed=5, max_tokens=16, prompt_logprobs=True)
    sequence = sampled.sequences[0]
    full = PROMPT + list(sequence.tokens)
    reference = torch.log_softmax(reference_logits(full, blob), dim=-1)
    expected_lp = [float(reference[i - 1, full[i]]) for i in range(len(PROMPT), len(full))]
    assert max(abs(a - b) for a, b in zip(sequence.logprobs, expected_lp)) <= 1e-4
    expected_prompt = [float(reference[i - 1, full[i]]) for i in range(1, len(PROMPT))]
    assert math.isnan(sampled.prompt_logprobs[0])
    assert max(abs(a - b) for a, b in zip(sampled.prompt_logprobs[1:], expected_prompt)) <= 1e-4

    scored = stub.ComputeLogprobs(sampler_pb2.ComputeLogprobsRequest(
        adapter=common_pb2.AdapterRef(name="cons", version=1), tokens=full))
    assert scored.served_version == 1
    assert max(abs(a - b) for a, b in zip(scored.logprobs[len(PROMPT):], sequence.logprobs)) <= 1e-4

    # The adapter really changes the model: the base model decodes differently.
    assert list(sample(stub, "", temperature=0.0, max_tokens=16).sequences[0].tokens) != expected


def test_mixed_batch_equals_each_request_alone(sampler):
    for index, name in enumerate(["mix-a", "mix-b", "mix-c"]):
        sampler.create_adapter(name)
        sampler.publish(name, adapter_blob(100 + index))
    sampler.wait_loaded({"mix-a@v1", "mix-b@v1", "mix-c@v1"})
    stub = sampler.stub()
    calls = [{"name": name, "seed": seed, "n": n, "prompt": PROMPT[: 3 + i], "max_tokens": 20, "temperature": 1.0}
             for i, (name, seed, n) in enumerate([("mix-a", 1, 2), ("mix-b", 2, 1), ("", 3, 2), ("mix-c", 4, 1),
                                                  ("mix-a", 5, 1)])]
    alone = [sample(stub, **call) for call in calls]
    steps_before = sampler.running.engine.decode_steps
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(lambda call: sample(stub, **call), calls))
    steps = sampler.running.engine.decode_steps - steps_before
    # Sharing decode steps proves the requests ran in one batch (alone they would need about 5 x 19 steps).
    assert steps < 19 * len(calls)
    for single, batched in zip(alone, together):
        assert len(single.sequences) == len(batched.sequences)
        for a, b in zip(single.sequences, batched.sequences):
            assert list(a.tokens) == list(b.tokens)
            assert list(a.logprobs) == list(b.logprobs)  # exact, not approximate
    # The four models differ from each other (the adapters are not no-ops).
    firsts = {tuple(r.sequences[0].tokens) for r in alone[:4]}
    assert len(firsts) == 4


def test_retention_keeps_held_version_until_released(registry, background_loop):
    live = start_live_sampler(registry.settings, background_loop, registry.address, keep_versions=2,
                              instance_id="retention")
    try:
        live.create_adapter("ret")
        live.publish("ret", adapter_blob(1))
        live.publish("ret", adapter_blob(2))
        live.wait_loaded({"ret@v1", "ret@v2"}, exact=True)
        lease = live.loop.run(live.manager.acquire("ret", 2))
        for seed in (3, 4, 5):
            live.publish("ret", adapter_blob(seed))
        # v2 is out of retention (v4, v5 are newest) but a request holds it.
        live.wait_loaded({"ret@v2", "ret@v4", "ret@v5"}, exact=True)
        listed = live.stub().ListLoadedAdapters(sampler_pb2.ListLoadedAdaptersRequest(adapter="ret"))
        assert {(a.version, a.active_requests) for a in listed.adapters} == {(2, 1), (4, 0), (5, 0)}
        stub = live.stub()
        assert sample(stub, "ret", version=2).served_version == 2
        live.loop.run(_release(lease))
        live.wait_loaded({"ret@v4", "ret@v5"}, exact=True)
        assert sample(stub, "ret").served_version == 5
    finally:
        live.close()


async def _release(lease):
    lease.release()


def test_on_demand_load_is_single_flight_under_20_concurrent_requests(sampler):
    sampler.create_adapter("old")
    blobs = [adapter_blob(200 + i) for i in range(4)]
    for blob in blobs:
        sampler.publish("old", blob)
    sampler.wait_loaded({"old@v3", "old@v4"}, exact=True)
    loads_before = sampler.manager.loads
    stub = sampler.stub()
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(lambda seed: sample(stub, "old", version=1, seed=seed, max_tokens=4), range(20)))
    assert {r.served_version for r in replies} == {1}
    assert sampler.manager.loads - loads_before == 1
    # Outside retention once released.
    sampler.wait_loaded({"old@v3", "old@v4"}, exact=True)
    # The on-demand version really is v1: its greedy output matches the v1 weights.
    expected = int(torch.argmax(reference_logits(PROMPT, blobs[0])[-1]))
    assert sample(stub, "old", version=1, temperature=0.0, max_tokens=1).sequences[0].tokens[0] == expected


def test_delete_events_unload_and_unknown_versions_are_not_found(sampler):
    sampler.create_adapter("gone")
    sampler.publish("gone", adapter_blob(1))
    sampler.publish("gone", adapter_blob(2))
    sampler.wait_loaded({"gone@v1", "gone@v2"})
    sampler.registry_call(lambda client: client.delete_version("gone", 2))
    sampler.wait_loaded({"gone@v1"}, exact=True)
    stub = sampler.stub()
    for version in (2, 9):
        with pytest.raises(grpc.RpcError) as info:
            sample(stub, "gone", version=version)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert sample(stub, "gone").served_version == 1
    sampler.registry_call(lambda client: client.delete_adapter("gone"))
    sampler.wait_loaded(set(), exact=True)
    with pytest.raises(grpc.RpcError) as info:
        sample(stub, "gone")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_registry_down_keeps_serving_and_catches_up(isolated_settings, background_loop):
    from loraplane.local.processes import free_port
    from tests.fixtures.registry import start_live_registry

    port = free_port()
    registry = start_live_registry(isolated_settings, background_loop, port=port)
    live = start_live_sampler(isolated_settings, background_loop, registry.address, instance_id="outage")
    try:
        live.create_adapter("up")
        live.publish("up", adapter_blob(1))
        live.wait_loaded({"up@v1"})
        stub = live.stub()
        before = sample(stub, "up", seed=9)
        registry.close(drop_data=False)  # an outage, not a wipe: Redis and S3 keep the registry's data
        deadline = time.monotonic() + 10
        while live.manager.registry_connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not live.manager.registry_connected
        during = sample(stub, "up", seed=9)
        assert during.served_version == 1 and list(during.sequences[0].tokens) == list(before.sequences[0].tokens)
        # A version the sampler has not loaded cannot be fetched now: UNAVAILABLE, not INTERNAL.
        with pytest.raises(grpc.RpcError) as info:
            sample(stub, "up", version=7)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        registry = start_live_registry(isolated_settings, background_loop, port=port)
        _publish_when_reachable(live, "up", adapter_blob(2))
        live.wait_loaded({"up@v1", "up@v2"}, timeout=30)
        assert live.manager.registry_connected
        assert sample(stub, "up").served_version == 2
    finally:
        live.close()
        registry.close()


def _publish_when_reachable(live, adapter: str, blob: bytes, timeout: float = 20.0):
    """gRPC clients back off after refused connections; a restarted server is reachable again within seconds."""
    from loraplane import errors

    deadline = time.monotonic() + timeout
    while True:
        try:
            return live.publish(adapter, blob)
        except errors.Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_redis_down_keeps_serving_and_persists_when_back(registry, background_loop, tmp_path):
    """The sampler's own Redis (a private Valkey, so killing it hurts no other test) dies: it keeps serving and
    applying registry events, and writes its newer cursor once Redis is back."""
    import json

    import redis

    from loraplane.local.processes import valkey_server

    private = valkey_server(tmp_path / "valkey")
    private.start()
    settings = registry.settings.model_copy(update={"redis_url": private.url})
    live = start_live_sampler(settings, background_loop, registry.address, instance_id="redis-outage")
    try:
        live.create_adapter("rd")
        live.publish("rd", adapter_blob(1))
        live.wait_loaded({"rd@v1"})
        private.kill()
        live.publish("rd", adapter_blob(2))
        live.wait_loaded({"rd@v1", "rd@v2"})
        stub = live.stub()
        assert sample(stub, "rd").served_version == 2
        deadline = time.monotonic() + 10
        while live.manager.redis_connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not live.manager.redis_connected
        private.start()
        key = f"{settings.key_prefix}sampler:redis-outage:state"
        deadline = time.monotonic() + 15
        while True:
            raw = redis.Redis.from_url(private.url).get(key)
            if raw and json.loads(raw)["cursor"] == live.manager.cursor:
                break
            assert time.monotonic() < deadline, "sampler state not persisted after Redis came back"
            time.sleep(0.1)
        assert json.loads(raw)["retained"] == {"rd": [1, 2]}
    finally:
        live.close()
        private.stop()


def test_lru_eviction_past_max_loaded_spares_pinned_versions(registry, background_loop):
    live = start_live_sampler(registry.settings, background_loop, registry.address, max_loaded=2,
                              instance_id="lru")
    try:
        stub = live.stub()
        for name in ("la", "lb"):
            live.create_adapter(name)
            live.publish(name, adapter_blob(len(name) + ord(name[1])))
        live.wait_loaded({"la@v1", "lb@v1"}, exact=True)
        assert sample(stub, "la").served_version == 1  # la is now more recently used than lb
        live.create_adapter("lc")
        live.publish("lc", adapter_blob(77))
        live.wait_loaded({"la@v1", "lc@v1"}, exact=True)  # lb was the least recently used
        stub.LoadAdapter(sampler_pb2.LoadAdapterRequest(adapter=common_pb2.AdapterRef(name="lc"), pin=True))
        assert sample(stub, "lb").served_version == 1  # loaded on demand, evicting la (lc is pinned)
        live.wait_loaded({"lb@v1", "lc@v1"}, exact=True)
        stub.LoadAdapter(sampler_pb2.LoadAdapterRequest(adapter=common_pb2.AdapterRef(name="lb"), pin=True))
        with pytest.raises(grpc.RpcError) as info:
            sample(stub, "la")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_loaded" in info.value.details()
    finally:
        live.close()
