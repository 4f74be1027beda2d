"""A trainer fleet on CPU: three trainers serve one base model, each adapter on one of them (trainer_svc/fleet.py).

Placement spreads adapters evenly; a drained trainer's adapters move with nothing lost; a SIGKILLed trainer's
adapters continue on the others with the same losses and the same published blobs (sha256) as an uninterrupted run
of the same requests on a lone trainer (its own registry, same names); a trainer that lost an adapter is refused by
the fence. Clients route as loraplane's do: ResolveAdapter on any trainer, and on UNAVAILABLE (ADAPTER_MOVED, or a
trainer gone) resolve again and retry the same seq_id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import pytest
import torch

from loraplane.client.errors import error_from_rpc
from loraplane.errors import Unavailable
from loraplane.fleet import MOVED_REASON
from loraplane.rpc import channel_options
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.fixtures.registry import start_live_registry
from tests.fixtures.trainer import start_live_trainer
from trainer_svc.fleet_store import FleetStore
from trainer_svc.journal import TrainingJournal

ROOT = Path(__file__).resolve().parents[2]
ADAM = trainer_pb2.AdamParams(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
TTL_S = 1.5
LIMITS = {"gap_timeout_s": 10.0, "checkpoint_every_steps": 3}


def datum(seed: int, n: int = 12) -> trainer_pb2.Datum:
    tokens = torch.randint(5, 261, (n + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])


def member_settings(settings, member: str, fleet: str = "fleet", ttl_s: float = TTL_S):
    return settings.model_copy(update={"trainer_fleet": fleet, "trainer_id": member,
                                       "trainer_heartbeat_ttl_s": ttl_s})


def second_registry(registry, background_loop):
    """A registry of its own (prefix and bucket) for the lone reference trainer, so its adapters can carry the
    same names as the fleet's and their blobs compare byte for byte."""
    suffix = uuid.uuid4().hex[:8]
    settings = registry.settings.model_copy(update={"key_prefix": f"lpref:{suffix}:",
                                                    "s3_bucket": f"lp-ref-{suffix}"})
    return start_live_registry(settings, background_loop)


class Router:
    """Routes each adapter's calls to its trainer the way loraplane's clients do."""

    def __init__(self, seeds: list[str]):
        self.seeds = list(seeds)
        self.where: dict[str, str] = {}
        self.channels: dict[str, grpc.Channel] = {}
        self.moved_answers = 0

    def stub(self, address: str) -> trainer_pb2_grpc.TrainerServiceStub:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address, options=channel_options())
        return trainer_pb2_grpc.TrainerServiceStub(self.channels[address])

    def resolve(self, name: str) -> str | None:
        for seed in list(self.seeds):
            try:
                reply = self.stub(seed).ResolveAdapter(trainer_pb2.ResolveAdapterRequest(name=name), timeout=5)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                continue
            self.seeds = list(dict.fromkeys([*reply.trainer_addresses, *self.seeds]))
            self.where[name] = reply.address
            return reply.address
        return None

    def call(self, name: str, method: str, request, within_s: float = 60.0):
        deadline = time.monotonic() + within_s
        while True:
            address = self.where.get(name) or self.resolve(name) or self.seeds[0]
            try:
                return getattr(self.stub(address), method)(request, timeout=30)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                self.moved_answers += error_from_rpc(exc).reason == MOVED_REASON
                self.where.pop(name, None)
                time.sleep(0.1)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


class Script:
    """One adapter's training, sent the same way to the fleet (through a Router) and to the reference."""

    def __init__(self, send, name: str, seed: int):
        self.send, self.name, self.seed, self.seq = send, name, seed, 0
        self.losses: list[float] = []

    def create(self):
        return self.send(self.name, "CreateAdapter", trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=self.name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=self.seed)))

    def forward_backward(self, step: int):
        self.seq += 1
        request = trainer_pb2.ForwardBackwardRequest(adapter=self.name, seq_id=self.seq, loss_fn="cross_entropy",
                                                     data=[datum(1000 * self.seed + step)])
        reply = self.send(self.name, "ForwardBackward", request)
        self.losses.append(reply.metrics["loss:sum"])
        return request, reply

    def optim_step(self):
        self.seq += 1
        return self.send(self.name, "OptimStep", trainer_pb2.OptimStepRequest(adapter=self.name, seq_id=self.seq,
                                                                             adam_params=ADAM))

    def train(self, steps: range):
        for step in steps:
            self.forward_backward(step)
            self.optim_step()

    def publish(self) -> str:
        self.seq += 1
        reply = self.send(self.name, "PublishWeights", trainer_pb2.PublishWeightsRequest(adapter=self.name,
                                                                                        seq_id=self.seq))
        return reply.version.sha256


