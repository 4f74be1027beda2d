"""A trainer fleet against one trainer, through the whole production path: aggregate training tokens/s of T tenants,
each training its own adapter with loraplane's Python client (ForwardBackward + OptimStep, pipelined), once on one
trainer holding all T adapters and once on a fleet of N trainers that placed them (least loaded), the client
routing each adapter's calls to its trainer. Both fleets run at once on one registry, Valkey and SeaweedFS, and the
rounds alternate between them, so both see the same machine.

    python bench/trainer_fleet.py                                   # CPU smoke run: tiny, 2 trainers, 4 tenants
    python bench/trainer_fleet.py --shape llama8b --device cuda --trainers 4 --tenants 8 --datums 2 --seq-len 2048 \
        --gpus 0,1,2,3 --one-gpu 0                                  # issue 23: 4 single-GPU trainers vs 1 (>= 3.6x)

Each trainer is its own `python -m trainer_svc` process (the torch backend; `--backend megatron` runs
`trainer_svc.torchrun` under a one-process torchrun instead) on its own GPU
(CUDA_VISIBLE_DEVICES); the single trainer shares `--one-gpu` with a fleet member, so on GPUs both must fit in its
memory at once. `--shape` other than tiny builds a random-weight bf16 model of that shape once (bench/trainer_vs_peft
SHAPES) with a small tokenizer: requests carry token ids. Prints a table and writes bench/results/trainer_fleet.json:
per round and contender the wall time of every tenant's steps and the aggregate tokens/s, the medians and their
ratio, and where the fleet placed the adapters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import embedded_storage, environment, print_table, write_results

ROOT = Path(__file__).resolve().parent.parent


def build_model(shape: str, directory: Path, device: str) -> str:
    """The base model to serve: `tiny` as is, else a random-weight bf16 model of the shape saved once."""
    if shape == "tiny":
        return "tiny"
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from bench.harness import SHAPES
    from loraplane.models.tiny import build_tiny_tokenizer

    if not (directory / "config.json").is_file():
        fields = dict(SHAPES[shape])
        arch = fields.pop("arch")
        config = (LlamaConfig if arch == "llama" else Qwen3Config)(
            **fields, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(directory, safe_serialization=True)
        build_tiny_tokenizer().save_pretrained(directory)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return str(directory)


class Trainer:
    """One trainer process, a member of `fleet`, on `gpu` (or the CPU)."""

    def __init__(self, args, settings, registry: str, base_model: str, fleet: str, member: str, gpu: str | None,
                 logs: Path):
        env = {**os.environ, "LORAPLANE_REDIS_URL": settings.redis_url, "LORAPLANE_KEY_PREFIX": settings.key_prefix,
               "LORAPLANE_TRAINER_FLEET": fleet, "LORAPLANE_TRAINER_ID": member, "LORAPLANE_AUTH": "0",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        common = ["--registry-address", registry, "--base-model", base_model, "--host", "127.0.0.1", "--port", "0",
                  "--max-fused-adapters", str(args.tenants)]
        if args.backend == "megatron":
            command = ["torchrun", "--standalone", "--nproc-per-node", "1", "-m",
                       "trainer_svc.torchrun", *common]
        else:
            command = [sys.executable, "-m", "trainer_svc", "--backend", "torch", "--device", args.device, *common]
        self.name = f"{fleet}/{member}"
        self.log = logs / f"{fleet}-{member}.log"
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=self.log.open("w"),
                                        text=True, cwd=ROOT, start_new_session=True)
        self.address = ""

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for line in self.process.stdout:
            if line.startswith("TRAINER_READY "):
                self.address = line.split()[1]
                # Nothing reads stdout from here on: keep draining it so the process never blocks on a full pipe.
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return self.address
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"trainer {self.name} did not start (exit {self.process.poll()}); see {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Contender:
    """T tenants training through one client seed: a lone trainer, or any member of a fleet."""

    def __init__(self, label: str, seed: str, registry: str, args, vocab: int):
        import random

        from loraplane.client import ServiceClient, datum_from_sequence
        from loraplane.client._runtime import RetryConfig

        self.label = label
        self.service = ServiceClient(trainer=seed, registry=registry, sampler="127.0.0.1:9",
                                     retry=RetryConfig(total_timeout_s=600.0))
        run = uuid.uuid4().hex[:6]
        self.clients = [self.service.create_lora_training_client(None,
                                                                 rank=args.rank, seed=i, name=f"bench/{run}-t{i}")
                        for i in range(args.tenants)]
        rng = random.Random(7)
        self.batches = [[datum_from_sequence([rng.randrange(5, vocab) for _ in range(args.seq_len + 1)])
                         for _ in range(args.datums)] for _ in range(args.tenants)]
        self.tokens_per_step = args.tenants * args.datums * args.seq_len
        self.steps = args.steps
        self.rounds: list[dict] = []

    def round(self) -> dict:
        from loraplane.client import AdamParams

        adam = AdamParams(learning_rate=1e-4)
        started = time.perf_counter()
        futures = []
        for _ in range(self.steps):  # every tenant's steps go out at once; the trainers queue and fuse them
            for client, batch in zip(self.clients, self.batches):
                futures.append(client.forward_backward(batch, "cross_entropy"))
                futures.append(client.optim_step(adam))
        for future in futures:
            future.result(3600)
        wall = time.perf_counter() - started
        result = {"wall_s": round(wall, 4), "tokens_per_s": round(self.tokens_per_step * self.steps / wall, 1)}
        self.rounds.append(result)
        return result

    def median(self) -> float:
        return statistics.median(r["tokens_per_s"] for r in self.rounds)


def placements(settings) -> dict:
    """Adapters placed per fleet member, as the fleet's store records them."""
    from trainer_svc.fleet_store import FleetStore

    store = FleetStore(settings.redis_url, key_prefix=settings.key_prefix, fleet="fleet")
    try:
        return {m.trainer_id: m.placed for m in store.members()}
    finally:
        store.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="tiny, or a bench/trainer_vs_peft.py shape (llama8b, ...)")
    parser.add_argument("--backend", choices=["torch", "megatron"], default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trainers", type=int, default=2, help="members of the fleet contender")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--datums", type=int, default=2, help="datums per tenant per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="steps per tenant per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per contender (after one warm-up)")
    parser.add_argument("--gpus", default="", help="comma-separated GPU per fleet member (default: none, CPU)")
    parser.add_argument("--one-gpu", default="", help="the GPU of the single trainer (default: none, CPU)")
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--sequential", action="store_true",
                        help="measure the single trainer, stop it, then start and measure the fleet (on GPUs the two "
                             "would otherwise share --one-gpu's memory)")
    parser.add_argument("--work", default="", help="where the stores, logs and the built model go (default: tmp)")
    args = parser.parse_args(argv)
    gpus = [g for g in args.gpus.split(",") if g] or [None] * args.trainers
    if len(gpus) != args.trainers:
        parser.error(f"--gpus names {len(gpus)} GPUs for {args.trainers} trainers")

    from loraplane.rpc import BackgroundLoop
    from registry_svc.server import start_registry_server

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    base_model = build_model(args.shape, work / f"model-{args.shape}", args.device)
    loop = BackgroundLoop("bench-fleet")
    trainers: list[Trainer] = []
    with embedded_storage(work / "stores", "bench-fleet", key_prefix=f"benchfleet:{uuid.uuid4().hex[:6]}:") \
            as settings:
        registry = loop.run(start_registry_server(settings), timeout=120)
        try:
            def start(fleet: str, names: list[str], gpu_of: list[str | None]) -> list[Trainer]:
                started = [Trainer(args, settings, registry.address, base_model, fleet, name, gpu, work)
                           for name, gpu in zip(names, gpu_of)]
                trainers.extend(started)
                for trainer in started:
                    trainer.wait_ready(args.start_timeout_s)
                return started

            def contender(label: str, seed: Trainer) -> Contender:
                from loraplane.client import ServiceClient

                vocab = ServiceClient(trainer=seed.address, registry=registry.address,
                                      sampler="127.0.0.1:9").get_server_capabilities().tokenizer.vocab_size
                made = Contender(label, seed.address, registry.address, args, vocab)
                made.round()  # warm-up: compiled kernels, allocator, resident slots
                made.rounds.clear()
                return made

            def stop_all() -> None:
                for trainer in trainers:
                    trainer.stop()
                trainers.clear()

            if args.sequential:
                # Each contender alone on its GPUs (started, measured, stopped), so neither holds device memory the
                # other's memory planner would count as taken; the rounds no longer alternate.
                single = contender("1 trainer", start("one", ["one-0"], [args.one_gpu or None])[0])
                for _ in range(args.rounds):
                    single.round()
                stop_all()
                members = start("fleet", [f"fleet-{i}" for i in range(args.trainers)], gpus)
                fleet = contender(f"{args.trainers} trainers", members[0])
                placed = placements(settings)
                for _ in range(args.rounds):
                    fleet.round()
            else:
                one = start("one", ["one-0"], [args.one_gpu or None])[0]
                members = start("fleet", [f"fleet-{i}" for i in range(args.trainers)], gpus)
                single, fleet = contender("1 trainer", one), contender(f"{args.trainers} trainers", members[0])
                placed = placements(settings)
                order = [single, fleet]
                for _ in range(args.rounds):
                    for c in order:
                        c.round()
                    order.reverse()
        finally:
            for trainer in trainers:
                trainer.stop()
            loop.run(registry.stop(), timeout=60)
            loop.close()
    contenders = [single, fleet]
    results = {
        "environment": environment(), "shape": args.shape, "backend": args.backend, "device": args.device,
        "trainers": args.trainers, "tenants": args.tenants, "datums": args.datums, "seq_len": args.seq_len,
        "rank": args.rank, "steps_per_round": args.steps, "gpus": args.gpus, "one_gpu": args.one_gpu,
        "placed": placed, "rounds": {c.label: c.rounds for c in contenders},
        "tokens_per_s": {c.label: c.median() for c in contenders}, "speedup": round(fleet.median() / single.median(), 3),
    }
    print_table(f"trainer fleet vs one trainer: {args.tenants} tenants, {args.shape}, {args.datums} x {args.seq_len}",
                ["contender", "median tok/s", "rounds (tok/s)"],
                [[c.label, f"{c.median():,.0f}", ", ".join(f"{r['tokens_per_s']:,.0f}" for r in c.rounds)]
                 for c in contenders])
    print(f"speedup {results['speedup']:.2f}x; adapters placed per member: {placed}")
    print(f"wrote {write_results('trainer_fleet', results)}")


if __name__ == "__main__":
    main()
