"""PublishWeights benchmark: export + serialize + upload of one adapter version to a real registry, old path vs new.

What the trainer's PublishWeights does after its worker has the adapter, timed until the registry has committed
the version: the export (host copies of the params, `TrainerBackend.export_params`), the PEFT safetensors file, and
the upload through `RegistryClient.publish` to a registry process on embedded Valkey + SeaweedFS (loopback). Three
ways for each weights dtype (float32, and bfloat16 as LoraConfig.weights_dtype asks), alternately in each round,
each publish of distinct content (so nothing is deduplicated):

  whole      the old path: the whole blob built (serialize_adapter), then hashed, then sent with the digest in the
             header; the registry streams it into S3 as it arrives
  made       the blob's chunks made and hashed in one pass (StreamedBlob.make), then sent with the digest in the
             header (streamed into S3 as it arrives): what the trainer's PublishWeights does now
  streamed   the chunks sent while they are made and hashed, the digest in the trailer; the registry can only write
             the blob to S3 (under its digest) once the trailer has come

Shapes: the LoRA tensors of a Llama-3-8B-shape rank-32 adapter on all seven projections (32 layers, hidden 4096,
intermediate 14336, 8 KV heads of 128: 336 MB in fp32) and of a SmolLM2-135M-shape rank-16 adapter (30 layers,
hidden 576, intermediate 1536, 3 KV heads of 64: 19 MB), built directly (no base model). Prints JSON and a table.

    python bench/publish.py             # 5 rounds per shape
    python bench/publish.py --quick     # 2 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import embedded_storage, environment, latency_summary, print_table, write_results
from bench.registry import start_registry_process
from loraplane.adapter_format import adapter_writer, serialize_adapter
from loraplane.lora import TARGET_MODULES, LoraSpec, peft_key
from loraplane.registry_client import CHUNK_BYTES, RegistryClient, StreamedBlob, lora_config
from trainer_svc.backends.base import TrainerBackend
from trainer_svc.pool import AdapterState

# name -> (layers, hidden, intermediate, kv_heads * head_dim, rank)
SHAPES = {
    "llama3-8b-r32": (32, 4096, 14336, 8 * 128, 32),
    "smollm2-135m-r16": (30, 576, 1536, 3 * 64, 16),
}
# (label, weights dtype, how: "whole" = serialize_adapter then publish the bytes; "made" = the chunks made and
# hashed in one pass, then sent with the digest in the header; "streamed" = sent while made, digest in a trailer)
VARIANTS = (("fp32 whole", "float32", "whole"), ("fp32 made", "float32", "made"),
            ("fp32 streamed", "float32", "streamed"), ("bf16 whole", "bfloat16", "whole"),
            ("bf16 made", "bfloat16", "made"), ("bf16 streamed", "bfloat16", "streamed"))
TARGET_S = 1.0  # issue 11: export + upload of the 8B rank-32 adapter, on the H100 host


def adapter_state(shape: str) -> AdapterState:
    """A trained-looking adapter of the shape: A and B random and small, as the trainer's pool holds it."""
    layers, hidden, intermediate, kv, rank = SHAPES[shape]
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}
    generator = torch.Generator().manual_seed(0)
    params = {}
    for layer in range(layers):
        for module in TARGET_MODULES:
            fan_in, fan_out = dims[module]
            params[peft_key(layer, module, "A")] = torch.randn(rank, fan_in, generator=generator) * 0.02
            params[peft_key(layer, module, "B")] = torch.randn(fan_out, rank, generator=generator) * 0.02
    spec = LoraSpec.create(rank, 2.0 * rank, [], seed=0)
    return AdapterState(name=shape, spec=spec, base_model="bench", params=params, exp_avg={}, exp_avg_sq={})


