"""The gateway in front of a trainer fleet: the Tinker SDK's models are created on whichever trainer the fleet
places them, and a drained trainer's model keeps training through the gateway (same futures, nothing lost)."""

from __future__ import annotations

import uuid

import tinker
from tinker import types

from gateway_svc.config import GatewaySettings
from loraplane.v1 import trainer_pb2
from tests.e2e.test_trainer_fleet import LIMITS, member_settings, wait_for
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer
from tests.gateway.conftest import LiveGateway, free_port
from trainer_svc.fleet_store import FleetStore


def datum(seed: int) -> types.Datum:
    import random

    tokens = [random.Random(seed).randrange(5, 200) for _ in range(13)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})


def test_the_gateway_routes_each_model_to_its_trainer_and_follows_a_drain(registry, background_loop,
                                                                          tmp_path, valkey):
    settings = registry.settings
    fleet = f"g{uuid.uuid4().hex[:6]}"
    trainers = {m: start_live_trainer(member_settings(settings, m, fleet), background_loop, registry.address,
                                      **LIMITS) for m in ("t0", "t1", "t2")}
    sampler = start_live_sampler(settings, background_loop, registry.address, base_model="tiny")
    gateway = LiveGateway(GatewaySettings(
        port=free_port(), trainer_address=trainers["t0"].address, registry_address=registry.address,
        sampler_address=sampler.address, redis_url=valkey.url, key_prefix=f"{settings.key_prefix}gw:",
        tokenizer_dir=str(tmp_path / "tokenizers"), long_poll_s=5.0, future_lease_s=3.0)).start()
    store = FleetStore(settings.redis_url, key_prefix=settings.key_prefix, fleet=fleet)
    service = tinker.ServiceClient(base_url=gateway.base_url)
    try:
        models = [service.create_lora_training_client(base_model="tiny", rank=4).result() for _ in range(3)]
        losses = {}
        for step in range(2):
            for i, model in enumerate(models):
                out = model.forward_backward([datum(10 * i + step)], "cross_entropy").result()
                losses.setdefault(i, []).append(out.metrics["loss:sum"])
                model.optim_step(types.AdamParams(learning_rate=0.05)).result()

        # Created through t0, placed one per trainer.
        assert {m.trainer_id: m.placed for m in store.members()} == {"t0": 1, "t1": 1, "t2": 1}
        adapters = {name for t in trainers.values() for name in
                    (a.name for a in t.stub().ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters)}
        on_t1 = next(a for a in adapters if store.placement(a).trainer == "t1")
        store.set_draining("t1")
        wait_for(lambda: store.placement(on_t1).trainer != "t1", 20, "the drain")
        for step in range(2, 4):
            for i, model in enumerate(models):
                out = model.forward_backward([datum(10 * i + step)], "cross_entropy").result()
                losses.setdefault(i, []).append(out.metrics["loss:sum"])
                model.optim_step(types.AdamParams(learning_rate=0.05)).result()
        owner = next(t for m, t in trainers.items() if m == store.placement(on_t1).trainer)
        info = next(a for a in owner.stub().ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters
                    if a.name == on_t1)
        assert (info.step, info.last_seq_id) == (4, 8)  # every step applied once, across the move
        assert all(len(v) == 4 for v in losses.values())
    finally:
        store.close()
        gateway.stop()
        sampler.close()
        for live in trainers.values():
            live.close()
