"""The megatron trainer's torchrun job across "machines": two torchrun agents on one host, each a node of one
process, meeting through a c10d rendezvous (CPU / gloo; on GPUs scripts/gpu/multi_gpu.sh runs the same with one
GPU per node). Rank 0 may land on either agent; it serves gRPC and drives the other node's rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from loraplane.local.processes import free_port
from tests.e2e.test_megatron_cpu import REPO, run, torchrun


def two_nodes(*args: str, timeout: int = 240) -> None:
    rdzv = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "multinode-test", *args]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


def test_two_nodes_train_like_one_rank(tmp_path):
    """Data parallel over two nodes gives what one rank gives (fused batches, spills, accumulation, state
    export/import, delete: scripts/gpu/driver_check.py)."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    run(torchrun(1, "scripts/gpu/driver_check.py", "--cpu-dev", "--out", str(one)))
    two_nodes("scripts/gpu/driver_check.py", "--cpu-dev", "--out", str(two))
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["gone"] is True and b["step"] == a["step"] == 2
    for field, tol in (("norms", 1e-5), ("logprobs", 1e-5), ("b_params", 1e-6)):
        worst = max(abs(x - y) for x, y in zip(a[field], b[field], strict=True))
        assert worst <= tol, (field, worst)


def test_launcher_across_two_nodes_serves_trains_publishes_and_stops():
    """TP=2 split over two nodes behind a real registry: rank 0 serves gRPC, three adapters train on two slots, a
    version publishes and parses, and SIGTERM to rank 0 ends both nodes' agents with exit code 0."""
    out = run([sys.executable, "scripts/gpu/launch_check.py", "--nproc", "2", "--tp", "2", "--nnodes", "2",
               "--cpu-dev"], timeout=280)
    assert "OK: 2 ranks on 2 nodes, TP=2: trained 3 adapters on 2 slots, published v1" in out
    assert "trainer exit code [0, 0]" in out
