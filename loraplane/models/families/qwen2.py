"""Qwen2 / 2.5: the Llama layout plus q, k, v biases."""

from loraplane.models.families._weights import COMMON_WEIGHTS, DENSE_MLP_WEIGHTS, QKV_BIAS_WEIGHTS
from loraplane.models.families.base import QKV_BIAS, ModelFamily


def tiny_config(vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False)


FAMILY = ModelFamily(
    model_type="qwen2", description="Qwen2/2.5: Llama layout plus q, k, v biases",
    features=frozenset({QKV_BIAS}),
    hf_weights={**COMMON_WEIGHTS, **DENSE_MLP_WEIGHTS, **QKV_BIAS_WEIGHTS},
    lacks=("qk_norm", "moe"), implied={QKV_BIAS: "q, k, v biases"}, tiny=tiny_config, sglang={})
