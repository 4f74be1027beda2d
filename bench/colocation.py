"""Co-located services on one CPU host: a tenant's sample alone, and while another tenant trains (issue 31 item 8).

Starts a local cluster as `loraplane up` does (Valkey, SeaweedFS, registry, trainer and sampler processes), then
times an 8-token greedy sample of the base model alone, then the same sample while another tenant's adapter trains
without pause (forward_backward + optim_step, batch 4 x 32 tokens, rank 16), and the training steps' time alone
and under sampling. The ratio contended / alone is the number that matters: each service used to run torch on
every core, so the two oversubscribed the host and the sample took 15-25x longer.

    python bench/colocation.py                    # each service gets its share of the cores (the default)
    python bench/colocation.py --threads 2        # LORAPLANE_TORCH_THREADS=2 for both: on a 2-core host, the
                                                  # old behaviour (torch's default, every core per service)

Prints a table and JSON; writes bench/results/colocation[-threads-N].json. Its numbers depend on what else runs
on the host (`environment.load_average_1m` in the JSON says how busy it was).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, print_table, write_results
from loraplane.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from loraplane.config import Settings
from loraplane.threads import THREADS_ENV, host_cores
from loraplane_cli.local_cluster import start_cluster, stop_cluster

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _sample_seconds(sampler, prompt: list[int], count: int, tokens: int) -> list[float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        sampler.sample(prompt, 1, params).result()
        seconds.append(time.perf_counter() - started)
    return seconds


class Trainer(threading.Thread):
    """Trains one adapter step after step until stopped, recording each step's wall time."""

    def __init__(self, training, batch: list[Datum]):
        super().__init__(name="colocation-trainer", daemon=True)
        self.training, self.batch = training, batch
        self.steps: list[tuple[float, float]] = []  # (start, end)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        adam = AdamParams(learning_rate=1e-4)
        try:
            while not self.stop.is_set():
                started = time.perf_counter()
                backward = self.training.forward_backward(self.batch, "cross_entropy")
                step = self.training.optim_step(adam)
                backward.result()
                step.result()
                self.steps.append((started, time.perf_counter()))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def step_seconds(self, start: float, end: float) -> list[float]:
        return [b - a for a, b in self.steps if a >= start and b <= end]


def measure(model: str, threads: int, samples: int, tokens: int, warm_steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="loraplane-colocation-") as root:
        settings = Settings(data_dir=Path(root) / "cluster", base_model=model, redis_url="", s3_endpoint="")
        extra = {"LORAPLANE_BASE_MODEL": model}
        if threads:
            extra[THREADS_ENV] = str(threads)
        state, _ = start_cluster(settings, extra_env=extra, gateway=False)
        try:
            service = ServiceClient(data_dir=settings.data_dir)
            tokenizer = service.get_tokenizer()
            prompt = [int(t) for t in tokenizer.encode(PROMPT)]
            sampler = service.create_sampling_client()
            _sample_seconds(sampler, prompt, 2, tokens)  # warm-up: first-call allocations, the KV cache
            alone = _sample_seconds(sampler, prompt, samples, tokens)

            rng = random.Random(0)
            vocab = len(tokenizer)
            batch = []
            for _ in range(4):
                ids = [rng.randrange(vocab) for _ in range(33)]
                batch.append(Datum(ModelInput(ids[:-1]), {"target_tokens": ids[1:], "weights": [1.0] * 32}))
            training = service.create_lora_training_client(model, rank=16, seed=0, name="acme/colocation")
            trainer = Trainer(training, batch)
            trainer.start()
            while len(trainer.steps) < warm_steps and trainer.error is None:
                time.sleep(0.05)
            solo_start = time.perf_counter()
            while len(trainer.steps) < warm_steps + 4 and trainer.error is None:
                time.sleep(0.05)
            contended_start = time.perf_counter()
            contended = _sample_seconds(sampler, prompt, samples, tokens)
            contended_end = time.perf_counter()
            trainer.stop.set()
            trainer.join()
            if trainer.error is not None:
                raise trainer.error
            train_alone = trainer.step_seconds(solo_start, contended_start)
            train_contended = trainer.step_seconds(contended_start, contended_end + 60)
        finally:
            stop_cluster(state)
    median_alone, median_contended = statistics.median(alone), statistics.median(contended)
    return {
        "model": model, "torch_threads": threads or "cluster share", "cores": host_cores(), "tokens": tokens,
        "sample_alone_s": [round(s, 3) for s in alone],
        "sample_while_training_s": [round(s, 3) for s in contended],
        "sample_alone_median_s": round(median_alone, 3),
        "sample_while_training_median_s": round(median_contended, 3),
        "sample_ratio": round(median_contended / median_alone, 2),
        "train_step_alone_median_s": round(statistics.median(train_alone), 3) if train_alone else None,
        "train_step_while_sampling_median_s": round(statistics.median(train_contended), 3)
        if train_contended else None,
        "environment": environment(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=0,
                        help="LORAPLANE_TORCH_THREADS for every service (0: the cluster's per-service share)")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--warm-steps", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure(args.model, args.threads, args.samples, args.tokens, args.warm_steps)
    name = "colocation" + (f"-threads-{args.threads}" if args.threads else "")
    path = write_results(name, result)
    print_table(f"colocation ({result['model']}, {result['cores']} cores, threads: {result['torch_threads']})",
                ["measure", "alone", "while the other tenant works", "ratio"], [
                    ["8-token sample (median s)", result["sample_alone_median_s"],
                     result["sample_while_training_median_s"], result["sample_ratio"]],
                    ["training step (median s)", result["train_step_alone_median_s"],
                     result["train_step_while_sampling_median_s"], ""]])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
