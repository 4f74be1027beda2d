"""The GPU tests' reports, written as each one arrives: a GPU call that its time limit kills loses pytest's end-of-run
summary (the failures' tracebacks), so each failed phase's report goes to $OUT/gpu_failures.log at once (the device
tool returns what is under $OUT)."""

from __future__ import annotations

import os
from pathlib import Path


def pytest_runtest_logreport(report) -> None:
    out = os.environ.get("OUT")
    if not out or not report.failed:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "gpu_failures.log", "a") as log:
        log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
