"""PEFT per-projection LoRA on megatron-core's fused, tensor-parallel linears, for one or many adapters per batch.

Forward hooks on ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and ``linear_fc2`` of every decoder layer add the
routed adapters' deltas to the base output (the module tree and its state dict stay untouched). For q, k, v (and
gate, up) the per-projection deltas ``scale * B_p (A_p x)`` are computed separately and placed in the fused layout
(GQA interleave, gate|up halves) by :mod:`.layout`, so the adapter is exactly the PEFT one.

Storage. Each adapter's tensors on this rank are grouped in *classes* (:func:`lora_classes`), one ``[L, G, r,
dim]`` tensor per class: the A's of the projections that share a hook input (q|k|v, gate|up) side by side, and
each B stored transposed (``B^T``, ``[r, out]``). A batch stacks its adapters along the rank dimension with one
``cat`` per class, so a hook does the same number of operations for one adapter as for eight.

One autograd node per hook. The LoRA tensors are not autograd leaves: :class:`_HookDelta` computes the delta in
its forward and, in its backward, the input gradient plus the A and B gradients, which it adds straight into the
batch's gradient sinks. A per-batch anchor leaf makes the first hook's output require grad. With hundreds of LoRA
tensors per adapter, per-tensor leaves (and their cat/split/accumulate nodes) cost more host time than the model.

Several adapters in one batch: ``A_cat x`` is multiplied by a per-row 0/1 mask that keeps each row's own adapter's
rank block, then by ``B_cat^T`` whose rank rows carry their adapter's scale; each row gets exactly its adapter's
``scale * B (A x)`` and each adapter's gradient comes only from its rows.

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
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import LlamaShape, fuse_gate_up, interleave_qkv, split_gate_up, split_qkv

HOOK_TARGETS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "fc1": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
ROW_PARALLEL_HOOKS = ("o_proj", "down_proj")


@dataclass(frozen=True)
class LoraClass:
    """One stored tensor class: ``[num_layers, len(targets), rank, dim]`` per adapter and rank."""

    name: str
    hook: str
    targets: tuple[str, ...]
    which: str  # "A" (rows = rank, cols = in features) or "B" (stored as B^T: rows = rank, cols = out features)
    dim: int  # this rank's share of the feature dimension
    sharded: bool  # differs between TP ranks (counted once per rank in the global gradient norm)


def a_class_name(hook: str) -> str:
    return f"{hook}.A"


def b_class_name(target: str) -> str:
    return f"{target}.B"


def lora_classes(shape: LlamaShape, tp: int) -> list[LoraClass]:
    """This rank's classes, TP-sharded ones first (the gradient-norm reduction relies on that order)."""
    out = []
    for hook, targets in HOOK_TARGETS.items():
        row = hook in ROW_PARALLEL_HOOKS
        in_full = shape.in_features(targets[0])
        out.append(LoraClass(a_class_name(hook), hook, targets, "A", in_full // tp if row else in_full, tp > 1 and row))
        for t in targets:
            out_full = shape.out_features(t)
            out.append(LoraClass(b_class_name(t), hook, (t,), "B", out_full if row else out_full // tp,
                                 tp > 1 and not row))
    return sorted(out, key=lambda c: not c.sharded)  # stable


@dataclass(eq=False)
class AdapterTensors:
    """One resident adapter on this rank: per class, its params and grads ``[L, G, r, dim]`` (views of its
    buffer), its rank and scale."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    rank: int
    scale: float


@dataclass(frozen=True)
class RowSegment:
    start: int
    end: int
    adapter: AdapterTensors | None


_local = threading.local()  # the active routing, per thread


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
        for i, layer in enumerate(model.decoder.layers if model is not None else ()):
            attn, mlp = layer.self_attention, layer.mlp
            attn.linear_qkv.register_forward_hook(self._hook(i, "qkv"))
            attn.linear_proj.register_forward_hook(self._hook(i, "o_proj"))
            mlp.linear_fc1.register_forward_hook(self._hook(i, "fc1"))
            mlp.linear_fc2.register_forward_hook(self._hook(i, "down_proj"))

    @contextlib.contextmanager
    def route(self, segments: Sequence[RowSegment], batch_rows: int) -> Iterator[BatchRouting]:
        """Routes the rows of the next forward(s); the returned routing's :meth:`BatchRouting.accumulate_grads`
        moves the gradients of a backward into each adapter's grad buffer."""
        previous = getattr(_local, "routing", None)
        routing = BatchRouting(self, list(segments), batch_rows)
        _local.routing = routing
        try:
            yield routing
        finally:
            _local.routing = previous

    @staticmethod
    def current() -> BatchRouting | None:
        """The routing in force on this thread (what the hooks will use)."""
        return getattr(_local, "routing", None)

    @staticmethod
    @contextlib.contextmanager
    def using(routing: BatchRouting | None) -> Iterator[None]:
        """Puts an existing routing in force on this thread: activation recomputation re-runs a layer's forward
        inside the backward (on autograd's thread, after :meth:`route` has exited), and its hooks must add the same
        adapters' deltas as the original forward did."""
        previous = getattr(_local, "routing", None)
        _local.routing = routing
        try:
            yield
        finally:
            _local.routing = previous

    def _hook(self, layer: int, hook: str):
        def run(_module, inputs, output):
            routing = getattr(_local, "routing", None)
            if routing is None or not routing.active:
                return None
            out, bias = output
            if out._is_view():  # never the case for megatron's linears; in-place on a view would be rebased
                delta = _HookDelta.apply(inputs[0], routing.anchor, (routing, layer, hook))
                return out + delta.to(out.dtype), bias
            return _HookAddInPlace.apply(inputs[0], out, routing.anchor, (routing, layer, hook)), bias

        return run

    # -- the work of one hook ---------------------------------------------------------------------------------

    def place(self, hook: str, deltas: list[torch.Tensor]) -> torch.Tensor:
        if hook == "qkv":
            return interleave_qkv(*deltas, self.groups_local, self.shape.head_dim, dim=-1)
        if hook == "fc1":
            return fuse_gate_up(*deltas, dim=-1)
        return deltas[0]

    def out_views(self, hook: str, out2: torch.Tensor) -> list[torch.Tensor]:
        """Views of a fused output ``[T, out]`` at each projection's columns, shaped so that the projection's delta
        ``[T, out_p]`` adds into them with ``view(view.shape)``: 2-D (strided rows, so ``addmm_`` writes in place)
        for gate|up halves and unfused outputs, ``[T, G, cols]`` for the GQA-interleaved q, k, v."""
        if hook == "qkv":
            hd, hpg = self.shape.head_dim, self.shape.heads_per_group
            g = out2.view(out2.shape[0], self.groups_local, (hpg + 2) * hd)
            return [g[:, :, : hpg * hd], g[:, :, hpg * hd : (hpg + 1) * hd], g[:, :, (hpg + 1) * hd :]]
        if hook == "fc1":
            half = out2.shape[1] // 2
            return [out2[:, :half], out2[:, half:]]
        return [out2]

    def unplace(self, hook: str, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if hook == "qkv":
            return split_qkv(g, self.groups_local, self.shape.heads_per_group, self.shape.head_dim, dim=-1)
        if hook == "fc1":
            return split_gate_up(g, dim=-1)
        return (g,)


class BatchRouting:
    """One batch's adapters, stacked per class along the rank dimension, with masks and gradient sinks."""

    def __init__(self, lora: MegatronLora, segments: list[RowSegment], batch_rows: int):
        self.lora = lora
        members = [s for s in segments if s.adapter is not None]
        if len({id(s.adapter) for s in members}) != len(members):
            raise ValueError("each adapter must occupy one contiguous row range of the batch")
        self.members = members
        self.active = bool(members)
        self.anchor: torch.Tensor | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.total_rank = sum(s.adapter.rank for s in members)
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        if not members:
            return
        cd = lora.compute_dtype
        first = members[0].adapter
        device = next(iter(first.params.values())).device
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        single = len(members) == 1
        # One adapter over every row: a scalar scale. Otherwise a 0/1 row mask, and each adapter's scale rides on
        # its rank rows of the stacked B^T (so the mask product is exact in bf16).
        self.scale = first.scale if single and members[0].start == 0 and members[0].end == batch_rows else None
        self.rank_scale = None if self.scale is not None else torch.cat(
            [torch.full((s.adapter.rank,), s.adapter.scale, dtype=torch.float32) for s in members]
        ).to(device, non_blocking=True)
        self._rank_scale_column = None if self.rank_scale is None else self.rank_scale.view(-1, 1)
        for c in lora.classes:
            stacked = first.params[c.name] if single else torch.cat([s.adapter.params[c.name] for s in members], 2)
            if c.which == "B" and self.rank_scale is not None:
                stacked = stacked * self.rank_scale.view(1, 1, -1, 1)
            self.weights[c.name] = stacked if stacked.dtype == cd else stacked.to(cd)
            # One adapter: its own grad buffer is the sink. Several: a stacked sink, split after the backward.
            self.grads[c.name] = first.grads[c.name] if single else torch.zeros(
                stacked.shape, dtype=torch.float32, device=device)
        self._batch_rows = batch_rows
        self._device = device

    def scaled(self, mid: torch.Tensor, groups: int, batch: int) -> torch.Tensor:
        """``mid[T, groups * Σr]`` times the scalar scale (one adapter on every row), or with every rank block
        zeroed outside its adapter's rows."""
        if self.scale is not None:
            return mid * self.scale
        key = (groups, mid.shape[0])
        mask = self._masks.get(key)
        if mask is None:
            host = torch.zeros(self._batch_rows, self.total_rank, dtype=mid.dtype)
            col = 0
            for s in self.members:
                host[s.start : s.end, col : col + s.adapter.rank] = 1
                col += s.adapter.rank
            # Materialized for every token row ([seq * batch, groups * Σr], a few MB): one multiply per use and
            # no reshapes, so a hook issues as many operations as with a scalar scale.
            mask = self._masks[key] = host.to(self._device).repeat(mid.shape[0] // batch, groups)
        return mid * mask

    def add_b_grad(self, sink: torch.Tensor, grad_bt: torch.Tensor) -> None:
        """Adds the gradient of an unscaled B^T, given that of the stacked (scale-carrying) one."""
        if self.rank_scale is None:
            sink.add_(grad_bt)
        else:
            sink.addcmul_(grad_bt, self._rank_scale_column)

    def accumulate_grads(self) -> None:
        """After a backward: adds the stacked gradients into each adapter's grad buffer (one adapter: already
        there)."""
        if len(self.members) < 2:
            return
        ranks = [s.adapter.rank for s in self.members]
        for name, stacked in self.grads.items():
            for s, part in zip(self.members, stacked.split(ranks, dim=2)):
                s.adapter.grads[name].add_(part)


class _HookDelta(torch.autograd.Function):
    """The LoRA delta of one hook (all its projections, all routed adapters) in the fused output layout."""

    @staticmethod
    def forward(ctx, x, anchor, plan):
        routing, layer, hook = plan
        lora = routing.lora
        seq, batch, _ = x.shape
        x2, mid = _lora_forward_mid(x, plan)
        r = routing.total_rank
        deltas = [mid[:, i * r : (i + 1) * r] @ routing.weights[b_class_name(t)][layer, 0]
                  for i, t in enumerate(HOOK_TARGETS[hook])]
        ctx.save_for_backward(x2, mid)
        ctx.plan = plan
        ctx.x_dtype = x.dtype
        return lora.place(hook, deltas).view(seq, batch, -1)

    @staticmethod
    def backward(ctx, g):
        return _lora_backward(ctx, g), None, None


def _lora_forward_mid(x, plan):
    """``mid = scale-or-mask(x A_cat^T)`` ([T, G * Σr], all-reduced for row-parallel hooks) and ``x`` as rows."""
    routing, layer, hook = plan
    lora = routing.lora
    cd = lora.compute_dtype
    _seq, batch, width = x.shape
    x2 = (x if x.dtype == cd else x.to(cd)).reshape(-1, width)
    a = routing.weights[a_class_name(hook)][layer].reshape(-1, width)  # [G * Σr, in]
    mid = x2 @ a.t()
    if hook in ROW_PARALLEL_HOOKS and lora.tp > 1:
        dist.all_reduce(mid, group=lora.tp_group)
    return x2, routing.scaled(mid, len(HOOK_TARGETS[hook]), batch)


def _lora_backward(ctx, g):
    """The input gradient (returned) and the A and B gradients (added into the routing's sinks) of one hook."""
    routing, layer, hook = ctx.plan
    lora = routing.lora
    x2, mid = ctx.saved_tensors
    cd = lora.compute_dtype
    seq, batch = g.shape[0], g.shape[1]
    r = routing.total_rank
    targets = HOOK_TARGETS[hook]
    parts = lora.unplace(hook, (g if g.dtype == cd else g.to(cd)).reshape(seq * batch, -1))
    g_mids = []
    for i, (t, g_t) in enumerate(zip(targets, parts)):
        bt = routing.weights[b_class_name(t)][layer, 0]  # [Σr, out]
        routing.add_b_grad(routing.grads[b_class_name(t)][layer, 0], mid[:, i * r : (i + 1) * r].t() @ g_t)
        g_mids.append(g_t @ bt.t())
    g_mid = routing.scaled(g_mids[0] if len(g_mids) == 1 else torch.cat(g_mids, 1), len(targets), batch)
    if hook not in ROW_PARALLEL_HOOKS and lora.tp > 1:
        dist.all_reduce(g_mid, group=lora.tp_group)
    a_name = a_class_name(hook)
    width = x2.shape[1]
    routing.grads[a_name][layer].add_((g_mid.t() @ x2).view(len(targets), r, width))
    if not ctx.needs_input_grad[0]:
        return None
    a = routing.weights[a_name][layer].reshape(-1, width)
    return (g_mid @ a).view(seq, batch, width).to(ctx.x_dtype)


class _HookAddInPlace(torch.autograd.Function):
    """What the hooks run: adds the LoRA delta of one hook into the base layer's output in place (``addmm_``
    straight into each projection's columns where they are 2-D: no delta tensor, no placement copy, no separate
    add). The base output's gradient passes through unchanged; the LoRA gradients are :class:`_HookDelta`'s."""

    @staticmethod
    def forward(ctx, x, out, anchor, plan):
        routing, layer, hook = plan
        lora = routing.lora
        x2, mid = _lora_forward_mid(x, plan)
        r = routing.total_rank
        for i, (t, view) in enumerate(zip(HOOK_TARGETS[hook], lora.out_views(hook, out.view(-1, out.shape[-1])))):
            m, bt = mid[:, i * r : (i + 1) * r], routing.weights[b_class_name(t)][layer, 0]
            if view.dim() == 2 and bt.dtype == view.dtype:
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
