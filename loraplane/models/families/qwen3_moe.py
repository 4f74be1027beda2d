"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention; routed SwiGLU experts stored fused 3-D."""

from loraplane.models.families._weights import (
    COMMON_WEIGHTS,
    DENSE_MLP_WEIGHTS,
    EXPERT_WEIGHTS,
    QK_NORM_WEIGHTS,
)
from loraplane.models.families.base import ATTENTION_BIAS, DENSE_AND_MOE_LAYERS, MOE, QK_NORM, ModelFamily


def tiny_config(vocab_size: int):
    from loraplane.models.tiny import tiny_moe_config

    return tiny_moe_config(vocab_size)


FAMILY = ModelFamily(
    model_type="qwen3_moe",
    description="Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention; routed SwiGLU experts stored fused 3-D, "
                "softmax top-k router (norm_topk_prob), no shared expert; optional dense layers",
    features=frozenset({QK_NORM, ATTENTION_BIAS, MOE, DENSE_AND_MOE_LAYERS}),
    hf_weights={**COMMON_WEIGHTS, **DENSE_MLP_WEIGHTS, **QK_NORM_WEIGHTS, **EXPERT_WEIGHTS},
    lacks=("shared experts", "router bias / grouped routing"), moe=True,
    notes="dense layers (mlp_only_layers, decoder_sparse_step) use the dense MLP weights",
    implied={QK_NORM: "per-head q/k RMSNorm"}, tiny=tiny_config, sglang={})
