"""Trainer and sampler with authentication on, on a registry with authentication on (all real servers): every RPC ×
{no key, revoked key, another tenant's key, own key, admin key}; denials change nothing and name no other tenant;
listings are filtered; the trainer publishes with its service key acting for the caller's tenant; quotas answer
RESOURCE_EXHAUSTED naming the quota."""

from __future__ import annotations

import threading
import uuid

import grpc
import pytest

from loraplane.v1 import (
    common_pb2,
    registry_pb2,
    registry_pb2_grpc,
    sampler_pb2,
    sampler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from tests.contract.auth_helpers import CALLERS, auth_settings, expect_code, issue_standard_keys
from tests.fixtures.registry import start_live_registry
from tests.fixtures.sampler import adapter_blob, start_live_sampler
from tests.fixtures.trainer import start_live_trainer

Trainer = trainer_pb2_grpc.TrainerServiceStub
Sampler = sampler_pb2_grpc.SamplerServiceStub
Registry = registry_pb2_grpc.AdapterRegistryServiceStub
DENIED = {"none": grpc.StatusCode.UNAUTHENTICATED, "revoked": grpc.StatusCode.UNAUTHENTICATED,
          "other": grpc.StatusCode.PERMISSION_DENIED}
LORA = common_pb2.LoraConfig(rank=4, alpha=8.0, seed=1)
ADAM = trainer_pb2.AdamParams(learning_rate=1e-2)


@pytest.fixture
def cluster(isolated_settings, background_loop):
    settings = auth_settings(isolated_settings)
    keys = issue_standard_keys(settings, background_loop)
    registry = start_live_registry(settings, background_loop)
    service_settings = auth_settings(settings, api_key=keys.tokens["service"])
    started = []
    try:
        yield registry, keys, service_settings, started
    finally:
        for live in reversed(started):
            live.close()
        keys.close()
        registry.close()


@pytest.fixture
def trainer(cluster, background_loop):
    registry, keys, settings, started = cluster
    live = start_live_trainer(settings, background_loop, registry.address, gap_timeout_s=5.0)
    started.append(live)
    return registry, keys, live


@pytest.fixture
def sampler(cluster, background_loop):
    registry, keys, settings, started = cluster
    live = start_live_sampler(settings, background_loop, registry.address)
    started.append(live)
    return registry, keys, live


def datum():
    tokens = list(range(10, 19))
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])


def create(stub, name):
    return stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=LORA))


# name -> (needs a fresh name, call(stub, adapter, next seq_id, source version))
TRAINER_RPCS = {
    "CreateAdapter": (True, lambda s, n, seq, v: create(s, n)),
    "ForwardBackward": (False, lambda s, n, seq, v: s.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
        adapter=n, seq_id=seq, data=[datum()], loss_fn="cross_entropy"))),
    "Forward": (False, lambda s, n, seq, v: s.Forward(trainer_pb2.ForwardRequest(
        adapter=n, seq_id=seq, data=[datum()], loss_fn="cross_entropy"))),
    "OptimStep": (False, lambda s, n, seq, v: s.OptimStep(trainer_pb2.OptimStepRequest(
        adapter=n, seq_id=seq, adam_params=ADAM))),
    "PublishWeights": (False, lambda s, n, seq, v: s.PublishWeights(trainer_pb2.PublishWeightsRequest(
        adapter=n, seq_id=seq, aliases=["prod"]))),
    "SaveState": (False, lambda s, n, seq, v: s.SaveState(trainer_pb2.SaveStateRequest(adapter=n, seq_id=seq))),
    "LoadState": (False, lambda s, n, seq, v: s.LoadState(trainer_pb2.LoadStateRequest(
        adapter=n, seq_id=seq, with_optimizer=True, source=common_pb2.AdapterRef(name=n, version=v)))),
    "DeleteAdapter": (False, lambda s, n, seq, v: s.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(
        name=n, delete_from_registry=True))),
}


def trainer_snapshot(admin: Trainer, registry_admin: Registry, name: str):
    rows = {a.name: (a.step, a.last_seq_id) for a in admin.ListAdapters(
        trainer_pb2.TrainerServiceListAdaptersRequest()).adapters}
    try:
        versions = [v.version for v in registry_admin.ListVersions(
            registry_pb2.ListVersionsRequest(adapter=name)).versions]
    except grpc.RpcError as exc:
        versions = exc.code()
    return rows.get(name), versions


