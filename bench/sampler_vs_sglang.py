"""The sampler against the SGLang server it wraps, side by side in one run (GPU machine with SGLang installed).

One SGLang server (launched here, LoRA on, CUDA graphs on unless --disable-cuda-graph) serves three paths, driven
alternately with the same request mix:
  raw     an aiohttp client posting straight to SGLang's /generate (what a user would run instead of loraplane);
  engine  loraplane's SGLangEngine in this process (`generate`, what the Sample RPC calls);
  grpc    the full path: a `sampler_svc` process (SGLang engine, attached to the same server, following a real
          registry on Valkey + SeaweedFS) answering gRPC Sample calls.
Concurrency 16 / 64 / 256, adapter mixes base / one adapter / 8 adapters, num_samples 1 and 8 (at 64). Throughput
is generated tokens per second of wall time (prefill included); latency (TTFT, inter-token gaps) is measured on
the streaming forms (SGLang `stream: true` vs gRPC SampleStream).

    python bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b [--rounds 2]

Writes JSON (bench/results/sampler_vs_sglang.json) and prints a table. Random weights in the real shape; rank-16
adapters on all seven projections with random B.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import itertools

import grpc
import torch

from bench.common import percentile, random_adapter_blob
from loraplane.config import Settings
from loraplane.local.processes import free_port, seaweed_s3_server, valkey_server, wait_until
from loraplane.models import load_base_model
from loraplane.registry_client import RegistryClient
from loraplane.rpc import BackgroundLoop, channel_options, check_health
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
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


async def run_raw(session, url: str, prompts, mix: Mix, num_samples: int, max_tokens: int, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: list[int]) -> int:
        key = key_of(mix.adapter(index))
        params = {"max_new_tokens": max_tokens, "temperature": 1.0}
        payload = {"input_ids": [prompt] * num_samples if num_samples > 1 else prompt,
                   "sampling_params": [params] * num_samples if num_samples > 1 else params,
                   "return_logprob": True, "lora_path": [key] * num_samples if num_samples > 1 else key}
        async with gate, session.post(f"{url}/generate", json=payload) as reply:
            body = await reply.json()
        outputs = body if isinstance(body, list) else [body]
        return sum(len(o["meta_info"]["output_token_logprobs"]) for o in outputs)

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


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


def sample_request(index: int, prompt: list[int], mix: Mix, num_samples: int, max_tokens: int):
    adapter = mix.adapter(index)
    ref = common_pb2.AdapterRef(name="" if adapter is None else f"bench/a{adapter}")
    if adapter is not None:
        ref.version = 1
    return sampler_pb2.SampleRequest(adapter=ref, prompt_tokens=prompt, num_samples=num_samples,
                                     sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0))


async def run_grpc(stubs, prompts, mix: Mix, num_samples: int, max_tokens: int, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: list[int]) -> int:
        async with gate:
            reply = await stubs[index % len(stubs)].Sample(sample_request(index, prompt, mix, num_samples,
                                                                          max_tokens), timeout=600)
        return sum(len(s.tokens) for s in reply.sequences)

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def latency_raw(session, url: str, prompts, mix: Mix, max_tokens: int, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: list[int]) -> list[float]:
        payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 1.0},
                   "return_logprob": True, "lora_path": key_of(mix.adapter(index)), "stream": True}
        async with gate:
            start = time.perf_counter()
            stamps = []
            async with session.post(f"{url}/generate", json=payload) as reply:
                async for line in reply.content:
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        stamps.append(time.perf_counter())
        return [stamps[0] - start, *(b - a for a, b in itertools.pairwise(stamps))]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def latency_grpc(stubs, prompts, mix: Mix, max_tokens: int, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: list[int]) -> list[float]:
        request = sample_request(index, prompt, mix, 1, max_tokens)
        async with gate:
            start = time.perf_counter()
            stamps = []
            async for chunk in stubs[index % len(stubs)].SampleStream(request, timeout=600):
                if chunk.tokens:
                    stamps.append(time.perf_counter())
        return [stamps[0] - start, *(b - a for a, b in itertools.pairwise(stamps))]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def summarize_latency(per_request: list[list[float]]) -> dict:
    ttft = [r[0] * 1000 for r in per_request]
    gaps = [g * 1000 for r in per_request for g in r[1:]]
    return {name: {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
            for name, values in (("ttft_ms", ttft), ("itl_ms", gaps))}


async def measure(args, engine: SGLangEngine, url: str, sampler_address: str) -> dict:
    import aiohttp

    rng = random.Random(0)
    vocab = engine.vocab_size
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4))
    # Each --grpc-channels count N is a client whose requests spread over N HTTP/2 connections (a local subchannel
    # pool each, or gRPC would share one connection among equal channels), raw SGLang having one connection per
    # request. Throughput uses the first count; latency measures every count.
    options = channel_options() + [("grpc.use_local_subchannel_pool", 1)]
    channels = {n: [grpc.aio.insecure_channel(sampler_address, options=options) for _ in range(n)]
                for n in args.grpc_channels}
    stubs_of = {n: [sampler_pb2_grpc.SamplerServiceStub(channel) for channel in group]
                for n, group in channels.items()}
    stubs = stubs_of[args.grpc_channels[0]]
    throughput, latency = [], []
    try:
        # Warm-up: every adapter through every path (SGLang's first LoRA batch configures its kernels).
        warm = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(ADAPTERS)]
        for mix in (Mix("base"), Mix("mixed8")):
            await run_raw(session, url, warm, mix, 1, 8, ADAPTERS)
            await run_engine(engine, warm, mix, 1, 8, ADAPTERS)
            await run_grpc(stubs, warm, mix, 1, 8, ADAPTERS)
        configs = [(c, m, 1) for c in args.concurrency for m in args.mixes]
        configs += [(64, m, 8) for m in args.mixes if 64 in args.concurrency]
        for concurrency, mix_name, num_samples in configs:
            mix = Mix(mix_name)
            requests = max(2 * concurrency // num_samples, concurrency // num_samples, 8)
            rates: dict[str, list[float]] = {"raw": [], "engine": [], "grpc": []}
            for round_ in range(args.rounds):
                # Fresh prompts per run (no path gains from another's prefix cache); the order rotates per round.
                order = ("raw", "engine", "grpc")[round_ % 3:] + ("raw", "engine", "grpc")[:round_ % 3]
                for path in order:
                    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(requests)]
                    start = time.perf_counter()
                    if path == "raw":
                        tokens = await run_raw(session, url, prompts, mix, num_samples, args.max_tokens, concurrency)
                    elif path == "engine":
                        tokens = await run_engine(engine, prompts, mix, num_samples, args.max_tokens, concurrency)
                    else:
                        tokens = await run_grpc(stubs, prompts, mix, num_samples, args.max_tokens, concurrency)
                    rates[path].append(tokens / (time.perf_counter() - start))
            row = {"concurrency": concurrency, "mix": mix_name, "num_samples": num_samples,
                   **{f"{p}_tok_s": statistics.median(v) for p, v in rates.items()}, "runs": rates}
            row["engine_over_raw"] = row["engine_tok_s"] / row["raw_tok_s"]
            row["grpc_over_raw"] = row["grpc_tok_s"] / row["raw_tok_s"]
            throughput.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        # Latency: --latency-rounds rounds, raw and each gRPC client in a rotating order, fresh prompts every run
        # (all requests of a run start at once, so one run's TTFT depends on how SGLang happens to batch the
        # prefills; a single run gave ratios from 0.66 to 3.5 at 256). Each path's percentiles are the medians of
        # its per-run percentiles.
        paths = ["raw", *(f"grpc{n}" for n in args.grpc_channels)]
        for concurrency in args.concurrency:
            mix = Mix("mixed8")
            runs: dict[str, list[dict]] = {path: [] for path in paths}
            for round_ in range(args.latency_rounds):
                for path in paths[round_ % len(paths):] + paths[:round_ % len(paths)]:
                    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(concurrency)]
                    if path == "raw":
                        per_request = await latency_raw(session, url, prompts, mix, args.max_tokens, concurrency)
                    else:
                        per_request = await latency_grpc(stubs_of[int(path[4:])], prompts, mix, args.max_tokens,
                                                         concurrency)
                    runs[path].append(summarize_latency(per_request))
            summary = {path: {metric: {q: statistics.median(run[metric][q] for run in path_runs)
                                       for q in path_runs[0][metric]} for metric in path_runs[0]}
                       for path, path_runs in runs.items()}
            row = {"concurrency": concurrency, "mix": "mixed8", "rounds": args.latency_rounds, "raw": summary["raw"],
                   "grpc": summary[paths[1]], **{path: summary[path] for path in paths[1:]},
                   "ttft_p50_ratio": summary[paths[1]]["ttft_ms"]["p50"] / summary["raw"]["ttft_ms"]["p50"],
                   "ttft_p50_ratio_by_channels": {n: summary[f"grpc{n}"]["ttft_ms"]["p50"]
                                                  / summary["raw"]["ttft_ms"]["p50"] for n in args.grpc_channels},
                   "ttft_p50_runs_ms": {path: [round(run["ttft_ms"]["p50"], 1) for run in path_runs]
                                        for path, path_runs in runs.items()}}
            latency.append(row)
            print(json.dumps(row), flush=True)
    finally:
        await session.close()
        for group in channels.values():
            for channel in group:
                await channel.close()
    return {"throughput": throughput, "latency": latency}


def table(result: dict) -> str:
    lines = ["| concurrency | mix | n | raw tok/s | engine tok/s | gRPC tok/s | engine/raw | gRPC/raw |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["throughput"]:
        lines.append(f"| {r['concurrency']} | {r['mix']} | {r['num_samples']} | {r['raw_tok_s']:.0f} | "
                     f"{r['engine_tok_s']:.0f} | {r['grpc_tok_s']:.0f} | {r['engine_over_raw']:.2f} | "
                     f"{r['grpc_over_raw']:.2f} |")
    lines += ["", "| concurrency | TTFT p50 raw / gRPC (ms) | ratio | ITL p50 raw / gRPC (ms) | ITL p99 raw / gRPC |",
              "|---|---|---|---|---|"]
    for r in result["latency"]:
        lines.append(f"| {r['concurrency']} | {r['raw']['ttft_ms']['p50']:.1f} / {r['grpc']['ttft_ms']['p50']:.1f} | "
                     f"{r['ttft_p50_ratio']:.2f} | {r['raw']['itl_ms']['p50']:.2f} / {r['grpc']['itl_ms']['p50']:.2f} "
                     f"| {r['raw']['itl_ms']['p99']:.2f} / {r['grpc']['itl_ms']['p99']:.2f} |")
    by_channels = [r for r in result["latency"] if len(r["ttft_p50_ratio_by_channels"]) > 1]
    if by_channels:
        counts = list(by_channels[0]["ttft_p50_ratio_by_channels"])
        lines += ["", "| concurrency | " + " | ".join(f"TTFT p50 gRPC ÷ raw, {n} connection(s)" for n in counts) + " |",
                  "|---|" + "---|" * len(counts)]
        for r in by_channels:
            lines.append(f"| {r['concurrency']} | "
                         + " | ".join(f"{r['ttft_p50_ratio_by_channels'][n]:.2f}" for n in counts) + " |")
    return "\n".join(lines)


def start_sampler_process(root: Path, model_dir: Path, url: str, registry_address: str, port: int):
    env = dict(os.environ, LORAPLANE_REGISTRY_ADDRESS=registry_address, PYTHONUNBUFFERED="1")
    with open(root / "sampler.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "sampler_svc", "--engine", "sglang", "--sglang-url", url, "--base-model",
             str(model_dir), "--port", str(port), "--keep-versions", "2", "--max-loaded", str(4 * ADAPTERS),
             "--sglang-max-lora-rank", str(RANK), "--sglang-max-loras-per-batch", str(ADAPTERS + 1)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def main_async(args) -> dict:
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
    engine = SGLangEngine(str(model_dir), launch_servers=1, work_dir=root / "sglang", max_lora_rank=RANK,
                          max_loras_per_batch=ADAPTERS + 1, max_loaded_loras=4 * ADAPTERS,
                          extra_server_args=server_args)
    sampler = None
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
        # The engine-alone path uses the names the sampler gives the same versions (`bench/aN@v1`), loaded from the
        # same bytes; the sampler process unloads and reloads them as it starts, SGLang keeps serving them.
        for i, blob in enumerate(blobs):
            await engine.load_adapter(key_of(i), blob)
        port = free_port()
        sampler = start_sampler_process(root, model_dir, url, registry_address, port)
        address = f"127.0.0.1:{port}"
        wait_until(lambda: sampler.poll() is None and check_health(address, "loraplane.v1.SamplerService"), 900,
                   "sampler_svc healthy")
        result = await measure(args, engine, url, address)
        result["machine"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        result["model"] = {"shape": args.build_shape or str(model_dir), "dtype": "bfloat16", "adapters": ADAPTERS,
                           "rank": RANK, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "cuda_graph": not args.disable_cuda_graph}
        return result
    finally:
        if sampler is not None:
            sampler.terminate()
            sampler.wait(30)
        await engine.stop()
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
    parser.add_argument("--grpc-channels", type=int, nargs="+", default=[1],
                        help="gRPC connections a client spreads its requests over: throughput uses the first count, "
                             "latency compares every count")
    parser.add_argument("--latency-rounds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench/results/sampler_vs_sglang.json"))
    args = parser.parse_args()
    if args.build_shape:
        build_model(args.build_shape, Path(args.model_dir))
    result = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
