"""Small helpers shared by the benchmarks: latency summaries, JSON results, a rich table."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(seconds: Iterable[float]) -> dict[str, float]:
    """p50/p90/p99/mean/min/max in milliseconds."""
    values = list(seconds)
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(sum(ms) / len(ms), 3) if ms else float("nan"),
        "min_ms": round(min(ms), 3) if ms else float("nan"),
        "max_ms": round(max(ms), 3) if ms else float("nan"),
    }


def environment() -> dict[str, Any]:
    import os

    # The load average says how much else competed for the CPUs while the numbers were taken.
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2), "platform": platform.platform(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_results(name: str, results: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    return path


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], width: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for row in rows:
        table.add_row(*[f"{cell:.1f}" if isinstance(cell, float) else str(cell) for cell in row])
    Console(width=width).print(table)


def random_adapter_blob(base, seed: int, rank: int = 16, dtype: str = "float32") -> bytes:
    """A PEFT blob of a rank-`rank` adapter on every projection whose B is small and random (not zero), so that it
    changes the model's output and costs the same as a trained one."""
    import torch

    from loraplane.adapter_format import serialize_adapter
    from loraplane.lora import LoraSpec, init_lora_params

    spec = LoraSpec.create(rank, 2.0 * rank, seed=seed)
    params = init_lora_params(base, spec)
    generator = torch.Generator().manual_seed(seed)
    for key in params:
        if key.endswith("lora_B.weight"):
            params[key] = torch.randn(params[key].shape, generator=generator) * 0.01
    return serialize_adapter(params, spec, base.name, dtype)


@contextlib.contextmanager
def embedded_storage(work: Path, bucket: str, key_prefix: str = "bench:"):
    """Valkey and SeaweedFS S3 on loopback under `work`, and the Settings that point a registry at them."""
    from loraplane.config import Settings
    from loraplane.local.processes import seaweed_s3_server, valkey_server

    valkey = valkey_server(work / "valkey")
    seaweed = seaweed_s3_server(work / "seaweed")
    valkey.start()
    try:
        seaweed.start()
        try:
            yield Settings(redis_url=valkey.url, s3_endpoint=seaweed.endpoint, s3_access_key=seaweed.access_key,
                           s3_secret_key=seaweed.secret_key, s3_bucket=bucket, key_prefix=key_prefix)
        finally:
            seaweed.stop()
    finally:
        valkey.stop()


def rotation(paths: Sequence[str], round_: int) -> list[str]:
    """The order in which round `round_` runs the alternated paths: shifted by one each round, so that no path always
    runs first (right after the warm-up) or last."""
    shift = round_ % len(paths)
    return [*paths[shift:], *paths[:shift]]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds(pid: int) -> float:
    """CPU time so far of a process's live children (a sampler's stream reader processes)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            try:
                total += cpu_seconds(int(child))
            except (OSError, ValueError):
                pass
    return total
