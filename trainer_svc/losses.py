"""Losses, summed over tokens and datums (never averaged), exactly as DESIGN.md defines them.

With lp the learner logprob of each target token, q the sampler logprob, A the advantage, r = exp(lp - q):
  cross_entropy        -lp * w                       (w real, may be negative; default 1)
  importance_sampling  -r * A
  ppo                  -min(r * A, clamp(r, lo, hi) * A)          lo/hi absolute ratio bounds (0.8 / 1.2)
  cispo                -stopgrad(clamp(r, lo, hi)) * lp * A
  dro                  -(lp * A - 0.5 * beta * (lp - q)^2)         beta 0.05
Each function returns the per-token loss; the datum's elementwise_loss is that vector and loss:sum is the total.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from loraplane.errors import InvalidArgument


@dataclass(frozen=True)
class LossDef:
    fn: Callable[..., torch.Tensor]
    defaults: Mapping[str, float]
    # Datum fields that must be present (same length as input_tokens).
    requires: tuple[str, ...]


def _cross_entropy(lp, *, weights, **_):
    return -lp * weights


def _importance_sampling(lp, *, q, advantages, **_):
    return -torch.exp(lp - q) * advantages


def _ppo(lp, *, q, advantages, clip_low_threshold, clip_high_threshold, **_):
    ratio = torch.exp(lp - q)
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _cispo(lp, *, q, advantages, clip_low_threshold, clip_high_threshold, **_):
    ratio = torch.exp(lp - q).detach()
    return -torch.clamp(ratio, clip_low_threshold, clip_high_threshold) * lp * advantages


def _dro(lp, *, q, advantages, beta, **_):
    return -(lp * advantages - 0.5 * beta * (lp - q) ** 2)


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossDef] = {
    "cross_entropy": LossDef(_cross_entropy, {}, ()),
    "importance_sampling": LossDef(_importance_sampling, {}, ("logprobs", "advantages")),
    "ppo": LossDef(_ppo, _CLIP, ("logprobs", "advantages")),
    "cispo": LossDef(_cispo, _CLIP, ("logprobs", "advantages")),
    "dro": LossDef(_dro, {"beta": 0.05}, ("logprobs", "advantages")),
}
DEFAULT_LOSS = "cross_entropy"


def supported_losses() -> list[str]:
    return list(LOSSES)


def resolve_loss(name: str, config: Mapping[str, float]) -> tuple[str, dict[str, float]]:
    """Checks the loss name and its config keys/values; returns (name, config with defaults filled in)."""
    name = name or DEFAULT_LOSS
    loss = LOSSES.get(name)
    if loss is None:
        raise InvalidArgument(f"loss_fn {name!r} is not one of {supported_losses()}", field="loss_fn")
    resolved = dict(loss.defaults)
    for key, value in config.items():
        if key not in loss.defaults:
            allowed = sorted(loss.defaults) or "none"
            raise InvalidArgument(f"loss_fn_config key {key!r} is not accepted by {name} (accepted: {allowed})",
                                  field=f"loss_fn_config.{key}")
        if not math.isfinite(value):
            raise InvalidArgument(f"loss_fn_config.{key} must be finite, got {value}", field=f"loss_fn_config.{key}")
        resolved[key] = float(value)
    if "clip_low_threshold" in resolved:
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        if not 0.0 <= low <= high:
            raise InvalidArgument(
                f"loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}",
                field="loss_fn_config.clip_low_threshold")
    if resolved.get("beta", 0.0) < 0:
        raise InvalidArgument(f"loss_fn_config.beta must be >= 0, got {resolved['beta']}", field="loss_fn_config.beta")
    return name, resolved


def elementwise_loss(name: str, config: Mapping[str, float], lp: torch.Tensor, *, weights: torch.Tensor | None,
                     q: torch.Tensor | None, advantages: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss of one datum (differentiable in lp)."""
    if weights is None:
        weights = torch.ones_like(lp)
    return LOSSES[name].fn(lp, weights=weights, q=q, advantages=advantages, **config)
