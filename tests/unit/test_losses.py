"""Losses: the backend's packed, fused computation vs a direct reference on the same model's logits (plain HF
forward per datum, the formulas written out independently), values and parameter gradients."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from loraplane.errors import InvalidArgument
from loraplane.lora import AdapterTensors, lora_routing
from tests.fixtures.adapters import make_state
from trainer_svc.backends.base import BatchItem, DatumInput
from trainer_svc.backends.torch_backend import TorchBackend
from trainer_svc.losses import resolve_loss


@pytest.fixture(scope="module")
def backend():
    return TorchBackend("tiny")


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


# ---- gspo and stable_reinforce: float64 references written out token by token, independently of losses.py ----

def reference_gspo(lp: torch.Tensor, q, adv, mask, clip_low_threshold=0.8, clip_high_threshold=1.2) -> torch.Tensor:
    """Tinker's GSPO-token, per token in float64: every token carries the sequence ratio's value, d/dlp_t = s."""
    lp, low, high = lp.double(), clip_low_threshold, clip_high_threshold
    members = [t for t in range(len(lp)) if (mask[t] != 0 if mask is not None else adv[t] != 0)]
    seq = sum(float(lp[t].detach()) - float(q[t]) for t in members) / len(members) if members else 0.0
    s = math.exp(seq)
    out = []
    for t in range(len(lp)):
        ratio = s * torch.exp(lp[t] - lp[t].detach())
        clipped = lp[t].detach() * 0 + low if s < low else lp[t].detach() * 0 + high if s > high else ratio
        a = float(adv[t])
        out.append(-(ratio * a if s * a <= float(clipped.detach()) * a else clipped * a))
    return torch.stack(out)


def reference_stable_reinforce(lp: torch.Tensor, q, adv, mask, ratio_cap=2.0, mask_low=0.5, mask_high=5.0,
                               sequence_level=0.0, kl_coeff=0.0) -> torch.Tensor:
    lp = lp.double()
    ids = [int(mask[t]) if mask is not None else int(adv[t] != 0) for t in range(len(lp))]
    log_ratio = {t: float(lp[t].detach()) - float(q[t]) for t in range(len(lp))}
    if sequence_level:
        by_seq: dict[int, list[float]] = {}
        for t, k in enumerate(ids):
            by_seq.setdefault(k, []).append(log_ratio[t])
        log_ratio = {t: sum(by_seq[ids[t]]) / len(by_seq[ids[t]]) for t in range(len(lp))}
    out = []
    for t in range(len(lp)):
        rho = math.exp(log_ratio[t]) if log_ratio[t] < 700 else math.inf
        if ids[t] == 0 or not mask_low <= rho <= mask_high:
            out.append(lp[t] * 0.0)
            continue
        delta = lp[t] - float(q[t])
        out.append(-min(rho, ratio_cap) * float(adv[t]) * lp[t] + kl_coeff * (torch.exp(delta) - delta - 1))
    return torch.stack(out)


def sequence_data(seed: int, loss: str):
    """Two datums shaped like RL data: a prompt (advantage 0, q 0 as the cookbook pads it) then sampled tokens. The
    first datum holds two sampled sequences (a multi-turn datum), the second one."""
    from trainer_svc.validation import DatumPayload

    generator = torch.Generator().manual_seed(seed)
    payloads = []
    for prompt, spans in ((4, (5, 6)), (3, (9,))):
        n = prompt + sum(spans)
        tokens = torch.randint(5, 261, (n + 1,), generator=generator)
        adv = [0.0] * prompt
        mask = [0.0] * prompt
        for k, length in enumerate(spans, start=1):
            adv += [float(torch.randn((), generator=generator))] * length
            mask += [float(k) if loss == "stable_reinforce" else 1.0] * length
        payloads.append(DatumPayload(tokens[:-1].tolist(), tokens[1:].tolist(), (), [0.0] * n, adv, mask))
    return payloads


def with_sampler_logprobs(backend, state, data, seed, scale):
    """q = learner logprob + per-token noise + a per-sequence offset, so ratios straddle every band and cap."""
    with torch.no_grad():
        learner = reference_logprobs(backend, state, data)
    generator = torch.Generator().manual_seed(seed)
    for d, lp in zip(data, learner):
        offset = torch.zeros_like(lp)
        ids = d.weights.round().long() if d.weights is not None else (d.advantages != 0).long()
        for k in ids.unique().tolist():
            offset[ids == k] = float(torch.randn((), generator=generator)) * scale
        d.logprobs = lp + offset + torch.randn(lp.shape, generator=generator) * scale
        d.logprobs[ids == 0] = 0.0


@pytest.mark.parametrize("name,config,use_mask", [
    ("gspo", {}, True),
    ("gspo", {}, False),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}, True),
    ("stable_reinforce", {}, True),
    ("stable_reinforce", {}, False),
    ("stable_reinforce", {"sequence_level": 1.0, "mask_low": 0.7, "mask_high": 1.6}, True),
    ("stable_reinforce", {"kl_coeff": 0.3, "ratio_cap": 1.5}, True),
])
def test_sequence_losses_match_float64_reference(backend, name, config, use_mask):
    from trainer_svc.validation import validate_data

    state = make_state(backend, 11)
    payloads = sequence_data(12, name)
    if not use_mask:
        payloads = [dataclasses.replace(p, sequence_ratio_mask=()) for p in payloads]
    data, resolved_name, resolved = validate_data(payloads, name, config, vocab_size=261, max_context_length=64,
                                                  max_batch_datums=8, max_request_tokens=512)
    scale = 0.05 if name == "gspo" else 0.4 if config.get("sequence_level") else 0.8
    with_sampler_logprobs(backend, state, data, 13, scale)
    (result,) = backend.run([BatchItem(state, data, resolved_name, resolved)], backward=True)
    grads = {k: v.grad.clone() for k, v in state.params.items()}
    for tensor in state.params.values():
        tensor.grad = None

    reference = reference_gspo if name == "gspo" else reference_stable_reinforce
    lps = reference_logprobs(backend, state, data)
    reference_total = torch.zeros((), dtype=torch.float64)
    kept = dropped = 0
    for out, d, lp in zip(result.outputs, data, lps):
        ref = reference(lp, d.logprobs, d.advantages, d.weights, **config)
        assert torch.allclose(torch.tensor(out.elementwise_loss, dtype=torch.float64), ref.detach(), atol=2e-5)
        reference_total = reference_total + ref.sum()
        sampled = d.advantages != 0
        nonzero = ref.detach() != 0
        kept += int((nonzero & sampled).sum())
        dropped += int((~nonzero & sampled).sum())
    assert result.metrics["loss:sum"] == pytest.approx(float(reference_total.detach()), abs=1e-4)
    reference_total.backward()
    for key, grad in grads.items():
        assert torch.allclose(grad.double(), state.params[key].grad.double(), atol=1e-5, rtol=1e-4), key
    assert any(float(g.abs().sum()) > 0 for g in grads.values())
    assert kept > 0
    if name == "stable_reinforce":
        assert dropped > 0, "the trust band dropped nothing: the test data does not exercise it"
    else:
        ratios = [float(torch.exp((lp.detach() - d.logprobs)[d.advantages != 0].mean())) for d, lp in zip(data, lps)]
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        inside = [low <= r <= high for r in ratios]
        assert all(inside) if high >= 1.2 else (any(inside) and not all(inside)), ratios


def test_sequence_loss_gradients_in_closed_form():
    """Gradient check for the surrogates (finite differences do not apply: the weights are stop-gradient by
    definition): d loss_t / d lp_t against the formulas, in float64."""
    from trainer_svc.losses import elementwise_loss

    generator = torch.Generator().manual_seed(21)
    n = 12
    lp0 = -torch.rand(n, generator=generator, dtype=torch.float64) * 3
    q = lp0 + torch.randn(n, generator=generator, dtype=torch.float64)
    adv = torch.randn(n, generator=generator, dtype=torch.float64)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2], dtype=torch.float64)
    adv[:2] = 0

    config = resolve_loss("stable_reinforce", {"kl_coeff": 0.25})[1]
    lp = lp0.clone().requires_grad_(True)
    elementwise_loss("stable_reinforce", config, lp, weights=mask, q=q, advantages=adv).sum().backward()
    rho = torch.exp(lp0 - q)
    keep = (mask > 0) & (rho >= 0.5) & (rho <= 5.0)
    expected = torch.where(keep, -torch.clamp(rho, max=2.0) * adv + 0.25 * (rho - 1), torch.zeros_like(rho))
    assert torch.allclose(lp.grad, expected, atol=1e-12)
    assert bool(keep.any()) and bool((~keep & (mask > 0)).any())

    config = resolve_loss("gspo", {})[1]
    lp = lp0.clone().requires_grad_(True)
    q_close = lp0 + torch.randn(n, generator=generator, dtype=torch.float64) * 0.3
    elementwise_loss("gspo", config, lp, weights=(mask > 0).double(), q=q_close, advantages=adv).sum().backward()
    s = torch.exp((lp0 - q_close)[mask > 0].mean())
    unclipped = (adv > 0) & (s <= 1.2) | (adv < 0) & (s >= 0.8)
    expected = torch.where(unclipped, -s * adv, torch.zeros_like(adv))
    assert torch.allclose(lp.grad, expected, atol=1e-12)


def test_stable_reinforce_is_reinforce_on_policy_and_finite_far_off_policy():
    from trainer_svc.losses import elementwise_loss

    config = resolve_loss("stable_reinforce", {"kl_coeff": 0.1, "sequence_level": 1.0})[1]
    lp = torch.tensor([-0.5, -1.0, -2.0, -0.1], requires_grad=True)
    adv = torch.tensor([0.0, 1.0, 1.0, -2.0])
    loss = elementwise_loss("stable_reinforce", config, lp, weights=None, q=lp.detach(), advantages=adv)
    assert torch.allclose(loss, -adv * lp.detach())
    # A sampler logprob 500 nats below the learner's: the ratio overflows float32; the sequence is dropped, and
    # neither the value nor the gradient turns into NaN.
    for level in (0.0, 1.0):
        config = resolve_loss("stable_reinforce", {"kl_coeff": 0.1, "sequence_level": level})[1]
        lp = torch.tensor([-0.5, -1.0, -2.0, -0.1], requires_grad=True)
        q = torch.tensor([0.0, -500.0, -1.0, -0.1])
        loss = elementwise_loss("stable_reinforce", config, lp, weights=None, q=q, advantages=adv)
        loss.sum().backward()
        assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(lp.grad).all())
        assert float(loss[1].detach()) == 0.0


def test_sequence_loss_config_and_mask_are_validated():
    from trainer_svc.validation import DatumPayload, validate_data

    assert resolve_loss("stable_reinforce", {})[1] == {"ratio_cap": 2.0, "mask_low": 0.5, "mask_high": 5.0,
                                                       "sequence_level": 0.0, "kl_coeff": 0.0}
    assert resolve_loss("stable_reinforce", {"kl_coeff": 0.01})[1]["kl_coeff"] == 0.01
    assert resolve_loss("gspo", {}) == ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    for name, config, field in [
        ("stable_reinforce", {"kl_penalty_coef": 0.1}, "loss_fn_config.kl_penalty_coef"),
        ("stable_reinforce", {"kl_coeff": -0.1}, "loss_fn_config.kl_coeff"),
        ("stable_reinforce", {"mask_low": 1.5}, "loss_fn_config.mask_low"),
        ("stable_reinforce", {"mask_high": 0.9}, "loss_fn_config.mask_high"),
        ("stable_reinforce", {"ratio_cap": 0.0}, "loss_fn_config.ratio_cap"),
        ("stable_reinforce", {"sequence_level": 0.5}, "loss_fn_config.sequence_level"),
        ("gspo", {"beta": 0.1}, "loss_fn_config.beta"),
        ("gspo", {"clip_low_threshold": 1.3}, "loss_fn_config.clip_low_threshold"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            resolve_loss(name, config)
        assert info.value.field == field, (name, config)

    limits = {"vocab_size": 261, "max_context_length": 64, "max_batch_datums": 8, "max_request_tokens": 512}
    good = DatumPayload([5, 6, 7], [6, 7, 8], (), [0.0, -1.0, -2.0], [0.0, 1.0, 1.0], [0.0, 1.0, 2.0])
    (datum,), _, _ = validate_data([good], "stable_reinforce", {}, **limits)
    assert datum.weights.tolist() == [0.0, 1.0, 2.0]
    for loss, payload, field in [
        ("stable_reinforce", dataclasses.replace(good, sequence_ratio_mask=[0.0, 1.5, 1.0]),
         "data[0].sequence_ratio_mask"),
        ("stable_reinforce", dataclasses.replace(good, sequence_ratio_mask=[0.0, -1.0, 1.0]),
         "data[0].sequence_ratio_mask"),
        ("gspo", dataclasses.replace(good, sequence_ratio_mask=[1.0]), "data[0].sequence_ratio_mask"),
        ("ppo", good, "data[0].sequence_ratio_mask"),
        ("stable_reinforce", dataclasses.replace(good, logprobs=()), "data[0].logprobs"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            validate_data([payload], loss, {}, **limits)
        assert info.value.field == field, (loss, payload)


def test_stable_reinforce_improves_on_stale_samples_where_importance_sampling_collapses(backend):
    """Off-policy training, deterministic: one batch sampled from the initial policy (q recorded then) is trained on
    for 30 optimizer steps, so by the end the data is 30 steps stale. The task: the next token after a fixed prompt,
    reward 1 for a "good" token (every 7th id). One sample is an unlucky one a noisy reward would produce: the
    least likely bad token, rewarded. Its importance weight p/q is unbounded, so importance_sampling ends up putting
    almost all mass on it (the expected reward collapses); stable_reinforce caps and then masks its weight and
    keeps improving the expected reward."""
    prompt = [17, 42, 99, 7, 120, 64]
    vocab = backend.description.vocab_size
    good = torch.zeros(vocab, dtype=torch.bool)
    good[torch.arange(0, vocab, 7)] = True

    def next_token_probs(state) -> torch.Tensor:
        adapter = AdapterTensors.from_params(state.params, state.spec)
        with torch.no_grad(), lora_routing(backend.base.model, [adapter]):
            return torch.softmax(backend.base.model(torch.tensor([prompt])).logits[0, -1].double(), -1)

    def train(loss: str):
        state = make_state(backend, 5)
        p0 = next_token_probs(state)
        actions = torch.multinomial(p0.float(), 24, replacement=True,
                                    generator=torch.Generator().manual_seed(0)).tolist()
        unlucky = min((a for a in range(vocab) if not good[a]), key=lambda a: float(p0[a]))
        actions.append(unlucky)
        rewards = [float(good[a]) for a in actions[:-1]] + [1.0]
        baseline = sum(rewards) / len(rewards)
        data = []
        for action, reward in zip(actions, rewards):
            advantages, q = torch.zeros(len(prompt)), torch.zeros(len(prompt))
            advantages[-1], q[-1] = reward - baseline, float(torch.log(p0[action]))
            data.append(DatumInput(torch.tensor(prompt), torch.tensor(prompt[1:] + [action]), None, q, advantages))
        name, config = resolve_loss(loss, {})
        optimizer = torch.optim.Adam(list(state.params.values()), lr=0.02)
        for _ in range(30):
            (result,) = backend.run([BatchItem(state, data, name, config)], backward=True)
            assert all(torch.isfinite(p.grad).all() for p in state.params.values())
            optimizer.step()
            optimizer.zero_grad()
        p = next_token_probs(state)
        return float(p0[good].sum()), float(p[good].sum()), float(p[unlucky] / p0[unlucky]), result

    start, is_end, is_ratio, _ = train("importance_sampling")
    assert is_end < start / 5, (start, is_end)
    assert is_ratio > 1000  # the stale sample's importance weight ran away

    start, sr_end, sr_ratio, result = train("stable_reinforce")
    assert sr_end > 2 * start, (start, sr_end)
    assert math.isfinite(result.metrics["loss:sum"])
    # The unlucky sample left the trust band and contributes nothing any more.
    assert sr_ratio > 5 and result.outputs[-1].elementwise_loss[-1] == 0.0