def test_every_trainer_rpc_under_every_key(trainer):
    registry, keys, live = trainer
    admin = keys.stub(Trainer, live.address, "admin")
    registry_admin = keys.stub(Registry, registry.address, "admin")
    for rpc, (fresh, call) in TRAINER_RPCS.items():
        targets = {who: f"acme/{rpc.lower()}-{who}-{uuid.uuid4().hex[:4]}" for who in CALLERS}
        source_version = 0
        if not fresh:
            for name in targets.values():
                create(admin, name)
                saved = admin.SaveState(trainer_pb2.SaveStateRequest(adapter=name, seq_id=1)).version
                source_version = saved.version
        for who in ("none", "revoked", "other"):
            before = trainer_snapshot(admin, registry_admin, targets[who])
            stub = keys.stub(Trainer, live.address, who)
            error = expect_code(lambda c=call, s=stub, n=targets[who], v=source_version: c(s, n, 2, v), DENIED[who])
            assert "acme" not in error.details(), (rpc, error.details())
            assert trainer_snapshot(admin, registry_admin, targets[who]) == before, f"{rpc} by {who} changed state"
        for who in ("own", "admin"):
            call(keys.stub(Trainer, live.address, who), targets[who], 2, source_version)

    # What the own key's PublishWeights stored went through the trainer's service key, into acme's namespace.
    published = [a.name for a in keys.stub(Registry, registry.address, "own").ListAdapters(
        registry_pb2.ListAdaptersRequest()).adapters]
    assert any(name.startswith("acme/publishweights-own") for name in published)


def test_trainer_listing_info_and_foreign_sources(trainer):
    _registry, keys, live = trainer
    admin = keys.stub(Trainer, live.address, "admin")
    for name in ("acme/one", "acme/two", "globex/three"):
        create(admin, name)
    own = keys.stub(Trainer, live.address, "own")
    listed = [a.name for a in own.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters]
    assert listed == ["acme/one", "acme/two"]
    assert [a.name for a in keys.stub(Trainer, live.address, "other").ListAdapters(
        trainer_pb2.TrainerServiceListAdaptersRequest()).adapters] == ["globex/three"]
    assert len(admin.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters) == 3
    assert own.GetInfo(trainer_pb2.GetInfoRequest()).base_model
    for who in ("none", "revoked"):
        expect_code(lambda who=who: keys.stub(Trainer, live.address, who).GetInfo(trainer_pb2.GetInfoRequest()),
                    grpc.StatusCode.UNAUTHENTICATED)
    # Loading another tenant's state into one's own adapter is denied, and takes no seq_id.
    globex_state = admin.SaveState(trainer_pb2.SaveStateRequest(adapter="globex/three", seq_id=1)).version
    error = expect_code(lambda: own.LoadState(trainer_pb2.LoadStateRequest(
        adapter="acme/one", seq_id=1, source=common_pb2.AdapterRef(name="globex/three", version=globex_state.version))),
        grpc.StatusCode.PERMISSION_DENIED)
    assert "globex" not in error.details()
    own.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="acme/one", seq_id=1, data=[datum()],
                                                           loss_fn="cross_entropy"))


def test_trainer_quotas(trainer):
    registry, keys, live = trainer
    keys.set_quotas("acme", max_adapters=2, max_stored_bytes=1)
    own = keys.stub(Trainer, live.address, "own")
    create(own, "acme/q1")
    create(own, "acme/q2")
    error = expect_code(lambda: create(own, "acme/q3"), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "max_adapters" in error.details()
    # Another tenant is not held to acme's quota.
    create(keys.stub(Trainer, live.address, "other"), "globex/q3")
    error = expect_code(lambda: own.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="acme/q1", seq_id=1)),
                        grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "max_stored_bytes" in error.details()
    versions = keys.stub(Registry, registry.address, "admin").ListVersions(
        registry_pb2.ListVersionsRequest(adapter="acme/q1")).versions
    assert list(versions) == []


def test_trainer_queue_quota(trainer):
    _registry, keys, live = trainer
    keys.set_quotas("acme", max_queued_requests=1)
    own = keys.stub(Trainer, live.address, "own")
    create(own, "acme/queue")
    # seq_id 2 waits for the missing seq_id 1 (up to the gap timeout), holding acme's only queue slot.
    codes = []

    def wait_for_gap():
        try:
            own.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="acme/queue", seq_id=2, data=[datum()],
                                                                   loss_fn="cross_entropy"))
        except grpc.RpcError as exc:
            codes.append(exc.code())

    waiting = threading.Thread(target=wait_for_gap)
    waiting.start()
    import time

    deadline = time.monotonic() + 5
    while not live.service._queued._counts and time.monotonic() < deadline:
        time.sleep(0.02)
    error = expect_code(lambda: own.OptimStep(trainer_pb2.OptimStepRequest(
        adapter="acme/queue", seq_id=3, adam_params=ADAM)), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "max_queued_requests" in error.details()
    # Other tenants queue freely.
    other = keys.stub(Trainer, live.address, "other")
    create(other, "globex/queue")
    other.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="globex/queue", seq_id=1, data=[datum()],
                                                             loss_fn="cross_entropy"))
    waiting.join(30)
    assert codes == [grpc.StatusCode.FAILED_PRECONDITION]  # the gap timed out; the slot is free again
    assert not live.service._queued._counts


