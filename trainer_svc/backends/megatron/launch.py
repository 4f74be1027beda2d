"""torchrun entry of the megatron trainer: rank 0 serves gRPC and drives the other ranks.

    torchrun --standalone --nproc-per-node 2 -m trainer_svc.backends.megatron.launch \
        --base-model smollm2-135m-instruct --tensor-parallel-size 2 --registry-address HOST:PORT --port 50052

World size = tensor_parallel_size x data_parallel_size; a mixture-of-experts model may spread its experts over
``--expert-parallel-size`` of the data-parallel ranks (EP must divide the data-parallel size and the expert
count). Every rank loads the base model and builds its shard of the GPTModel; rank 0 then builds the service and the gRPC server, and every engine call is broadcast to the other
ranks (:class:`.backend.Driver`), which loop in :meth:`Driver.follow` until rank 0 shuts down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    from loraplane.config import Settings

    settings = Settings()
    p = argparse.ArgumentParser(prog="torchrun ... -m trainer_svc.backends.megatron.launch", description=__doc__)
    p.add_argument("--registry-address", default=settings.registry_address)
    p.add_argument("--base-model", default=settings.base_model)
    p.add_argument("--host", default=settings.host)
    p.add_argument("--port", type=int, default=settings.trainer_port)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=0, help="0 = world size / tensor parallel size")
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="MoE models: experts spread over this many data-parallel ranks (tokens exchanged all-to-all)")
    p.add_argument("--device-slots", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=128)
    p.add_argument("--max-fused-adapters", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--lora-dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="dtype of the LoRA matmuls; auto = --dtype (masters and grads are fp32 regardless)")
    p.add_argument("--attention", choices=["sdpa", "unfused"], default="sdpa",
                   help="core attention: torch SDPA (fused kernels, no s^2 scores) or megatron's unfused one")
    p.add_argument("--recompute", choices=["auto", "none", "full"], default="auto",
                   help="activation recomputation of decoder layers; auto = as many as a batch needs to fit")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def build_engine(base_model: str, tensor_parallel_size: int, data_parallel_size: int, device_slots: int,
                 dtype: torch.dtype, lora_dtype: torch.dtype | None, attention: str = "sdpa",
                 recompute: str = "auto", expert_parallel_size: int = 1, max_fused_adapters: int = 8):
    from loraplane.models import load_base_model

    from .engine import Engine
    from .model import init_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tensor_parallel_size:
        raise SystemExit(f"world size {world} is not a multiple of --tensor-parallel-size {tensor_parallel_size}")
    if data_parallel_size and data_parallel_size * tensor_parallel_size != world:
        raise SystemExit(f"tensor x data parallel = {tensor_parallel_size * data_parallel_size} != world {world}")
    if (world // tensor_parallel_size) % expert_parallel_size:
        raise SystemExit(f"--expert-parallel-size {expert_parallel_size} must divide the data-parallel size "
                         f"{world // tensor_parallel_size}")
    init_parallel(tensor_parallel_size, expert_parallel_size=expert_parallel_size)
    base = load_base_model(base_model, device="cpu", dtype=torch.float32)
    # An MoE model routes each fused adapter's tokens through its own expert slot (.moe.SlotRouter).
    return Engine(base, device_slots=device_slots, dtype=dtype, lora_compute_dtype=lora_dtype,
                  data_parallel_size=data_parallel_size or None, attention=attention, recompute=recompute,
                  expert_lora_slots=max_fused_adapters)


async def start_megatron_trainer_server(settings, *, backend, registry_address: str, host: str = "127.0.0.1",
                                       port: int = 0, **limits):
    """`trainer_svc.server.start_trainer_server` for the megatron backend (the one shared service: the backend
    owns its adapter tensors through the backend interface, trainer_svc/backends/base.py)."""
    from trainer_svc.server import start_trainer_server

    return await start_trainer_server(settings, backend=backend, registry_address=registry_address, host=host,
                                      port=port, **limits)


async def serve_rank0(args, engine) -> None:
    from loraplane.config import Settings
    from loraplane.rpc import wait_for_shutdown_signal

    from .backend import MegatronBackend

    if not args.registry_address:
        raise SystemExit("--registry-address (or LORAPLANE_REGISTRY_ADDRESS) is required")
    trainer = await start_megatron_trainer_server(
        Settings(), backend=MegatronBackend(engine=engine), registry_address=args.registry_address,
        host=args.host, port=args.port, device_slots=args.device_slots, max_lora_rank=args.max_lora_rank,
        max_fused_adapters=args.max_fused_adapters)
    print(f"TRAINER_READY {trainer.address}", flush=True)
    await wait_for_shutdown_signal()
    await trainer.stop()  # closes the backend, which releases the follower ranks


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(args.base_model, args.tensor_parallel_size, args.data_parallel_size, args.device_slots,
                          DTYPES[args.dtype], DTYPES.get(args.lora_dtype), args.attention, args.recompute,
                          args.expert_parallel_size, args.max_fused_adapters)
    import torch.distributed as dist

    from .backend import Driver

    if dist.get_rank() == 0:
        asyncio.run(serve_rank0(args, engine))
    else:
        Driver(engine).follow()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
