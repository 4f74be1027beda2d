"""PEFT per-projection LoRA on megatron-core's fused, tensor-parallel linears.

Forward hooks on ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and ``linear_fc2`` of every decoder layer add
each routed adapter's delta to the base output (the module tree and its state dict stay untouched). For q, k, v
(and gate, up) the per-projection deltas ``scale * B_p (A_p x)`` are computed separately and placed in the fused
layout (GQA interleave, gate|up halves) by :mod:`.layout`, so the adapter is exactly the PEFT one.

Tensor parallel (no sequence parallel):
  * column-parallel targets (q, k, v, gate, up): A in full, B's local row chunk. The low-rank activation
    ``A x`` passes ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so A's
    gradient and the input gradient of the LoRA path sum every rank's share of B.
  * row-parallel targets (o, down): A's local column chunk, B in full. ``A_local x_local`` passes
    ``reduce_from_tensor_model_parallel_region`` (all-reduce forward), so every rank holds the full low-rank
    activation, and B's gradient is identical on every rank.

Routing: a batch ``[b, s]`` is split into contiguous row ranges, each with its own adapter (or none); each
adapter's delta is computed from its rows only, so its gradient lands only in its own tensors.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .layout import COLUMN_PARALLEL_TARGETS, LlamaShape, place_gate_up_delta, place_qkv_delta

QKV_TARGETS = ("q_proj", "k_proj", "v_proj")
FC1_TARGETS = ("gate_proj", "up_proj")


@dataclass(eq=False)
class LocalAdapter:
    """One adapter's tensors as this rank uses them: (layer, target) → (A_local, B_local), plus its scale."""

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scale: float


@dataclass(frozen=True)
class RowSegment:
    start: int
    end: int
    adapter: LocalAdapter | None


_local = threading.local()


def _tp() -> tuple[int, object]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state


def _column_mid(x: torch.Tensor, a: torch.Tensor, tp: int) -> torch.Tensor:
    mid = x @ a.t()
    if tp > 1:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        mid = copy_to_tensor_model_parallel_region(mid)
    return mid


def _row_mid(x: torch.Tensor, a_local: torch.Tensor, tp: int) -> torch.Tensor:
    mid = x @ a_local.t()
    if tp > 1:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        mid = reduce_from_tensor_model_parallel_region(mid)
    return mid


class MegatronLora:
    """Installs the hooks on a GPTModel once; :meth:`route` selects adapters per batch-row range."""

    def __init__(self, model, shape: LlamaShape, compute_dtype: torch.dtype = torch.float32):
        tp, _ = _tp()
        self.shape = shape
        self.tp = tp
        self.compute_dtype = compute_dtype
        self.groups_local = shape.num_kv_heads // tp
        self.ffn_local = shape.ffn_hidden_size // tp
        self._handles = []
        for i, layer in enumerate(model.decoder.layers):
            attn, mlp = layer.self_attention, layer.mlp
            self._handles += [
                attn.linear_qkv.register_forward_hook(self._hook(i, "qkv")),
                attn.linear_proj.register_forward_hook(self._hook(i, "o_proj")),
                mlp.linear_fc1.register_forward_hook(self._hook(i, "fc1")),
                mlp.linear_fc2.register_forward_hook(self._hook(i, "down_proj")),
            ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def route(self, segments: Sequence[RowSegment]) -> Iterator[None]:
        previous = getattr(_local, "segments", None)
        _local.segments = list(segments)
        try:
            yield
        finally:
            _local.segments = previous

    # -- hooks --------------------------------------------------------------------------------------------------

    def _hook(self, layer: int, kind: str):
        def hook(_module, inputs, output):
            segments = getattr(_local, "segments", None)
            if not segments:
                return None
            out, bias = output
            x = inputs[0]  # [s, b, in_local]
            delta = self._delta(layer, kind, x, out, segments)
            if delta is None:
                return None
            return out + delta.to(out.dtype), bias

        return hook

    def _delta(self, layer: int, kind: str, x: torch.Tensor, out: torch.Tensor, segments) -> torch.Tensor | None:
        s, b = out.shape[0], out.shape[1]
        pieces: list[torch.Tensor] = []
        any_delta = False
        cursor = 0
        for seg in segments:
            if seg.start > cursor:
                pieces.append(out.new_zeros(s, seg.start - cursor, out.shape[2], dtype=self.compute_dtype))
            xs = x[:, seg.start : seg.end].to(self.compute_dtype)
            like = out[:, seg.start : seg.end]
            d = None if seg.adapter is None else self._segment_delta(layer, kind, xs, like, seg.adapter)
            if d is None:
                pieces.append(out.new_zeros(s, seg.end - seg.start, out.shape[2], dtype=self.compute_dtype))
            else:
                pieces.append(d)
                any_delta = True
            cursor = seg.end
        if not any_delta:
            return None
        if cursor < b:
            pieces.append(out.new_zeros(s, b - cursor, out.shape[2], dtype=self.compute_dtype))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _segment_delta(self, layer, kind, xs, like, adapter: LocalAdapter) -> torch.Tensor | None:
        cd = self.compute_dtype
        like = like.to(cd) if like.dtype != cd else like

        def pair(target):
            p = adapter.modules.get((layer, target))
            return None if p is None else (p[0].to(cd), p[1].to(cd))

        if kind in ("o_proj", "down_proj"):
            p = pair(kind)
            if p is None:
                return None
            a_local, b_full = p
            return (_row_mid(xs, a_local, self.tp) @ b_full.t()) * adapter.scale

        targets = QKV_TARGETS if kind == "qkv" else FC1_TARGETS
        deltas = {}
        for t in targets:
            p = pair(t)
            if p is not None:
                a_full, b_local = p
                deltas[t] = (_column_mid(xs, a_full, self.tp) @ b_local.t()) * adapter.scale
        if not deltas:
            return None
        if kind == "qkv":
            return place_qkv_delta(
                deltas.get("q_proj"),
                deltas.get("k_proj"),
                deltas.get("v_proj"),
                self.groups_local,
                self.shape.heads_per_group,
                self.shape.head_dim,
                like,
            )
        return place_gate_up_delta(deltas.get("gate_proj"), deltas.get("up_proj"), self.ffn_local, like)


def is_column_parallel(target: str) -> bool:
    return target in COLUMN_PARALLEL_TARGETS
