"""Qwen3.5 / 3.6 / 3.8 (``qwen3_5`` dense, ``qwen3_5_moe``): a hybrid decoder released as vision-language
checkpoints (text weights under ``model.language_model.*``; transformers' causal LM loads them text-only, the
vision tower is not loaded).

Layers repeat three Gated DeltaNet linear-attention layers (``linear_attn``: a fused ``in_proj_qkv`` of unequal
Q/K/V widths, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, a depthwise causal conv1d, ``A_log``, ``dt_bias``, a
gated RMSNorm, ``out_proj``) and one gated full-attention layer (``q_proj`` emits the query and a sigmoid output
gate; per-head q/k norms; RoPE on a quarter of each head). The MoE variant routes its experts beside a shared
expert with a sigmoid gate (``mlp.shared_expert``, ``mlp.shared_expert_gate``).

LoRA targets, as Tinker trains them: q/k/v/o of the full-attention layers; in_proj_q/k/v (separate LoRA pairs on
the Q, K and V rows of the fused in_proj_qkv: Tinker's keys ``linear_attn.in_proj_{q,k,v}``), in_proj_z/b/a and
out_proj of the linear-attention layers; the dense MLP, or the routed experts and the shared expert's three
projections. The shared expert's gate (hidden -> 1) is not a target.

Sampling: the torch engine decodes through transformers' own forward and cache (``hf_decode``: the conv and
recurrent states of the linear-attention layers beside the full-attention layers' KV cache).

Packed rows: the trainer lays datums end to end in one row. The Gated DeltaNet's causal conv1d and its recurrent
state would carry one datum into the next, so :func:`enable_packing` makes each linear-attention layer start each
datum from a zero state (the projections still see the whole row, as every other linear layer does): on CPU per
datum, and each MoE block its shared expert's sigmoid gate per datum too (bit-exactness); on CUDA in one call per
layer, fla's varlen kernels where fla can run, else transformers' torch kernels on a padded batch
(loraplane.models.packed's implementations).
"""

from __future__ import annotations

import inspect
import sys
import types

import torch

from loraplane.models.families._weights import COMMON_WEIGHTS, DENSE_MLP_WEIGHTS, QK_NORM_WEIGHTS
from loraplane.models.families.base import (
    ATTENTION_BIAS,
    ATTENTION_TARGETS,
    DENSE_MLP_TARGETS,
    EXPERT_TARGETS,
    GATED_ATTENTION,
    LINEAR_ATTENTION,
    LINEAR_ATTENTION_TARGETS,
    MOE,
    PARTIAL_ROTARY,
    QK_NORM,
    SHARED_EXPERT_TARGETS,
    SHARED_EXPERTS,
    TARGETS,
    VISION_TOWER,
    ModelFamily,
)

_LINEAR_WEIGHTS = {
    "in_proj_qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight",  # [2 key_dim + value_dim, hidden]: Q | K | V
    "in_proj_z": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "in_proj_b": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "in_proj_a": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "conv1d": "model.layers.{i}.linear_attn.conv1d.weight",  # [conv_dim, 1, kernel], depthwise
    "A_log": "model.layers.{i}.linear_attn.A_log",
    "dt_bias": "model.layers.{i}.linear_attn.dt_bias",
    "linear_norm": "model.layers.{i}.linear_attn.norm.weight",
    "out_proj": "model.layers.{i}.linear_attn.out_proj.weight",
}
_SHARED_EXPERT_WEIGHTS = {
    "router": "model.layers.{i}.mlp.gate.weight",
    "experts.gate_up_proj": "model.layers.{i}.mlp.experts.gate_up_proj",
    "experts.down_proj": "model.layers.{i}.mlp.experts.down_proj",
    "shared_expert.gate_proj": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "shared_expert.up_proj": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "shared_expert.down_proj": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",  # [1, hidden], sigmoid
}

