"""gpt-oss (``gpt_oss``: openai/gpt-oss-20b, gpt-oss-120b).

What differs from the Llama layout, all computed by transformers' own GptOss modules (the torch backend runs the HF
model as it is):

* attention sinks: a learned logit per head (``self_attn.sinks``) joins each query's softmax and is dropped after
  it. HF refuses SDPA for them, so the model runs eager attention (:attr:`ModelFamily.attn_implementation`);
* layers alternate a sliding window (``sliding_window`` keys, ``layer_types`` "sliding_attention") with full
  attention; biases on q/k/v/o; YaRN RoPE;
* routed experts top-k with a biased router (softmax over the top-k logits), stored transposed ``[E, in, out]``
  with biases, gate and up *interleaved* in ``gate_up_proj`` ([g0, u0, g1, u1, ...]) and a clamped SwiGLU
  ``(clamp(up) + 1) * g * sigmoid(1.702 g)``, ``g = clamp(gate, max=7)``;
* released checkpoints keep the experts MXFP4-quantized (``*_blocks`` / ``*_scales``):
  :mod:`loraplane.models.mxfp4` dequantizes them at load.

LoRA targets: q/k/v/o and the experts (HF PEFT's ``target_parameters`` on ``mlp.experts.gate_up_proj`` /
``down_proj``: A ``[r*E, in]``, B ``[out, r*E]``; on gpt-oss's transposed experts PEFT keeps in = hidden for
gate_up, whose B rows are in the interleaved order). Tinker's checkpoints name the attention ``.attn``
(the cookbook remaps it to ``.self_attn``); SGLang serves ``self_attn.qkv_proj|o_proj`` and ``mlp.experts``.

Packed rows: :func:`enable_packing` routes attention through :func:`_packed_sink_attention`, which runs transformers'
eager sink attention per datum with the datum's own causal (+ window) mask on CPU (bit-exactness), so no datum sees
another's keys; on CUDA one fused SDPA call per layer over the padded datums with the sink as an extra key
(:func:`_batched_sink_attention`).
"""

from __future__ import annotations

import torch

from loraplane.models.families._weights import COMMON_WEIGHTS
from loraplane.models.families.base import (
    ATTENTION_BIAS,
    ATTENTION_SINKS,
    ATTENTION_TARGETS,
    EXPERT_BIAS,
    EXPERT_TARGETS,
    MOE,
    ROPE_YARN,
    SLIDING_WINDOW,
    ModelFamily,
)

PACKED_SINK_ATTENTION = "loraplane_packed_sinks"

_WEIGHTS = {
    **COMMON_WEIGHTS,
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{i}.self_attn.o_proj.bias",
    "sinks": "model.layers.{i}.self_attn.sinks",  # [heads]
    "router": "model.layers.{i}.mlp.router.weight",  # [E, hidden]
    "router_bias": "model.layers.{i}.mlp.router.bias",  # [E]
    # [E, hidden, 2 ffn], columns interleaved gate/up (MXFP4 checkpoints: ..._blocks [E, 2 ffn, hidden/32, 16] and
    # ..._scales [E, 2 ffn, hidden/32], i.e. [out, in] before the transpose)
    "experts.gate_up_proj": "model.layers.{i}.mlp.experts.gate_up_proj",
    "experts.gate_up_proj_bias": "model.layers.{i}.mlp.experts.gate_up_proj_bias",  # [E, 2 ffn]
    "experts.down_proj": "model.layers.{i}.mlp.experts.down_proj",  # [E, ffn, hidden]
    "experts.down_proj_bias": "model.layers.{i}.mlp.experts.down_proj_bias",  # [E, hidden]
}

# SGLang 0.5.17's GptOssForCausalLM: LoRA on qkv_proj (stacked q/k/v), o_proj and the fused experts. The experts
# are left out until checked on a GPU: SGLang keeps gpt-oss's gate/up rows interleaved ([g0, u0, g1, ...]) while our
# SGLang expert conversion splits a gate_up LoRA B at its half (the Qwen layout), which would serve other numbers
# than the trainer's; an adapter with expert targets is refused for SGLang (the torch engine serves it).
_SGLANG = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj"}

