"""cross_entropy with soft targets: (N, K) target_tokens and weights (the teacher's top-K tokens and probabilities
per position, tinker-cookbook's SDFT distillation). loss = sum_n sum_k -w[n, k] * log p(target[n, k] | prefix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplane.errors import InvalidArgument
from loraplane.lora import AdapterTensors, lora_routing
from tests.fixtures.adapters import make_state
from trainer_svc.backends.base import BatchItem, DatumInput
from trainer_svc.backends.torch_backend import TorchBackend
from trainer_svc.losses import resolve_loss
from trainer_svc.validation import DatumPayload, validate_data

VOCAB = 261
LIMITS = {"vocab_size": VOCAB, "max_context_length": 64, "max_batch_datums": 8, "max_request_tokens": 512}


@pytest.fixture(scope="module")
def backend():
    return TorchBackend("tiny")


def soft_datum(generator, n: int, k: int, used: int | None = None) -> DatumInput:
    """Top-k style targets: distinct tokens per row, probabilities summing to <= 1, slots past `used` of weight 0."""
    inputs = torch.randint(5, VOCAB, (n,), generator=generator)
    targets = torch.stack([torch.randperm(VOCAB - 5, generator=generator)[:k] + 5 for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=generator), -1)
    if used is not None:
        weights[:, used:] = 0.0
    return DatumInput(input_tokens=inputs, target_tokens=targets, weights=weights)


def hard_datum(generator, n: int) -> DatumInput:
    tokens = torch.randint(5, VOCAB, (n + 1,), generator=generator)
    return DatumInput(input_tokens=tokens[:-1], target_tokens=tokens[1:], weights=torch.rand(n, generator=generator))


def take_grads(state) -> dict[str, torch.Tensor]:
    grads = {k: v.grad.clone() for k, v in state.params.items()}
    for tensor in state.params.values():
        tensor.grad = None
    return grads


def reference(backend, state, data) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Each datum alone through the plain HF forward; log-softmax and the loss formula in float64."""
    adapter = AdapterTensors.from_params(state.params, state.spec)
    lps, losses = [], []
    with lora_routing(backend.base.model, [adapter]):
        for d in data:
            logits = backend.base.model(d.input_tokens[None]).logits[0].double()
            targets = d.target_tokens if d.target_tokens.dim() == 2 else d.target_tokens[:, None]
            weights = d.weights.double() if d.target_tokens.dim() == 2 else d.weights.double()[:, None]
            lp = torch.log_softmax(logits, -1).gather(1, targets)
            lps.append(lp if d.target_tokens.dim() == 2 else lp[:, 0])
            losses.append((-weights * lp).sum(1))
    total = torch.stack([loss.sum() for loss in losses]).sum()
    return lps, losses, total