_IMPLIED = {
    LINEAR_ATTENTION: "Gated DeltaNet linear-attention layers",
    GATED_ATTENTION: "gated full attention (q_proj also emits the output gate)",
    QK_NORM: "per-head q/k RMSNorm",
}
# Our target -> the module SGLang 0.5.17's Qwen3_5ForCausalLM applies it to (its supported_lora_modules: qkv_proj,
# o_proj, out_proj, in_proj_qkvz, gate_up_proj, down_proj, lm_head); the adapter keeps HF's names and SGLang stacks
# q/k/v, gate/up and Tinker's in_proj_q/k/v with in_proj_z (one pair per slice of its in_proj_qkvz) itself. Absent:
# in_proj_b/a (in_proj_ba takes no LoRA).
_SGLANG = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
    "in_proj_q": "in_proj_qkvz", "in_proj_k": "in_proj_qkvz", "in_proj_v": "in_proj_qkvz",
    "in_proj_z": "in_proj_qkvz", "out_proj": "out_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
}
# SGLang stacks the four Q | K | V | Z pairs of a Gated DeltaNet layer into its in_proj_qkvz LoRA only when all four
# are there (sglang/srt/lora/lora.py, _normalize_in_proj_qkvz); a lone in_proj_z pair would be dropped silently.
_SGLANG_TOGETHER = (frozenset({"in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z"}),)
_SGLANG_MOE = {**_SGLANG, "shared_expert.gate_proj": "gate_up_proj", "shared_expert.up_proj": "gate_up_proj",
               "shared_expert.down_proj": "down_proj", "experts.gate_up_proj": "experts",
               "experts.down_proj": "experts"}


class HybridFamily(ModelFamily):
    def fused_widths(self, block, target: str) -> tuple[int, ...]:
        if TARGETS[target].module != "linear_attn.in_proj_qkv":
            return super().fused_widths(block, target)
        mixer = block.linear_attn
        return int(mixer.key_dim), int(mixer.key_dim), int(mixer.value_dim)


# ------------------------------------------------------------------------------------------------ packed rows

def _packed_forward(module, hidden_states, cache=None, attention_mask=None, **kwargs):
    """transformers' Gated DeltaNet forward over a packed row, each datum's conv1d and delta rule starting from a
    zero state as the datum alone would: per datum on CPU (bit-exact), in one call per layer on CUDA
    (loraplane.models.packed: EXACT / BATCHED / FLA). Outside a packed scope, or with a cache (generation),
    transformers' own forward."""
    from loraplane.models import packed

    lengths = packed.packed_lengths()
    if lengths is None or cache is not None:
        return module._loraplane_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if sum(lengths) != hidden_states.shape[1]:
        raise ValueError(f"packed lengths cover {sum(lengths)} tokens, the row has {hidden_states.shape[1]}")
    # The projections see the whole row, as every other linear layer does.
    mixed_qkv = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states)
    b = module.in_proj_b(hidden_states)
    a = module.in_proj_a(hidden_states)
    impl = packed.packed_impl(hidden_states.device, fla=True)
    if impl == packed.EXACT:
        core = _exact_core(module, lengths, mixed_qkv, z, b, a)
    else:
        layout = packed.packed_layout(hidden_states.device)
        run = _fla_core if impl == packed.FLA else _batched_core
        out = run(module, layout, mixed_qkv, b, a)  # (1, N, value heads, head_v_dim)
        # The gated norm over the whole row at once (row-wise; only the CPU needs it per datum, see _exact_core).
        head_v = module.head_v_dim
        core = module.norm(out.reshape(-1, head_v), z.reshape(-1, head_v)).reshape(1, out.shape[1], -1)
    return module.out_proj(core)


def _gate_beta(module, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' decay (log space, fp32) and beta for `a`, `b` of any batch shape."""
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)
    return g, beta


def _split_heads(module, x: torch.Tensor, repeat: bool):
    """(batch, T, conv_dim) after the conv -> query, key (batch, T, k heads, dk) and value (batch, T, v heads, dv);
    `repeat`: query and key repeated to the value heads (transformers' torch kernel: 5.24's repeats them itself,
    5.17's, the GPU image's, expects its caller to; repeating here is right for both)."""
    batch, length, _ = x.shape
    query, key, value = torch.split(x, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, module.head_k_dim)
    key = key.reshape(batch, length, -1, module.head_k_dim)
    value = value.reshape(batch, length, -1, module.head_v_dim)
    groups = value.shape[2] // query.shape[2]
    if repeat and groups > 1:
        query, key = query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
    return query, key, value


def _causal_conv1d(module, x: torch.Tensor) -> torch.Tensor:
    """The depthwise causal conv1d and its activation over ``x [batch, channels, length]``, by the function
    transformers picked; transformers before 5.17 (SGLang 0.5.17 pins 5.12) leaves it None without the
    causal-conv1d package and runs the layer's own Conv1d then, as here."""
    kernel = getattr(sys.modules[type(module).__module__], "causal_conv1d_fn", None)
    if kernel is not None:
        return kernel(x, module.conv1d.weight.squeeze(1), module.conv1d.bias, activation=module.activation)
    return getattr(torch.nn.functional, module.activation)(module.conv1d(x)[..., :x.shape[-1]])


