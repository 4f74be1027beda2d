"""Mixture-of-experts layers (Qwen3-MoE) on megatron-core's ``MoELayer``.

megatron-core splits an MoE layer into three small objects with narrow interfaces, and we keep that split:

* the router, :class:`SlotRouter` (megatron's router interface; ``mlp.router.weight`` = HF ``mlp.gate.weight``,
  frozen): megatron's fp32 top-k routing (``topk_routing_with_score_function``), no load-balancing loss, no token
  dropping. Qwen3-MoE's ``norm_topk_prob`` (softmax over all experts, top-k, renormalize) is the softmax over the
  k chosen logits (``moe_router_pre_softmax=False``), the same probabilities; without it, softmax then top-k. Each
  chosen expert ``e`` of a token of the batch's j-th expert adapter becomes *virtual* expert ``e * slots + j``;
* the token dispatch: under expert parallelism megatron's ``alltoall`` dispatcher over the virtual experts (it
  permutes each token's k copies by virtual expert, so every expert's rows arrive sorted by tenant, and exchanges
  them between expert-parallel ranks; nothing is padded, no capacity). Virtual experts ``e * slots + j`` of one
  expert are adjacent, so megatron's contiguous assignment of experts to EP ranks keeps a real expert's slots
  together. Without EP the layer (:func:`_local_moe_layer_class`) skips it: one stable sort of the top-k choices by
  virtual expert gives the same row order, and gathers replace its permutations (:meth:`GroupedExperts.local_forward`);
* the experts, :class:`GroupedExperts` (ours; megatron's grouped experts need TransformerEngine or the
  ``grouped_gemm`` package): the local experts' weights as two 3-D tensors in HF's own layout (``weight1[E, 2F,
  h]`` = ``[gate; up]`` rows per expert, ``weight2[E, h, F]``); each base expert GEMM is one ``torch._grouped_mm``
  over the rows with per-expert offsets, each expert-LoRA GEMM one over the tenant x expert segments
  (:class:`ExpertRoute`; the LoRA math is :meth:`.expert_lora.ExpertBatch.forward` / ``backward``), where
  the kernel exists (bf16 on sm90; on CPU torch's loop); elsewhere a loop over the groups. Router weight, SwiGLU,
  both GEMMs, their LoRA and the sum of a token's k rows are one autograd node, :class:`_ExpertMLP`.

gpt-oss: the router adds a bias to its logits; the experts keep HF's interleaved gate/up rows, add per-expert
biases to both GEMMs (the down bias weighted by the routing probability, which otherwise multiplies the activation
before the down GEMM) and run the clamped SwiGLU (:func:`_gpt_oss_glu_weighted`).

Experts are never sharded by tensor parallelism (``expert_tensor_parallel_size = 1``): under TP every rank
dispatches the same tokens and computes the whole MoE layer; expert parallelism (EP) spreads the experts over the
data-parallel ranks instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplane.models import packed

from .expert_lora import ExpertTokens, in_force
from .kernels import grouped_mm_supported, segment_mm, sum_copies


def _swiglu_weighted_eager(h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``p * silu(gate) * up`` of the fc1 output ``h = [gate | up]`` (``[N, 2F]``) and row weights ``p[N, 1]``."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate).mul_(up).mul_(p)


def _swiglu_weighted_backward_eager(g_pa: torch.Tensor, h: torch.Tensor, p: torch.Tensor):
    """The backward of :func:`_swiglu_weighted_eager` for the gradient ``g_pa`` of its output: ``(g_h [N, 2F],
    g_p [N] fp32)``."""
    gate, up = h.chunk(2, dim=-1)
    sg = F.silu(gate)
    act = sg * up
    g_p = (g_pa * act).sum(-1, dtype=torch.promote_types(g_pa.dtype, torch.float32))
    del act
    g_act = g_pa * p
    g_h = torch.empty_like(h)
    torch.mul(g_act, sg, out=g_h[:, gate.shape[1] :])
    del sg
    torch.ops.aten.silu_backward(g_act.mul_(up), gate, grad_input=g_h[:, : gate.shape[1]])
    return g_h, g_p


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _swiglu_weighted_backward_math(g_pa: torch.Tensor, h: torch.Tensor, p: torch.Tensor):
    gate, up = _wide(h).chunk(2, dim=-1)
    g = _wide(g_pa)
    sig = torch.sigmoid(gate)
    sg = gate * sig
    act = sg * up
    g_act = g * _wide(p)
    g_gate = g_act * up * sig * (1 + gate * (1 - sig))
    return torch.cat([g_gate, g_act * sg], dim=-1).to(h.dtype), (g * act).sum(-1)


def _swiglu_weighted_math(h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    gate, up = _wide(h).chunk(2, dim=-1)
    return (F.silu(gate) * up * _wide(p)).to(h.dtype)


class _Fused:
    """The SwiGLU glue of :class:`_ExpertMLP` (forward: silu, the up product, the routing weight; backward: those
    recomputed, the probability gradient, silu's derivative) as kernels ``torch.compile`` fuses, on CUDA: one pass
    over ``[N, 2F]`` instead of five or six. Anything the compiler refuses, the eager functions do (and keep
    doing); elsewhere (CPU: the exact fp32 tests) always the eager functions. ``LORAPLANE_MOE_COMPILE=0`` turns it
    off."""

    forward_fn = None
    backward_fn = None
    failed = False

    @classmethod
    def usable(cls, t: torch.Tensor) -> bool:
        import os

        if cls.failed or t.device.type != "cuda" or os.environ.get("LORAPLANE_MOE_COMPILE", "1") == "0":
            return False
        if cls.forward_fn is None:
            cls.forward_fn = torch.compile(_swiglu_weighted_math, dynamic=True)
            cls.backward_fn = torch.compile(_swiglu_weighted_backward_math, dynamic=True)
        return True

    @classmethod
    def forward(cls, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if cls.usable(h):
            try:
                return cls.forward_fn(h, p)
            except Exception:  # noqa: BLE001 - any compiler failure: the eager kernels compute the same
                cls.failed = True
        return _swiglu_weighted_eager(h, p)

    @classmethod
    def backward(cls, g_pa: torch.Tensor, h: torch.Tensor, p: torch.Tensor):
        if cls.usable(h):
            try:
                return cls.backward_fn(g_pa, h, p)
            except Exception:  # noqa: BLE001 - as above
                cls.failed = True
        return _swiglu_weighted_backward_eager(g_pa, h, p)


# gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate): gate and up interleaved in the fc1 output.
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def _gpt_oss_glu_weighted(h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``p * (clamp(up) + 1) * g * sigmoid(alpha g)``, ``g = clamp(gate, max=limit)``, of ``h = [g0, u0, g1, ...]``."""
    gate = h[:, ::2].clamp(min=None, max=GPT_OSS_LIMIT)
    up = h[:, 1::2].clamp(min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_ALPHA)) * p