def test_soft_targets_match_float64_reference_in_a_fused_batch(backend):
    generator = torch.Generator().manual_seed(7)
    soft_state, hard_state = make_state(backend, 3), make_state(backend, 4)
    soft = [soft_datum(generator, 9, 4, used=3), soft_datum(generator, 5, 2)]
    hard = [hard_datum(generator, 7)]
    name, config = resolve_loss("cross_entropy", {})
    # One fused batch: a soft-target request and a 1-D request of another adapter.
    soft_out, hard_out = backend.run([BatchItem(soft_state, soft, name, config),
                                      BatchItem(hard_state, hard, name, config)], backward=True)
    soft_grads, hard_grads = take_grads(soft_state), take_grads(hard_state)

    lps, losses, total = reference(backend, soft_state, soft)
    for out, d, lp, loss in zip(soft_out.outputs, soft, lps, losses):
        assert out.targets_per_position == d.target_tokens.shape[1]
        assert len(out.logprobs) == d.target_tokens.numel() and len(out.elementwise_loss) == d.length
        torch.testing.assert_close(torch.tensor(out.logprobs).view_as(lp), lp.float(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(out.elementwise_loss), loss.float(), atol=2e-5, rtol=1e-5)
    assert soft_out.metrics["loss:sum"] == pytest.approx(float(total.detach()), abs=1e-4)
    assert soft_out.metrics["num_tokens:sum"] == 14
    total.backward()
    for key, grad in soft_grads.items():
        torch.testing.assert_close(grad, soft_state.params[key].grad, atol=1e-5, rtol=1e-4, msg=key)
    assert any(float(g.abs().sum()) > 0 for g in soft_grads.values())

    # The 1-D request fused beside soft targets gets exactly what it gets alone (bit for bit).
    (alone,) = backend.run([BatchItem(hard_state, hard, name, config)], backward=True)
    assert alone.outputs[0].logprobs == hard_out.outputs[0].logprobs
    assert alone.outputs[0].elementwise_loss == hard_out.outputs[0].elementwise_loss
    assert alone.outputs[0].targets_per_position == 1
    for key, grad in take_grads(hard_state).items():
        assert torch.equal(grad, hard_grads[key]), key


def test_zero_weight_slots_contribute_nothing_and_k1_is_the_1d_loss(backend):
    generator = torch.Generator().manual_seed(11)
    state = make_state(backend, 5)
    n = 8
    hard = hard_datum(generator, n)
    # K = 3 whose first slot is the 1-D datum's target and weight; the other slots have weight 0.
    others = torch.randint(5, VOCAB, (n, 2), generator=generator)
    padded = DatumInput(hard.input_tokens, torch.cat([hard.target_tokens[:, None], others], 1),
                        torch.cat([hard.weights[:, None], torch.zeros(n, 2)], 1))
    name, config = resolve_loss("cross_entropy", {})
    (one,) = backend.run([BatchItem(state, [hard], name, config)], backward=True)
    one_grads = take_grads(state)
    (three,) = backend.run([BatchItem(state, [padded], name, config)], backward=True)
    three_grads = take_grads(state)
    assert three.outputs[0].elementwise_loss == one.outputs[0].elementwise_loss
    assert torch.tensor(three.outputs[0].logprobs).view(n, 3)[:, 0].tolist() == one.outputs[0].logprobs
    for key, grad in one_grads.items():
        torch.testing.assert_close(three_grads[key], grad, atol=1e-7, rtol=1e-6, msg=key)

    # K = 1 sent as targets_per_position = 1 is the 1-D datum, exactly.
    flat = DatumPayload(hard.input_tokens.tolist(), hard.target_tokens.tolist(), hard.weights.tolist())
    k1 = DatumPayload(hard.input_tokens.tolist(), hard.target_tokens.tolist(), hard.weights.tolist(),
                      targets_per_position=1)
    (a,), _, _ = validate_data([flat], "cross_entropy", {}, **LIMITS)
    (b,), _, _ = validate_data([k1], "cross_entropy", {}, **LIMITS)
    assert torch.equal(a.target_tokens, b.target_tokens) and b.target_tokens.dim() == 1
    (via_k1,) = backend.run([BatchItem(state, [b], name, config)], backward=True)
    assert via_k1.outputs[0].logprobs == one.outputs[0].logprobs
    for key, grad in take_grads(state).items():
        assert torch.equal(grad, one_grads[key]), key


def test_soft_target_validation_names_the_field():
    n, k = 4, 3
    inputs = [5, 6, 7, 8]
    targets = list(range(10, 10 + n * k))
    weights = [0.5] * (n * k)
    (datum,), _, _ = validate_data([DatumPayload(inputs, targets, weights, targets_per_position=k)],
                                   "cross_entropy", {}, **LIMITS)
    assert datum.target_tokens.shape == (n, k) and datum.weights.shape == (n, k)
    assert datum.target_tokens[1].tolist() == [13, 14, 15]

    def refused(payload, field, words, loss="cross_entropy", **extra):
        with pytest.raises(InvalidArgument) as info:
            validate_data([payload], loss, {}, **{**LIMITS, **extra})
        assert info.value.field == field, info.value.message
        for word in words:
            assert word in info.value.message, info.value.message

    refused(DatumPayload(inputs, targets[:-1], weights, targets_per_position=k), "data[0].target_tokens",
            ["11 entries", "4 x 3"])
    refused(DatumPayload(inputs, targets, weights[:n], targets_per_position=k), "data[0].weights", ["4 entries"])
    refused(DatumPayload(inputs, targets[:-1] + [VOCAB], weights, targets_per_position=k), "data[0].target_tokens",
            [str(VOCAB), "vocabulary"])
    refused(DatumPayload(inputs, targets, [0.5] * (n * k - 1) + [float("nan")], targets_per_position=k),
            "data[0].weights", ["not finite"])
    refused(DatumPayload(inputs, list(range(n * 65)), targets_per_position=65), "data[0].target_tokens",
            ["65", "at most 64"])
    refused(DatumPayload(inputs, targets, (), [0.0] * n, [1.0] * n, targets_per_position=k), "data[0].target_tokens",
            ["only read by cross_entropy", "importance_sampling"], loss="importance_sampling")
    refused(DatumPayload(inputs, targets, weights, targets_per_position=k), "data[0].target_tokens",
            ["3 targets per position", "megatron backend takes at most 2"], max_targets_per_position=2,
            backend="megatron")


def test_client_datum_sends_soft_targets_flat_with_k_and_reshapes_the_logprobs():
    from loraplane.client import Datum, TensorData
    from loraplane.client.types import outputs_from_proto
    from loraplane.v1 import trainer_pb2

    targets = np.arange(12, dtype=np.int64).reshape(4, 3) + 5
    weights = np.linspace(0, 1, 12, dtype=np.float32).reshape(4, 3)
    protos = [Datum([1, 2, 3, 4], {"target_tokens": t, "weights": w}).to_proto() for t, w in (
        (targets, weights), (torch.from_numpy(targets), torch.from_numpy(weights)),
        (TensorData.from_numpy(targets), TensorData.from_numpy(weights)))]
    assert protos[0] == protos[1] == protos[2]
    assert protos[0].targets_per_position == 3 and list(protos[0].target_tokens) == targets.reshape(-1).tolist()
    assert list(protos[0].weights) == pytest.approx(weights.reshape(-1).tolist())
    flat = Datum([1, 2, 3, 4], {"target_tokens": targets[:, 0]}).to_proto()
    assert flat.targets_per_position == 0
    k1 = Datum([1, 2, 3, 4], {"target_tokens": targets[:, :1]}).to_proto()
    assert k1.targets_per_position == 1 and list(k1.target_tokens) == list(flat.target_tokens)

    replies = [trainer_pb2.DatumOutput(logprobs=[-1.0] * 12, elementwise_loss=[1.0] * 4, targets_per_position=3),
               trainer_pb2.DatumOutput(logprobs=[-1.0] * 4, elementwise_loss=[1.0] * 4, targets_per_position=1),
               trainer_pb2.DatumOutput(logprobs=[-1.0] * 4, elementwise_loss=[1.0] * 4, targets_per_position=1)]
    outs = outputs_from_proto(replies, [protos[0], k1, flat])
    assert [o["logprobs"].shape for o in outs] == [[4, 3], [4, 1], [4]]
    assert outs[0]["logprobs"].to_numpy().shape == (4, 3) and outs[0]["elementwise_loss"].shape == [4]


@pytest.mark.parametrize("shape", [(3, 7, 50), (5, 50), (1, 9, 17)])
def test_megatron_target_logprob_with_k_columns_matches_float64(monkeypatch, shape):
    """The megatron backend's chunked logprob function with [..., K] targets: values and gradients against
    log_softmax(...).gather in float64, in several chunks, a repeated target in a row included."""
    from trainer_svc.backends.megatron import model

    monkeypatch.setattr(model, "LOGPROB_CHUNK_ELEMENTS", 120)  # several chunks, a ragged last one
    k = 3
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, dtype=torch.float64, generator=g).mul_(3).requires_grad_(True)
    targets = torch.randint(0, shape[-1], (*shape[:-1], k), generator=g)
    targets.view(-1, k)[0, 1] = targets.view(-1, k)[0, 0]  # the same token twice: its gradients add up
    weights = torch.randn(*shape[:-1], k, dtype=torch.float64, generator=g)
    ref = torch.log_softmax(x, -1).gather(-1, targets)
    (ref * weights).sum().backward()

    xf = x.detach().float().requires_grad_(True)
    out = model._TargetLogprob.apply(xf, targets)
    (out * weights.float()).sum().backward()
    assert out.dtype == torch.float32 and out.shape == targets.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)
    torch.testing.assert_close(xf.grad.double(), x.grad, atol=2e-6, rtol=0)
    # Each column's values are the 1-D function's, exactly.
    for j in range(k):
        assert torch.equal(out[..., j], model._TargetLogprob.apply(xf.detach(), targets[..., j].contiguous()))
