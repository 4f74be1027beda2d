"""Qwen3 dense: the Llama layout plus per-head q/k RMSNorm and an explicit head_dim."""

from loraplane.models.families._weights import COMMON_WEIGHTS, DENSE_MLP_WEIGHTS, QK_NORM_WEIGHTS
from loraplane.models.families.base import ATTENTION_BIAS, QK_NORM, ModelFamily


def tiny_config(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=512,
                       rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False)


FAMILY = ModelFamily(
    model_type="qwen3", description="Qwen3 dense: Llama layout plus per-head q/k RMSNorm, explicit head_dim",
    features=frozenset({QK_NORM, ATTENTION_BIAS}),
    hf_weights={**COMMON_WEIGHTS, **DENSE_MLP_WEIGHTS, **QK_NORM_WEIGHTS},
    lacks=("moe",), implied={QK_NORM: "per-head q/k RMSNorm"}, tiny=tiny_config, sglang={})
