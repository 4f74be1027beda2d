"""How the megatron backend is built and launched: its command-line options, the engine on every rank, and the
torchrun job in which rank 0 serves gRPC and drives the other ranks. The entry point is the trainer's own
(`torchrun ... -m trainer_svc.torchrun`, trainer_svc/torchrun.py); it reaches this module through the backend
registry (trainer_svc/backends/__init__.py) and hands it the function that serves the built backend.

World size = tensor_parallel_size x data_parallel_size; a mixture-of-experts model may spread its experts over
``--expert-parallel-size`` of the data-parallel ranks (EP must divide the data-parallel size and the expert
count; unset, the trainer chooses it from the model and the GPUs, :mod:`.parallel_plan`). Every rank loads the base model and builds its shard of the GPTModel; rank 0 then builds the service and
the gRPC server, and every engine call is broadcast to the other ranks (:class:`.backend.Driver`), which loop in
:meth:`Driver.follow` until rank 0 shuts down.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer_svc.backends import BackendConfig, Serve
    from trainer_svc.backends.base import TrainerBackend

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The megatron backend's own options (the trainer's common ones, and their defaults, are trainer_svc's)."""
    group = parser.add_argument_group("megatron backend (one process per GPU under torchrun)")
    actions = [
        group.add_argument("--tensor-parallel-size", type=int, default=1),
        group.add_argument("--data-parallel-size", type=int, default=0, help="0 = world size / tensor parallel size"),
        group.add_argument("--expert-parallel-size", type=int, default=0,
                           help="MoE models: experts spread over this many data-parallel ranks (tokens exchanged "
                                "all-to-all); 0 = chosen from the model and the GPUs (replicas where the model fits "
                                "one GPU: parallel_plan.py)"),
        group.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16"),
        group.add_argument("--lora-dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                           help="dtype of the LoRA matmuls; auto = --dtype (masters and grads are fp32 regardless)"),
        group.add_argument("--attention", choices=["sdpa", "unfused"], default="sdpa",
                           help="core attention: torch SDPA (fused kernels, no s^2 scores) or megatron's unfused one"),
        group.add_argument("--recompute", choices=["auto", "none", "full"], default="auto",
                           help="activation recomputation of decoder layers; auto = as many as a batch needs to fit"),
    ]
    return tuple(action.dest for action in actions)


def build_engine(base_model: str, tensor_parallel_size: int, data_parallel_size: int, device_slots: int,
                 dtype: torch.dtype, lora_dtype: torch.dtype | None, attention: str = "sdpa",
                 recompute: str = "auto", expert_parallel_size: int = 0, max_fused_adapters: int = 8):
    from loraplane.models import load_base_model

    from .engine import Engine
    from .model import init_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tensor_parallel_size:
        raise SystemExit(f"world size {world} is not a multiple of --tensor-parallel-size {tensor_parallel_size}")
    if data_parallel_size and data_parallel_size * tensor_parallel_size != world:
        raise SystemExit(f"tensor x data parallel = {tensor_parallel_size * data_parallel_size} != world {world}")
    base = load_base_model(base_model, device="cpu", dtype=torch.float32, backend="megatron")
    if not expert_parallel_size:
        from .parallel_plan import planned_expert_parallel

        expert_parallel_size = planned_expert_parallel(
            base.model.config, world, tensor_parallel_size, dtype_bytes=torch.finfo(dtype).bits // 8,
            device_slots=device_slots, expert_lora_slots=max_fused_adapters)
    if (world // tensor_parallel_size) % expert_parallel_size:
        raise SystemExit(f"--expert-parallel-size {expert_parallel_size} must divide the data-parallel size "
                         f"{world // tensor_parallel_size}")
    init_parallel(tensor_parallel_size, expert_parallel_size=expert_parallel_size)
    # An MoE model routes each fused adapter's tokens through its own expert slot (.moe.SlotRouter).
    return Engine(base, device_slots=device_slots, dtype=dtype, lora_compute_dtype=lora_dtype,
                  data_parallel_size=data_parallel_size or None, attention=attention, recompute=recompute,
                  expert_lora_slots=max_fused_adapters)


def _engine(config: BackendConfig):
    options = dict(config.options)
    return build_engine(config.base_model, int(options.get("tensor_parallel_size", 1)),
                        int(options.get("data_parallel_size", 0)), config.device_slots,
                        DTYPES[options.get("dtype", "bfloat16")], DTYPES.get(options.get("lora_dtype", "auto")),
                        options.get("attention", "sdpa"), options.get("recompute", "auto"),
                        int(options.get("expert_parallel_size", 0)), config.max_fused_adapters)


def build(config: BackendConfig) -> TrainerBackend:
    """The backend on this one process (a one-rank job; tests and in-process servers)."""
    from .backend import MegatronBackend

    return MegatronBackend(engine=_engine(config))


def launch(config: BackendConfig, serve: Serve) -> None:
    """One rank of the torchrun job: every rank builds its shard of the engine; rank 0 serves it (`serve` returns at
    shutdown, and closing the backend releases the followers), the others follow rank 0's calls."""
    import torch.distributed as dist

    from .backend import Driver, MegatronBackend

    engine = _engine(config)
    if dist.get_rank() == 0:
        asyncio.run(serve(MegatronBackend(engine=engine)))
    else:
        Driver(engine).follow()
    dist.barrier()
    dist.destroy_process_group()
