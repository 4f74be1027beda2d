"""Dense LoRA: PEFT per-projection LoRA on megatron-core's fused, tensor-parallel linears, for one or many adapters
per batch; and :class:`MegatronLora`, which installs it on a model and hands the MoE layers their expert LoRA
(:mod:`.expert_lora`, which this module does not otherwise touch).

Layering: :mod:`.kernels` (grouped-GEMM primitives) and :mod:`.routing` (stored classes, row segments, the routing
in force) at the bottom; :mod:`.expert_lora` on them; :mod:`.moe` (the MoE layer) on that; this module beside it.

Forward hooks on ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and ``linear_fc2`` of every decoder layer (a Gated
DeltaNet layer's ``in_proj_qkv/z/b/a`` and ``out_proj`` instead of attention's; an MoE layer's shared expert's
``linear_fc1/fc2``) add the routed adapters' deltas to the base output (the module tree and its state dict stay untouched). For q, k, v (and
gate, up) the per-projection deltas ``scale * B_p (A_p x)`` are computed separately and placed in the fused layout
(GQA interleave, gate|up halves) by :mod:`.layout`, so the adapter is exactly the PEFT one.

Storage. Each adapter's tensors on this rank are grouped in *classes* (:func:`lora_classes`), one ``[L, G, r,
dim]`` tensor per class: the A's of the projections that share a hook input (q|k|v, gate|up) side by side, and
each B stored transposed (``B^T``, ``[r, out]``). A batch stacks its adapters with one ``cat`` (along the rank
dimension) or ``stack`` (grouped: along a new adapter dimension) per class, so a hook does the same number of
operations for one adapter as for eight.

One autograd node per hook. The LoRA tensors are not autograd leaves: :class:`_HookDelta` computes the delta in
its forward and, in its backward, the input gradient plus the A and B gradients, which it adds straight into the
batch's gradient sinks. A per-batch anchor leaf makes the first hook's output require grad. With hundreds of LoRA
tensors per adapter, per-tensor leaves (and their cat/split/accumulate nodes) cost more host time than the model.

Rows. The hooks see the batch as token rows (the packed ``[T, 1, h]`` of :mod:`.engine`, flattened to ``[T, h]``);
a :class:`RowSegment` routes one contiguous token range to one adapter. The engine packs each adapter's datums back
to back, so every adapter owns exactly one range.

Several adapters in one batch, grouped (the fast path): each adapter's rows against its own A and B with
``torch._grouped_mm`` and the cumulative row ends as offsets: ``x A^T`` and ``mid B^T`` (and the input gradient)
are 2-D x 3-D grouped products, the A and B gradients 2-D x 2-D ones whose contraction (the rows) is split per
adapter, giving ``[n, r, dim]`` straight into each adapter's slice of the gradient sink. Each row costs its own
adapter's rank, not Σr. Taken when the adapters share one rank, the kernel exists for the device and compute dtype
(:func:`grouped_mm_supported`: bf16 on sm90 on CUDA) and the feature dims meet its 16-byte stride alignment.

Otherwise, the mask: ``A_cat x`` (all adapters' ranks stacked) is multiplied by a per-row 0/1 mask that keeps each
row's own adapter's rank block, then by ``B_cat^T``. Either way each adapter's scale rides on its rank rows of the
stacked ``B^T`` (the fp32 master times the scale, rounded once to the compute dtype: the 0/1 mask product is exact
in bf16, and both modes multiply by the same bf16 B), each row gets exactly its adapter's ``scale * B (A x)`` and
each adapter's gradient comes only from its rows.

Tensor parallel (no sequence parallel):
  * column-parallel targets (q, k, v, gate, up): A in full, B's local row chunk. The gradient of the low-rank
    activation ``A x`` is all-reduced over the TP group (what ``copy_to_tensor_model_parallel_region`` does), so
    A's gradient and the input gradient sum every rank's share of B.
  * row-parallel targets (o, down): A's local column chunk, B in full. ``A_local x_local`` is all-reduced in the
    forward (``reduce_from_tensor_model_parallel_region``), so every rank holds the full low-rank activation, and
    B's gradient is identical on every rank.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import routing as _routing
from .expert_lora import ExpertBatch, ExpertLora
from .kernels import aligned, grouped_mm_supported
from .layout import LlamaShape, interleave_gated_qkv, interleave_qkv, split_gated_qkv, split_qkv
from .routing import AdapterTensors, LoraClass, RowSegment

__all__ = ["HOOK_TARGETS", "AdapterTensors", "BatchRouting", "LoraClass", "MegatronLora", "RowSegment",
           "a_class_name", "b_class_name", "grouped_mm_supported", "lora_classes"]

HOOK_TARGETS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "fc1": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
    # Qwen3.5's Gated DeltaNet layers (:mod:`.gated_delta_net`): Tinker's three pairs on the fused in_proj_qkv's
    # Q, K and V rows, then the unfused in_proj_z/b/a and out_proj.
    "in_proj_qkv": ("in_proj_q", "in_proj_k", "in_proj_v"),
    "in_proj_z": ("in_proj_z",),
    "in_proj_b": ("in_proj_b",),
    "in_proj_a": ("in_proj_a",),
    "out_proj": ("out_proj",),
    # An MoE layer's shared expert (Qwen3.5-MoE; megatron's SharedExpertMLP): like the dense MLP's.
    "shared_fc1": ("shared_expert.gate_proj", "shared_expert.up_proj"),
    "shared_fc2": ("shared_expert.down_proj",),
}
ROW_PARALLEL_HOOKS = ("o_proj", "down_proj", "out_proj", "shared_fc2")
SHARED_EXPERT_HOOKS = ("shared_fc1", "shared_fc2")
# Hooks on one column-parallel output holding several projections' columns side by side (this rank's share of each).
FUSED_COLUMN_HOOKS = ("fc1", "in_proj_qkv", "shared_fc1")
LINEAR_ATTENTION_HOOKS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ATTENTION_HOOKS = ("qkv", "o_proj")


def model_hooks(shape: LlamaShape) -> tuple[str, ...]:
    """The hooks a model of this shape has: attention's where some layer attends, the Gated DeltaNet's where some
    layer is one, the dense MLP's always (an MoE model's stay zero: the flat layout's order does not depend on it)."""
    return tuple(h for h in HOOK_TARGETS
                 if (h not in ATTENTION_HOOKS or shape.attention_layers)
                 and (h not in LINEAR_ATTENTION_HOOKS or shape.linear_layers)
                 and (h not in SHARED_EXPERT_HOOKS or shape.shared_ffn_hidden_size))


