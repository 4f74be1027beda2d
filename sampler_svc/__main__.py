"""`python -m sampler_svc`: runs a sampler until SIGINT/SIGTERM. Prints `SAMPLER_READY <address>` once serving."""

from __future__ import annotations

import argparse
import logging

from loraplane.config import Settings
from loraplane.rpc import wait_for_shutdown_signal
from loraplane.threads import apply_service_threads
from sampler_svc.engines import ENGINE_NAMES, ENGINES
from sampler_svc.server import DEFAULT_MAX_LOADED, run_event_loop, start_sampler_server


def parse_args(argv=None) -> argparse.Namespace:
    settings = Settings()
    parser = argparse.ArgumentParser(prog="python -m sampler_svc", description=__doc__)
    parser.add_argument("--registry-address", default=settings.registry_address,
                        help="host:port of the adapter registry (LORAPLANE_REGISTRY_ADDRESS)")
    parser.add_argument("--base-model", default=settings.base_model)
    parser.add_argument("--engine", choices=ENGINE_NAMES, default=settings.sampler_engine,
                        help="the in-process torch engine or SGLang (LORAPLANE_SAMPLER_ENGINE)")
    parser.add_argument("--instance-id", default=settings.sampler_id,
                        help="names this sampler (its replica id in a fleet) and its persisted watch cursor; reuse it "
                             "across restarts (LORAPLANE_SAMPLER_ID)")
    parser.add_argument("--fleet", default=settings.sampler_fleet,
                        help="join this sampler fleet: replicas serving one base model, chosen per adapter by the "
                             "clients (LORAPLANE_SAMPLER_FLEET)")
    parser.add_argument("--keep-versions", type=int, default=2)
    parser.add_argument("--max-loaded", type=int, default=DEFAULT_MAX_LOADED)
    parser.add_argument("--max-batch-rows", type=int, default=16)
    parser.add_argument("--watch-prefix", default="", help="only follow adapters whose name starts with this")
    parser.add_argument("--host", default=settings.host)
    parser.add_argument("--port", type=int, default=settings.sampler_port)
    parser.add_argument("--sglang-url", action="append", default=[],
                        help="URL of a running SGLang server (repeatable)")
    parser.add_argument("--sglang-launch", type=int, default=0,
                        help="start this many SGLang servers (one per GPU) instead of --sglang-url")
    parser.add_argument("--sglang-max-lora-rank", type=int, default=64)
    parser.add_argument("--sglang-max-loras-per-batch", type=int, default=8)
    parser.add_argument("--sglang-max-loaded-loras", type=int, default=64)
    parser.add_argument("--sglang-adapter-transport", choices=["auto", "file", "tensors"], default="auto",
                        help="how adapter versions reach SGLang: a PEFT directory on a shared disk (file), the "
                             "request body (tensors), or files for servers on this host and tensors otherwise (auto)")
    parser.add_argument("--sglang-expert-form", choices=["per_expert", "stacked", "shared_outer"],
                        default="per_expert",
                        help="how MoE expert LoRA reaches SGLang: per-expert keys, 3-D tensors, or shared_outer (the "
                             "servers run --experts-shared-outer-loras: shared factors once, shared-outer adapters "
                             "only)")
    parser.add_argument("--sglang-arg", action="append", default=settings.sampler_sglang_args.split(),
                        help="extra argument for launched SGLang servers (repeatable), e.g. --sglang-arg=--dtype=bfloat16")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if ENGINES[args.engine].uses_servers and not args.sglang_url and not args.sglang_launch:
        args.sglang_launch = 1  # SGLang named and no server given: run one, as the torch engine runs in-process
    return args


async def serve(args: argparse.Namespace) -> None:
    settings = Settings()
    if not args.registry_address:
        raise SystemExit("--registry-address (or LORAPLANE_REGISTRY_ADDRESS) is required")
    sampler = await start_sampler_server(
        settings, registry_address=args.registry_address, base_model=args.base_model, engine=args.engine,
        instance_id=args.instance_id, fleet=args.fleet, keep_versions=args.keep_versions, max_loaded=args.max_loaded,
        host=args.host, port=args.port, watch_prefix=args.watch_prefix, sglang_urls=args.sglang_url,
        sglang_launch=args.sglang_launch, max_batch_rows=args.max_batch_rows,
        sglang_options={"max_lora_rank": args.sglang_max_lora_rank,
                        "max_loras_per_batch": args.sglang_max_loras_per_batch,
                        "max_loaded_loras": args.sglang_max_loaded_loras,
                        "adapter_transport": args.sglang_adapter_transport,
                        "expert_form": args.sglang_expert_form,
                        "extra_server_args": args.sglang_arg})
    print(f"SAMPLER_READY {sampler.address}", flush=True)
    await wait_for_shutdown_signal()
    await sampler.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_service_threads("sampler")  # this host's share of the cores (LORAPLANE_TORCH_THREADS)
    run_event_loop(serve(args))


if __name__ == "__main__":
    main()
