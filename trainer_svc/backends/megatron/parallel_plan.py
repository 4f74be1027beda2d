"""How the megatron trainer spreads an MoE model over the GPUs it is given: data parallelism over replicas of the base
where one GPU holds the model, expert parallelism where it does not; chosen from the model's shape and the GPUs,
not by hand (issue 35). An operator's explicit ``expert_parallel_size`` still wins.

Every GPU of the job is a data-parallel rank (world = TP x DP); expert parallelism spreads each MoE layer's experts
over EP of those ranks, which then exchange tokens all-to-all in every MoE layer (megatron's layout, experts
unsplit by TP). Replicas need no exchange: at equal tokens per GPU, DP=2 does twice the work of one GPU, while EP=2
measured 0.91x of one GPU on two H200s (Qwen3-30B-A3B, docs/benchmarks.md). So the plan takes EP=1 whenever the
memory plan fits one GPU, else the smallest EP that fits.

The memory plan of one GPU (bytes), what :func:`plan_parallelism` sums:

* ``weights``: the base in the compute dtype, the routed experts' share divided by EP, the rest by TP;
* ``adapters``: the resident adapters' fp32 params, grads and both AdamW moments (the engine's flat buffers); their
  per-expert factors divided by EP;
* ``activations``: one backward pass of ``tokens_per_gpu`` tokens with every layer recomputed (what recompute
  ``auto`` falls back to: each layer's input, plus one layer's full working set, :func:`.recompute.layer_bytes_per_token`),
  and the logits (their copy and gradient);
* ``all_to_all``: under EP, the dispatcher's buffers: each token's k expert rows sent and received in the dispatch
  and again in the combine, the receiving side sized for ``A2A_IMBALANCE`` times the even share (megatron's
  dispatcher drops no token and pads nothing, so a rank receives whatever the router sends its experts);
* ``reserve``: ``RESERVE_FRACTION`` of the GPU (allocator fragmentation, kernel workspaces, the CUDA context), as the
  recompute budget keeps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .layout import LlamaShape
from .recompute import layer_bytes_per_token

RESERVE_FRACTION = 0.06
A2A_IMBALANCE = 2.0
# What the trainer plans for when nobody says: one backward pass of 8 datums of 2,048 tokens per GPU, and each of
# the device slots holding a rank-16 adapter on every target (shared-outer on the experts).
DEFAULT_TOKENS_PER_GPU = 8 * 2048
DEFAULT_PLAN_RANK = 16
DEFAULT_PLAN_LAYOUT = "shared_outer"


@dataclass(frozen=True)
class ModelSize:
    """The model as the plan sees it: its decoder shape (layer count, experts, widths: the parameter counts follow),
    top-k, tied embeddings and the bytes of its compute dtype."""

    shape: LlamaShape
    top_k: int = 0
    tied_embeddings: bool = False
    dtype_bytes: int = 2

    @property
    def expert_params(self) -> int:
        """The routed experts' weights (what EP spreads)."""
        s = self.shape
        return len(s.moe_layers) * s.num_experts * 3 * s.hidden_size * s.moe_ffn_hidden_size

    @property
    def params(self) -> int:
        s = self.shape
        h = s.hidden_size
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        if s.gated_attention:
            q *= 2  # q_proj also emits the output gate
        attention = h * (q + 2 * kv) + q * h // (2 if s.gated_attention else 1) + 2 * h + 2 * s.head_dim
        mixers = len(s.attention_layers) * attention
        if s.linear_layers:  # Qwen3.5's Gated DeltaNet: in_proj_qkv, z, b, a, conv1d, out_proj, two norms
            lin = s.linear
            conv = 2 * lin.key_dim + lin.value_dim
            mixers += len(s.linear_layers) * (h * (conv + lin.value_dim + 2 * lin.num_v_heads) + conv * lin.conv_kernel
                                              + lin.value_dim * h + 2 * h + lin.head_v_dim + 2 * lin.num_v_heads)
        dense = 3 * h * s.ffn_hidden_size
        router = s.num_experts * h + 3 * h * s.shared_ffn_hidden_size + (h if s.shared_ffn_hidden_size else 0)
        layers = mixers + len(s.dense_layers) * dense + len(s.moe_layers) * router
        embeddings = s.vocab_size * h * (1 if self.tied_embeddings else 2) + h
        return layers + embeddings + self.expert_params


