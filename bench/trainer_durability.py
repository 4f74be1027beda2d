"""What durable training costs: the same training loop through two real trainers side by side, one journaling
every request to Redis and checkpointing to the registry, one with neither (what a user gets who turns durability
off), alternately in one run on real Valkey + SeaweedFS + registry; then the time a journaled trainer takes to
recover its adapter after it is dropped without any shutdown work (checkpoint download + journal replay).

    python bench/trainer_durability.py                       # tiny, then SmolLM2-135M (real weights)
    python bench/trainer_durability.py --models tiny --steps 60

Step time is ForwardBackward + OptimStep over gRPC. The overhead is journaled ÷ plain - 1, on the median step and
on the mean step (the mean carries the checkpoint steps). A smaller `--checkpoint-every` than the default 50 makes
the figure an upper bound for the default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import torch

from bench.common import embedded_storage, environment, print_table, write_results
from loraplane.rpc import BackgroundLoop, channel_options
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from registry_svc.server import start_registry_server
from trainer_svc.backends import build_backend
from trainer_svc.journal import TrainingJournal
from trainer_svc.server import start_trainer_server

TARGET_OVERHEAD = 0.05
# model: (datums, tokens per datum, steps per contender, checkpoint every N steps)
SETTINGS = {
    "tiny": (8, 64, 100, 50),
    "smollm2-135m-instruct": (8, 64, 12, 6),
}
ADAM = trainer_pb2.AdamParams(learning_rate=1e-4)
ROUND = 3  # steps one contender runs before the other takes over


class Contender:
    def __init__(self, name: str, running, loop: BackgroundLoop, vocab: int, datums: int, length: int):
        self.name, self.running, self.loop = name, running, loop
        self.channel = grpc.insecure_channel(running.address, options=channel_options())
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)
        self.seq = 0
        self.step_s: list[float] = []
        generator = torch.Generator().manual_seed(11)
        self.data = []
        for _ in range(datums):
            tokens = torch.randint(5, vocab, (length + 1,), generator=generator).tolist()
            self.data.append(trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:]))
        self.stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="bench-durable", lora_config=common_pb2.LoraConfig(rank=16, alpha=32, seed=1)))

    def step(self) -> None:
        started = time.perf_counter()
        self.seq += 1
        self.stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="bench-durable", seq_id=self.seq,
                                                                     data=self.data, loss_fn="cross_entropy"))
        self.seq += 1
        self.stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="bench-durable", seq_id=self.seq, adam_params=ADAM))
        self.step_s.append(time.perf_counter() - started)

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.running.stop(grace=0.5), timeout=60)


def run_model(model: str, steps: int | None, checkpoint_every: int | None, work: Path) -> dict:
    datums, length, default_steps, default_every = SETTINGS.get(model, (8, 64, 20, 10))
    steps, every = steps or default_steps, checkpoint_every or default_every
    with embedded_storage(work, "bench-durable") as settings:
        return _run_with(settings, model, datums, length, steps, every)


def _run_with(settings, model: str, datums: int, length: int, steps: int, every: int) -> dict:
    loop = BackgroundLoop("bench-durability")
    try:
        registry = loop.run(start_registry_server(settings), timeout=60)
        # One backend each: they hold per-adapter device state and must not see each other's adapters.
        backends = [build_backend("torch", model, "cpu") for _ in range(2)]
        limits = {"checkpoint_every_steps": every, "checkpoint_every_s": 0.0}

        def start(trainer_id: str, backend, journal: bool):
            return loop.run(start_trainer_server(settings.model_copy(update={"trainer_id": trainer_id}),
                                                 registry_address=registry.address, backend=backend,
                                                 journal=journal, **limits), timeout=300)

        vocab = backends[0].description.vocab_size
        journaled = Contender("journaled", start("journaled", backends[0], True), loop, vocab, datums, length)
        plain = Contender("plain", start("plain", backends[1], False), loop, vocab, datums, length)
        journaled.step(), plain.step()  # warm-up, not counted
        journaled.step_s.clear(), plain.step_s.clear()
        order = [journaled, plain]
        while len(journaled.step_s) < steps:
            for contender in order:
                for _ in range(min(ROUND, steps - len(contender.step_s))):
                    contender.step()
            order.reverse()

        journal = TrainingJournal(settings.redis_url, key_prefix=settings.key_prefix, trainer_id="journaled")
        entries = journal.length("bench-durable")
        journal.close()
        expected_step = steps + 1
        journaled.close()  # the in-memory state is gone; recovery has the checkpoint and the journal
        started = time.perf_counter()
        recovered = start("journaled", backends[0], True)
        recovery_s = time.perf_counter() - started
        channel = grpc.insecure_channel(recovered.address, options=channel_options())
        listed = trainer_pb2_grpc.TrainerServiceStub(channel).ListAdapters(
            trainer_pb2.TrainerServiceListAdaptersRequest())
        step_after = {a.name: a.step for a in listed.adapters}.get("bench-durable")
        channel.close()
        loop.run(recovered.stop(grace=0.5), timeout=60)
        plain.close()
        loop.run(registry.stop(), timeout=60)
        tokens = datums * length
        median_j, median_p = statistics.median(journaled.step_s), statistics.median(plain.step_s)
        mean_j, mean_p = statistics.fmean(journaled.step_s), statistics.fmean(plain.step_s)
        return {
            "model": model, "datums": datums, "tokens_per_datum": length, "steps": steps,
            "checkpoint_every_steps": every, "tokens_per_step": tokens,
            "journaled_step_ms": {"median": median_j * 1e3, "mean": mean_j * 1e3},
            "plain_step_ms": {"median": median_p * 1e3, "mean": mean_p * 1e3},
            "overhead_median": median_j / median_p - 1, "overhead_mean": mean_j / mean_p - 1,
            "journal_entries_at_crash": entries, "recovery_s": recovery_s,
            "recovered_step": step_after, "recovered_exactly": step_after == expected_step,
        }
    finally:
        loop.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=None, help="steps per contender")
    parser.add_argument("--checkpoint-every", type=int, default=None)
    args = parser.parse_args(argv)
    results = {"environment": environment(), "target_overhead": TARGET_OVERHEAD, "models": []}
    for model in [m for m in args.models.split(",") if m]:
        with tempfile.TemporaryDirectory(prefix="lp-bench-durable-") as work:
            results["models"].append(run_model(model, args.steps, args.checkpoint_every, Path(work)))
    path = write_results("trainer_durability", results)
    rows = []
    for r in results["models"]:
        rows.append((r["model"], f"{r['datums']}x{r['tokens_per_datum']}", r["checkpoint_every_steps"],
                     f"{r['plain_step_ms']['median']:.1f} / {r['plain_step_ms']['mean']:.1f}",
                     f"{r['journaled_step_ms']['median']:.1f} / {r['journaled_step_ms']['mean']:.1f}",
                     f"{100 * r['overhead_median']:+.1f}% / {100 * r['overhead_mean']:+.1f}%",
                     r["journal_entries_at_crash"], f"{r['recovery_s']:.2f}",
                     "yes" if r["recovered_exactly"] else "NO"))
    print_table("durable training: journal + checkpoints vs neither (step = ForwardBackward + OptimStep over gRPC)",
                ["model", "batch", "ckpt every", "plain ms (median/mean)", "journaled ms (median/mean)",
                 "overhead (median/mean)", "journal entries", "recovery s", "step recovered"], rows, width=170)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