def sample_request(name):
    return sampler_pb2.SampleRequest(adapter=common_pb2.AdapterRef(name=name), prompt_tokens=[5, 6, 7],
                                     sampling_params=common_pb2.SamplingParams(max_tokens=2))


SAMPLER_RPCS = {
    "Sample": lambda s, n: s.Sample(sample_request(n), timeout=30),
    "SampleStream": lambda s, n: list(s.SampleStream(sampler_pb2.SampleStreamRequest(
        adapter=common_pb2.AdapterRef(name=n), prompt_tokens=[5, 6, 7],
        sampling_params=common_pb2.SamplingParams(max_tokens=2)), timeout=30)),
    "ComputeLogprobs": lambda s, n: s.ComputeLogprobs(sampler_pb2.ComputeLogprobsRequest(
        adapter=common_pb2.AdapterRef(name=n), tokens=[5, 6, 7]), timeout=30),
    "LoadAdapter": lambda s, n: s.LoadAdapter(sampler_pb2.LoadAdapterRequest(
        adapter=common_pb2.AdapterRef(name=n), pin=True), timeout=30),
    "UnloadAdapter": lambda s, n: s.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(adapter=n), timeout=30),
    "ListLoadedAdapters": lambda s, n: s.ListLoadedAdapters(sampler_pb2.ListLoadedAdaptersRequest(adapter=n)),
}


def publish(registry_admin: Registry, name: str, seed: int) -> None:
    import hashlib

    registry_admin.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0), base_model="tiny")))
    blob = adapter_blob(seed)
    registry_admin.PublishVersion(iter([
        registry_pb2.PublishVersionRequest(header=registry_pb2.PublishVersionHeader(
            adapter=name, sha256=hashlib.sha256(blob).hexdigest(), size_bytes=len(blob))),
        registry_pb2.PublishVersionRequest(chunk=blob)]))


def test_every_sampler_rpc_under_every_key(sampler):
    registry, keys, live = sampler
    registry_admin = keys.stub(Registry, registry.address, "admin")
    names = ["acme/s1", "globex/s1"]
    for seed, name in enumerate(names):
        publish(registry_admin, name, seed)
    live.wait_loaded({f"{n}@v1" for n in names})

    def loaded():
        return sorted((e.key, e.pinned) for e in live.manager.list_loaded())

    for rpc, call in SAMPLER_RPCS.items():
        for who in ("none", "revoked", "other"):
            before = loaded()
            stub = keys.stub(Sampler, live.address, who)
            error = expect_code(lambda c=call, s=stub: c(s, "acme/s1"), DENIED[who])
            assert "acme" not in error.details(), (rpc, error.details())
            assert loaded() == before, f"{rpc} by {who} changed state"
        for who in ("own", "admin"):
            call(keys.stub(Sampler, live.address, who), "acme/s1")

    own = keys.stub(Sampler, live.address, "own")
    assert {a.adapter for a in own.ListLoadedAdapters(sampler_pb2.ListLoadedAdaptersRequest()).adapters} == {"acme/s1"}
    assert {a.adapter for a in own.GetStatus(sampler_pb2.GetStatusRequest()).loaded} == {"acme/s1"}
    admin = keys.stub(Sampler, live.address, "admin")
    assert {a.adapter for a in admin.GetStatus(sampler_pb2.GetStatusRequest()).loaded} == set(names)
    # The base model is every tenant's; a key is still needed.
    assert own.Sample(sample_request(""), timeout=30).sequences
    expect_code(lambda: keys.stub(Sampler, live.address, "none").Sample(sample_request(""), timeout=30),
                grpc.StatusCode.UNAUTHENTICATED)
    expect_code(lambda: keys.stub(Sampler, live.address, "none").GetStatus(sampler_pb2.GetStatusRequest()),
                grpc.StatusCode.UNAUTHENTICATED)


