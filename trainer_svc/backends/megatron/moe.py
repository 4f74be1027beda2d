"""Mixture-of-experts layers (Qwen3-MoE) on megatron-core's ``MoELayer``.

megatron-core splits an MoE layer into three small objects with narrow interfaces, and we keep that split:

* the router, :class:`SlotRouter` (megatron's router interface; ``mlp.router.weight`` = HF ``mlp.gate.weight``,
  frozen): megatron's fp32 top-k routing (``topk_routing_with_score_function``), no load-balancing loss, no token
  dropping. Qwen3-MoE's ``norm_topk_prob`` (softmax over all experts, top-k, renormalize) is the softmax over the
  k chosen logits (``moe_router_pre_softmax=False``), the same probabilities; without it, softmax then top-k. Each
  chosen expert ``e`` of a token of the batch's j-th expert adapter becomes *virtual* expert ``e * slots + j``;
* the token dispatcher: megatron's ``alltoall`` dispatcher over the virtual experts (it permutes each token's k
  copies by virtual expert, so every expert's rows arrive sorted by tenant, and exchanges them between
  expert-parallel ranks; nothing is padded, no capacity). Virtual experts ``e * slots + j`` of one expert are
  adjacent, so megatron's contiguous assignment of experts to EP ranks keeps a real expert's slots together;
* the experts, :class:`GroupedExperts` (ours; megatron's grouped experts need TransformerEngine or the
  ``grouped_gemm`` package): the local experts' weights as two 3-D tensors in HF's own layout (``weight1[E, 2F,
  h]`` = ``[gate; up]`` rows per expert, ``weight2[E, h, F]``); each base expert GEMM is one ``torch._grouped_mm``
  over the rows with per-expert offsets, each expert-LoRA GEMM one over the tenant x expert segments
  (:class:`ExpertRoute`, :class:`.lora._ExpertLoraAdd`), where the kernel exists (bf16 on sm90; on CPU torch's
  loop); elsewhere a loop over the groups.

Experts are never sharded by tensor parallelism (``expert_tensor_parallel_size = 1``): under TP every rank
dispatches the same tokens and computes the whole MoE layer; expert parallelism (EP) spreads the experts over the
data-parallel ranks instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lora import grouped_mm_supported

# torch._grouped_mm refuses 1,024 groups per call on the H100 ("Can't process more than 1024 groups"); 128 experts
# times 8 adapter slots (the virtual experts of fused tenants) is more.
MAX_GROUPS = 512


def _group_chunks(offs: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(first group, end group, first row, end row) of each run of at most MAX_GROUPS groups (one host sync, only
    when there are more groups than one call takes)."""
    groups = offs.shape[0]
    ends = list(range(MAX_GROUPS, groups, MAX_GROUPS)) + [groups]
    rows = offs[[e - 1 for e in ends]].tolist()
    out, g0, r0 = [], 0, 0
    for g1, r1 in zip(ends, rows):
        out.append((g0, g1, r0, int(r1)))
        g0, r0 = g1, int(r1)
    return out


def segment_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for ``x[N, k]`` sorted by group, ``w[G, k, n]``: one grouped GEMM (one per
    MAX_GROUPS groups), or a loop over the groups' host ``counts`` where the kernel does not run."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[2])
    if counts is None:
        if offs.shape[0] <= MAX_GROUPS:
            return torch._grouped_mm(x, w, offs=offs)
        return torch.cat([torch._grouped_mm(x[r0:r1], w[g0:g1], offs=offs[g0:g1] - r0) if r1 > r0
                          else x.new_zeros(0, w.shape[2]) for g0, g1, r0, r1 in _group_chunks(offs)])
    return torch.cat([part @ w[g] for g, part in enumerate(x.split(counts))])