def lone(stub):
    return lambda _name, method, request: getattr(stub, method)(request, timeout=30)


def names_on(live) -> set[str]:
    """The adapters this member serves itself (its plain ListAdapters lists the whole fleet)."""
    return {a.name for a in live.stub().ListAdapters(
        trainer_pb2.TrainerServiceListAdaptersRequest(this_trainer_only=True)).adapters}


def wait_for(predicate, within_s: float, what: str):
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def moved_reason(call) -> str | None:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    return error_from_rpc(refused.value).reason


def test_placement_spreads_twelve_adapters_and_a_drain_moves_them_with_nothing_lost(registry, background_loop):
    settings = registry.settings
    trainers = {m: start_live_trainer(member_settings(settings, m), background_loop, registry.address, **LIMITS)
                for m in ("t0", "t1", "t2")}
    reference_registry = second_registry(registry, background_loop)
    reference = start_live_trainer(reference_registry.settings, background_loop, reference_registry.address,
                                   **LIMITS)
    router = Router([trainers["t0"].address])  # one seed: the rest is learnt from the fleet
    store = FleetStore(settings.redis_url, key_prefix=settings.key_prefix, fleet="fleet")
    try:
        scripts = [Script(router.call, f"ten/a{i:02d}", seed=i) for i in range(12)]
        for script in scripts:
            script.create()
        held = {m: names_on(live) for m, live in trainers.items()}
        assert [len(held[m]) for m in ("t0", "t1", "t2")] == [4, 4, 4]
        assert set().union(*held.values()) == {s.name for s in scripts}
        assert router.moved_answers >= 8  # creations sent to t0 that the policy placed elsewhere
        assert {m.trainer_id: m.placed for m in store.members()} == {"t0": 4, "t1": 4, "t2": 4}

        drained = [s for s in scripts if s.name in held["t1"]]
        references = [Script(lone(reference.stub()), s.name, s.seed) for s in drained]
        for script in references:
            script.create()
        for script in drained + references:
            script.train(range(2))
        before_drain = {s.name: s.seq for s in drained}

        store.set_draining("t1")
        wait_for(lambda: not names_on(trainers["t1"]), 20, "t1 to hand its adapters over")
        survivors = {trainers["t0"].address: trainers["t0"], trainers["t2"].address: trainers["t2"]}
        wait_for(lambda: all(s.name in names_on(survivors[router.resolve(s.name)]) for s in drained), 20,
                 "the drained adapters to be served elsewhere")
        # t1 is fenced off them: a request sent to it is told to look elsewhere, and consumes nothing.
        victim = drained[0]
        assert moved_reason(lambda: trainers["t1"].stub().OptimStep(trainer_pb2.OptimStepRequest(
            adapter=victim.name, seq_id=victim.seq + 1, adam_params=ADAM))) == MOVED_REASON
        # The new owners restored everything t1 acknowledged: last_seq_id, then the same training.
        for script in drained:
            owner = survivors[router.where[script.name]]
            info = next(a for a in owner.stub().ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest())
                        .adapters if a.name == script.name)
            assert (info.last_seq_id, info.step) == (before_drain[script.name], 2)
        for script in drained + references:
            script.train(range(2, 4))
        assert [s.publish() for s in drained] == [r.publish() for r in references]
        assert [s.losses for s in drained] == [r.losses for r in references]

        loads = {m.trainer_id: m.placed for m in store.members()}
        assert loads == {"t0": 6, "t1": 0, "t2": 6}
        # A draining trainer gets no new adapter, even one created through it.
        late = Script(lambda _n, method, request: Router([trainers["t1"].address]).call(_n, method, request),
                      "ten/late", seed=99)
        late.create()
        assert store.placement("ten/late").trainer in ("t0", "t2")
    finally:
        store.close()
        router.close()
        for live in (*trainers.values(), reference, reference_registry):
            live.close()