def test_sampler_concurrency_quota(sampler):
    _registry, keys, live = sampler
    keys.set_quotas("acme", max_concurrent_samples=1)
    own = keys.stub(Sampler, live.address, "own")
    stream = own.SampleStream(sampler_pb2.SampleStreamRequest(
        prompt_tokens=[5, 6, 7], num_samples=1, sampling_params=common_pb2.SamplingParams(max_tokens=400)),
        timeout=60)
    next(stream)  # the stream is running: acme's one sample slot is taken
    error = expect_code(lambda: own.Sample(sample_request(""), timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "max_concurrent_samples" in error.details()
    assert keys.stub(Sampler, live.address, "other").Sample(sample_request(""), timeout=30).sequences
    stream.cancel()
    # The cancelled stream gives its slot back.
    import time

    deadline = time.monotonic() + 10
    while live.running.service._samples._counts:
        assert time.monotonic() < deadline, "the cancelled stream kept its sample slot"
        time.sleep(0.05)
    assert own.Sample(sample_request(""), timeout=30).sequences


def test_every_rpc_of_every_service_with_auth_on(cluster, background_loop):
    """The contract test that calls every RPC, with auth on: an empty request with no key is UNAUTHENTICATED on
    every method; with an admin key every method answers as in the open mode (never UNIMPLEMENTED/INTERNAL)."""
    from tests.contract.test_protos import _all_methods, _call

    registry, keys, settings, started = cluster
    trainer = start_live_trainer(settings, background_loop, registry.address, gap_timeout_s=5.0)
    started.append(trainer)
    sampler = start_live_sampler(settings, background_loop, registry.address)
    started.append(sampler)
    servers = {"registry": registry, "trainer": trainer, "sampler": sampler}
    from loraplane.rpc import sync_channel

    for fixture, method in _all_methods():
        address = servers[fixture].address
        with sync_channel(address, keys.security("none")) as channel:
            assert _call(channel, method, timeout=3.0) == grpc.StatusCode.UNAUTHENTICATED, method.full_name
        with sync_channel(address, keys.security("admin")) as channel:
            code = _call(channel, method, timeout=3.0)
        assert code not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), \
            f"{method.full_name} answered {code}"


def test_a_restarted_trainer_with_auth_recovers_and_the_tenant_goes_on(cluster, background_loop):
    """Identity is not journaled: a trainer restarted with auth on replays the tenant's journal (checkpoints via
    its service key) and the tenant continues with its next seq_id; other tenants still see nothing of it."""
    registry, keys, settings, started = cluster
    limits = {"gap_timeout_s": 5.0, "checkpoint_every_steps": 2}
    live = start_live_trainer(settings, background_loop, registry.address, **limits)
    own = keys.stub(Trainer, live.address, "own")
    create(own, "acme/durable")
    seq = 0
    for _ in range(3):
        for request in ("fb", "step"):
            seq += 1
            if request == "fb":
                own.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="acme/durable", seq_id=seq,
                                                                       data=[datum()], loss_fn="cross_entropy"))
            else:
                own.OptimStep(trainer_pb2.OptimStepRequest(adapter="acme/durable", seq_id=seq, adam_params=ADAM))
    # The automatic checkpoint (step 2) went to the registry with the trainer's service key.
    registry_admin = keys.stub(Registry, registry.address, "admin")
    import time

    deadline = time.monotonic() + 20
    while not registry_admin.ListVersions(registry_pb2.ListVersionsRequest(
            adapter="acme/durable", kind=common_pb2.VERSION_KIND_TRAINING_STATE)).versions:
        assert time.monotonic() < deadline, "no checkpoint reached the registry"
        time.sleep(0.1)
    live.close()

    live = start_live_trainer(settings, background_loop, registry.address, **limits)
    started.append(live)
    own = keys.stub(Trainer, live.address, "own")
    [info] = own.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters
    assert (info.name, info.step, info.last_seq_id) == ("acme/durable", 3, 6)
    own.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="acme/durable", seq_id=7, data=[datum()],
                                                           loss_fn="cross_entropy"))
    assert own.OptimStep(trainer_pb2.OptimStepRequest(adapter="acme/durable", seq_id=8, adam_params=ADAM)).step == 4
    other = keys.stub(Trainer, live.address, "other")
    assert list(other.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters) == []
    expect_code(lambda: other.OptimStep(trainer_pb2.OptimStepRequest(adapter="acme/durable", seq_id=9,
                                                                     adam_params=ADAM)),
                grpc.StatusCode.PERMISSION_DENIED)
