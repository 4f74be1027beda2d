"""Model families: one module per family (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``qwen3_5``), each a
:class:`~loraplane.models.families.base.ModelFamily` that owns everything about the family; this registry finds
the family of a transformers config, and both trainer backends, the adapter format and the sampler read it.

Everything a config asks for that no family here describes, or that the chosen backend does not compute, is refused
at start-up by :func:`check_supported` with FAILED_PRECONDITION naming each feature, never an INTERNAL error at the
first request (``loraplane.models.load_base_model`` checks the checkpoint's config.json before reading a weight).

API:

* :func:`family_for(config)` -> the family of ``config.model_type`` (FailedPrecondition if unknown);
* :func:`detect_features(config)` -> every feature the config asks for (feature id -> phrase);
* :func:`unsupported_features(config, backend)` -> one phrase per feature ``backend`` ("torch" | "megatron")
  cannot compute (empty = supported);
* :func:`check_supported(config, backend, name)` raises FailedPrecondition(reason UNSUPPORTED_MODEL) listing them;
* :func:`layer_kinds(config)` -> "dense" or "moe" per decoder layer; :func:`mixer_kinds(config)` -> "attention" or
  "linear_attention" per layer; :func:`lora_targets(config)` -> the LoRA targets the model offers, canonical order.

Adding a family: a module here defining a ModelFamily (see base.py for what each field means), listed in
``_MODULES``; a tiny config on it; tests in tests/unit/test_families*.py (docs/megatron.md, "Model families").
"""

from __future__ import annotations

from loraplane.errors import FailedPrecondition
from loraplane.models.families import gpt_oss, llama, nemotron_h, qwen2, qwen3, qwen3_5, qwen3_moe
from loraplane.models.families.base import (
    ALL_TARGETS,
    ATTENTION_BIAS,
    ATTENTION_SINKS,
    ATTENTION_TARGETS,
    BACKENDS,
    DENSE_AND_MOE_LAYERS,
    DENSE_MLP_TARGETS,
    EXPERT_TARGETS,
    FAMILY_ONLY,
    GATED_ATTENTION,
    LINEAR_ATTENTION,
    LINEAR_ATTENTION_TARGETS,
    MOE,
    PARTIAL_ROTARY,
    QK_NORM,
    QKV_BIAS,
    ROPE_LLAMA3,
    ROPE_YARN,
    SHARED_EXPERT_TARGETS,
    SHARED_EXPERTS,
    SLIDING_WINDOW,
    TARGET_BY_KEY_PATH,
    TARGETS,
    VISION_TOWER,
    ModelFamily,
    Target,
    mlp_kinds,
    num_experts,
    text_config,
)

_MODULES = (llama, qwen2, qwen3, qwen3_moe, qwen3_5, gpt_oss, nemotron_h)
FAMILIES: dict[str, ModelFamily] = {}
for _module in _MODULES:
    for _family in getattr(_module, "FAMILIES", None) or (_module.FAMILY,):
        FAMILIES[_family.model_type] = _family
# model_type -> family, the text sub-configs' model_types included.
_BY_TYPE: dict[str, ModelFamily] = {}
for _family in FAMILIES.values():
    for _type in (_family.model_type, *_family.config_types):
        _BY_TYPE[_type] = _family

# What each backend does not compute among the features families may use. The torch backend runs the HF model as
# it is, so it computes every family feature; so does megatron now (attention biases included: q/k/v in its fused
# qkv, o in a row-parallel linear of its own). A family's backend_lacks / backend_lacks_features name what a
# backend lacks for that family alone.
BACKEND_LACKS: dict[str, frozenset[str]] = {
    "torch": frozenset(),
    "megatron": frozenset(),
}

_SUPPORTED_ROPE = ("default", "llama3")
# Families whose attention has learned sink logits per head (a module parameter, not a config field).
_SINK_MODEL_TYPES = ("gpt_oss",)


