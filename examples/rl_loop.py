"""GRPO-style RL on a verifiable toy task (single-digit arithmetic), two tenants at once on one cluster.

Each iteration, per tenant:
  1. publish the current weights (a new version) and get a SamplingClient pinned to it;
  2. sample a group of G completions for each of B problems, keeping the sampler's per-token logprobs;
  3. reward each completion from its first number: 1 if right, partial credit (up to 0.3) if close, else 0;
  4. advantages = reward minus the group mean, divided by the group std (groups with equal rewards carry no signal
     and are dropped);
  5. one `importance_sampling` forward_backward over all completions (loss -Σ exp(lp - q)·A, q = sampler logprob,
     A on completion tokens only) and one AdamW optim_step, submitted back to back (pipelined).

    python examples/rl_loop.py --local                     # embedded cluster on SmolLM2-135M-Instruct
    python examples/rl_loop.py                             # cluster from LORAPLANE_*_ADDRESS / `loraplane up`
    python examples/rl_loop.py --local --model tiny --iterations 3   # plumbing check on the tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient, TrainingClient
from loraplane_cli.product import encode_prompt

NUMBER = re.compile(r"-?\d+")
OPERATIONS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b, "-": lambda a, b: a - b}


@dataclass
class Problem:
    a: int
    b: int
    op: str

    @property
    def answer(self) -> int:
        return OPERATIONS[self.op](self.a, self.b)

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}? Answer with just the number."


def reward(problem: Problem, completion: str) -> tuple[float, bool]:
    """(reward, correct). Verifiable from the first integer in the completion: 1 for the right answer, else partial
    credit for being close (0.3 at distance 0, falling to 0 at distance 5), 0 without a number. The partial credit
    keeps groups from being all-equal (no signal) while the model is still mostly wrong."""
    found = NUMBER.search(completion)
    if not found:
        return 0.0, False
    guess = int(found.group())
    if guess == problem.answer:
        return 1.0, True
    return 0.3 * max(0.0, 1.0 - abs(guess - problem.answer) / 5.0), False


def group_advantages(rewards: list[float]) -> list[float] | None:
    """GRPO: (r - mean) / std within the group; None when every reward is equal (no learning signal)."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    if std < 1e-6:
        return None
    return [(r - mean) / (std + 1e-6) for r in rewards]


def stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return sorted(int(i) for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id)


def rl_datum(prompt: list[int], completion: list[int], sampler_logprobs: list[float], advantage: float) -> Datum:
    """Tinker alignment over prompt + completion: position i predicts token i+1. Prompt targets carry advantage 0
    (no gradient) and logprob 0 (unused there)."""
    tokens = prompt + completion
    n_prompt_targets = len(prompt) - 1
    return Datum(
        model_input=ModelInput(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt_targets + list(sampler_logprobs),
            "advantages": [0.0] * n_prompt_targets + [advantage] * len(completion),
        },
    )


@dataclass
class TenantRun:
    name: str
    op: str
    seed: int
    history: list[dict] = field(default_factory=list)
    error: str = ""


@dataclass
class Rollout:
    """One iteration's samples of one tenant: the replies, their rewards and the datums that carry a signal."""

    prompts: list[list[int]]
    replies: list
    rewards: list[float]
    correct: list[bool]
    data: list[Datum]

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(self.rewards)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


def tenant_clients(service: ServiceClient, tokenizer, run: TenantRun, args
                   ) -> tuple[TrainingClient, SamplingParams, AdamParams]:
    training = service.create_lora_training_client(
        args.model, rank=args.rank, alpha=args.rank, seed=run.seed, name=run.name, exist_ok=True,
        keep_last=4)  # one version per iteration: let the registry drop the old ones
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=stop_ids(tokenizer))
    adam = AdamParams(learning_rate=args.learning_rate, beta1=0.9, beta2=0.999, eps=1e-8)
    return training, params, adam


def rollout(sampler, tokenizer, rng: random.Random, op: str, params: SamplingParams, args) -> Rollout:
    """Steps 2-4: B fresh problems, G samples each from the sampler's version, rewards and GRPO advantages."""
    problems = [Problem(rng.randint(0, 9), rng.randint(0, 9), op) for _ in range(args.problems)]
    prompts = [encode_prompt(tokenizer, p.question) for p in problems]
    futures = [sampler.sample(prompt, args.group_size, dataclasses.replace(params, seed=rng.getrandbits(31)))
               for prompt in prompts]
    batch = Rollout(prompts, [], [], [], [])
    for problem, prompt, future in zip(problems, prompts, futures):
        reply = future.result()
        batch.replies.append(reply)
        scored = [reward(problem, tokenizer.decode(s.tokens, skip_special_tokens=True)) for s in reply.sequences]
        group = [r for r, _ in scored]
        batch.rewards.extend(group)
        batch.correct.extend(c for _, c in scored)
        advantages = group_advantages(group)
        if advantages is None:
            continue
        for sequence, advantage in zip(reply.sequences, advantages):
            if sequence.tokens:
                batch.data.append(rl_datum(prompt, sequence.tokens, sequence.logprobs or [], advantage))
    return batch


