"""`python -m trainer_svc`: runs a trainer until SIGINT/SIGTERM. Prints `TRAINER_READY <address>` once serving."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from loraplane.config import Settings
from loraplane.rpc import wait_for_shutdown_signal
from loraplane.threads import apply_service_threads
from trainer_svc.server import start_trainer_server
from trainer_svc.service import TrainerLimits


def parse_args(argv=None) -> argparse.Namespace:
    settings = Settings()
    defaults = TrainerLimits()
    parser = argparse.ArgumentParser(prog="python -m trainer_svc", description=__doc__)
    parser.add_argument("--registry-address", default=settings.registry_address,
                        help="host:port of the adapter registry (LORAPLANE_REGISTRY_ADDRESS)")
    parser.add_argument("--base-model", default=settings.base_model,
                        help="tiny, smollm2-135m-instruct, or a local HF model directory")
    parser.add_argument("--backend", choices=["torch", "megatron"], default="torch",
                        help="megatron hands over to trainer_svc.backends.megatron.launch (run it under torchrun)")
    parser.add_argument("--device", default=settings.device)
    parser.add_argument("--host", default=settings.host)
    parser.add_argument("--port", type=int, default=settings.trainer_port)
    parser.add_argument("--device-slots", type=int, default=defaults.device_slots)
    parser.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank)
    parser.add_argument("--max-fused-adapters", type=int, default=defaults.max_fused_adapters)
    parser.add_argument("--gap-timeout-s", type=float, default=defaults.gap_timeout_s)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    settings = Settings()
    if not args.registry_address:
        raise SystemExit("--registry-address (or LORAPLANE_REGISTRY_ADDRESS) is required")
    trainer = await start_trainer_server(
        settings, base_model=args.base_model, registry_address=args.registry_address, host=args.host,
        port=args.port, device=args.device, backend=args.backend, device_slots=args.device_slots,
        max_lora_rank=args.max_lora_rank, max_fused_adapters=args.max_fused_adapters,
        gap_timeout_s=args.gap_timeout_s)
    print(f"TRAINER_READY {trainer.address}", flush=True)
    await wait_for_shutdown_signal()
    await trainer.stop()


def _without_backend_flag(argv: list[str]) -> list[str]:
    kept, skip_value = [], False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--backend":
            skip_value = True
        elif not arg.startswith("--backend="):
            kept.append(arg)
    return kept


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    backend = argparse.ArgumentParser(add_help=False)
    backend.add_argument("--backend", default="torch")
    if backend.parse_known_args(argv)[0].backend == "megatron":
        # The megatron trainer runs one process per GPU under torchrun; its launcher owns the options it needs.
        from trainer_svc.backends.megatron.launch import main as megatron_main

        megatron_main(_without_backend_flag(argv))
        return
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_service_threads("trainer")  # this host's share of the cores (LORAPLANE_TORCH_THREADS)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
