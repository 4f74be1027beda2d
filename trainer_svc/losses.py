"""Losses, summed over tokens and datums (never averaged), exactly as DESIGN.md defines them.

With lp the learner logprob of each target token, q the sampler logprob, A the advantage, r = exp(lp - q), sg() a
stop-gradient and m the datum's per-token `sequence_ratio_mask`:
  cross_entropy        -lp * w                       (w real, may be negative; default 1). With soft targets
                       (K targets per position, lp and w [N, K]) the position's loss is sum_k -lp[n, k] * w[n, k]
  importance_sampling  -r * A
  ppo                  -min(r * A, clamp(r, lo, hi) * A)          lo/hi absolute ratio bounds (0.8 / 1.2)
  cispo                -stopgrad(clamp(r, lo, hi)) * lp * A
  dro                  -(lp * A - 0.5 * beta * (lp - q)^2)         beta 0.05
  gspo                 -min(s_t * A, clamp(s_t, lo, hi) * A)      Tinker's GSPO-token (Zheng et al. 2025), lo/hi 0.8/1.2
        with M = {t : m_t != 0} (no mask sent: M = {t : A_t != 0}), s = exp(mean_{t in M} (sg(lp_t) - q_t))
        (0 when M is empty) and s_t = sg(s) * exp(lp_t - sg(lp_t)): every token carries the sequence ratio's value
        and its own logprob's gradient.
  stable_reinforce     loraplane's off-policy-robust REINFORCE; only tokens of a sampled sequence contribute:
        S_k = {t : m_t == k} for k = 1, 2, ... (one k per sampled sequence; no mask sent: one sequence,
        {t : A_t != 0}). Per-token log ratio d_t = sg(lp_t) - q_t; rho_t = exp(d_t), or with sequence_level = 1
        rho_t = exp(mean_{u in S_k} d_u) for t in S_k (the geometric-mean ratio of GSPO / sequence-level MIS).
          keep_t = [mask_low <= rho_t <= mask_high]           trust band: tokens (sequences) outside it are
                                                                dropped, IcePop (Ling Team 2025) / MIS (Liu et al.
                                                                2025, "When speed kills stability")
          w_t    = min(rho_t, ratio_cap)                      truncated importance weight, TIS (Yao et al. 2025,
                                                                "Your efficient RL framework secretly brings you
                                                                off-policy RL training")
          loss_t = keep_t * (-w_t * A_t * lp_t + kl_coeff * (exp(lp_t - q_t) - (lp_t - q_t) - 1))
        The last term is Schulman's k3 estimate of KL(sampler || learner) on the sampled tokens, a pull towards
        the policy that produced the data. q must be the logprobs recorded at sampling time (the gateway fills them
        from its record of the sampled sequence, never from the client). Defaults: ratio_cap 2, mask_low 0.5,
        mask_high 5, sequence_level 0, kl_coeff 0. On policy (q = lp) it is plain REINFORCE: -A * lp.
Each function returns the per-token loss of one datum (a Datum is one sampled sequence or several, never part of
one, so sequence-level terms never cross datums); the datum's elementwise_loss is that vector and loss:sum the total.
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
    # The loss reads the datum's sequence_ratio_mask (it reaches the loss in DatumInput.weights, which these losses
    # have no other use for); None when it was not sent.
    uses_sequence_mask: bool = False


def _cross_entropy(lp, *, weights, **_):
    loss = -lp * (torch.ones_like(lp) if weights is None else weights)
    # Soft targets: lp and weights are [N, K] (K candidate tokens per position); the position's loss is their sum.
    return loss.sum(-1) if lp.dim() == 2 else loss


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


def _gspo(lp, *, q, advantages, weights, clip_low_threshold, clip_high_threshold, **_):
    in_ratio = ((weights != 0) if weights is not None else (advantages != 0)).to(lp.dtype)
    # The mean over M without a host sync (the megatron engine calls this per datum on the device); 0 if M is empty.
    seq_log_ratio = ((lp.detach() - q) * in_ratio).sum() / in_ratio.sum().clamp(min=1)
    ratio = torch.exp(seq_log_ratio + lp - lp.detach())
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _sequence_ids(weights: torch.Tensor | None, advantages: torch.Tensor) -> torch.Tensor:
    """Per token: 0 outside every sampled sequence, k >= 1 inside the k-th (validation made them whole numbers)."""
    if weights is None:
        return (advantages != 0).long()
    return weights.round().long()


def _stable_reinforce(lp, *, q, advantages, weights, ratio_cap, mask_low, mask_high, sequence_level, kl_coeff,
                      **_):
    seq = _sequence_ids(weights, advantages)
    sampled = seq > 0
    log_ratio = lp.detach() - q
    if sequence_level:
        # Geometric-mean ratio per sampled sequence, broadcast back to its tokens (a float64 sum keeps long
        # sequences exact; groups are renumbered densely so any ids work).
        groups, index = torch.unique(seq, return_inverse=True)
        sums = torch.zeros(len(groups), dtype=torch.float64, device=lp.device).index_add_(0, index,
                                                                                       log_ratio.double())
        counts = torch.zeros(len(groups), dtype=torch.float64, device=lp.device).index_add_(
            0, index, torch.ones_like(log_ratio, dtype=torch.float64))
        log_ratio = (sums / counts)[index].to(lp.dtype)
    keep = sampled & (log_ratio >= math.log(mask_low)) & (log_ratio <= math.log(mask_high))
    # Ratios are only exponentiated where kept (in the band, so finite): a huge off-policy log ratio never turns
    # into inf * 0 = NaN, in the value or the gradient.
    zeros = torch.zeros_like(lp)
    weight = torch.where(keep, torch.exp(torch.clamp(log_ratio, max=math.log(ratio_cap))), zeros)
    loss = -weight * advantages * lp
    if kl_coeff:
        delta = torch.where(keep, lp - q, zeros)
        loss = loss + kl_coeff * torch.where(keep, torch.exp(delta) - delta - 1, zeros)
    return loss


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_STABLE = {"ratio_cap": 2.0, "mask_low": 0.5, "mask_high": 5.0, "sequence_level": 0.0, "kl_coeff": 0.0}
LOSSES: dict[str, LossDef] = {
    "cross_entropy": LossDef(_cross_entropy, {}, ()),
    "importance_sampling": LossDef(_importance_sampling, {}, ("logprobs", "advantages")),
    "ppo": LossDef(_ppo, _CLIP, ("logprobs", "advantages")),
    "cispo": LossDef(_cispo, _CLIP, ("logprobs", "advantages")),
    "dro": LossDef(_dro, {"beta": 0.05}, ("logprobs", "advantages")),
    "gspo": LossDef(_gspo, _CLIP, ("logprobs", "advantages"), uses_sequence_mask=True),
    "stable_reinforce": LossDef(_stable_reinforce, _STABLE, ("logprobs", "advantages"), uses_sequence_mask=True),
}
DEFAULT_LOSS = "cross_entropy"


def supported_losses() -> list[str]:
    return list(LOSSES)


def _check_stable_reinforce(resolved: dict[str, float]) -> None:
    def refuse(key: str, rule: str) -> None:
        raise InvalidArgument(f"loss_fn_config.{key} must be {rule}, got {resolved[key]}",
                              field=f"loss_fn_config.{key}")

    if resolved["ratio_cap"] <= 0:
        refuse("ratio_cap", "> 0")
    # The band must hold ratio 1, or on-policy data would train nothing.
    if not 0 < resolved["mask_low"] <= 1:
        refuse("mask_low", "in (0, 1]")
    if resolved["mask_high"] < 1:
        refuse("mask_high", ">= 1")
    if resolved["sequence_level"] not in (0.0, 1.0):
        refuse("sequence_level", "0 (token-level ratios) or 1 (one geometric-mean ratio per sampled sequence)")
    if resolved["kl_coeff"] < 0:
        refuse("kl_coeff", ">= 0")


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
    if name == "stable_reinforce":
        _check_stable_reinforce(resolved)
    return name, resolved


def elementwise_loss(name: str, config: Mapping[str, float], lp: torch.Tensor, *, weights: torch.Tensor | None,
                     q: torch.Tensor | None, advantages: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss of one datum (differentiable in lp). For the losses that read a sequence mask, `weights`
    carries the datum's sequence_ratio_mask (None = not sent)."""
    return LOSSES[name].fn(lp, weights=weights, q=q, advantages=advantages, **config)


def packed_targets(targets: list[torch.Tensor]) -> torch.Tensor:
    """The targets of a packed batch, datum after datum: [T] when every datum has one target per position; with
    soft targets ((N, K) target_tokens) [T, Kmax], each datum's K columns first, then padding no loss reads (a
    one-target datum's target repeated, token 0 after a shorter K), so one gather serves the whole batch."""
    width = max(t.shape[1] if t.dim() == 2 else 1 for t in targets)
    if width == 1:
        return torch.cat([t.reshape(-1) for t in targets])
    return torch.cat([t.view(-1, 1).expand(-1, width) if t.dim() == 1 or t.shape[1] == 1 else
                      torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in targets])


def own_targets(lp: torch.Tensor, k: int) -> torch.Tensor:
    """A datum's rows of a packed_targets gather cut to its own targets: [N] for one per position, [N, K] else."""
    if lp.dim() == 1:
        return lp
    return lp[:, 0] if k == 1 else lp[:, :k]
