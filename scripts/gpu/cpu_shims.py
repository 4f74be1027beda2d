"""pytest plugin for developers without a GPU: lets the megatron backend's CUDA tests run on CPU (fp32, gloo).

    LORAPLANE_MEGATRON_CPU_DEV=1 PYTHONPATH=<megatron-core>:. python -m pytest tests/gpu/test_megatron_service.py \
        -m gpu -o addopts="" -p scripts.gpu.cpu_shims

megatron-core asks ``torch.cuda.current_device()`` for the RoPE frequencies and forks its CUDA RNG tracker around
attention dropout (which is 0 here); both are redirected. Nothing else changes: the same engine code runs.
"""

from __future__ import annotations

import contextlib

import torch

if not torch.cuda.is_available():
    torch.cuda.current_device = lambda: "cpu"

    import trainer_svc.backends.megatron.model as _model

    _init_parallel = _model.init_parallel

    def _init_parallel_cpu(tensor_parallel_size: int = 1, seed: int = 1234, **kwargs) -> None:
        _init_parallel(tensor_parallel_size, seed, **kwargs)
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

    _model.init_parallel = _init_parallel_cpu
