"""Model families as data: what each supported Hugging Face ``model_type`` is, in one place both backends read.

A :class:`ModelFamily` says how the family's HF weights are named and laid out, which optional features it uses
(q/k/v biases, per-head q/k RMSNorm, routed experts, ...) and which LoRA targets its layers offer. Everything a
config asks for that no family here describes, or that the chosen backend does not compute, is refused at start-up
by :func:`check_supported` with FAILED_PRECONDITION naming each feature, never an INTERNAL error at the first
request.

API for the backends:

* :func:`family_for(config)` -> the :class:`ModelFamily` of ``config.model_type`` (FailedPrecondition if unknown);
* :func:`detect_features(config)` -> every feature the config asks for (feature id -> phrase);
* :func:`unsupported_features(config, backend)` -> one phrase per feature ``backend`` ("torch" | "megatron")
  cannot compute (empty = supported);
* :func:`check_supported(config, backend, name)` raises FailedPrecondition(reason UNSUPPORTED_MODEL) listing them;
* :func:`layer_kinds(config)` -> "dense" or "moe" per decoder layer (Qwen3-MoE's ``mlp_only_layers`` and
  ``decoder_sparse_step``); :func:`lora_targets(config)` -> the LoRA target names the model offers, canonical order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from loraplane.errors import FailedPrecondition

# LoRA targets. Dense projections are nn.Linear modules; the expert targets are transformers' fused 3-D expert
# parameters of a MoE layer (``mlp.experts.gate_up_proj`` [E, 2*ffn, hidden] with the gate rows first, and
# ``mlp.experts.down_proj`` [E, hidden, ffn]), which HF PEFT targets with ``target_parameters``.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
ALL_TARGETS = ATTENTION_TARGETS + DENSE_MLP_TARGETS + EXPERT_TARGETS

BACKENDS = ("torch", "megatron")

# Feature ids a family may use (each backend says which it computes).
QKV_BIAS = "qkv_bias"              # Qwen2: q, k, v biases (no o bias)
ATTENTION_BIAS = "attention_bias"  # Llama/Qwen3 attention_bias=True: q, k, v AND o biases
QK_NORM = "qk_norm"                # Qwen3: per-head RMSNorm of q and k before RoPE
ROPE_LLAMA3 = "rope_llama3"        # Llama-3.1+ frequency rescaling
MOE = "moe"                        # routed experts, softmax top-k router (norm_topk_prob optional)
DENSE_AND_MOE_LAYERS = "dense_and_moe_layers"  # some layers dense (mlp_only_layers / decoder_sparse_step)


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    description: str
    # Optional features this family may use (ids above); anything else detected is unsupported everywhere.
    features: frozenset[str]
    # HF parameter names of one decoder layer ({i} = layer index) and of the model around the layers.
    hf_weights: Mapping[str, str]
    # Features the family never has (documentation; also refused if a config asks for them).
    lacks: tuple[str, ...] = ()
    moe: bool = False
    notes: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)


_COMMON_WEIGHTS = {
    "embed_tokens": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",  # absent when tie_word_embeddings
    "input_layernorm": "model.layers.{i}.input_layernorm.weight",
    "post_attention_layernorm": "model.layers.{i}.post_attention_layernorm.weight",
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
}
_DENSE_MLP_WEIGHTS = {
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
}
_QKV_BIAS_WEIGHTS = {
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
}
_QK_NORM_WEIGHTS = {
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",  # [head_dim], shared by every head
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
_EXPERT_WEIGHTS = {
    # [num_experts, hidden]: router logits = x W^T; softmax in fp32, top-k, optional renormalisation.
    "router": "model.layers.{i}.mlp.gate.weight",
    # [num_experts, 2 * moe_intermediate_size, hidden]: rows [0, ffn) are gate, [ffn, 2 ffn) up.
    "experts.gate_up_proj": "model.layers.{i}.mlp.experts.gate_up_proj",
    # [num_experts, hidden, moe_intermediate_size]
    "experts.down_proj": "model.layers.{i}.mlp.experts.down_proj",
}

FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily(
        model_type="llama", description="Llama 2/3.x: dense SwiGLU decoder, GQA, RoPE",
        features=frozenset({ATTENTION_BIAS, ROPE_LLAMA3}),
        hf_weights={**_COMMON_WEIGHTS, **_DENSE_MLP_WEIGHTS},
        lacks=("qk_norm", "moe")),
    "qwen2": ModelFamily(
        model_type="qwen2", description="Qwen2/2.5: Llama layout plus q, k, v biases",
        features=frozenset({QKV_BIAS}),
        hf_weights={**_COMMON_WEIGHTS, **_DENSE_MLP_WEIGHTS, **_QKV_BIAS_WEIGHTS},
        lacks=("qk_norm", "moe")),
    "qwen3": ModelFamily(
        model_type="qwen3", description="Qwen3 dense: Llama layout plus per-head q/k RMSNorm, explicit head_dim",
        features=frozenset({QK_NORM, ATTENTION_BIAS}),
        hf_weights={**_COMMON_WEIGHTS, **_DENSE_MLP_WEIGHTS, **_QK_NORM_WEIGHTS},
        lacks=("moe",)),
    "qwen3_moe": ModelFamily(
        model_type="qwen3_moe",
        description="Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention; routed SwiGLU experts stored fused 3-D, "
                    "softmax top-k router (norm_topk_prob), no shared expert; optional dense layers",
        features=frozenset({QK_NORM, ATTENTION_BIAS, MOE, DENSE_AND_MOE_LAYERS}),
        hf_weights={**_COMMON_WEIGHTS, **_DENSE_MLP_WEIGHTS, **_QK_NORM_WEIGHTS, **_EXPERT_WEIGHTS},
        lacks=("shared experts", "router bias / grouped routing"), moe=True,
        notes="dense layers (mlp_only_layers, decoder_sparse_step) use the dense MLP weights"),
}

# What each backend does not compute among the features families may use. The torch backend runs the HF model as
# it is, so it computes every family feature; megatron's local layer spec has no o-only bias.
BACKEND_LACKS: dict[str, frozenset[str]] = {
    "torch": frozenset(),
    "megatron": frozenset({ATTENTION_BIAS}),
}

_SUPPORTED_ROPE = ("default", "llama3")
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# Families whose attention has learned sink logits per head (a module parameter, not a config field).
_SINK_MODEL_TYPES = ("gpt_oss",)


def family_for(config) -> ModelFamily:
    """The family of a transformers config; FailedPrecondition when no family describes its model_type."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise FailedPrecondition(
            f"base model {_name(config)!r}: model_type {model_type!r} is not a supported family "
            f"(supported: {', '.join(FAMILIES)})", reason="UNSUPPORTED_MODEL", field="base_model")
    return family


