"""Which of the megatron backend's elementwise chains run as compiled (fused) kernels, and the one helper that
compiles them.

On a GPU an elementwise chain costs what its memory traffic costs: ``x * cos + rotate_half(x) * sin`` run op by
op reads and writes ``[tokens, heads, head_dim]`` five times (and twice more for the rotate-half's concatenation),
once per layer in the forward, again in a recomputed forward, and again in the backward. At Llama-8B 16 x 2048 such
chains were 22% of the step (docs/benchmarks.md, run tvp6). A compiled chain reads its inputs once and writes its
output once, in both directions. The math per element is the same; only intermediate bf16 roundings go away.

Parts (``LORAPLANE_MEGATRON_COMPILE``: ``1``/``all`` (default), ``0``/``none``, or a comma list of them, which is
how a benchmark measures one part against the others in the same build):
  * ``logprob``: the per-token log-softmax chunks of :class:`.model._TargetLogprob`;
  * ``swiglu``: megatron's own fused SwiGLU (``bias_activation_fusion``), which also keeps half the MLP
    activations the unfused ``silu(a) * (b + 0)`` keeps for its backward;
  * ``rope``: the rotary embedding, applied by the packed core attention (:mod:`.attention`) to the batch's
    angles, computed once per batch.
Only on CUDA: on a CPU the eager chains are what runs (and what the CPU tests compare bit for bit).
"""

from __future__ import annotations

import os

import torch

PARTS = ("logprob", "swiglu", "rope")


def compiles(part: str, device: torch.device) -> bool:
    """Whether ``part`` runs compiled on ``device``."""
    if part not in PARTS:
        raise ValueError(f"unknown compiled part {part!r}: one of {PARTS}")
    if torch.device(device).type != "cuda":
        return False
    value = os.environ.get("LORAPLANE_MEGATRON_COMPILE", "1").strip().lower()
    if value in ("1", "all", ""):
        return True
    if value in ("0", "none"):
        return False
    return part in {p.strip() for p in value.split(",")}


class CompiledOrEager:
    """``torch.compile(fn)``, falling back to ``eager`` for good if compiling fails (no compiler toolchain)."""

    def __init__(self, fn, eager, **compile_options):
        self.eager = eager
        self.compiled = torch.compile(fn, **compile_options)
        self.failed = False

    def __call__(self, *args):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception:  # noqa: BLE001 - the eager math is the same
                self.failed = True
        return self.eager(*args)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention (HF Llama's and megatron's non-interleaved one): ``x * cos +
    rotate_half(x) * sin`` over the last dimension, with megatron's order of operations."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


# dynamic: a packed row's length changes from batch to batch; one kernel serves them all.
_ROTATE_COMPILED = CompiledOrEager(rotate, rotate, dynamic=True)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _ROTATE_COMPILED(x, cos, sin) if compiles("rope", x.device) else rotate(x, cos, sin)
