"""production_e2e's placement options (issue 23, item 3: the disaggregated production shape against the colocated
one, `scripts/gpu/e2e.sh disagg` on the 2-GPU machine): the shape and SGLang's memory share each GPU list gives,
the steady-state timings and the side-by-side comparison. The GPU run itself is the lead's; on CPU the driver runs
with the torch trainer and sampler engine, GPU indices pinned (harmless without CUDA)."""

from __future__ import annotations

import json
import math

import pytest

from tests import production_e2e
from tests.e2e.test_production_shape_cpu import run_driver


def test_gpu_lists_give_the_shape_and_sglangs_memory_share():
    cases = {(): ("unpinned", production_e2e.COLOCATED_MEM_FRACTION, {}),
             ("--trainer-gpus", "0", "--sampler-gpus", "0"): ("colocated", production_e2e.COLOCATED_MEM_FRACTION,
                                                              {"trainer": "0", "sampler": "0"}),
             ("--trainer-gpus", "0,1", "--sampler-gpus", "1"): ("colocated", production_e2e.COLOCATED_MEM_FRACTION,
                                                                {"trainer": "0,1", "sampler": "1"}),
             ("--trainer-gpus", "0", "--sampler-gpus", "1"): ("disaggregated",
                                                              production_e2e.DISAGGREGATED_MEM_FRACTION,
                                                              {"trainer": "0", "sampler": "1"})}
    for argv, (shape, fraction, gpus) in cases.items():
        args = production_e2e.parse_args(list(argv))
        assert (args.shape_name, args.mem_fraction_static, production_e2e.cluster_gpus(args)) == \
            (shape, fraction, gpus), argv
        assert f"--sglang-arg=--mem-fraction-static={fraction}" in production_e2e.service_commands(args)["sampler"]
    # An explicit share wins over the shape's default.
    args = production_e2e.parse_args(["--trainer-gpus", "0", "--sampler-gpus", "1", "--mem-fraction-static", "0.5"])
    assert args.mem_fraction_static == 0.5
    assert production_e2e.DISAGGREGATED_MEM_FRACTION > production_e2e.COLOCATED_MEM_FRACTION


def test_union_seconds_counts_overlapping_sampling_once():
    assert production_e2e.union_seconds([]) == 0.0
    assert production_e2e.union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert production_e2e.union_seconds([(0.0, 4.0), (1.0, 2.0)]) == pytest.approx(4.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_disaggregated_run_reports_steady_state_timings_and_compares(tmp_path):
    report = run_driver(tmp_path, "--engine", "torch", "--device", "cpu", "--model", "tiny", "--trainer-backend",
                        "torch", "--iterations", "4", "--problems", "2", "--group-size", "4",
                        "--trainer-gpus", "0", "--sampler-gpus", "1", timeout=240)
    assert report["placement"] == {"shape": "disaggregated", "trainer_gpus": "0", "sampler_gpus": "1",
                                   "mem_fraction_static": production_e2e.DISAGGREGATED_MEM_FRACTION}
    rows = [r for rows in report["history"].values() for r in rows]
    steady = [r for r in rows if r["iteration"] > 2]
    summary = report["steady_state"]
    assert summary["rows"] == len(steady) == 4 and summary["warmup_iterations"] == 2
    tokens = sum(r["sampled_tokens"] for r in steady)
    assert tokens == summary["sampled_tokens"] > 0
    for r in rows:
        start, end = r["sampling_window"]
        assert end - start == pytest.approx(r["sampling_s"], abs=1e-6)
        assert r["iteration_window"][0] <= start <= end <= r["iteration_window"][1]
    # Both tenants sample at once: the busy time is at most the sum of their sampling times, at least the longest.
    assert max(r["sampling_s"] for r in steady) <= summary["sampling_busy_s"] <= sum(r["sampling_s"] for r in steady)
    assert summary["sampling_tokens_per_s"] == pytest.approx(tokens / summary["sampling_busy_s"])
    middle = sorted(r["seconds"] for r in steady)[1:3]  # four rows: the median is the mean of the middle two
    assert summary["median_seconds"] == pytest.approx(sum(middle) / 2)

    # The comparison: a second "shape" whose iterations took twice as long and sampled half as fast.
    slower = json.loads(json.dumps(report))
    for key in ("median_seconds", "median_sampling_s"):
        slower["steady_state"][key] *= 2
    slower["steady_state"]["sampling_tokens_per_s"] /= 2
    (tmp_path / "a.json").write_text(json.dumps(report))
    (tmp_path / "b.json").write_text(json.dumps(slower))
    out = tmp_path / "compare.json"
    assert production_e2e.main(["--compare", f"colocated={tmp_path / 'a.json'}", f"disaggregated={tmp_path / 'b.json'}",
                                "--out", str(out)]) == 0
    ratios = json.loads(out.read_text())["ratio_to_baseline"]["disaggregated"]
    assert ratios["median_seconds"] == pytest.approx(2.0) and ratios["median_sampling_s"] == pytest.approx(2.0)
    assert ratios["sampling_tokens_per_s"] == pytest.approx(0.5) and ratios["median_training_s"] == pytest.approx(1.0)
    # A report that is missing (a run that never wrote one) shows as dashes, and the exit code says so.
    assert production_e2e.main(["--compare", f"colocated={tmp_path / 'a.json'}", f"x={tmp_path / 'none.json'}",
                                "--out", str(out)]) == 1
    assert all(v is None for v in json.loads(out.read_text())["ratio_to_baseline"]["x"].values())
    assert not math.isnan(summary["end_to_end_tokens_per_s"])
