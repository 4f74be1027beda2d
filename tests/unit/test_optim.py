"""OptimStep = torch.optim.AdamW (decoupled weight decay) + global-norm clipping; non-finite gradients skip."""

from __future__ import annotations

import math

import pytest
import torch

from loraplane.errors import InvalidArgument
from trainer_svc.optimizer import AdamHyper, adamw_step


def tensors(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in ((4, 8), (8, 4), (3, 5))]


def grads_for(step: int, shapes, scale: float):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=generator) * scale for s in shapes]


@pytest.mark.parametrize("hyper", [
    AdamHyper(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0),
    AdamHyper(learning_rate=3e-2, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
    AdamHyper(learning_rate=3e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.5),
])
def test_parity_with_torch_adamw_over_several_steps(hyper):
    ours = [t.clone().requires_grad_(True) for t in tensors(1)]
    theirs = [t.clone().requires_grad_(True) for t in tensors(1)]
    exp_avg = [torch.zeros_like(t) for t in ours]
    exp_avg_sq = [torch.zeros_like(t) for t in ours]
    reference = torch.optim.AdamW(theirs, lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                                  weight_decay=hyper.weight_decay)
    step = 0
    clipped_any = False
    for i in range(6):
        grads = grads_for(i, [t.shape for t in ours], scale=1.0 + i)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        norm_before = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        if hyper.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(theirs, hyper.grad_clip_norm)
            clipped_any |= norm_before > hyper.grad_clip_norm
        reference.step()
        reference.zero_grad()
        outcome = adamw_step(ours, exp_avg, exp_avg_sq, step, hyper)
        step = outcome.step
        assert not outcome.skipped and outcome.step == i + 1
        assert outcome.grad_norm == pytest.approx(norm_before, rel=1e-6)
        for mine, ref in zip(ours, theirs):
            assert torch.equal(mine.detach(), ref.detach())
            assert mine.grad is None  # grads are zeroed after a step
        for mine, ref in zip(exp_avg, theirs):
            assert torch.equal(mine, reference.state[ref]["exp_avg"])
        for mine, ref in zip(exp_avg_sq, theirs):
            assert torch.equal(mine, reference.state[ref]["exp_avg_sq"])
    if hyper.grad_clip_norm:
        assert clipped_any


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_skips_and_changes_nothing(bad):
    params = [t.clone().requires_grad_(True) for t in tensors(2)]
    exp_avg = [torch.randn_like(t) for t in params]
    exp_avg_sq = [torch.rand_like(t) for t in params]
    before = ([p.detach().clone() for p in params], [m.clone() for m in exp_avg], [v.clone() for v in exp_avg_sq])
    for i, p in enumerate(params):
        p.grad = torch.ones_like(p)
    params[1].grad[2, 1] = bad
    outcome = adamw_step(params, exp_avg, exp_avg_sq, 7, AdamHyper(learning_rate=0.1, weight_decay=0.1,
                                                                   grad_clip_norm=1.0))
    assert outcome.skipped and outcome.step == 7 and not math.isfinite(outcome.grad_norm)
    for now, then in zip(params, before[0]):
        assert torch.equal(now.detach(), then)
    for now, then in zip(exp_avg, before[1]):
        assert torch.equal(now, then)
    for now, then in zip(exp_avg_sq, before[2]):
        assert torch.equal(now, then)
    assert all(p.grad is None for p in params)


def test_zero_gradient_step_is_not_a_no_op():
    # Why the skip must not be implemented as "zero the grads and step": AdamW with zero grads still decays and
    # applies the momentum.
    params = [torch.ones(3, requires_grad=True)]
    exp_avg, exp_avg_sq = [torch.full((3,), 0.5)], [torch.full((3,), 0.25)]
    params[0].grad = torch.zeros(3)
    adamw_step(params, exp_avg, exp_avg_sq, 1, AdamHyper(learning_rate=0.1, weight_decay=0.1))
    assert not torch.equal(params[0].detach(), torch.ones(3))


@pytest.mark.parametrize("field,value", [
    ("learning_rate", -1.0), ("learning_rate", float("nan")), ("beta1", 1.0), ("beta2", 1.5), ("eps", -1e-8),
    ("weight_decay", float("inf")), ("grad_clip_norm", -0.1),
])
def test_hyper_parameters_are_validated(field, value):
    with pytest.raises(InvalidArgument) as info:
        AdamHyper(**{field: value}).validate()
    assert info.value.field == f"adam_params.{field}"
