"""Pure-tensor layout rules between Hugging Face Llama-family weights / PEFT LoRA and megatron-core's fused layers.

This module imports only torch, so CPU-only CI can check the layout without megatron-core installed.

megatron-core (local layer spec) fuses
  * q, k, v into ``linear_qkv`` with the GQA interleave: for each query group g the rows are
    ``[q heads g*hpg .. (g+1)*hpg-1, k head g, v head g]`` (hpg = query heads per group);
  * gate, up into ``linear_fc1`` as ``[gate; up]`` (``MLP.glu`` applies the activation to the first half);
  * Qwen2's q, k, v biases into ``linear_qkv.bias`` with the same interleave as the weight rows (a bias is one more
    value per output row); Qwen3's per-head ``q_norm`` / ``k_norm`` weights are megatron's ``q_layernorm`` /
    ``k_layernorm`` (``[head_dim]``, identical on every rank).
Under tensor parallelism a column-parallel layer keeps a contiguous chunk of its output rows. Query groups are
contiguous in the interleave, so rank r holds groups ``[r*G/TP, (r+1)*G/TP)``; fc1 is stored per rank as
``[gate_r; up_r]`` (so the global fc1 is ``[gate_0; up_0; gate_1; up_1; ...]``). A row-parallel layer keeps a
contiguous chunk of its input columns.

PEFT's per-projection LoRA maps onto this exactly: ``delta_q = scale * B_q A_q x`` and so on, where a rank holds
A in full and the contiguous row-chunk r of every B for column-parallel targets (q, k, v, gate, up), and the
column-chunk r of A plus B in full for row-parallel targets (o, down). The per-projection deltas are placed in
the fused layout with the same interleave as the base weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COLUMN_PARALLEL_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                           "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a",
                           "shared_expert.gate_proj", "shared_expert.up_proj")
ROW_PARALLEL_TARGETS = ("o_proj", "down_proj", "out_proj", "shared_expert.down_proj")
# An MoE layer's shared expert (Qwen3.5-MoE): a SwiGLU MLP beside the routed experts, tensor-parallel like the dense
# MLP (megatron's SharedExpertMLP: linear_fc1 [gate; up], linear_fc2).
SHARED_EXPERT_TARGETS = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Qwen3.5's Gated DeltaNet layers (:mod:`.gated_delta_net`): Tinker's three pairs on the Q, K and V rows of the fused
# in_proj_qkv, then in_proj_z/b/a and out_proj.
LINEAR_ATTENTION_TARGETS = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")

# Which megatron module of a decoder layer each HF projection lives in.
MCORE_MODULE_OF_TARGET = {
    "q_proj": "self_attention.linear_qkv",
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1",
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
}
HF_MODULE_OF_TARGET = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's dimensions (Qwen3.5's ``linear_*`` config fields): ``num_k_heads`` query/key heads
    of ``head_k_dim``, ``num_v_heads`` value heads of ``head_v_dim`` (each q/k head serves ``num_v_heads /
    num_k_heads`` consecutive value heads), a depthwise causal conv1d of ``conv_kernel`` taps."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-family decoder that the layout depends on."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    # Mixture of experts (Qwen3-MoE): the routed experts of the layers in ``moe_layers`` (the others are dense
    # SwiGLU MLPs of ``ffn_hidden_size``); each expert is a SwiGLU MLP of ``moe_ffn_hidden_size``.
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()
    # Hybrid decoders (Qwen3.5): the layers whose token mixer is a Gated DeltaNet (the others attend), its
    # dimensions; whether q_proj also emits a sigmoid output gate per head (HF rows [query | gate] per head); whether
    # the RMSNorms scale by (1 + w) (the decoder's norms and q/k norms, not the DeltaNet's gated norm): the
    # megatron model's torch RMSNorm gets 1 + w as its weight.
    linear_layers: tuple[int, ...] = ()
    linear: LinearAttentionShape | None = None
    # The MoE layers' shared expert (its SwiGLU width; 0 = none) and its sigmoid gate (hidden -> 1).
    shared_ffn_hidden_size: int = 0
    gated_attention: bool = False
    zero_centered_norms: bool = False
    # attention_bias (gpt-oss; Llama/Qwen3 attention_bias=True): o_proj has a bias too (linear_proj.bias).
    o_bias: bool = False

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear(self, layer: int) -> bool:
        return layer in self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    def has_target(self, layer: int, target: str) -> bool:
        """Whether ``layer`` offers the dense projection ``target`` as a LoRA target: its token mixer's (attention
        or Gated DeltaNet) and, on a dense model, the MLP's; an MoE model's MLP targets are its experts
        (loraplane.models.families.lora_targets: not even its dense layers offer gate/up/down, which HF PEFT would
        rewrite into the experts' target_parameters)."""
        if target in ATTENTION_TARGETS:
            return not self.is_linear(layer)
        if target in LINEAR_ATTENTION_TARGETS:
            return self.is_linear(layer)
        if target in SHARED_EXPERT_TARGETS:
            return self.is_moe(layer) and self.shared_ffn_hidden_size > 0
        return not self.moe_layers

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    def check_expert_parallel(self, ep: int) -> None:
        if self.moe_layers and self.num_experts % ep:
            raise ValueError(f"expert_parallel_size={ep} must divide num_experts={self.num_experts}")
        if not self.moe_layers and ep > 1:
            raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_tensor_parallel(self, tp: int) -> None:
        """Raises ValueError when this shape cannot be split over ``tp`` ranks."""
        problems = []
        if self.num_kv_heads % tp:
            problems.append(f"num_key_value_heads={self.num_kv_heads}")
        if self.dense_layers and self.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={self.ffn_hidden_size}")
        if self.shared_ffn_hidden_size % tp:
            problems.append(f"shared_expert_intermediate_size={self.shared_ffn_hidden_size}")
        if self.linear_layers and self.linear.num_k_heads % tp:
            problems.append(f"linear_num_key_heads={self.linear.num_k_heads}")
        if self.linear_layers and self.linear.num_v_heads % tp:
            problems.append(f"linear_num_value_heads={self.linear.num_v_heads}")
        if self.vocab_size % tp:
            problems.append(f"vocab_size={self.vocab_size}")
        if problems:
            raise ValueError(f"tensor_parallel_size={tp} must divide {', '.join(problems)}")

    def out_features(self, target: str) -> int:
        lin = self.linear
        if target in LINEAR_ATTENTION_TARGETS:
            return {"in_proj_q": lin.key_dim, "in_proj_k": lin.key_dim, "in_proj_v": lin.value_dim,
                    "in_proj_z": lin.value_dim, "in_proj_b": lin.num_v_heads, "in_proj_a": lin.num_v_heads,
                    "out_proj": self.hidden_size}[target]
        if target in SHARED_EXPERT_TARGETS:
            return self.hidden_size if target == "shared_expert.down_proj" else self.shared_ffn_hidden_size
        return {
            "q_proj": self.num_heads * self.head_dim * (2 if self.gated_attention else 1),
            "k_proj": self.num_kv_heads * self.head_dim,
            "v_proj": self.num_kv_heads * self.head_dim,
            "o_proj": self.hidden_size,
            "gate_proj": self.ffn_hidden_size,
            "up_proj": self.ffn_hidden_size,
            "down_proj": self.hidden_size,
        }[target]

    def in_features(self, target: str) -> int:
        if target == "out_proj":
            return self.linear.value_dim
        if target == "shared_expert.down_proj":
            return self.shared_ffn_hidden_size
        return {
            "o_proj": self.num_heads * self.head_dim,
            "down_proj": self.ffn_hidden_size,
        }.get(target, self.hidden_size)


def shape_from_hf_config(config, moe_layers: tuple[int, ...] = (), linear_layers: tuple[int, ...] = (),
                         gated_attention: bool = False, zero_centered_norms: bool = False,
                         o_bias: bool = False) -> LlamaShape:
    """LlamaShape of a transformers Llama/Qwen-style config object; ``moe_layers``: the layers whose MLP is the
    routed experts, ``linear_layers`` those whose token mixer is a Gated DeltaNet (the model family says which:
    :func:`.model.spec_from_hf_config`)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    moe = {}
    if moe_layers:
        # gpt-oss names them num_local_experts and intermediate_size (it has no dense MLP).
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        moe = {"num_experts": int(experts), "moe_ffn_hidden_size": int(ffn),
               "moe_layers": tuple(moe_layers),
               "shared_ffn_hidden_size": int(getattr(config, "shared_expert_intermediate_size", 0) or 0)}
    if linear_layers:
        moe["linear_layers"] = tuple(linear_layers)
        moe["linear"] = LinearAttentionShape(
            num_k_heads=int(config.linear_num_key_heads), num_v_heads=int(config.linear_num_value_heads),
            head_k_dim=int(config.linear_key_head_dim), head_v_dim=int(config.linear_value_head_dim),
            conv_kernel=int(config.linear_conv_kernel_dim))
    return LlamaShape(**moe, gated_attention=gated_attention, zero_centered_norms=zero_centered_norms, o_bias=o_bias,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn_hidden_size=int(getattr(config, "intermediate_size", 0) or 0),
        vocab_size=config.vocab_size,
    )


# --------------------------------------------------------------------------------------------------------------
# Fused qkv (GQA interleave)
# --------------------------------------------------------------------------------------------------------------


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int, head_dim: int, dim: int = 0
) -> torch.Tensor:
    """Fuses per-projection q, k, v along ``dim`` into megatron's GQA-interleaved layout.

    Works for weights (``dim=0``: rows are output features) and for activations (``dim=-1``). ``num_groups`` is
    the number of query groups present in the tensors (all of them, or one rank's share).
    """
    dim = dim % q.dim()
    lead, tail = q.shape[:dim], q.shape[dim + 1 :]
    qg = q.reshape(*lead, num_groups, -1, *tail)  # [..., G, hpg*hd, ...]
    kg = k.reshape(*lead, num_groups, head_dim, *tail)
    vg = v.reshape(*lead, num_groups, head_dim, *tail)
    fused = torch.cat([qg, kg, vg], dim=dim + 1)
    return fused.reshape(*lead, -1, *tail)


def interleave_gated_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int, head_dim: int, dim: int = 0
) -> torch.Tensor:
    """Qwen3.5's gated attention: HF's q_proj rows (or output columns) are ``[query | gate]`` per head; megatron's
    ``linear_qkv`` with ``attention_output_gate`` wants per query group ``[queries, gates, k head, v head]``.
    ``q`` holds the ``[query | gate]`` rows of this rank's heads."""
    dim = dim % q.dim()
    lead, tail = q.shape[:dim], q.shape[dim + 1 :]
    qg = q.reshape(*lead, num_groups, -1, 2, head_dim, *tail)  # [..., G, hpg, 2, hd, ...]
    qg = qg.transpose(dim + 1, dim + 2).reshape(*lead, num_groups, -1, *tail)  # [..., G, 2 * hpg * hd, ...]
    kg = k.reshape(*lead, num_groups, head_dim, *tail)
    vg = v.reshape(*lead, num_groups, head_dim, *tail)
    return torch.cat([qg, kg, vg], dim=dim + 1).reshape(*lead, -1, *tail)


def split_gated_qkv(
    fused: torch.Tensor, num_groups: int, heads_per_group: int, head_dim: int, dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_gated_qkv`: (q_proj's ``[query | gate]`` per head, k, v)."""
    dim = dim % fused.dim()
    lead, tail = fused.shape[:dim], fused.shape[dim + 1 :]
    g = fused.reshape(*lead, num_groups, (2 * heads_per_group + 2) * head_dim, *tail)
    qg, k, v = torch.split(g, [2 * heads_per_group * head_dim, head_dim, head_dim], dim=dim + 1)
    qg = qg.reshape(*lead, num_groups, 2, heads_per_group, head_dim, *tail).transpose(dim + 1, dim + 2)
    return (qg.reshape(*lead, -1, *tail), k.reshape(*lead, -1, *tail), v.reshape(*lead, -1, *tail))


def split_qkv(
    fused: torch.Tensor, num_groups: int, heads_per_group: int, head_dim: int, dim: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_qkv`."""
    dim = dim % fused.dim()
    lead, tail = fused.shape[:dim], fused.shape[dim + 1 :]
    g = fused.reshape(*lead, num_groups, (heads_per_group + 2) * head_dim, *tail)
    q, k, v = torch.split(g, [heads_per_group * head_dim, head_dim, head_dim], dim=dim + 1)
    return (
        q.reshape(*lead, -1, *tail),
        k.reshape(*lead, -1, *tail),
        v.reshape(*lead, -1, *tail),
    )


# --------------------------------------------------------------------------------------------------------------
# Fused gate|up
# --------------------------------------------------------------------------------------------------------------


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """One rank's fc1 layout: ``[gate; up]`` along ``dim`` (gate first: ``MLP.glu`` activates the first half)."""
    return torch.cat([gate, up], dim=dim)


def split_gate_up(fused: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fused, 2, dim=dim)
    return gate, up


# --------------------------------------------------------------------------------------------------------------
# Tensor-parallel shards
# --------------------------------------------------------------------------------------------------------------


def chunk_for_rank(t: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
    if t.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by tensor_parallel_size={tp}")
    return torch.chunk(t, tp, dim=dim)[rank]


def hf_moe_to_mcore(router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ep: int = 1,
                    ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """One MoE layer's HF weights (transformers 5's fused 3-D experts: ``gate_up_proj[E, 2F, h]`` whose rows are
    ``[gate; up]``, ``down_proj[E, h, F]``; router ``mlp.gate.weight[E, h]``) → this expert-parallel rank's
    weights of :class:`.moe.GroupedExperts` (its contiguous block of E/EP experts, in the same layouts: gate|up
    is already megatron's fc1 order) and megatron's ``TopKRouter`` (replicated). Experts are never split by
    tensor parallelism (expert_tensor_parallel_size = 1)."""
    return {
        "mlp.router.weight": router,
        "mlp.experts.weight1": chunk_for_rank(gate_up, ep, ep_rank, 0),
        "mlp.experts.weight2": chunk_for_rank(down, ep, ep_rank, 0),
    }


def hf_gpt_oss_moe_to_mcore(hf: dict[str, torch.Tensor], ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """One gpt-oss MoE layer (keys ``mlp.*``): experts stored transposed (``gate_up_proj[E, h, 2F]`` with gate and
    up columns interleaved, ``down_proj[E, F, h]``) with biases, a biased router ``mlp.router`` → this EP rank's
    :class:`.moe.GroupedExperts` in its ``[E, out, in]`` layout, gate/up rows left interleaved (the experts'
    activation reads them so, and a PEFT gate_up LoRA B's rows are in that order too) and the router (replicated)."""
    def experts(key: str) -> torch.Tensor:
        return chunk_for_rank(hf[key], ep, ep_rank, 0)

    return {
        "mlp.router.weight": hf["mlp.router.weight"],
        "mlp.router.bias": hf["mlp.router.bias"],
        "mlp.experts.weight1": experts("mlp.experts.gate_up_proj").transpose(1, 2).contiguous(),
        "mlp.experts.weight2": experts("mlp.experts.down_proj").transpose(1, 2).contiguous(),
        "mlp.experts.bias1": experts("mlp.experts.gate_up_proj_bias"),
        "mlp.experts.bias2": experts("mlp.experts.down_proj_bias"),
    }


def linear_qkv_split(lin: LinearAttentionShape, tp: int) -> tuple[int, int, int]:
    """The widths of one rank's Q, K and V blocks of in_proj_qkv (and of its conv1d channels)."""
    return lin.key_dim // tp, lin.key_dim // tp, lin.value_dim // tp


def hf_linear_attention_to_mcore(hf: dict[str, torch.Tensor], lin: LinearAttentionShape, tp: int,
                                 rank: int) -> dict[str, torch.Tensor]:
    """One Gated DeltaNet layer's HF weights (keys ``linear_attn.*``) → this rank's weights of
    :class:`.gated_delta_net.GatedDeltaNet`. A rank holds whole heads: its chunk of the q/k heads and of the value
    heads they serve (every q/k head serves consecutive value heads, so contiguous chunks agree); in_proj_qkv and
    the conv1d channels, whose HF rows are ``Q | K | V``, take the rank's chunk of each block (the rank's rows are
    its ``Q | K | V``); z, b, a, A_log and dt_bias its value heads; out_proj its input columns; the gated norm
    (over one value head) is replicated."""
    left = set(hf) - {f"linear_attn.{k}" for k in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                                      "in_proj_a.weight", "conv1d.weight", "A_log", "dt_bias",
                                                      "norm.weight", "out_proj.weight")}
    if left:
        raise ValueError(f"HF linear-attention weights with no megatron counterpart: {sorted(left)}")

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.split(t, [lin.key_dim, lin.key_dim, lin.value_dim], dim=0)
        return torch.cat([chunk_for_rank(x, tp, rank, 0) for x in (q, k, v)], 0)

    p = "linear_attn."
    return {
        "self_attention.in_proj_qkv.weight": qkv_rows(hf[p + "in_proj_qkv.weight"]),
        "self_attention.in_proj_z.weight": chunk_for_rank(hf[p + "in_proj_z.weight"], tp, rank, 0),
        "self_attention.in_proj_b.weight": chunk_for_rank(hf[p + "in_proj_b.weight"], tp, rank, 0),
        "self_attention.in_proj_a.weight": chunk_for_rank(hf[p + "in_proj_a.weight"], tp, rank, 0),
        "self_attention.conv1d_weight": qkv_rows(hf[p + "conv1d.weight"]),
        "self_attention.A_log": chunk_for_rank(hf[p + "A_log"], tp, rank, 0),
        "self_attention.dt_bias": chunk_for_rank(hf[p + "dt_bias"], tp, rank, 0),
        "self_attention.norm_weight": hf[p + "norm.weight"],
        "self_attention.out_proj.weight": chunk_for_rank(hf[p + "out_proj.weight"], tp, rank, 1),
    }


def hf_layer_to_mcore_shards(
    hf_layer: dict[str, torch.Tensor], shape: LlamaShape, tp: int, rank: int, ep: int = 1, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """One decoder layer: HF weights (keys relative to ``model.layers.N.``) → this rank's mcore weights.

    Raises ValueError if the layer has a weight this mapping does not place (say an o_proj bias): a weight left
    behind would make the megatron model compute something else than the checkpoint."""
    groups_local = shape.num_kv_heads // tp
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        used.add(key)
        return hf_layer[key]

    def fused_qkv(kind: str) -> torch.Tensor:
        q, k, v = (chunk_for_rank(take(f"self_attn.{p}_proj.{kind}"), tp, rank, 0) for p in "qkv")
        if shape.gated_attention:
            return interleave_gated_qkv(q, k, v, groups_local, shape.head_dim, dim=0)
        return interleave_qkv(q, k, v, groups_local, shape.head_dim, dim=0)

    def norm(key: str) -> torch.Tensor:
        # Qwen3.5's RMSNorms scale by (1 + w): torch's RMSNorm by its weight, so it gets 1 + w (in fp32, as HF
        # adds it).
        w = take(key)
        return (1.0 + w.float()).to(w.dtype) if shape.zero_centered_norms else w

    out = {
        "input_layernorm.weight": norm("input_layernorm.weight"),
        "pre_mlp_layernorm.weight": norm("post_attention_layernorm.weight"),
    }
    if "linear_attn.in_proj_qkv.weight" in hf_layer:
        out.update(hf_linear_attention_to_mcore({k: take(k) for k in hf_layer if k.startswith("linear_attn.")},
                                                shape.linear, tp, rank))
    else:
        out["self_attention.linear_qkv.weight"] = fused_qkv("weight")
        out["self_attention.linear_proj.weight"] = chunk_for_rank(take("self_attn.o_proj.weight"), tp, rank, 1)
    if "mlp.router.weight" in hf_layer:
        out.update(hf_gpt_oss_moe_to_mcore({k: take(k) for k in hf_layer if k.startswith("mlp.")}, ep, ep_rank))
    elif "mlp.experts.gate_up_proj" in hf_layer:
        out.update(hf_moe_to_mcore(take("mlp.gate.weight"), take("mlp.experts.gate_up_proj"),
                                   take("mlp.experts.down_proj"), ep, ep_rank))
        if "mlp.shared_expert.gate_proj.weight" in hf_layer:
            gate = chunk_for_rank(take("mlp.shared_expert.gate_proj.weight"), tp, rank, 0)
            up = chunk_for_rank(take("mlp.shared_expert.up_proj.weight"), tp, rank, 0)
            out["mlp.shared_experts.linear_fc1.weight"] = fuse_gate_up(gate, up, dim=0)
            out["mlp.shared_experts.linear_fc2.weight"] = chunk_for_rank(
                take("mlp.shared_expert.down_proj.weight"), tp, rank, 1)
            out["mlp.shared_experts.gate_weight"] = take("mlp.shared_expert_gate.weight")  # [1, h], replicated
    else:
        gate = chunk_for_rank(take("mlp.gate_proj.weight"), tp, rank, 0)
        up = chunk_for_rank(take("mlp.up_proj.weight"), tp, rank, 0)
        out["mlp.linear_fc1.weight"] = fuse_gate_up(gate, up, dim=0)
        out["mlp.linear_fc2.weight"] = chunk_for_rank(take("mlp.down_proj.weight"), tp, rank, 1)
    if "self_attn.q_proj.bias" in hf_layer:
        out["self_attention.linear_qkv.bias"] = fused_qkv("bias")
    if shape.o_bias:  # added once after the row-parallel reduction: whole on every rank
        out["self_attention.linear_proj.bias"] = take("self_attn.o_proj.bias")
    if "self_attn.sinks" in hf_layer:  # per query head: the rank's contiguous heads
        out["self_attention.core_attention.sinks"] = chunk_for_rank(take("self_attn.sinks"), tp, rank, 0)
    if "self_attn.q_norm.weight" in hf_layer:
        out["self_attention.q_layernorm.weight"] = norm("self_attn.q_norm.weight")
        out["self_attention.k_layernorm.weight"] = norm("self_attn.k_norm.weight")
    left = sorted(set(hf_layer) - used)
    if left:
        raise ValueError(f"HF layer weights with no megatron counterpart: {left}")
    return out


def hf_to_mcore_state_dict(
    hf_sd: dict[str, torch.Tensor], shape: LlamaShape, tp: int = 1, rank: int = 0, ep: int = 1, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """Full HF state dict (``model.…`` keys, tied or untied head) → this rank's GPTModel state dict (TP rank
    ``rank``, expert-parallel rank ``ep_rank``)."""
    final_norm = hf_sd["model.norm.weight"]
    if shape.zero_centered_norms:
        final_norm = (1.0 + final_norm.float()).to(final_norm.dtype)
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": chunk_for_rank(hf_sd["model.embed_tokens.weight"], tp, rank, 0),
        "decoder.final_layernorm.weight": final_norm,
    }
    if "lm_head.weight" in hf_sd and not _same_storage(hf_sd["lm_head.weight"], hf_sd["model.embed_tokens.weight"]):
        out["output_layer.weight"] = chunk_for_rank(hf_sd["lm_head.weight"], tp, rank, 0)
    outside = sorted(k for k in hf_sd if not k.startswith("model.layers.")
                     and k not in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"))
    if outside:
        raise ValueError(f"HF weights with no megatron counterpart: {outside}")
    for i in range(shape.num_layers):
        prefix = f"model.layers.{i}."
        layer = {k[len(prefix) :]: v for k, v in hf_sd.items() if k.startswith(prefix)}
        for k, v in hf_layer_to_mcore_shards(layer, shape, tp, rank, ep, ep_rank).items():
            out[f"decoder.layers.{i}.{k}"] = v
    return out


def mcore_to_hf_state_dict(
    rank_sds: list[dict[str, torch.Tensor]], shape: LlamaShape, tied: bool = True,
    ep_sds: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mcore_state_dict` given every TP rank's state dict (index = TP rank) and, for MoE
    layers under expert parallelism, every EP rank's (index = EP rank; default: the TP ranks' first). Llama-layout
    decoders only (not Qwen3.5's hybrid layers)."""
    if shape.linear_layers or shape.gated_attention or shape.zero_centered_norms:
        raise NotImplementedError("mcore_to_hf_state_dict: hybrid (Qwen3.5) layouts are not converted back")
    tp = len(rank_sds)
    groups_local = shape.num_kv_heads // tp
    hpg = shape.heads_per_group
    first = rank_sds[0]
    hf: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.cat([sd["embedding.word_embeddings.weight"] for sd in rank_sds], 0),
        "model.norm.weight": first["decoder.final_layernorm.weight"],
    }
    if tied:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    else:
        hf["lm_head.weight"] = torch.cat([sd["output_layer.weight"] for sd in rank_sds], 0)

    def unfused_qkv(key: str) -> tuple[torch.Tensor, ...]:
        per_rank = [split_qkv(sd[key], groups_local, hpg, shape.head_dim, 0) for sd in rank_sds]
        return tuple(torch.cat(parts, 0) for parts in zip(*per_rank))

    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        h = f"model.layers.{i}."
        hf[h + "input_layernorm.weight"] = first[p + "input_layernorm.weight"]
        hf[h + "post_attention_layernorm.weight"] = first[p + "pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias"):
            if p + f"self_attention.linear_qkv.{kind}" in first:
                for proj, t in zip("qkv", unfused_qkv(p + f"self_attention.linear_qkv.{kind}")):
                    hf[h + f"self_attn.{proj}_proj.{kind}"] = t
        if p + "self_attention.q_layernorm.weight" in first:
            hf[h + "self_attn.q_norm.weight"] = first[p + "self_attention.q_layernorm.weight"]
            hf[h + "self_attn.k_norm.weight"] = first[p + "self_attention.k_layernorm.weight"]
        hf[h + "self_attn.o_proj.weight"] = torch.cat(
            [sd[p + "self_attention.linear_proj.weight"] for sd in rank_sds], 1
        )
        if p + "mlp.router.weight" in first:
            experts = ep_sds or rank_sds[:1]
            hf[h + "mlp.gate.weight"] = first[p + "mlp.router.weight"]
            hf[h + "mlp.experts.gate_up_proj"] = torch.cat([sd[p + "mlp.experts.weight1"] for sd in experts], 0)
            hf[h + "mlp.experts.down_proj"] = torch.cat([sd[p + "mlp.experts.weight2"] for sd in experts], 0)
            continue
        gates, ups = zip(*(split_gate_up(sd[p + "mlp.linear_fc1.weight"], 0) for sd in rank_sds))
        hf[h + "mlp.gate_proj.weight"] = torch.cat(gates, 0)
        hf[h + "mlp.up_proj.weight"] = torch.cat(ups, 0)
        hf[h + "mlp.down_proj.weight"] = torch.cat([sd[p + "mlp.linear_fc2.weight"] for sd in rank_sds], 1)
    return hf


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() or (a.shape == b.shape and torch.equal(a, b))


# --------------------------------------------------------------------------------------------------------------
# LoRA shards and the fused LoRA delta
# --------------------------------------------------------------------------------------------------------------


def lora_shard(target: str, a: torch.Tensor, b: torch.Tensor, tp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of one PEFT projection: B's row chunk for column-parallel targets, A's column chunk for
    row-parallel ones; the other factor is held in full."""
    if target in COLUMN_PARALLEL_TARGETS:
        return a, chunk_for_rank(b, tp, rank, 0)
    if target in ROW_PARALLEL_TARGETS:
        return chunk_for_rank(a, tp, rank, 1), b
    raise ValueError(f"unknown LoRA target {target!r}")


def lora_unshard(target: str, shards: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`lora_shard` over all ranks (index = TP rank)."""
    if target in COLUMN_PARALLEL_TARGETS:
        return shards[0][0], torch.cat([b for _, b in shards], 0)
    if target in ROW_PARALLEL_TARGETS:
        return torch.cat([a for a, _ in shards], 1), shards[0][1]
    raise ValueError(f"unknown LoRA target {target!r}")


def projection_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """PEFT's LoRA term ``scale * B (A x)`` for activations ``x[..., in]``."""
    return (x @ a.t()) @ b.t() * scale


def place_qkv_delta(
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    groups_local: int,
    heads_per_group: int,
    head_dim: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """Per-projection deltas (any may be None = not a target) → one delta in the fused qkv layout (last dim)."""
    lead = like.shape[:-1]

    def filled(d: torch.Tensor | None, width: int) -> torch.Tensor:
        return d if d is not None else like.new_zeros(*lead, width)

    dq = filled(dq, groups_local * heads_per_group * head_dim)
    dk = filled(dk, groups_local * head_dim)
    dv = filled(dv, groups_local * head_dim)
    return interleave_qkv(dq, dk, dv, groups_local, head_dim, dim=-1)


def place_gate_up_delta(
    dgate: torch.Tensor | None, dup: torch.Tensor | None, ffn_local: int, like: torch.Tensor
) -> torch.Tensor:
    lead = like.shape[:-1]
    dgate = dgate if dgate is not None else like.new_zeros(*lead, ffn_local)
    dup = dup if dup is not None else like.new_zeros(*lead, ffn_local)
    return fuse_gate_up(dgate, dup, dim=-1)


# --------------------------------------------------------------------------------------------------------------
# Expert LoRA (Qwen3-MoE routed experts)
# --------------------------------------------------------------------------------------------------------------
#
# The canonical blob holds an expert target in HF PEFT's ``target_parameters`` layout (loraplane.lora
# .expert_shapes): A ``[r * E, in]`` with expert e's rows at ``[e r, (e + 1) r)``, B ``[out, r * E]`` with expert
# e's column j at ``j E + e``; in the shared-outer layout gate_up's A is one ``[r, in]`` and down's B one
# ``[out, r]``, shared by the layer's experts. The megatron backend stores each as ``[G, r, dim]`` (G = experts, or
# 1 for a shared factor; B transposed, as the dense classes store B^T), and under expert parallelism a rank keeps
# its contiguous block of E / EP experts (shared factors are replicated).

EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


def expert_factor_shared(target: str, which: str, layout: str) -> bool:
    """Whether ``target``'s ``which`` factor is one tensor shared by a layer's experts (the shared-outer layout)."""
    return layout == "shared_outer" and (target, which) in (("experts.gate_up_proj", "A"),
                                                            ("experts.down_proj", "B"))


def expert_lora_to_stacked(which: str, full: torch.Tensor, rank: int, shared: bool) -> torch.Tensor:
    """A PEFT expert factor → ``[G, r, dim]`` (A as it is per expert, B transposed)."""
    if which == "A":
        return full.reshape(-1, rank, full.shape[1])
    if shared:
        return full.t().unsqueeze(0)
    return full.view(full.shape[0], rank, -1).permute(2, 1, 0)


def expert_lora_from_stacked(which: str, stacked: torch.Tensor, shared: bool) -> torch.Tensor:
    """Inverse of :func:`expert_lora_to_stacked`."""
    if which == "A":
        return stacked.reshape(-1, stacked.shape[2])
    if shared:
        return stacked[0].t()
    return stacked.permute(2, 1, 0).reshape(stacked.shape[2], -1)
