"""The state file of a local cluster (`loraplane up` writes it under the data dir): which components run where.
In the shared library because clients read it to find the services; starting and stopping them is the CLI's
(`loraplane_cli.local_cluster`)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "cluster.json"
SERVICE_NAMES = ("registry", "trainer", "sampler")


@dataclass
class ComponentState:
    name: str
    kind: str  # "valkey" | "s3" | "service" | "external"
    endpoint: str
    pid: int | None = None
    log: str = ""
    # Prometheus endpoint (services only).
    metrics: str = ""


@dataclass
class ClusterState:
    data_dir: str
    components: list[ComponentState] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)

    def component(self, name: str) -> ComponentState | None:
        return next((c for c in self.components if c.name == name), None)

    def addresses(self) -> dict[str, str]:
        return {c.name: c.endpoint for c in self.components if c.name in SERVICE_NAMES}

    def save(self) -> None:
        path = Path(self.data_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)


def read_cluster_state(data_dir: Path) -> ClusterState | None:
    path = Path(data_dir) / STATE_FILE
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return ClusterState(data_dir=raw["data_dir"], started_at=raw.get("started_at", 0.0),
                        components=[ComponentState(**c) for c in raw["components"]])


def pid_alive(pid: int | None) -> bool:
    """True while the process runs. A zombie counts as gone: `up` exits, so nothing of ours may reap its children."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return False