def segment_outer(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """``a[rows of g]^T @ b[rows of g]`` per group: ``[G, a_cols, b_cols]`` (the weight gradients of
    :func:`segment_mm`; a group without rows gets zeros)."""
    groups = offs.shape[0]
    if a.shape[0] == 0:
        return a.new_zeros(groups, a.shape[1], b.shape[1])
    if counts is None:
        if groups <= MAX_GROUPS:
            return torch._grouped_mm(a.t(), b, offs=offs)
        return torch.cat([torch._grouped_mm(a[r0:r1].t(), b[r0:r1], offs=offs[g0:g1] - r0) if r1 > r0
                          else a.new_zeros(g1 - g0, a.shape[1], b.shape[1])
                          for g0, g1, r0, r1 in _group_chunks(offs)])
    return torch.stack([pa.t() @ pb for pa, pb in zip(a.split(counts), b.split(counts))])


class _ExpertLinear(torch.autograd.Function):
    """``x[rows of expert e] @ w[e]^T`` (``w[E, out, in]``) with a frozen weight: the backward computes only the
    input gradient (the base experts never get weight gradients; torch's own ``_grouped_mm`` backward also fails on
    CPU for broadcast gradients)."""

    @staticmethod
    def forward(ctx, x, w, offs, counts):
        ctx.save_for_backward(w, offs)
        ctx.counts = counts
        return segment_mm(x, w.transpose(1, 2), offs, counts)

    @staticmethod
    def backward(ctx, g):
        w, offs = ctx.saved_tensors
        return segment_mm(g.contiguous(), w, offs, ctx.counts), None, None, None


class ExpertRoute:
    """Where a batch's expert rows are on this rank. The dispatcher sorts rows by *virtual* expert ``v = e * slots
    + s``: local expert ``e``, adapter slot ``s`` (:class:`SlotRouter`), so each expert's rows are contiguous
    (``offs``: the base GEMMs' groups) and within them each adapter slot's (``slot_offs``: the LoRA GEMMs' groups,
    tenant x expert segments). ``counts`` / ``slot_counts`` are host counts, None where the grouped kernel runs."""

    __slots__ = ("counts", "experts", "offs", "per_virtual", "slot_counts", "slot_offs", "slots")

    def __init__(self, tokens_per_virtual: torch.Tensor, experts: int, slots: int, device, grouped: bool):
        per_virtual = tokens_per_virtual.to(torch.int64)
        per_expert = per_virtual.view(experts, slots).sum(1)
        self.experts, self.slots = experts, slots
        self.offs = per_expert.cumsum(0).to(device=device, dtype=torch.int32)
        self.slot_offs = per_virtual.cumsum(0).to(device=device, dtype=torch.int32)
        self.per_virtual = per_virtual
        self.counts = None if grouped else per_expert.tolist()
        self.slot_counts = None if grouped else per_virtual.tolist()

    def host_slot_counts(self) -> list[int]:
        if self.slot_counts is None:
            self.slot_counts = self.per_virtual.tolist()
        return self.slot_counts


class GroupedExperts(torch.nn.Module):
    """The local experts of one MoE layer (megatron's experts interface: ``forward(tokens sorted by expert,
    tokens_per_expert, probs) -> (output, None)``). The dispatcher hands it ``experts x slots`` virtual experts
    (:class:`SlotRouter`); the base weights are the real experts'.

    ``lora`` (:class:`.lora.MegatronLora`, when the model trains expert adapters) adds the routed adapters' expert
    deltas to the outputs of the two expert GEMMs, per tenant x expert segment."""

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
        self.lora = None
        self.layer_index = -1

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        grouped = grouped_mm_supported(x.device, x.dtype) and self._aligned(x)
        route = ExpertRoute(tokens_per_expert, self.num_local_experts, self.slots, x.device, grouped)
        h = _ExpertLinear.apply(x, self.weight1, route.offs, route.counts)
        if self.lora is not None:
            h = self.lora.expert_hook("experts.gate_up_proj", self.layer_index, x, h, route)
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
        out = _ExpertLinear.apply(act, self.weight2, route.offs, route.counts)
        if self.lora is not None:
            out = self.lora.expert_hook("experts.down_proj", self.layer_index, act, out, route)
        # As transformers: each expert's output times its routing weight (the dispatcher sums a token's k copies).
        out = out * probs.unsqueeze(-1).to(out.dtype)
        return out, None

    def _aligned(self, x: torch.Tensor) -> bool:
        """The grouped kernel's 16-byte stride alignment for every operand."""
        size = x.element_size()
        return all((d * size) % 16 == 0 for d in (self.weight1.shape[1], self.weight1.shape[2],
                                                    self.weight2.shape[2]))

    def backward_dw(self):  # megatron's delayed-wgrad interface: the base experts have no weight gradients
        return None


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
        self.layer_number = None
        self.token_slots = None  # set by .lora.MegatronLora: () -> [tokens] slot of each token, or None

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden: torch.Tensor, padding_mask=None):
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        x = hidden.reshape(-1, hidden.shape[-1])
        logits = x.float() @ self.weight.float().t()
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
                      expert_parallel_size: int, slots: int = 1) -> dict:
    """The TransformerConfig fields of a Qwen3-MoE layer (see the module docstring); the dispatcher sees
    ``num_experts * slots`` virtual experts (:class:`SlotRouter`)."""
    return {
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
    copies its split sizes to the host plainly (megatron's own copies them on a CUDA side stream)."""
    for i in moe_layers:
        mlp = model.decoder.layers[i].mlp
        mlp.experts.layer_index = i
        if not torch.cuda.is_available():
            mlp.token_dispatcher.__class__ = _host_dispatcher_class()


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
    mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    mlp.submodules.router = SlotRouter
    spec.submodules.mlp = mlp
    return spec
