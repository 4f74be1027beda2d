"""Compares a benchmark's result JSON with its baseline: each metric within its tolerance, or a regression.

    python bench/compare.py bench/baselines/colocation.json bench/results/colocation.json [--case smollm2-2cores]

A baseline (bench/baselines/<benchmark>.json) holds, per case, the numbers docs/benchmarks.md reports today:

    {"benchmark": "colocation", "command": "python bench/colocation.py", "machine": "CPU box (2 cores)",
     "cases": {"smollm2-2cores": {"source": "docs/gpu-runs/... (where the number came from)", "metrics": {
         "sample_ratio": {"path": ["sample_ratio"], "value": 1.07, "better": "lower", "tolerance": 0.4}}}}}

`path` finds the metric in the result JSON (keys, or list indices); `better` says which way is good; `tolerance` is
relative (0.1: a result 10% worse than the baseline is still a pass; better is always a pass). Exit status: 0 every
metric of the compared cases passed, 1 some regressed, 2 the baseline or the result is unusable (a missing metric,
an unknown case). Prints one line per metric.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BaselineError(ValueError):
    """A baseline or a result that cannot be compared (names what is wrong)."""


@dataclass(frozen=True)
class Verdict:
    case: str
    metric: str
    baseline: float
    result: float
    better: str
    tolerance: float

    @property
    def limit(self) -> float:
        return self.baseline * (1 - self.tolerance) if self.better == "higher" else self.baseline * (1 + self.tolerance)

    @property
    def passed(self) -> bool:
        return self.result >= self.limit if self.better == "higher" else self.result <= self.limit

    @property
    def change(self) -> float:
        """Result ÷ baseline."""
        return self.result / self.baseline if self.baseline else float("inf")

    def line(self) -> str:
        sign = ">=" if self.better == "higher" else "<="
        return (f"{'PASS' if self.passed else 'FAIL'}  {self.case} / {self.metric}: {self.result:g} "
                f"(baseline {self.baseline:g}, {self.change:.2f}x; needs {sign} {self.limit:g})")


def lookup(result: Any, path: list) -> float:
    node = result
    for step in path:
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            raise BaselineError(f"the result has no {'/'.join(map(str, path))} (missing at {step!r})") from None
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise BaselineError(f"the result's {'/'.join(map(str, path))} is {node!r}, not a number")
    return float(node)


def compare(baseline: dict, result: dict, cases: list[str] | None = None) -> list[Verdict]:
    """Every metric of the chosen cases (default: all the baseline has) against the result."""
    known = baseline.get("cases")
    if not isinstance(known, dict) or not known:
        raise BaselineError("the baseline has no cases")
    chosen = cases or list(known)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise BaselineError(f"unknown case(s) {unknown}; the baseline has {sorted(known)}")
    verdicts = []
    for case in chosen:
        for name, metric in known[case].get("metrics", {}).items():
            better = metric.get("better")
            tolerance = metric.get("tolerance")
            if better not in ("higher", "lower"):
                raise BaselineError(f"{case} / {name}: better must be 'higher' or 'lower', not {better!r}")
            numeric = isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool)
            if not numeric or tolerance < 0 or (better == "higher" and tolerance >= 1):
                raise BaselineError(f"{case} / {name}: tolerance must be a fraction >= 0 (below 1 where higher is "
                                    f"better), not {tolerance!r}")
            verdicts.append(Verdict(case, name, float(metric["value"]), lookup(result, metric["path"]), better,
                                    float(tolerance)))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline", type=Path)
    parser.add_argument("result", type=Path)
    parser.add_argument("--case", action="append", help="compare only this case (repeatable)")
    args = parser.parse_args(argv)
    try:
        verdicts = compare(json.loads(args.baseline.read_text()), json.loads(args.result.read_text()), args.case)
    except (OSError, json.JSONDecodeError, BaselineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for verdict in verdicts:
        print(verdict.line())
    failed = sum(not v.passed for v in verdicts)
    print(f"{len(verdicts) - failed} passed, {failed} regressed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
