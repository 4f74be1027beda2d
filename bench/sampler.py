"""Sampler benchmarks (torch engine on CPU by default; `--engine sglang` on a GPU machine with SGLang installed).

1. publish -> first sample served on the new version: a rank-16 SmolLM2 adapter is published to a real registry
   (Valkey + SeaweedFS on loopback) and immediately requested by version through the sampler's gRPC API (the RL
   loop's pattern); also the time until the sampler's watcher has loaded it without any request.
2. decode tokens/s of a 16-row batch: base model without LoRA, all rows on 1 adapter, rows spread over 8 adapters.
   Decode-only throughput (engine counters; prefill excluded).

Prints a table and JSON, writes bench/results/sampler.json.
    python bench/sampler.py [--iterations 20] [--model smollm2-135m-instruct] [--tokens 48] [--engine sglang]

With the SGLang engine, one SGLang server is launched by the sampler (see SGLANG_OPTIONS) and decode throughput
is measured end to end (16 concurrent requests, wall clock, prefill of 32 tokens included) since SGLang has no
decode-only counters.

`--engine sglang --shape smollm2|llama8b` instead measures publish -> first sample for both ways a version reaches
SGLang, alternately on one server: in the request body (`/load_lora_adapter_from_tensors`) and as a PEFT directory
(`/load_lora_adapter`). The model has random bf16 weights in that shape (load speed does not depend on their values);
it first checks that one blob loaded both ways gives identical greedy tokens and logprobs.
    python bench/sampler.py --engine sglang --shape llama8b --iterations 6

`--shape qwen3moe` is Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts top-8, expert FFN 768, 32/4 heads of 128,
vocab 151936) with rank-32 adapters on q,k,v,o and the experts, one per expert layout (`--expert-layouts`), each
version 2.6 GB of bf16. Its 61 GB of base weights never touch the disk: the model directory holds config.json and a
tokenizer only and SGLang makes random weights on the GPU (`--load-format dummy`). SGLang's LoRA file loader reads
with the server's load format (a dummy server cannot read adapter files: DefaultModelLoader refuses
LoadFormat.DUMMY), so every version travels as tensors (`/load_lora_adapter_from_tensors`, through /dev/shm: the
server is this process's), its experts in each of `--expert-forms` (per-expert keys, stacked 3-D tensors). Each
version's phases are printed as it completes: publish (the trainer side: upload, registry check, S3 write, commit),
event (commit -> the sampler starts downloading), download (S3 read + digest), convert (header, views), pack (the
one copy into the shared buffer, pickling), SGLang's load call (its unpickle and LoRA processing), first token
(load done -> the sample's reply: SGLang moves the adapter into its GPU buffers on its first batch).
    python bench/sampler.py --engine sglang --shape qwen3moe --iterations 2 --deadline-s 430

`--push` measures publish -> first sample where the publisher does what the trainer's PublishWeights does: the blob
(random LoRA tensors of the shape, written as the trainer writes them: a shared-outer expert adapter in the compact
format 2) is made and hashed, pushed by the real trainer_svc.handoff.Handoff to the sampler registered in the
deployment's fleet membership (through this host's shared memory, or as the gRPC stream a sampler on another host
gets) while the real registry reserves the version, and the publish answers then, its upload going on beside
(trainer_svc/upload_spool.py, `publish_ack = "pushed"`); then that version is sampled. Versions that are not pushed
(the registry path: answered after the upload and commit) alternate with them in the same run. Per version: the
total from the publish's start to the sampled token, the moments between (made, push done, staged on the sampler,
committed, acknowledged, load started, loaded, sampled, and the upload stored) and the path the sampler reports for
it; the run fails
(exit 1) when a version took another path than its own, or was served as another version. Writes
bench/results/sampler_push_<shape>.json.
    python bench/sampler.py --push --quick [--shape tiny|tiny-moe|smollm2]     (torch engine, CPU, about a minute)
    python bench/sampler.py --push --engine sglang --shape llama8b|qwen3moe --iterations 4 [--deadline-s 430]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc
import torch

from bench.common import (
    embedded_storage,
    environment,
    latency_summary,
    print_table,
    random_adapter_blob,
    rotation,
    write_results,
)
from loraplane.models import load_base_model
from loraplane.registry_client import RegistryClient
from loraplane.rpc import channel_options
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
from registry_svc.server import start_registry_server
from sampler_svc.engines.base import GenerationRequest, SamplingOptions
from sampler_svc.server import start_sampler_server

# One server; 8 bench adapters + the base model fit one batch. CUDA graphs off: they cost a minute of start-up
# and the numbers compared here are ratios between adapter mixes on the same server.
SGLANG_OPTIONS = {"max_lora_rank": 16, "max_loras_per_batch": 9, "max_loaded_loras": 24,
                  "extra_server_args": ["--mem-fraction-static", "0.3", "--disable-cuda-graph"]}


# Real shapes for the SGLang load benchmark: (model config, adapter rank). Mixture-of-experts shapes are in
# MOE_SHAPES (a production_e2e.MOE_SHAPES name, adapter rank).
MOE_SHAPES = {"qwen3moe": ("qwen3-30b-a3b", 32)}
MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
SHAPES = {
    # SmolLM2-135M: 30 layers, d 576, GQA 9/3, MLP 1536, vocab 49152, tied embeddings.
    "smollm2": ({"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
                 "max_position_embeddings": 8192, "rope_theta": 100000.0}, 16),
    # Llama-3.1-8B: 32 layers, d 4096, GQA 32/8, MLP 14336, vocab 128256.
    "llama8b": ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
                 "max_position_embeddings": 8192, "rope_theta": 500000.0}, 32),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def publish_to_first_sample(model: str, iterations: int, workdir: Path, engine: str = "torch") -> dict:
    with embedded_storage(workdir, "bench-sampler") as storage:
        return await _publish_to_first_sample(storage.model_copy(update={"data_dir": workdir}), model, iterations,
                                              workdir, engine)


async def _publish_to_first_sample(settings, model: str, iterations: int, workdir: Path, engine: str) -> dict:
    registry = await start_registry_server(settings)
    sglang = {"sglang_launch": 1, "sglang_options": SGLANG_OPTIONS} if engine == "sglang" else {}
    sampler = await start_sampler_server(settings, registry_address=registry.address, base_model=model,
                                         instance_id="bench", engine=engine, **sglang)
    client = RegistryClient(registry.address)
    base = load_base_model(model)
    try:
        await client.create_adapter("bench", base_model=model, lora_config=common_pb2.LoraConfig(rank=16))
        blobs = [random_adapter_blob(base, seed) for seed in range(2 * iterations + 2)]
        channel = grpc.aio.insecure_channel(sampler.address, options=channel_options())
        stub = sampler_pb2_grpc.SamplerServiceStub(channel)
        request_path, committed_path, watcher_path = [], [], []
        prompt = list(range(100, 132))
        # Warm-up: first load pays one-time costs (allocator, kernels).
        warm = await client.publish("bench", blobs[-1])
        await stub.Sample(sampler_pb2.SampleRequest(adapter=common_pb2.AdapterRef(name="bench", version=warm.version),
                                                    prompt_tokens=prompt,
                                                    sampling_params=common_pb2.SamplingParams(max_tokens=1)))
        for index in range(iterations):
            # (a) publish, then request that version at once (on-demand load joins the watcher's load, if any).
            started = time.perf_counter()
            version = await client.publish("bench", blobs[2 * index])
            committed = time.perf_counter()
            reply = await stub.Sample(sampler_pb2.SampleRequest(
                adapter=common_pb2.AdapterRef(name="bench", version=version.version), prompt_tokens=prompt,
                sampling_params=common_pb2.SamplingParams(max_tokens=1)))
            assert reply.served_version == version.version
            request_path.append(time.perf_counter() - started)
            committed_path.append(time.perf_counter() - committed)
            # (b) publish and wait for the watcher alone to have it loaded.
            started = time.perf_counter()
            version = await client.publish("bench", blobs[2 * index + 1])
            key = f"bench@v{version.version}"
            while key not in {e.key for e in sampler.manager.list_loaded()}:
                await asyncio.sleep(0.002)
            watcher_path.append(time.perf_counter() - started)
        await channel.close()
    finally:
        await client.close()
        await sampler.stop()
        await registry.stop()
    blob_mb = len(blobs[0]) / 1e6
    return {
        "adapter_mb": round(blob_mb, 2),
        "iterations": iterations,
        # From the start of the upload (includes the registry's S3 write of the blob) ...
        "publish_then_sample_ms": {"p50": percentile(request_path, 50) * 1e3, "p99": percentile(request_path, 99) * 1e3},
        # ... and from the moment the version is committed (the sampler's part: download, verify, load, serve).
        "committed_then_sample_ms": {"p50": percentile(committed_path, 50) * 1e3,
                                     "p99": percentile(committed_path, 99) * 1e3},
        "publish_then_watcher_loaded_ms": {"p50": percentile(watcher_path, 50) * 1e3,
                                           "p99": percentile(watcher_path, 99) * 1e3},
    }


async def decode_throughput(model: str, tokens: int, repeats: int, engine_name: str = "torch",
                            workdir: Path | None = None) -> dict:
    if engine_name == "sglang":
        from sampler_svc.engines.sglang_engine import SGLangEngine

        engine = SGLangEngine(model, launch_servers=1, work_dir=workdir, **SGLANG_OPTIONS)
    else:
        from sampler_svc.engines.torch_engine import TorchEngine

        engine = TorchEngine(model, max_batch_rows=16)
    await engine.start()
    base = load_base_model(model)
    try:
        for index in range(8):
            await engine.load_adapter(f"a{index}@v1", random_adapter_blob(base, 1000 + index))
        configs = {
            "base (no LoRA)": [None] * 16,
            "1 adapter": ["a0@v1"] * 16,
            "8 adapters": [f"a{i % 8}@v1" for i in range(16)],
        }

        async def run(keys: list[str | None]) -> float:
            requests = [GenerationRequest(prompt_tokens=tuple(range(100 + i, 132 + i)),
                                          options=SamplingOptions(max_tokens=tokens, seed=i, ignore_eos=True),
                                          adapter_key=key) for i, key in enumerate(keys)]

            async def one(request) -> int:
                produced = 0
                async for update in engine.generate(request):
                    produced += len(update.tokens)
                return produced

            if engine_name == "sglang":
                started = time.perf_counter()
                produced = sum(await asyncio.gather(*(one(r) for r in requests)))
                return produced / (time.perf_counter() - started)
            seconds, produced = engine.decode_seconds, engine.decode_tokens
            await asyncio.gather(*(one(r) for r in requests))
            return (engine.decode_tokens - produced) / (engine.decode_seconds - seconds)

        rates: dict[str, list[float]] = {name: [] for name in configs}
        await run(configs["1 adapter"])  # warm-up
        # Interleaved repeats, so load from other processes hits every configuration alike.
        for _ in range(repeats):
            for name, keys in configs.items():
                rates[name].append(await run(keys))
    finally:
        await engine.stop()
    result = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "rows": 16,
        "new_tokens_per_row": tokens,
        "tokens_per_s": result,
        "ratio_8_vs_1_adapter": result["8 adapters"] / result["1 adapter"],
        "ratio_1_adapter_vs_base": result["1 adapter"] / result["base (no LoRA)"],
    }


def write_shape_dir(shape: str, directory: Path, layers: int = 0) -> None:
    """A random-weight bf16 Llama of the shape (built on the GPU) + a small byte-level tokenizer (requests carry token
    ids). Real files, not `--load-format dummy`: SGLang loads LoRA directories with the server's load format. A MoE
    shape: config.json + tokenizer only (served with `--load-format dummy`, adapters as tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraplane.models.tiny import build_tiny_tokenizer

    if (directory / "config.json").is_file():
        return
    if shape in MOE_SHAPES:
        from tests.production_e2e import qwen3_moe_config, write_moe_config_dir

        write_moe_config_dir(directory, qwen3_moe_config(MOE_SHAPES[shape][0], layers=layers))
        return
    config = LlamaConfig(**SHAPES[shape][0], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(directory)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the memory goes to the SGLang server started next


WAYS = ("file:float32", "file:bfloat16", "tensors:float32", "tensors:bfloat16")


def random_moe_adapter_blob(base, seed: int, rank: int, dtype: str, layout: str) -> bytes:
    """A rank-`rank` adapter on q,k,v,o and the routed experts of a MoE base (its shapes only: `base` may live on
    the meta device), `layout` per_expert or shared_outer; A uniform with kaiming's bound, B small and random (not
    zero). Drawn on the GPU when there is one (1.3 B values for Qwen3-30B-A3B per-expert), a tensor at a time, and
    kept on the host in the blob's dtype."""
    import math

    from loraplane.adapter_format import serialize_adapter
    from loraplane.lora import LoraSpec, expected_shapes

    spec = LoraSpec.create(rank, 2.0 * rank, MOE_TARGETS, seed=seed, expert_layout=layout)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    host_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    params = {}
    for key, shape in expected_shapes(base, spec).items():
        if key.endswith("lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])
            values = (torch.rand(shape, generator=generator, device=device) * 2 - 1) * bound
        else:
            values = torch.randn(shape, generator=generator, device=device) * 0.01
        params[key] = values.to(host_dtype).cpu()
    return serialize_adapter(params, spec, base.name, dtype)


async def sglang_load_paths(shape: str, iterations: int, workdir: Path, ways: Sequence[str], layers: int = 0) -> dict:
    """publish -> first sample for each way a version can reach SGLang (`transport:blob dtype`), rotated every
    iteration, on one server (a dense shape; MoE shapes: moe_load_variants)."""
    model_dir = workdir.parent / f"lp-model-{shape}{f'-{layers}l' if layers else ''}"  # kept across runs
    started = time.perf_counter()
    write_shape_dir(shape, model_dir, layers)
    model_write_s = time.perf_counter() - started
    with embedded_storage(workdir, "bench-sampler") as storage:
        return await _sglang_load_paths(storage.model_copy(update={"data_dir": workdir}), shape, iterations,
                                        workdir, model_dir, model_write_s, list(ways))


def sglang_engine_options(shape: str, expert_form: str = "per_expert", server_args: Sequence[str] = ()) -> dict:
    """SGLangEngine keyword arguments of the load benchmark's one server for a shape (`expert_form`: how expert
    LoRA reaches a MoE shape's server; shared_outer runs it with --experts-shared-outer-loras; `server_args`: more
    SGLang arguments, after the shape's own)."""
    if server_args:
        options = sglang_engine_options(shape, expert_form)
        return {**options, "extra_server_args": [*options["extra_server_args"], *server_args]}
    if shape in MOE_SHAPES and expert_form != "per_expert":
        return {**sglang_engine_options(shape), "expert_form": expert_form}
    if shape in MOE_SHAPES:
        # Qwen3-30B-A3B's 61 GB of dummy bf16 weights, then per LoRA slot 3.3 GB of per-expert buffers (48 layers x
        # 128 experts x rank 32 x (2 x 2048 + 1536 + 768 + 2048) x 2 bytes): two slots (one adapter + the base),
        # the rest of 88% of an 80 GB GPU is KV cache. At most 4 versions in SGLang's host memory (3.3 GB each).
        return {"max_lora_rank": MOE_SHAPES[shape][1], "max_loras_per_batch": 2, "max_loaded_loras": 4,
                "startup_timeout_s": 420, "adapter_transport": "tensors",
                "extra_server_args": ["--load-format", "dummy", "--mem-fraction-static", "0.88",
                                      "--disable-cuda-graph", "--skip-tokenizer-init"]}
    return {"max_lora_rank": SHAPES[shape][1], "max_loras_per_batch": 4, "max_loaded_loras": 8,
            "extra_server_args": ["--mem-fraction-static", "0.5", "--disable-cuda-graph", "--skip-tokenizer-init"]}


async def _sglang_load_paths(settings, shape: str, iterations: int, workdir: Path, model_dir: Path,
                             model_write_s: float, ways: list[str]) -> dict:
    from sampler_svc.engines.base import GenerationRequest, SamplingOptions
    from sampler_svc.engines.sglang_engine import SGLangEngine, _base_model_facts

    rank = SHAPES[shape][1]
    registry = await start_registry_server(settings)
    engine = SGLangEngine(str(model_dir), launch_servers=1, work_dir=workdir / "sglang",
                          **sglang_engine_options(shape))
    started = time.perf_counter()
    sampler = await start_sampler_server(settings, registry_address=registry.address, base_model=str(model_dir),
                                         instance_id="bench", engine=engine, keep_versions=2, max_loaded=6)
    startup_s = time.perf_counter() - started
    client = RegistryClient(registry.address)
    facts = _base_model_facts(str(model_dir))

    def make_blob(seed: int, dtype: str) -> bytes:
        return random_adapter_blob(facts, seed, rank, dtype)
    load_s: dict[str, float] = {}
    load_done: dict[str, float] = {}
    real_load = engine.load_adapter

    async def timed_load(key, blob):
        began = time.perf_counter()
        try:
            return await real_load(key, blob)
        finally:
            load_done[key] = time.perf_counter()
            load_s[key] = load_done[key] - began

    engine.load_adapter = timed_load
    # Inside the engine's load: the HTTP call that hands the version to SGLang, until SGLang answers (its own load);
    # the rest of engine_load is the sampler's part (parse, layout conversion, serialization or the file write).
    sglang_call_s: dict[str, float] = {}
    real_load_call = engine.transport.load_call

    async def timed_load_call(server, key, path, request):
        began = time.perf_counter()
        try:
            return await real_load_call(server, key, path, request)
        finally:
            sglang_call_s[key] = sglang_call_s.get(key, 0.0) + time.perf_counter() - began

    engine.transport.load_call = timed_load_call
    # The sampler's download of each version (its own RegistryClient, in this process): when it began, how long.
    download_began: dict[str, float] = {}
    download_s: dict[str, float] = {}
    real_download = RegistryClient.download

    async def timed_download(self, name, version=0, alias=""):
        key = f"{name}@v{version}"
        download_began[key] = time.perf_counter()
        try:
            return await real_download(self, name, version, alias)
        finally:
            download_s[key] = time.perf_counter() - download_began[key]

    RegistryClient.download = timed_download
    prompt = list(range(100, 132))
    results: dict = {way: {"total": [], "publish": [], "committed": [], "event": [], "download": [],
                           "engine_load": [], "sglang_load": [], "first_token": []} for way in ways}
    adapter_of = {way: way.replace(":", "-") for way in ways}  # one adapter per way, its blobs in its dtype
    try:
        channel = grpc.aio.insecure_channel(sampler.address, options=channel_options())
        stub = sampler_pb2_grpc.SamplerServiceStub(channel)

        committed_at: dict[str, float] = {}

        sampled_at: dict[str, float] = {}

        async def publish_and_sample(name: str, blob: bytes) -> tuple[float, float, int]:
            began = time.perf_counter()
            version = await client.publish(name, blob)
            committed = committed_at[f"{name}@v{version.version}"] = time.perf_counter()
            reply = await stub.Sample(sampler_pb2.SampleRequest(
                adapter=common_pb2.AdapterRef(name=name, version=version.version), prompt_tokens=prompt,
                sampling_params=common_pb2.SamplingParams(max_tokens=1)))
            assert reply.served_version == version.version
            end = sampled_at[f"{name}@v{version.version}"] = time.perf_counter()
            return end - began, end - committed, version.version

        dtype_enum = {"float32": common_pb2.WEIGHTS_DTYPE_FLOAT32, "bfloat16": common_pb2.WEIGHTS_DTYPE_BFLOAT16}
        for way in ways:
            config = common_pb2.LoraConfig(rank=rank, alpha=2 * rank, weights_dtype=dtype_enum[way.split(":")[1]])
            await client.create_adapter(adapter_of[way], base_model=str(model_dir), lora_config=config)
        # Warm-up every way: the first load of a shape configures SGLang's LoRA kernels (~20 s).
        for n, way in enumerate(ways):
            transport, dtype = way.split(":")
            engine.adapter_transport = transport
            await publish_and_sample(adapter_of[way], make_blob(10_000 + n, dtype))

        # The same bytes every way -> the same greedy tokens and logprobs (the transfer is exact, see the engine);
        # bf16 blobs are the float32 one rounded, so they are compared among themselves. One way: nothing to compare.
        outputs = {}
        for way in ways if len(ways) > 1 else []:
            transport, dtype = way.split(":")
            engine.adapter_transport = transport
            key = f"same@{adapter_of[way]}"
            await real_load(key, make_blob(77, dtype))
            request = GenerationRequest(prompt_tokens=tuple(prompt), options=SamplingOptions(max_tokens=16,
                                        temperature=0.0), adapter_key=key)
            updates = [u async for u in engine.generate(request)]
            outputs[way] = ([t for u in updates for t in u.tokens], [x for u in updates for x in u.logprobs])
            await engine.unload_adapter(key)
        same_tokens, max_logprob_diff = True, 0.0
        for way in outputs:
            twin = next(w for w in ways if w.split(":")[1] == way.split(":")[1])
            same_tokens &= outputs[way][0] == outputs[twin][0]
            max_logprob_diff = max([max_logprob_diff, *(abs(a - b) for a, b in zip(outputs[way][1],
                                                                                      outputs[twin][1]))])
        if not outputs:  # one way: nothing was compared
            same_tokens, max_logprob_diff = None, None

        for index in range(iterations):
            shift = index % len(ways)
            for way in ways[shift:] + ways[:shift]:
                transport, dtype = way.split(":")
                engine.adapter_transport = transport
                blob = make_blob(1000 * (1 + ways.index(way)) + index, dtype)  # not timed
                total, committed, version = await publish_and_sample(adapter_of[way], blob)
                results[way]["total"].append(total)
                results[way]["publish"].append(total - committed)  # the registry's upload and commit
                results[way]["committed"].append(committed)
                key = f"{adapter_of[way]}@v{version}"
                # The engine's load finished -> the sample's reply: the first token (and the gRPC way back).
                results[way]["first_token"].append(sampled_at[key] - load_done.get(key, float("nan")))
                results[way]["engine_load"].append(load_s.get(key, float("nan")))
                results[way]["sglang_load"].append(sglang_call_s.get(key, float("nan")))
                results[way]["download"].append(download_s.get(key, float("nan")))
                # Commit -> the sampler starts downloading: the event's way to the watcher (it can be negative by
                # the publish reply's own way back, when the event outruns it).
                results[way]["event"].append(download_began.get(key, float("nan")) - committed_at[key])
                results[way].setdefault("blob_mb", round(len(blob) / 1e6, 1))
        await channel.close()
        server = engine.servers[0]
    finally:
        RegistryClient.download = real_download
        await client.close()
        await sampler.stop()
        await registry.stop()

    def summary(values: list[float]) -> dict:
        return {"p50": round(percentile(values, 50) * 1e3, 1), "p99": round(percentile(values, 99) * 1e3, 1),
                "min": round(min(values) * 1e3, 1), "max": round(max(values) * 1e3, 1)}

    return {
        "shape": shape, "rank": rank, "ways": ways, "iterations": iterations,
        "server": {"tp_size": server.tp_size, "dtype": server.dtype, "tensor_loads": server.tensor_loads},
        "sampler_startup_s": round(startup_s, 1), "model_write_s": round(model_write_s, 1),
        "same_greedy_tokens_both_ways": same_tokens, "max_logprob_diff_both_ways": max_logprob_diff,
        **{way: {name: summary(values) if isinstance(values, list) else values for name, values in parts.items()}
           for way, parts in results.items()},
        "raw_ms": {way: {name: [round(v * 1e3, 1) for v in values] for name, values in parts.items()
                         if isinstance(values, list)} for way, parts in results.items()},
    }


# ------------------------------------------------------------------------------------------------ qwen3moe

EXPERT_FORMS = ("per_expert", "stacked")
MOE_PHASES = ("publish", "event", "download", "convert", "pack", "sglang_call", "first_token", "committed", "total")


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


async def moe_load_variants(shape: str, iterations: int, workdir: Path, layouts: Sequence[str],
                            forms: Sequence[str], layers: int = 0, deadline_s: float = 0.0,
                            sglang_url: str = "") -> dict:
    """publish -> first sample of a MoE expert adapter for every (expert layout, SGLang expert form) on ONE SGLang
    server (dummy weights), each version's phases printed as it completes, so a run cut short still explains its
    time. `deadline_s` (from the start of this call, 0: none): no version is started after it."""
    started = time.perf_counter()
    model_dir = workdir.parent / f"lp-model-{shape}{f'-{layers}l' if layers else ''}"  # kept across runs
    write_shape_dir(shape, model_dir, layers)
    _say(f"model directory {model_dir} ready ({time.perf_counter() - started:.1f} s)")
    with embedded_storage(workdir, "bench-sampler") as storage:
        return await _moe_load_variants(storage.model_copy(update={"data_dir": workdir}), shape, iterations, workdir,
                                        model_dir, list(layouts), list(forms),
                                        started + deadline_s if deadline_s else float("inf"), sglang_url)


async def _moe_load_variants(settings, shape: str, iterations: int, workdir: Path, model_dir: Path,
                             layouts: list[str], forms: list[str], deadline: float, sglang_url: str) -> dict:
    from sampler_svc.engines.sglang_engine import SGLangEngine, _base_model_facts

    rank = MOE_SHAPES[shape][1]
    registry = await start_registry_server(settings)
    options = sglang_engine_options(shape)
    if sglang_url:  # a server already running on this host (a smoke run against a stand-in)
        engine = SGLangEngine(str(model_dir), urls=[sglang_url], work_dir=workdir / "sglang",
                              **{k: v for k, v in options.items() if k != "extra_server_args"})
        engine.shared_memory_tensors = "loopback"
    else:
        engine = SGLangEngine(str(model_dir), launch_servers=1, work_dir=workdir / "sglang", **options)
    began = time.perf_counter()
    # A version is 2.6 GB: one kept per adapter; SGLang holds at most 4 in host memory.
    sampler = await start_sampler_server(settings, registry_address=registry.address, base_model=str(model_dir),
                                         instance_id="bench", engine=engine, keep_versions=1, max_loaded=3)
    startup_s = time.perf_counter() - began
    server = engine.servers[0]
    _say(f"SGLang + sampler up in {startup_s:.1f} s (tp {server.tp_size}, dtype {server.dtype}, tensors through "
         f"shared memory: {engine.transport.shares_memory(server)})")
    client = RegistryClient(registry.address)
    facts = _base_model_facts(str(model_dir))

    # Per version key: phase -> seconds, and the moments between them.
    phases: dict[str, dict[str, float]] = {}
    moments: dict[str, dict[str, float]] = {}
    notes: dict[str, dict] = {}

    def phase(key: str, name: str, seconds: float) -> None:
        phases.setdefault(key, {})[name] = phases.get(key, {}).get(name, 0.0) + seconds

    real_load, real_call, real_body = engine.load_adapter, engine.transport.load_call, engine.transport.tensor_body

    async def timed_load(key, blob):
        t = time.perf_counter()
        try:
            return await real_load(key, blob)
        finally:
            moments.setdefault(key, {})["loaded"] = time.perf_counter()
            phase(key, "engine_load", time.perf_counter() - t)

    async def timed_call(server, key, path, request):
        t = time.perf_counter()
        notes.setdefault(key, {})["request_mb"] = round(len(request) / 1e6, 3)
        try:
            return await real_call(server, key, path, request)
        finally:
            phase(key, "sglang_call", time.perf_counter() - t)

    def timed_body(key, params, spec, base_name, server, shared):
        t = time.perf_counter()
        request, packed = real_body(key, params, spec, base_name, server, shared)
        phase(key, "pack", time.perf_counter() - t)
        notes.setdefault(key, {}).update(shared_memory=packed.shared, packed_mb=round(packed.nbytes / 1e6, 1),
                                         tensors=len(packed.layout))
        return request, packed

    engine.load_adapter, engine.transport.load_call, engine.transport.tensor_body = timed_load, timed_call, timed_body
    real_download = RegistryClient.download

    async def timed_download(self, name, version=0, alias=""):
        key = f"{name}@v{version}"
        moments.setdefault(key, {})["download"] = time.perf_counter()
        try:
            return await real_download(self, name, version, alias)
        finally:
            phase(key, "download", time.perf_counter() - moments[key]["download"])

    RegistryClient.download = timed_download
    prompt = list(range(100, 132))
    variants = [(layout, form) for form in forms for layout in layouts]
    records: list[dict] = []
    same: dict = {}
    try:
        channel = grpc.aio.insecure_channel(sampler.address, options=channel_options())
        stub = sampler_pb2_grpc.SamplerServiceStub(channel)
        layout_enum = {"per_expert": common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT,
                       "shared_outer": common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER}
        for layout in layouts:
            config = common_pb2.LoraConfig(rank=rank, alpha=2 * rank, weights_dtype=common_pb2.WEIGHTS_DTYPE_BFLOAT16,
                                           expert_layout=layout_enum[layout])
            config.target_modules.extend(MOE_TARGETS)
            await client.create_adapter(f"moe-{layout}", base_model=str(model_dir), lora_config=config)

        async def one(layout: str, form: str, seed: int, label: str) -> dict:
            engine.tensor_expert_form = form
            t = time.perf_counter()
            blob = random_moe_adapter_blob(facts, seed, rank, "bfloat16", layout)
            made_s = time.perf_counter() - t
            name = f"moe-{layout}"
            t0 = time.perf_counter()
            version = await client.publish(name, blob)
            committed = time.perf_counter()
            key = f"{name}@v{version.version}"
            reply = await stub.Sample(sampler_pb2.SampleRequest(
                adapter=common_pb2.AdapterRef(name=name, version=version.version), prompt_tokens=prompt,
                sampling_params=common_pb2.SamplingParams(max_tokens=1)))
            end = time.perf_counter()
            assert reply.served_version == version.version
            got = dict(phases.get(key, {}))
            at = moments.get(key, {})
            got.update(publish=committed - t0, committed=end - committed, total=end - t0,
                       event=at.get("download", float("nan")) - committed,
                       first_token=end - at.get("loaded", float("nan")))
            got["convert"] = got.get("engine_load", float("nan")) - got.get("sglang_call", 0.0) - got.get("pack", 0.0)
            record = {"variant": f"{layout}/{form}", "label": label, "key": key, "blob_mb": round(len(blob) / 1e6, 1),
                      "blob_make_s": round(made_s, 2), **notes.get(key, {}),
                      **{p: round(got.get(p, float("nan")), 3) for p in (*MOE_PHASES, "engine_load")}}
            _say(f"{record['variant']:<24} {label:<7} {record['blob_mb']} MB, {record.get('tensors', '?')} tensors, "
                 f"request {record.get('request_mb', '?')} MB, shared memory {record.get('shared_memory', '?')}: "
                 f"publish {got['publish']:.2f} s | event {got['event']:.3f} | download {got.get('download', 0):.2f} "
                 f"| convert {got['convert']:.2f} | pack {got.get('pack', 0):.2f} | SGLang load call "
                 f"{got.get('sglang_call', 0):.2f} | first token {got['first_token']:.2f} || committed->sample "
                 f"{got['committed']:.2f} s, publish->sample {got['total']:.2f} s")
            return record

        # The first load of the shape configures SGLang's LoRA kernels: one warm-up version, not measured.
        records.append(await one(variants[0][0], variants[0][1], 10_000, "warm-up"))
        for index in range(iterations):
            shift = index % len(variants)
            for layout, form in variants[shift:] + variants[:shift]:
                if time.perf_counter() > deadline:
                    _say(f"deadline reached: {layout}/{form} iteration {index + 1} not run")
                    continue
                records.append(await one(layout, form, 1000 * (1 + variants.index((layout, form))) + index,
                                         f"iter {index + 1}"))
        # Both forms of one blob serve the same greedy tokens and logprobs (their SGLang buffers hold the same
        # numbers): the stacked form is checked against the per-expert one the GPU tests verified.
        if len(forms) > 1 and time.perf_counter() < deadline:
            blob = random_moe_adapter_blob(facts, 77, rank, "bfloat16", layouts[0])
            outputs = {}
            for form in forms:
                engine.tensor_expert_form = form
                key = f"same-{form}@v1"
                await real_load(key, blob)
                request = GenerationRequest(prompt_tokens=tuple(prompt), adapter_key=key,
                                            options=SamplingOptions(max_tokens=16, temperature=0.0))
                updates = [u async for u in engine.generate(request)]
                outputs[form] = ([t for u in updates for t in u.tokens], [x for u in updates for x in u.logprobs])
                await engine.unload_adapter(key)
            reference = outputs[forms[0]]
            same = {"same_greedy_tokens": all(o[0] == reference[0] for o in outputs.values()),
                    "max_logprob_diff": max(abs(a - b) for o in outputs.values() for a, b in zip(o[1], reference[1]))}
            _say(f"forms {forms} on one blob: {same}")
        await channel.close()
    finally:
        RegistryClient.download = real_download
        await client.close()
        await sampler.stop()
        await registry.stop()

    summary = {}
    for layout, form in variants:
        rows = [r for r in records if r["variant"] == f"{layout}/{form}" and r["label"] != "warm-up"]
        if rows:
            summary[f"{layout}/{form}"] = {p: round(statistics.median(r[p] for r in rows), 3) for p in MOE_PHASES}
            summary[f"{layout}/{form}"]["n"] = len(rows)
    return {"shape": shape, "rank": rank, "iterations": iterations, "layouts": layouts, "forms": forms,
            "target_s": 2.0, "sampler_startup_s": round(startup_s, 1),
            "server": {"tp_size": server.tp_size, "dtype": server.dtype, "tensor_loads": server.tensor_loads},
            "median_s": summary, "forms_agree": same, "versions": records}


def print_moe_summary(result: dict) -> None:
    print(f"\n{result['shape']} rank {result['rank']}, median seconds per version (target publish->sample <= "
          f"{result['target_s']} s):")
    print(f"{'layout/form':<26}" + "".join(f"{p:>12}" for p in MOE_PHASES) + f"{'n':>4}")
    for variant, values in result["median_s"].items():
        print(f"{variant:<26}" + "".join(f"{values[p]:>12.3f}" for p in MOE_PHASES) + f"{values['n']:>4}")


# ------------------------------------------------------------------------------------------------ push

# The paths a version takes to the sampler, alternated in one run: pushed by the trainer's handoff through this
# host's shared memory (a colocated sampler), pushed as a gRPC stream (what a sampler on another host gets: a
# disaggregated deployment; here on loopback), or not pushed at all (the sampler downloads it from the registry).
PUSH_PATHS = ("push:shared_memory", "push:stream", "registry")
PUSH_FLEET = "bench-push"
# --push on the torch engine (CPU): shape -> (model name, adapter rank).
TORCH_PUSH_SHAPES = {"tiny": ("tiny", 8), "tiny-moe": ("tiny-moe", 8), "smollm2": ("smollm2-135m-instruct", 16)}
# Moments of a version, each from the start of its publish (milliseconds in the results).
# commit: the registry's commit (a pushed version's reservation; a registry-path version's upload and commit);
# stored: the pushed version's upload landed (after the answer: `publish_ack = "pushed"`).
PUSH_PHASES = ("make", "push_done", "staged", "commit", "ack", "load_start", "loaded", "first_sample", "stored")


def random_lora_params(base, spec, seed: int) -> dict[str, torch.Tensor]:
    """Random LoRA tensors of `spec` on `base` (its shapes only: it may live on the meta device), in the trainer's
    own layout (a shared-outer expert adapter's shared factors once): A uniform with kaiming's bound, B small and
    random (not zero). Drawn on the GPU when there is one, a tensor at a time, and kept on the host in fp32."""
    import math

    from loraplane.lora import expected_shapes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    params = {}
    for key, shape in expected_shapes(base, spec).items():
        if key.endswith("lora_A.weight"):
            values = (torch.rand(shape, generator=generator, device=device) * 2 - 1) / math.sqrt(shape[1])
        else:
            values = torch.randn(shape, generator=generator, device=device) * 0.01
        params[key] = values.cpu()
    return params


def push_variants(moe: bool, layouts: Sequence[str], paths: Sequence[str]) -> list[tuple[str, str]]:
    """(expert layout or "dense", path) of every version kind a round publishes."""
    return [(layout, path) for layout in (layouts if moe else ["dense"]) for path in paths]


async def push_to_first_sample(engine_name: str, shape: str, iterations: int, workdir: Path, paths: Sequence[str],
                               layouts: Sequence[str], dtype: str, layers: int = 0, deadline_s: float = 0.0,
                               expert_form: str = "per_expert", server_args: Sequence[str] = ()) -> dict:
    """publish -> first sample of each version, published as the trainer's PublishWeights does (the blob made and
    hashed, pushed by trainer_svc.handoff.Handoff to the deployment's sampler while the registry reserves the
    version, answered then, the upload beside: trainer_svc/upload_spool.py), alternated with versions that are not
    pushed (answered after the upload and commit); each
    version's path as the sampler reports it. `deadline_s` (from the start, 0: none): no version starts after it."""
    started = time.perf_counter()
    if engine_name == "sglang":
        model = workdir.parent / f"lp-model-{shape}{f'-{layers}l' if layers else ''}"  # kept across runs
        write_shape_dir(shape, model, layers)
        model = str(model)
        rank = (MOE_SHAPES.get(shape) or SHAPES[shape])[1]
    else:
        model, rank = TORCH_PUSH_SHAPES[shape]
    _say(f"model {model} ready ({time.perf_counter() - started:.1f} s)")
    with embedded_storage(workdir, "bench-sampler") as storage:
        settings = storage.model_copy(update={"data_dir": workdir, "sampler_fleet": PUSH_FLEET})
        return await _push_to_first_sample(settings, engine_name, shape, model, rank, iterations, workdir,
                                           list(paths), list(layouts), dtype,
                                           started + deadline_s if deadline_s else float("inf"), expert_form,
                                           server_args)


async def _push_to_first_sample(settings, engine_name: str, shape: str, model: str, rank: int, iterations: int,
                                workdir: Path, paths: list[str], layouts: list[str], dtype: str,
                                deadline: float, expert_form: str = "per_expert", server_args: Sequence[str] = ()
                                ) -> dict:
    from loraplane.adapter_format import COMPACT_FORMAT, FORMAT_VERSION_KEY, adapter_writer, blob_metadata
    from loraplane.lora import LoraSpec
    from loraplane.membership import Membership
    from loraplane.registry_client import CHUNK_BYTES, StreamedBlob
    from trainer_svc import handoff as handoff_module
    from trainer_svc.upload_spool import UploadSpool, publish_before_upload

    moe = shape in MOE_SHAPES or shape == "tiny-moe"
    registry = await start_registry_server(settings)
    began = time.perf_counter()
    if engine_name == "sglang":
        from sampler_svc.engines.sglang_engine import SGLangEngine, _base_model_facts

        engine = SGLangEngine(model, launch_servers=1, work_dir=workdir / "sglang",
                              **sglang_engine_options(shape, expert_form, server_args))
        # A MoE version is GBs: one kept per adapter (SGLang holds at most 4 in host memory).
        keep, max_loaded = (1, 3) if moe else (2, 6)
        base = _base_model_facts(model)
    else:
        engine, keep, max_loaded = "torch", 2, 8
        base = load_base_model(model)
    try:
        sampler = await start_sampler_server(settings, registry_address=registry.address, base_model=model,
                                             instance_id="bench-push", fleet=PUSH_FLEET, engine=engine,
                                             keep_versions=keep, max_loaded=max_loaded)
    except BaseException:
        await registry.stop()
        raise
    startup_s = time.perf_counter() - began
    _say(f"registry + sampler ({engine_name}) up in {startup_s:.1f} s")
    # The trainer's handoff as trainer_svc/server.py builds it: this deployment's sampler fleet from Redis.
    handoff = handoff_module.Handoff(Membership(settings.redis_url, key_prefix=settings.key_prefix, fleet=PUSH_FLEET),
                                     None, preload=settings.sampler_fleet_preload)
    client = RegistryClient(registry.address)
    spool = UploadSpool(workdir / "trainer-uploads", client)

    # Per version (its blob's sha256 until the version is known, then its key): moment name -> perf_counter().
    by_sha: dict[str, dict[str, float]] = {}
    by_key: dict[str, dict[str, float]] = {}
    outcomes: dict[str, dict[str, str]] = {}
    real_push, real_finish = handoff.push, sampler.manager.staging.finish
    real_load, real_download = sampler.engine.load_adapter, RegistryClient.download

    async def timed_push(adapter, blob):
        try:
            result = outcomes[blob.sha256] = await real_push(adapter, blob)
            return result
        finally:
            by_sha.setdefault(blob.sha256, {})["push_done"] = time.perf_counter()

    async def timed_finish(incoming, blob, hasher=None):
        await real_finish(incoming, blob, hasher)
        by_sha.setdefault(incoming.sha256, {})["staged"] = time.perf_counter()

    async def timed_load(key, blob):
        by_key.setdefault(key, {})["load_start"] = time.perf_counter()
        try:
            return await real_load(key, blob)
        finally:
            by_key[key]["loaded"] = time.perf_counter()

    async def timed_download(self, name, version=0, alias=""):
        key = f"{name}@v{version}"
        t = time.perf_counter()
        try:
            return await real_download(self, name, version, alias)
        finally:
            by_key.setdefault(key, {})["download_s"] = time.perf_counter() - t

    handoff.push, sampler.manager.staging.finish = timed_push, timed_finish
    untracked = _one_tracker_per_role()
    sampler.engine.load_adapter, RegistryClient.download = timed_load, timed_download
    prompt = list(range(100, 132))
    variants = push_variants(moe, layouts, paths)
    adapter_of = {v: f"push-{v[0].replace('_', '-')}-{v[1].replace(':', '-').replace('_', '-')}" for v in variants}
    records: list[dict] = []
    wrong: list[str] = []
    try:
        deadline_at = time.monotonic() + 30
        while not await handoff.targets("any"):  # the sampler's first heartbeat is in Redis before it answers
            assert time.monotonic() < deadline_at, "the sampler never appeared in its fleet's membership"
            await asyncio.sleep(0.05)
        layout_enum = {"per_expert": common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT,
                       "shared_outer": common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER}
        dtype_enum = {"float32": common_pb2.WEIGHTS_DTYPE_FLOAT32, "bfloat16": common_pb2.WEIGHTS_DTYPE_BFLOAT16}
        for variant, name in adapter_of.items():
            config = common_pb2.LoraConfig(rank=rank, alpha=2 * rank, weights_dtype=dtype_enum[dtype])
            if moe:
                config.expert_layout = layout_enum[variant[0]]
                config.target_modules.extend(MOE_TARGETS)
            await client.create_adapter(name, base_model=model, lora_config=config)
        channel = grpc.aio.insecure_channel(sampler.address, options=channel_options())
        stub = sampler_pb2_grpc.SamplerServiceStub(channel)
        model_type = getattr(getattr(base, "family", None), "model_type", "")

        async def one(variant: tuple[str, str], seed: int, label: str) -> dict:
            layout, path = variant
            name = adapter_of[variant]
            spec = (LoraSpec.create(rank, 2.0 * rank, MOE_TARGETS, seed=seed, expert_layout=layout) if moe
                    else LoraSpec.create(rank, 2.0 * rank, seed=seed))
            params = random_lora_params(base, spec, seed)  # not timed: the trainer's export is not this bench's
            writer = adapter_writer(params, spec, base.name, dtype, model_type=model_type)
            blob = StreamedBlob(writer.size, writer.chunks(CHUNK_BYTES))
            # PublishWeights from here on (trainer_svc/service.py _finish_publish): made and hashed in one pass;
            # a pushed version is answered once reserved and pushed, its upload beside (upload_spool.py); a
            # registry-path version after its upload and commit.
            t0 = time.perf_counter()
            await asyncio.to_thread(blob.make)
            made = time.perf_counter()
            del params
            pushed_path = path.startswith("push:")
            moments: dict[str, float] = {}
            upload = None
            if pushed_path:
                handoff.shared_memory = path == "push:shared_memory"

                async def reserved(_version) -> None:
                    moments["commit"] = time.perf_counter()

                version, upload = await publish_before_upload(client, handoff, spool, name, blob,
                                                              idempotency_key=f"{name}-{seed}", reserved=reserved)
                if upload is not None:
                    upload.add_done_callback(lambda _t: moments.setdefault("stored", time.perf_counter()))
            else:
                version = await client.publish(name, blob)
                moments["commit"] = moments["stored"] = time.perf_counter()
            acked = time.perf_counter()
            # The RL loop's next call: a sample of exactly that version.
            reply = await stub.Sample(sampler_pb2.SampleRequest(
                adapter=common_pb2.AdapterRef(name=name, version=version.version), prompt_tokens=prompt,
                sampling_params=common_pb2.SamplingParams(max_tokens=1)))
            end = time.perf_counter()
            if upload is not None:
                await upload  # the next version's numbers do not share the host with this upload
            key = f"{name}@v{version.version}"
            loaded = next((e for e in sampler.manager.list_loaded() if e.key == key), None)
            format_ = blob_metadata(_header_bytes(blob)).get(FORMAT_VERSION_KEY, "1")
            at = {**by_sha.pop(blob.sha256, {}), **by_key.get(key, {}), **moments, "make": made, "ack": acked,
                  "first_sample": end}
            expected = "push" if pushed_path else "registry"
            pushed = outcomes.pop(blob.sha256, {})
            record = {"variant": f"{layout}/{path}", "label": label, "key": key, "blob_mb": round(blob.size / 1e6, 2),
                      "format": format_, "expected_path": expected,
                      "path": loaded.path if loaded is not None else "not loaded",
                      "served_version": reply.served_version, "push_outcomes": sorted(pushed.values()),
                      **{f"{p}_ms": round((at[p] - t0) * 1e3, 2) if p in at else None for p in PUSH_PHASES},
                      "download_ms": round(at["download_s"] * 1e3, 2) if "download_s" in at else None,
                      "load_ms": round((at["loaded"] - at["load_start"]) * 1e3, 2) if "loaded" in at else None}
            problems = []
            if reply.served_version != version.version:
                problems.append(f"served v{reply.served_version}, asked v{version.version}")
            if record["path"] != expected:
                problems.append(f"path {record['path']}, expected {expected}")
            if pushed_path and record["push_outcomes"] != [path.split(":")[1]]:
                problems.append(f"push outcomes {record['push_outcomes']}, expected [{path.split(':')[1]}]")
            if moe and layout == "shared_outer" and format_ != COMPACT_FORMAT:
                problems.append(f"shared-outer blob in format {format_}, not the compact {COMPACT_FORMAT}")
            if problems:
                wrong.append(f"{key} ({record['variant']}, {label}): " + "; ".join(problems))
            record["ok"] = not problems
            _say(f"{record['variant']:<32} {label:<8} {record['blob_mb']:>9} MB fmt {format_} path "
                 f"{record['path']:<8} | " + " ".join(f"{p} {record[p + '_ms']}" for p in PUSH_PHASES
                                                      if record[p + "_ms"] is not None)
                 + f" | load {record['load_ms']} download {record['download_ms']} ms"
                 + ("" if record["ok"] else "  <-- WRONG: " + "; ".join(problems)))
            return record

        # Not measured: the first load of a shape configures the engine's LoRA kernels, the first push of each way
        # opens its connection. Each path and each expert layout once (a MoE version takes many seconds).
        kinds = sorted({v[0] for v in variants}, key=[v[0] for v in variants].index)
        warm = [(kinds[i % len(kinds)], path) for i, path in enumerate(paths)]
        warm += [(kind, paths[0]) for kind in kinds[len(paths):]]
        for n, variant in enumerate(warm):
            records.append(await one(variant, 10_000 + n, "warm-up"))
        for index in range(iterations):
            for variant in rotation(variants, index):
                if time.perf_counter() > deadline:
                    _say(f"deadline reached: {variant} iteration {index + 1} not run")
                    continue
                records.append(await one(variant, 1000 * (1 + variants.index(variant)) + index, f"iter {index + 1}"))
        await channel.close()
    finally:
        RegistryClient.download = real_download
        await spool.close()
        await handoff.close()
        untracked()
        await client.close()
        await sampler.stop()
        await registry.stop()

    summary = {}
    for layout, path in variants:
        rows = [r for r in records if r["variant"] == f"{layout}/{path}" and r["label"] != "warm-up"]
        if rows:
            summary[f"{layout}/{path}"] = {
                "n": len(rows), "paths": sorted({r["path"] for r in rows}), "blob_mb": rows[0]["blob_mb"],
                "format": rows[0]["format"],
                "total_ms": latency_summary([r["first_sample_ms"] / 1e3 for r in rows]),
                **{f"{p}_ms_p50": _median([r[f"{p}_ms"] for r in rows]) for p in (*PUSH_PHASES, "load", "download")}}
    for variant, values in summary.items():
        registry_path = summary.get(variant.split("/")[0] + "/registry")
        if registry_path and not variant.endswith("/registry"):
            # < 1: the push path is that much faster than the registry path in the same run.
            values["total_p50_vs_registry"] = round(values["total_ms"]["p50_ms"] / registry_path["total_ms"]["p50_ms"],
                                                    3)
    return {"shape": shape, "engine": engine_name, "model": model, "rank": rank, "dtype": dtype,
            "iterations": iterations, "paths": paths, "layouts": layouts if moe else None,
            "targets_ms": {"llama8b": 150, "qwen3moe": 1000}, "sampler_startup_s": round(startup_s, 1),
            "handoff_pushes": dict(handoff.pushes), "summary": summary, "wrong_paths": wrong, "versions": records}


def _one_tracker_per_role():
    """This one process is both the trainer and the sampler, so they share one multiprocessing resource tracker: the
    sampler's attach takes the handoff's segment off it (sampler_svc/staging.py), and the pusher's unlink taking it
    off again makes the tracker print a KeyError per version. Each segment is taken off once here, as it is where
    the two are processes of their own. Returns the function that undoes this."""
    from multiprocessing import resource_tracker

    tracked: set[str] = set()
    real_register, real_unregister = resource_tracker.register, resource_tracker.unregister

    def register(name, rtype):
        tracked.add(name)
        real_register(name, rtype)

    def unregister(name, rtype):
        if name in tracked:
            tracked.discard(name)
            real_unregister(name, rtype)

    resource_tracker.register, resource_tracker.unregister = register, unregister

    def undo() -> None:
        resource_tracker.register, resource_tracker.unregister = real_register, real_unregister
    return undo


def _header_bytes(blob) -> bytes:
    """The safetensors header of a made StreamedBlob (its first pieces, as far as the header goes)."""
    head, index = b"", 0
    while len(head) < 8 or len(head) < 8 + int.from_bytes(head[:8], "little"):
        head += blob.made(index)
        index += 1
    return head


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def print_push_summary(result: dict) -> None:
    target = result["targets_ms"].get(result["shape"])
    print_table(f"publish -> first sample through the handoff: {result['shape']} rank {result['rank']} "
                f"{result['dtype']} ({result['engine']} engine), p50 ms from the publish's start"
                + (f"; target <= {target} ms" if target else ""),
                ["layout/path", "MB", "fmt", "sampler path", "n", "total p50", "total p99", "÷ registry", "made",
                 "push done", "staged", "commit", "ack", "load start", "loaded", "first sample", "stored", "load",
                 "download"],
                [[variant, f"{s['blob_mb']:g}", s["format"], ",".join(s["paths"]), s["n"], s["total_ms"]["p50_ms"],
                  s["total_ms"]["p99_ms"], f"{s['total_p50_vs_registry']:.2f}" if "total_p50_vs_registry" in s else "-",
                  *(_cell(s[f"{p}_ms_p50"]) for p in ("make", "push_done", "staged", "commit", "ack", "load_start",
                                                       "loaded", "first_sample", "stored", "load", "download"))]
                 for variant, s in result["summary"].items()], width=220)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--engine", choices=["torch", "sglang"], default="torch")
    parser.add_argument("--shape", choices=sorted({*SHAPES, *MOE_SHAPES, *TORCH_PUSH_SHAPES}),
                        help="sglang: tensors vs files publish -> first sample on a random-weight model this "
                             "shape (qwen3moe: Qwen3-30B-A3B, dummy weights, tensors only); with --push the shape "
                             "published (torch engine: tiny, tiny-moe, smollm2; default tiny-moe)")
    parser.add_argument("--push", action="store_true",
                        help="publish -> first sample through the trainer's handoff (trainer_svc.handoff.Handoff) "
                             "per path (--push-paths), alternated in one run; fails if a version took another path")
    parser.add_argument("--push-paths", nargs="+", choices=PUSH_PATHS, default=list(PUSH_PATHS),
                        help="--push: the paths compared (default all)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="--push: the adapters' weights dtype (the blob's)")
    parser.add_argument("--quick", action="store_true",
                        help="--push: 3 iterations (about a minute on CPU with --shape tiny or tiny-moe)")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=None,
                        help="with --shape: transport:blob dtype of the versions compared (default file:float32 "
                             "file:bfloat16; qwen3moe: tensors:bfloat16)")
    parser.add_argument("--expert-layouts", nargs="+", choices=["per_expert", "shared_outer"],
                        default=["per_expert", "shared_outer"], help="qwen3moe: the adapters' expert layouts")
    parser.add_argument("--expert-forms", nargs="+", choices=EXPERT_FORMS, default=list(EXPERT_FORMS),
                        help="qwen3moe: the forms expert LoRA reaches SGLang in (SGLangEngine.tensor_expert_form)")
    parser.add_argument("--sglang-expert-form", choices=["per_expert", "stacked", "shared_outer"],
                        default="per_expert",
                        help="--push on a MoE shape: how expert LoRA reaches SGLang (shared_outer: the server runs "
                             "--experts-shared-outer-loras and takes shared-outer adapters only)")
    parser.add_argument("--sglang-server-arg", action="append", default=[], dest="sglang_server_args",
                        help="--push: one more argument for the launched SGLang server (repeat; e.g. "
                             "--sglang-server-arg=--enable-lora-overlap-loading)")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="qwen3moe: start no version after this many seconds (0: no limit)")
    parser.add_argument("--sglang-url", default="",
                        help="qwen3moe: use this SGLang server on this host instead of launching one")
    parser.add_argument("--layers", type=int, default=0,
                        help="qwen3moe: the first N layers only (default all 48; the adapter shrinks with them)")
    args = parser.parse_args(argv)
    if args.push:
        args.shape = args.shape or ("tiny-moe" if args.engine == "torch" else "llama8b")
        if args.engine == "torch" and args.shape not in TORCH_PUSH_SHAPES:
            parser.error(f"--push on the torch engine runs {', '.join(TORCH_PUSH_SHAPES)} (the GPU shapes need "
                         "--engine sglang)")
        if args.engine == "sglang" and args.shape in TORCH_PUSH_SHAPES and args.shape not in SHAPES:
            parser.error(f"--shape {args.shape} is a torch-engine shape")
        if args.quick:
            args.iterations = 3
        return args
    if args.shape in TORCH_PUSH_SHAPES and args.shape not in SHAPES:
        parser.error(f"--shape {args.shape} is for --push on the torch engine")
    if args.shape in MOE_SHAPES and args.ways:
        parser.error(f"--shape {args.shape} is served with --load-format dummy, whose SGLang cannot read adapter "
                     "files: its versions go as bf16 tensors (--expert-forms, --expert-layouts choose what is compared)")
    args.ways = args.ways or ["file:float32", "file:bfloat16"]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.push:
        # A fixed folder, kept: the SGLang server's log is there when something fails.
        workdir = Path(tempfile.gettempdir()) / f"lp-bench-push-{args.shape}"
        shutil.rmtree(workdir, ignore_errors=True)
        result = asyncio.run(push_to_first_sample(args.engine, args.shape, args.iterations, workdir, args.push_paths,
                                                  args.expert_layouts, args.dtype, args.layers, args.deadline_s,
                                                  args.sglang_expert_form, args.sglang_server_args))
        result["layers"] = args.layers or None
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result["environment"] = environment()
        print(json.dumps({k: v for k, v in result.items() if k != "versions"}, indent=2))
        print_push_summary(result)
        out = write_results(f"sampler_push_{args.shape}", result)
        print(f"wrote {out}")
        if result["wrong_paths"]:
            print("FAILED: versions that did not take their expected path (or were served wrong):", file=sys.stderr)
            for line in result["wrong_paths"]:
                print(f"  {line}", file=sys.stderr)
            sys.exit(1)
        return
    if args.shape in MOE_SHAPES:
        workdir = Path(tempfile.gettempdir()) / f"lp-bench-load-{args.shape}"
        shutil.rmtree(workdir, ignore_errors=True)
        result = asyncio.run(moe_load_variants(args.shape, args.iterations, workdir, args.expert_layouts,
                                               args.expert_forms, args.layers, args.deadline_s, args.sglang_url))
        result["layers"] = args.layers or None
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        out = REPO / "bench" / "results" / f"sampler_sglang_load_{args.shape}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print_moe_summary(result)
        return
    if args.shape:
        # A fixed folder, kept: the SGLang server's log is there when something fails.
        workdir = Path(tempfile.gettempdir()) / f"lp-bench-load-{args.shape}"
        shutil.rmtree(workdir, ignore_errors=True)
        result = asyncio.run(sglang_load_paths(args.shape, args.iterations, workdir, args.ways, args.layers))
        result["layers"] = args.layers or None
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(json.dumps(result, indent=2))
        for way in args.ways:
            parts = result[way]
            print(f"{args.shape} rank {result['rank']} ({parts['blob_mb']} MB) {way:<16} publish->sample p50 "
                  f"{parts['total']['p50']:>8.1f} ms p99 {parts['total']['p99']:>8.1f} ms  committed->sample "
                  f"{parts['committed']['p50']:>8.1f} ms  "
                  f"(event {parts['event']['p50']:>6.1f} ms, download {parts['download']['p50']:>7.1f} ms, "
                  f"engine load {parts['engine_load']['p50']:>7.1f} ms of which SGLang's "
                  f"{parts['sglang_load']['p50']:>7.1f} ms, first token {parts['first_token']['p50']:>6.1f} "
                  f"ms; publish {parts['publish']['p50']:>7.1f} ms)")
        out = REPO / "bench" / "results" / f"sampler_sglang_load_{args.shape}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        return
    device = torch.cuda.get_device_name() if args.engine == "sglang" else "cpu"
    results: dict = {"model": args.model, "engine": args.engine, "device": device,
                     "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    if not args.skip_latency:
        with tempfile.TemporaryDirectory(prefix="bench-sampler-") as workdir:
            results["publish_to_first_sample"] = asyncio.run(
                publish_to_first_sample(args.model, args.iterations, Path(workdir), args.engine))
    if not args.skip_decode:
        with tempfile.TemporaryDirectory(prefix="bench-sampler-decode-") as workdir:
            results["decode"] = asyncio.run(
                decode_throughput(args.model, args.tokens, args.repeats, args.engine, Path(workdir)))

    print(json.dumps(results, indent=2))
    print()
    print(f"{'metric':<52} {'value':>12}")
    if "publish_to_first_sample" in results:
        latency = results["publish_to_first_sample"]
        for name in ("publish_then_sample_ms", "committed_then_sample_ms", "publish_then_watcher_loaded_ms"):
            for q in ("p50", "p99"):
                print(f"{name + ' ' + q + ' (' + str(latency['adapter_mb']) + ' MB)':<52} {latency[name][q]:>12.1f}")
    if "decode" in results:
        decode = results["decode"]
        for name, rate in decode["tokens_per_s"].items():
            print(f"{'decode tok/s (' + args.engine + '), 16 rows, ' + name:<52} {rate:>12.1f}")
        print(f"{'ratio 8 adapters / 1 adapter (target >= 0.8)':<52} {decode['ratio_8_vs_1_adapter']:>12.2f}")
        print(f"{'ratio 1 adapter / base':<52} {decode['ratio_1_adapter_vs_base']:>12.2f}")
    out = REPO / "bench" / "results" / ("sampler.json" if args.engine == "torch" else f"sampler_{args.engine}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
