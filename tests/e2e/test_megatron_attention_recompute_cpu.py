"""The megatron backend's fused SDPA attention and activation recomputation change nothing but rounding: checked on
CPU with real megatron-core (fp32, gloo) against megatron's unfused attention without recomputation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sdpa_attention_and_full_recompute_match_the_unfused_model():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "scripts/gpu/attention_recompute_check.py", "--cpu-dev"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["sdpa/full"]["recomputed_layers"] == 2 and report["sdpa/none"]["recomputed_layers"] == 0
    assert report["unfused/none"]["grad_norm"] > 0
    for key in ("sdpa/none", "sdpa/full"):
        assert report[key]["logprob_max_abs"] <= 1e-5, (key, report[key])
        assert report[key]["grad_rel"] <= 1e-5, (key, report[key])
