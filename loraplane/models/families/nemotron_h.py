"""Nemotron-H / Nemotron-3 (``nemotron_h``: NVIDIA Nemotron-3 Nano 30B-A3B, Super 120B).

One mixer per decoder block, chosen by ``layers_block_type``: a Mamba-2 mixer ("linear_attention" in transformers
5: ``in_proj`` -> depthwise causal conv1d -> selective-state-space scan with ``n_groups`` -> gated RMSNorm ->
``out_proj``), GQA attention without RoPE ("full_attention"), a non-gated relu^2 MLP ("mlp": ``up_proj``,
``down_proj``) or a MoE ("moe": a sigmoid router with a score-correction bias and grouped top-k, non-gated relu^2
experts ``up_proj`` / ``down_proj`` stored fused 3-D, and a shared expert). Released checkpoints name the weights
``backbone.*`` (transformers' causal LM maps them to ``model.*``).

On the torch backend transformers' modules compute everything (on CPU its PyTorch fallbacks of the Mamba kernels).
LoRA targets (PEFT target_modules match them as module-path suffixes): the Mamba mixers' ``mixer.in_proj`` /
``mixer.out_proj``, attention ``mixer.q_proj|k_proj|v_proj|o_proj``, the relu^2 MLPs' ``mixer.up_proj`` /
``mixer.down_proj``, the shared experts' ``mixer.shared_experts.up_proj|down_proj`` and the routed experts'
``mixer.experts.up_proj|down_proj`` (HF PEFT target_parameters; computed by the LoRA experts path, non-gated);
a block offers its own kind's. SGLang serves all but the routed experts (refused before a version reaches it).

Packed rows: the Mamba-2 conv1d and scan would carry one datum's state into the next, so :func:`enable_packing`
runs them from a zero state at each datum (the projections still see the whole row, as every linear layer does):
per datum on CPU (bit-exactness), as one zero-padded batch on CUDA;
attention layers go through the packed attention like every family's. The sampler decodes through transformers'
forward with its hybrid cache (``hf_decode``).

Megatron: refused, naming the missing pieces (its Mamba layers need the mamba_ssm / causal_conv1d CUDA kernels).
"""

from __future__ import annotations

import sys
import types

import torch

from loraplane.models.families.base import (
    ALL_TARGETS,
    BLOCK_ATTENTION_TARGETS,
    BLOCK_MLP_TARGETS,
    BLOCK_SHARED_EXPERT_TARGETS,
    DENSE_AND_MOE_LAYERS,
    MAMBA,
    MAMBA_TARGETS,
    MOE,
    NONGATED_EXPERT_TARGETS,
    RELU2_MLP,
    SHARED_EXPERTS,
    SIGMOID_ROUTER,
    ModelFamily,
)

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

# Our target -> the module SGLang 0.5.17's NemotronHForCausalLM applies it to (its LoRA modules: in_proj,
# out_proj, qkv_proj, o_proj, up_proj, gate_up_proj, down_proj; q/k/v stacked by SGLang itself). Not the Mamba
# in_proj: SGLang gives LoRA to its z and x parts only (lora/mem_pool.py's buffer for in_proj), while our pair spans
# all of its rows (z, x, B, C, dt), which SGLang's load refuses; the sampler refuses such a version up front.
_SGLANG = {"mixer.out_proj": "out_proj", "mixer.q_proj": "qkv_proj",
           "mixer.k_proj": "qkv_proj", "mixer.v_proj": "qkv_proj", "mixer.o_proj": "o_proj",
           "mixer.up_proj": "up_proj", "mixer.down_proj": "down_proj",
           "mixer.shared_experts.up_proj": "up_proj", "mixer.shared_experts.down_proj": "down_proj"}
