"""`python -m trainer_svc`: runs a trainer until SIGINT/SIGTERM. Prints `TRAINER_READY <address>` once serving.

The one command line of every backend (trainer_svc/backends: `--backend` picks the entry, which adds its own
options and launches its processes); under torchrun the same command is `-m trainer_svc.torchrun`, whose backend
defaults to megatron. The trainer's defaults are TrainerLimits' and Settings', here only."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from loraplane.config import Settings
from loraplane.rpc import wait_for_shutdown_signal
from loraplane.threads import apply_service_threads
from trainer_svc.backends import BACKEND_NAMES, BACKENDS, PROCESS, BackendConfig, backend_entry
from trainer_svc.backends.base import TrainerBackend
from trainer_svc.server import start_trainer_server
from trainer_svc.service import TrainerLimits


def parse_args(argv=None, *, default_backend: str = "torch", prog: str = "python -m trainer_svc") -> argparse.Namespace:
    """The trainer's options plus the chosen backend's own; `backend_options` names the latter."""
    argv = sys.argv[1:] if argv is None else list(argv)
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--backend", default=default_backend)
    chosen = BACKENDS.get(chooser.parse_known_args(argv)[0].backend)
    settings = Settings()
    defaults = TrainerLimits()
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--registry-address", default=settings.registry_address,
                        help="host:port of the adapter registry (LORAPLANE_REGISTRY_ADDRESS)")
    parser.add_argument("--base-model", default=settings.base_model,
                        help="tiny, smollm2-135m-instruct, or a local HF model directory")
    parser.add_argument("--backend", choices=BACKEND_NAMES, default=default_backend,
                        help="; ".join(f"{entry.name}: {entry.description}" for entry in BACKENDS.values()))
    parser.add_argument("--device", default=settings.device)
    parser.add_argument("--host", default=settings.host)
    parser.add_argument("--port", type=int, default=settings.trainer_port)
    parser.add_argument("--device-slots", type=int, default=defaults.device_slots)
    parser.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank)
    parser.add_argument("--max-fused-adapters", type=int, default=defaults.max_fused_adapters)
    parser.add_argument("--gap-timeout-s", type=float, default=defaults.gap_timeout_s)
    parser.add_argument("--log-level", default="INFO")
    backend_options = chosen.add_arguments(parser) if chosen is not None else ()
    args = parser.parse_args(argv)
    args.backend_options = backend_options
    return args


async def serve(args: argparse.Namespace, backend: TrainerBackend) -> None:
    trainer = await start_trainer_server(
        Settings(), base_model=args.base_model, registry_address=args.registry_address, host=args.host,
        port=args.port, device=args.device, backend=backend, device_slots=args.device_slots,
        max_lora_rank=args.max_lora_rank, max_fused_adapters=args.max_fused_adapters,
        gap_timeout_s=args.gap_timeout_s)
    print(f"TRAINER_READY {trainer.address}", flush=True)
    await wait_for_shutdown_signal()
    await trainer.stop()  # closes the backend (a torchrun job's followers are released by it)


def main(argv=None, *, default_backend: str = "torch", prog: str = "python -m trainer_svc") -> None:
    args = parse_args(argv, default_backend=default_backend, prog=prog)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.registry_address:
        raise SystemExit("--registry-address (or LORAPLANE_REGISTRY_ADDRESS) is required")
    entry = backend_entry(args.backend)
    if entry.launcher == PROCESS:
        # This host's share of the cores (LORAPLANE_TORCH_THREADS); torchrun sets its ranks' threads itself.
        apply_service_threads("trainer")
    config = BackendConfig(args.base_model, args.device, device_slots=args.device_slots,
                           max_fused_adapters=args.max_fused_adapters,
                           options={name: getattr(args, name) for name in args.backend_options})
    entry.launch(config, functools.partial(serve, args))


if __name__ == "__main__":
    main()
