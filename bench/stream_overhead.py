"""What sampler_svc adds to SGLang's streaming latency, measured on a CPU machine (no GPU, no SGLang).

A synthetic SGLang-compatible server (bench/synthetic_sglang.py: one token per running request every --itl-ms, the
chunks SGLang streams) stands in for the engine; sampler_svc runs as its own process with its real SGLang engine
pointed at it, following a real registry (Valkey + SeaweedFS on loopback) that holds 8 adapters. The clients,
each in its own process (bench/stream_clients.py), alternate in rotating order with fresh prompts each run:
  raw     aiohttp straight to the synthetic server;
  stubs   bare grpc.aio stubs, one connection, to sampler_svc;
  client  loraplane.client's SamplingClient to sampler_svc;
  openai  aiohttp to the HTTP gateway's OpenAI /v1/completions (stream: true), the
          gateway (one uvicorn process) calling the same sampler_svc; its CPU per token is reported beside the
          sampler's. The gateway asks a trainer for the base model's tokenizer, so one runs too (idle after that).
          The synthetic server samples only ids that decode to a whole printable character (tiny's vocabulary is
          bytes: a random id is half a character about half the time, which the gateway holds back until the next
          token, as it should, and which would have made openai's ITL the gap between pairs of tokens).
--gateway-baseline-src DIR runs a second gateway from another tree in front of the same sampler, measured as
`openai_baseline` in the same rotation: before/after a gateway change (compare CPU per token first; the
latencies of two runs of the same code differ by more than that on a shared 2-core machine).
Per concurrency (16 / 64 / 256 streams over 8 adapters): TTFT and per-token inter-token gaps (p50/p99), time per
output token and tokens/s of streams; then tokens/s of non-streaming Sample calls. Each value is the median over
--rounds runs. Since the synthetic server's own timing is fixed, every difference from raw is the path's overhead.

    python bench/stream_overhead.py [--concurrency 16 64 256] [--rounds 3] [--itl-ms 10] [--max-tokens 64]
    python bench/stream_overhead.py --paths raw stubs openai [--gateway-baseline-src DIR]

Writes bench/results/stream_overhead.json and prints a table. The load average is recorded: on a shared machine
the other tenants' work shows up in every path alike, since the paths alternate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (
    children_cpu_seconds,
    cpu_seconds,
    embedded_storage,
    environment,
    print_table,
    random_adapter_blob,
    rotation,
    write_results,
)
from bench.stream_clients import DIAGNOSTIC_PATHS, GATEWAY_PATHS, PATHS, Worker

ADAPTERS = 8
RANK = 8
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tok_s", "sampler_cpu_us_per_token",
           "readers_cpu_us_per_token", "gateway_cpu_us_per_token", "client_cpu_us_per_token")


def _wait_line(process: subprocess.Popen, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited with {process.wait()} before printing {prefix}")
        if line.startswith(prefix):
            return line.split()[-1]
    raise RuntimeError(f"no {prefix} after {timeout:.0f}s")


def publish_adapters(registry_address: str) -> None:
    from loraplane.models import load_base_model
    from loraplane.registry_client import RegistryClient
    from loraplane.rpc import BackgroundLoop
    from loraplane.v1 import common_pb2

    base = load_base_model("tiny", "cpu")
    blobs = [random_adapter_blob(base, 100 + i, RANK) for i in range(ADAPTERS)]

    async def publish():
        async with RegistryClient(registry_address) as client:
            for i, blob in enumerate(blobs):
                await client.create_adapter(f"bench/a{i}", lora_config=common_pb2.LoraConfig(rank=RANK, alpha=2 * RANK),
                                            base_model="tiny")
                await client.publish(f"bench/a{i}", blob)

    loop = BackgroundLoop("publish")
    try:
        loop.run(publish())
    finally:
        loop.close()


def start_gateways(work: Path, procs: list, registry: str, redis_url: str, sampler: str,
                   gateways: list[tuple[str, Path, dict]], pids: dict[str, int]) -> dict[str, str]:
    """A trainer on `tiny` (the gateway asks it once for the base model's name and tokenizer; idle afterwards), then
    one gateway process per (path, source tree, extra env), each in front of `sampler`, with its state in the
    bench's Valkey under a key prefix of its own. Returns path -> base URL; pids gets path -> gateway pid."""
    from loraplane.local.processes import free_port

    env = dict(os.environ, LORAPLANE_REGISTRY_ADDRESS=registry, PYTHONUNBUFFERED="1")
    log = open(work / "trainer.log", "w")  # noqa: SIM115 - closed with the process
    trainer = subprocess.Popen(
        [sys.executable, "-m", "trainer_svc", "--base-model", "tiny", "--device", "cpu", "--port", str(free_port()),
         "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
        env=dict(env, LORAPLANE_DATA_DIR=str(work / "trainer")))
    procs.append(trainer)
    trainer_address = _wait_line(trainer, "TRAINER_READY", 300)
    urls, started = {}, []
    for path, cwd, extra_env in gateways:
        port = free_port()
        gateway_env = dict(env, PYTHONPATH=str(cwd), LORAPLANE_DATA_DIR=str(work / path),
                           LORAPLANE_GATEWAY_HOST="127.0.0.1", LORAPLANE_GATEWAY_PORT=str(port),
                           LORAPLANE_GATEWAY_REDIS_URL=redis_url, LORAPLANE_GATEWAY_KEY_PREFIX=f"bench-{path}:",
                           LORAPLANE_GATEWAY_TRAINER_ADDRESS=trainer_address,
                           LORAPLANE_GATEWAY_REGISTRY_ADDRESS=registry, LORAPLANE_GATEWAY_SAMPLER_ADDRESS=sampler,
                           LORAPLANE_GATEWAY_TOKENIZER_DIR=str(work / path / "tokenizers"), **extra_env)
        log = open(work / f"{path}.log", "w")  # noqa: SIM115 - closed with the process
        gateway = subprocess.Popen([sys.executable, "-m", "gateway_svc"], stdout=log, stderr=subprocess.STDOUT,
                                   cwd=cwd, env=gateway_env)
        procs.append(gateway)
        pids[path] = gateway.pid
        urls[path] = f"http://127.0.0.1:{port}"
        started.append((path, gateway))
    import urllib.request

    for path, gateway in started:  # all started before any is waited for: their imports overlap
        deadline = time.monotonic() + 120
        while True:
            if gateway.poll() is not None:
                raise RuntimeError(f"the {path} gateway exited with {gateway.returncode}: see {work / path}.log "
                                   "(--keep)")
            try:
                with urllib.request.urlopen(f"{urls[path]}/api/v1/healthz", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {path} gateway did not answer /api/v1/healthz in 120 s")
            time.sleep(0.3)
    return urls


def whole_character_ids() -> list[int]:
    """The ids of `tiny`'s vocabulary that decode to one printable character on their own."""
    from loraplane.models import load_base_model

    tokenizer = load_base_model("tiny", "cpu").tokenizer
    return [i for i in range(10, len(tokenizer))
            if len(text := tokenizer.decode([i])) == 1 and text.isprintable() and text != "\ufffd"]


def measure(args, workers: dict[str, Worker], vocab: int, sampler_pids: dict[str, int],
            gateway_pids: dict[str, int] | None = None) -> list[dict]:
    """sampler_pids: path -> the sampler process it calls, whose CPU time per token is reported (a figure the
    other tenants of a shared machine barely move, unlike the latencies); gateway_pids: likewise the gateway
    process of the paths through one."""
    gateway_pids = gateway_pids or {}
    rng = random.Random(0)

    def requests(count: int) -> list:
        return [[i % ADAPTERS, [rng.randrange(10, vocab) for _ in range(args.prompt_len)]] for i in range(count)]

    # Warm-up: every adapter on every path (the sampler loads each version on first use), both kinds of call.
    for worker in workers.values():
        for op in ("stream", "unary"):
            worker.run({"op": op, "concurrency": ADAPTERS, "requests": requests(ADAPTERS), "max_tokens": 4})
    rows = []
    paths = list(workers)
    grpc_paths = [p for p in paths if p != "raw"]
    for concurrency in args.concurrency:
        for op in ("stream", "unary"):
            runs: dict[str, list[dict]] = {p: [] for p in paths}
            for round_ in range(args.rounds):
                for path in rotation(paths, round_):
                    count = concurrency * args.waves
                    pid = sampler_pids.get(path)
                    before = cpu_seconds(pid) if pid else 0.0
                    readers_before = children_cpu_seconds(pid) if pid else 0.0
                    gateway = gateway_pids.get(path)
                    gateway_before = cpu_seconds(gateway) if gateway else 0.0
                    result = workers[path].run({"op": op, "concurrency": concurrency, "requests": requests(count),
                                                "max_tokens": args.max_tokens})
                    if pid:
                        result["sampler_cpu_us_per_token"] = (cpu_seconds(pid) - before) * 1e6 / result["tokens"]
                        result["readers_cpu_us_per_token"] = ((children_cpu_seconds(pid) - readers_before) * 1e6
                                                              / result["tokens"])
                    if gateway:
                        result["gateway_cpu_us_per_token"] = (cpu_seconds(gateway) - gateway_before) * 1e6 / result[
                            "tokens"]
                    runs[path].append(result)
            row = {"concurrency": concurrency, "op": op, "rounds": args.rounds,
                   "load_average_1m": round(os.getloadavg()[0], 2)}
            for path in paths:
                row[path] = {m: statistics.median(r[m] for r in runs[path]) for m in METRICS if m in runs[path][0]}
                row[path]["runs_tok_s"] = [round(r["tok_s"], 1) for r in runs[path]]
                # Every path is sent the same number of requests of max_tokens each (the synthetic server always
                # generates max_tokens): equal counts across paths show that each path counts every token.
                row[path]["runs_tokens"] = [r["tokens"] for r in runs[path]]
                if op == "stream":
                    row[path]["tokens_per_message"] = round(statistics.median(
                        r["tokens"] / max(r["messages"], 1) for r in runs[path]), 2)
            for path in grpc_paths:
                row[f"{path}_over_raw"] = {m: row[path][m] / row["raw"][m] for m in METRICS
                                           if m in row[path] and row["raw"].get(m)}
            if "client" in row and "stubs" in row:
                row["client_over_stubs_tok_s"] = row["client"]["tok_s"] / row["stubs"]["tok_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> None:
    streams = [r for r in rows if r["op"] == "stream"]
    paths = [p for p in streams[0] if isinstance(streams[0][p], dict) and "runs_tok_s" in streams[0][p]]
    print_table("Streaming (median of rounds): TTFT and inter-message gap (ITL) p50/p99, TPOT p50 in ms; tokens/s",
                ["concurrency", "path", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50", "tok/s",
                 "tok/msg", "sampler CPU µs/token", "readers CPU µs/token", "gateway CPU µs/token",
                 "client CPU µs/token", "TTFT p50 ÷ raw",
                 "ITL p50 ÷ raw",
                 "tok/s ÷ raw"],
                [[r["concurrency"], p, r[p]["ttft_p50_ms"], r[p]["ttft_p99_ms"], f"{r[p]['itl_p50_ms']:.2f}",
                  f"{r[p]['itl_p99_ms']:.2f}", f"{r[p]['tpot_p50_ms']:.2f}", r[p]["tok_s"], r[p]["tokens_per_message"],
                  f"{r[p].get('sampler_cpu_us_per_token', float('nan')):.1f}",
                  f"{r[p].get('readers_cpu_us_per_token', float('nan')):.1f}",
                  f"{r[p].get('gateway_cpu_us_per_token', float('nan')):.1f}",
                  f"{r[p]['client_cpu_us_per_token']:.1f}",
                  f"{r[p]['ttft_p50_ms'] / r['raw']['ttft_p50_ms']:.2f}",
                  f"{r[p]['itl_p50_ms'] / r['raw']['itl_p50_ms']:.2f}", f"{r[p]['tok_s'] / r['raw']['tok_s']:.3f}"]
                 for r in streams for p in paths], width=200)
    unary = [r for r in rows if r["op"] == "unary"]
    print_table("Non-streaming Sample: tokens/s (median of rounds)",
                ["concurrency", *paths, *(f"{p} ÷ raw" for p in paths[1:]), "client ÷ stubs"],
                [[r["concurrency"], *(r[p]["tok_s"] for p in paths),
                  *(f"{r[p]['tok_s'] / r['raw']['tok_s']:.3f}" for p in paths[1:]),
                  f"{r.get('client_over_stubs_tok_s', float('nan')):.3f}"] for r in unary], width=200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--waves", type=int, default=1, help="requests per run = concurrency x waves")
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--out", default="stream_overhead", help="results name under bench/results/")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--profile", action="store_true",
                        help="run sampler_svc under cProfile; its top functions are printed at the end (with "
                             "LORAPLANE_UVLOOP=0 set: under uvloop the loop's own work shows as one C call)")
    parser.add_argument("--profile-clients", action="store_true",
                        help="run the client workers under cProfile; their top functions are printed at the end")
    # openai is in the default: the full default run, gateway and all, takes ~2 minutes on a 2-core machine.
    parser.add_argument("--paths", nargs="+", default=[*PATHS, *GATEWAY_PATHS],
                        choices=PATHS + DIAGNOSTIC_PATHS + GATEWAY_PATHS)
    parser.add_argument("--baseline-src", default="",
                        help="a copy of another version's tree (e.g. `git archive OLD sampler_svc loraplane | tar -x "
                             "-C DIR`): its sampler_svc runs beside this one on the same synthetic server, measured "
                             "through bare stubs as the path `stubs_baseline` ('.' = this tree, with --baseline-env)")
    parser.add_argument("--baseline-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment of the baseline sampler, e.g. LORAPLANE_UVLOOP=0")
    parser.add_argument("--gateway-baseline-src", default="",
                        help="a copy of another version's tree (e.g. `git archive OLD gateway_svc loraplane | tar -x "
                             "-C DIR`): its gateway runs beside this one in front of the same sampler, measured as "
                             "the path `openai_baseline` ('.' = this tree)")
    parser.add_argument("--gateway-baseline-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment of the baseline gateway")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lp-stream-overhead-"))
    procs: list[subprocess.Popen] = []
    workers: dict[str, Worker] = {}
    try:
        from loraplane.local.processes import free_port
        from loraplane.rpc import BackgroundLoop
        from registry_svc.server import start_registry_server

        with embedded_storage(work, "bench") as settings:
            loop = BackgroundLoop("registry")
            registry = loop.run(start_registry_server(settings, port=0))
            try:
                publish_adapters(registry.address)
                synthetic = subprocess.Popen(
                    [sys.executable, str(REPO / "bench/synthetic_sglang.py"), "--port", str(free_port()),
                     "--itl-ms", str(args.itl_ms), "--token-ids", ",".join(map(str, whole_character_ids()))],
                    stdout=subprocess.PIPE, text=True, cwd=REPO)
                procs.append(synthetic)
                url = _wait_line(synthetic, "SYNTHETIC_SGLANG_READY", 60)
                sampler_pids: dict[str, int] = {}

                def start_sampler(name: str, cwd: Path, extra_env: dict | None = None) -> str:
                    env = dict(os.environ, LORAPLANE_REGISTRY_ADDRESS=registry.address, PYTHONUNBUFFERED="1",
                               LORAPLANE_DATA_DIR=str(work / name), PYTHONPATH=str(cwd), **(extra_env or {}))
                    log = open(work / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
                    profile = ["-m", "cProfile", "-o", str(work / f"{name}.prof")] if args.profile else []
                    sampler = subprocess.Popen(
                        [sys.executable, *profile, "-m", "sampler_svc", "--engine", "sglang", "--sglang-url", url,
                         "--base-model", "tiny", "--port", str(free_port()), "--max-loaded", str(4 * ADAPTERS),
                         "--sglang-max-lora-rank", str(RANK), "--log-level", "WARNING"],
                        stdout=subprocess.PIPE, stderr=log, text=True, cwd=cwd, env=env)
                    procs.append(sampler)
                    sampler_pids[name] = sampler.pid
                    return _wait_line(sampler, "SAMPLER_READY", 120)

                address = start_sampler("sampler", REPO)
                from loraplane.models import load_base_model

                vocab = load_base_model("tiny", "cpu").vocab_size
                client_env = (dict(os.environ, LORAPLANE_BENCH_PROFILE_DIR=str(work)) if args.profile_clients
                              else None)
                for path in args.paths:
                    if path not in GATEWAY_PATHS:
                        workers[path] = Worker(path, url=url, sampler=address, env=client_env)
                if args.baseline_src:
                    baseline_env = dict(item.split("=", 1) for item in args.baseline_env)
                    workers["stubs_baseline"] = Worker("stubs", sampler=start_sampler(
                        "baseline", Path(args.baseline_src).resolve(), baseline_env))
                started = environment()
                gateway_pids: dict[str, int] = {}
                if "openai" in args.paths or args.gateway_baseline_src:
                    gateways = [("openai", REPO, {})] if "openai" in args.paths else []
                    if args.gateway_baseline_src:
                        gateways.append(("openai_baseline", Path(args.gateway_baseline_src).resolve(),
                                         dict(item.split("=", 1) for item in args.gateway_baseline_env)))
                    gateway_urls = start_gateways(work, procs, registry.address, settings.redis_url, address,
                                                  gateways, gateway_pids)
                    for path, _, _ in gateways:
                        workers[path] = Worker("openai", gateway=gateway_urls[path], env=client_env)
                started = environment()
                pids = {p: sampler_pids["sampler"] for p in workers if p != "raw"}
                if "baseline" in sampler_pids:
                    pids["stubs_baseline"] = sampler_pids["baseline"]
                rows = measure(args, workers, vocab, pids, gateway_pids)
                result = {"environment": started, "finished_load_average_1m": round(os.getloadavg()[0], 2),
                          "itl_ms": args.itl_ms, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
                          "adapters": ADAPTERS, "rows": rows}
                path = write_results(args.out, result)
                table(rows)
                print(f"wrote {path}")
            finally:
                for worker in workers.values():
                    worker.close()
                for proc in reversed(procs):
                    proc.terminate()
                    try:
                        proc.wait(20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                loop.run(registry.stop())
                loop.close()
        if args.profile or args.profile_clients:
            import pstats

            for prof in sorted(work.glob("*.prof")):
                print(f"--- {prof.stem}: top functions by own time")
                pstats.Stats(str(prof)).sort_stats("tottime").print_stats(45)
    finally:
        if args.keep:
            print(f"work directory: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
