"""Trainer backends: `torch` (HF transformers, CPU or GPU) and, later, `megatron`."""
