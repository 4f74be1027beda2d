"""What a model family is: :class:`ModelFamily`, the LoRA targets any family may offer (:data:`TARGETS`) and the
feature ids a config may ask for. One module per family under this package fills a ModelFamily in; the registry in
``__init__`` finds it from a transformers config.

A family owns everything that differs between families:

* detection: which ``model_type`` values (the checkpoint's and its text sub-config's) it answers, and the features
  the family always has (:attr:`ModelFamily.implied`) beside what the generic detection reads from any config;
* what each backend lacks for it (:attr:`ModelFamily.backend_lacks`: "megatron" -> the missing pieces, named in
  the FAILED_PRECONDITION a start-up gets);
* weights: the HF parameter names (:attr:`hf_weights`, as the text-only causal LM names them) and the prefix of the
  text decoder in the checkpoint users download (:attr:`checkpoint_prefix`: ``model.language_model.`` for a
  vision-language checkpoint);
* layers: the token mixer of each decoder layer (:meth:`mixer_kinds`: "attention" or "linear_attention") and its
  MLP (:meth:`layer_kinds`: "dense" or "moe"), and the LoRA targets each kind offers (:attr:`mixer_targets`,
  :attr:`mlp_targets`); where a target's module is (:data:`TARGETS`);
* adapter tensor names: PEFT's and Tinker's (the key of each target, :data:`TARGETS`), SGLang's (:attr:`sglang`);
* a tiny random config for tests (:meth:`tiny_config`) and any change the trainer needs on the HF model for packed
  rows (:meth:`enable_packing`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# ------------------------------------------------------------------------------------------------ LoRA targets


@dataclass(frozen=True)
class Target:
    """One LoRA target: its name (LoraConfig.target_modules; HF PEFT's target_modules entry), the module it acts
    on relative to a decoder layer, and the path of its tensors in a PEFT / Tinker key (``<prefix>.{i}.<key_path>
    .lora_A.weight``). A target with a `part` is one output slice of a fused projection: Tinker's in_proj_q/k/v
    are separate LoRA pairs on the fused in_proj_qkv (Q | K | V rows)."""

    name: str
    module: str
    key_path: str
    part: int | None = None
    group: str = "attention"  # attention | linear_attention | mlp | shared_expert | experts


def _t(name: str, module: str, group: str, key_path: str | None = None, part: int | None = None) -> Target:
    return Target(name, module, key_path or module, part, group)


# Canonical order (init, export, LoraSpec.create): existing families' targets keep their relative order.
TARGETS: dict[str, Target] = {t.name: t for t in (
    _t("q_proj", "self_attn.q_proj", "attention"),
    _t("k_proj", "self_attn.k_proj", "attention"),
    _t("v_proj", "self_attn.v_proj", "attention"),
    _t("o_proj", "self_attn.o_proj", "attention"),
    _t("in_proj_q", "linear_attn.in_proj_qkv", "linear_attention", "linear_attn.in_proj_q", 0),
    _t("in_proj_k", "linear_attn.in_proj_qkv", "linear_attention", "linear_attn.in_proj_k", 1),
    _t("in_proj_v", "linear_attn.in_proj_qkv", "linear_attention", "linear_attn.in_proj_v", 2),
    _t("in_proj_z", "linear_attn.in_proj_z", "linear_attention"),
    _t("in_proj_b", "linear_attn.in_proj_b", "linear_attention"),
    _t("in_proj_a", "linear_attn.in_proj_a", "linear_attention"),
    _t("out_proj", "linear_attn.out_proj", "linear_attention"),
    _t("gate_proj", "mlp.gate_proj", "mlp"),
    _t("up_proj", "mlp.up_proj", "mlp"),
    _t("down_proj", "mlp.down_proj", "mlp"),
    _t("shared_expert.gate_proj", "mlp.shared_expert.gate_proj", "shared_expert"),
    _t("shared_expert.up_proj", "mlp.shared_expert.up_proj", "shared_expert"),
    _t("shared_expert.down_proj", "mlp.shared_expert.down_proj", "shared_expert"),
    # transformers' fused 3-D expert parameters of a MoE layer (``mlp.experts.gate_up_proj`` [E, 2*ffn, hidden],
    # gate rows first; ``mlp.experts.down_proj`` [E, hidden, ffn]), which HF PEFT targets with target_parameters
    # and keys under ``mlp.experts.base_layer`` (gate_up, wrapped innermost) and ``mlp.experts`` (down).
    _t("experts.gate_up_proj", "mlp.experts", "experts", "mlp.experts.base_layer"),
    _t("experts.down_proj", "mlp.experts", "experts", "mlp.experts"),
    # Nemotron-H: one mixer per decoder block (``mixer``: a Mamba-2 mixer, attention, a relu^2 MLP or a MoE with
    # a shared expert); PEFT target_modules match these names as suffixes of the module paths.
    _t("mixer.in_proj", "mixer.in_proj", "mamba"),
    _t("mixer.out_proj", "mixer.out_proj", "mamba"),
    _t("mixer.q_proj", "mixer.q_proj", "block_attention"),
    _t("mixer.k_proj", "mixer.k_proj", "block_attention"),
    _t("mixer.v_proj", "mixer.v_proj", "block_attention"),
    _t("mixer.o_proj", "mixer.o_proj", "block_attention"),
    _t("mixer.up_proj", "mixer.up_proj", "block_mlp"),
    _t("mixer.down_proj", "mixer.down_proj", "block_mlp"),
    _t("mixer.shared_experts.up_proj", "mixer.shared_experts.up_proj", "block_shared_expert"),
    _t("mixer.shared_experts.down_proj", "mixer.shared_experts.down_proj", "block_shared_expert"),
    # Nemotron-H's routed experts: non-gated ``mixer.experts.up_proj`` [E, ffn, hidden] and ``down_proj``
    # [E, hidden, ffn], HF PEFT's target_parameters on one module as for the fused experts above (up innermost).
    _t("mixer.experts.up_proj", "mixer.experts", "experts", "mixer.experts.base_layer"),
    _t("mixer.experts.down_proj", "mixer.experts", "experts", "mixer.experts"),
)}

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_ATTENTION_TARGETS = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
DENSE_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SHARED_EXPERT_TARGETS = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
NONGATED_EXPERT_TARGETS = ("mixer.experts.up_proj", "mixer.experts.down_proj")
# Every routed-expert target (LoRA inside the experts implementation, PEFT target_parameters): (in, out) per layout.
ROUTED_EXPERT_TARGETS = EXPERT_TARGETS + NONGATED_EXPERT_TARGETS
MAMBA_TARGETS = ("mixer.in_proj", "mixer.out_proj")
BLOCK_ATTENTION_TARGETS = ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj")
BLOCK_MLP_TARGETS = ("mixer.up_proj", "mixer.down_proj")
BLOCK_SHARED_EXPERT_TARGETS = ("mixer.shared_experts.up_proj", "mixer.shared_experts.down_proj")
# Targets of one-mixer-per-block models: a layer holds the targets of its one block kind (group) only.
BLOCK_TARGETS = frozenset(MAMBA_TARGETS + BLOCK_ATTENTION_TARGETS + BLOCK_MLP_TARGETS + BLOCK_SHARED_EXPERT_TARGETS)
ALL_TARGETS = tuple(TARGETS)
# key_path -> target (the experts' two paths included): how a PEFT / Tinker key names its target.
TARGET_BY_KEY_PATH = {t.key_path: t.name for t in TARGETS.values()}
# Tinker names gpt-oss's attention ``.attn`` in its adapter keys (the cookbook remaps it to ``.self_attn``): a key of
# either spelling names the same target.
TARGET_BY_KEY_PATH.update({f"attn.{name}": name for name in ATTENTION_TARGETS})

# ------------------------------------------------------------------------------------------------ features

BACKENDS = ("torch", "megatron")

QKV_BIAS = "qkv_bias"              # Qwen2: q, k, v biases (no o bias)
ATTENTION_BIAS = "attention_bias"  # Llama/Qwen3 attention_bias=True: q, k, v AND o biases
QK_NORM = "qk_norm"                # Qwen3: per-head RMSNorm of q and k before RoPE
ROPE_LLAMA3 = "rope_llama3"        # Llama-3.1+ frequency rescaling
MOE = "moe"                        # routed experts, softmax top-k router (norm_topk_prob optional)
DENSE_AND_MOE_LAYERS = "dense_and_moe_layers"  # some layers dense (mlp_only_layers / decoder_sparse_step)
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet layers (layer_types "linear_attention")
GATED_ATTENTION = "gated_attention"    # q_proj also emits a sigmoid output gate (Qwen3.5 full attention)
PARTIAL_ROTARY = "partial_rotary"      # RoPE on a fraction of each head
SHARED_EXPERTS = "shared_experts"      # an always-on expert beside the routed ones
VISION_TOWER = "vision_tower"          # a vision-language checkpoint (the text decoder is trained; vision unused)
# Features only a family that lists them may have: an unknown model_type asking for one is refused naming it.
ATTENTION_SINKS = "attention_sinks"    # gpt-oss: a learned logit per head beside the keys in the softmax
SLIDING_WINDOW = "sliding_window"      # some layers attend to a window of recent keys (gpt-oss alternates)
ROPE_YARN = "rope_yarn"                # YaRN RoPE scaling (gpt-oss)
EXPERT_BIAS = "expert_bias"            # gpt-oss: router and expert biases, interleaved gate/up, clamped SwiGLU
MAMBA = "mamba"                        # Nemotron-H: Mamba-2 mixer layers
RELU2_MLP = "relu2_mlp"                # Nemotron-H: non-gated relu^2 MLPs and experts
SIGMOID_ROUTER = "sigmoid_router"      # Nemotron-H: sigmoid scores + correction bias, grouped top-k
FAMILY_ONLY = frozenset({LINEAR_ATTENTION, GATED_ATTENTION, PARTIAL_ROTARY, SHARED_EXPERTS, VISION_TOWER,
                         ATTENTION_SINKS, SLIDING_WINDOW, ROPE_YARN, EXPERT_BIAS, MAMBA, RELU2_MLP,
                         SIGMOID_ROUTER})


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    description: str
    # Optional features this family may use (ids above); anything else detected is unsupported everywhere.
    features: frozenset[str]
    # HF parameter names of one decoder layer ({i} = layer index) and of the model around the layers, as the
    # text-only causal LM names them (documentation and the megatron weight conversion's reference).
    hf_weights: Mapping[str, str]
    # Features the family never has (documentation; also refused if a config asks for them).
    lacks: tuple[str, ...] = ()
    moe: bool = False
    notes: str = ""
    # Other model_type values of this family (a text sub-config's, e.g. "qwen3_5_text").
    config_types: tuple[str, ...] = ()
    # Features every config of the family has, whatever its fields say: id -> phrase.
    implied: Mapping[str, str] = field(default_factory=dict)
    # backend -> the pieces it does not implement for this family (refused before any weight is read).
    backend_lacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Features of this family a backend refuses when a config has them (backend -> feature ids): what the backend
    # computes for other families but has not been checked for this one.
    backend_lacks_features: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # Where the text decoder's weights are in the checkpoint users download ("model." or
    # "model.language_model." for a vision-language one); transformers' causal LM loads either.
    checkpoint_prefix: str = "model."
    # LoRA targets per token-mixer kind and per MLP kind (a layer offers its mixer's and its MLP's).
    mixer_targets: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"attention": ATTENTION_TARGETS})
    mlp_targets: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: {"dense": DENSE_MLP_TARGETS, "moe": EXPERT_TARGETS})
    # Our target -> SGLang's module name for it, for the families SGLang serves with LoRA (None: as PEFT names it);
    # targets absent here SGLang cannot serve.
    sglang: Mapping[str, str] | None = None
    # Groups of targets SGLang serves only all together (it stacks them into one fused module's LoRA).
    sglang_together: tuple[frozenset[str], ...] = ()
    # Arguments a launched SGLang server needs for this family with LoRA on (the sampler's engine adds them).
    sglang_server_args: tuple[str, ...] = ()
    # A tiny random config of this family (tests/fixtures/models.py builds checkpoints from it).
    tiny: Callable[[int], object] | None = None
    # Patches the HF model for packed rows (several datums end to end in one row), or None when attention
    # alone needs it (loraplane.models.packed).
    packing: Callable[[object], None] | None = None
    # The attention implementation transformers runs for this family outside packed rows ("eager" where SDPA
    # cannot compute it: gpt-oss's sinks).
    attn_implementation: str = "sdpa"
    # The order of gate and up in the fused experts' gate_up_proj ("concatenated" [gate; up] or "interleaved"
    # [g0, u0, g1, ...]): the rows of an expert adapter's gate_up lora_B, which a consumer splitting gate from up
    # (Tinker's w1 / w3) must know; and the attention module's name in Tinker's adapter keys.
    expert_gate_up: str = "concatenated"
    tinker_attention: str = "self_attn"
    # The sampler's torch engine runs transformers' own forward with its cache, one row at a time, instead of its
    # own Llama-layout decode loop (which computes neither sinks, windows nor recurrent mixer state).
    hf_decode: bool = False
    # Config attributes set on the text config before transformers builds the model from a checkpoint.
    loading_overrides: Mapping[str, object] = field(default_factory=dict)

    # -------------------------------------------------------------- layers and targets

    def mixer_kinds(self, config) -> list[str]:
        """"attention" or "linear_attention" per decoder layer."""
        layers = int(getattr(config, "num_hidden_layers", 0))
        types = getattr(config, "layer_types", None)
        if types and LINEAR_ATTENTION in self.features:
            return ["linear_attention" if t == "linear_attention" else "attention" for t in types[:layers]]
        return ["attention"] * layers

    def layer_kinds(self, config) -> list[str]:
        """"moe" or "dense" for each decoder layer, as transformers' Qwen3-MoE decoder layer decides it."""
        return mlp_kinds(config)

    def layer_targets(self, config, layer: int) -> tuple[str, ...]:
        """The LoRA targets decoder layer `layer` offers, canonical order."""
        offered = set(self.mixer_targets.get(self.mixer_kinds(config)[layer], ()))
        offered |= set(self.mlp_targets.get(self.layer_kinds(config)[layer], ()))
        return tuple(t for t in ALL_TARGETS if t in offered)

    def lora_targets(self, config) -> tuple[str, ...]:
        """Every target some layer offers, canonical order. A MoE model's dense layers (mlp_only_layers) offer no
        MLP target: HF PEFT (0.21 on transformers 5) rewrites target_modules gate_proj/up_proj/down_proj of a
        Qwen3-MoE into the experts' target_parameters, so such an adapter would not load there as trained."""
        mixers = set(self.mixer_kinds(config))
        kinds = set(self.layer_kinds(config))
        offered: set[str] = set()
        for mixer in mixers:
            offered |= set(self.mixer_targets.get(mixer, ()))
        for kind in kinds:
            if kind == "dense" and "moe" in kinds:
                continue
            offered |= set(self.mlp_targets.get(kind, ()))
        return tuple(t for t in ALL_TARGETS if t in offered)

    def target_module(self, block, target: str):
        """The module of decoder layer `block` (an HF decoder layer) that `target` acts on, or None."""
        owner = block
        for name in TARGETS[target].module.split("."):
            owner = getattr(owner, name, None)
            if owner is None:
                return None
        return owner

    def fused_widths(self, block, target: str) -> tuple[int, ...]:
        """The output widths of the parts of the fused projection `target` is a part of (in_proj_qkv: Q, K, V)."""
        raise NotImplementedError(f"{self.model_type} has no fused projection {target}")

    def target_dims(self, block, target: str) -> tuple[int, int] | None:
        """(in_features, out_features) of `target` in `block` (of one expert for the expert targets)."""
        module = self.target_module(block, target)
        if module is None:
            return None
        spec = TARGETS[target]
        if spec.group == "experts":
            return self.expert_dims(module, target)
        if spec.part is not None:
            return int(module.in_features), int(self.fused_widths(block, target)[spec.part])
        return int(module.in_features), int(module.out_features)

    def expert_dims(self, experts, target: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert of `target` in the `experts` module, whose 3-D parameters
        each family lays out its own way; here transformers' fused experts: gate_up_proj [E, 2 ffn, hidden],
        down_proj [E, hidden, ffn]."""
        _, two_ffn, hidden = experts.gate_up_proj.shape
        return (int(hidden), int(two_ffn)) if target == "experts.gate_up_proj" else (int(two_ffn) // 2, int(hidden))

    def tiny_config(self, vocab_size: int = 261):
        if self.tiny is None:
            raise NotImplementedError(f"{self.model_type} has no tiny test config")
        return self.tiny(vocab_size)

    def enable_packing(self, model) -> None:
        if self.packing is not None:
            self.packing(model)


# ------------------------------------------------------------------------------------------------ helpers

_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def text_config(config):
    """The decoder's config: a vision-language config's ``text_config``, else the config itself."""
    inner = getattr(config, "text_config", None)
    return inner if inner is not None and inner is not config else config


def num_experts(config) -> int:
    config = text_config(config)
    for name in _EXPERT_COUNT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def mlp_kinds(config) -> list[str]:
    """"moe" or "dense" per decoder layer (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    config = text_config(config)
    layers = int(getattr(config, "num_hidden_layers", 0))
    experts = num_experts(config)
    if not experts:
        return ["dense"] * layers
    only = set(getattr(config, "mlp_only_layers", None) or ())
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return ["moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(layers)]