def _gpt_oss_glu_weighted_backward(g_pa: torch.Tensor, h: torch.Tensor, p: torch.Tensor):
    """The backward of :func:`_gpt_oss_glu_weighted` (autograd over the recomputed forward: ``(g_h, g_p [N])``)."""
    with torch.enable_grad():
        hh, pp = h.detach().requires_grad_(), p.detach().requires_grad_()
        g_h, g_p = torch.autograd.grad(_gpt_oss_glu_weighted(hh, pp), (hh, pp), g_pa)
    return g_h, g_p.reshape(-1).to(torch.promote_types(g_p.dtype, torch.float32))


def _act(experts, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return _gpt_oss_glu_weighted(h, p) if experts.bias1 is not None else _Fused.forward(h, p)


def _act_backward(experts, g_pa: torch.Tensor, h: torch.Tensor, p: torch.Tensor):
    if experts.bias1 is not None:
        return _gpt_oss_glu_weighted_backward(g_pa, h, p)
    return _Fused.backward(g_pa, h, p)


def _tokens(x: torch.Tensor, probs: torch.Tensor, plan):
    """The local path's token view of the expert rows, for the LoRA factors shared across experts (None under the
    dispatcher or without expert LoRA)."""
    if plan.tok is None or plan.lora is None:
        return None
    return ExpertTokens(x, plan.tok, plan.inv.view(probs.shape))


class _ExpertMLP(torch.autograd.Function):
    """The routed experts of one MoE layer as ONE autograd node: ``out_i = E_e(p_i x_i)``-style SwiGLU experts with
    the routed adapters' expert LoRA, each row ``i`` (a token's copy for expert ``e``) weighted by its routing
    probability ``p_i``, forward and backward written out so that only what the backward needs is kept:

    * kept: the fc1 output ``h = [gate | up]`` (``[N, 2F]``, the only activation the backward cannot get cheaply),
      the LoRA mids (``[N, r]``) and, in the local mode, the token rows ``x`` (``[T, h]``, not their ``k`` gathered
      copies ``[N, h]``: the backward gathers them again);
    * the weight ``p_i`` multiplies the SwiGLU output (``[N, F]``) before the down GEMM rather than the down output
      (``[N, h]``): the down projection and its LoRA are linear, so ``E(p a) = p E(a)``; its gradient is then
      ``<g_(p a), a>`` per row, with no copy of the expert output kept for it;
    * the base GEMMs are frozen: no weight gradients, the input gradients as grouped GEMMs on the transposed weight
      (no recomputation of any GEMM).

    Two modes. *Local* (``plan.tok`` set, expert parallelism 1): ``x`` are the layer's token rows ``[T, h]``,
    ``probs`` their top-k probabilities ``[T, k]``; the rows are gathered by the sort index once (``tok``), and the
    output is the weighted sum over each token's ``k`` copies (``inv``: where each copy landed), ``[T, h]``; the
    backward gathers the output gradient with ``tok`` and sums the copies' input gradients with ``inv`` (gathers and
    a reduction over ``k``: no atomics, no scatter, no concatenation). *Rows* (megatron's dispatcher, expert
    parallelism): ``x`` are the dispatched rows ``[N, h]`` sorted by (virtual) expert and ``probs`` their
    probabilities ``[N]``; the output is the weighted rows, which the dispatcher un-permutes and sums."""

    @staticmethod
    def forward(ctx, x, probs, anchor, plan):
        experts, route, lora = plan.experts, plan.route, plan.lora
        local = plan.tok is not None
        tokens = _tokens(x, probs, plan)
        p = (probs.reshape(-1)[plan.order] if local else probs).to(x.dtype)
        mid1 = mid2 = None
        # The token gather and the LoRA inside the grouped GEMM's kernel (issue 35; off unless asked for).
        fused = None
        if lora is not None and lora.fusable("experts.gate_up_proj", route, x, tokens):
            fused = lora.fused_gemm("experts.gate_up_proj", plan.position, route, x, experts.weight1,
                                    plan.tok if local else None)
        if fused is not None:
            h, mid1 = fused
        else:
            xs = x.index_select(0, plan.tok) if local else x
            h = segment_mm(xs, experts.weight1.transpose(1, 2), route.offs, route.counts)
            if lora is not None:
                mid1 = lora.forward("experts.gate_up_proj", plan.position, route, xs, h, tokens)
            del xs
        if experts.bias1 is not None:  # gpt-oss: each row's expert's fc1 bias, before the activation
            h = h + experts.bias1[route.row_experts()]
        pa = _act(experts, h, p.unsqueeze(-1))
        fused = None
        if lora is not None and lora.fusable("experts.down_proj", route, pa, tokens):
            fused = lora.fused_gemm("experts.down_proj", plan.position, route, pa, experts.weight2, None)
        if fused is not None:
            out, mid2 = fused
        else:
            out = segment_mm(pa, experts.weight2.transpose(1, 2), route.offs, route.counts)
            if lora is not None:
                mid2 = lora.forward("experts.down_proj", plan.position, route, pa, out, tokens)
        del pa
        if experts.bias2 is not None:  # p (E(a) + b) = E(p a) + p b
            out = out + p.unsqueeze(-1) * experts.bias2[route.row_experts()]
        ctx.save_for_backward(x, probs, h, mid1, mid2)
        ctx.plan = plan
        if not local:
            return out
        y = sum_copies(out, plan.inv.view(probs.shape))
        if lora is not None:
            lora.combine("experts.down_proj", plan.position, mid2, tokens, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, probs, h, mid1, mid2 = ctx.saved_tensors
        plan = ctx.plan
        experts, route, lora = plan.experts, plan.route, plan.lora
        local = plan.tok is not None
        g = g.to(x.dtype)
        g_rows = g.index_select(0, plan.tok) if local else g.contiguous()
        p = (probs.reshape(-1)[plan.order] if local else probs).to(x.dtype).unsqueeze(-1)
        # The gradient of the down projection's input p*a, base and LoRA (the LoRA's A and B gradients land in the
        # adapters' sinks on the way), then SwiGLU's (with the routing weight's).
        g_pa = segment_mm(g_rows, experts.weight2, route.offs, route.counts)
        tokens = _tokens(x, probs, plan)
        if lora is not None:
            lora.backward("experts.down_proj", plan.position, route, _act(experts, h, p), mid2, g_rows,
                                      g_pa, tokens, g)
        g_h, g_p = _act_backward(experts, g_pa, h, p)
        if experts.bias2 is not None:  # the routing weight's share of the bias term p b
            g_p = g_p + (g_rows * experts.bias2[route.row_experts()]).sum(-1, dtype=g_p.dtype)
        del g_rows
        del g_pa
        g_probs = None
        if ctx.needs_input_grad[1]:
            g_probs = g_p.index_select(0, plan.inv).view(probs.shape) if local else g_p
            g_probs = g_probs.to(probs.dtype)
        g_x = None
        if ctx.needs_input_grad[0] or lora is not None:
            g_xs = segment_mm(g_h, experts.weight1, route.offs, route.counts) if ctx.needs_input_grad[0] else None
            g_tok = None
            if lora is not None:
                xs = None
                if not lora.token_shared("experts.gate_up_proj", "A", tokens):
                    xs = x.index_select(0, plan.tok) if local else x
                g_tok = lora.backward("experts.gate_up_proj", plan.position, route, xs, mid1, g_h, g_xs,
                                                  tokens)
            if g_xs is not None:
                g_x = sum_copies(g_xs, plan.inv.view(probs.shape)) if local else g_xs
                if g_tok is not None:
                    g_x.add_(g_tok if g_tok.dtype == g_x.dtype else g_tok.to(g_x.dtype))
        return g_x, g_probs, None, None


class _Plan:
    """What one call of :class:`_ExpertMLP` needs besides its tensors."""

    __slots__ = ("experts", "inv", "lora", "order", "position", "route", "tok")

    def __init__(self, experts, route, lora, position, tok=None, inv=None, order=None):
        self.experts, self.route, self.lora, self.position = experts, route, lora, position
        self.tok, self.inv, self.order = tok, inv, order


class ExpertRoute:
    """Where a batch's expert rows are on this rank. The dispatcher sorts rows by *virtual* expert ``v = e * slots
    + s``: local expert ``e``, adapter slot ``s`` (:class:`SlotRouter`), so each expert's rows are contiguous
    (``offs``: the base GEMMs' groups) and within them each adapter slot's (``slot_offs``: the LoRA GEMMs' groups,
    tenant x expert segments). ``counts`` / ``slot_counts`` are host counts, None where the grouped kernel runs."""

    __slots__ = ("_row_experts", "counts", "experts", "offs", "per_virtual", "slot_counts", "slot_offs", "slots")

    def __init__(self, tokens_per_virtual: torch.Tensor, experts: int, slots: int, device, grouped: bool):
        per_virtual = tokens_per_virtual.to(torch.int64)
        per_expert = per_virtual.view(experts, slots).sum(1)
        self.experts, self.slots = experts, slots
        self.offs = per_expert.cumsum(0).to(device=device, dtype=torch.int32)
        self.slot_offs = per_virtual.cumsum(0).to(device=device, dtype=torch.int32)
        self.per_virtual = per_virtual
        self.counts = None if grouped else per_expert.tolist()
        self.slot_counts = None if grouped else per_virtual.tolist()
        self._row_experts = None

    def row_experts(self) -> torch.Tensor:
        """``[N]`` the local expert of each row (for per-expert biases)."""
        if self._row_experts is None:
            per_expert = self.per_virtual.view(self.experts, self.slots).sum(1).to(self.offs.device)
            self._row_experts = torch.repeat_interleave(
                torch.arange(self.experts, device=self.offs.device), per_expert)
        return self._row_experts

    def host_slot_counts(self) -> list[int]:
        if self.slot_counts is None:
            self.slot_counts = self.per_virtual.tolist()
        return self.slot_counts


class GroupedExperts(torch.nn.Module):
    """The local experts of one MoE layer (megatron's experts interface: ``forward(tokens sorted by expert,
    tokens_per_expert, probs) -> (output, None)``). The dispatcher hands it ``experts x slots`` virtual experts
    (:class:`SlotRouter`); the base weights are the real experts'. Without expert parallelism the layer skips the
    dispatcher and calls :meth:`local_forward` with the token rows and their top-k choices instead.

    ``lora`` (:class:`.expert_lora.ExpertLora`, when the model trains expert adapters) adds the routed adapters' expert
    deltas to the outputs of the two expert GEMMs, per tenant x expert segment (:class:`_ExpertMLP`)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, **_kwargs):
        super().__init__()
        self.config = config
        self.slots = getattr(config, "loraplane_expert_slots", 1)
        if num_local_experts % self.slots:
            raise ValueError(f"{num_local_experts} local virtual experts for {self.slots} adapter slots")
        self.num_local_experts = num_local_experts // self.slots
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        dtype = config.params_dtype
        self.weight1 = torch.nn.Parameter(torch.empty(self.num_local_experts, 2 * ffn, hidden, dtype=dtype),
                                          requires_grad=False)
        self.weight2 = torch.nn.Parameter(torch.empty(self.num_local_experts, hidden, ffn, dtype=dtype),
                                          requires_grad=False)
        # gpt-oss: per-expert biases of both GEMMs; weight1's rows (and bias1) are gate/up interleaved and the
        # activation is its clamped SwiGLU.
        self.bias1 = self.bias2 = None
        if getattr(config, "loraplane_gpt_oss_experts", False):
            self.bias1 = torch.nn.Parameter(torch.empty(self.num_local_experts, 2 * ffn, dtype=dtype),
                                            requires_grad=False)
            self.bias2 = torch.nn.Parameter(torch.empty(self.num_local_experts, hidden, dtype=dtype),
                                            requires_grad=False)
        self.lora = None
        self.layer_index = -1

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """Megatron's dispatcher path (expert parallelism): rows sorted by virtual expert, their probabilities;
        returns the weighted rows (the dispatcher un-permutes and sums a token's k copies)."""
        route = ExpertRoute(tokens_per_expert, self.num_local_experts, self.slots, x.device, self._grouped(x))
        return self._run(x, probs, _Plan(self, route, None, -1)), None

    def local_forward(self, x: torch.Tensor, probs: torch.Tensor, top: torch.Tensor,
                      slot: torch.Tensor | None) -> torch.Tensor:
        """Every expert on this rank: ``x`` the token rows ``[T, h]``, ``probs``/``top`` their top-k probabilities
        and experts ``[T, k]``, ``slot`` each token's adapter slot (None: one slot). One stable sort of the tokens'
        k copies by virtual expert (the order megatron's dispatcher gives: by expert, then adapter slot, then token)
        serves the gather, the un-permutation and the backward of both."""
        k = top.shape[1]
        virtual = top * self.slots + slot.view(-1, 1) if slot is not None and self.slots > 1 else top
        flat = virtual.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = torch.div(order, k, rounding_mode="floor")
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
        counts = torch.bincount(flat, minlength=self.num_local_experts * self.slots)
        route = ExpertRoute(counts, self.num_local_experts, self.slots, x.device, self._grouped(x))
        return self._run(x, probs, _Plan(self, route, None, -1, tok, inv, order))

    def _run(self, x: torch.Tensor, probs: torch.Tensor, plan: _Plan) -> torch.Tensor:
        experts = in_force() if self.lora is not None else None
        anchor = None
        if experts is not None:
            plan.lora, plan.position, anchor = experts, self.lora.position[self.layer_index], experts.anchor
        return _ExpertMLP.apply(x, probs, anchor, plan)

    def _grouped(self, x: torch.Tensor) -> bool:
        """Whether the grouped kernel runs the base GEMMs: it exists for the device and dtype, and every operand
        meets its 16-byte stride alignment."""
        size = x.element_size()
        return grouped_mm_supported(x.device, x.dtype) and all(
            (d * size) % 16 == 0 for d in (self.weight1.shape[1], self.weight1.shape[2], self.weight2.shape[2]))

    def backward_dw(self):  # megatron's delayed-wgrad interface: the base experts have no weight gradients
        return None


class _RouterLogits(torch.autograd.Function):
    """fp32 router logits ``x W^T`` of a frozen router weight: on CUDA one GEMM with bf16 operands and an fp32 output
    (bf16 products are exact in fp32 and the GEMM accumulates in fp32: the fp32 logits without an fp32 copy of the
    ``[T, h]`` activations), elsewhere the fp32 product; the input gradient in fp32, cast once to the input's
    dtype."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        ctx.x_dtype = x.dtype
        if x.dtype != torch.float32 and x.device.type == "cuda" and x.dtype == w.dtype:
            try:
                return torch.mm(x, w.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError):
                pass
        return x.float() @ w.float().t()

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return (g @ w.float()).to(ctx.x_dtype), None


class SlotRouter(torch.nn.Module):
    """The router of an MoE layer (megatron's router interface: ``forward(hidden, padding_mask) -> (probs,
    routing_map)`` over the dispatcher's experts; ``weight`` = HF ``mlp.gate.weight``, frozen).

    The logits, softmax and top-k are megatron's (``topk_routing_with_score_function``, fp32): Qwen3-MoE's
    ``norm_topk_prob`` is the softmax over the k chosen logits (``use_pre_softmax=False``; the renormalized full
    softmax), without it the full softmax then top-k. Each choice of expert ``e`` by a token of the adapter in
    batch slot ``s`` is then sent to virtual expert ``e * slots + s`` (slot ``slots - 1``: no expert adapter), so
    the dispatcher sorts every expert's rows by tenant and the experts run each tenant's expert LoRA on its own
    contiguous rows. With one slot (no expert adapters) this is megatron's plain routing."""

    def __init__(self, config, pg_collection=None, **_kwargs):
        super().__init__()
        self.config = config
        self.slots = getattr(config, "loraplane_expert_slots", 1)
        self.num_experts = config.num_moe_experts // self.slots
        self.topk = config.moe_router_topk
        self.weight = torch.nn.Parameter(torch.empty(self.num_experts, config.hidden_size,
                                                     dtype=config.params_dtype), requires_grad=False)
        # gpt-oss's router adds a bias to its logits (transformers' GptOssTopKRouter: F.linear(x, W, b)).
        self.bias = None
        if getattr(config, "loraplane_gpt_oss_experts", False):
            self.bias = torch.nn.Parameter(torch.empty(self.num_experts, dtype=config.params_dtype),
                                           requires_grad=False)
        self.layer_number = None
        self.token_slots = None  # set by .expert_lora.ExpertLora: () -> [tokens] slot of each token, or None
        # Tests (local path only): ``record`` a list that collects each call's top-k experts ``[T, k]``; ``force``
        # a list of ``[n, k]`` experts the next calls' first n rows use instead of their own top-k (one per call).
        self.record: list[torch.Tensor] | None = None
        self.force: list[torch.Tensor] | None = None

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def route_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, experts)``, both ``[T, k]``, of the token rows ``x[T, h]``: megatron's softmax routing
        (``topk_routing_with_score_function``) without its dense ``[T, experts]`` maps, in fp32 (the logits and
        softmax over ``[T, experts]``; no fp32 copy of ``x`` where a GEMM gives fp32 from bf16 operands)."""
        logits = self._logits(x)
        if self.config.moe_router_pre_softmax:
            probs, top = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k=self.topk, dim=1)
        else:
            scores, top = torch.topk(logits, k=self.topk, dim=1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if self.force:  # tests: the first rows take the experts another model chose, with this router's probabilities
            forced = self.force.pop(0).to(top.device)
            n = min(forced.shape[0], top.shape[0])
            top = torch.cat([forced[:n], top[n:]])
            if self.config.moe_router_pre_softmax:
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, top)
            else:
                probs = torch.softmax(logits.gather(1, top), dim=-1, dtype=torch.float32)
        if self.record is not None:
            self.record.append(top.detach())
        return probs, top

    def token_slot(self, tokens: int, device) -> torch.Tensor | None:
        """``[T]`` adapter slot of each token (None: one slot, no expert adapters)."""
        if self.slots == 1:
            return None
        slot = self.token_slots() if self.token_slots is not None else None
        return slot if slot is not None else torch.full((tokens,), self.slots - 1, dtype=torch.int64, device=device)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = _RouterLogits.apply(x, self.weight)
        return logits if self.bias is None else logits + self.bias.float()

    def forward(self, hidden: torch.Tensor, padding_mask=None):
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        x = hidden.reshape(-1, hidden.shape[-1])
        logits = self._logits(x)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax, score_function="softmax")
        if self.slots == 1:
            return probs, routing_map
        tokens = logits.shape[0]
        slot = self.token_slots() if self.token_slots is not None else None
        if slot is None:
            slot = torch.full((tokens,), self.slots - 1, dtype=torch.int64, device=logits.device)
        index = slot.view(tokens, 1, 1).expand(tokens, self.num_experts, 1)
        virtual = (tokens, self.num_experts, self.slots)
        probs = probs.new_zeros(virtual).scatter(2, index, probs.unsqueeze(-1)).view(tokens, -1)
        routing_map = routing_map.new_zeros(virtual).scatter(2, index, routing_map.unsqueeze(-1)).view(tokens, -1)
        return probs, routing_map


def moe_config_fields(num_experts: int, top_k: int, moe_ffn_hidden_size: int, norm_topk_prob: bool,
                      expert_parallel_size: int, slots: int = 1, shared_ffn_hidden_size: int = 0) -> dict:
    """The TransformerConfig fields of a Qwen3-MoE layer (see the module docstring); the dispatcher sees
    ``num_experts * slots`` virtual experts (:class:`SlotRouter`). ``shared_ffn_hidden_size``: Qwen3.5-MoE's shared
    expert beside the routed ones, with its sigmoid gate (:class:`PackedSharedExpertMLP`)."""
    shared = {}
    if shared_ffn_hidden_size:
        shared = {"moe_shared_expert_intermediate_size": shared_ffn_hidden_size, "moe_shared_expert_gate": True,
                  "moe_shared_expert_overlap": False}
    return {
        **shared,
        "num_moe_experts": num_experts * slots,
        "moe_router_topk": top_k,
        "moe_ffn_hidden_size": moe_ffn_hidden_size,
        "moe_router_pre_softmax": not norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_input_jitter_eps": None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_expert_capacity_factor": None,
        "expert_model_parallel_size": expert_parallel_size,
        "expert_tensor_parallel_size": 1,
    }


def prepare_megatron_moe() -> None:
    """Before building MoE layers: what megatron-core 0.16 needs to build and run them without TransformerEngine
    and, on a machine without CUDA (CPU tests), without CUDA streams (see :func:`finish_moe_layers`)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        # The router GEMM tests this name, which megatron defines only when TransformerEngine imports; None is its
        # own "no TE" value (then the router logits are a plain fp32 torch.mm).
        moe_utils.te_general_gemm = None
    if not torch.cuda.is_available() and MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA"  # never used: see finish_moe_layers


def finish_moe_layers(model, moe_layers: tuple[int, ...]) -> None:
    """After building: each MoE layer's experts learn their layer index; without CUDA each alltoall dispatcher
    copies its split sizes to the host plainly (megatron's own copies them on a CUDA side stream); a shared expert
    learns the datum boundaries of each row its layer runs (:class:`PackedSharedExpertMLP`)."""
    for i in moe_layers:
        layer = model.decoder.layers[i]
        mlp = layer.mlp
        mlp.experts.layer_index = i
        if not torch.cuda.is_available():
            mlp.token_dispatcher.__class__ = _host_dispatcher_class()
        if getattr(mlp, "shared_experts", None) is not None:
            layer.forward = _with_bounds(layer.forward, mlp.shared_experts)


def _with_bounds(forward, shared):
    """The decoder layer's forward, handing the row's datum boundaries (``packed_seq_params``, which megatron passes
    to attention only) to its shared expert first; activation recomputation reruns this wrapper too."""

    def run(*args, **kwargs):
        shared.bounds = getattr(kwargs.get("packed_seq_params"), "bounds", None)
        return forward(*args, **kwargs)

    return run


_SHARED_EXPERT = []


def _shared_expert_class():
    """megatron's SharedExpertMLP with its sigmoid gate taken per datum of the packed row: the gate's hidden -> 1
    product and its sigmoid over the whole row would round a datum's values by where they sit in it (a vectorised
    kernel treats a tensor's tail apart), so a tenant's logits would depend on its neighbours' datums (the torch
    backend's Qwen3.5 packing does the same). ``gate * shared`` as transformers multiplies them."""
    if not _SHARED_EXPERT:
        from megatron.core.transformer.mlp import MLP
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        class PackedSharedExpertMLP(SharedExpertMLP):
            bounds = None

            def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
                output, _ = MLP.forward(self, hidden_states)
                if not self.use_shared_expert_gate:
                    return output
                flat = hidden_states.reshape(-1, hidden_states.shape[-1])
                # Per datum only where the contract is bit-exactness (the CPU); on CUDA one call for the row.
                exact = packed.packed_impl(flat.device) == packed.EXACT
                bounds = (self.bounds if exact else None) or ((0, flat.shape[0]),)
                gates = [torch.sigmoid(F.linear(flat[s:e].contiguous(), self.gate_weight)) for s, e in bounds]
                gate = gates[0] if len(gates) == 1 else torch.cat(gates, 0)
                return gate.view(*output.shape[:-1], 1) * output

        _SHARED_EXPERT.append(PackedSharedExpertMLP)
    return _SHARED_EXPERT[0]


_HOST_DISPATCHER = []


def _host_dispatcher_class():
    if not _HOST_DISPATCHER:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        class HostAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
            def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
                if not self.drop_and_pad and point == self.cuda_dtoh_point:
                    for name in ("input_splits", "output_splits", "output_splits_tp"):
                        value = getattr(self, name)
                        if torch.is_tensor(value):  # what all_to_all_single takes as split sizes
                            setattr(self, name, value.tolist())
                return tokens_per_expert

        _HOST_DISPATCHER.append(HostAlltoAllDispatcher)
    return _HOST_DISPATCHER[0]


def moe_layer_spec(dense_spec, num_experts: int):
    """The local layer spec of an MoE decoder layer: ``dense_spec`` with its MLP replaced by megatron's MoELayer
    whose experts are :class:`GroupedExperts`."""
    import copy

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(dense_spec)
    mlp = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=num_experts, moe_grouped_gemm=False)
    mlp.module = _local_moe_layer_class()
    mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    mlp.submodules.router = SlotRouter
    if mlp.submodules.shared_experts is not None:  # built only where the config has a shared expert
        mlp.submodules.shared_experts.module = _shared_expert_class()
    spec.submodules.mlp = mlp
    return spec


_LOCAL_MOE_LAYER = []


def _local_moe_layer_class():
    """megatron's MoELayer, but without expert parallelism the dispatcher is skipped: the router's top-k
    (:meth:`SlotRouter.route_topk`) goes straight to :meth:`GroupedExperts.local_forward`, which sorts once, gathers,
    runs the experts and sums each token's k weighted copies in one autograd node (megatron's alltoall dispatcher
    on one rank builds dense ``[T, experts]`` maps, permutes by ``masked_select``, re-sorts its chunks with a
    ``torch.cat`` of every expert's rows, and un-permutes with a scatter-add whose backward is an atomic
    ``index_add``). Under EP (or anything else the local path does not do) it is megatron's forward unchanged."""
    if not _LOCAL_MOE_LAYER:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        class LocalMoELayer(MoELayer):
            def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
                d = self.token_dispatcher
                if (intermediate_tensors is not None or padding_mask is not None or self.shared_expert_overlap
                        or self.moe_layer_recompute or getattr(d, "ep_size", 1) > 1 or getattr(d, "tp_size", 1) > 1
                        or not isinstance(self.experts, GroupedExperts) or not isinstance(self.router, SlotRouter)):
                    return super().forward(hidden_states, intermediate_tensors, padding_mask)
                x = hidden_states.reshape(-1, hidden_states.shape[-1])
                probs, top = self.router.route_topk(x)
                y = self.experts.local_forward(x, probs, top, self.router.token_slot(x.shape[0], x.device))
                y = y.view(hidden_states.shape)
                if self.use_shared_expert:  # routed + gated shared, as transformers adds them
                    y = y + self.shared_experts(hidden_states)
                return y, None

        _LOCAL_MOE_LAYER.append(LocalMoELayer)
    return _LOCAL_MOE_LAYER[0]
