"""Trainer service: multi-tenant LoRA training (forward/backward, AdamW, publish) over gRPC."""
