"""AdamW step with exactly torch.optim.AdamW semantics, per-request hyper-parameters, global-norm clipping and a
non-finite skip.

torch.optim.AdamW itself does the update (single-tensor path, foreach=False) on the adapter's own moment tensors,
which we hand it as its state; so parity with a user's torch.optim.AdamW loop is by construction, not by
re-implementation. A throwaway optimizer object per step costs microseconds next to a forward/backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loraplane.errors import InvalidArgument

ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


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
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)


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
    for p, g in zip(params, grads):
        p.grad = g
    if hyper.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, hyper.grad_clip_norm, foreach=False)
    optimizer = torch.optim.AdamW(params, lr=hyper.learning_rate, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                                  weight_decay=hyper.weight_decay, foreach=False)
    step_tensor = torch.tensor(float(step), dtype=torch.float32)
    for p, m, v in zip(params, exp_avg, exp_avg_sq):
        # AdamW keeps one step counter per tensor; they always agree here, so each gets its own copy of ours.
        optimizer.state[p] = {"step": step_tensor.clone(), "exp_avg": m, "exp_avg_sq": v}
    optimizer.step()
    _zero_grads(params)
    return StepOutcome(step=step + 1, grad_norm=grad_norm, skipped=False)


def _zero_grads(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None
