"""Multi-tenant isolation: adapters trained interleaved, with fused forward/backward batches, end bit-identical (fp32,
CPU) to the same adapters trained alone; an adapter created later starts from its own seed, untouched."""

from __future__ import annotations

import time

import torch

from loraplane.adapter_format import parse_training_state
from loraplane.lora import LoraSpec, init_lora_params
from loraplane.models import load_base_model
from loraplane.v1 import common_pb2, trainer_pb2

ADAM = trainer_pb2.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01,
                              grad_clip_norm=5.0)


def datum(generator: torch.Generator, n: int, weighted: bool = False) -> trainer_pb2.Datum:
    tokens = torch.randint(5, 261, (n + 1,), generator=generator).tolist()
    message = trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])
    if weighted:
        message.weights.extend((torch.rand(n, generator=generator) * 2 - 0.5).tolist())
    return message


def rounds(seed: int, lengths: list[int], count: int = 3) -> list[list[trainer_pb2.Datum]]:
    generator = torch.Generator().manual_seed(seed)
    return [[datum(generator, n, weighted=i % 2 == 1) for i, n in enumerate(lengths)] for _ in range(count)]


def create(stub, name: str, rank: int, alpha: float, seed: int, targets=()):
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=rank, alpha=alpha, seed=seed, target_modules=targets)))


def fb(name: str, seq: int, data) -> trainer_pb2.ForwardBackwardRequest:
    return trainer_pb2.ForwardBackwardRequest(adapter=name, seq_id=seq, data=data, loss_fn="cross_entropy")


def saved_state(trainer, stub, name: str, seq: int):
    version = stub.SaveState(trainer_pb2.SaveStateRequest(adapter=name, seq_id=seq)).version
    return parse_training_state(trainer.download(name, version.version))


def wait_queued(scheduler, count: int) -> None:
    deadline = time.monotonic() + 10
    while scheduler._queued < count:
        assert time.monotonic() < deadline, "requests never reached the scheduler"
        time.sleep(0.005)


def assert_states_identical(left, right) -> None:
    assert left.step == right.step
    assert set(left.params) == set(right.params)
    for key in left.params:
        assert torch.equal(left.params[key], right.params[key]), key
        assert torch.equal(left.exp_avg[key], right.exp_avg[key]), key
        assert torch.equal(left.exp_avg_sq[key], right.exp_avg_sq[key]), key


def test_interleaved_fused_training_is_bit_identical_to_training_alone(trainer):
    stub = trainer.stub()
    scheduler = trainer.service.scheduler
    data_a = rounds(1, [7, 12])
    data_b = rounds(2, [5])  # alone: 5 tokens (padded to the minimum), fused: shares a batch with A's 19
    # Different ranks, alphas and targets side by side.
    create(stub, "alone-a", 4, 8, 11)
    create(stub, "alone-b", 2, 0, 22, ["q_proj", "v_proj", "down_proj"])
    create(stub, "mixed-a", 4, 8, 11)
    create(stub, "mixed-b", 2, 0, 22, ["q_proj", "v_proj", "down_proj"])

    seq = 0
    alone_outputs = {}
    for name, data in (("alone-a", data_a), ("alone-b", data_b)):
        seq = 0
        outputs = []
        for batch in data:
            seq += 1
            outputs.append(stub.ForwardBackward(fb(name, seq, batch)))
            seq += 1
            stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, seq_id=seq, adam_params=ADAM))
        alone_outputs[name] = outputs
    fused_before = scheduler.stats.fused_batches

    mixed_outputs = {"mixed-a": [], "mixed-b": []}
    seq = 0
    for batch_a, batch_b in zip(data_a, data_b):
        seq += 1
        scheduler.hold()
        try:
            future_a = stub.ForwardBackward.future(fb("mixed-a", seq, batch_a))
            future_b = stub.ForwardBackward.future(fb("mixed-b", seq, batch_b))
            wait_queued(scheduler, 2)
        finally:
            scheduler.release()
        mixed_outputs["mixed-a"].append(future_a.result(60))
        mixed_outputs["mixed-b"].append(future_b.result(60))
        seq += 1
        step_a = stub.OptimStep.future(trainer_pb2.OptimStepRequest(adapter="mixed-a", seq_id=seq, adam_params=ADAM))
        step_b = stub.OptimStep.future(trainer_pb2.OptimStepRequest(adapter="mixed-b", seq_id=seq, adam_params=ADAM))
        assert not step_a.result(60).skipped and not step_b.result(60).skipped
    # Every forward/backward round really ran as one fused batch of both adapters.
    assert scheduler.stats.fused_batches - fused_before == len(data_a)

    for alone, mixed in (("alone-a", "mixed-a"), ("alone-b", "mixed-b")):
        for got, want in zip(mixed_outputs[mixed], alone_outputs[alone]):
            assert got.metrics["loss:sum"] == want.metrics["loss:sum"]
            for out_got, out_want in zip(got.outputs, want.outputs):
                assert list(out_got.logprobs) == list(out_want.logprobs)
                assert list(out_got.elementwise_loss) == list(out_want.elementwise_loss)
    state_alone_a = saved_state(trainer, stub, "alone-a", 7)
    state_mixed_a = saved_state(trainer, stub, "mixed-a", 7)
    state_alone_b = saved_state(trainer, stub, "alone-b", 7)
    state_mixed_b = saved_state(trainer, stub, "mixed-b", 7)
    assert state_alone_a.step == 3
    assert_states_identical(state_mixed_a, state_alone_a)
    assert_states_identical(state_mixed_b, state_alone_b)
    # Training moved the params (so equality above is not trivially about untouched tensors).
    fresh_a = init_lora_params(load_base_model("tiny"), LoraSpec.create(4, 8, seed=11))
    assert any(not torch.equal(fresh_a[k], state_mixed_a.params[k]) for k in fresh_a)

    # A third adapter created after all that starts from its own seed's init, bit for bit.
    create(stub, "late-c", 3, 6, 33)
    state_c = saved_state(trainer, stub, "late-c", 1)
    fresh_c = init_lora_params(load_base_model("tiny"), LoraSpec.create(3, 6, seed=33))
    assert state_c.step == 0
    for key, tensor in fresh_c.items():
        assert torch.equal(state_c.params[key], tensor), key
        assert float(state_c.exp_avg[key].abs().sum()) == 0.0
