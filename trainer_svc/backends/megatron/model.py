"""Hugging Face Llama-3.x / Qwen2.5 / Qwen3 / Qwen3.5 weights → megatron-core ``GPTModel`` (local, non-Transformer-Engine layer
spec).

The model runs in plain PyTorch: causal attention within each datum of a packed row (:mod:`.attention`;
``attention="unfused"`` keeps megatron's ``DotProductAttention`` with a block-diagonal mask), ``torch.nn.RMSNorm``,
RoPE in the rotate-half convention (like HF Llama) at each token's position within its datum
(:class:`PackedRotaryEmbedding`), ``ColumnParallelLinear`` / ``RowParallelLinear``; on CUDA the RoPE and SwiGLU
chains run as compiled kernels (:mod:`.fusion`). A batch is one packed row
(:func:`forward_logits`): no padding. The base weights are frozen; only the LoRA tensors of :mod:`.lora` receive
gradients.

What a family adds to the Llama layout (docs/megatron.md, "Model families"): Qwen2 biases q, k and v (megatron's
``add_qkv_bias``: one bias on the fused ``linear_qkv``); Qwen3 RMS-normalizes every q and k head before RoPE
(``qk_layernorm``: megatron's ``q_layernorm``/``k_layernorm`` on ``[s, b, heads, head_dim]``) and may have a
``head_dim`` other than hidden/heads (``kv_channels``); Llama-3.1/3.2 rescale the RoPE frequencies (``llama3``);
gpt-oss adds per-head attention sinks and sliding windows on alternate layers (our core attention, per datum), YaRN,
an o_proj bias, a biased router and biased experts with interleaved gate/up and a clamped SwiGLU (:mod:`.moe`);
Qwen3.5 puts our Gated DeltaNet (:mod:`.gated_delta_net`) in most layers' attention slot, gates attention's output
(``attention_output_gate``), rotates a quarter of each head and scales its norms by ``1 + w`` (its MoE variant adds
a gated shared expert, :mod:`.moe`).
Anything else a config asks for is refused by :func:`spec_from_hf_config` rather than silently computed wrong.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplane.models import families
from loraplane.models.families.base import ATTENTION_SINKS, EXPERT_BIAS, ROPE_YARN, SLIDING_WINDOW

from .fusion import CompiledOrEager, compiles
from .layout import LlamaShape, hf_to_mcore_state_dict, shape_from_hf_config


@dataclass(frozen=True)
class Llama3RopeScaling:
    """transformers' ``rope_type: llama3`` (Llama-3.1/3.2/3.3): long wavelengths divided by ``factor``, short ones
    kept, the band between smoothly interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MegatronModelSpec:
    shape: LlamaShape
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_layernorm: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    # Mixture of experts (the layers are shape.moe_layers): top-k routing, renormalized over the k chosen experts
    # when norm_topk_prob.
    moe_top_k: int = 0
    norm_topk_prob: bool = False
    # RoPE on the first rotary_dim values of each head (Qwen3.5: a quarter); 0 = all of it.
    rotary_dim: int = 0
    # gpt-oss: YaRN's inverse frequencies and cos/sin factor as transformers computes them; a learned sink logit per
    # head in each attention softmax; the sliding window of each layer (0: full attention); a bias on o_proj too;
    # a biased router and biased experts with gate/up interleaved and the clamped SwiGLU.
    yarn_inv_freq: tuple[float, ...] = ()
    rope_attention_scaling: float = 1.0
    attention_sinks: bool = False
    sliding_windows: tuple[int, ...] = ()
    o_bias: bool = False
    gpt_oss_experts: bool = False