def test_a_sigkilled_trainers_adapters_continue_elsewhere_bit_for_bit_and_retries_ride_across(
        registry, background_loop, tmp_path):
    settings = registry.settings
    in_process = {m: start_live_trainer(member_settings(settings, m), background_loop, registry.address, **LIMITS)
                  for m in ("t0", "t1")}
    env = dict(os.environ, PYTHONPATH=str(ROOT), LORAPLANE_REGISTRY_ADDRESS=registry.address,
               LORAPLANE_REDIS_URL=settings.redis_url, LORAPLANE_KEY_PREFIX=settings.key_prefix,
               LORAPLANE_TRAINER_FLEET="fleet", LORAPLANE_TRAINER_ID="t2",
               LORAPLANE_TRAINER_HEARTBEAT_TTL_S=str(TTL_S), LORAPLANE_CHECKPOINT_EVERY_STEPS="3",
               LORAPLANE_BASE_MODEL="tiny")
    with open(tmp_path / "t2.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainer_svc", "--gap-timeout-s", "10"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    reference_registry = second_registry(registry, background_loop)
    reference = start_live_trainer(reference_registry.settings, background_loop, reference_registry.address,
                                   **LIMITS)
    router = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("TRAINER_READY "), (line, (tmp_path / "t2.log").read_text()[-3000:])
        t2_address = line.split()[1]
        router = Router([in_process["t0"].address])
        scripts = [Script(router.call, f"ten/k{i}", seed=i) for i in range(6)]
        for script in scripts:
            script.create()
        router.resolve(scripts[0].name)
        doomed = [s for s in scripts if router.resolve(s.name) == t2_address]
        assert len(doomed) == 2  # six adapters over three trainers
        references = [Script(lone(reference.stub()), s.name, s.seed) for s in doomed]
        for script in references:
            script.create()
        for script in doomed + references:
            script.train(range(4))  # a checkpoint at step 3, then the journal
        # Acknowledged, then the trainer dies before the client saw... anything more.
        last_requests = [script.forward_backward(4) for script in doomed]
        for script in references:
            script.forward_backward(4)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        started = time.monotonic()
        # The client retries the same seq_id: once the heartbeat expires another trainer adopts the adapter and
        # answers from the journal (the gradient is not accumulated twice: the losses below would differ).
        for script, (request, reply) in zip(doomed, last_requests):
            again = router.call(script.name, "ForwardBackward", request)
            assert list(again.outputs[0].logprobs) == list(reply.outputs[0].logprobs)
        failover_s = time.monotonic() - started
        assert {router.where[s.name] for s in doomed} <= {live.address for live in in_process.values()}
        for script in doomed + references:
            script.optim_step()
            script.train(range(5, 7))
        assert [s.publish() for s in doomed] == [r.publish() for r in references]
        assert [s.losses for s in doomed] == [r.losses for r in references]
        assert failover_s < 15, failover_s
        # The survivors hold all six now.
        assert set().union(*(names_on(live) for live in in_process.values())) == {s.name for s in scripts}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if router is not None:
            router.close()
        for live in (*in_process.values(), reference, reference_registry):
            live.close()


def test_a_trainer_that_lost_its_adapter_is_fenced_off_it(registry, background_loop):
    """The placement moves to t1 while the old owner t0 still holds the adapter in memory (what a member does when
    it presumed the owner dead): t0's requests, journal writes and checkpoints are refused, before and after it
    notices, and the journal keeps only what the owner of the moment wrote."""
    settings = registry.settings
    t0 = start_live_trainer(member_settings(settings, "t0"), background_loop, registry.address, **LIMITS)
    t1 = start_live_trainer(member_settings(settings, "t1"), background_loop, registry.address, **LIMITS)
    store = FleetStore(settings.redis_url, key_prefix=settings.key_prefix, fleet="fleet")
    try:
        stub = t0.stub()
        for name, seed in (("ten/x", 1), ("ten/y", 2)):
            Router([t0.address]).call(name, "CreateAdapter", trainer_pb2.TrainerServiceCreateAdapterRequest(
                name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=seed)))
        for name in ("ten/x", "ten/y"):  # both on t0, wherever the policy placed them
            if (placed := store.placement(name)).trainer != "t0":
                store.move(placed, "t0")
        wait_for(lambda: {"ten/x", "ten/y"} <= names_on(t0), 10, "t0 to serve both")
        runner = Script(lone(stub), "ten/x", 1)
        runner.train(range(1))
        seen = store.placement("ten/x")
        assert seen.trainer == "t0"
        journal = t0.service.journal
        length = journal.length("ten/x")

        # The journal itself refuses a write fenced by a newer placement, in the same step as the check.
        taken = store.move(seen, "t1")
        assert taken is not None and taken.epoch > seen.epoch
        with pytest.raises(Unavailable) as refused:
            journal.append_requests([("ten/x", 3, "optim_step", b"h", {})], outcomes=[("ten/y", 1, b"out", {})])
        assert getattr(refused.value, "reason", "") == MOVED_REASON
        assert journal.length("ten/x") == length
        record = journal.record("ten/x")
        with pytest.raises(Unavailable, match="another trainer"):
            journal.put_adapter(record)
        # Outcomes (best effort) of the fenced adapter are dropped while another adapter's are written.
        y_length = journal.length("ten/y")
        journal.append_outcomes([("ten/x", 2, b"out", {}), ("ten/y", 1, b"out", {})])
        assert (journal.length("ten/x"), journal.length("ten/y")) == (length, y_length + 1)

        # Over gRPC: moved, whether or not the trainer has noticed yet, and nothing of it is journaled.
        assert moved_reason(lambda: stub.OptimStep(trainer_pb2.OptimStepRequest(
            adapter="ten/x", seq_id=3, adam_params=ADAM))) == MOVED_REASON
        wait_for(lambda: "ten/x" not in names_on(t0) and "ten/x" in names_on(t1), 10, "ten/x to move to t1")
        assert "ten/y" in names_on(t0)
        assert journal.length("ten/x") == length
        # t1 restored what t0 had journaled and trains on.
        runner.send = lone(t1.stub())
        assert runner.optim_step().step == 2
        # A lone journal (no fence) of another trainer id is unaffected by fleets.
        lone_journal = TrainingJournal(settings.redis_url, key_prefix=settings.key_prefix, trainer_id="solo")
        lone_journal.append_requests([("solo/a", 1, "optim_step", b"h", {})])
        assert lone_journal.length("solo/a") == 1
        lone_journal.close()
    finally:
        store.close()
        t0.close()
        t1.close()


