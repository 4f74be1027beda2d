"""The in-memory handoff on CPU (issue 34 item 1): a real trainer and two real samplers of one sampler fleet on one
real registry (Valkey + SeaweedFS), all on loopback. A published version reaches the samplers from the trainer
(shared memory, since they share this host) and is served exactly, without a registry download; a sampler that joins
later catches up from the registry; a push cut off midway stages nothing and serves nothing; pushed bytes the
registry did not commit as the version are never served; a tenant's key cannot push."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from loraplane.membership import Membership
from loraplane.v1 import (
    common_pb2,
    registry_pb2,
    registry_pb2_grpc,
    sampler_pb2,
    sampler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from tests.contract.auth_helpers import auth_settings, expect_code, issue_standard_keys
from tests.fixtures.registry import start_live_registry
from tests.fixtures.sampler import adapter_blob, start_live_sampler
from tests.fixtures.trainer import start_live_trainer

PROMPT = [17, 42, 99, 7, 120, 64]
FLEET = "samplers"
IDS = ("sampler-a", "sampler-b")


def fleet_settings(settings):
    return settings.model_copy(update={"sampler_fleet": FLEET, "sampler_heartbeat_ttl_s": 1.0})


def start_fleet(settings, loop, registry_address):
    samplers = {i: start_live_sampler(settings, loop, registry_address, instance_id=i, fleet=FLEET) for i in IDS}
    # Each replica preloads (so is pushed to) by its view of the fleet: wait until both see both.
    deadline = time.monotonic() + 10
    for live in samplers.values():
        while len(live.running.fleet.replicas()) < len(IDS):
            assert time.monotonic() < deadline, "the replicas never saw each other"
            time.sleep(0.05)
    return samplers


@contextlib.contextmanager
def running_deployment(settings, loop, registry_address):
    """A trainer and the sampler fleet it pushes to: (trainer, samplers by id, every server started, to close)."""
    started = []
    try:
        samplers = start_fleet(settings, loop, registry_address)
        started.extend(samplers.values())
        trainer = start_live_trainer(settings, loop, registry_address, gap_timeout_s=5.0)
        started.append(trainer)
        yield trainer, samplers, started
    finally:
        for live in reversed(started):
            live.close()


@pytest.fixture
def deployment(registry, background_loop):
    with running_deployment(fleet_settings(registry.settings), background_loop, registry.address) as running:
        yield running


def loads_metric(path: str) -> float:
    return REGISTRY.get_sample_value("loraplane_sampler_version_loads_total", {"path": path}) or 0.0


def train_and_publish(stub, name: str, *, seq: int = 0, create: bool = True) -> int:
    if create:
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=3), base_model="tiny"))
    # A real step, so the version differs from the base model (B is no longer zero).
    datum = trainer_pb2.Datum(input_tokens=[5, 6, 7, 8, 9], target_tokens=[6, 7, 8, 9, 10])
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter=name, seq_id=seq + 1, data=[datum],
                                                            loss_fn="cross_entropy"))
    stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, seq_id=seq + 2, adam_params=trainer_pb2.AdamParams(
        learning_rate=0.05, beta1=0.9, beta2=0.999, eps=1e-8)))
    return stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter=name, seq_id=seq + 3)).version.version


def entry(live, key: str):
    return next(e for e in live.manager.list_loaded() if e.key == key)


def sample(live, name: str, version: int) -> sampler_pb2.SampleResponse:
    return live.stub().Sample(sampler_pb2.SampleRequest(
        adapter=common_pb2.AdapterRef(name=name, version=version), prompt_tokens=PROMPT,
        sampling_params=common_pb2.SamplingParams(max_tokens=8, temperature=1.0, seed=21)), timeout=60)


def registry_sha(live, name: str, version: int) -> str:
    return live.registry_call(lambda c: c.get_version(name, version)).sha256


def staged_nothing(live) -> bool:
    staging = live.manager.staging
    return staging.held_bytes == 0 and not staging.keys()


def push_requests(name: str, blob: bytes, sha256: str | None = None, chunk: int = 1 << 20):
    yield sampler_pb2.PushVersionRequest(header=sampler_pb2.PushVersionHeader(
        adapter=name, sha256=sha256 or hashlib.sha256(blob).hexdigest(), size_bytes=len(blob)))
    for start in range(0, len(blob), chunk):
        yield sampler_pb2.PushVersionRequest(chunk=blob[start:start + chunk])


def test_a_published_version_reaches_both_samplers_by_push_and_is_served_exactly(deployment):
    trainer, samplers, _ = deployment
    stub = trainer.stub()
    pushed_before, downloaded_before = loads_metric("push"), loads_metric("registry")
    version = train_and_publish(stub, "ho")
    sha = registry_sha(trainer, "ho", version)
    for live in samplers.values():
        live.wait_loaded({f"ho@v{version}"})
        loaded = entry(live, f"ho@v{version}")
        assert (loaded.path, loaded.sha256) == ("push", sha)
        assert live.manager.loads_by_path == {"push": 1, "registry": 0}  # no registry download
        assert staged_nothing(live)
    assert trainer.service.handoff.pushes["shared_memory"] == 2
    assert loads_metric("push") - pushed_before == 2
    assert loads_metric("registry") == downloaded_before

    # Exactly that version: its logprobs are the trainer's Forward logprobs for the same weights.
    reply = sample(samplers[IDS[0]], "ho", version)
    assert reply.served_version == version
    full = PROMPT + list(reply.sequences[0].tokens)
    forward = stub.Forward(trainer_pb2.ForwardRequest(
        adapter="ho", seq_id=4, loss_fn="cross_entropy",
        data=[trainer_pb2.Datum(input_tokens=full[:-1], target_tokens=full[1:])])).outputs[0]
    trainer_logprobs = list(forward.logprobs)[len(PROMPT) - 1:]
    assert max(abs(a - b) for a, b in zip(reply.sequences[0].logprobs, trainer_logprobs)) <= 1e-4
    assert sample(samplers[IDS[1]], "ho", version).sequences[0].logprobs == reply.sequences[0].logprobs

    # A sampler that starts later (it missed the push) catches up from the registry: the same version, exactly.
    late = start_live_sampler(trainer.settings.model_copy(update={"sampler_fleet": ""}), trainer.loop,
                              trainer.registry_address, instance_id="sampler-late")
    deployment[2].append(late)
    late.wait_loaded({f"ho@v{version}"})
    assert (entry(late, f"ho@v{version}").path, entry(late, f"ho@v{version}").sha256) == ("registry", sha)
    assert late.manager.loads_by_path == {"push": 0, "registry": 1}
    assert sample(late, "ho", version).sequences[0].logprobs == reply.sequences[0].logprobs


def test_a_push_cut_off_midway_stages_nothing_and_the_next_publish_is_pushed(deployment):
    trainer, samplers, _ = deployment
    live = samplers[IDS[0]]
    stub = trainer.stub()
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name="cut", lora_config=common_pb2.LoraConfig(rank=4, alpha=8), base_model="tiny"))
    blob = adapter_blob(7)
    hold = threading.Event()

    def stalled():
        requests = push_requests("cut", blob, chunk=len(blob) // 3 + 1)
        yield next(requests)  # the header
        yield next(requests)  # a third of the bytes
        hold.wait(30)  # the pusher dies here

    channel = grpc.insecure_channel(live.address)
    call = sampler_pb2_grpc.SamplerServiceStub(channel).PushVersion.future(stalled())
    deadline = time.monotonic() + 10
    while not live.manager.staging.has("cut", hashlib.sha256(blob).hexdigest()):
        assert time.monotonic() < deadline, "the push never arrived"
        time.sleep(0.02)
    channel.close()  # the fault: the connection goes away mid-stream
    hold.set()
    with pytest.raises(grpc.RpcError) as cut:
        call.result()
    assert cut.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 10
    while not staged_nothing(live) or live.manager.staging.holds("cut"):
        assert time.monotonic() < deadline, "the cut-off push left bytes staged"
        time.sleep(0.02)
    assert not [e for e in live.manager.list_loaded() if e.adapter == "cut"]

    version = train_and_publish(stub, "cut", create=False)
    for replica in samplers.values():
        replica.wait_loaded({f"cut@v{version}"})
        assert entry(replica, f"cut@v{version}").path == "push"
        assert staged_nothing(replica)

    # A sampler that dies (still listed: its heartbeat has not expired) fails its push, never the publish; the
    # other gets the bytes as a stream when shared memory is off (samplers on other hosts).
    crash(samplers[IDS[1]], deployment[2])
    handoff = trainer.service.handoff
    handoff.shared_memory = False
    before = dict(handoff.pushes)
    version = train_and_publish(stub, "cut", seq=3, create=False)
    live.wait_loaded({f"cut@v{version}"})
    assert entry(live, f"cut@v{version}").path == "push"
    assert (handoff.pushes["stream"] - before["stream"], handoff.pushes["failed"] - before["failed"]) == (1, 1)
    assert registry_sha(live, "cut", version) == entry(live, f"cut@v{version}").sha256


def crash(live, started) -> None:
    """The sampler's server goes away without leaving the fleet (its heartbeat just stops), as a killed one's does."""
    running = live.running

    async def down():
        running.fleet._task.cancel()
        await running.server.stop(grace=0)
        await running.manager.stop()
        await running.engine.stop()
        await running.registry.close()
    live.loop.run(down(), timeout=60)
    started.remove(live)
    # Listed as alive for a while yet, however long the next steps take on a busy machine (a heartbeat's TTL).
    membership = Membership(live.settings.redis_url, key_prefix=live.settings.key_prefix, fleet=FLEET)
    membership.heartbeat(running.service.replica_id, running.fleet.report(), 60.0)
    membership.close()


def test_pushed_bytes_the_registry_did_not_commit_are_never_served(registry, background_loop):
    live = start_live_sampler(registry.settings, background_loop, registry.address)
    try:
        live.create_adapter("mix")
        stub = live.stub()
        pushed, committed = adapter_blob(1), adapter_blob(2)
        # Bytes that do not hash to the header's digest are refused and stage nothing.
        error = expect_code(lambda: stub.PushVersion(push_requests("mix", pushed, hashlib.sha256(committed)
                                                                   .hexdigest())), grpc.StatusCode.DATA_LOSS)
        assert "header.sha256" in error.details()
        assert staged_nothing(live)
        # Malformed pushes are the caller's error, naming the field, and stage nothing either.
        header = next(push_requests("mix", pushed))
        segment = "lp_handoff_" + "0" * 32  # the right shape, but no such segment on this host
        for requests, code, field in [
            ([sampler_pb2.PushVersionRequest(chunk=pushed)], grpc.StatusCode.INVALID_ARGUMENT, "header"),
            ([sampler_pb2.PushVersionRequest(header=sampler_pb2.PushVersionHeader(
                adapter="mix", sha256="abc", size_bytes=len(pushed)))], grpc.StatusCode.INVALID_ARGUMENT,
             "header.sha256"),
            ([header, sampler_pb2.PushVersionRequest(chunk=pushed + b"x")], grpc.StatusCode.INVALID_ARGUMENT,
             "chunk"),
            ([sampler_pb2.PushVersionRequest(header=sampler_pb2.PushVersionHeader(
                adapter="mix", sha256=header.header.sha256, size_bytes=len(pushed), shared_memory_name="/etc/x"))],
             grpc.StatusCode.INVALID_ARGUMENT, "header.shared_memory_name"),
            ([sampler_pb2.PushVersionRequest(header=sampler_pb2.PushVersionHeader(
                adapter="mix", sha256=header.header.sha256, size_bytes=len(pushed), shared_memory_name=segment))],
             grpc.StatusCode.FAILED_PRECONDITION, "header.shared_memory_name"),
        ]:
            error = expect_code(lambda r=requests: stub.PushVersion(iter(r)), code)
            assert field in error.details(), (field, error.details())
            assert staged_nothing(live) and not live.manager.staging.holds("mix")
        assert stub.PushVersion(push_requests("mix", pushed)).staged
        assert live.manager.staging.keys() == [("mix", hashlib.sha256(pushed).hexdigest())]

        # The registry commits other bytes as v1: the sampler downloads them; the pushed ones are never served.
        version = live.publish("mix", committed).version
        live.wait_loaded({f"mix@v{version}"})
        loaded = entry(live, f"mix@v{version}")
        assert (loaded.path, loaded.sha256) == ("registry", hashlib.sha256(committed).hexdigest())
        # Unclaimed bytes go once their time is up.
        ttl = live.manager.staging.ttl_s
        live.manager.staging.ttl_s = 0.0
        live.loop.run(_sweep(live.manager.staging), timeout=10)
        assert staged_nothing(live) and live.manager.staging.dropped == 1
        live.manager.staging.ttl_s = ttl  # else the next push could be swept before its load claims it

        # An on-demand load (this sampler does not preload the adapter) uses pushed bytes only once the registry's
        # GetVersion says the requested version has them.
        live.manager.preloads = lambda adapter: adapter != "lazy"
        live.create_adapter("lazy")
        blob = adapter_blob(3)
        assert stub.PushVersion(push_requests("lazy", blob)).staged
        version = live.publish("lazy", blob).version
        assert sample(live, "lazy", version).served_version == version
        assert entry(live, f"lazy@v{version}").path == "push"
        assert staged_nothing(live)
    finally:
        live.close()


async def _sweep(staging) -> None:
    staging.sweep()


def test_only_service_keys_push_and_only_into_their_tenant(isolated_settings, background_loop):
    settings = auth_settings(fleet_settings(isolated_settings))
    keys = issue_standard_keys(settings, background_loop)
    registry = start_live_registry(settings, background_loop)
    service_settings = auth_settings(settings, api_key=keys.tokens["service"])
    started = []
    try:
        live = start_live_sampler(service_settings, background_loop, registry.address, instance_id=IDS[0],
                                  fleet=FLEET)
        started.append(live)
        admin = keys.stub(registry_pb2_grpc.AdapterRegistryServiceStub, registry.address, "admin")
        admin.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
            name="acme/p", lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0), base_model="tiny")))
        blob = adapter_blob(4)
        for who in ("own", "other"):  # tenant keys, its own adapter or not
            error = expect_code(lambda w=who: keys.stub(sampler_pb2_grpc.SamplerServiceStub, live.address, w)
                                .PushVersion(push_requests("acme/p", blob)), grpc.StatusCode.PERMISSION_DENIED)
            assert "service key" in error.details()
        service = keys.stub(sampler_pb2_grpc.SamplerServiceStub, live.address, "service")
        # A service acting for another tenant cannot push into this one.
        expect_code(lambda: service.PushVersion(push_requests("acme/p", blob),
                                                metadata=[("x-loraplane-acting-for", "globex")]),
                    grpc.StatusCode.PERMISSION_DENIED)
        assert staged_nothing(live)

        # The trainer pushes with its service key, acting for the tenant whose publish it serves.
        trainer = start_live_trainer(service_settings, background_loop, registry.address, gap_timeout_s=5.0)
        started.append(trainer)
        own = keys.stub(trainer_pb2_grpc.TrainerServiceStub, trainer.address, "own")
        version = train_and_publish(own, "acme/t")
        live.wait_loaded({f"acme/t@v{version}"})
        assert entry(live, f"acme/t@v{version}").path == "push"
    finally:
        for server in reversed(started):
            server.close()
        keys.close()
        registry.close()