def lookup(config) -> ModelFamily | None:
    """The family of a config (its own model_type, else its text sub-config's), or None."""
    family = _BY_TYPE.get(getattr(config, "model_type", None))
    if family is None:
        family = _BY_TYPE.get(getattr(text_config(config), "model_type", None))
    return family


def family_for(config) -> ModelFamily:
    """The family of a transformers config; FailedPrecondition when no family describes its model_type."""
    family = lookup(config)
    if family is None:
        raise FailedPrecondition(
            f"base model {_name(config)!r}: model_type {getattr(config, 'model_type', None)!r} is not a supported "
            f"family (supported: {', '.join(FAMILIES)})", reason="UNSUPPORTED_MODEL", field="base_model")
    return family


def rope_parameters(config) -> dict:
    """One dict of the RoPE settings: transformers 5 keeps them (theta included) in ``rope_parameters``,
    transformers 4 in ``rope_theta`` plus an optional ``rope_scaling`` dict."""
    config = text_config(config)
    merged = dict(getattr(config, "rope_scaling", None) or {})
    merged.update(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in merged and getattr(config, "rope_theta", None) is not None:
        merged["rope_theta"] = config.rope_theta
    return merged


def sliding_window_in_use(config) -> str:
    """A description of the sliding-window attention this config runs, or "" when every layer attends fully."""
    config = text_config(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        # What transformers itself consults per layer (Qwen2/3 only slide from max_window_layers on).
        # Nemotron-H's layer_types also name its MLP / MoE blocks.
        other = sorted(set(layer_types) - {"full_attention", "attention", "linear_attention", "mamba", "mlp", "moe"})
        return f"layer_types {other}" if other else ""
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"sliding_window={window}"
    return ""


def layer_kinds(config) -> list[str]:
    """The MLP kind of each decoder layer ("dense", "moe"; Nemotron-H's mixer-only blocks "none"), as the family
    decides it (Qwen3-MoE's mlp_only_layers and decoder_sparse_step by default)."""
    family = lookup(config)
    return family.layer_kinds(text_config(config)) if family else mlp_kinds(config)


def mixer_kinds(config) -> list[str]:
    """"attention" or "linear_attention" for each decoder layer."""
    family = lookup(config)
    inner = text_config(config)
    return family.mixer_kinds(inner) if family else ["attention"] * int(getattr(inner, "num_hidden_layers", 0))


def lora_targets(config) -> tuple[str, ...]:
    """The LoRA targets this model offers (canonical order); see ModelFamily.lora_targets. An unknown family
    offers the Llama layout's."""
    return (lookup(config) or llama.FAMILY).lora_targets(text_config(config))


def detect_features(config) -> dict[str, str]:
    """Every feature this config asks for beyond the plain Llama layout: feature id -> phrase for messages.
    Ids that no family lists (``unsupported:*``) are refused by every backend."""
    found: dict[str, str] = {}
    family = lookup(config)
    if family is not None:
        found.update(family.implied)
    if getattr(config, "vision_config", None) is not None:
        found[VISION_TOWER] = "a vision tower (vision-language checkpoint)"
    model_type = getattr(config, "model_type", None)
    config = text_config(config)
    if getattr(config, "attention_bias", False) and model_type != "qwen2":
        found[ATTENTION_BIAS] = "attention biases including o_proj (attention_bias=True)"
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        found[ROPE_LLAMA3] = "llama3 RoPE scaling"
    elif rope_type == "yarn":
        found[ROPE_YARN] = "rope_scaling type 'yarn' (YaRN)"
    elif rope_type not in _SUPPORTED_ROPE:
        found[f"unsupported:rope:{rope_type}"] = f"rope_scaling type {rope_type!r}"
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        found[PARTIAL_ROTARY] = f"partial rotary embeddings (partial_rotary_factor={partial})"
    experts = num_experts(config)
    if experts:
        found[MOE] = f"mixture-of-experts MLP ({experts} experts, top-{getattr(config, 'num_experts_per_tok', '?')})"
        kinds = layer_kinds(config)
        if "dense" in kinds and "moe" in kinds:
            found[DENSE_AND_MOE_LAYERS] = f"dense layers {[i for i, k in enumerate(kinds) if k == 'dense']}"
    shared = (getattr(config, "shared_expert_intermediate_size", 0) or getattr(config, "n_shared_experts", 0)
              or getattr(config, "num_shared_experts", 0))
    if shared:
        found[SHARED_EXPERTS] = f"shared experts ({shared})"
    scoring = getattr(config, "scoring_func", None)
    if (scoring not in (None, "softmax") or getattr(config, "topk_method", None) not in (None, "greedy")
            or getattr(config, "n_group", None) not in (None, 0, 1)
            or getattr(config, "router_bias", False) or getattr(config, "moe_router_bias", False)):
        found["unsupported:router"] = (
            f"a router other than softmax top-k (scoring_func={scoring!r}, topk_method="
            f"{getattr(config, 'topk_method', None)!r}, n_group={getattr(config, 'n_group', None)!r})")
    sliding = sliding_window_in_use(config)
    if sliding:
        found[SLIDING_WINDOW] = f"sliding-window attention ({sliding})"
    layer_types = getattr(config, "layer_types", None) or ()
    # Nemotron-H's "linear_attention" blocks (layers_block_type) are Mamba-2 mixers, a feature of its family.
    if ("linear_attention" in layer_types or getattr(config, "full_attention_interval", None)) and not getattr(
            config, "layers_block_type", None):
        found[LINEAR_ATTENTION] = "linear-attention layers"
    if any(getattr(config, name, None) for name in ("q_lora_rank", "kv_lora_rank")):
        found["unsupported:mla"] = "multi-head latent attention (MLA)"
    if model_type in _SINK_MODEL_TYPES or getattr(config, "attention_sink", None) or getattr(
            config, "use_attention_sinks", None):
        found[ATTENTION_SINKS] = "attention sinks"
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
    family = lookup(config)
    if family is None:
        problems.append(f"model_type {getattr(config, 'model_type', None)!r}")
    for feature, phrase in detect_features(config).items():
        if feature.startswith("unsupported:") or (family is None and feature in FAMILY_ONLY):
            problems.append(phrase)
        elif family is not None and feature not in family.features:
            problems.append(f"{phrase} (not part of the {family.model_type} family)")
        elif feature in BACKEND_LACKS[backend] or (
                family is not None and feature in family.backend_lacks_features.get(backend, ())):
            problems.append(f"{phrase} (not computed by the {backend} backend)")
    if family is not None:
        problems += [f"{piece} (not implemented by the {backend} backend)"
                     for piece in family.backend_lacks.get(backend, ())]
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


__all__ = [
    "ALL_TARGETS", "ATTENTION_BIAS", "ATTENTION_TARGETS", "BACKENDS", "BACKEND_LACKS", "DENSE_AND_MOE_LAYERS",
    "DENSE_MLP_TARGETS", "EXPERT_TARGETS", "FAMILIES", "FAMILY_ONLY", "GATED_ATTENTION", "LINEAR_ATTENTION",
    "LINEAR_ATTENTION_TARGETS", "MOE", "PARTIAL_ROTARY", "QKV_BIAS", "QK_NORM", "ROPE_LLAMA3",
    "SHARED_EXPERTS", "SHARED_EXPERT_TARGETS", "TARGETS", "TARGET_BY_KEY_PATH", "VISION_TOWER", "ModelFamily",
    "Target", "check_supported", "detect_features", "family_for", "layer_kinds", "lookup", "lora_targets",
    "mixer_kinds", "num_experts", "rope_parameters", "sliding_window_in_use", "text_config",
    "unsupported_features",
]