# Tinker names gpt-oss's attention ``.attn`` in its adapter keys (the cookbook's weights remap it to
# ``.self_attn``): Tinker key fragment -> ours.
TINKER_RENAMES = {".attn.": ".self_attn."}

class GptOssFamily(ModelFamily):
    def expert_dims(self, experts, target: str) -> tuple[int, int]:
        # Transposed experts: gate_up_proj [E, hidden, 2 ffn], down_proj [E, ffn, hidden] (in, out per expert).
        _, hidden, two_ffn = experts.gate_up_proj.shape
        return (int(hidden), int(two_ffn)) if target == "experts.gate_up_proj" else (int(two_ffn) // 2, int(hidden))


# ------------------------------------------------------------------------------------------------ packed rows

def _datum_mask(length: int, window: int | None, dtype: torch.dtype, device) -> torch.Tensor:
    """transformers' eager mask for one sequence alone: 0 where key j is visible to query i (j <= i, and
    j > i - window on a sliding layer), the dtype's minimum elsewhere."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    visible = k <= q
    if window:
        visible = visible & (k > q - window)
    mask = torch.zeros((length, length), dtype=dtype, device=device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def _packed_sink_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           sliding_window=None, **kwargs):
    """gpt-oss's eager sink attention, per datum of a packed row (each with its own causal/window mask), or as
    transformers runs it outside a packed scope."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from loraplane.models import packed

    lengths = packed.packed_lengths()
    if lengths is None:
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    if sum(lengths) != query.shape[2]:
        raise ValueError(f"packed lengths cover {sum(lengths)} tokens, the row has {query.shape[2]}")
    if packed.packed_impl(query.device) != packed.EXACT:
        return _batched_sink_attention(module, query, key, value, scaling, sliding_window,
                                       packed.packed_layout(query.device)), None
    outputs = []
    start = 0
    for length in lengths:
        end = start + length
        mask = _datum_mask(length, sliding_window, query.dtype, query.device)
        out, _ = eager_attention_forward(module, query[:, :, start:end], key[:, :, start:end],
                                         value[:, :, start:end], mask, scaling=scaling, dropout=dropout)
        outputs.append(out)
        start = end
    if start != query.shape[2]:
        raise ValueError(f"packed lengths cover {start} tokens, the row has {query.shape[2]}")
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _sink_visibility(length: int, window: int | None, device) -> torch.Tensor:
    """(length, 1 + length) bool: the sink key (column 0) visible to every query, then :func:`_datum_mask`'s
    causal (+ window) visibility."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    visible = k <= q
    if window:
        visible = visible & (k > q - window)
    return torch.cat([torch.ones(length, 1, dtype=torch.bool, device=device), visible], dim=1)


def _batched_sink_attention(module, query, key, value, scaling, window, layout) -> torch.Tensor:
    """Sink attention over every datum of a packed row in one fused SDPA call (CUDA; EXACT per datum on CPU).

    The sink is a per-head logit in the softmax's denominator with no value: softmax over [scores, sink], sink
    column dropped. That is attention over one extra key whose score is the sink and whose value is zero. The
    extra key is made a real key through one extra feature column: every query gets 1 there, the sink key
    sinks[h] / scaling (SDPA multiplies q . k by scaling), every real key 0; so the kernel computes exactly that
    softmax, and the sinks' gradient flows back through the sink key. Datums are zero-padded at their ends into a
    (datums, heads, longest, dim) batch: causal masking keeps the padding out of every real query's keys, and the
    padded queries' rows are dropped."""
    from transformers.models.gpt_oss.modeling_gpt_oss import repeat_kv

    groups = module.num_key_value_groups

    def batch(x):  # (1, heads, N, d) -> (datums, heads, longest, d)
        return layout.pad(x.transpose(1, 2)).transpose(1, 2)

    q, k, v = batch(query), repeat_kv(batch(key), groups), repeat_kv(batch(value), groups)
    count, heads, longest, dim = q.shape
    width = -(-(dim + 1) // 8) * 8  # the fused kernels want head dims in multiples of 8
    zeros = q.new_zeros(count, heads, longest, width - dim - 1)
    q = torch.cat([q, q.new_ones(count, heads, longest, 1), zeros], dim=-1)
    k = torch.cat([k, k.new_zeros(count, heads, longest, width - dim)], dim=-1)
    sink = (module.sinks.to(q.dtype) / scaling).reshape(1, heads, 1, 1).expand(count, heads, 1, 1)
    sink_key = torch.cat([k.new_zeros(count, heads, 1, dim), sink, k.new_zeros(count, heads, 1, width - dim - 1)],
                         dim=-1)
    # Key length padded to a multiple of 16 with masked zero keys: the memory-efficient kernel wants its mask's
    # rows aligned so (every query still sees the sink, so no row is fully masked).
    tail = -(longest + 1) % 16
    k = torch.cat([sink_key, k, k.new_zeros(count, heads, tail, width)], dim=2)
    v = torch.cat([v.new_zeros(count, heads, 1, v.shape[-1]), v, v.new_zeros(count, heads, tail, v.shape[-1])],
                  dim=2)
    mask = _sink_visibility(longest, window, q.device)
    mask = torch.cat([mask, mask.new_zeros(longest, tail)], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return layout.unpad(out.transpose(1, 2))  # (1, N, heads, dim), as eager attention returns it


def _packed_sink_mask(*args, **kwargs):
    from transformers.masking_utils import eager_mask

    from loraplane.models.packed import packed_lengths

    if packed_lengths() is not None:
        return None  # each datum gets its own mask in _packed_sink_attention
    return eager_mask(*args, **kwargs)


def enable_packing(model) -> None:
    """Switches `model` to the packed-aware sink attention (eager attention outside packed rows)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if PACKED_SINK_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(PACKED_SINK_ATTENTION, _packed_sink_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SINK_ATTENTION, _packed_sink_mask)
    model.config._attn_implementation = PACKED_SINK_ATTENTION
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = PACKED_SINK_ATTENTION


# ------------------------------------------------------------------------------------------------ tiny config

def tiny_config(vocab_size: int):
    """2 layers (sliding window 4, then full attention), GQA 4/2 heads of 16, 4 experts top-2 (sizes multiples of
    4 for torch._grouped_mm), YaRN RoPE as released (scaled down)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
        router_aux_loss_coef=0.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=4, pad_token_id=0,
        initializer_range=0.1)


FAMILY = GptOssFamily(
    model_type="gpt_oss",
    description="gpt-oss (gpt-oss-20b, 120b): attention sinks, alternating 128-token sliding windows, q/k/v/o "
                "biases, YaRN RoPE; routed experts top-4 with biases, interleaved gate/up, clamped SwiGLU; MXFP4 "
                "expert weights in released checkpoints (dequantized at load)",
    features=frozenset({ATTENTION_SINKS, SLIDING_WINDOW, ATTENTION_BIAS, ROPE_YARN, MOE, EXPERT_BIAS}),
    hf_weights=_WEIGHTS,
    lacks=("dense MLP layers", "shared experts"),
    moe=True,
    implied={ATTENTION_SINKS: "attention sinks", EXPERT_BIAS: "biased experts with interleaved gate/up and a "
             "clamped SwiGLU"},
    backend_lacks={},
    mixer_targets={"attention": ATTENTION_TARGETS},
    mlp_targets={"moe": EXPERT_TARGETS},
    sglang=_SGLANG,
    # On Hopper SGLang 0.5.17 runs gpt-oss's experts on its triton_kernel MoE runner, whose LoRA wrapper raises
    # NotImplementedError at start-up once --lora-target-modules covers the MoE layers ("all"); the plain triton
    # runner takes LoRA.
    sglang_server_args=("--moe-runner-backend", "triton"),
    tiny=tiny_config,
    packing=enable_packing,
    attn_implementation="eager",
    hf_decode=True,
    expert_gate_up="interleaved",
    tinker_attention="attn",  # Tinker's gpt-oss keys: layers.{i}.attn.q_proj...
    notes="experts [E, in, out] (transformers' is_transposed); gate_up columns interleaved gate/up",
)