def _exact_core(module, lengths, mixed_qkv, z, b, a) -> torch.Tensor:
    """Per datum, on the datum's own contiguous tensors (the CPU's bit-exact path)."""
    # The kernels transformers picked (hub kernels when installed, else its torch reference implementations).
    modeling = sys.modules[type(module).__module__]
    batch = mixed_qkv.shape[0]
    outputs = []
    start = 0
    for length in lengths:
        end = start + length
        # Each datum's tensors laid out alike whatever else is in the row, so its kernels run identically.
        # Elementwise transcendental ops too: a vectorised kernel treats a tensor's tail elements apart, so the
        # same value could round differently at another position of a longer row.
        g, beta = _gate_beta(module, b[:, start:end].contiguous(), a[:, start:end].contiguous())
        x = _causal_conv1d(module, mixed_qkv[:, start:end].transpose(1, 2).contiguous())
        query, key, value = _split_heads(module, x.transpose(1, 2), repeat=True)
        out, _ = modeling.torch_chunk_gated_delta_rule(
            query.contiguous(), key.contiguous(), value.contiguous(),
            g=g, beta=beta, initial_state=None,
            output_final_state=False, use_qk_l2norm_in_kernel=True)
        # The gated norm too, on the datum's own rows: its reduction over a head's few values is not row-for-row
        # the same for every row count.
        gate = z[:, start:end].reshape(-1, module.head_v_dim).contiguous()
        outputs.append(module.norm(out.reshape(-1, module.head_v_dim), gate).reshape(batch, length, -1))
        start = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def _batched_core(module, layout, mixed_qkv, b, a) -> torch.Tensor:
    """Every datum in one (datums, longest, ...) batch, zero-padded at its end: the conv1d and the delta rule are
    causal, so the padding never reaches a datum's real positions (transformers' chunked kernel pads each sequence
    to a multiple of its chunk the same way, with zeros at the end). The delta rule is transformers' torch
    reference, also where transformers itself picked fla: this path is the one for when fla cannot run."""
    modeling = sys.modules[type(module).__module__]
    delta_rule = inspect.unwrap(modeling.torch_chunk_gated_delta_rule)
    x = _causal_conv1d(module, layout.pad(mixed_qkv).transpose(1, 2))
    query, key, value = _split_heads(module, x.transpose(1, 2), repeat=True)
    g, beta = _gate_beta(module, layout.pad(b), layout.pad(a))
    out, _ = delta_rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=True)
    return layout.unpad(out)


def _fla_core(module, layout, mixed_qkv, b, a) -> torch.Tensor:
    """fla's varlen kernels over the packed row itself (loraplane.models.packed.fla_gated_delta_rule)."""
    from loraplane.models.packed import fla_gated_delta_rule

    g, beta = _gate_beta(module, b, a)
    return fla_gated_delta_rule(layout, mixed_qkv, module.conv1d.weight.squeeze(1), module.conv1d.bias,
                                module.activation, lambda x: _split_heads(module, x, repeat=False), g, beta)


def _packed_moe_forward(module, hidden_states):
    """transformers' Qwen3.5-MoE block with the shared expert's sigmoid gate taken per datum of a packed row. The
    router, the experts and the shared expert are row-wise as transformers runs them; the gate's hidden -> 1
    projection and its sigmoid, over the whole row, would round a datum's values by where they sit in it (a
    vectorised kernel treats a tensor's tail elements apart), so a tenant's logits would depend on its neighbours'
    datums. Outside a packed scope, transformers' own forward."""
    from loraplane.models.packed import EXACT, packed_impl, packed_lengths

    lengths = packed_lengths()
    if lengths is None or packed_impl(hidden_states.device) != EXACT:
        return module._loraplane_forward(hidden_states)  # off CPU the row-wise gate runs over the whole row
    batch, seq_len, hidden = hidden_states.shape
    flat = hidden_states.view(-1, hidden)
    shared = module.shared_expert(flat).view(batch, seq_len, hidden)
    _, routing_weights, selected = module.gate(flat)
    routed = module.experts(flat, selected, routing_weights).view(batch, seq_len, hidden)
    gates = []
    start = 0
    for length in lengths:
        end = start + length
        piece = hidden_states[:, start:end].reshape(-1, hidden).contiguous()
        gates.append(torch.sigmoid(module.shared_expert_gate(piece)).view(batch, length, 1))
        start = end
    if start != seq_len:
        raise ValueError(f"packed lengths cover {start} tokens, the row has {seq_len}")
    gate = gates[0] if len(gates) == 1 else torch.cat(gates, dim=1)
    return routed + gate * shared


