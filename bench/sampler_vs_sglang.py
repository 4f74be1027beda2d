"""The sampler against the SGLang server it wraps, side by side in one run (GPU machine with SGLang installed).

One SGLang server (launched here, LoRA on, CUDA graphs on unless --disable-cuda-graph) serves four paths, driven
alternately with the same request mix:
  raw     an aiohttp client posting straight to SGLang's /generate (what a user would run instead of loraplane);
  engine  loraplane's SGLangEngine in this process (`generate`, what the Sample RPC calls; throughput only);
  grpc    the full path through bare grpc.aio stubs on one connection ("stubs"): a `sampler_svc` process (SGLang
          engine, attached to the same server, following a real registry on Valkey + SeaweedFS);
  client  the same sampler_svc through loraplane.client's SamplingClient (`sample_async`, `sample_stream_async`).
raw, stubs and client each run in a process of their own (bench/stream_clients.py). Concurrency 16 / 64 / 256,
adapter mixes base / one adapter / 8 adapters (--mixes), num_samples 8 at 64 with --multi-sample. Throughput is
generated tokens per second of wall time (prefill included) of non-streaming calls; latency is measured on the
streaming forms (SGLang `stream: true` vs SampleStream), 8 adapters: TTFT, ITL (gaps between a stream's
consecutive messages), TPOT, tokens per message, and the sampler process's CPU per token and CPU s/s (near 1.0:
its event loop is saturated).

The streaming rows also run `stubs_old`: a second sampler_svc on the same SGLang server with its streams read on its
serving loop (LORAPLANE_SGLANG_STREAM_READERS=0), while the first reads them in --stream-readers helper processes
(sampler_svc/engines/sglang_streams.py). Both serve the same adapter versions under the same SGLang names, loaded from
the same bytes (a sampler drops what it finds on its servers as it starts, so they start one after the other, each
loading everything before the next starts). --no-old-path leaves it out.

--two-servers (a machine with 2 GPUs): SGLang servers on GPU 0 and GPU 1, and two samplers side by side: `one`
(sampler_svc with the GPU 0 server) and `two` (ONE sampler_svc with both servers: what an operator runs on one
2-GPU host, `sampler_svc --sglang-launch 2`; each adapter version lives on one server, placed on the emptier one),
with raw SGLang on GPU 0 for reference, alternated: tokens/s of Sample and of streams at --concurrency (default 256)
over 8 adapters, and two / one (issue 23's target: >= 1.8). `raw2`, raw SGLang over both servers (odd adapters to
GPU 1's server, where `two` puts them), is the engine's own two-GPU ceiling: two / raw2 is what the sampler leaves.

--two-servers --fleet: the production answer on a 2-GPU host, a sampler fleet (README "More than one sampler"):
replicas `fleet-a` (GPU 0's server) and `fleet-b` (GPU 1's), each a sampler_svc of its own in fleet `bench-fleet`
(membership in the bench's Valkey, every replica preloading all eight versions), against `one` (GPU 0's server, not
in a fleet), with raw SGLang on GPU 0 and raw2 over both servers (both hold all eight; left out with a note if
not), alternated. `one` and `fleet` both go through the SamplingClient (bench/stream_clients.py `client`), seeded
with one's / fleet-a's address: for `fleet` the client lists the replicas and routes each adapter (consistent
hashing with bounded load). Rows give fleet / one (issue 23: >= 1.8), fleet / raw2, each sampler's CPU s/s (the
fleet's per replica) and the Sample/SampleStream calls each replica served (its Prometheus counters). The existing
samplers `one`/`two` of --two-servers are not started in this mode.

    python bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b [--rounds 2]
    python bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b --two-servers [--fleet]
    python bench/sampler_vs_sglang.py --model-dir tiny --synthetic-itl-ms 10   # a dry run without a GPU
    python bench/sampler_vs_sglang.py --model-dir tiny --synthetic-itl-ms 10 --two-servers --fleet --concurrency 32

Writes JSON (bench/results/sampler_vs_sglang.json) and prints a table. Random weights in the real shape; rank-16
adapters on all seven projections with random B.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


import torch

from bench.common import children_cpu_seconds, cpu_seconds, random_adapter_blob, rotation
from bench.stream_clients import PATHS as CLIENT_PATHS
from bench.stream_clients import Worker
from loraplane.config import Settings
from loraplane.local.processes import free_port, seaweed_s3_server, valkey_server, wait_until
from loraplane.models import load_base_model
from loraplane.registry_client import RegistryClient
from loraplane.rpc import BackgroundLoop, check_health, quiet_grpc_poller
from loraplane.v1 import common_pb2
from registry_svc.server import start_registry_server
from sampler_svc.engines.base import GenerationRequest, SamplingOptions
from sampler_svc.engines.sglang_engine import SGLangEngine

SHAPES = {
    # Llama-3.2-1B: 16 layers, d 2048, GQA 32/8, MLP 8192, vocab 128256, tied embeddings.
    "llama1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
                    "max_position_embeddings": 8192, "rope_theta": 500000.0},
}
ADAPTERS = 8
RANK = 16


def build_model(shape: str, directory: Path) -> None:
    """A random-weight bf16 Llama of the named shape, saved with a small byte-level tokenizer (requests carry
    token ids, so the tokenizer only has to exist)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraplane.models.tiny import build_tiny_tokenizer

    if (directory / "config.json").is_file():
        return
    config = LlamaConfig(**SHAPES[shape], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(directory)
    del model
    torch.cuda.empty_cache()  # the memory goes to the SGLang server started next


class Mix:
    """Which adapter each request uses: none, always the first, or round-robin over all eight."""

    def __init__(self, name: str):
        self.name = name

    def adapter(self, index: int) -> int | None:
        return None if self.name == "base" else 0 if self.name == "one" else index % ADAPTERS


def key_of(adapter: int | None) -> str | None:
    return None if adapter is None else f"bench/a{adapter}@v1"


async def run_engine(engine: SGLangEngine, prompts, mix: Mix, num_samples: int, max_tokens: int,
                     concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    options = SamplingOptions(max_tokens=max_tokens, temperature=1.0)

    async def one(index: int, prompt: list[int]) -> int:
        request = GenerationRequest(prompt_tokens=tuple(prompt), options=options, num_samples=num_samples,
                                    adapter_key=key_of(mix.adapter(index)))
        async with gate:
            return sum([len(update.tokens) async for update in engine.generate(request)])

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def worker_requests(prompts, mix: Mix) -> list:
    """The request list of a bench/stream_clients.py command (adapter index, -1 for the base model)."""
    adapters = [mix.adapter(i) for i in range(len(prompts))]
    return [[-1 if a is None else a, p] for a, p in zip(adapters, prompts, strict=True)]


LATENCY_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tok_s",
                   "sampler_cpu_us_per_token", "sampler_cpu_s_per_s", "readers_cpu_us_per_token",
                   "client_cpu_us_per_token")


def prompt_maker(rng: random.Random, vocab: int, prompt_len: int) -> Callable[[int], list[list[int]]]:
    """`count` fresh random prompts per call: no run reuses another's prompts (nor SGLang's prefix cache)."""
    return lambda count: [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(count)]


async def run_on(workers: dict[str, Worker], path: str, command: dict) -> dict:
    """One measuring worker's run, off the event loop (it blocks on its processes' pipes)."""
    return await asyncio.get_running_loop().run_in_executor(None, workers[path].run, command)


async def measure(args, engine: SGLangEngine, url: str, sampler_address: str, sampler_pid: int,
                  old: tuple[str, int] | None = None) -> dict:
    """old: (address, pid) of the sampler that reads its streams on its serving loop (path stubs_old)."""
    rng = random.Random(0)
    vocab = engine.vocab_size
    # raw, stubs and client each run in a process of their own (bench/stream_clients.py): the same process
    # separation a user has, and no path pays for another's event loops and threads.
    workers = {path: Worker(path, url=url, sampler=sampler_address, processes=args.client_processes)
               for path in CLIENT_PATHS}
    latency_paths = CLIENT_PATHS
    pids = {"stubs": sampler_pid, "client": sampler_pid}
    if old is not None:
        workers["stubs_old"] = Worker("stubs", sampler=old[0], processes=args.client_processes)
        latency_paths = (*CLIENT_PATHS, "stubs_old")
        pids["stubs_old"] = old[1]
    on_worker = functools.partial(run_on, workers)
    fresh = prompt_maker(rng, vocab, args.prompt_len)

    throughput, latency = [], []
    try:
        # Warm-up: every adapter through every path (SGLang's first LoRA batch configures its kernels).
        for mix in (Mix("base"), Mix("mixed8")):
            await run_engine(engine, fresh(ADAPTERS), mix, 1, 8, ADAPTERS)
            for path in workers:
                for op in ("unary", "stream"):
                    await on_worker(path, {"op": op, "concurrency": ADAPTERS, "max_tokens": 8,
                                           "requests": worker_requests(fresh(ADAPTERS), mix)})
        configs = [(c, m, 1) for c in args.concurrency for m in args.mixes]
        if args.multi_sample:
            configs += [(64, m, 8) for m in args.mixes if 64 in args.concurrency]
        paths = ("raw", "engine", "grpc", "client")
        for concurrency, mix_name, num_samples in configs:
            mix = Mix(mix_name)
            requests = max(2 * concurrency // num_samples, concurrency // num_samples, 8)
            rates: dict[str, list[float]] = {p: [] for p in paths}
            for round_ in range(args.rounds):
                # Fresh prompts per run (no path gains from another's prefix cache); the order rotates per round.
                for path in rotation(paths, round_):
                    prompts = fresh(requests)
                    if path == "engine":
                        start = time.perf_counter()
                        tokens = await run_engine(engine, prompts, mix, num_samples, args.max_tokens, concurrency)
                        rates[path].append(tokens / (time.perf_counter() - start))
                    else:
                        result = await on_worker("stubs" if path == "grpc" else path, {
                            "op": "unary", "concurrency": concurrency, "max_tokens": args.max_tokens,
                            "num_samples": num_samples, "requests": worker_requests(prompts, mix)})
                        rates[path].append(result["tok_s"])
            row = {"concurrency": concurrency, "mix": mix_name, "num_samples": num_samples,
                   **{f"{p}_tok_s": statistics.median(v) for p, v in rates.items()}, "runs": rates}
            row["engine_over_raw"] = row["engine_tok_s"] / row["raw_tok_s"]
            row["grpc_over_raw"] = row["grpc_tok_s"] / row["raw_tok_s"]
            row["client_over_raw"] = row["client_tok_s"] / row["raw_tok_s"]
            row["client_over_grpc"] = row["client_tok_s"] / row["grpc_tok_s"]
            throughput.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        # Latency: --latency-rounds rounds, raw, bare stubs and SamplingClient in a rotating order, fresh prompts
        # every run, all of a run's streams started at once (C of them, 8 adapters round-robin). One run's TTFT
        # depends on how SGLang happens to batch the prefills (a single run gave ratios from 0.66 to 3.5 at 256),
        # so each path's figures are the medians of its per-run percentiles. ITL is the gap between a stream's
        # consecutive messages (an SSE chunk for raw, a SampleStreamResponse for gRPC); TPOT is a stream's
        # first-to-last time over its tokens - 1.
        for concurrency in args.concurrency:
            mix = Mix("mixed8")
            runs: dict[str, list[dict]] = {path: [] for path in latency_paths}
            for round_ in range(args.latency_rounds):
                for path in rotation(latency_paths, round_):
                    pid = pids.get(path, sampler_pid)
                    before, readers_before = cpu_seconds(pid), children_cpu_seconds(pid)
                    run = await on_worker(path, {
                        "op": "stream", "concurrency": concurrency, "max_tokens": args.max_tokens,
                        "requests": worker_requests(fresh(concurrency * args.latency_waves), mix)})
                    # The sampler's CPU time per forwarded token (near 1 s per s of wall time means its one event
                    # loop is saturated: tokens then leave in batches and the gaps between messages grow), and
                    # its stream readers' apart.
                    spent, readers_spent = cpu_seconds(pid) - before, children_cpu_seconds(pid) - readers_before
                    run["sampler_cpu_us_per_token"] = spent * 1e6 / run["tokens"] if path != "raw" else 0.0
                    run["sampler_cpu_s_per_s"] = spent / run["wall_s"] if path != "raw" else 0.0
                    run["readers_cpu_us_per_token"] = readers_spent * 1e6 / run["tokens"] if path != "raw" else 0.0
                    runs[path].append(run)
            summary = {path: {m: statistics.median(r[m] for r in path_runs) for m in LATENCY_METRICS}
                       | {"tokens_per_message": statistics.median(r["tokens"] / max(r["messages"], 1)
                                                                  for r in path_runs)}
                       for path, path_runs in runs.items()}
            raw = summary["raw"]
            row = {"concurrency": concurrency, "mix": "mixed8", "rounds": args.latency_rounds, **summary,
                   "grpc": summary["stubs"],
                   "ttft_p50_ratio": summary["stubs"]["ttft_p50_ms"] / raw["ttft_p50_ms"],
                   "itl_p50_ratio": summary["stubs"]["itl_p50_ms"] / raw["itl_p50_ms"],
                   "client_ttft_p50_ratio": summary["client"]["ttft_p50_ms"] / raw["ttft_p50_ms"],
                   "client_itl_p50_ratio": summary["client"]["itl_p50_ms"] / raw["itl_p50_ms"],
                   "client_over_stubs_tok_s": summary["client"]["tok_s"] / summary["stubs"]["tok_s"],
                   **({"old_ttft_p50_ratio": summary["stubs_old"]["ttft_p50_ms"] / raw["ttft_p50_ms"],
                       "old_itl_p50_ratio": summary["stubs_old"]["itl_p50_ms"] / raw["itl_p50_ms"]}
                      if "stubs_old" in summary else {}),
                   "ttft_p50_runs_ms": {path: [round(r["ttft_p50_ms"], 1) for r in path_runs]
                                        for path, path_runs in runs.items()},
                   "itl_p50_runs_ms": {path: [round(r["itl_p50_ms"], 2) for r in path_runs]
                                       for path, path_runs in runs.items()}}
            latency.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return {"throughput": throughput, "latency": latency}


def table(result: dict) -> str:
    lines = [("| concurrency | mix | n | raw tok/s | engine tok/s | gRPC stubs tok/s | SamplingClient tok/s | engine/raw | "
             "stubs/raw | client/raw | client/stubs |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["throughput"]:
        lines.append(f"| {r['concurrency']} | {r['mix']} | {r['num_samples']} | {r['raw_tok_s']:.0f} | "
                     f"{r['engine_tok_s']:.0f} | {r['grpc_tok_s']:.0f} | {r['client_tok_s']:.0f} | "
                     f"{r['engine_over_raw']:.2f} | {r['grpc_over_raw']:.2f} | {r['client_over_raw']:.2f} | "
                     f"{r['client_over_grpc']:.3f} |")
    lines += ["", ("Streaming, 8 adapters (medians of per-run values; targets: TTFT p50 <= 1.10x raw, ITL p50 <= 1.20x "
              "raw, client tok/s >= 0.97x stubs)"), "",
              ("| concurrency | path | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | tok/s | tok/msg | "
              "TTFT p50 / raw | ITL p50 / raw | sampler CPU µs/token | sampler CPU s/s | readers CPU µs/token | "
              "client CPU µs/token |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["latency"]:
        for path in [p for p in (*CLIENT_PATHS, "stubs_old") if p in r]:
            v, raw = r[path], r["raw"]
            lines.append(f"| {r['concurrency']} | {path} | {v['ttft_p50_ms']:.1f} | {v['ttft_p99_ms']:.1f} | "
                         f"{v['itl_p50_ms']:.2f} | {v['itl_p99_ms']:.2f} | {v['tpot_p50_ms']:.2f} | {v['tok_s']:.0f} | "
                         f"{v['tokens_per_message']:.2f} | {v['ttft_p50_ms'] / raw['ttft_p50_ms']:.2f} | "
                         f"{v['itl_p50_ms'] / raw['itl_p50_ms']:.2f} | {v['sampler_cpu_us_per_token']:.1f} | "
                         f"{v['sampler_cpu_s_per_s']:.2f} | {v['readers_cpu_us_per_token']:.1f} | "
                         f"{v['client_cpu_us_per_token']:.1f} |")
    return "\n".join(lines)


def start_sampler_process(root: Path, model_dir: Path, urls: list[str], registry_address: str, port: int, *,
                          name: str = "sampler", stream_readers: int | None = None, watch_prefix: str = "",
                          extra_env: dict[str, str] | None = None):
    env = dict(os.environ, LORAPLANE_REGISTRY_ADDRESS=registry_address, PYTHONUNBUFFERED="1",
               LORAPLANE_DATA_DIR=str(root / name), **(extra_env or {}))
    if stream_readers is not None:
        env["LORAPLANE_SGLANG_STREAM_READERS"] = str(stream_readers)
    with open(root / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "sampler_svc", "--engine", "sglang", *(a for u in urls for a in ("--sglang-url", u)),
             "--base-model", str(model_dir), "--port", str(port), "--watch-prefix", watch_prefix,
             "--keep-versions", "2", "--max-loaded",
             str(4 * ADAPTERS), "--sglang-max-lora-rank", str(RANK), "--sglang-max-loras-per-batch",
             str(ADAPTERS + 1)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def gpu_memory_used() -> str:
    """nvidia-smi's memory in use per GPU ("" without it)."""
    if not shutil.which("nvidia-smi"):
        return ""
    return subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"], check=False,
                          capture_output=True, text=True).stdout.strip()


async def start_samplers(root: Path, model_dir: Path, registry_address: str, specs: list[tuple]) -> list:
    """specs: (name, urls, stream_readers, watch_prefix[, extra env]) -> [(process, address)], started one after the
    other in this order. A sampler given server URLs unloads whatever it finds there as it starts, then loads the versions it
    follows (watch_prefix; "bench/" = all eight): so each waits until the one before has loaded all of them, and
    the last to start reloads any name it dropped (same name, same bytes) before the measurement begins."""
    from loraplane.v1 import sampler_pb2, sampler_pb2_grpc

    started = []
    for name, urls, readers, prefix, *extra in specs:
        port = free_port()
        process = start_sampler_process(root, model_dir, urls, registry_address, port, name=name,
                                        stream_readers=readers, watch_prefix=prefix,
                                        extra_env=extra[0] if extra else None)
        address = f"127.0.0.1:{port}"
        started.append((process, address))
        await asyncio.to_thread(wait_until, lambda p=process, a=address: p.poll() is None and check_health(
            a, "loraplane.v1.SamplerService"), 900, f"{name} healthy")
        if not prefix.startswith("bench/"):
            continue  # follows nothing: loads on demand

        def loaded(address: str = address) -> bool:
            import grpc

            with grpc.insecure_channel(address) as channel:
                status = sampler_pb2_grpc.SamplerServiceStub(channel).GetStatus(sampler_pb2.GetStatusRequest(),
                                                                                timeout=10)
            return len(status.loaded) >= ADAPTERS

        await asyncio.to_thread(wait_until, loaded, 300, f"{name} loaded the {ADAPTERS} adapters")
    return started


def median_row(concurrency: int, op: str, rounds: int, runs: dict[str, list[dict]]) -> dict:
    """One table row of rotated rounds: each path's median per metric, and its per-run tokens/s."""
    metrics = ["tok_s", "sampler_cpu_s_per_s"] + (
        ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_p50_ms"] if op == "stream" else [])
    return {"concurrency": concurrency, "op": op, "mix": "mixed8", "rounds": rounds,
            **{p: {m: statistics.median(r[m] for r in rs) for m in metrics} for p, rs in runs.items()},
            "runs_tok_s": {p: [round(r["tok_s"]) for r in rs] for p, rs in runs.items()}}


def _ms(row: dict, path: str, metric: str) -> str:
    return f"{row[path][metric]:.1f}" if metric in row[path] else "-"


async def raw2_placement(engine: SGLangEngine) -> tuple[dict[str, list[str]], list[str]]:
    """The adapter versions each SGLang server holds (its own /v1/models list), printed, and the adapters not on
    the server raw2 sends them to (adapter i -> server i % servers)."""
    placement: dict[str, list[str]] = {}
    for server in engine.servers:
        status, body = await engine.http.request(server, "/v1/models", timeout=30)
        placement[server.url] = sorted(m.get("id", "") for m in (body or {}).get("data", [])
                                       if m.get("parent")) if status == 200 and isinstance(body, dict) else []
    print(f"adapter versions per SGLang server: {json.dumps(placement)}", flush=True)
    urls = [server.url for server in engine.servers]
    return placement, [key_of(i) for i in range(ADAPTERS) if key_of(i) not in placement.get(urls[i % len(urls)], [])]


async def warm_up(on_worker, workers: dict[str, Worker], fresh, mix: Mix) -> None:
    """Every adapter through every path, unary and streamed, before anything is timed."""
    for path in workers:
        for op in ("unary", "stream"):
            await on_worker(path, {"op": op, "concurrency": 2 * ADAPTERS, "max_tokens": 8,
                                   "requests": worker_requests(fresh(2 * ADAPTERS), mix)})


async def measure_two_servers(args, engine: SGLangEngine, one: tuple[str, int], two: tuple[str, int]) -> dict:
    """`one` / `two`: (address, pid) of the sampler with the GPU 0 server / with both. Per concurrency, Sample
    (tokens/s) and streams (tokens/s, TTFT, ITL) through bare stubs, raw SGLang on GPU 0 and raw SGLang over both
    servers (raw2) beside them, in rotating order with fresh prompts."""
    rng = random.Random(1)
    vocab = engine.vocab_size
    url = engine.servers[0].url
    worker = functools.partial(Worker, processes=args.client_processes)
    workers = {"raw": worker("raw", url=url), "one": worker("stubs", sampler=one[0]),
               "two": worker("stubs", sampler=two[0]),
               # adapter i to servers[i % 2]: where `two` placed it (checked below, after the first loads)
               "raw2": worker("raw", url=",".join(server.url for server in engine.servers))}
    pids = {"one": one[1], "two": two[1]}
    mix = Mix("mixed8")
    on_worker = functools.partial(run_on, workers)
    fresh = prompt_maker(rng, vocab, args.prompt_len)

    rows = []
    try:
        # The two-server sampler places each version on the server with fewer of its versions when the load starts;
        # loads that run side by side all see the same counts (and would all land on GPU 0), so the first request of
        # each adapter goes alone.
        await on_worker("two", {"op": "unary", "concurrency": 1, "max_tokens": 4,
                                "requests": worker_requests(fresh(ADAPTERS), mix)})
        # Where the versions ended up (SGLang's own list), before raw2's first requests rely on it.
        placement, misplaced = await raw2_placement(engine)
        if misplaced:
            print(f"WARNING: {', '.join(misplaced)} not on the server raw2 sends them to (adapter i -> server i % "
                  f"{len(engine.servers)}): raw2 routes those requests to a server that lacks the adapter", flush=True)
        # Every adapter loaded (the two-server sampler spreads them over both servers).
        await warm_up(on_worker, workers, fresh, mix)
        paths = tuple(workers)
        for concurrency in args.concurrency:
            for op in ("unary", "stream"):
                count = 2 * concurrency if op == "unary" else concurrency * args.latency_waves
                runs: dict[str, list[dict]] = {p: [] for p in paths}
                for round_ in range(args.rounds):
                    for path in rotation(paths, round_):
                        pid = pids.get(path)
                        before = cpu_seconds(pid) + children_cpu_seconds(pid) if pid else 0.0
                        run = await on_worker(path, {"op": op, "concurrency": concurrency,
                                                     "max_tokens": args.max_tokens,
                                                     "requests": worker_requests(fresh(count), mix)})
                        run["sampler_cpu_s_per_s"] = ((cpu_seconds(pid) + children_cpu_seconds(pid) - before)
                                                      / run["wall_s"] if pid else 0.0)
                        runs[path].append(run)
                row = median_row(concurrency, op, args.rounds, runs)
                row["two_over_one_tok_s"] = row["two"]["tok_s"] / row["one"]["tok_s"]
                row["one_over_raw_tok_s"] = row["one"]["tok_s"] / row["raw"]["tok_s"]
                row["raw2_over_raw_tok_s"] = row["raw2"]["tok_s"] / row["raw"]["tok_s"]
                row["two_over_raw2_tok_s"] = row["two"]["tok_s"] / row["raw2"]["tok_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return {"two_servers": rows, "placement": placement}


def two_servers_table(result: dict) -> str:
    lines = [("Two SGLang servers (GPU 0 + GPU 1) behind one sampler_svc vs one (GPU 0), 8 adapters; target "
              "two/one >= 1.8"), "",
             ("| concurrency | op | raw (GPU 0) tok/s | raw2 (GPU 0+1) tok/s | one tok/s | two tok/s | two / one | "
              "one / raw | raw2 / raw | two / raw2 | one TTFT p50 | two TTFT p50 | one ITL p50 | two ITL p50 | "
              "one sampler CPU s/s | two sampler CPU s/s |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    for r in result["two_servers"]:
        lines.append(f"| {r['concurrency']} | {r['op']} | {r['raw']['tok_s']:.0f} | {r['raw2']['tok_s']:.0f} | "
                     f"{r['one']['tok_s']:.0f} | {r['two']['tok_s']:.0f} | {r['two_over_one_tok_s']:.2f} | "
                     f"{r['one_over_raw_tok_s']:.2f} | {r['raw2_over_raw_tok_s']:.2f} | "
                     f"{r['two_over_raw2_tok_s']:.2f} | "
                     f"{_ms(r, 'one', 'ttft_p50_ms')} | {_ms(r, 'two', 'ttft_p50_ms')} | {_ms(r, 'one', 'itl_p50_ms')} | "
                     f"{_ms(r, 'two', 'itl_p50_ms')} | {r['one']['sampler_cpu_s_per_s']:.2f} | "
                     f"{r['two']['sampler_cpu_s_per_s']:.2f} |")
    return "\n".join(lines)


FLEET = "bench-fleet"


def fleet_env(valkey_url: str, replica_id: str, metrics_port: int) -> dict[str, str]:
    """What makes a sampler_svc a replica of the bench's sampler fleet (as `loraplane up --samplers N` starts its
    members: LORAPLANE_SAMPLER_FLEET + LORAPLANE_SAMPLER_ID, the membership in Redis), every replica preloading every
    version (so both SGLang servers hold all eight and raw2 is valid), and a Prometheus endpoint for its request
    counts (the per-replica spread)."""
    return {"LORAPLANE_REDIS_URL": valkey_url, "LORAPLANE_SAMPLER_FLEET": FLEET, "LORAPLANE_SAMPLER_ID": replica_id,
            "LORAPLANE_SAMPLER_FLEET_PRELOAD": "0", "LORAPLANE_METRICS_PORT": str(metrics_port)}


def replica_counters(metrics_url: str) -> dict[str, float]:
    """A sampler's Sample + SampleStream calls handled and tokens generated so far (its Prometheus counters)."""
    import re
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    counts = {"requests": 0.0, "tokens": 0.0}
    for line in text.splitlines():
        if line.startswith("loraplane_sampler_tokens_total{"):
            counts["tokens"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("loraplane_rpc_total{") and re.search(r'method="(Sample|SampleStream)"', line):
            counts["requests"] += float(line.rsplit(" ", 1)[1])
    return counts


def fleet_replicas_listed(address: str) -> list[str]:
    """The replica ids a sampler lists (ListReplicas: what a SamplingClient seeded with it learns)."""
    import grpc

    from loraplane.v1 import sampler_pb2, sampler_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = sampler_pb2_grpc.SamplerServiceStub(channel).ListReplicas(sampler_pb2.ListReplicasRequest(), timeout=10)
    return [r.replica_id for r in reply.replicas]


async def measure_fleet(args, engine: SGLangEngine, one: tuple[str, int], replicas: list[tuple[str, str, int, str]]
                        ) -> dict:
    """`one`: (address, pid) of the lone sampler on GPU 0's server; `replicas`: (replica id, address, pid, metrics
    URL) of the fleet, the first on GPU 0's server, the second on GPU 1's. Per concurrency, Sample (tokens/s) and
    streams (tokens/s, TTFT, ITL), all four paths through the same client kind where a sampler is in the path
    (SamplingClient: for `fleet` it is what routes each adapter to a replica), raw SGLang on GPU 0 and over both
    servers (raw2) beside them, in rotating order with fresh prompts. The fleet's Sample/SampleStream calls and tokens
    per replica (their counters' change over the fleet's measured runs) show how the client spread the adapters."""
    rng = random.Random(2)
    vocab = engine.vocab_size
    urls = [server.url for server in engine.servers]
    worker = functools.partial(Worker, processes=args.client_processes)
    workers = {"raw": worker("raw", url=urls[0]), "raw2": worker("raw", url=",".join(urls)),
               "one": worker("client", sampler=one[0]), "fleet": worker("client", sampler=replicas[0][1])}
    pids = {"one": {"one": one[1]}, "fleet": {rid: pid for rid, _, pid, _ in replicas}}
    mix = Mix("mixed8")
    on_worker = functools.partial(run_on, workers)
    fresh = prompt_maker(rng, vocab, args.prompt_len)

    async def counters() -> dict[str, dict[str, float]]:
        found = await asyncio.gather(*(asyncio.to_thread(replica_counters, url) for *_, url in replicas))
        return {rid: c for (rid, *_), c in zip(replicas, found, strict=True)}

    rows = []
    try:
        # Where the versions are (SGLang's own list): raw2 sends adapter i to server i % 2, right only where that
        # server holds it. Every replica preloads all eight (fleet_env), and `one` reloads all eight on GPU 0's.
        placement, misplaced = await raw2_placement(engine)
        if misplaced:
            print(f"NOTE: raw2 left out: {', '.join(misplaced)} not on the server raw2 sends them to (adapter i -> "
                  f"server i % {len(engine.servers)})", flush=True)
            workers.pop("raw2").close()
        await warm_up(on_worker, workers, fresh, mix)
        paths = tuple(workers)
        for concurrency in args.concurrency:
            for op in ("unary", "stream"):
                count = 2 * concurrency if op == "unary" else concurrency * args.latency_waves
                runs: dict[str, list[dict]] = {p: [] for p in paths}
                spread = {rid: {"requests": 0.0, "tokens": 0.0} for rid, *_ in replicas}
                for round_ in range(args.rounds):
                    for path in rotation(paths, round_):
                        watched = pids.get(path, {})
                        before = {n: cpu_seconds(pid) + children_cpu_seconds(pid) for n, pid in watched.items()}
                        counts = await counters() if path == "fleet" else {}
                        run = await on_worker(path, {"op": op, "concurrency": concurrency,
                                                     "max_tokens": args.max_tokens,
                                                     "requests": worker_requests(fresh(count), mix)})
                        # Each sampler's CPU (with its stream readers) per second of the run: one process near
                        # 1.0 s/s has its serving loop saturated; the fleet's is the sum over its replicas.
                        per = {n: (cpu_seconds(pid) + children_cpu_seconds(pid) - before[n]) / run["wall_s"]
                               for n, pid in watched.items()}
                        run["sampler_cpu_s_per_s"] = sum(per.values())
                        if path == "fleet":
                            after = await counters()
                            for rid, total in spread.items():
                                for key in total:
                                    total[key] += after[rid][key] - counts[rid][key]
                                run[f"{rid}_cpu_s_per_s"] = per[rid]
                        runs[path].append(run)
                row = median_row(concurrency, op, args.rounds, runs)
                total_requests = sum(c["requests"] for c in spread.values()) or 1.0
                row["fleet_replicas"] = {
                    rid: {"requests": round(c["requests"]), "tokens": round(c["tokens"]),
                          "request_share": c["requests"] / total_requests,
                          "cpu_s_per_s": statistics.median(r[f"{rid}_cpu_s_per_s"] for r in runs["fleet"])}
                    for rid, c in spread.items()}
                row["fleet_over_one_tok_s"] = row["fleet"]["tok_s"] / row["one"]["tok_s"]
                row["one_over_raw_tok_s"] = row["one"]["tok_s"] / row["raw"]["tok_s"]
                row["fleet_over_raw_tok_s"] = row["fleet"]["tok_s"] / row["raw"]["tok_s"]
                if "raw2" in row:
                    row["raw2_over_raw_tok_s"] = row["raw2"]["tok_s"] / row["raw"]["tok_s"]
                    row["fleet_over_raw2_tok_s"] = row["fleet"]["tok_s"] / row["raw2"]["tok_s"]
                idle = [rid for rid, c in spread.items() if not c["requests"]]
                print(f"fleet {op} at {concurrency}: requests per replica "
                      f"{ {rid: round(c['requests']) for rid, c in spread.items()} }, tokens per replica "
                      f"{ {rid: round(c['tokens']) for rid, c in spread.items()} }"
                      + (f"; WARNING: {', '.join(idle)} got no requests" if idle else ""), flush=True)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return {"fleet": rows, "placement": placement, "raw2": "raw2" in workers}


def fleet_table(result: dict) -> str:
    lines = [("A sampler fleet (replica fleet-a with GPU 0's SGLang server, fleet-b with GPU 1's; the SamplingClient "
              "routes each adapter) vs one sampler_svc (GPU 0's server), 8 adapters; issue 23: fleet/one >= 1.8"), "",
             ("| concurrency | op | raw (GPU 0) tok/s | raw2 (GPU 0+1) tok/s | one tok/s | fleet tok/s | fleet / one | "
              "fleet / raw2 | one / raw | one TTFT p50 | fleet TTFT p50 | one ITL p50 | fleet ITL p50 | "
              "one sampler CPU s/s | fleet CPU s/s per replica | fleet requests per replica |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    for r in result["fleet"]:
        raw2 = f"{r['raw2']['tok_s']:.0f}" if "raw2" in r else "-"
        over_raw2 = f"{r['fleet_over_raw2_tok_s']:.2f}" if "raw2" in r else "-"
        replicas = r["fleet_replicas"]
        cpu = " + ".join(f"{v['cpu_s_per_s']:.2f}" for v in replicas.values())
        spread = " / ".join(f"{rid} {v['requests']} ({100 * v['request_share']:.0f}%)" for rid, v in replicas.items())
        lines.append(f"| {r['concurrency']} | {r['op']} | {r['raw']['tok_s']:.0f} | {raw2} | {r['one']['tok_s']:.0f} | "
                     f"{r['fleet']['tok_s']:.0f} | {r['fleet_over_one_tok_s']:.2f} | {over_raw2} | "
                     f"{r['one_over_raw_tok_s']:.2f} | {_ms(r, 'one', 'ttft_p50_ms')} | {_ms(r, 'fleet', 'ttft_p50_ms')} | "
                     f"{_ms(r, 'one', 'itl_p50_ms')} | {_ms(r, 'fleet', 'itl_p50_ms')} | "
                     f"{r['one']['sampler_cpu_s_per_s']:.2f} | {cpu} | {spread} |")
    return "\n".join(lines)


def start_synthetic(itl_ms: float) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, str(REPO / "bench/synthetic_sglang.py"), "--port", str(free_port()),
                                "--itl-ms", str(itl_ms)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    return process, process.stdout.readline().split()[-1]


async def run_fleet(args, root: Path, model_dir: Path, registry_address: str, valkey_url: str,
                    engine: SGLangEngine, urls: list[str], gpus: str, samplers: list) -> dict:
    """--fleet: `fleet-b` (GPU 1's server), `fleet-a` (GPU 0's), both of fleet FLEET, then `one` (GPU 0's, not in a
    fleet). `one` and `fleet-a` share GPU 0's server, which is sound here: a sampler drops what it finds on its servers
    as it starts and then loads the versions it follows, so they start one after the other (start_samplers), each
    having loaded all eight before the next starts; `one`, last, reloads the names fleet-a had loaded there under the
    same names from the same bytes (`bench/aN@v1`), so fleet-a's routes stay valid. Neither unloads anything
    afterwards (max_loaded and keep_versions keep all eight) and only one path runs at a time, so neither loses its
    GPU or its adapters to the other: measuring them in sequence would add a second pair of server starts for
    nothing. `samplers` (the caller's list, which it stops) gets the processes as they start."""
    specs = []
    metrics = {}
    for rid, server_urls in (("fleet-b", urls[1:2]), ("fleet-a", urls[:1])):
        metrics[rid] = free_port()
        specs.append((f"sampler-{rid}", server_urls, args.stream_readers, "bench/",
                      fleet_env(valkey_url, rid, metrics[rid])))
    specs.append(("sampler", urls[:1], args.stream_readers, "bench/"))
    samplers.extend(await start_samplers(root, model_dir, registry_address, specs))
    (fleet_b, fleet_b_address), (fleet_a, fleet_a_address), (one, one_address) = samplers
    # Both replicas listed before the client's first ListReplicas (a heartbeat each; TTL/3 apart).
    await asyncio.to_thread(wait_until, lambda: len(fleet_replicas_listed(fleet_a_address)) >= 2, 60,
                            "both fleet replicas listed")
    print(f"fleet {FLEET}: {fleet_replicas_listed(fleet_a_address)} (seed fleet-a {fleet_a_address})", flush=True)
    replicas = [(rid, address, process.pid, f"http://127.0.0.1:{metrics[rid]}/metrics")
                for rid, (process, address) in (("fleet-a", (fleet_a, fleet_a_address)),
                                                ("fleet-b", (fleet_b, fleet_b_address)))]
    result = await measure_fleet(args, engine, (one_address, one.pid), replicas)
    idle = {rid for row in result["fleet"] for rid, v in row["fleet_replicas"].items() if not v["requests"]}
    print(f"both fleet replicas received requests in every row: {'yes' if not idle else 'NO (' + ', '.join(sorted(idle)) + ')'}",
          flush=True)
    result["stream_readers"] = args.stream_readers
    result["client_processes"] = args.client_processes
    result["gpu_memory_used"] = gpus.splitlines()
    result["machine"] = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                         if torch.cuda.is_available() else "cpu")
    result["model"] = {"shape": args.build_shape or str(model_dir), "dtype": "bfloat16", "adapters": ADAPTERS,
                       "rank": RANK, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                       "cuda_graph": not args.disable_cuda_graph}
    return result


async def main_async(args) -> dict:
    # This loop and the registry's both use grpc.aio: every completion wakes both, and one finds nothing to read.
    quiet_grpc_poller(asyncio.get_running_loop())
    model_dir = Path(args.model_dir)
    root = Path(args.work_dir)
    shutil.rmtree(root, ignore_errors=True)  # a previous run's registry would already hold the bench adapters
    root.mkdir(parents=True)
    valkey, seaweed = valkey_server(root / "valkey"), seaweed_s3_server(root / "seaweed")
    valkey.start()
    seaweed.start()
    settings = Settings(redis_url=valkey.url, s3_endpoint=seaweed.endpoint, s3_access_key=seaweed.access_key,
                        s3_secret_key=seaweed.secret_key, s3_bucket="bench", key_prefix="bench:")
    loop = BackgroundLoop("registry")
    registry = loop.run(start_registry_server(settings, port=0))
    registry_address = registry.address
    server_args = ["--mem-fraction-static", str(args.mem_fraction), "--skip-tokenizer-init"]
    if args.disable_cuda_graph:
        server_args.append("--disable-cuda-graph")
    synthetics = []
    servers = 2 if args.two_servers else 1
    if args.synthetic_itl_ms:
        # A dry run of this script on a machine without a GPU: bench/synthetic_sglang.py in SGLang's place.
        synthetics = [start_synthetic(args.synthetic_itl_ms) for _ in range(servers)]
        engine = SGLangEngine(str(model_dir), urls=[u for _, u in synthetics], stream_readers=0,
                              work_dir=root / "sglang", max_lora_rank=RANK, max_loaded_loras=4 * ADAPTERS)
    else:
        if args.two_servers:
            # The engine gives launched server i CUDA_VISIBLE_DEVICES=i unless the variable is set already (then
            # every server would share the GPUs it names).
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        engine = SGLangEngine(str(model_dir), launch_servers=servers, work_dir=root / "sglang", max_lora_rank=RANK,
                              max_loras_per_batch=ADAPTERS + 1, max_loaded_loras=4 * ADAPTERS,
                              extra_server_args=server_args, stream_readers=0)
    samplers = []
    try:
        await engine.start()
        url = engine.servers[0].url
        base = load_base_model(str(model_dir), "cpu")
        blobs = [random_adapter_blob(base, 100 + i, RANK) for i in range(ADAPTERS)]
        del base
        async with RegistryClient(registry_address) as client:
            for i, blob in enumerate(blobs):
                await client.create_adapter(f"bench/a{i}", lora_config=common_pb2.LoraConfig(rank=RANK, alpha=2 * RANK),
                                            base_model=str(model_dir))
                await client.publish(f"bench/a{i}", blob)
        if args.two_servers:
            gpus = await asyncio.to_thread(gpu_memory_used)
            print(f"GPU memory with both SGLang servers up (each should hold one server):\n{gpus}", flush=True)
            urls = [server.url for server in engine.servers]
            if args.fleet:
                return await run_fleet(args, root, model_dir, registry_address, valkey.url, engine, urls, gpus,
                                       samplers)
            # `two` first and following nothing (it loads each version on its first request: measure_two_servers
            # sends those one at a time, so they alternate between the servers), then `one`, which loads all eight
            # on GPU 0's server.
            samplers = await start_samplers(root, model_dir, registry_address, [
                ("sampler-two", urls, args.stream_readers, "none/"), ("sampler", urls[:1], args.stream_readers,
                                                                     "bench/")])
            (two, two_address), (one, one_address) = samplers
            result = await measure_two_servers(args, engine, (one_address, one.pid), (two_address, two.pid))
            result["stream_readers"] = args.stream_readers
            result["client_processes"] = args.client_processes
            result["gpu_memory_used"] = gpus.splitlines()
            result["machine"] = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                                 if torch.cuda.is_available() else "cpu")
            result["model"] = {"shape": args.build_shape or str(model_dir), "dtype": "bfloat16",
                               "adapters": ADAPTERS, "rank": RANK, "prompt_len": args.prompt_len,
                               "max_tokens": args.max_tokens, "cuda_graph": not args.disable_cuda_graph}
            return result
        # The engine-alone path uses the names the sampler gives the same versions (`bench/aN@v1`), loaded from the
        # same bytes; the sampler process unloads and reloads them as it starts, SGLang keeps serving them.
        for i, blob in enumerate(blobs):
            await engine.load_adapter(key_of(i), blob)
        specs = [("sampler-old", [url], 0, "bench/")] if args.old_path else []
        samplers = await start_samplers(root, model_dir, registry_address,
                                        [*specs, ("sampler", [url], args.stream_readers, "bench/")])
        sampler, address = samplers[-1]
        old = (samplers[0][1], samplers[0][0].pid) if args.old_path else None
        result = await measure(args, engine, url, address, sampler.pid, old)
        result["stream_readers"] = args.stream_readers
        result["client_processes"] = args.client_processes
        result["machine"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        result["model"] = {"shape": args.build_shape or str(model_dir), "dtype": "bfloat16", "adapters": ADAPTERS,
                           "rank": RANK, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "cuda_graph": not args.disable_cuda_graph}
        return result
    finally:
        for process, _ in samplers:
            process.terminate()
        for process, _ in samplers:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        await engine.stop()
        for synthetic, _ in synthetics:
            synthetic.terminate()
            synthetic.wait(10)
        loop.run(registry.stop())
        loop.close()
        valkey.stop()
        seaweed.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--build-shape", choices=sorted(SHAPES), help="first write a random-weight model there")
    parser.add_argument("--work-dir", default="/tmp/lp-bench-sglang")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--mixes", nargs="+", default=["base", "one", "mixed8"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--mem-fraction", type=float, default=0.5)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--latency-rounds", type=int, default=3)
    parser.add_argument("--latency-waves", type=int, default=1, help="streams per latency run = concurrency x this")
    parser.add_argument("--multi-sample", action="store_true", help="add num_samples=8 throughput rows at 64")
    parser.add_argument("--stream-readers", type=int, default=4,
                        help="stream reader processes of the sampler measured (LORAPLANE_SGLANG_STREAM_READERS)")
    parser.add_argument("--old-path", action=argparse.BooleanOptionalAction, default=True,
                        help="also stream through a second sampler with no readers (path stubs_old)")
    parser.add_argument("--two-servers", action="store_true",
                        help="GPU 0 + GPU 1: one sampler with both servers vs one with GPU 0's (module docstring)")
    parser.add_argument("--fleet", action="store_true",
                        help="with --two-servers: a sampler fleet of two replicas (one per server) vs one sampler "
                             "(module docstring)")
    parser.add_argument("--synthetic-itl-ms", type=float, default=0.0,
                        help="no SGLang: a dry run against bench/synthetic_sglang.py (--model-dir tiny)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="measuring processes per path (each its own connection): one Python process receiving "
                             "256 streams saturates its own core (bench/stream_clients.py, Worker(processes=N))")
    parser.add_argument("--out", default=str(REPO / "bench/results/sampler_vs_sglang.json"))
    args = parser.parse_args()
    if args.fleet and not args.two_servers:
        parser.error("--fleet is a --two-servers mode: add --two-servers")
    if args.build_shape:
        build_model(args.build_shape, Path(args.model_dir))
    if args.two_servers and args.concurrency == parser.get_default("concurrency"):
        args.concurrency = [256]
    result = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(fleet_table(result) if args.fleet else two_servers_table(result) if args.two_servers else table(result))


if __name__ == "__main__":
    main()
