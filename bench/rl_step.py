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

Two shapes:
  CPU (default): model `tiny`, the torch engine and the torch backend on CPU.
  GPU (--engine sglang --device cuda): random bf16 weights in SmolLM2-135M's real shape (bench/sampler.py's
      `smollm2` shape, written to --model-dir once), the sampler on an SGLang server it launches, the trainer's
      torch backend on CUDA (the trainer service's own dtype: fp32 weights). The engines' own sampling time is
      SGLang driven directly while the cluster is still up: its /generate (bench/stream_clients.py's raw client,
      each group one request of group_size samples, all groups at once, same max_tokens, temperature 1) with the
      newest adapter version the sampler loaded, loaded again from its PEFT directory under a name of its own.
      The trainer side is the torch backend on CUDA after the cluster is down.

    .venv/bin/python bench/rl_step.py [--model tiny] [--steps 3] [--groups 32] [--group-size 16] [--max-tokens 5]
    python3 bench/rl_step.py --engine sglang --device cuda --work-dir /tmp/lp-rl-step --steps 3   # GPU (rl_step.sh)
    .venv/bin/python bench/rl_step.py --engine sglang --sglang-url http://127.0.0.1:P --steps 1  # dry run, no GPU

Sample rows sum over the concurrent calls (the route's own wall time is the SDK column). The trainer orders
optim_step after forward_backward, so its OptimStep RPC time includes that wait.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import re
import shutil
import signal
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
# The adapter rank of the step (the tinker client's, SGLang's --max-lora-rank, the anchors').
RANK = 8
# bench/sampler.py's name for SmolLM2-135M's shape (the issue measured SmolLM2; random weights are fine for speed).
GPU_SHAPE = "smollm2"


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


def prepare_model(args: argparse.Namespace) -> str:
    """--model as given; else `tiny` on CPU, and on a GPU the SmolLM2-135M-shaped random bf16 checkpoint (bench/
    sampler.py writes it with the byte tokenizer: requests carry token ids), kept in --model-dir across runs."""
    if args.model:
        return args.model
    if args.device == "cpu":
        return "tiny"
    from bench.sampler import write_shape_dir

    directory = Path(args.model_dir).resolve()
    write_shape_dir(GPU_SHAPE, directory)
    # The absolute path is the model's name for trainer, sampler and gateway alike, and the --model-path SGLang is
    # launched with (rl_step.sh finds leftover servers by it).
    return str(directory)


def service_commands(args: argparse.Namespace, model: str) -> dict[str, list[str]] | None:
    """The sampler on a launched SGLang server, as tests/production_e2e.py starts it; the trainer stays `python -m
    trainer_svc` (torch backend) on LORAPLANE_DEVICE, in LORAPLANE_TRAINER_DTYPE."""
    if args.engine != "sglang":
        return None
    # A server given by URL (a dry run against bench/synthetic_sglang.py) instead of one launched on the GPU.
    server = ["--sglang-url", args.sglang_url] if args.sglang_url else ["--sglang-launch", "1"]
    sampler = [sys.executable, "-m", "sampler_svc", "--base-model", model, "--engine", "sglang", *server,
               "--sglang-max-lora-rank", str(RANK),
               # SGLang's share of the GPU it shares with the trainer.
               f"--sglang-arg=--mem-fraction-static={args.mem_fraction_static}",
               # Requests carry token ids, and the random model samples ids past the byte tokenizer's 261: SGLang
               # must not detokenize them (bench/sampler.py's smollm2 shape runs the same way).
               "--sglang-arg=--skip-tokenizer-init"]
    if args.sglang_eager:
        sampler.append("--sglang-arg=--disable-cuda-graph")
    return {"sampler": sampler}


def trainer_dtype(args: argparse.Namespace) -> str:
    return "float32" if args.device == "cpu" else "bfloat16"


def run(args: argparse.Namespace, model: str, workdir: Path) -> dict:
    import random

    import tinker

    steps, groups, group_size, max_tokens = args.steps, args.groups, args.group_size, args.max_tokens
    settings = Settings(data_dir=workdir, base_model=model)
    gateway_metrics = free_port()
    env = {"LORAPLANE_BASE_MODEL": model, "TINKER_TELEMETRY": "0",
           "LORAPLANE_GATEWAY_METRICS_PORT": str(gateway_metrics)}
    if args.device != "cpu":
        env["LORAPLANE_DEVICE"] = args.device  # the trainer's torch backend (and a torch engine's) on the GPU
    # Its base weights in bf16 on a GPU (its LoRA state stays fp32), as a user's PEFT loop runs there.
    env["LORAPLANE_TRAINER_DTYPE"] = trainer_dtype(args)
    started = time.perf_counter()
    state, _started = start_cluster(settings, extra_env=env, gateway=True, commands=service_commands(args, model),
                                    on_progress=lambda m: print(f"[cluster +{time.perf_counter() - started:.0f}s] {m}",
                                                                flush=True))
    startup_s = time.perf_counter() - started
    print(f"[cluster] up in {startup_s:.0f} s", flush=True)
    sglang_times, anchor_version = None, ""
    try:
        metrics = {c.name: c.metrics for c in state.components if getattr(c, "metrics", None)}
        metrics["gateway"] = f"http://127.0.0.1:{gateway_metrics}/metrics"
        service = tinker.ServiceClient(base_url=state.component("gateway").endpoint, api_key="tml-bench")
        training = service.create_lora_training_client(base_model=model, rank=RANK, seed=0).result()
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
            print(f"step {step}{' (warm-up)' if not step else ''}: {1000 * wall:.0f} ms, "
                  + ", ".join(f"{k} {1000 * v:.0f}" for k, v in times.items()), flush=True)
            if step:
                rows.append({"step": step, "wall_s": round(wall, 4), "datums": len(data),
                             "sdk_route_s": {k: round(v, 4) for k, v in times.items()}, "server_rpc_s": server})
        if args.engine == "sglang":
            # SGLang alone, on the cluster's own server (same flags, same GPU beside the idle trainer), while it is up.
            url, adapter_dir, anchor_version = sglang_target(state, workdir)
            print(f"engines' own sampling: SGLang {url} directly, {anchor_version} (the last step's) from {adapter_dir}",
                  flush=True)
            with _spawn_pool() as pool:
                sglang_times = pool.submit(sglang_sample_anchor, url, str(adapter_dir), steps, groups, group_size,
                                           max_tokens, prompts).result()
    finally:
        stop_cluster(state)
    lengths = [len(d.model_input.to_ints()) for d in data]
    # In a fresh process, as each service runs in its own: this one's SDK threads slow torch down many times over.
    with _spawn_pool() as pool:
        engines = pool.submit(engines_anchor, model, args.device, trainer_dtype(args), steps, groups, group_size,
                              max_tokens, prompts,
                              lengths, sglang_times).result()
    return {"model": model, "engine": args.engine, "device": args.device, "groups": groups,
            "group_size": group_size, "max_tokens": max_tokens, "rank": RANK, "cluster_startup_s": round(startup_s, 1),
            "sglang": ({"mem_fraction_static": args.mem_fraction_static, "cuda_graph": not args.sglang_eager,
                        "url": args.sglang_url or "launched", "anchor_version": anchor_version}
                       if args.engine == "sglang" else None),
            "steps": rows, "engines": engines, "environment": environment()}


def _spawn_pool() -> concurrent.futures.ProcessPoolExecutor:
    return concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


def sglang_target(state, data_dir: Path) -> tuple[str, Path, str]:
    """The SGLang server the cluster's sampler launched, and a copy of the PEFT directory of the newest adapter
    version on it (the last step's): the sampler loads each version as `<adapter>@v<N>` from data_dir/sglang/
    adapters (sampler_svc/engines/sglang_transport.py, the file transport of a server it launched)."""
    from loraplane.client.addresses import client_security
    from loraplane.rpc import sync_channel
    from loraplane.v1 import sampler_pb2, sampler_pb2_grpc

    channel = sync_channel(state.component("sampler").endpoint, client_security(data_dir))
    try:
        status = sampler_pb2_grpc.SamplerServiceStub(channel).GetStatus(sampler_pb2.GetStatusRequest(), timeout=30)
    finally:
        channel.close()
    if not status.engine_servers:
        raise RuntimeError("the sampler names no SGLang server (GetStatus.engine_servers is empty)")
    url = status.engine_servers[0]
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
        models = json.load(reply).get("data", [])
    versions = {m["id"]: int(match.group(1)) for m in models
                if m.get("parent") and (match := re.search(r"@v(\d+)$", m.get("id", "")))}
    if not versions:
        raise RuntimeError(f"no adapter version loaded on SGLang {url}: /v1/models lists {[m.get('id') for m in models]}")
    newest = max(versions, key=versions.get)
    # SGLang lists a LoRA's path as its root; the transport's own naming where it does not.
    root = next((m.get("root") or "" for m in models if m["id"] == newest), "")
    source = (Path(root) if root and Path(root).is_dir()
              else Path(state.data_dir) / "sglang" / "adapters" / newest.replace("/", "__"))
    if not (source / "adapter_config.json").is_file():
        raise RuntimeError(f"{newest} is loaded on SGLang but its PEFT directory {source} is not there")
    # A copy of its own: the sampler removes its directory when it unloads the version.
    target = data_dir / "anchor-adapter"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return url, target, newest


def sglang_sample_anchor(url: str, adapter_dir: str, steps: int, groups: int, group_size: int, max_tokens: int,
                         prompts: list[list[int]]) -> list[float]:
    """Every group's rollouts from SGLang's /generate directly, all groups at once (one request of group_size
    samples per group, as a user of SGLang sends them), with the adapter loaded from `adapter_dir` under the raw
    client's name for adapter 0; steps + 1 rounds, the first a warm-up. Seconds per measured round."""
    from bench.stream_clients import Raw, adapter_key

    name = adapter_key(0)

    async def post(raw, path: str, body: dict) -> None:
        async with raw.session.post(f"{url}{path}", json=body) as reply:
            text = await reply.text()
            if reply.status != 200 or '"success":false' in text.replace(" ", ""):
                raise RuntimeError(f"SGLang {path} failed with HTTP {reply.status}: {text[:500]}")

    async def rounds() -> list[float]:
        raw = Raw(url)
        try:
            await post(raw, "/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir})
            times = []
            for _ in range(steps + 1):
                start = time.perf_counter()
                tokens = await asyncio.gather(*(raw.unary(0, p, max_tokens, group_size) for p in prompts[:groups]))
                times.append(time.perf_counter() - start)
                if sum(tokens) < groups * group_size:
                    raise RuntimeError(f"SGLang returned {sum(tokens)} tokens for {groups * group_size} rollouts")
            await post(raw, "/unload_lora_adapter", {"lora_name": name})
            return times[1:]
        finally:
            await raw.close()

    return asyncio.run(rounds())


def engines_anchor(model: str, device: str, dtype: str, steps: int, groups: int, group_size: int, max_tokens: int,
                   prompts: list[list[int]], lengths: list[int], sample_times: list[float] | None = None) -> list[dict]:
    """The same work on the engines alone, in this process: the sampler's engine generating every group's rollouts
    at once (one request per group, as the service hands them over, all queued together), and the trainer backend's
    forward_backward of the same datums + optim_step on one adapter. `sample_times`: the sampling already measured
    on SGLang (sglang_sample_anchor); without them the torch engine samples here."""
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
    cuda = device.startswith("cuda")

    def synchronize() -> None:
        if cuda:  # kernels run asynchronously: a step's time is until the GPU has finished it
            torch.cuda.synchronize()

    async def sample_all(engine) -> None:
        options = SamplingOptions(max_tokens=max_tokens, temperature=1.0)

        async def one(prompt):
            request = GenerationRequest(prompt_tokens=tuple(prompt), options=options, num_samples=group_size,
                                        adapter_key="anchor@v1")
            async for _update in engine.generate(request):
                pass

        await asyncio.gather(*(one(p) for p in prompts[:groups]))

    async def sampler_rounds() -> list[float]:
        engine = TorchEngine(model, device=device)  # the sampler service's defaults (max_batch_rows 16)
        await engine.start()
        try:
            await engine.load_adapter("anchor@v1", random_adapter_blob(engine.base, seed=1, rank=RANK))
            times = []
            for _ in range(steps + 1):
                start = time.perf_counter()
                await sample_all(engine)
                synchronize()
                times.append(time.perf_counter() - start)
            return times[1:]
        finally:
            await engine.stop()

    if sample_times is None:
        sample_times = asyncio.run(sampler_rounds())

    # As the trainer service builds it (trainer_svc/backends/__init__.py: the model, device and --dtype).
    backend = TorchBackend(model, device=device, dtype=getattr(torch, dtype))
    # Tinker's alpha 32 and every target the model offers, as the gateway's create_model gives it.
    spec = LoraSpec.create(RANK, 32.0, seed=0, available=list(backend.description.module_dims))
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
        synchronize()
        fb = time.perf_counter() - start
        backend.optim_step(state, AdamHyper(learning_rate=1e-4))
        synchronize()
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


def _exit_on_sigterm(_signum, _frame) -> None:
    # A timeout's SIGTERM unwinds like an error, so the cluster (and the SGLang server its sampler launched) is
    # stopped on the way out instead of left running.
    raise SystemExit(143)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="",
                        help="base model (default: tiny on CPU; on a GPU random bf16 weights in SmolLM2-135M's shape, "
                             "written to --model-dir)")
    parser.add_argument("--engine", choices=["torch", "sglang"], default="torch",
                        help="the sampler's engine (sglang: a server the sampler launches; needs --device cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="the trainer's torch backend (and a torch engine's) device")
    parser.add_argument("--model-dir", default="/tmp/lp-rl-step-smollm2",
                        help="where the GPU shape's random SmolLM2-135M-shaped checkpoint is written (kept across runs)")
    parser.add_argument("--work-dir", default="",
                        help="the cluster's data dir, emptied first (logs, SGLang's server log under sglang/); "
                             "default: a temporary directory")
    parser.add_argument("--mem-fraction-static", type=float, default=0.4,
                        help="SGLang's share of the GPU it shares with the trainer")
    parser.add_argument("--sglang-eager", action="store_true", help="SGLang without CUDA graphs")
    parser.add_argument("--sglang-url", default="",
                        help="--engine sglang on a running server instead of one the sampler launches (a dry run of "
                             "the GPU shape's plumbing: python bench/synthetic_sglang.py --port P, then --engine "
                             "sglang --sglang-url http://127.0.0.1:P)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=5)
    args = parser.parse_args()
    if args.engine == "sglang" and args.device == "cpu" and not args.sglang_url:
        parser.error("--engine sglang launches its server on the GPU the trainer uses: add --device cuda")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    model = prepare_model(args)
    if args.work_dir:
        work = Path(args.work_dir).resolve()
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        results = run(args, model, work)
    else:
        with tempfile.TemporaryDirectory(prefix="lp-rl-step-") as work:
            results = run(args, model, Path(work))
    results["summary"] = summarize(results)
    name = "rl_step" if (args.engine, args.device) == ("torch", "cpu") else f"rl_step_{args.engine}_{args.device}"
    path = write_results(name, results)
    print_summary(results["summary"])
    print(f"results: {path}")


if __name__ == "__main__":
    main()
