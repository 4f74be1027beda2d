"""The megatron backend on CPU: real megatron-core (gloo, fp32) through the CPU shims of tests/fixtures/megatron_cpu.py.

The GPU tests (tests/gpu/test_megatron*.py) need CUDA and do not run in CI; these run the same engine, driver and
launcher code on CPU so that CI catches a broken megatron backend (`make install` installs megatron-core, which
needs only torch, numpy and packaging). Each check runs in its own process (they initialize torch.distributed
process groups), and the multi-rank ones under torchrun with 2 ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], timeout: int = 240) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


def test_engine_matches_torch_backend_and_keeps_tenants_apart():
    out = run([sys.executable, "scripts/gpu/cpu_engine_check.py"])
    result = json.loads(out.strip().splitlines()[-1])
    # Both backends in fp32 on the same CPU: only summation order differs.
    assert result["logprob_max_abs"] <= 1e-5
    assert result["grad_rel"] <= 1e-5
    assert abs(result["grad_norm"][0] - result["grad_norm"][1]) <= 1e-4 * result["grad_norm"][1]
    assert result["update_norm"] > 0 and result["update_rel"] <= 1e-3
    assert result["state_round_trip"] is True
    tenants = [json.loads(line) for line in out.splitlines() if line.startswith('{"tenant"')]
    assert len(tenants) == 3 and all(t["rel_diff"] <= 1e-3 for t in tenants)


def test_tensor_and_data_parallel_ranks_equal_one_rank(tmp_path):
    """Rank 0 drives the backend API (fused batches, spills, two accumulated batches per step, a failing op,
    state export/import, delete); TP=2 and DP=2 over 2 ranks must give what 1 rank gives."""
    results = {}
    for nproc, tp in ((1, 1), (2, 2), (2, 1)):
        out = tmp_path / f"n{nproc}_tp{tp}.json"
        run(torchrun(nproc, "scripts/gpu/driver_check.py", "--tp", str(tp), "--cpu-dev", "--out", str(out)))
        results[(nproc, tp)] = json.loads(out.read_text())
    one = results[(1, 1)]
    assert one["gone"] is True and one["step"] == 2 and all(n > 0 for n in one["norms"])
    for key in ((2, 2), (2, 1)):
        other = results[key]
        assert other["gone"] is True and other["step"] == one["step"]
        for field, tol in (("norms", 1e-5), ("logprobs", 1e-5), ("b_params", 1e-6)):
            worst = max(abs(a - b) for a, b in zip(one[field], other[field], strict=True))
            assert worst <= tol, (key, field, worst)


def test_torchrun_launcher_trains_publishes_and_stops_cleanly():
    """Two ranks (TP=2) under torchrun behind a real registry: gRPC training of three adapters on two slots, a
    publish whose blob is downloaded and parsed, then SIGTERM to rank 0 and every rank exits 0."""
    out = run([sys.executable, "scripts/gpu/launch_check.py", "--nproc", "2", "--tp", "2", "--cpu-dev"], timeout=280)
    assert "OK: 2 ranks, TP=2: trained 3 adapters on 2 slots, published v1" in out
    assert "trainer exit code 0" in out
