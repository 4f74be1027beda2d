"""Llama 2/3.x: the plain layout every other family extends (dense SwiGLU decoder, GQA, RoPE)."""

from loraplane.models.families._weights import COMMON_WEIGHTS, DENSE_MLP_WEIGHTS
from loraplane.models.families.base import ATTENTION_BIAS, ROPE_LLAMA3, ModelFamily


def tiny_config(vocab_size: int):
    from loraplane.models.tiny import tiny_config as llama_tiny

    return llama_tiny(vocab_size)


FAMILY = ModelFamily(
    model_type="llama", description="Llama 2/3.x: dense SwiGLU decoder, GQA, RoPE",
    features=frozenset({ATTENTION_BIAS, ROPE_LLAMA3}),
    hf_weights={**COMMON_WEIGHTS, **DENSE_MLP_WEIGHTS},
    lacks=("qk_norm", "moe"), tiny=tiny_config, sglang={})
