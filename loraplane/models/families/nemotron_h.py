"""Nemotron-H / Nemotron-3 (``nemotron_h``: NVIDIA Nemotron-3 Nano 30B-A3B, Super 120B).

One mixer per decoder block, chosen by ``layers_block_type``: a Mamba-2 mixer ("linear_attention" in transformers
5: ``in_proj`` -> depthwise causal conv1d -> selective-state-space scan with ``n_groups`` -> gated RMSNorm ->
``out_proj``), GQA attention without RoPE ("full_attention"), a non-gated relu^2 MLP ("mlp": ``up_proj``,
``down_proj``) or a MoE ("moe": a sigmoid router with a score-correction bias and grouped top-k, non-gated relu^2
experts ``up_proj`` / ``down_proj`` stored fused 3-D, and a shared expert). Released checkpoints name the weights
``backbone.*`` (transformers' causal LM maps them to ``model.*``).

What loraplane computes for it today: the family is detected and checked before any weight is read; both backends
refuse it naming what they lack (see ``backend_lacks``): the torch backend's LoRA hooks, packed rows (the Mamba
conv and scan state must restart per datum) and the sampler's decode of Mamba layers are not built yet; megatron
lacks the Mamba layers' kernels (mamba_ssm / causal_conv1d, CUDA only) in our image and the relu^2 experts.
"""

from __future__ import annotations

from loraplane.models.families.base import MAMBA, MOE, RELU2_MLP, SHARED_EXPERTS, SIGMOID_ROUTER, ModelFamily

_WEIGHTS = {
    "embed_tokens": "backbone.embeddings.weight",
    "final_norm": "backbone.norm_f.weight",
    "lm_head": "lm_head.weight",
    "norm": "backbone.layers.{i}.norm.weight",
    "in_proj": "backbone.layers.{i}.mixer.in_proj.weight",  # [2 d_inner + 2 groups*state + heads, hidden]
    "conv1d": "backbone.layers.{i}.mixer.conv1d.weight",  # [d_inner + 2 groups*state, 1, kernel]
    "A_log": "backbone.layers.{i}.mixer.A_log",
    "D": "backbone.layers.{i}.mixer.D",
    "dt_bias": "backbone.layers.{i}.mixer.dt_bias",
    "mamba_norm": "backbone.layers.{i}.mixer.norm.weight",
    "out_proj": "backbone.layers.{i}.mixer.out_proj.weight",
    "q_proj": "backbone.layers.{i}.mixer.q_proj.weight",
    "k_proj": "backbone.layers.{i}.mixer.k_proj.weight",
    "v_proj": "backbone.layers.{i}.mixer.v_proj.weight",
    "o_proj": "backbone.layers.{i}.mixer.o_proj.weight",
    "up_proj": "backbone.layers.{i}.mixer.up_proj.weight",
    "down_proj": "backbone.layers.{i}.mixer.down_proj.weight",
    "router": "backbone.layers.{i}.mixer.gate.weight",
    "router_correction_bias": "backbone.layers.{i}.mixer.gate.e_score_correction_bias",
    "experts.up_proj": "backbone.layers.{i}.mixer.experts.up_proj",  # [E, moe_ffn, hidden]
    "experts.down_proj": "backbone.layers.{i}.mixer.experts.down_proj",  # [E, hidden, moe_ffn]
    "shared_experts.up_proj": "backbone.layers.{i}.mixer.shared_experts.up_proj.weight",
    "shared_experts.down_proj": "backbone.layers.{i}.mixer.shared_experts.down_proj.weight",
}

# SGLang 0.5.17's NemotronHForCausalLM LoRA modules (for when the torch side lands): in_proj, out_proj,
# qkv_proj, o_proj, up_proj, gate_up_proj, down_proj.
SGLANG_MODULES = ("in_proj", "out_proj", "qkv_proj", "o_proj", "up_proj", "gate_up_proj", "down_proj")

_TORCH_LACKS = (
    "LoRA on the Mamba-2 mixers, the one-mixer-per-block layout (mixer.*) and the non-gated relu^2 experts",
    "packed rows for Mamba-2 (conv and scan state restarted per datum)",
    "the sampler's decode of Mamba-2 layers",
)
_MEGATRON_LACKS = (
    "Mamba-2 layers (megatron-core's MambaMixer needs the mamba_ssm and causal_conv1d CUDA kernels, not in this "
    "image)",
    "non-gated relu^2 experts with a sigmoid grouped router",
)

_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
          "mlp": "dense", "moe": "moe"}


class NemotronHFamily(ModelFamily):
    def _block_types(self, config) -> list[str]:
        layers = int(getattr(config, "num_hidden_layers", 0))
        types = list(getattr(config, "layers_block_type", None) or ())
        return [_KINDS.get(t, t) for t in types[:layers]]

    def mixer_kinds(self, config) -> list[str]:
        """The token mixer of each block ("mamba", "attention"; "none" for an MLP/MoE block)."""
        return [k if k in ("mamba", "attention") else "none" for k in self._block_types(config)]

    def layer_kinds(self, config) -> list[str]:
        """The MLP of each block ("dense", "moe"; "none" for a mixer block)."""
        return [k if k in ("dense", "moe") else "none" for k in self._block_types(config)]


def tiny_config(vocab_size: int):
    """4 blocks: Mamba-2, MoE (4 experts top-2 + a shared expert), attention, relu^2 MLP; hidden 64."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab_size, hidden_size=64, layers_block_type=["mamba", "moe", "attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, expand=1,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1, use_mamba_kernels=False,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=4, pad_token_id=0)


FAMILY = NemotronHFamily(
    model_type="nemotron_h",
    description="Nemotron-H / Nemotron-3 (Nano 30B-A3B, Super 120B): blocks of Mamba-2 mixers, GQA attention "
                "(no RoPE), relu^2 MLPs and MoE (sigmoid grouped router, relu^2 experts, a shared expert); "
                "checkpoint weights under backbone.",
    features=frozenset({MAMBA, RELU2_MLP, SIGMOID_ROUTER, MOE, SHARED_EXPERTS}),
    hf_weights=_WEIGHTS,
    moe=True,
    implied={MAMBA: "Mamba-2 mixer layers", RELU2_MLP: "non-gated relu^2 MLPs and experts",
             SIGMOID_ROUTER: "a sigmoid router with a score-correction bias and grouped top-k"},
    backend_lacks={"torch": _TORCH_LACKS, "megatron": _MEGATRON_LACKS},
    checkpoint_prefix="backbone.",
    mixer_targets={},
    mlp_targets={},
    sglang=None,
    tiny=tiny_config,
)
