"""Expert LoRA of mixture-of-experts layers: each routed adapter's ``scale * B_e (A_e x)`` on the rows of each of its
tenant x expert segments, written in the grouped-GEMM primitives of :mod:`.kernels`; the MoE layer (:mod:`.moe`)
calls it from inside its one autograd node.

Storage. An adapter that trains the routed experts (per expert, or shared-outer: one gate_up A and one down B
shared by a layer's experts) stores one ``[L_moe, G, r, dim]`` block per class (:func:`expert_lora_classes`): G is
this rank's experts (different on every expert-parallel rank) or 1 for a shared factor.

Rows. The router sends each chosen expert ``e`` of a token of the batch's j-th expert adapter to *virtual* expert
``e * slots + j`` (:class:`.moe.SlotRouter`), so every expert's rows arrive sorted by adapter slot: each tenant x
expert segment is one group of the grouped GEMMs, whatever mix of tenants the batch fuses (:class:`ExpertBatch`).
On the local path (no expert parallelism) a factor that every expert adapter of the batch shares goes on the token
rows instead of their k expert copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fused_expert_lora
from .kernels import aligned, grouped_mm_supported, segment_mm, segment_outer, sum_copies
from .layout import LlamaShape, expert_factor_shared
from .routing import LoraClass, RowSegment, current


def expert_lora_classes(shape: LlamaShape, layout: str, ep: int) -> list[LoraClass]:
    """The expert classes of an adapter that trains the routed experts in ``layout`` (per_expert or
    shared_outer): per-expert factors first (EP-sharded), then the shared ones (replicated)."""
    local = shape.num_experts // ep
    ffn, hidden = shape.moe_ffn_hidden_size, shape.hidden_size
    dims = {("experts.gate_up_proj", "A"): hidden, ("experts.gate_up_proj", "B"): 2 * ffn,
            ("experts.down_proj", "A"): ffn, ("experts.down_proj", "B"): hidden}
    out = []
    for (target, which), dim in dims.items():
        shared = expert_factor_shared(target, which, layout)
        out.append(LoraClass(f"{target}.{which}", target, (target,), which, dim, False, layers=len(shape.moe_layers),
                             groups=1 if shared else local, ep_sharded=ep > 1 and not shared, expert=True))
    return sorted(out, key=lambda c: c.groups == 1 and local > 1)  # stable: per-expert first


@dataclass(frozen=True)
class ExpertTokens:
    """The local MoE path's view of the expert rows as copies of the token rows: ``x`` the token rows ``[T, in]``,
    ``tok`` the token of each row ``[rows]``, ``where`` the rows of each token's k copies ``[T, k]``."""

    x: torch.Tensor
    tok: torch.Tensor
    where: torch.Tensor


class ExpertLora:
    """The model's expert LoRA on this rank: its MoE layers, this rank's experts and how many expert adapters one
    batch may fuse (``slots``; the router has one more, for tokens of no expert adapter). The experts and the router
    of every MoE layer point at it; per batch, :meth:`batch` gives the :class:`ExpertBatch` the experts run."""

    def __init__(self, shape: LlamaShape, compute_dtype: torch.dtype, tp: int, ep: int = 1):
        self.shape = shape
        self.compute_dtype = compute_dtype
        self.tp = tp
        self.ep = ep
        self.slots = 0
        self.local_experts = shape.num_experts // ep if shape.moe_layers else 0
        # Each MoE layer's index among the MoE layers (the expert classes' first dimension).
        self.position = {layer: k for k, layer in enumerate(shape.moe_layers)}
        # Expert-LoRA GEMM pairs run as grouped kernels / as loops over the segments (the engine reports them).
        self.gemms = {"expert_lora_grouped": 0, "expert_lora_loop": 0}

    def attach(self, mlp) -> None:
        """Serves one MoE layer: its experts ask for the batch in force (:func:`in_force`), its router which adapter
        slot each token is in."""
        mlp.experts.lora = self
        mlp.router.token_slots = self.token_slots
        self.slots = mlp.router.slots - 1

    def classes(self, layout: str) -> list[LoraClass]:
        return expert_lora_classes(self.shape, layout, self.ep)

    def batch(self, members: list[RowSegment], rows: int, device: torch.device,
              anchor: torch.Tensor) -> ExpertBatch | None:
        """The batch's adapters that train the routed experts, in slot order (None: there are none); ``anchor`` the
        batch's leaf that makes the experts' output require grad."""
        experts = [s for s in members if s.adapter.experts]
        if len(experts) > self.slots:
            raise ValueError(f"{len(experts)} adapters with expert LoRA in one batch; the model has {self.slots} "
                             f"expert adapter slots")
        return ExpertBatch(self, experts, rows, device, anchor) if experts else None

    @staticmethod
    def token_slots() -> torch.Tensor | None:
        experts = in_force()
        return None if experts is None else experts.token_slots()


