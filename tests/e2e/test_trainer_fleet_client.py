"""loraplane's Python client on a trainer fleet: it knows one trainer, creates adapters wherever the fleet places
them, and its pipelined calls follow an adapter that a drain moves mid-training (same seq_ids, applied once), with
the same results as the same calls on a lone trainer."""

from __future__ import annotations

import uuid

from loraplane.client import AdamParams, ServiceClient, datum_from_sequence
from loraplane.client._runtime import RetryConfig
from tests.e2e.test_trainer_fleet import LIMITS, member_settings, second_registry, wait_for
from tests.fixtures.trainer import start_live_trainer
from trainer_svc.fleet_store import FleetStore

ADAM = AdamParams(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
RETRY = RetryConfig(initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=60.0, attempt_timeout_s=30.0)


def batch(seed: int) -> list:
    import random

    rng = random.Random(seed)
    return [datum_from_sequence([rng.randrange(5, 200) for _ in range(13)]) for _ in range(2)]


def run(training, steps: range) -> list:
    """Pipelined: every call of the range goes out before the first result is read."""
    futures = []
    for step in steps:
        futures.append(training.forward_backward(batch(100 * step + len(training.adapter)), "cross_entropy"))
        futures.append(training.optim_step(ADAM))
    return [f.result(60) for f in futures]


def test_the_client_places_through_one_trainer_and_follows_a_drained_adapter_mid_pipeline(registry,
                                                                                           background_loop):
    settings = registry.settings
    fleet = f"f{uuid.uuid4().hex[:6]}"
    trainers = {m: start_live_trainer(member_settings(settings, m, fleet), background_loop, registry.address,
                                      **LIMITS) for m in ("t0", "t1", "t2")}
    reference_registry = second_registry(registry, background_loop)
    reference_trainer = start_live_trainer(reference_registry.settings, background_loop,
                                           reference_registry.address, **LIMITS)
    store = FleetStore(settings.redis_url, key_prefix=settings.key_prefix, fleet=fleet)
    # No sampler runs here: publishing only names one for the SamplingClient it returns, which nobody calls.
    service = ServiceClient(trainer=trainers["t0"].address, registry=registry.address, sampler="127.0.0.1:9",
                            retry=RETRY)
    reference = ServiceClient(trainer=reference_trainer.address, registry=reference_registry.address,
                              sampler="127.0.0.1:9", retry=RETRY)
    try:
        clients = [service.create_lora_training_client("tiny", rank=4, seed=i, name=f"ten/c{i}") for i in range(3)]
        refs = [reference.create_lora_training_client("tiny", rank=4, seed=i, name=f"ten/c{i}") for i in range(3)]
        assert {m.trainer_id: m.placed for m in store.members()} == {"t0": 1, "t1": 1, "t2": 1}
        moving = next(c for c in clients if store.placement(c.adapter).trainer == "t1")
        before = run(moving, range(2))

        # Drain t1 with a pipeline in flight: whatever t1 journaled is replayed by the new owner, the rest is
        # refused as moved and retried there by the client with the same seq_ids.
        futures = []
        for step in range(2, 6):
            futures.append(moving.forward_backward(batch(100 * step + len(moving.adapter)), "cross_entropy"))
            futures.append(moving.optim_step(ADAM))
            if step == 3:
                store.set_draining("t1")
        during = [f.result(60) for f in futures]
        wait_for(lambda: store.placement(moving.adapter).trainer != "t1", 20, "the drain")
        after = run(moving, range(6, 8))
        got = before + during + after

        ref = next(r for r in refs if r.adapter == moving.adapter)
        want = run(ref, range(8))
        assert [o.loss for o in got[0::2]] == [o.loss for o in want[0::2]]
        assert [s.step for s in got[1::2]] == [s.step for s in want[1::2]] == list(range(1, 9))
        info = moving.get_info()  # found on its new trainer
        assert (info.step, info.last_seq_id) == (8, 16)
        published = moving.save_weights_for_sampler().result(60).published
        expected = ref.save_weights_for_sampler().result(60).published
        assert published.sha256 == expected.sha256
        # Attaching to an adapter that lives on another trainer than the client's finds it there.
        again = service.get_training_client(moving.adapter)
        assert again.last_seq_id == moving.last_seq_id == 17  # the publish took a seq_id too
    finally:
        service.close()
        reference.close()
        store.close()
        for live in (*trainers.values(), reference_trainer, reference_registry):
            live.close()
