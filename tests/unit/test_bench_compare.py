"""bench/compare.py: a result against its baseline, metric by metric, with a tolerance each way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.compare import BaselineError, compare, main

BASELINE = {"benchmark": "b", "cases": {
    "one": {"metrics": {
        "tok_s": {"path": ["contenders", "megatron/direct/1t", "tokens_per_s"], "value": 100.0, "better": "higher",
                  "tolerance": 0.1},
        "p50_ms": {"path": ["latency", 0, "p50_ms"], "value": 50.0, "better": "lower", "tolerance": 0.2}}},
    "two": {"metrics": {"ratio": {"path": ["ratio"], "value": 2.0, "better": "higher", "tolerance": 0.0}}}}}


def result(tok_s=100.0, p50_ms=50.0, ratio=2.0) -> dict:
    return {"contenders": {"megatron/direct/1t": {"tokens_per_s": tok_s}}, "latency": [{"p50_ms": p50_ms}],
            "ratio": ratio}


@pytest.mark.parametrize(("tok_s", "p50_ms", "passed"), [
    (100.0, 50.0, [True, True]),
    (90.0, 60.0, [True, True]),      # exactly at the tolerance, both ways
    (89.9, 60.1, [False, False]),    # just past it
    (500.0, 1.0, [True, True]),      # better is never a regression
])
def test_each_metric_passes_within_its_tolerance_in_its_own_direction(tok_s, p50_ms, passed):
    verdicts = compare(BASELINE, result(tok_s, p50_ms), ["one"])
    assert [v.passed for v in verdicts] == passed
    assert [v.metric for v in verdicts] == ["tok_s", "p50_ms"]


def test_every_case_by_default_and_a_named_case_alone():
    assert [v.case for v in compare(BASELINE, result())] == ["one", "one", "two"]
    assert [v.case for v in compare(BASELINE, result(), ["two"])] == ["two"]


@pytest.mark.parametrize(("baseline", "res", "cases", "message"), [
    (BASELINE, result(), ["three"], "unknown case"),
    (BASELINE, {"ratio": 2.0}, None, "no contenders/megatron/direct/1t/tokens_per_s"),
    (BASELINE, {**result(), "ratio": "fast"}, ["two"], "not a number"),
    ({"cases": {}}, result(), None, "no cases"),
    ({"cases": {"c": {"metrics": {"m": {"path": ["ratio"], "value": 1, "better": "up", "tolerance": 0.1}}}}},
     result(), None, "better must be"),
    ({"cases": {"c": {"metrics": {"m": {"path": ["ratio"], "value": 1, "better": "higher", "tolerance": 1.5}}}}},
     result(), None, "tolerance must be"),
])
def test_what_cannot_be_compared_is_an_error_naming_it(baseline, res, cases, message):
    with pytest.raises(BaselineError, match=message):
        compare(baseline, res, cases)


def test_the_command_exits_0_on_a_pass_1_on_a_regression_2_when_it_cannot_compare(tmp_path, capsys):
    base = tmp_path / "base.json"
    base.write_text(json.dumps(BASELINE))
    good, bad, broken = tmp_path / "good.json", tmp_path / "bad.json", tmp_path / "broken.json"
    good.write_text(json.dumps(result()))
    bad.write_text(json.dumps(result(ratio=1.9)))
    broken.write_text("{")
    assert main([str(base), str(good)]) == 0
    assert main([str(base), str(bad)]) == 1
    assert "FAIL  two / ratio: 1.9 (baseline 2, 0.95x; needs >= 2)" in capsys.readouterr().out
    assert main([str(base), str(broken)]) == 2
    assert main([str(base), str(good), "--case", "nope"]) == 2


def test_every_committed_baseline_is_well_formed():
    baselines = sorted((Path(__file__).resolve().parents[2] / "bench" / "baselines").glob("*.json"))
    assert baselines
    for path in baselines:
        baseline = json.loads(path.read_text())
        assert {"benchmark", "command", "machine", "cases"} <= set(baseline), path.name
        for name, case in baseline["cases"].items():
            assert case["metrics"] and case.get("source"), (path.name, name)
            # A result holding exactly the baseline's numbers passes: every path, direction and tolerance is usable.
            assert all(v.passed for v in compare({"cases": {name: case}}, _at_baseline(case))), (path.name, name)


def _at_baseline(case: dict) -> dict:
    out: dict = {}
    for metric in case["metrics"].values():
        node = out
        for step in metric["path"][:-1]:
            node = node.setdefault(step, {})
        node[metric["path"][-1]] = metric["value"]
    return out