def a_class_name(hook: str) -> str:
    return f"{hook}.A"


def b_class_name(target: str) -> str:
    return f"{target}.B"


def lora_classes(shape: LlamaShape, tp: int) -> list[LoraClass]:
    """This rank's classes, TP-sharded ones first (the gradient-norm reduction relies on that order)."""
    out = []
    for hook in model_hooks(shape):
        targets = HOOK_TARGETS[hook]
        row = hook in ROW_PARALLEL_HOOKS
        in_full = shape.in_features(targets[0])
        out.append(LoraClass(a_class_name(hook), hook, targets, "A", in_full // tp if row else in_full, tp > 1 and row))
        for t in targets:
            out_full = shape.out_features(t)
            out.append(LoraClass(b_class_name(t), hook, (t,), "B", out_full if row else out_full // tp,
                                 tp > 1 and not row))
    return sorted(out, key=lambda c: not c.sharded)  # stable


class MegatronLora:
    """Installs the hooks on a GPTModel once; :meth:`route` selects adapters per batch-row range."""

    def __init__(self, model, shape: LlamaShape, compute_dtype: torch.dtype = torch.float32, *,
                 tensor_parallel: tuple[int, object] | None = None):
        """``model=None`` installs no hooks (the math alone, for tests); ``tensor_parallel`` = (size, group),
        default megatron's TP group."""
        if tensor_parallel is None:
            from megatron.core import parallel_state

            size = parallel_state.get_tensor_model_parallel_world_size()
            tensor_parallel = (size, parallel_state.get_tensor_model_parallel_group() if size > 1 else None)
        self.shape = shape
        self.tp, self.tp_group = tensor_parallel
        self.compute_dtype = compute_dtype
        self.groups_local = shape.num_kv_heads // self.tp
        self.classes = lora_classes(shape, self.tp)
        ep = 1
        if model is not None and shape.moe_layers:
            from megatron.core import parallel_state

            ep = parallel_state.get_expert_model_parallel_world_size()
        # The expert LoRA of the MoE layers (none on a dense model): it has no hooks, the experts call it.
        self.experts = ExpertLora(shape, compute_dtype, self.tp, ep)
        for i, layer in enumerate(model.decoder.layers if model is not None else ()):
            attn, mlp = layer.self_attention, layer.mlp
            if shape.is_linear(i):
                for hook in LINEAR_ATTENTION_HOOKS:
                    getattr(attn, hook).register_forward_hook(self._hook(i, hook))
            else:
                attn.linear_qkv.register_forward_hook(self._hook(i, "qkv"))
                attn.linear_proj.register_forward_hook(self._hook(i, "o_proj"))
            if shape.is_moe(i):
                self.experts.attach(mlp)  # no dense MLP
                if shape.shared_ffn_hidden_size:
                    mlp.shared_experts.linear_fc1.register_forward_hook(self._hook(i, "shared_fc1"))
                    mlp.shared_experts.linear_fc2.register_forward_hook(self._hook(i, "shared_fc2"))
                continue
            mlp.linear_fc1.register_forward_hook(self._hook(i, "fc1"))
            mlp.linear_fc2.register_forward_hook(self._hook(i, "down_proj"))

    @property
    def expert_gemms(self) -> dict[str, int]:
        return self.experts.gemms

    @contextlib.contextmanager
    def route(self, segments: Sequence[RowSegment], rows: int) -> Iterator[BatchRouting]:
        """Routes the ``rows`` token rows of the next forward(s); the returned routing's
        :meth:`BatchRouting.accumulate_grads` moves the gradients of a backward into each adapter's grad buffer."""
        routing = BatchRouting(self, list(segments), rows)
        with _routing.using(routing):
            yield routing

    @staticmethod
    def current() -> BatchRouting | None:
        """The routing in force on this thread (what the hooks will use)."""
        return _routing.current()

    @staticmethod
    def using(routing: BatchRouting | None):
        """Puts an existing routing in force on this thread: activation recomputation re-runs a layer's forward
        inside the backward (on autograd's thread, after :meth:`route` has exited), and its hooks must add the same
        adapters' deltas as the original forward did."""
        return _routing.using(routing)

    def _hook(self, layer: int, hook: str):
        def run(_module, inputs, output):
            routing = _routing.current()
            if routing is None or not routing.active:
                return None
            out, bias = output
            if out._is_view():  # never the case for megatron's linears; in-place on a view would be rebased
                delta = _HookDelta.apply(inputs[0], routing.anchor, (routing, layer, hook))
                return out + delta.to(out.dtype), bias
            return _HookAddInPlace.apply(inputs[0], out, routing.anchor, (routing, layer, hook)), bias

        return run

    def grouped_layout_ok(self, rank: int, dtype: torch.dtype) -> bool:
        """Whether every operand of the grouped products has 16-byte aligned strides and column offsets (what
        ``torch._grouped_mm`` requires): the rank, this rank's feature dims and the head dim (the q, k, v column
        views) in multiples of 16 bytes."""
        lin = self.shape.linear
        dims = [lin.head_k_dim, lin.head_v_dim] if lin is not None else []
        return aligned([rank, self.shape.head_dim, *dims, *(c.dim for c in self.classes)], dtype)

    # -- the work of one hook ---------------------------------------------------------------------------------

    def place(self, hook: str, deltas: list[torch.Tensor]) -> torch.Tensor:
        if hook == "qkv":
            interleave = interleave_gated_qkv if self.shape.gated_attention else interleave_qkv
            return interleave(*deltas, self.groups_local, self.shape.head_dim, dim=-1)
        if hook in FUSED_COLUMN_HOOKS:
            return torch.cat(deltas, dim=-1)
        return deltas[0]

    def out_views(self, hook: str, out2: torch.Tensor) -> list[torch.Tensor]:
        """Views of a fused output ``[T, out]`` at each projection's columns, shaped so that the projection's delta
        ``[T, out_p]`` adds into them with ``view(view.shape)``: 2-D (strided rows, so ``addmm_`` writes in place)
        for gate|up halves and unfused outputs, ``[T, G, cols]`` for the GQA-interleaved q, k, v."""
        if hook == "qkv":
            hd, hpg = self.shape.head_dim, self.shape.heads_per_group
            if self.shape.gated_attention:
                # q_proj's delta is [query | gate] per head; megatron's rows per group [queries, gates, k, v]:
                # the q view is [T, G, hpg, 2, hd] (strided), which the delta viewed so adds into exactly.
                t, groups = out2.shape[0], self.groups_local
                g = out2.view(t, groups, (2 * hpg + 2) * hd)
                q = g[:, :, : 2 * hpg * hd].unflatten(-1, (2, hpg, hd)).transpose(2, 3)
                return [q, g[:, :, 2 * hpg * hd : (2 * hpg + 1) * hd], g[:, :, (2 * hpg + 1) * hd :]]
            g = out2.view(out2.shape[0], self.groups_local, (hpg + 2) * hd)
            return [g[:, :, : hpg * hd], g[:, :, hpg * hd : (hpg + 1) * hd], g[:, :, (hpg + 1) * hd :]]
        if hook in FUSED_COLUMN_HOOKS:
            return list(torch.split(out2, self._widths(hook), dim=1))
        return [out2]

    def unplace(self, hook: str, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if hook == "qkv":
            split = split_gated_qkv if self.shape.gated_attention else split_qkv
            return split(g, self.groups_local, self.shape.heads_per_group, self.shape.head_dim, dim=-1)
        if hook in FUSED_COLUMN_HOOKS:
            return torch.split(g, self._widths(hook), dim=-1)
        return (g,)

    def _widths(self, hook: str) -> list[int]:
        """This rank's output widths of the projections fused in one column-parallel output."""
        return [self.shape.out_features(t) // self.tp for t in HOOK_TARGETS[hook]]


class BatchRouting:
    """One batch's adapters, stacked per class, with their gradient sinks and the way their rows are told apart.

    Three modes, picked per batch: one adapter over every row (its own tensors, a scalar scale); the grouped GEMM
    (``grouped``: several adapters of one rank, each owning one contiguous row range from row 0, on a device and
    dtype where ``torch._grouped_mm`` runs a real grouped kernel); otherwise the 0/1 mask over the rank-stacked
    adapters."""

    def __init__(self, lora: MegatronLora, segments: list[RowSegment], rows: int):
        self.lora = lora
        members = [s for s in segments if s.adapter is not None and s.end > s.start]
        if len({id(s.adapter) for s in members}) != len(members):
            raise ValueError("each adapter must occupy one contiguous row range of the batch")
        self.members = members
        self.rows = rows
        self.active = bool(members)
        self.anchor: torch.Tensor | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.grouped = False
        self.end = rows  # rows [end, rows) get no adapter (grouped mode only: elsewhere the mask zeroes them)
        self._masks: dict[int, torch.Tensor] = {}
        self.experts: ExpertBatch | None = None  # the adapters that train the routed experts (.expert_lora)
        if not members:
            return
        cd = lora.compute_dtype
        first = members[0].adapter
        device = next(iter(first.params.values())).device
        self._device = device
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.experts = lora.experts.batch(members, rows, device, self.anchor)
        single = len(members) == 1
        ranks = [s.adapter.rank for s in members]
        self.scale = first.scale if single and members[0].start == 0 and members[0].end == rows else None
        self.grouped = (
            not single
            and len(set(ranks)) == 1
            and members[0].start == 0
            and all(a.end == b.start for a, b in itertools.pairwise(members))
            and lora.grouped_layout_ok(ranks[0], cd)
            and grouped_mm_supported(device, cd)
        )
        if self.grouped:
            self._init_grouped(device, cd)
            return
        # Σr wide: every row multiplies every routed adapter's rank block (the mask keeps its own).
        self.block = sum(ranks)
        # One adapter over every row: a scalar scale. Otherwise a 0/1 row mask, and each adapter's scale rides on
        # its rank rows of the stacked B^T (so the mask product is exact in bf16).
        rank_scale = None if self.scale is not None else torch.cat(
            [torch.full((s.adapter.rank,), s.adapter.scale, dtype=torch.float32) for s in members]
        ).to(device, non_blocking=True)
        self._b_grad_scale = None if rank_scale is None else rank_scale.view(-1, 1)
        for c in lora.classes:
            stacked = first.params[c.name] if single else torch.cat([s.adapter.params[c.name] for s in members], 2)
            if c.which == "B" and rank_scale is not None:
                stacked = stacked * rank_scale.view(1, 1, -1, 1)
            self.weights[c.name] = stacked if stacked.dtype == cd else stacked.to(cd)
            # One adapter: its own grad buffer is the sink. Several: a stacked sink, split after the backward.
            self.grads[c.name] = first.grads[c.name] if single else torch.zeros(
                stacked.shape, dtype=torch.float32, device=device)

    def _init_grouped(self, device: torch.device, cd: torch.dtype) -> None:
        members = self.members
        n = len(members)
        self.block = members[0].adapter.rank
        self.end = members[-1].end
        self.offs = torch.tensor([s.end for s in members], dtype=torch.int32).to(device, non_blocking=True)
        scales = torch.tensor([s.adapter.scale for s in members], dtype=torch.float32).to(device, non_blocking=True)
        self._b_grad_scale = scales.view(n, 1, 1)
        for c in self.lora.classes:
            stacked = torch.stack([s.adapter.params[c.name] for s in members])  # [n, L, G, r, dim]
            if c.which == "B":
                # The scale rides on B (fp32 master × scale, rounded once to the compute dtype): the same bf16 B as
                # the mask path uses, and mid = x A^T stays a plain product.
                stacked = stacked * scales.view(n, 1, 1, 1, 1)
            self.weights[c.name] = stacked if stacked.dtype == cd else stacked.to(cd)
            self.grads[c.name] = torch.zeros(stacked.shape, dtype=torch.float32, device=device)

    @property
    def mode(self) -> str:
        """``none`` (no adapter routed), ``single`` (one adapter over every row), ``grouped`` or ``mask``."""
        if not self.members:
            return "none"
        return "single" if self.scale is not None else "grouped" if self.grouped else "mask"

    # -- the pieces the hook math is written in (one formula for every mode) -----------------------------------

    def a_weight(self, hook: str, layer: int) -> torch.Tensor:
        """The hook's A's, projections side by side: ``[n, G·r, in]`` (grouped) or ``[G·Σr, in]``."""
        w = self.weights[a_class_name(hook)]
        return w[:, layer].flatten(1, 2) if self.grouped else w[layer].flatten(0, 1)

    def b_weight(self, target: str, layer: int) -> torch.Tensor:
        """The scale-carrying ``B^T``: ``[n, r, out]`` (grouped) or ``[Σr, out]``."""
        w = self.weights[b_class_name(target)]
        return w[:, layer, 0] if self.grouped else w[layer, 0]

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` with each adapter's rows (of ``a``, or of the contraction when both are 2-D) against its own
        weights: ``b`` 3-D gives ``[rows, m]``; both 2-D gives per-adapter sums ``[n, k, m]``."""
        if self.grouped:
            return torch._grouped_mm(a, b, offs=self.offs)
        return a @ b

    def rows_of(self, x2: torch.Tensor) -> torch.Tensor:
        """The rows that carry an adapter (all of them, except in grouped mode, where the tail past ``end`` has
        none and the grouped kernel leaves its output rows unwritten)."""
        return x2[: self.end] if self.grouped and self.end < x2.shape[0] else x2

    def full_rows(self, t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, self.rows - t.shape[0])) if t.shape[0] < self.rows else t

    def scaled(self, mid: torch.Tensor, groups: int) -> torch.Tensor:
        """``mid[T, groups * block]`` times the scalar scale (one adapter on every row), as it is (grouped: each
        row met only its own adapter), or with every rank block zeroed outside its adapter's rows (mask)."""
        if self.scale is not None:
            return mid * self.scale
        if self.grouped:
            return mid
        mask = self._masks.get(groups)
        if mask is None:
            owner = torch.full((self.rows,), -1, dtype=torch.int32)
            for k, s in enumerate(self.members):
                owner[s.start : s.end] = k
            cols = torch.repeat_interleave(torch.arange(len(self.members), dtype=torch.int32),
                                           torch.tensor([s.adapter.rank for s in self.members]))
            # Materialized for every token row ([T, groups * Σr], a few MB), built on the device from the owners
            # of rows and rank columns: one multiply per use, as with a scalar scale.
            owner, cols = owner.to(self._device, non_blocking=True), cols.to(self._device, non_blocking=True)
            mask = self._masks[groups] = (owner[:, None] == cols[None, :]).to(mid.dtype).repeat(1, groups)
        return mid * mask

    def add_a_grad(self, hook: str, layer: int, grad: torch.Tensor) -> None:
        sink = self.grads[a_class_name(hook)]
        sink = sink[:, layer] if self.grouped else sink[layer]
        sink.add_(grad.view(sink.shape))

    def add_b_grad(self, target: str, layer: int, grad_bt: torch.Tensor) -> None:
        """Adds the gradient of an unscaled B^T, given that of the stacked (scale-carrying) one."""
        sink = self.grads[b_class_name(target)]
        sink = sink[:, layer, 0] if self.grouped else sink[layer, 0]
        if self._b_grad_scale is None:
            sink.add_(grad_bt)
        else:
            sink.addcmul_(grad_bt, self._b_grad_scale)

    def accumulate_grads(self) -> None:
        """After a backward: adds the stacked gradients into each adapter's grad buffer (one adapter: already
        there)."""
        if len(self.members) < 2:
            return
        ranks = [s.adapter.rank for s in self.members]
        for name, stacked in self.grads.items():
            parts = stacked.unbind(0) if self.grouped else stacked.split(ranks, dim=2)
            torch._foreach_add_([s.adapter.grads[name] for s in self.members], list(parts))


class _HookDelta(torch.autograd.Function):
    """The LoRA delta of one hook (all its projections, all routed adapters) in the fused output layout."""

    @staticmethod
    def forward(ctx, x, anchor, plan):
        routing, layer, hook = plan
        lora = routing.lora
        seq, batch, _ = x.shape
        x2, mid = _lora_forward_mid(x, plan)
        r = routing.block
        deltas = [routing.full_rows(routing.mm(mid[:, i * r : (i + 1) * r], routing.b_weight(t, layer)))
                  for i, t in enumerate(HOOK_TARGETS[hook])]
        ctx.save_for_backward(x2, mid)
        ctx.plan = plan
        ctx.x_dtype = x.dtype
        return lora.place(hook, deltas).view(seq, batch, -1)

    @staticmethod
    def backward(ctx, g):
        return _lora_backward(ctx, g), None, None


def _lora_forward_mid(x, plan):
    """``mid = scale-or-mask(x A^T)`` ([rows, G * block], all-reduced for row-parallel hooks) and ``x`` as the
    rows that carry an adapter."""
    routing, layer, hook = plan
    lora = routing.lora
    cd = lora.compute_dtype
    width = x.shape[-1]
    x2 = routing.rows_of((x if x.dtype == cd else x.to(cd)).reshape(-1, width))
    mid = routing.mm(x2, routing.a_weight(hook, layer).transpose(-1, -2))
    if hook in ROW_PARALLEL_HOOKS and lora.tp > 1:
        dist.all_reduce(mid, group=lora.tp_group)
    return x2, routing.scaled(mid, len(HOOK_TARGETS[hook]))


def _lora_backward(ctx, g):
    """The input gradient (returned) and the A and B gradients (added into the routing's sinks) of one hook."""
    routing, layer, hook = ctx.plan
    lora = routing.lora
    x2, mid = ctx.saved_tensors
    cd = lora.compute_dtype
    seq, batch = g.shape[0], g.shape[1]
    r = routing.block
    targets = HOOK_TARGETS[hook]
    parts = lora.unplace(hook, routing.rows_of((g if g.dtype == cd else g.to(cd)).reshape(seq * batch, -1)))
    g_mids = []
    for i, (t, g_t) in enumerate(zip(targets, parts)):
        bt = routing.b_weight(t, layer)  # [n, r, out] or [Σr, out]
        routing.add_b_grad(t, layer, routing.mm(mid[:, i * r : (i + 1) * r].t(), g_t))
        g_mids.append(routing.mm(g_t, bt.transpose(-1, -2)))
    g_mid = routing.scaled(g_mids[0] if len(g_mids) == 1 else torch.cat(g_mids, 1), len(targets))
    if hook not in ROW_PARALLEL_HOOKS and lora.tp > 1:
        dist.all_reduce(g_mid, group=lora.tp_group)
    routing.add_a_grad(hook, layer, routing.mm(g_mid.t(), x2))
    if not ctx.needs_input_grad[0]:
        return None
    g_x = routing.full_rows(routing.mm(g_mid, routing.a_weight(hook, layer)))
    return g_x.view(seq, batch, -1).to(ctx.x_dtype)


class _HookAddInPlace(torch.autograd.Function):
    """What the hooks run: adds the LoRA delta of one hook into the base layer's output in place (``addmm_``
    straight into each projection's columns where they are 2-D: no delta tensor, no placement copy, no separate
    add; grouped: one add of the grouped product into the adapters' rows). The base output's gradient passes
    through unchanged; the LoRA gradients are :class:`_HookDelta`'s."""

    @staticmethod
    def forward(ctx, x, out, anchor, plan):
        routing, layer, hook = plan
        lora = routing.lora
        x2, mid = _lora_forward_mid(x, plan)
        r = routing.block
        for i, (t, view) in enumerate(zip(HOOK_TARGETS[hook], lora.out_views(hook, out.view(-1, out.shape[-1])))):
            m, bt = mid[:, i * r : (i + 1) * r], routing.b_weight(t, layer)
            if routing.grouped:
                view = view[: routing.end]
                view.add_(routing.mm(m, bt).view(view.shape).to(view.dtype))
            elif view.dim() == 2 and bt.dtype == view.dtype:
                view.addmm_(m, bt)
            else:
                view.add_((m @ bt).to(view.dtype).view(view.shape))
        ctx.save_for_backward(x2, mid)
        ctx.plan = plan
        ctx.x_dtype = x.dtype
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return _lora_backward(ctx, g), g, None, None
