"""Mixture-of-experts layers (Qwen3-MoE) on megatron-core's ``MoELayer``.

megatron-core splits an MoE layer into three small objects, and we keep that split:

* the router: megatron's ``TopKRouter`` (``mlp.router.weight`` = HF ``mlp.gate.weight``), with fp32 router math
  (``moe_router_dtype="fp32"``), no load-balancing loss and no token dropping. Qwen3-MoE's ``norm_topk_prob``
  (softmax over all experts, top-k, renormalize) is megatron's top-k on the logits followed by a softmax over the k
  chosen ones (``moe_router_pre_softmax=False``): the same probabilities, since a softmax restricted to the chosen
  experts is the renormalized full softmax. Without ``norm_topk_prob`` it is ``moe_router_pre_softmax=True``
  (softmax over all, top-k, no renormalization). Its weight is frozen like every base weight, so LoRA training
  never moves the routing;
* the token dispatcher: megatron's ``alltoall`` dispatcher (permutes each token's k copies by expert, exchanges
  them between expert-parallel ranks, and back; nothing is padded, no capacity);
* the experts: :class:`GroupedExperts` (ours; megatron's grouped experts need TransformerEngine or the
  ``grouped_gemm`` package): all local experts' weights as two 3-D tensors, in HF's own layout
  (``weight1[E, 2F, h]`` = ``[gate; up]`` rows per expert, ``weight2[E, h, F]``), and each of the two expert
  GEMMs one ``torch._grouped_mm`` over the tokens sorted by expert with their cumulative counts as offsets, where
  the kernel exists (bf16 on sm90; on CPU torch's loop); elsewhere a loop over the experts.

Experts are never sharded by tensor parallelism (``expert_tensor_parallel_size = 1``): under TP every rank computes
the whole MoE layer on the same tokens; expert parallelism (EP) spreads the experts over ranks instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lora import grouped_mm_supported


def expert_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """``x[rows of expert e] @ w[e]^T`` for every expert: ``x[N, in]`` sorted by expert, ``w[E, out, in]``,
    ``offs`` the int32 cumulative row ends; ``counts`` (host) for the loop path, None on the grouped one."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if counts is None:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return torch.cat([part @ w[e].t() for e, part in enumerate(x.split(counts))])


def expert_mm_t(g: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """``g[rows of expert e] @ w[e]``: the input gradient of :func:`expert_mm`."""
    if g.shape[0] == 0:
        return g.new_zeros(0, w.shape[2])
    if counts is None:
        return torch._grouped_mm(g, w, offs=offs)
    return torch.cat([part @ w[e] for e, part in enumerate(g.split(counts))])


class _ExpertLinear(torch.autograd.Function):
    """:func:`expert_mm` with a frozen weight: the backward computes only the input gradient (the base experts
    never get weight gradients; torch's own ``_grouped_mm`` backward also fails on CPU for broadcast gradients)."""

    @staticmethod
    def forward(ctx, x, w, offs, counts):
        ctx.save_for_backward(w, offs)
        ctx.counts = counts
        return expert_mm(x, w, offs, counts)

    @staticmethod
    def backward(ctx, g):
        w, offs = ctx.saved_tensors
        return expert_mm_t(g.contiguous(), w, offs, ctx.counts), None, None, None


class GroupedExperts(torch.nn.Module):
    """The local experts of one MoE layer (megatron's experts interface: ``forward(tokens sorted by expert,
    tokens_per_expert, probs) -> (output, None)``).

    ``lora`` (set by :class:`.lora.MegatronLora` when adapters train the experts) is called on the two expert
    GEMMs' inputs and outputs to add the routed adapters' expert deltas."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, **_kwargs):
        super().__init__()
        self.config = config
        self.num_local_experts = num_local_experts
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        dtype = config.params_dtype
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2 * ffn, hidden, dtype=dtype),
                                          requires_grad=False)
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn, dtype=dtype),
                                          requires_grad=False)
        self.ep_rank = pg_collection.ep.rank() if pg_collection is not None and pg_collection.ep is not None else 0
        self.lora = None  # (hook, layer) while MegatronLora trains expert adapters
        self.layer_index = -1

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        device = x.device
        grouped = grouped_mm_supported(device, x.dtype) and self._aligned(x)
        counts = None if grouped else [int(c) for c in tokens_per_expert.tolist()]
        offs = tokens_per_expert.to(device=device, dtype=torch.int64).cumsum(0).to(torch.int32)
        route = ExpertRoute(offs, counts, tokens_per_expert)
        w1, w2 = self.weight1, self.weight2
        h = _ExpertLinear.apply(x, w1, offs, counts)
        if self.lora is not None:
            h = self.lora.expert_hook("fc1", self.layer_index, x, h, route)
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
        out = _ExpertLinear.apply(act, w2, offs, counts)
        if self.lora is not None:
            out = self.lora.expert_hook("fc2", self.layer_index, act, out, route)
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


class ExpertRoute:
    """Where a batch's expert rows are: ``offs`` (int32 cumulative row ends on the device), ``counts`` (host
    counts, None when the grouped kernel runs) and the per-expert counts as the dispatcher gave them."""

    __slots__ = ("counts", "offs", "tokens_per_expert")

    def __init__(self, offs, counts, tokens_per_expert):
        self.offs = offs
        self.counts = counts
        self.tokens_per_expert = tokens_per_expert


def moe_config_fields(num_experts: int, top_k: int, moe_ffn_hidden_size: int, norm_topk_prob: bool,
                      expert_parallel_size: int) -> dict:
    """The TransformerConfig fields of a Qwen3-MoE layer (see the module docstring)."""
    return {
        "num_moe_experts": num_experts,
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
    spec.submodules.mlp = mlp
    return spec
