"""Registry benchmark: publish latency (1 / 10 / 100 MB), download throughput, event delivery latency
(publish -> watcher), concurrent-publisher throughput.

Starts its own Valkey + SeaweedFS and runs the registry as a separate process (`python -m registry_svc`), as in
production, so the client and the server do not share one interpreter. Usage:

    python bench/registry.py            # full run
    python bench/registry.py --quick    # a short run
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import environment, latency_summary, print_table, write_results
from loraplane.adapter_format import serialize_adapter
from loraplane.local.processes import seaweed_s3_server, valkey_server
from loraplane.lora import LoraSpec, peft_key
from loraplane.registry_client import RegistryClient
from loraplane.v1 import common_pb2

MB = 1_000_000
# The registry checks every published blob as an adapter of the registered shape, so the benchmark publishes real
# ones: rank 8 on q_proj of one layer, as wide as the wanted size needs.
BENCH_ADAPTER = {"lora_config": common_pb2.LoraConfig(rank=8, alpha=16, target_modules=["q_proj"]),
                 "base_model": "bench"}


def adapter_of_size(size: int, seed: int) -> bytes:
    """A PEFT adapter blob of about `size` bytes (at least ~1 KB) with random values."""
    spec = LoraSpec.create(8, 16.0, ["q_proj"], 0)
    width = max(1, (size - 1500) // (2 * spec.rank * 4))
    generator = torch.Generator().manual_seed(seed)
    params = {peft_key(0, "q_proj", "A"): torch.randn(spec.rank, width, generator=generator),
              peft_key(0, "q_proj", "B"): torch.randn(width, spec.rank, generator=generator)}
    return serialize_adapter(params, spec, "bench")


TARGETS = {"publish_10mb_p50_ms": 150.0, "event_delivery_p99_ms": 50.0}


def start_registry_process(env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen, str]:
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "registry_svc", "--port", "0"], env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                cwd=Path(__file__).resolve().parent.parent)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"registry did not start: {line!r}; log {log_path}")
    return proc, line.strip().rsplit(" ", 1)[-1]


async def publish_latency(client: RegistryClient, size: int, runs: int) -> dict:
    adapter = f"pub-{size // MB}mb"
    await client.create_adapter(adapter, **BENCH_ADAPTER, exist_ok=True)
    blobs = [adapter_of_size(size, seed) for seed in range(min(runs, 3))]
    await client.publish(adapter, blobs[0])  # warm up connections
    times = []
    for run in range(runs):
        blob = blobs[run % len(blobs)][:-8] + run.to_bytes(8, "little")  # distinct content each run
        started = time.perf_counter()
        await client.publish(adapter, blob)
        times.append(time.perf_counter() - started)
    summary = latency_summary(times)
    summary["size_mb"] = size / MB
    summary["throughput_mb_s"] = round(size / MB / (summary["p50_ms"] / 1000), 1)
    return summary


async def download_throughput(client: RegistryClient, size: int, runs: int) -> dict:
    adapter = "download"
    await client.create_adapter(adapter, **BENCH_ADAPTER, exist_ok=True)
    blob = adapter_of_size(size, 7)
    await client.publish(adapter, blob)
    await client.download(adapter)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        _, data = await client.download(adapter)
        times.append(time.perf_counter() - started)
        assert len(data) == size
    summary = latency_summary(times)
    summary["size_mb"] = size / MB
    summary["throughput_mb_s"] = round(size / MB / (summary["p50_ms"] / 1000), 1)
    return summary


async def event_delivery(client: RegistryClient, watcher_client: RegistryClient, runs: int) -> dict:
    """Time from the commit of a version (the server's event time) and from the start of its publish call to its
    arrival at a watcher that is blocked on WatchEvents."""
    adapter = "events"
    await client.create_adapter(adapter, **BENCH_ADAPTER, exist_ok=True)
    received: dict[int, float] = {}
    ready = asyncio.Event()

    async def watch() -> None:
        stream = watcher_client.watch(adapter=adapter, start_at_end=True)
        ready.set()
        async for event in stream:
            if event.version:
                received[event.version] = time.time()
                commit_times[event.version] = event.time

    commit_times: dict[int, float] = {}
    event_blobs = [adapter_of_size(1024, run) for run in range(runs)]
    task = asyncio.create_task(watch())
    await ready.wait()
    await asyncio.sleep(0.3)
    started: dict[int, float] = {}
    for run in range(runs):
        begin = time.time()
        version = await client.publish(adapter, event_blobs[run])
        started[version.version] = begin
        deadline = time.monotonic() + 5
        while version.version not in received and time.monotonic() < deadline:
            await asyncio.sleep(0.0005)
        await asyncio.sleep(0.005)
    task.cancel()
    from_commit = [received[v] - commit_times[v] for v in started if v in received]
    from_publish = [received[v] - started[v] for v in started if v in received]
    return {"from_commit": latency_summary([max(x, 0.0) for x in from_commit]),
            "from_publish_start": latency_summary(from_publish), "lost": runs - len(from_commit)}


async def concurrent_publishers(client_address: str, publishers: int, per_publisher: int, size: int) -> dict:
    adapter = "concurrent"
    setup = RegistryClient(client_address)
    await setup.create_adapter(adapter, **BENCH_ADAPTER, exist_ok=True)
    await setup.close()
    clients = [RegistryClient(client_address) for _ in range(publishers)]

    base = adapter_of_size(size, 0)

    async def run(index: int) -> list[int]:
        versions = []
        for item in range(per_publisher):
            blob = base[:-16] + index.to_bytes(8, "little") + item.to_bytes(8, "little")  # finite floats
            versions.append((await clients[index].publish(adapter, blob)).version)
        return versions

    started = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(publishers)))
    elapsed = time.perf_counter() - started
    for client in clients:
        await client.close()
    versions = sorted(v for batch in results for v in batch)
    total = publishers * per_publisher
    return {"publishers": publishers, "versions": total, "size_mb": size / MB, "seconds": round(elapsed, 3),
            "versions_per_s": round(total / elapsed, 1), "mb_per_s": round(total * size / MB / elapsed, 1),
            "gapless": versions == list(range(1, total + 1))}


def s3_baseline(s3, size: int, runs: int) -> dict:
    """A plain PUT of the same size straight to the S3 server: the floor under any publish latency."""
    from minio import Minio

    client = Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False)
    if not client.bucket_exists("baseline"):
        client.make_bucket("baseline")
    blob = os.urandom(size)
    times = []
    for run in range(runs + 1):
        started = time.perf_counter()
        client.put_object("baseline", f"put-{run}", io.BytesIO(blob), size, part_size=max(size, 5 * 1024 * 1024))
        times.append(time.perf_counter() - started)
    summary = latency_summary(times[1:])
    summary["size_mb"] = size / MB
    return summary


async def run_all(address: str, quick: bool) -> dict:
    client = RegistryClient(address, timeout=120)
    watcher = RegistryClient(address)
    results: dict = {"publish": {}}
    for size, runs in ((1 * MB, 10 if quick else 40), (10 * MB, 10 if quick else 30), (100 * MB, 2 if quick else 6)):
        results["publish"][f"{size // MB}MB"] = await publish_latency(client, size, runs)
    results["download"] = await download_throughput(client, (20 if quick else 100) * MB, 3 if quick else 6)
    results["events"] = await event_delivery(client, watcher, 50 if quick else 300)
    results["concurrent"] = await concurrent_publishers(address, 8, 5 if quick else 25, 1 * MB)
    await client.close()
    await watcher.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer runs and smaller downloads")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lp-bench-registry-") as tmp:
        root = Path(tmp)
        valkey = valkey_server(root / "valkey")
        s3 = seaweed_s3_server(root / "seaweed")
        valkey.start()
        s3.start()
        registry = None
        try:
            env = {**os.environ, "LORAPLANE_REDIS_URL": valkey.url, "LORAPLANE_S3_ENDPOINT": s3.endpoint,
                   "LORAPLANE_S3_ACCESS_KEY": s3.access_key, "LORAPLANE_S3_SECRET_KEY": s3.secret_key,
                   "LORAPLANE_S3_BUCKET": "bench", "LORAPLANE_KEY_PREFIX": "bench:"}
            registry, address = start_registry_process(env, root / "registry.log")
            results = asyncio.run(run_all(address, args.quick))
            results["s3_put_baseline_10MB"] = s3_baseline(s3, 10 * MB, 10 if args.quick else 30)
        finally:
            if registry is not None:
                registry.terminate()
                registry.wait(10)
            valkey.stop()
            s3.kill()

    results["quick"] = args.quick
    results["environment"] = environment()
    results["targets"] = TARGETS
    results["targets_met"] = {
        "publish_10mb_p50_ms": results["publish"]["10MB"]["p50_ms"] <= TARGETS["publish_10mb_p50_ms"],
        "event_delivery_p99_ms": results["events"]["from_commit"]["p99_ms"] <= TARGETS["event_delivery_p99_ms"],
    }
    path = write_results("registry", results)
    print(json.dumps(results, indent=2))

    rows = [[f"publish {name}", s["n"], s["p50_ms"], s["p99_ms"], s["throughput_mb_s"]]
            for name, s in results["publish"].items()]
    b = results["s3_put_baseline_10MB"]
    rows.append(["(baseline: plain S3 PUT 10MB)", b["n"], b["p50_ms"], b["p99_ms"], "-"])
    d = results["download"]
    rows.append([f"download {d['size_mb']:.0f}MB", d["n"], d["p50_ms"], d["p99_ms"], d["throughput_mb_s"]])
    for label, key in (("event commit->watcher", "from_commit"), ("event publish->watcher", "from_publish_start")):
        e = results["events"][key]
        rows.append([label, e["n"], e["p50_ms"], e["p99_ms"], "-"])
    c = results["concurrent"]
    rows.append([f"{c['publishers']} publishers x 1MB ({c['versions_per_s']} versions/s)", c["versions"], "-", "-",
                 c["mb_per_s"]])
    print_table("registry benchmark (loopback)", ["measurement", "n", "p50 ms", "p99 ms", "MB/s"], rows)
    print(f"targets met: {results['targets_met']}; JSON: {path}")


if __name__ == "__main__":
    main()
