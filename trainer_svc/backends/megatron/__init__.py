"""megatron-core backend of the trainer (CUDA; tensor/data parallel under torchrun).

Only :mod:`.layout` is importable without megatron-core; everything else imports it lazily.
"""