_MEGATRON_LACKS = (
    ("Mamba-2 layers (megatron-core's MambaMixer needs the mamba_ssm and causal_conv1d CUDA kernels, not in this "
     "image)"),
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

    def expert_dims(self, experts, target: str) -> tuple[int, int]:
        # Non-gated experts: up_proj [E, ffn, hidden], down_proj [E, hidden, ffn]: (in, out) of one expert.
        _, ffn, hidden = experts.up_proj.shape
        return (int(hidden), int(ffn)) if target == "mixer.experts.up_proj" else (int(ffn), int(hidden))

    def lora_targets(self, config) -> tuple[str, ...]:
        """Every block kind's targets (the dense relu^2 MLPs' beside the MoE blocks': their names differ, so PEFT
        never mistakes one for the other)."""
        offered: set[str] = set()
        for layer in range(len(self._block_types(config))):
            offered |= set(self.layer_targets(config, layer))
        return tuple(t for t in ALL_TARGETS if t in offered)


# ------------------------------------------------------------------------------------------------ packed rows

def _packed_forward(module, hidden_states, cache=None, attention_mask=None, **kwargs):
    """transformers' Mamba-2 mixer forward (its torch path) with the conv1d and the chunked scan starting from a zero
    state at each datum of a packed row, as the datum alone would: per datum on CPU (bit-exact), as one padded
    batch on CUDA (loraplane.models.packed). Outside a packed scope, or with a cache (generation), transformers'
    own forward."""
    from loraplane.models import packed

    lengths = packed.packed_lengths()
    if lengths is None or cache is not None:
        return module._loraplane_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    seq_len = hidden_states.shape[1]
    if sum(lengths) != seq_len:
        raise ValueError(f"packed lengths cover {sum(lengths)} tokens, the row has {seq_len}")
    dtype = hidden_states.dtype
    projected = module.in_proj(hidden_states)
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
    if packed.packed_impl(hidden_states.device) == packed.EXACT:
        outputs = []
        start = 0
        for length in lengths:
            end = start + length
            outputs.append(_scan(module, xbc[:, start:end], dt[:, start:end].contiguous()))
            start = end
        scan = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    else:
        # Every datum in one (datums, longest, ...) batch, zero-padded at its end: the conv1d and the scan are
        # causal, so the padding never reaches a datum's real positions.
        layout = packed.packed_layout(hidden_states.device)
        scan = layout.unpad(_scan(module, layout.pad(xbc), layout.pad(dt)))
    return module.out_proj(module.norm(scan, gate).to(dtype))


def _scan(module, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """conv1d + SSM scan of (batch, T, conv_dim) sequences from a zero state: (batch, T, intermediate)."""
    modeling = sys.modules[type(module).__module__]
    batch, length, _ = xbc.shape
    groups = module.n_groups * module.ssm_state_size
    x = xbc.transpose(1, 2).contiguous()
    conv = getattr(modeling, "causal_conv1d_fn", None)
    if conv is not None:
        x = conv(x, module.conv1d.weight.squeeze(1), module.conv1d.bias, activation=module.activation)
    else:  # transformers before 5.17 (SGLang 0.5.17 pins 5.12) without the causal-conv1d package
        x = getattr(torch.nn.functional, module.activation)(module.conv1d(x)[..., :length])
    x = x.transpose(1, 2)
    states, B, C = torch.split(x, [module.intermediate_size, groups, groups], dim=-1)
    chunk_scan = getattr(modeling, "mamba2_chunk_scan", None) or recurrent_scan
    out = chunk_scan(
        states.reshape(batch, length, module.num_heads, module.head_dim), dt, -torch.exp(module.A_log.float()),
        B.reshape(batch, length, module.n_groups, module.ssm_state_size),
        C.reshape(batch, length, module.n_groups, module.ssm_state_size), chunk_size=module.chunk_size,
        D=module.D, z=None, return_final_states=False, dt_bias=module.dt_bias, dt_softplus=True,
        initial_states=None, dt_limit=module.time_step_limit)
    return out.reshape(batch, length, -1)


def recurrent_scan(hidden_states, dt, A, B, C, chunk_size=None, D=None, z=None, return_final_states=False,
                   dt_bias=None, dt_softplus=False, initial_states=None, dt_limit=(0.0, float("inf"))):
    """The Mamba-2 SSM scan from a zero state, one position at a time, in fp32, taking transformers'
    ``mamba2_chunk_scan`` arguments (``hidden_states [b, T, heads, head_dim]``, ``dt [b, T, heads]``, ``A [heads]``,
    ``B``/``C [b, T, groups, state]``) -> ``[b, T, heads, head_dim]``. transformers before 5.17 (SGLang 0.5.17 pins
    5.12) has the chunked scan only inline in the mixer's forward; this is the same recurrence, a loop over
    positions (slow on long rows, exact to rounding: the chunked form is an algebraic regrouping of it)."""
    if z is not None or return_final_states or initial_states is not None:
        raise NotImplementedError("recurrent_scan computes the scan from a zero state, without a gate")
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    batch, length, heads, head_dim = x.shape
    B = B.float().repeat_interleave(heads // B.shape[2], dim=2)
    C = C.float().repeat_interleave(heads // C.shape[2], dim=2)
    decay = torch.exp(dt * A.float())
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    outputs = []
    for t in range(length):
        state = state * decay[:, t, :, None, None] + (x[:, t] * dt[:, t, :, None])[..., None] * B[:, t, :, None, :]
        outputs.append((state * C[:, t, :, None, :]).sum(-1))
    y = torch.stack(outputs, dim=1)
    return y if D is None else y + D.float()[:, None] * x


def enable_packing(model) -> None:
    """Routes every Mamba-2 mixer of `model` through :func:`_packed_forward` (idempotent)."""
    for module in model.modules():
        if type(module).__name__.endswith("Mamba2Mixer") and not hasattr(module, "_loraplane_forward"):
            module._loraplane_forward = module.forward
            module.forward = types.MethodType(_packed_forward, module)


def tiny_config(vocab_size: int):
    """4 blocks: Mamba-2, MoE (4 experts top-2 + a shared expert), attention, relu^2 MLP; hidden 64."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab_size, hidden_size=64, layers_block_type=["mamba", "moe", "attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, expand=1,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=4, pad_token_id=0)


FAMILY = NemotronHFamily(
    model_type="nemotron_h",
    description="Nemotron-H / Nemotron-3 (Nano 30B-A3B, Super 120B): blocks of Mamba-2 mixers, GQA attention "
                "(no RoPE), relu^2 MLPs and MoE (sigmoid grouped router, relu^2 experts, a shared expert); "
                "checkpoint weights under backbone.",
    # Its layers_block_type mixes relu^2 MLP blocks ("-") and MoE blocks ("E").
    features=frozenset({MAMBA, RELU2_MLP, SIGMOID_ROUTER, MOE, SHARED_EXPERTS, DENSE_AND_MOE_LAYERS}),
    hf_weights=_WEIGHTS,
    moe=True,
    implied={MAMBA: "Mamba-2 mixer layers", RELU2_MLP: "non-gated relu^2 MLPs and experts",
             SIGMOID_ROUTER: "a sigmoid router with a score-correction bias and grouped top-k"},
    backend_lacks={"megatron": _MEGATRON_LACKS},
    checkpoint_prefix="backbone.",
    mixer_targets={"mamba": MAMBA_TARGETS, "attention": BLOCK_ATTENTION_TARGETS},
    mlp_targets={"dense": BLOCK_MLP_TARGETS, "moe": BLOCK_SHARED_EXPERT_TARGETS + NONGATED_EXPERT_TARGETS},
    sglang=_SGLANG,
    tiny=tiny_config,
    packing=enable_packing,
    hf_decode=True,
    # transformers' Mamba-2 mixer otherwise fetches causal-conv1d and mamba-ssm from the Hugging Face Hub at
    # construction whenever the `kernels` package is installed (SGLang's wheels bring it): a network call at run
    # time, refused offline. loraplane runs the mixer's torch path on packed rows in any case.
    loading_overrides={"use_mamba_kernels": False},
)
