"""AdamW step with exactly torch.optim.AdamW semantics, per-request hyper-parameters, global-norm clipping and a
non-finite skip.

The update is torch's own multi-tensor ("foreach") AdamW arithmetic, written out with the same `torch._foreach_*`
calls and the same Python-float bias corrections as `torch.optim.adam._multi_tensor_adam` (non-capturable,
decoupled weight decay). On CPU those foreach ops run torch's per-tensor kernels, so every element is bit-identical
to `torch.optim.AdamW()` with its CPU default (the single-tensor path); tests/unit/test_optim.py checks that over
several steps. It replaces a throwaway `torch.optim.AdamW` per step, whose Python per-tensor loop (hundreds of
tensors per adapter: 2 per projection per layer) cost ~4x the arithmetic itself, and which the norm computed twice.
Clipping is torch's `get_total_norm` + `clip_grads_with_norm_` arithmetic, with the norm computed once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loraplane.errors import InvalidArgument
from loraplane.threads import share_work

ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class AdamHyper:
    """Tinker's defaults. learning_rate None = not given by the caller, which `validate` rejects: the wire format
    has no default for it."""

    learning_rate: float | None = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def validate(self) -> AdamHyper:
        if self.learning_rate is None:
            raise InvalidArgument("adam_params.learning_rate is required (> 0)", field="adam_params.learning_rate")
        for name in ADAM_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise InvalidArgument(f"adam_params.{name} must be finite, got {value}", field=f"adam_params.{name}")
        # Zero eps divides 0 by 0 wherever a gradient is exactly zero (all of lora_A on the first step), and a
        # zero learning rate is a caller's mistake, not a no-op step: both are refused rather than obeyed.
        for name in ("learning_rate", "eps"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"adam_params.{name} must be > 0, got {getattr(self, name)}",
                                      field=f"adam_params.{name}")
        for name in ("weight_decay", "grad_clip_norm"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"adam_params.{name} must be >= 0, got {getattr(self, name)}",
                                      field=f"adam_params.{name}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InvalidArgument(f"adam_params.{name} must be in [0, 1), got {getattr(self, name)}",
                                      field=f"adam_params.{name}")
        # The step's scalars (lr / (1 - beta1) at step 1, lr * weight_decay, eps, the clip norm) meet float32
        # tensors: one beyond float32 is torch's overflow error, an INTERNAL failure, not the caller's error.
        for name, value in (("learning_rate", self.learning_rate / (1.0 - self.beta1)),
                            ("learning_rate", self.learning_rate * self.weight_decay), ("eps", self.eps),
                            ("weight_decay", self.weight_decay), ("grad_clip_norm", self.grad_clip_norm)):
            if value > FLOAT32_MAX:
                raise InvalidArgument(f"adam_params.{name} {getattr(self, name)} is too large: the update's scalars "
                                      f"must fit float32 (<= {FLOAT32_MAX:.4g})", field=f"adam_params.{name}")
        return self


@dataclass
class StepOutcome:
    step: int
    grad_norm: float
    skipped: bool


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The same norm torch.nn.utils.clip_grad_norm_ computes (norm of the per-tensor L2 norms)."""
    if not grads:
        return torch.tensor(0.0)
    return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)


def adamw_step(params: list[torch.Tensor], exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], step: int,
               hyper: AdamHyper) -> StepOutcome:
    """Applies one AdamW step in place to `params` (leaf tensors whose .grad holds the accumulated gradient),
    then zeroes the grads. Non-finite gradients: nothing but the grads changes (they are zeroed)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    norm = global_grad_norm(grads)
    grad_norm = float(norm)
    if not math.isfinite(grad_norm):
        _zero_grads(params)
        return StepOutcome(step=step, grad_norm=grad_norm, skipped=True)
    if params:
        with torch.no_grad():
            if hyper.grad_clip_norm > 0:
                # torch.nn.utils.clip_grads_with_norm_'s arithmetic, on the grads themselves.
                torch._foreach_mul_(grads, torch.clamp(hyper.grad_clip_norm / (norm + 1e-6), max=1.0))
            def one(group: list[int]) -> None:
                _foreach_adamw([params[i] for i in group], [grads[i] for i in group], [exp_avg[i] for i in group],
                               [exp_avg_sq[i] for i in group], step + 1, hyper)

            groups = _cache_groups(params)
            if params[0].device.type == "cpu":
                # Per-tensor kernels this small run single-threaded anyway: two threads take groups in turn.
                share_work(groups, one)
            else:
                for group in groups:
                    one(group)
    _zero_grads(params)
    return StepOutcome(step=step + 1, grad_norm=grad_norm, skipped=False)


# AdamW makes ~8 elementwise passes over params, grads and moments. Run on all of an adapter's tensors at once
# (rank 16 on SmolLM2: 4.9M parameters, 78 MB of state), every pass streams them from DRAM; run group by group,
# each group's ~2 MB stays in cache across its passes. Elementwise ops per tensor give the same bits either way.
CACHE_GROUP_BYTES = 2 << 20


def _cache_groups(params: list[torch.Tensor]) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    size = 0
    for index, p in enumerate(params):
        nbytes = 4 * p.numel() * p.element_size()  # param, grad, exp_avg, exp_avg_sq
        if groups[-1] and size + nbytes > CACHE_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += nbytes
    return groups


def _foreach_adamw(params, grads, exp_avgs, exp_avg_sqs, step: int, hyper: AdamHyper) -> None:
    """torch.optim.adam._multi_tensor_adam for AdamW (decoupled weight decay, no amsgrad/maximize), every tensor at
    the same `step` (already incremented). torch keeps the step as a float32 tensor and reads it back as a Python
    float, so the bias corrections use float32(step) exactly as it does."""
    lr, beta1, beta2, eps, weight_decay = (hyper.learning_rate, hyper.beta1, hyper.beta2, hyper.eps,
                                           hyper.weight_decay)
    step_value = float(torch.tensor(float(step), dtype=torch.float32))
    params = [p.detach() for p in params]
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction1 = 1 - beta1 ** step_value
    bias_correction2 = 1 - beta2 ** step_value
    step_size = (lr / bias_correction1) * -1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def _zero_grads(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None