def rope_parameters(config) -> dict:
    """One dict of the RoPE settings: transformers 5 keeps them (theta included) in ``rope_parameters``,
    transformers 4 in ``rope_theta`` plus an optional ``rope_scaling`` dict."""
    merged = dict(getattr(config, "rope_scaling", None) or {})
    merged.update(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in merged and getattr(config, "rope_theta", None) is not None:
        merged["rope_theta"] = config.rope_theta
    return merged


def num_experts(config) -> int:
    for name in _EXPERT_COUNT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def sliding_window_in_use(config) -> str:
    """A description of the sliding-window attention this config runs, or "" when every layer attends fully."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        # What transformers itself consults per layer (Qwen2/3 only slide from max_window_layers on).
        other = sorted(set(layer_types) - {"full_attention", "linear_attention"})
        return f"layer_types {other}" if other else ""
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"sliding_window={window}"
    return ""


def layer_kinds(config) -> list[str]:
    """"moe" or "dense" for each decoder layer, as transformers' Qwen3-MoE decoder layer decides it."""
    layers = int(getattr(config, "num_hidden_layers", 0))
    experts = num_experts(config)
    if not experts:
        return ["dense"] * layers
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return ["moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(layers)]


def lora_targets(config) -> tuple[str, ...]:
    """The LoRA targets this model offers (canonical order): attention always; the dense MLP projections of a
    dense model; the expert targets of a MoE model. A MoE model's dense layers (mlp_only_layers) offer no MLP
    target: HF PEFT (0.21 on transformers 5) rewrites target_modules gate_proj/up_proj/down_proj of a Qwen3-MoE
    into the experts' target_parameters, so such an adapter would not load there as trained."""
    kinds = set(layer_kinds(config))
    targets = list(ATTENTION_TARGETS)
    if kinds == {"dense"}:
        targets += DENSE_MLP_TARGETS
    if "moe" in kinds:
        targets += EXPERT_TARGETS
    return tuple(targets)


def detect_features(config) -> dict[str, str]:
    """Every feature this config asks for beyond the plain Llama layout: feature id -> phrase for messages.
    Ids that no family lists (``unsupported:*``) are refused by every backend."""
    found: dict[str, str] = {}
    model_type = getattr(config, "model_type", None)
    if model_type == "qwen2":
        found[QKV_BIAS] = "q, k, v biases"
    if getattr(config, "attention_bias", False) and model_type != "qwen2":
        found[ATTENTION_BIAS] = "attention biases including o_proj (attention_bias=True)"
    if model_type in ("qwen3", "qwen3_moe"):
        found[QK_NORM] = "per-head q/k RMSNorm"
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        found[ROPE_LLAMA3] = "llama3 RoPE scaling"
    elif rope_type not in _SUPPORTED_ROPE:
        found[f"unsupported:rope:{rope_type}"] = f"rope_scaling type {rope_type!r}"
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        found["unsupported:partial_rotary"] = f"partial rotary embeddings (partial_rotary_factor={partial})"
    experts = num_experts(config)
    if experts:
        found[MOE] = f"mixture-of-experts MLP ({experts} experts, top-{getattr(config, 'num_experts_per_tok', '?')})"
        kinds = layer_kinds(config)
        if "dense" in kinds and "moe" in kinds:
            found[DENSE_AND_MOE_LAYERS] = f"dense layers {[i for i, k in enumerate(kinds) if k == 'dense']}"
    shared = (getattr(config, "shared_expert_intermediate_size", 0) or getattr(config, "n_shared_experts", 0)
              or getattr(config, "num_shared_experts", 0))
    if shared:
        found["unsupported:shared_experts"] = f"shared experts ({shared})"
    scoring = getattr(config, "scoring_func", None)
    if (scoring not in (None, "softmax") or getattr(config, "topk_method", None) not in (None, "greedy")
            or getattr(config, "n_group", None) not in (None, 0, 1)
            or getattr(config, "router_bias", False) or getattr(config, "moe_router_bias", False)):
        found["unsupported:router"] = (
            f"a router other than softmax top-k (scoring_func={scoring!r}, topk_method="
            f"{getattr(config, 'topk_method', None)!r}, n_group={getattr(config, 'n_group', None)!r})")
    sliding = sliding_window_in_use(config)
    if sliding:
        found["unsupported:sliding_window"] = f"sliding-window attention ({sliding})"
    layer_types = getattr(config, "layer_types", None) or ()
    if "linear_attention" in layer_types or getattr(config, "full_attention_interval", None):
        found["unsupported:linear_attention"] = "linear-attention layers"
    if any(getattr(config, name, None) for name in ("q_lora_rank", "kv_lora_rank")):
        found["unsupported:mla"] = "multi-head latent attention (MLA)"
    if model_type in _SINK_MODEL_TYPES or getattr(config, "attention_sink", None) or getattr(
            config, "use_attention_sinks", None):
        found["unsupported:attention_sinks"] = "attention sinks"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        found["unsupported:hidden_act"] = f"hidden_act={act!r} (only SiLU-gated MLPs)"
    if getattr(config, "mlp_bias", False):
        found["unsupported:mlp_bias"] = "MLP biases (mlp_bias=True)"
    return found


def unsupported_features(config, backend: str = "torch") -> list[str]:
    """What of this config `backend` cannot compute, one phrase per feature (empty = supported)."""
    if backend not in BACKEND_LACKS:
        raise ValueError(f"unknown backend {backend!r}")
    problems = []
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        problems.append(f"model_type {getattr(config, 'model_type', None)!r}")
    for feature, phrase in detect_features(config).items():
        if feature.startswith("unsupported:"):
            problems.append(phrase)
        elif family is not None and feature not in family.features:
            problems.append(f"{phrase} (not part of the {family.model_type} family)")
        elif feature in BACKEND_LACKS[backend]:
            problems.append(f"{phrase} (not computed by the {backend} backend)")
    return problems


def check_supported(config, backend: str = "torch", name: str = "") -> ModelFamily:
    """The family of `config`, or FailedPrecondition naming every feature `backend` cannot compute."""
    problems = unsupported_features(config, backend)
    if problems:
        raise FailedPrecondition(
            f"base model {name or _name(config)!r} cannot run on the {backend} backend: {'; '.join(problems)} "
            f"(supported families: {', '.join(FAMILIES)})", reason="UNSUPPORTED_MODEL", field="base_model")
    return family_for(config)


def _name(config) -> str:
    return getattr(config, "_name_or_path", "") or str(getattr(config, "model_type", "?"))