def spec_from_hf_config(config) -> MegatronModelSpec:
    """The megatron model of a transformers config; :class:`FailedPrecondition` naming every feature of the config
    that the megatron backend does not implement (so a checkpoint never loads into a model that computes something
    else). What a family is and which features it uses is :mod:`loraplane.models.families`' data, shared with the
    torch backend; this function only maps those features onto megatron-core."""
    families.check_supported(config, "megatron")
    features = families.detect_features(config)
    rope = families.rope_parameters(config)
    scaling = None
    if families.ROPE_LLAMA3 in features:
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    moe_layers = moe_layer_indices(config)
    family = families.family_for(config)
    linear_layers = tuple(i for i, kind in enumerate(family.mixer_kinds(families.text_config(config)))
                          if kind == "linear_attention")
    shape = shape_from_hf_config(config, moe_layers, linear_layers,
                                 gated_attention=families.GATED_ATTENTION in features,
                                 zero_centered_norms=family.model_type in ZERO_CENTERED_NORM_FAMILIES,
                                 o_bias=families.ATTENTION_BIAS in features)
    rotary_dim = 0
    if families.PARTIAL_ROTARY in features:
        # transformers' compute_default_rope_parameters: int(head_dim * partial_rotary_factor). For text the
        # multimodal RoPE (mrope_section) rotates every section by the same position: plain RoPE on that fraction.
        rotary_dim = int(shape.head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    yarn: dict = {}
    if ROPE_YARN in features:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["yarn"](families.text_config(config), None)
        yarn = {"yarn_inv_freq": tuple(inv_freq.float().tolist()), "rope_attention_scaling": float(attention_scaling)}
    windows: tuple[int, ...] = ()
    types = getattr(config, "layer_types", None)
    if SLIDING_WINDOW in features and types:
        windows = tuple(int(config.sliding_window) if t == "sliding_attention" else 0 for t in types)
    return MegatronModelSpec(
        **yarn,
        attention_sinks=ATTENTION_SINKS in features,
        sliding_windows=windows,
        o_bias=shape.o_bias,
        gpt_oss_experts=EXPERT_BIAS in features,
        shape=shape,
        rotary_dim=rotary_dim,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
        qkv_bias=families.QKV_BIAS in features or families.ATTENTION_BIAS in features,
        qk_layernorm=families.QK_NORM in features,
        rope_scaling=scaling,
        moe_top_k=int(config.num_experts_per_tok) if moe_layers else 0,
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", family.model_type in RENORMALIZED_TOPK_FAMILIES))
        if moe_layers else False,
    )


# Families whose RMSNorms scale by (1 + weight) (transformers' Qwen3_5RMSNorm); the megatron model's torch RMSNorm is
# given 1 + weight (layout.hf_layer_to_mcore_shards).
ZERO_CENTERED_NORM_FAMILIES = ("qwen3_5", "qwen3_5_moe")


# MoE families whose router always renormalizes the top-k probabilities (their config has no norm_topk_prob).
RENORMALIZED_TOPK_FAMILIES = ("qwen3_5_moe", "gpt_oss")


def moe_layer_indices(config) -> tuple[int, ...]:
    """The decoder layers whose MLP is the routed experts (Qwen3-MoE: every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers``, as transformers builds them)."""
    return tuple(i for i, kind in enumerate(families.layer_kinds(config)) if kind == "moe")


def unsupported_features(config) -> list[str]:
    """What of this config the megatron backend cannot compute, one phrase per feature (empty = supported)."""
    return families.unsupported_features(config, "megatron")


def rope_inv_freq(spec: MegatronModelSpec) -> torch.Tensor:
    """fp32 RoPE inverse frequencies ``[head_dim / 2]``, computed as transformers computes them
    (``_compute_default_rope_parameters`` / ``_compute_llama3_parameters``), so both models rotate by the same
    angles. megatron's own llama3 rescaling fixes low/high_freq_factor and the original context (1, 4, 8192)."""
    if spec.yarn_inv_freq:
        return torch.tensor(spec.yarn_inv_freq, dtype=torch.float32)
    dim = spec.rotary_dim or spec.shape.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = spec.rope_scaling
    if s is None:
        return inv_freq
    context = s.original_max_position_embeddings
    low_freq_wavelen = context / s.low_freq_factor
    high_freq_wavelen = context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def init_parallel(tensor_parallel_size: int = 1, seed: int = 1234, expert_parallel_size: int = 1) -> None:
    """Process group + megatron parallel state. Under torchrun the env vars come from the launcher; a single
    process without them gets a private one-rank group (NCCL on CUDA, gloo on CPU). Expert parallelism spreads
    the experts over ``expert_parallel_size`` ranks, taken from the data-parallel ones (megatron's layout: the
    world is TP x DP for attention and EP x expert-DP for the experts, experts unsplit by TP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            from loraplane.local.processes import free_port

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                                 expert_model_parallel_size=expert_parallel_size,
                                                 expert_tensor_parallel_size=1)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


ATTENTION_KINDS = ("sdpa", "unfused")


def build_gpt_model(spec: MegatronModelSpec, dtype: torch.dtype, device: torch.device, attention: str = "sdpa",
                    expert_lora_slots: int = 0):
    """An empty megatron GPTModel of this shape (weights come from :func:`load_hf_weights`). An MoE model routes
    through ``expert_lora_slots + 1`` adapter slots per expert (:class:`.moe.SlotRouter`): how many adapters with
    expert LoRA one batch may fuse."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .moe import finish_moe_layers, moe_config_fields, moe_layer_spec, prepare_megatron_moe

    s = spec.shape
    moe = {}
    if s.moe_layers:
        moe = moe_config_fields(s.num_experts, spec.moe_top_k, s.moe_ffn_hidden_size, spec.norm_topk_prob,
                                _ep_size(), slots=expert_lora_slots + 1,
                                shared_ffn_hidden_size=s.shared_ffn_hidden_size)
    config = TransformerConfig(
        **moe,
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_heads,
        num_query_groups=s.num_kv_heads,
        kv_channels=s.head_dim,
        ffn_hidden_size=s.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        attention_output_gate=s.gated_attention,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=_tp_size(),
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=compiles("swiglu", device),
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )
    config.loraplane_expert_slots = expert_lora_slots + 1 if s.moe_layers else 1
    config.loraplane_sinks = spec.attention_sinks
    config.loraplane_windows = spec.sliding_windows
    config.loraplane_gpt_oss_experts = spec.gpt_oss_experts
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention {attention!r}: one of {ATTENTION_KINDS}")
    if attention != "sdpa" and (spec.attention_sinks or any(spec.sliding_windows) or spec.yarn_inv_freq):
        raise ValueError("attention sinks, sliding windows and YaRN run in the packed core attention: "
                         "attention='sdpa'")
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_layernorm)
    if spec.o_bias:  # attention_bias (gpt-oss): o_proj biased too, and nothing else that add_bias_linear biases
        layer_spec.submodules.self_attention.submodules.linear_proj = _biased_row_parallel_linear()
    if attention == "sdpa":
        from .attention import SDPACoreAttention

        layer_spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if s.linear_layers and attention != "sdpa":
        raise ValueError("a model with Gated DeltaNet layers runs packed rows: attention='sdpa'")
    if s.moe_layers or s.linear_layers:
        from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

        # Per layer: Qwen3-MoE may keep dense MLPs in some layers (mlp_only_layers, decoder_sparse_step); Qwen3.5
        # has a Gated DeltaNet instead of attention in most layers.
        sparse = layer_spec
        if s.moe_layers:
            prepare_megatron_moe()
            sparse = moe_layer_spec(layer_spec, s.num_experts)
        layer_spec = TransformerBlockSubmodules(
            layer_specs=[_with_mixer(sparse if s.is_moe(i) else layer_spec, spec, i) for i in range(s.num_layers)],
            layer_norm=LayerNormImpl)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=s.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
    )
    # Always ours, not megatron's: one code path for default and llama3 RoPE, equal to transformers' by
    # construction, at each token's position within its datum of the packed row.
    finish_moe_layers(model, s.moe_layers)
    model.packed_attention = attention == "sdpa"
    model.rotary_pos_emb = PackedRotaryEmbedding(rope_inv_freq(spec).to(device), model.packed_attention,
                                                 spec.rope_attention_scaling)
    return model.to(device=device, dtype=dtype)