def in_force() -> ExpertBatch | None:
    """The expert adapters of the routing in force on this thread (None: none)."""
    routing = current()
    return None if routing is None else routing.experts


class ExpertBatch:
    """One batch's expert adapters (``members``: slot j is the j-th) and their expert-LoRA math over the tenant x
    expert segments of a layer's rows."""

    def __init__(self, lora: ExpertLora, members: list[RowSegment], rows: int, device: torch.device,
                 anchor: torch.Tensor):
        self.lora = lora
        self.anchor = anchor
        self.members = members
        self.rows = rows
        self._device = device
        self._token_slots: torch.Tensor | None = None
        # Every TP rank dispatches the same tokens to the experts (experts are not split by TP), so each expert
        # row is computed once per TP rank: each copy contributes 1/TP of the expert LoRA gradients.
        self.grad_scale = 1.0 / lora.tp

    def token_slots(self) -> torch.Tensor:
        """``[rows]`` adapter slot of each token row (the expert adapters' order; ``lora.slots``: none)."""
        if self._token_slots is None:
            slots = torch.full((self.rows,), self.lora.slots, dtype=torch.int64)
            for j, seg in enumerate(self.members):
                slots[seg.start : seg.end] = j
            self._token_slots = slots.to(self._device, non_blocking=True)
        return self._token_slots

    def stack(self, target: str, which: str, position: int) -> torch.Tensor:
        """``[local experts * slots, r_max, dim]`` in the compute dtype: group ``e * slots + j`` holds expert
        ``e``'s factor of the adapter in slot ``j`` (a shared factor repeated per expert; B transposed and times
        the adapter's scale; ranks below ``r_max`` zero-padded, which adds exact zeros), the no-adapter slot
        zeros. Built per use rather than kept for the backward: a rank-32 per-expert adapter of Qwen3-30B-A3B is
        ~26M values per layer."""
        name = f"{target}.{which}"
        slots = self.lora.slots + 1
        r_max = max(s.adapter.rank for s in self.members)
        first = self.members[0].adapter.params[name]
        stack = torch.zeros((self.lora.local_experts, slots, r_max, first.shape[-1]), dtype=self.lora.compute_dtype,
                            device=first.device)
        for j, seg in enumerate(self.members):
            a = seg.adapter
            t = a.params[name][position]  # [G, r, dim]
            stack[:, j, : a.rank].copy_(t * a.scale if which == "B" else t)
        return stack.view(-1, r_max, stack.shape[-1])

    def add_grad(self, target: str, which: str, position: int, grad: torch.Tensor) -> None:
        """Adds the gradient of :meth:`stack`'s tensor into each expert adapter's own (unscaled B; a shared factor
        gets the sum over this rank's experts)."""
        name = f"{target}.{which}"
        grad = grad.view(self.lora.local_experts, self.lora.slots + 1, grad.shape[-2], grad.shape[-1])
        for j, seg in enumerate(self.members):
            a = seg.adapter
            g = grad[:, j, : a.rank]  # added into the fp32 sink as it is (no fp32 copy of a per-expert block)
            factor = self.grad_scale * (a.scale if which == "B" else 1.0)
            sink = a.grads[name][position]
            if sink.shape[0] == 1 and g.shape[0] > 1:
                g = g.sum(0, keepdim=True, dtype=torch.float32)
            sink.add_(g, alpha=factor) if factor != 1.0 else sink.add_(g)

    def _counts(self, route) -> list[int] | None:
        """Host counts of the tenant x expert segments, or None where the grouped kernel runs the LoRA GEMMs (its
        16-byte stride alignment holds for the rank and feature dims)."""
        lora = self.lora
        r_max = max(s.adapter.rank for s in self.members)
        dims = (lora.shape.hidden_size, 2 * lora.shape.moe_ffn_hidden_size, lora.shape.moe_ffn_hidden_size, r_max)
        if (route.slot_counts is None and grouped_mm_supported(self._device, lora.compute_dtype)
                and aligned(dims, lora.compute_dtype)):
            return None
        return route.host_slot_counts()

    def forward(self, target: str, position: int, route, x: torch.Tensor, out: torch.Tensor,
                tokens: ExpertTokens | None = None) -> torch.Tensor:
        """Adds ``scale * B_e (A_e x)`` of each row's adapter and expert into the expert GEMM's output ``out`` in
        place: rows sorted by expert then adapter slot (:class:`.moe.ExpertRoute`), so each tenant x expert
        segment is one group of two grouped GEMMs (:func:`.kernels.segment_mm`). Returns the mid ``A_e x``
        (``[rows, r]``) that :meth:`backward` takes.

        ``tokens`` (the local MoE path: the rows are the k copies of the layer's token rows): a factor that every
        expert adapter of the batch shares across its experts (the shared-outer layout's gate_up A and down B) is
        applied to the token rows instead of their k copies. The shared A: ``mid = (x_t A_j^T)`` per token, then
        gathered to its rows; the shared B: not added here but by :meth:`combine` after the k rows are summed,
        ``B_j (sum_k mid)``, since B is linear and the same for a token's k rows."""
        cd = self.lora.compute_dtype
        offs, counts = route.slot_offs, self._counts(route)
        self.lora.gemms["expert_lora_loop" if counts is not None else "expert_lora_grouped"] += 1
        if self.token_shared(target, "A", tokens):
            mid = self._token_mm(tokens.x, target, "A", position, transpose=True).index_select(0, tokens.tok)
        else:
            xc = x if x.dtype == cd else x.to(cd)
            mid = segment_mm(xc, self.stack(target, "A", position).transpose(1, 2), offs, counts)
        if self.token_shared(target, "B", tokens):
            return mid
        segment_mm(mid, self.stack(target, "B", position), offs, counts, acc=out)  # casts into out's dtype
        return mid

    def fusable(self, target: str, route, x: torch.Tensor, tokens: ExpertTokens | None) -> bool:
        """Whether :meth:`fused_gemm` runs this target's expert GEMM with its LoRA (``LORAPLANE_MOE_FUSED_LORA=1``
        on CUDA in bf16, the grouped path, no factor on the token rows)."""
        return (fused_expert_lora.enabled(x) and route.counts is None and self._counts(route) is None
                and not self.token_shared(target, "A", tokens) and not self.token_shared(target, "B", tokens))

    def fused_gemm(self, target: str, position: int, route, x: torch.Tensor, weight: torch.Tensor,
                   tok: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The base expert GEMM of ``weight [E, out, in]`` over the rows ``x[tok]`` (``tok`` None: ``x``'s rows)
        with the LoRA delta added, and the mid, as one fused kernel (:mod:`.fused_expert_lora`): what
        :func:`.kernels.segment_mm` followed by :meth:`forward` compute, rounded once instead of twice. None where
        the kernel does not run here (it failed to compile: the unfused path then does, from now on)."""
        out = fused_expert_lora.fused_forward_or_none(x, weight, self.stack(target, "A", position),
                                                      self.stack(target, "B", position), route.slot_offs,
                                                      self.lora.slots + 1, tok)
        if out is not None:
            self.lora.gemms["expert_lora_fused"] = self.lora.gemms.get("expert_lora_fused", 0) + 1
        return out

    def combine(self, target: str, position: int, mid: torch.Tensor, tokens: ExpertTokens, y: torch.Tensor) -> None:
        """After the sum of each token's k rows into ``y [T, out]``: the shared B's delta ``scale_j B_j (sum_k
        mid)`` of each token (nothing unless every expert adapter shares this target's B)."""
        if not self.token_shared(target, "B", tokens):
            return
        delta = self._token_mm(sum_copies(mid, tokens.where), target, "B", position, transpose=False)
        y.add_(delta if delta.dtype == y.dtype else delta.to(y.dtype))

    def backward(self, target: str, position: int, route, x: torch.Tensor | None, mid: torch.Tensor,
                 g: torch.Tensor, g_x: torch.Tensor | None, tokens: ExpertTokens | None = None,
                 g_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The backward of :meth:`forward` (and :meth:`combine`) for the output gradient ``g`` of the rows
        (``g_tokens``: of the token rows, for a shared B): the A and B gradients into each adapter's sinks
        (:meth:`add_grad`) and, when ``g_x`` is given, the input gradient of the rows added into it in place. A
        shared A's input gradient belongs to the token rows: returned (``[T, in]``), else None. ``x`` (the rows)
        may be None where the A is shared."""
        cd = self.lora.compute_dtype
        offs, counts = route.slot_offs, self._counts(route)
        if self.token_shared(target, "B", tokens):
            gt = g_tokens if g_tokens.dtype == cd else g_tokens.to(cd)
            mid_tok = sum_copies(mid, tokens.where)
            g_mid = self._token_grads(mid_tok, gt, target, "B", position).index_select(0, tokens.tok)
        else:
            gc = (g if g.dtype == cd else g.to(cd)).contiguous()
            bt = self.stack(target, "B", position)
            self.add_grad(target, "B", position, segment_outer(mid, gc, offs, counts))
            g_mid = segment_mm(gc, bt.transpose(1, 2), offs, counts)
            del bt, gc
        if self.token_shared(target, "A", tokens):
            xt = tokens.x if tokens.x.dtype == cd else tokens.x.to(cd)
            return self._token_grads(sum_copies(g_mid, tokens.where), xt, target, "A", position,
                                     input_grad=g_x is not None)
        xc = x if x.dtype == cd else x.to(cd)
        self.add_grad(target, "A", position, segment_outer(g_mid, xc, offs, counts))
        if g_x is not None:
            segment_mm(g_mid, self.stack(target, "A", position), offs, counts, acc=g_x)
        return None

    # -- shared factors on the token rows (the local MoE path) ----------------------------------------------------

    def token_shared(self, target: str, which: str, tokens: ExpertTokens | None) -> bool:
        """Whether ``target``'s ``which`` factor goes on the token rows: the local path, and every expert adapter of
        the batch shares the factor across its experts (one block in its storage)."""
        if tokens is None:
            return False
        name = f"{target}.{which}"
        return all(s.adapter.params[name].shape[1] == 1 for s in self.members)

    def _token_factor(self, seg: RowSegment, target: str, which: str, position: int) -> torch.Tensor:
        """One adapter's shared factor ``[r, dim]`` in the compute dtype (B transposed and times the scale, as
        :meth:`stack` stores it: the same rounding)."""
        a = seg.adapter
        t = a.params[f"{target}.{which}"][position][0]
        if which == "B":
            t = t * a.scale
        return t if t.dtype == self.lora.compute_dtype else t.to(self.lora.compute_dtype)

    def _token_mm(self, rows: torch.Tensor, target: str, which: str, position: int, transpose: bool) -> torch.Tensor:
        """Each expert adapter's token range times its shared factor: ``rows[t] @ F_j^T`` (A: ``[T, r_max]``) or
        ``rows[t, :r_j] @ F_j`` (B^T: ``[T, out]``); zero rows for tokens of no expert adapter."""
        cd = self.lora.compute_dtype
        rows = rows if rows.dtype == cd else rows.to(cd)
        r_max = max(s.adapter.rank for s in self.members)
        dim = self.members[0].adapter.params[f"{target}.{which}"].shape[-1]
        out = rows.new_zeros(rows.shape[0], r_max if transpose else dim)
        for seg in self.members:
            f = self._token_factor(seg, target, which, position)
            r = seg.adapter.rank
            if transpose:
                out[seg.start : seg.end, :r] = rows[seg.start : seg.end] @ f.t()
            else:
                out[seg.start : seg.end] = rows[seg.start : seg.end, :r] @ f
        return out

    def _token_grads(self, g_mid_tok: torch.Tensor, other: torch.Tensor, target: str, which: str, position: int,
                     input_grad: bool = True) -> torch.Tensor | None:
        """The gradients of a shared factor from the token rows: B (``other`` = the output gradient ``[T, out]``,
        ``g_mid_tok`` = the summed mids): ``B^T``'s gradient ``mid^T g`` into the sinks, returns the mids' gradient
        ``g B`` (``[T, r_max]``); A (``other`` = the token rows ``[T, in]``, ``g_mid_tok`` = the mids' gradient
        summed over each token's k rows): A's gradient ``g_mid^T x`` into the sinks, returns the token rows' input
        gradient ``g_mid A`` (``[T, in]``, when ``input_grad``)."""
        r_max = g_mid_tok.shape[1]
        if which == "B":
            back = other.new_zeros(other.shape[0], r_max)
        else:
            back = other.new_zeros(other.shape) if input_grad else None
        for seg in self.members:
            a, r = seg.adapter, seg.adapter.rank
            m, o = g_mid_tok[seg.start : seg.end, :r], other[seg.start : seg.end]
            factor = self.grad_scale * (a.scale if which == "B" else 1.0)
            sink = a.grads[f"{target}.{which}"][position][0]
            grad = (m.t() @ o).float()
            sink.add_(grad, alpha=factor) if factor != 1.0 else sink.add_(grad)
            f = self._token_factor(seg, target, which, position)
            if which == "B":
                back[seg.start : seg.end, :r] = o @ f.t()
            elif back is not None:
                back[seg.start : seg.end].add_(m @ f)
        return back