def test_members_and_placements_are_listed_for_operators(registry, background_loop):
    settings = registry.settings
    trainers = [start_live_trainer(member_settings(settings, m), background_loop, registry.address, **LIMITS)
                for m in ("t0", "t1")]
    store = FleetStore(settings.redis_url, key_prefix=settings.key_prefix, fleet="fleet")
    try:
        members = {m.trainer_id: m for m in store.members()}
        assert set(members) == {"t0", "t1"} and all(m.live for m in members.values())
        assert {m.address for m in members.values()} == {t.address for t in trainers}
        assert all(m.device_total > 0 and m.device_used > 0 for m in members.values())
        trainers[1].close()  # a clean stop leaves the heartbeat to expire
        wait_for(lambda: not next(m for m in store.members() if m.trainer_id == "t1").live, 10, "t1 to expire")
        assert Counter(m.live for m in store.members()) == {True: 1, False: 1}
    finally:
        store.close()
        trainers[0].close()


def test_a_member_restarted_under_its_id_within_its_ttl_takes_its_adapters_back_under_a_new_epoch(
        registry, background_loop):
    settings = registry.settings
    ttl_s = 20.0  # a restart well within it: nobody else takes the adapters meanwhile
    t0 = start_live_trainer(member_settings(settings, "t0", ttl_s=ttl_s), background_loop, registry.address,
                            **LIMITS)
    t1 = start_live_trainer(member_settings(settings, "t1", ttl_s=ttl_s), background_loop, registry.address,
                            **LIMITS)
    store = FleetStore(settings.redis_url, key_prefix=settings.key_prefix, fleet="fleet")
    try:
        router = Router([t0.address])
        scripts = [Script(router.call, f"ten/r{i}", seed=i) for i in range(4)]
        for script in scripts:
            script.create()
            script.train(range(2))
        mine = [s for s in scripts if store.placement(s.name).trainer == "t0"]
        assert len(mine) == 2
        before = {s.name: store.placement(s.name).epoch for s in mine}
        old_journal = t0.service.journal  # the old incarnation's fenced journal, kept past its death
        t0.close()  # its heartbeat stays until the TTL: to the others it may as well be alive
        t0 = start_live_trainer(member_settings(settings, "t0", ttl_s=ttl_s), background_loop, registry.address,
                                **LIMITS)
        assert {s.name for s in mine} <= names_on(t0) and not ({s.name for s in mine} & names_on(t1))
        for script in mine:
            now = store.placement(script.name)
            assert now.trainer == "t0" and now.epoch > before[script.name]
        # The earlier incarnation is fenced even under the same member id.
        with pytest.raises(Unavailable):
            old_journal.append_requests([(mine[0].name, 99, "optim_step", b"h", {})])
        router.where.clear()
        for script in mine:
            script.train(range(2, 3))
            info = next(a for a in t0.stub().ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest())
                        .adapters if a.name == script.name)
            assert (info.step, info.last_seq_id) == (3, 6)
    finally:
        store.close()
        t0.close()
        t1.close()