async def publish_once(client: RegistryClient, state: AdapterState, adapter: str, dtype: str,
                       how: str) -> dict[str, float]:
    """One PublishWeights' worth of work; seconds per phase and in total."""
    started = time.perf_counter()
    # The trainer's export, unchanged by this work (the backend method does not use its instance).
    params = TrainerBackend.export_params(None, state)
    exported = time.perf_counter()
    if how == "whole":
        blob: bytes | StreamedBlob = await asyncio.to_thread(serialize_adapter, params, state.spec,
                                                             state.base_model, dtype)
    else:
        writer = adapter_writer(params, state.spec, state.base_model, dtype)
        blob = StreamedBlob(writer.size, writer.chunks(CHUNK_BYTES))
        if how == "made":
            await asyncio.to_thread(blob.make)
    del params
    built = time.perf_counter()
    version = await client.publish(adapter, blob)
    done = time.perf_counter()
    size = blob.size if isinstance(blob, StreamedBlob) else len(blob)
    del blob
    await client.delete_version(adapter, version.version)  # keeps the disk bounded; not timed
    return {"export_s": exported - started, "serialize_s": built - exported, "upload_s": done - built,
            "total_s": done - started, "size_bytes": size}


async def run_shape(address: str, shape: str, rounds: int) -> dict:
    state = adapter_state(shape)
    first = next(iter(state.params))
    results: dict[str, list[dict]] = {label: [] for label, _dtype, _how in VARIANTS}
    async with RegistryClient(address, timeout=600) as client:
        adapters = {}
        for label, dtype, _how in VARIANTS:
            adapters[label] = f"{shape}-{label.replace(' ', '-')}"
            await client.create_adapter(adapters[label], base_model="bench", exist_ok=True,
                                        lora_config=lora_config(state.spec.rank, state.spec.alpha,
                                                                weights_dtype=dtype))
        publishes = 0
        for round_ in range(rounds + 1):  # round 0 warms up connections, threads and S3 volumes; not recorded
            for label, dtype, how in VARIANTS:
                publishes += 1
                # Distinct content every time (exact in bf16 too): the registry would skip storing a known blob.
                state.params[first][0, 0] = 1.0 + publishes / 64
                sample = await publish_once(client, state, adapters[label], dtype, how)
                if round_:
                    results[label].append(sample)
                print(f"  {shape} round {round_} {label}: {sample['total_s'] * 1e3:.0f} ms "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    summary = {}
    for label, samples in results.items():
        phases = {phase: latency_summary([s[phase] for s in samples])
                  for phase in ("export_s", "serialize_s", "upload_s", "total_s")}
        summary[label] = {"size_mb": round(samples[0]["size_bytes"] / 1e6, 1), **phases,
                          "rounds_total_ms": [round(s["total_s"] * 1e3, 1) for s in samples]}
    old = summary["fp32 whole"]["total_s"]["p50_ms"]
    for entry in summary.values():
        entry["vs_old_path"] = round(old / entry["total_s"]["p50_ms"], 2)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)

    results: dict = {"rounds": rounds, "environment": environment(), "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="lp-bench-publish-") as tmp, \
            embedded_storage(Path(tmp), "bench-publish") as settings:
        env = {**os.environ, "LORAPLANE_REDIS_URL": settings.redis_url, "LORAPLANE_S3_ENDPOINT": settings.s3_endpoint,
               "LORAPLANE_S3_ACCESS_KEY": settings.s3_access_key, "LORAPLANE_S3_SECRET_KEY": settings.s3_secret_key,
               "LORAPLANE_S3_BUCKET": settings.s3_bucket, "LORAPLANE_KEY_PREFIX": settings.key_prefix}
        registry, address = start_registry_process(env, Path(tmp) / "registry.log")
        try:
            for shape in args.shapes.split(","):
                results["shapes"][shape] = asyncio.run(run_shape(address, shape, rounds))
        finally:
            registry.terminate()
            registry.wait(10)
    results["environment_after"] = environment()
    path = write_results("publish", results)
    print(json.dumps(results, indent=2))

    rows = []
    for shape, summary in results["shapes"].items():
        for label, s in summary.items():
            rows.append([shape, label, s["size_mb"], s["export_s"]["p50_ms"], s["serialize_s"]["p50_ms"],
                         s["upload_s"]["p50_ms"], s["total_s"]["p50_ms"], f"{s['vs_old_path']:.2f}x"])
    print_table(f"PublishWeights export + upload, p50 of {rounds} rounds (registry process, Valkey + SeaweedFS "
                "on loopback)", ["shape", "path", "MB", "export ms", "serialize ms", "upload ms", "total ms",
                                 "old / this"], rows)
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