def train_on(training: TrainingClient, data: list[Datum], adam: AdamParams) -> float:
    """Step 5; the loss, or NaN when no group carried a signal."""
    if not data:
        return float("nan")
    backward = training.forward_backward(data, "importance_sampling")
    step = training.optim_step(adam)  # pipelined: no wait for the backward's reply
    loss = backward.result().metrics.get("loss:sum", float("nan"))
    step.result()
    return loss


def run_tenant(service: ServiceClient, tokenizer, run: TenantRun, args, print_lock: threading.Lock) -> None:
    rng = random.Random(run.seed)
    training, params, adam = tenant_clients(service, tokenizer, run, args)
    for iteration in range(1, args.iterations + 1):
        started = time.monotonic()
        sampler = training.save_weights_for_sampler(f"iter-{iteration}").result()
        batch = rollout(sampler, tokenizer, rng, run.op, params, args)
        loss = train_on(training, batch.data, adam)
        row = {"iteration": iteration, "version": sampler.version, "mean_reward": batch.mean_reward,
               "accuracy": batch.accuracy, "datums": len(batch.data), "loss": loss,
               "seconds": time.monotonic() - started}
        run.history.append(row)
        with print_lock:
            print(f"{run.name:<18} iter {iteration:>3}  v{sampler.version:<3} reward {row['mean_reward']:.3f}  "
                  f"accuracy {row['accuracy']:.3f}  datums {len(batch.data):>3}  loss {loss:9.3f}  "
                  f"{row['seconds']:.1f}s", flush=True)


def tenant_runs(ops: str) -> list[TenantRun]:
    """One tenant per comma-separated operation."""
    return [TenantRun(f"tenant-{chr(ord('a') + i)}/rl-arith", op, seed=1000 + i)
            for i, op in enumerate(ops.split(","))]


def run_tenants(runs: list[TenantRun], loop: Callable[[TenantRun], None]) -> float:
    """Runs every tenant's loop in its own thread at once; a loop's exception becomes its run's error. Returns the
    wall time."""
    def guarded(run: TenantRun) -> None:
        try:
            loop(run)
        except Exception as exc:  # noqa: BLE001 - reported in the summary and the exit code
            run.error = f"{type(exc).__name__}: {exc}"

    started = time.monotonic()
    threads = [threading.Thread(target=guarded, args=(run,), name=run.name) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def summarize(runs: list[TenantRun], window: int) -> dict:
    summary = {}
    for run in runs:
        rewards = [h["mean_reward"] for h in run.history]
        accuracy = [h["accuracy"] for h in run.history]
        k = max(1, min(window, len(rewards) // 2))
        summary[run.name] = {
            "op": run.op,
            "first_mean_reward": statistics.fmean(rewards[:k]) if rewards else None,
            "last_mean_reward": statistics.fmean(rewards[-k:]) if rewards else None,
            "first_accuracy": statistics.fmean(accuracy[:k]) if accuracy else None,
            "last_accuracy": statistics.fmean(accuracy[-k:]) if accuracy else None,
            "window": k,
            "error": run.error,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local", action="store_true", help="start an embedded cluster in this process")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--problems", type=int, default=4, help="problems per iteration (B)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per problem (G)")
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--ops", default="+,+", help="one operation per tenant, comma-separated (+ - *)")
    parser.add_argument("--window", type=int, default=4, help="iterations averaged for first/last reward")
    parser.add_argument("--out", type=Path, default=Path("rl_results.json"))
    args = parser.parse_args(argv)

    import contextlib

    with contextlib.ExitStack() as stack:
        if args.local:
            from loraplane_cli.demo import embedded_cluster

            cluster = stack.enter_context(embedded_cluster(args.model, on_progress=lambda m: print(f"[cluster] {m}")))
            service = cluster.service_client()
        else:
            service = ServiceClient()
        tokenizer = service.get_tokenizer()
        runs = tenant_runs(args.ops)
        lock = threading.Lock()
        elapsed = run_tenants(runs, lambda run: run_tenant(service, tokenizer, run, args, lock))

    summary = summarize(runs, args.window)
    result = {"model": args.model, "iterations": args.iterations, "problems": args.problems,
              "group_size": args.group_size, "learning_rate": args.learning_rate, "rank": args.rank,
              "seconds": elapsed, "summary": summary, "history": {r.name: r.history for r in runs}}
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out} ({elapsed:.0f}s)")
    return 1 if any(r.error for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
