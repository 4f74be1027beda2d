"""The production shape end to end on CPU (issue 12, item 4): `python -m tests.production_e2e` with the
megatron trainer under torchrun (1 rank, gloo, float32, real megatron-core), the torch sampler engine and a
supervised local cluster (Valkey, SeaweedFS, registry), running examples/rl_loop.py's two-tenant GRPO loop on
`tiny`. The GPU run of the same driver (SGLang, SmolLM2, bf16) is tests/gpu/test_production_shape.py.

`tiny` is random and three iterations teach it nothing, so rewards are only required to be recorded here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests import production_e2e

REPO = Path(__file__).resolve().parents[2]
ITERATIONS, PROBLEMS, GROUP = 3, 4, 8


def assert_report(report: dict, *, model: str, engine: str, iterations: int, samples: int, max_abs: float,
                  mean_abs: float | None = None) -> None:
    """What the driver checks, asserted again from its recorded numbers rather than from its verdicts alone (shared
    with tests/gpu/test_production_shape.py)."""
    assert report["shape"] == {"trainer_backend": "megatron", "trainer_base_model": model,
                               "sampler_engine": engine, "sampler_base_model": model}
    history = report["history"]
    assert len(history) == 2
    bound = 2 * int(report["config"]["keep_versions"])
    for rows in history.values():
        assert [r["version"] for r in rows] == list(range(1, iterations + 1))
        for r in rows:
            # Every request was answered by exactly the version it named, with all its samples.
            assert r["served_versions"] == [r["version"]] and r["served_mismatches"] == 0
            assert r["samples"] == samples
            # The sampler's logprobs are the trainer's Forward logprobs of that version.
            assert r["sequences_without_logprobs"] == 0 and r["tokens_compared"] > 0
            assert r["logprob_max_abs"] <= max_abs
            # Retention: the sampler's table and, with SGLang, the server's own LoRA names.
            assert r["sampler_loaded"] <= bound and not r["stray_in_sglang"]
            assert (r["sglang_loaded"] is None) == (engine != "sglang")
            assert r["sglang_loaded"] is None or r["sglang_loaded"] <= bound
            assert math.isfinite(r["mean_reward"]) and 0.0 <= r["mean_reward"] <= 1.0
            for field in ("publish_s", "publish_to_loaded_s", "sampling_s", "training_s"):
                assert math.isfinite(r[field]) and r[field] >= 0.0
        # The comparison covered trained weights too: a version published after an optim step that moved them.
        assert any(r["datums"] > 0 for r in rows[:-1])
        if mean_abs is not None:
            compared = sum(r["tokens_compared"] for r in rows)
            assert sum(r["logprob_mean_abs"] * r["tokens_compared"] for r in rows) / compared <= mean_abs
    final = report["final_loaded"]
    keep = int(report["config"]["keep_versions"])
    assert final["ok"] and final["sampler"] == final["expected"] == sorted(
        f"{name}@v{v}" for name in history for v in range(iterations - keep + 1, iterations + 1))
    if engine == "sglang":
        assert final["sglang"] == final["sampler"]
    assert all(c["passed"] for c in report["checks"].values() if c["required"])


def run_driver(tmp_path: Path, *argv: str, timeout: float) -> dict:
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "-m", "tests.production_e2e", *argv, "--data-dir",
                           str(tmp_path / "cluster"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    print(proc.stdout[-8000:])
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["passed"], proc.stdout[-6000:] + proc.stderr[-3000:]
    return report


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_megatron_trainer_and_torch_sampler_loop_on_cpu(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (make install)")
    report = run_driver(tmp_path, "--engine", "torch", "--device", "cpu", "--model", "tiny",
                        "--iterations", str(ITERATIONS), "--problems", str(PROBLEMS), "--group-size", str(GROUP),
                        "--rank", "4", timeout=600)
    # fp32 on CPU: the design's 1e-4.
    assert_report(report, model="tiny", engine="torch", iterations=ITERATIONS, samples=PROBLEMS * GROUP,
                  max_abs=production_e2e.FP32_MAX_ABS)
    assert report["checks"]["rewards_rise"]["required"] is False


def _row(version: int, **changes) -> dict:
    row = {"iteration": version, "version": version, "mean_reward": 0.1 * version, "accuracy": 0.0, "datums": 4,
           "loss": 0.0, "publish_s": 0.1, "publish_to_loaded_s": 0.2, "sampling_s": 1.0, "forward_check_s": 0.1,
           "training_s": 0.5, "seconds": 2.0, "samples": 8, "served_versions": [version], "served_mismatches": 0,
           "tokens_compared": 40, "sequences_without_logprobs": 0, "logprob_max_abs": 2e-6,
           "logprob_mean_abs": 1e-7, "sampler_loaded": 2, "retention_bound": 4, "sglang_loaded": None,
           "stray_in_sglang": []}
    return {**row, **changes}


def _verdicts(rows_a: list[dict], *argv: str, final_ok: bool = True) -> dict[str, bool]:
    rl = production_e2e.load_rl_example()
    args = production_e2e.parse_args(["--device", "cpu", "--iterations", str(len(rows_a)), "--window", "1", *argv])
    runs = rl.tenant_runs("+,+")
    runs[0].history = rows_a
    runs[1].history = [_row(v) for v in range(1, len(rows_a) + 1)]
    final = {"ok": final_ok, "sampler": [], "expected": [], "sglang": None,
             "summary": rl.summarize(runs, args.window)}
    checks = production_e2e.evaluate(runs, args, final, bound=4)
    return {name: c["passed"] or not c["required"] for name, c in checks.items()}


def test_each_check_fails_on_what_it_guards():
    """The driver's verdicts (the exit code follows them), each broken by the fault it exists to catch."""
    good = [_row(1), _row(2), _row(3)]
    assert all(_verdicts(good).values())
    assert not _verdicts([_row(1), _row(2, served_mismatches=1, served_versions=[1, 2]), _row(3)])[
        "served_version_exact"]
    assert not _verdicts([_row(1), _row(2, logprob_max_abs=2e-4), _row(3)])["logprobs_match_forward"]
    assert not _verdicts([_row(1), _row(2, sequences_without_logprobs=1), _row(3)])["logprobs_match_forward"]
    # bf16 bounds apply to a bf16 run: 2e-4 is fine there; a mean over all tokens of both tenants of 0.25 is not.
    assert _verdicts([_row(1), _row(2, logprob_max_abs=2e-4), _row(3)], "--dtype", "bfloat16")[
        "logprobs_match_forward"]
    assert not _verdicts([_row(v, logprob_mean_abs=0.5, logprob_max_abs=0.9) for v in (1, 2, 3)],
                         "--dtype", "bfloat16")["logprobs_match_forward"]
    assert not _verdicts([_row(1), _row(2, logprob_max_abs=1.5), _row(3)], "--dtype", "bfloat16")[
        "logprobs_match_forward"]
    assert not _verdicts([_row(1), _row(2, sampler_loaded=5), _row(3)])["retention"]
    assert not _verdicts([_row(1), _row(2, stray_in_sglang=["tenant-a/rl-arith@v1"]), _row(3)])["retention"]
    assert not _verdicts(good, final_ok=False)["retention"]
    assert not _verdicts([_row(1), _row(2, mean_reward=math.nan), _row(3)])["rewards_recorded"]
    assert not _verdicts(good[:2], "--iterations", "3")["tenants_completed"]
    falling = [_row(1, mean_reward=0.3), _row(2), _row(3, mean_reward=0.1)]
    assert _verdicts(falling)["rewards_rise"]  # reported, not required without the flag
    assert not _verdicts(falling, "--require-reward-rise")["rewards_rise"]