@dataclass(frozen=True)
class Gpus:
    count: int
    memory_bytes: int  # each


@dataclass(frozen=True)
class AdapterMemory:
    """The resident adapters' device bytes per replica: ``replicated`` on every rank, ``per_expert`` (per-expert
    factors) spread over the EP ranks."""

    replicated: int = 0
    per_expert: int = 0

    def on_rank(self, ep: int) -> int:
        return self.replicated + -(-self.per_expert // ep)


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's bytes (see the module docstring)."""

    weights: int
    adapters: int
    activations: int
    all_to_all: int
    reserve: int
    capacity: int

    @property
    def total(self) -> int:
        return self.weights + self.adapters + self.activations + self.all_to_all + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class ParallelPlan:
    data_parallel: int  # ranks of the job / TP: every one a replica of the non-expert weights
    expert_parallel: int  # of the data-parallel ranks, how many share one copy of the experts
    tensor_parallel: int
    memory: MemoryPlan
    reason: str

    def as_dict(self) -> dict:
        memory = asdict(self.memory) | {"total": self.memory.total, "fits": self.memory.fits}
        return {"data_parallel": self.data_parallel, "expert_parallel": self.expert_parallel,
                "tensor_parallel": self.tensor_parallel, "memory_bytes": memory, "reason": self.reason}


def memory_plan(model: ModelSize, gpus: Gpus, adapters: AdapterMemory, ep: int, tp: int = 1,
                tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU, adapter_slots: int = 8) -> MemoryPlan:
    """One GPU's memory at expert parallelism ``ep`` and tensor parallelism ``tp`` (``adapter_slots``: the router's
    expert adapter slots, whose fp32 maps the dispatcher keeps under EP)."""
    s, b = model.shape, model.dtype_bytes
    expert = model.expert_params
    weights = ((model.params - expert) // tp + -(-expert // ep)) * b
    full, kept = layer_bytes_per_token(s, tp, b, 3, model.top_k, ep, s.num_experts * (adapter_slots + 1))
    logits = 3 * (s.vocab_size // tp) * b
    activations = tokens_per_gpu * (s.num_layers * kept + full + logits)
    all_to_all = 0
    if ep > 1 and s.moe_layers:
        rows = tokens_per_gpu * model.top_k
        all_to_all = int(2 * (1 + A2A_IMBALANCE) * rows * s.hidden_size * b)
    return MemoryPlan(weights, adapters.on_rank(ep), activations, all_to_all,
                      int(RESERVE_FRACTION * gpus.memory_bytes), gpus.memory_bytes)


def plan_parallelism(model: ModelSize, gpus: Gpus, adapters: AdapterMemory, *, tp: int = 1,
                     expert_parallel: int | None = None, tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU,
                     adapter_slots: int = 8) -> ParallelPlan:
    """DP over replicas when the model, its activations, the adapters (and no all-to-all) fit one GPU; else the
    smallest expert-parallel degree that fits (one that divides the expert count and the data-parallel size);
    ``expert_parallel`` (the operator's) is taken as given. Where nothing fits, the degree that comes closest (the
    smallest total), its plan saying it does not fit."""
    if gpus.count % tp:
        raise ValueError(f"{gpus.count} GPUs are not a multiple of tensor_parallel_size={tp}")
    dp = gpus.count // tp

    def plan(ep: int, reason: str) -> ParallelPlan:
        memory = memory_plan(model, gpus, adapters, ep, tp, tokens_per_gpu, adapter_slots)
        return ParallelPlan(dp, ep, tp, memory, reason)

    if expert_parallel is not None:
        return plan(expert_parallel, "expert_parallel_size set by the operator")
    replicas = plan(1, f"the model fits one GPU: {dp} data-parallel replicas")
    if replicas.memory.fits or not model.shape.moe_layers:
        return replicas
    choices = [ep for ep in range(2, dp + 1) if dp % ep == 0 and model.shape.num_experts % ep == 0]
    candidates = [plan(ep, f"the model does not fit one GPU ({replicas.memory.total} > {gpus.memory_bytes} bytes): "
                           f"its experts spread over {ep} GPUs") for ep in choices]
    for candidate in candidates:
        if candidate.memory.fits:
            return candidate
    closest = min([replicas, *candidates], key=lambda p: p.memory.total)
    return ParallelPlan(closest.data_parallel, closest.expert_parallel, tp, closest.memory,
                        f"no expert-parallel degree of {gpus.count} GPUs fits; EP={closest.expert_parallel} comes "
                        f"closest")


def adapter_memory(shape: LlamaShape, tp: int, slots: int, rank: int = DEFAULT_PLAN_RANK,
                   layout: str = DEFAULT_PLAN_LAYOUT) -> AdapterMemory:
    """``slots`` resident rank-``rank`` adapters on every target, as the engine stores them (flat fp32 buffers of
    params, grads and two moments; :func:`.engine.flat_layout`)."""
    from .engine import ROWS, flat_layout

    lay = flat_layout(shape, rank, tp, layout if shape.moe_layers else None, 1)
    unit = ROWS * 4 * slots
    per_expert = lay.ep_numel - lay.dense_numel
    return AdapterMemory((lay.numel - per_expert) * unit, per_expert * unit)


def trainer_plan(hf_config, world: int, tp: int, *, dtype_bytes: int, device_memory_bytes: int, device_slots: int,
                 expert_lora_slots: int = 8, expert_parallel: int | None = None,
                 tokens_per_gpu: int = DEFAULT_TOKENS_PER_GPU) -> ParallelPlan:
    """The plan the megatron trainer starts with: this config on ``world`` GPUs of ``device_memory_bytes`` each,
    ``device_slots`` resident adapters (:func:`adapter_memory`)."""
    from .model import spec_from_hf_config

    spec = spec_from_hf_config(hf_config)
    model = ModelSize(spec.shape, spec.moe_top_k, spec.tie_word_embeddings, dtype_bytes)
    return plan_parallelism(model, Gpus(world, device_memory_bytes), adapter_memory(spec.shape, tp, device_slots),
                            tp=tp, expert_parallel=expert_parallel, tokens_per_gpu=tokens_per_gpu,
                            adapter_slots=expert_lora_slots)


def planned_expert_parallel(hf_config, world: int, tp: int, *, dtype_bytes: int, device_slots: int,
                            expert_lora_slots: int = 8, device_memory_bytes: int | None = None,
                            tokens_per_gpu: int | None = None) -> int:
    """The expert-parallel degree the trainer starts with when the operator sets none: :func:`trainer_plan`'s for
    this job's GPUs (``device_memory_bytes``: each GPU's, default the CUDA device's total memory) and backward
    passes of ``tokens_per_gpu`` tokens (default ``DEFAULT_TOKENS_PER_GPU``). Without a GPU and without a memory
    size there is nothing to plan: 1 (CPU runs: every rank is a replica)."""
    import logging
    import os

    import torch

    if device_memory_bytes is None:
        if not torch.cuda.is_available():
            return 1
        device_memory_bytes = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    plan = trainer_plan(hf_config, world, tp, dtype_bytes=dtype_bytes, device_memory_bytes=device_memory_bytes,
                        device_slots=device_slots, expert_lora_slots=expert_lora_slots,
                        tokens_per_gpu=tokens_per_gpu or DEFAULT_TOKENS_PER_GPU)
    logging.getLogger(__name__).info("parallel plan: %s", plan.as_dict())
    return plan.expert_parallel
