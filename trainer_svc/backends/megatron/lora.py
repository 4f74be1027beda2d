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

Routing: a batch ``[b, s]`` is split into contiguous row ranges, each with its own adapter (or none). One adapter:
the plain PEFT term. Several: their A's and B's are stacked along the rank dimension and a per-row mask keeps each
row's own block (see ``MegatronLora._delta``), so each adapter's gradient comes only from its own rows.
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


_local = threading.local()  # the active routing, per thread


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
        previous = getattr(_local, "routing", None)
        _local.routing = _Routing(list(segments))
        try:
            yield
        finally:
            _local.routing = previous

    # -- hooks --------------------------------------------------------------------------------------------------

    def _hook(self, layer: int, kind: str):
        def hook(_module, inputs, output):
            routing = getattr(_local, "routing", None)
            if routing is None or not routing.active:
                return None
            out, bias = output
            delta = self._delta(layer, kind, inputs[0], out, routing)
            if delta is None:
                return None
            return out + delta.to(out.dtype), bias

        return hook

    def _delta(self, layer: int, kind: str, x: torch.Tensor, out: torch.Tensor, routing: _Routing):
        """LoRA delta for the whole batch ``x[s, b, in_local]``.

        One adapter over every row: ``scale * B (A x)`` per projection. Several adapters: their A's are stacked
        along the rank dimension and their B's along the rank dimension too, ``A_cat x`` is multiplied by a
        per-row mask that keeps only the row's own adapter's rank block (times its scale, zero elsewhere), then
        ``B_cat``. Each row thus gets exactly its adapter's ``scale * B (A x)`` (the other blocks add exact
        zeros) and each adapter's gradient comes only from its rows; the number of kernels does not grow with
        the number of adapters.
        """
        cd = self.compute_dtype
        xs = x.to(cd)
        targets = QKV_TARGETS if kind == "qkv" else FC1_TARGETS if kind == "fc1" else (kind,)
        row_parallel = kind in ("o_proj", "down_proj")
        deltas = {}
        for t in targets:
            members = [(seg, seg.adapter.modules[(layer, t)]) for seg in routing.with_adapter
                       if (layer, t) in seg.adapter.modules]
            if not members:
                continue
            if len(members) == 1 and routing.single and members[0][0].end == x.shape[1]:
                seg, (a, b) = members[0]
                mid = _row_mid(xs, a.to(cd), self.tp) if row_parallel else _column_mid(xs, a.to(cd), self.tp)
                deltas[t] = (mid @ b.to(cd).t()) * seg.adapter.scale
                continue
            a_cat = torch.cat([a for _, (a, _) in members], 0).to(cd)
            b_cat = torch.cat([b for _, (_, b) in members], 1).to(cd)
            mid = _row_mid(xs, a_cat, self.tp) if row_parallel else _column_mid(xs, a_cat, self.tp)
            deltas[t] = (mid * routing.mask(members, x.shape[1], cd, x.device)) @ b_cat.t()
        if not deltas:
            return None
        if row_parallel:
            return deltas[kind]
        if kind == "qkv":
            return place_qkv_delta(deltas.get("q_proj"), deltas.get("k_proj"), deltas.get("v_proj"),
                                   self.groups_local, self.shape.heads_per_group, self.shape.head_dim,
                                   out if out.dtype == cd else out.to(cd))
        return place_gate_up_delta(deltas.get("gate_proj"), deltas.get("up_proj"), self.ffn_local,
                                   out if out.dtype == cd else out.to(cd))


class _Routing:
    """One batch's row ranges and the masks derived from them (cached per set of participating adapters)."""

    def __init__(self, segments: list[RowSegment]):
        self.segments = segments
        self.with_adapter = [s for s in segments if s.adapter is not None]
        self.active = bool(self.with_adapter)
        # One adapter covering every row of the batch: no mask needed.
        self.single = len(segments) == 1 and len(self.with_adapter) == 1 and segments[0].start == 0
        self._masks: dict[tuple, torch.Tensor] = {}

    def mask(self, members, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
        """``[1, batch, Σ ranks]``: row r, rank block of adapter k = scale_k if r is k's row, else 0."""
        key = tuple((seg.start, seg.end, a.shape[0], seg.adapter.scale) for seg, (a, _) in members) + (batch,)
        m = self._masks.get(key)
        if m is None:
            total = sum(a.shape[0] for _, (a, _) in members)
            host = torch.zeros(batch, total, dtype=dtype)
            col = 0
            for seg, (a, _) in members:
                host[seg.start : seg.end, col : col + a.shape[0]] = seg.adapter.scale
                col += a.shape[0]
            m = self._masks[key] = host.to(device, non_blocking=True).unsqueeze(0)
        return m


def is_column_parallel(target: str) -> bool:
    return target in COLUMN_PARALLEL_TARGETS