def enable_packing(model) -> None:
    """Routes every Gated DeltaNet layer of `model` through :func:`_packed_forward` and every MoE block with a
    gated shared expert through :func:`_packed_moe_forward` (idempotent)."""
    for module in model.modules():
        if hasattr(module, "_loraplane_forward"):
            continue
        if type(module).__name__.endswith("GatedDeltaNet"):
            module._loraplane_forward = module.forward
            module.forward = types.MethodType(_packed_forward, module)
        elif hasattr(module, "shared_expert_gate") and hasattr(module, "experts"):
            module._loraplane_forward = module.forward
            module.forward = types.MethodType(_packed_moe_forward, module)


# ------------------------------------------------------------------------------------------------ tiny configs

def _tiny_text(vocab_size: int, **extra) -> dict:
    # Two linear-attention layers then a full-attention one, twice (full_attention_interval 3 instead of 4 keeps
    # it small); GQA 4/2; linear Q/K heads (2 x 8) narrower than V (4 x 16): unequal Q/K/V widths.
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
                linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                bos_token_id=1, eos_token_id=4, pad_token_id=0, **extra)


_TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16}


def tiny_dense_config(vocab_size: int):
    """The vision-language config users download, in miniature (text decoder as above, a one-block vision tower)."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=_tiny_text(vocab_size), vision_config=dict(_TINY_VISION),
                         tie_word_embeddings=False)


def tiny_moe_config(vocab_size: int):
    """As :func:`tiny_dense_config` with 8 experts top-2 (sizes multiples of 4 for torch._grouped_mm) and a shared
    expert."""
    from transformers import Qwen3_5MoeConfig

    text = _tiny_text(vocab_size, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                      num_experts_per_tok=2, router_aux_loss_coef=0.0)
    text.pop("intermediate_size")
    return Qwen3_5MoeConfig(text_config=text, vision_config=dict(_TINY_VISION), tie_word_embeddings=False)


_MIXERS = {"attention": ATTENTION_TARGETS, "linear_attention": LINEAR_ATTENTION_TARGETS}
# Megatron's attention biases are checked for Llama, Qwen3 and gpt-oss, not with Qwen3.5's gated q_proj (whose
# bias would carry the gate's rows too); released Qwen3.5 checkpoints have none.
_MEGATRON_UNCHECKED = {"megatron": frozenset({ATTENTION_BIAS})}
_HYBRID_FEATURES = frozenset({LINEAR_ATTENTION, GATED_ATTENTION, PARTIAL_ROTARY, QK_NORM, ATTENTION_BIAS,
                              VISION_TOWER})

DENSE = HybridFamily(
    model_type="qwen3_5", config_types=("qwen3_5_text",),
    description="Qwen3.5/3.6/3.8 dense (Qwen3.5-4B, 9B, 27B): 3 Gated DeltaNet layers per gated full-attention "
                "layer, dense SwiGLU MLP; vision-language checkpoints (text weights under model.language_model.)",
    features=_HYBRID_FEATURES,
    hf_weights={**COMMON_WEIGHTS, **QK_NORM_WEIGHTS, **_LINEAR_WEIGHTS, **DENSE_MLP_WEIGHTS},
    lacks=("moe",), implied=_IMPLIED,
    checkpoint_prefix="model.language_model.", mixer_targets=_MIXERS, backend_lacks_features=_MEGATRON_UNCHECKED,
    mlp_targets={"dense": DENSE_MLP_TARGETS}, sglang=_SGLANG, sglang_together=_SGLANG_TOGETHER,
    tiny=tiny_dense_config, packing=enable_packing, hf_decode=True,
    notes="q_proj's output is [query | gate] per head (2 x heads x head_dim rows)")

MOE_FAMILY = HybridFamily(
    model_type="qwen3_5_moe", config_types=("qwen3_5_moe_text",),
    description="Qwen3.5/3.6 MoE (Qwen3.5-35B-A3B, 397B-A17B): the Qwen3.5 hybrid layers; routed SwiGLU experts "
                "(fused 3-D, softmax top-k, renormalised) beside a shared expert with a sigmoid gate",
    features=_HYBRID_FEATURES | {MOE, SHARED_EXPERTS},
    hf_weights={**COMMON_WEIGHTS, **QK_NORM_WEIGHTS, **_LINEAR_WEIGHTS, **_SHARED_EXPERT_WEIGHTS},
    moe=True, implied=_IMPLIED,
    checkpoint_prefix="model.language_model.", mixer_targets=_MIXERS, backend_lacks_features=_MEGATRON_UNCHECKED,
    mlp_targets={"moe": SHARED_EXPERT_TARGETS + EXPERT_TARGETS}, sglang=_SGLANG_MOE,
    sglang_together=_SGLANG_TOGETHER, tiny=tiny_moe_config, packing=enable_packing, hf_decode=True)

FAMILIES = (DENSE, MOE_FAMILY)
