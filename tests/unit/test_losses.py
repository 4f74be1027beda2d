"""Losses: the backend's packed, fused computation vs a direct reference on the same model's logits (plain HF
forward per datum, the formulas written out independently), values and parameter gradients."""

from __future__ import annotations

import pytest
import torch

from loraplane.errors import InvalidArgument
from loraplane.lora import AdapterTensors, LoraSpec, lora_routing
from trainer_svc.backends.base import BatchItem, DatumInput
from trainer_svc.backends.torch_backend import TorchBackend
from trainer_svc.losses import resolve_loss
from trainer_svc.pool import AdapterState


@pytest.fixture(scope="module")
def backend():
    return TorchBackend("tiny")


def make_state(backend, seed: int) -> AdapterState:
    spec = LoraSpec.create(4, 8, seed=seed)
    params = backend.init_params(spec)
    generator = torch.Generator().manual_seed(seed)
    for key, tensor in params.items():
        if key.endswith("lora_B.weight"):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
        tensor.requires_grad_(True)
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    return AdapterState(name=f"s{seed}", spec=spec, base_model="tiny", params=params, exp_avg=zeros,
                        exp_avg_sq=dict(zeros))


def make_data(seed: int, lengths=(6, 11)) -> list[DatumInput]:
    generator = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        tokens = torch.randint(5, 261, (n + 1,), generator=generator)
        data.append(DatumInput(
            input_tokens=tokens[:-1], target_tokens=tokens[1:],
            weights=torch.rand(n, generator=generator) * 2 - 0.7,
            # Sampler logprobs near the learner's so ratios straddle the clip bounds.
            logprobs=None,
            advantages=torch.randn(n, generator=generator)))
    return data


def reference_logprobs(backend, state, data) -> list[torch.Tensor]:
    """Plain HF forward of each datum alone (no packing), LoRA via per-row routing."""
    adapter = AdapterTensors.from_params(state.params, state.spec)
    out = []
    with lora_routing(backend.base.model, [adapter]):
        for d in data:
            logits = backend.base.model(d.input_tokens[None]).logits[0]
            out.append(torch.log_softmax(logits, -1)[torch.arange(d.length), d.target_tokens])
    return out


def reference_loss(name: str, lp: torch.Tensor, d: DatumInput, config: dict) -> torch.Tensor:
    q, adv = d.logprobs, d.advantages
    if name == "cross_entropy":
        return -(lp * d.weights)
    ratio = torch.exp(lp - q)
    if name == "importance_sampling":
        return -(ratio * adv)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    clipped = torch.where(ratio < low, torch.full_like(ratio, low), torch.where(ratio > high, high, ratio))
    if name == "ppo":
        unclipped_term, clipped_term = ratio * adv, clipped * adv
        return -torch.where(unclipped_term < clipped_term, unclipped_term, clipped_term)
    if name == "cispo":
        return -(clipped.detach() * lp * adv)
    if name == "dro":
        beta = config.get("beta", 0.05)
        return -(lp * adv) + 0.5 * beta * (lp - q) * (lp - q)
    raise AssertionError(name)


@pytest.mark.parametrize("name,config", [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {}),
    ("dro", {}),
    ("dro", {"beta": 0.5}),
])
def test_loss_matches_reference_values_and_gradients(backend, name, config):
    state = make_state(backend, 3)
    data = make_data(4)
    # Sampler logprobs = learner logprobs + noise, so r = exp(lp - q) spreads over both sides of the clip range.
    with torch.no_grad():
        learner = reference_logprobs(backend, state, data)
    generator = torch.Generator().manual_seed(5)
    for d, lp in zip(data, learner):
        d.logprobs = lp + torch.randn(lp.shape, generator=generator) * 0.3
    resolved_name, resolved = resolve_loss(name, config)
    (result,) = backend.run([BatchItem(state, data, resolved_name, resolved)], backward=True)
    grads = {k: v.grad.clone() for k, v in state.params.items()}
    for tensor in state.params.values():
        tensor.grad = None

    lps = reference_logprobs(backend, state, data)
    total = 0.0
    reference_total = torch.zeros(())
    for out, d, lp in zip(result.outputs, data, lps):
        ref = reference_loss(name, lp, d, config)
        assert torch.allclose(torch.tensor(out.logprobs), lp.detach(), atol=1e-5)
        assert torch.allclose(torch.tensor(out.elementwise_loss), ref.detach(), atol=1e-5)
        total += float(ref.detach().sum())
        reference_total = reference_total + ref.sum()
    assert result.metrics["loss:sum"] == pytest.approx(total, abs=1e-4)
    assert result.metrics["num_tokens:sum"] == sum(d.length for d in data)
    reference_total.backward()
    for key, grad in grads.items():
        ref_grad = state.params[key].grad
        assert torch.allclose(grad, ref_grad, atol=1e-5, rtol=1e-4), key
    assert any(float(g.abs().sum()) > 0 for g in grads.values())
    if name in ("ppo", "cispo"):
        ratios = torch.cat([torch.exp(lp.detach() - d.logprobs) for lp, d in zip(lps, data)])
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        assert bool((ratios < low).any()) and bool((ratios > high).any()), "clip range not exercised"


def test_cross_entropy_with_weights_minus_g_equals_custom_loss_gradient(backend):
    """forward_backward_custom: g = d(custom)/d(logprobs) from a Forward; cross_entropy with weights -g must give
    the same parameter gradient as the custom loss itself."""
    state = make_state(backend, 7)
    data = make_data(8, lengths=(9, 14))
    for d in data:
        d.weights = None
    (forward,) = backend.run([BatchItem(state, data, "cross_entropy", {})], backward=False)
    assert all(v.grad is None for v in state.params.values())

    def custom(lps):
        return sum((torch.sin(lp) * (i + 1.5) + lp.pow(2) * 0.1).sum() for i, lp in enumerate(lps))

    leaves = [torch.tensor(out.logprobs, requires_grad=True) for out in forward.outputs]
    custom(leaves).backward()
    for d, leaf in zip(data, leaves):
        d.weights = -leaf.grad
    backend.run([BatchItem(state, data, "cross_entropy", {})], backward=True)
    via_weights = {k: v.grad.clone() for k, v in state.params.items()}
    for tensor in state.params.values():
        tensor.grad = None
    custom(reference_logprobs(backend, state, data)).backward()
    for key, grad in via_weights.items():
        assert torch.allclose(grad, state.params[key].grad, atol=1e-5, rtol=1e-4), key
    assert any(float(g.abs().sum()) > 0 for g in via_weights.values())


def test_loss_config_is_validated():
    assert resolve_loss("", {}) == ("cross_entropy", {})
    assert resolve_loss("ppo", {}) == ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert resolve_loss("dro", {"beta": 0.2})[1] == {"beta": 0.2}
    for name, config, field in [
        ("nope", {}, "loss_fn"),
        ("cross_entropy", {"beta": 1.0}, "loss_fn_config.beta"),
        ("ppo", {"clip_ratio": 0.2}, "loss_fn_config.clip_ratio"),
        ("ppo", {"clip_low_threshold": float("nan")}, "loss_fn_config.clip_low_threshold"),
        ("cispo", {"clip_low_threshold": 1.3}, "loss_fn_config.clip_low_threshold"),
        ("dro", {"beta": -1.0}, "loss_fn_config.beta"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            resolve_loss(name, config)
        assert info.value.field == field, (name, config)