_BIASED_ROW_PARALLEL = []


def _biased_row_parallel_linear():
    """megatron's RowParallelLinear with a bias whatever ``add_bias_linear`` says (SelfAttention builds linear_proj
    with ``bias=config.add_bias_linear``, which would bias the dense MLPs too). The bias is whole on every rank and
    returned apart (``skip_bias_add``): the layer adds it once after the row-parallel reduction."""
    if not _BIASED_ROW_PARALLEL:
        from megatron.core.tensor_parallel import RowParallelLinear

        class BiasedRowParallelLinear(RowParallelLinear):
            def __init__(self, *args, **kwargs):
                kwargs["bias"] = True
                super().__init__(*args, **kwargs)

        _BIASED_ROW_PARALLEL.append(BiasedRowParallelLinear)
    return _BIASED_ROW_PARALLEL[0]


def _with_mixer(layer_spec, spec: MegatronModelSpec, layer: int):
    """``layer_spec`` with our Gated DeltaNet as the token mixer where ``layer`` is a linear-attention layer."""
    if not spec.shape.is_linear(layer):
        return layer_spec
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    from .gated_delta_net import GatedDeltaNet

    mixer = ModuleSpec(module=GatedDeltaNet, params={"linear": spec.shape.linear, "eps": spec.rms_norm_eps})
    return ModuleSpec(module=layer_spec.module, params=dict(layer_spec.params),
                      submodules=dataclasses.replace(layer_spec.submodules, self_attention=mixer))


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _ep_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def _ep_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def _tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


