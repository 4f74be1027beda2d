"""One cookbook `math_rl` step through the gateway, timed end to end and broken down by where the time goes.

The step has the recipe's shape (tinker-cookbook rl/train.py, sync): save_weights_and_get_sampling_client, then
`groups` sample requests of num_samples=`group_size` rollouts of <= `max_tokens` tokens (all in flight at once, as
the recipe gathers them), group-centred advantages, one forward_backward("importance_sampling") over every
rollout and one optim_step. It runs on `loraplane up`'s local cluster (real processes on loopback) with the
official tinker SDK.

Per step it reports: the wall time; the SDK-side time of each route (submit + retrieve_future until the result);
the gateway's own time per HTTP route and per future (its /metrics, LORAPLANE_GATEWAY_METRICS_PORT); the services'
handling time of each RPC (their /metrics); all from the existing loraplane_rpc_seconds histograms, scraped before
and after the step. Then the engines' own time for the same work, in a fresh process with the threads each service
gets here: the sampler's engine generating every group's rollouts (all queued at once) and the trainer backend's
forward_backward of the same datum lengths + optim_step, called directly. ours / engines is the step's ratio.

    .venv/bin/python bench/rl_step.py [--model tiny] [--steps 3] [--groups 32] [--group-size 16] [--max-tokens 5]

Sample rows sum over the concurrent calls (the route's own wall time is the SDK column). The trainer orders
optim_step after forward_backward, so its OptimStep RPC time includes that wait.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import re
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment, print_table, write_results
from loraplane.config import Settings
from loraplane.local.processes import free_port
from loraplane.threads import host_cores, thread_shares
from loraplane_cli.local_cluster import start_cluster, stop_cluster

_SUM = re.compile(r'^loraplane_rpc_seconds_sum\{([^}]*)\}\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def rpc_seconds(metrics_urls: dict[str, str]) -> dict[str, float]:
    """Cumulative server-side seconds per "<service>.<method>" across the services."""
    totals: dict[str, float] = defaultdict(float)
    for url in metrics_urls.values():
        with urllib.request.urlopen(url, timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                match = _SUM.match(line)
                if match:
                    labels = dict(_LABEL.findall(match.group(1)))
                    totals[f"{labels.get('service', '?')}.{labels.get('method', '?')}"] += float(match.group(2))
    return dict(totals)


async def one_step(training, step: int, groups: int, group_size: int, max_tokens: int, prompts: list[list[int]]):
    from tinker import types

    times: dict[str, float] = {}

    async def timed(name: str, coro):
        start = time.perf_counter()
        result = await coro
        times[name] = times.get(name, 0.0) + time.perf_counter() - start
        return result

    sampling = await timed("save_weights_for_sampler", training.save_weights_and_get_sampling_client(
        name=f"step-{step}"))
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    start = time.perf_counter()
    results = await asyncio.gather(*(sampling.sample(types.ModelInput.from_ints(p), group_size, params)
                                     for p in prompts[:groups]))
    times["sample"] = time.perf_counter() - start
    data = []
    for prompt, result in zip(prompts, results):
        rewards = [float(sum(s.tokens) % 2) for s in result.sequences]  # a stand-in grader: cheap, deterministic
        mean = sum(rewards) / len(rewards)
        for seq, reward in zip(result.sequences, rewards):
            tokens = prompt + list(seq.tokens)
            n = len(tokens) - 1
            gen = len(seq.tokens)
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:],
                                "logprobs": [0.0] * (n - gen) + list(seq.logprobs or [0.0] * gen),
                                "advantages": [0.0] * (n - gen) + [reward - mean] * gen}))
    # The recipe's order: both submitted, then both awaited (optim_step's time is what is left after fwd/bwd).
    start = time.perf_counter()
    fwdbwd = training.forward_backward(data, "importance_sampling")
    optim = training.optim_step(types.AdamParams(learning_rate=1e-4))
    await fwdbwd
    times["forward_backward"] = time.perf_counter() - start
    await optim
    times["optim_step"] = time.perf_counter() - start - times["forward_backward"]
    return times, data


def run(model: str, steps: int, groups: int, group_size: int, max_tokens: int, workdir: Path) -> dict:
    import random

    import tinker

    settings = Settings(data_dir=workdir, base_model=model)
    gateway_metrics = free_port()
    state, _started = start_cluster(settings, extra_env={"LORAPLANE_BASE_MODEL": model, "TINKER_TELEMETRY": "0",
                                                         "LORAPLANE_GATEWAY_METRICS_PORT": str(gateway_metrics)},
                                    gateway=True)
    try:
        metrics = {c.name: c.metrics for c in state.components if getattr(c, "metrics", None)}
        metrics["gateway"] = f"http://127.0.0.1:{gateway_metrics}/metrics"
        service = tinker.ServiceClient(base_url=state.component("gateway").endpoint, api_key="tml-bench")
        training = service.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        rng = random.Random(0)
        prompts = [[rng.randrange(5, 200) for _ in range(24)] for _ in range(groups)]
        rows = []
        for step in range(steps + 1):  # step 0 warms up (first version load, compilation caches)
            before = rpc_seconds(metrics)
            start = time.perf_counter()
            times, data = asyncio.run(one_step(training, step, groups, group_size, max_tokens, prompts))
            wall = time.perf_counter() - start
            after = rpc_seconds(metrics)
            server = {k: round(after[k] - before.get(k, 0.0), 4) for k in after if after[k] - before.get(k, 0.0) > 0}
            if step:
                rows.append({"step": step, "wall_s": round(wall, 4), "datums": len(data),
                             "sdk_route_s": {k: round(v, 4) for k, v in times.items()}, "server_rpc_s": server})
    finally:
        stop_cluster(state)
    # In a fresh process, as each service runs in its own: this one's SDK threads slow torch down many times over.
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        engines = pool.submit(engines_anchor, model, steps, groups, group_size, max_tokens, prompts,
                              [len(d.model_input.to_ints()) for d in data]).result()
    return {"model": model, "groups": groups, "group_size": group_size, "max_tokens": max_tokens,
            "steps": rows, "engines": engines, "environment": environment()}


def engines_anchor(model: str, steps: int, groups: int, group_size: int, max_tokens: int,
                   prompts: list[list[int]], lengths: list[int]) -> list[dict]:
    """The same work on the engines alone, in this process: the sampler's engine generating every group's rollouts
    at once (one request per group, as the service hands them over, all queued together), and the trainer backend's
    forward_backward of the same datums + optim_step on one adapter."""
    import random

    import torch

    from bench.common import random_adapter_blob
    from loraplane.lora import LoraSpec
    from sampler_svc.engines.base import GenerationRequest, SamplingOptions
    from sampler_svc.engines.torch_engine import TorchEngine
    from trainer_svc.backends.base import BatchItem, DatumInput
    from trainer_svc.backends.torch_backend import TorchBackend
    from trainer_svc.optimizer import AdamHyper
    from trainer_svc.pool import AdapterState

    # Each engine with the threads its service gets on this host (`loraplane up` splits the cores between them).
    torch.set_num_threads(thread_shares(host_cores(), 2)[-1])

    async def sample_all(engine) -> None:
        options = SamplingOptions(max_tokens=max_tokens, temperature=1.0)

        async def one(prompt):
            request = GenerationRequest(prompt_tokens=tuple(prompt), options=options, num_samples=group_size,
                                        adapter_key="anchor@v1")
            async for _update in engine.generate(request):
                pass

        await asyncio.gather(*(one(p) for p in prompts[:groups]))

    async def sampler_rounds() -> list[float]:
        engine = TorchEngine(model)  # the sampler service's defaults (max_batch_rows 16)
        await engine.start()
        try:
            await engine.load_adapter("anchor@v1", random_adapter_blob(engine.base, seed=1, rank=8))
            times = []
            for _ in range(steps + 1):
                start = time.perf_counter()
                await sample_all(engine)
                times.append(time.perf_counter() - start)
            return times[1:]
        finally:
            await engine.stop()

    sample_times = asyncio.run(sampler_rounds())

    backend = TorchBackend(model)
    # Tinker's alpha 32 and every target the model offers, as the gateway's create_model gives it.
    spec = LoraSpec.create(8, 32.0, seed=0, available=list(backend.description.module_dims))
    # Leaves that take gradients, as the trainer's pool makes them: without requires_grad the backend's loss has
    # no graph and its "forward_backward" is a forward alone (the anchor measured 132 ms for ~1 s of work).
    params = {k: v.requires_grad_(True) for k, v in backend.init_params(spec).items()}
    state = AdapterState(name="anchor", spec=spec, base_model=model, params=params,
                         exp_avg={k: torch.zeros_like(v) for k, v in params.items()},
                         exp_avg_sq={k: torch.zeros_like(v) for k, v in params.items()}, resident=True)
    rng = random.Random(1)
    data = []
    for n in lengths:
        tokens = torch.tensor([rng.randrange(5, 200) for _ in range(n + 1)])
        data.append(DatumInput(input_tokens=tokens[:-1], target_tokens=tokens[1:],
                               logprobs=torch.zeros(n), advantages=torch.full((n,), 0.5)))
    rows = []
    for i in range(steps + 1):
        start = time.perf_counter()
        backend.run([BatchItem(state, data, "importance_sampling", {})], backward=True)
        fb = time.perf_counter() - start
        backend.optim_step(state, AdamHyper(learning_rate=1e-4))
        optim = time.perf_counter() - start - fb
        if i:
            rows.append({"sample_s": round(sample_times[i - 1], 4), "forward_backward_s": round(fb, 4),
                         "optim_step_s": round(optim, 4),
                         "total_s": round(sample_times[i - 1] + fb + optim, 4)})
    backend.close()
    return rows


# Each route of the step and the service RPCs that do its work (the rest of the route's time is ours outside the
# services: SDK, HTTP, the gateway's conversion, its futures in Redis, the gRPC hop).
ROUTE_RPCS = {
    "save_weights_for_sampler": ("TrainerService.PublishWeights",),
    "sample": ("SamplerService.Sample",),
    "forward_backward": ("TrainerService.ForwardBackward",),
    "optim_step": ("TrainerService.OptimStep",),
}
# The gateway's future that does each route's work (loraplane_rpc_seconds{service="gateway"}).
ROUTE_FUTURES = {"save_weights_for_sampler": "gateway.future:save_for_sampler", "sample":
                 "gateway.future:sample", "forward_backward": "gateway.future:fwdbwd",
                 "optim_step": "gateway.future:optim"}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def summarize(results: dict) -> dict:
    """Medians over the measured steps: ours per route, the services' own share, the engines' own time."""
    steps, engines = results["steps"], results["engines"]
    routes = {}
    for route, rpcs in ROUTE_RPCS.items():
        ours = _median([r["sdk_route_s"].get(route, 0.0) for r in steps])
        server = _median([sum(r["server_rpc_s"].get(k, 0.0) for k in rpcs) for r in steps])
        future = _median([r["server_rpc_s"].get(ROUTE_FUTURES[route], 0.0) for r in steps])
        routes[route] = {"ours_s": round(ours, 4), "gateway_future_s": round(future, 4),
                         "service_rpc_s": round(server, 4)}
    engine = {k: round(_median([e[k] for e in engines]), 4) for k in engines[0]} if engines else {}
    routes["sample"]["engine_s"] = engine.get("sample_s", 0.0)
    routes["forward_backward"]["engine_s"] = engine.get("forward_backward_s", 0.0)
    routes["optim_step"]["engine_s"] = engine.get("optim_step_s", 0.0)
    routes["save_weights_for_sampler"]["engine_s"] = 0.0  # the engines need no publish: weights never leave them
    wall = _median([r["wall_s"] for r in steps])
    other = {k: round(_median([r["server_rpc_s"].get(k, 0.0) for r in steps]), 4)
             for k in sorted({k for r in steps for k in r["server_rpc_s"]})
             if not any(k in rpcs for rpcs in ROUTE_RPCS.values()) and k not in ROUTE_FUTURES.values()}
    return {"wall_s": round(wall, 4), "engines_s": engine.get("total_s", 0.0),
            "ratio": round(wall / engine["total_s"], 2) if engine.get("total_s") else None,
            "routes": routes, "other_rpcs_s": other}


def print_summary(summary: dict) -> None:
    ms = lambda s: f"{1000 * s:.1f}"
    rows = [[route, ms(r["ours_s"]), ms(r["gateway_future_s"]), ms(r["service_rpc_s"]), ms(r["engine_s"])]
            for route, r in summary["routes"].items()]
    rows.append(["step (wall)", ms(summary["wall_s"]), "", "", ms(summary["engines_s"])])
    print_table(f"math_rl step, median ms: ours / engines' own = {summary['ratio']}x (sample: summed over "
                "concurrent calls)", ["route", "ours (SDK)", "gateway future", "service RPC", "engine"], rows)
    if summary["other_rpcs_s"]:
        print_table("other time inside the step (gateway routes, other RPCs; ms summed over calls)", ["rpc", "ms"],
                    [[k, ms(v)] for k, v in summary["other_rpcs_s"].items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lp-rl-step-") as work:
        results = run(args.model, args.steps, args.groups, args.group_size, args.max_tokens, Path(work))
    results["summary"] = summarize(results)
    path = write_results("rl_step", results)
    print_summary(results["summary"])
    print(f"results: {path}")


if __name__ == "__main__":
    main()