@torch.no_grad()
def load_hf_weights(model, hf_state_dict: dict[str, torch.Tensor], spec: MegatronModelSpec) -> None:
    """Copies HF weights into this rank's shards; every parameter must be covered (nothing silently random). A
    shard that is an HF tensor as it is, already on the parameter's device and in its dtype (the experts, the
    embeddings and norms when the HF model lives on the training device, as in the benchmarks), is shared rather
    than copied: the base weights are frozen, and a 30B MoE model then exists once on the device, not twice."""
    shards = hf_to_mcore_state_dict(hf_state_dict, spec.shape, tp=_tp_size(), rank=_tp_rank(), ep=_ep_size(),
                                    ep_rank=_ep_rank())
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in shards]
    unexpected = [n for n in shards if n not in params]
    if missing or unexpected:
        raise ValueError(f"HF → megatron mapping mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    for name, p in params.items():
        src = shards[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{name}: HF shard shape {tuple(src.shape)} != megatron {tuple(p.shape)}")
        if src.device == p.device and src.dtype == p.dtype and src.is_contiguous():
            p.data = src
        else:
            p.copy_(src.to(dtype=p.dtype))
        p.requires_grad_(False)


def build_from_hf(hf_model, dtype: torch.dtype, device: torch.device, attention: str = "sdpa",
                  expert_lora_slots: int = 0):
    """(GPTModel with the HF model's weights, spec)."""
    spec = spec_from_hf_config(hf_model.config)
    spec.shape.check_tensor_parallel(_tp_size())
    spec.shape.check_expert_parallel(_ep_size())
    model = build_gpt_model(spec, dtype, device, attention, expert_lora_slots)
    load_hf_weights(model, {k: v.detach() for k, v in hf_model.state_dict().items()}, spec)
    model.eval()  # dropout is 0 anyway; eval keeps any train-only paths off
    return model, spec


class PackedRotaryEmbedding(torch.nn.Module):
    """Stands in for ``GPTModel.rotary_pos_emb``: the RoPE angles ``[T, 1, 1, head_dim]`` of the positions of the
    packed row being run (each datum's restart at 0), which :func:`forward_logits` sets. The angles are
    ``position * inv_freq`` in fp32, the same products megatron's ``arange`` ones and transformers' are, so every
    datum is rotated exactly as alone.

    With the packed core attention (``in_core_attention``) the rotation is applied there (:mod:`.attention`, one
    fused kernel on CUDA) and megatron is handed no angles; otherwise megatron applies them with its plain (sbhd)
    path, ``t * cos + rotate_half(t) * sin`` op by op."""

    def __init__(self, inv_freq: torch.Tensor, in_core_attention: bool, attention_scaling: float = 1.0):
        super().__init__()
        self.attention_scaling = attention_scaling  # YaRN's factor on cos and sin (transformers' attention_scaling)
        self.inv_freq = inv_freq  # a plain attribute (not a buffer): stays fp32 whatever dtype the model is cast to
        self.in_core_attention = in_core_attention
        self.positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *_args, **_kwargs) -> int:
        return 0 if self.positions is None else self.positions.shape[0]

    def angles(self) -> torch.Tensor:
        if self.positions is None:
            raise RuntimeError("the megatron model runs packed rows: call model.forward_logits")
        freqs = torch.outer(self.positions.to(self.inv_freq.dtype), self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def forward(self, max_seq_len: int = 0, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if self.in_core_attention and self.positions is not None:
            return None  # forward_logits handed the angles to the core attention with the row's boundaries
        return self.angles()


def forward_logits(model, input_ids: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
    """Vocab-sharded logits of one packed row: ``input_ids[T]`` holding datums of ``lengths`` back to back (each at
    positions 0.. and attending only within itself) gives ``[1, T, V/TP]``; ``input_ids[b, s]`` is ``b`` datums of
    ``s`` tokens (run as the same packed row) and gives ``[b, s, V/TP]``."""
    if input_ids.dim() == 2:
        b, s = input_ids.shape
        return forward_logits(model, input_ids.reshape(-1), [s] * b).view(b, s, -1)
    lengths = [n for n in lengths if n]
    total = sum(lengths)
    if total != input_ids.shape[0]:
        raise ValueError(f"lengths sum to {total} but the packed row has {input_ids.shape[0]} tokens")
    device = input_ids.device
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    positions = (torch.arange(total) - starts.repeat_interleave(torch.tensor(lengths))).to(device, non_blocking=True)
    packed = mask = None
    if getattr(model, "packed_attention", True):
        from .attention import packed_rows

        packed = packed_rows(lengths, device)
    else:
        # megatron's unfused attention (comparisons only): the block-diagonal causal mask, True = masked out.
        owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        later = torch.ones(total, total, dtype=torch.bool, device=device).triu_(1)
        mask = ((owner[:, None] != owner[None, :]) | later)[None, None]
    rotary = model.rotary_pos_emb
    rotary.positions = positions
    if packed is not None and rotary.in_core_attention:
        packed.rope_angles = rotary.angles()[:, 0]  # [T, 1, d]: broadcasts over the heads of [T, heads, d]
        packed.rope_scale = rotary.attention_scaling
    try:
        return model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=mask,
                     packed_seq_params=packed)
    finally:
        rotary.positions = None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token log p(target) in fp32 from vocab-sharded logits; the full vocabulary is never gathered.
    ``targets`` is ``[b, s]``, or ``[b, s, K]`` for K soft targets per position (then the result is too)."""
    if _tp_size() == 1:
        return _TargetLogprob.apply(logits, targets)
    if targets.dim() == logits.dim():
        # One vocab-parallel pass per target column: each is the 1-D computation, exactly (soft targets are rare
        # and K small; a fused K-column vocab-parallel kernel is not worth its own reduction code).
        return torch.stack([target_logprobs(logits, targets[..., k]) for k in range(targets.shape[-1])], -1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # [b, s, V/TP] → [s, b, V/TP] as the function expects; a fresh fp32 copy because it works in place.
    ce = vocab_parallel_cross_entropy(
        logits.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format, copy=True),
        targets.transpose(0, 1).contiguous(),
    )
    return -ce.transpose(0, 1)


LOGPROB_CHUNK_ELEMENTS = 1 << 28  # fp32 working set per chunk: 1 GiB


class _TargetLogprob(torch.autograd.Function):
    """``log_softmax(logits.float()).gather(targets)`` without a full-size fp32 copy of the logits.

    ``log_softmax(x.float())`` keeps an fp32 ``[tokens, V]`` output for its backward (16.8 GB for 32k tokens of a
    128k vocabulary) on top of the fp32 input copy. Here the forward keeps only the logits it was given and the fp32
    log-sum-exp per token, and both directions work in row chunks of at most ``LOGPROB_CHUNK_ELEMENTS`` fp32
    values; the math per element is the same fp32 math (``x - lse``; gradient ``g * (onehot - exp(x - lse))``, cast
    to the logits' dtype as autograd casts the gradient of ``.float()``)."""

    @staticmethod
    def forward(ctx, logits, targets):
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        # Soft targets ([..., K]: K columns per row) take the eager chunk functions; the compiled ones are 1-D.
        wide = targets.dim() == logits.dim()
        tgt = targets.reshape(flat.shape[0], -1) if wide else targets.reshape(-1)
        rows = max(1, LOGPROB_CHUNK_ELEMENTS // vocab)
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        out = torch.empty(tgt.shape, dtype=torch.float32, device=logits.device)
        fn = _lse_and_target if wide else _kernels(logits.device)[0]
        for i in range(0, flat.shape[0], rows):
            lse[i : i + rows], out[i : i + rows] = fn(flat[i : i + rows], tgt[i : i + rows])
        ctx.save_for_backward(logits, targets, lse)
        ctx.mark_non_differentiable(targets)
        return out.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        if targets.dim() == logits.dim():
            return _TargetLogprob._backward_wide(logits, targets, lse, grad_out), None
        if logits.dim() != 3:
            return _TargetLogprob._backward_rows(logits, targets, lse, grad_out), None
        # The gradient is built in [s, b, V] order and handed back as its [b, s, V] transpose: megatron's logits
        # are the [b, s, V] transpose of an [s, b, V] output, so the output layer's backward then gets a gradient
        # with standard [s, b, V] strides (with a [b, s, V]-contiguous one its matmul ran as a batched GEMM of
        # N = b, 7x slower on an H100; for a packed row, b = 1, the size-1 dimension's stride of T * V made it T
        # one-row GEMMs that each reread the vocabulary matrix: 1.2 s of a 1.3 s Llama-1B step).
        b, s, vocab = logits.shape
        lt, tt = logits.transpose(0, 1), targets.t()
        lse_t = lse.view(b, s).t()
        g_t = grad_out.float().t()
        grad = torch.empty((s, b, vocab), dtype=logits.dtype, device=logits.device)
        step = max(1, LOGPROB_CHUNK_ELEMENTS // (b * vocab))
        fn = _kernels(logits.device)[1]
        for i in range(0, s, step):
            grad[i : i + step] = fn(lt[i : i + step], lse_t[i : i + step], g_t[i : i + step], tt[i : i + step])
        return grad.transpose(0, 1), None

    @staticmethod
    def _backward_wide(logits, targets, lse, grad_out):
        """Soft targets: per row, g scattered onto its K targets minus (sum_k g_k) * softmax, eagerly; for
        [b, s, V] logits built in [s, b, V] order as in :meth:`backward`."""
        vocab = logits.shape[-1]
        if logits.dim() == 3:
            b, s, _ = logits.shape
            x, tgt, lse_r, g = (logits.transpose(0, 1), targets.transpose(0, 1), lse.view(b, s).t(),
                                grad_out.float().transpose(0, 1))
            grad = torch.empty((s, b, vocab), dtype=logits.dtype, device=logits.device)
            step = max(1, LOGPROB_CHUNK_ELEMENTS // (b * vocab))
            for i in range(0, s, step):
                grad[i : i + step] = _logprob_grad_eager(x[i : i + step], lse_r[i : i + step], g[i : i + step],
                                                         tgt[i : i + step])
            return grad.transpose(0, 1)
        flat = logits.reshape(-1, vocab)
        tgt = targets.reshape(flat.shape[0], -1)
        g = grad_out.reshape(flat.shape[0], -1).float()
        grad = torch.empty_like(flat)
        rows = max(1, LOGPROB_CHUNK_ELEMENTS // vocab)
        for i in range(0, flat.shape[0], rows):
            grad[i : i + rows] = _logprob_grad_eager(flat[i : i + rows], lse[i : i + rows], g[i : i + rows],
                                                     tgt[i : i + rows])
        return grad.view(logits.shape)

    @staticmethod
    def _backward_rows(logits, targets, lse, grad_out):
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        tgt = targets.reshape(-1, 1)
        g = grad_out.reshape(-1, 1).float()
        grad = torch.empty_like(flat)
        rows = max(1, LOGPROB_CHUNK_ELEMENTS // vocab)
        fn = _kernels(logits.device)[1]
        for i in range(0, flat.shape[0], rows):
            grad[i : i + rows] = fn(flat[i : i + rows], lse[i : i + rows], g[i : i + rows, 0], tgt[i : i + rows, 0])
        return grad.view(logits.shape)


def _lse_and_target(x: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp, x[target] - logsumexp) in fp32 over the last dim of a chunk of logits; ``tgt`` one target per
    row, or ``[rows, K]`` (soft targets: K logprobs per row)."""
    xf = x.float()
    lse = torch.logsumexp(xf, dim=-1)
    if tgt.dim() == x.dim():
        return lse, xf.gather(-1, tgt) - lse.unsqueeze(-1)
    return lse, xf.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse


def _logprob_grad_eager(x, lse, g, tgt):
    """d(sum g * logprob)/dx: g on each row's target minus g * softmax; with ``[..., K]`` targets and gradients,
    each g_k onto its target (scatter_add: repeated targets add up) minus (sum_k g_k) * softmax."""
    p = torch.exp(x.float() - lse.unsqueeze(-1))
    if tgt.dim() == x.dim():
        p.mul_(-g.sum(-1, keepdim=True))
        p.scatter_add_(-1, tgt, g)
        return p.to(x.dtype)
    gi = g.unsqueeze(-1)
    p.mul_(-gi)
    p.scatter_add_(-1, tgt.unsqueeze(-1), gi)
    return p.to(x.dtype)


def _logprob_grad_fused(x, lse, g, tgt):
    # The one-hot as a comparison, so the compiler emits one pointwise kernel (read x once, write the gradient).
    hot = torch.arange(x.shape[-1], device=x.device) == tgt.unsqueeze(-1)
    gi = g.unsqueeze(-1)
    return (torch.where(hot, gi, 0.0) - gi * torch.exp(x.float() - lse.unsqueeze(-1))).to(x.dtype)


_KERNELS: dict[str, tuple] = {}


def _kernels(device: torch.device) -> tuple:
    """(forward chunk fn, backward chunk fn): compiled (fused: one pass over the logits) where
    :func:`.fusion.compiles` says so, else eager."""
    key = device.type
    if key not in _KERNELS:
        fns = (_lse_and_target, _logprob_grad_eager)
        if compiles("logprob", device):
            fns = (CompiledOrEager(_lse_and_target, _lse_and_target),
                   CompiledOrEager(_logprob_grad_fused, _logprob_grad_eager))
        _KERNELS[key] = fns
    return _KERNELS[key]
