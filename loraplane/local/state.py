"""The state file of a local cluster (`loraplane up` writes it under the data dir): which components run where.
In the shared library because clients read it to find the services; starting and stopping them is the CLI's
(`loraplane_cli.local_cluster`)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

STATE_FILE = "cluster.json"
SERVICE_NAMES = ("registry", "trainer", "sampler")


@dataclass
class ComponentState:
    name: str
    kind: str  # "valkey" | "seaweedfs" | "service" | "external"
    endpoint: str
    pid: int | None = None
    log: str = ""
    # Prometheus endpoint (services only).
    metrics: str = ""
    # How to start it again (the supervisor and a later `up` restart a dead component exactly as it was started):
    # argv, and the environment entries that differ from the starting shell's.
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    # "" while it runs as started; "restarting" after a crash (waiting out its backoff); "crash-loop" after
    # several crashes in a row shortly after starting.
    supervision: str = ""
    last_exit: str = ""

    @property
    def restartable(self) -> bool:
        return self.kind != "external" and bool(self.argv)


@dataclass
class ClusterState:
    data_dir: str
    components: list[ComponentState] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    supervisor_pid: int | None = None

    def component(self, name: str) -> ComponentState | None:
        return next((c for c in self.components if c.name == name), None)

    def trainer_components(self) -> list[ComponentState]:
        """The trainer and, with `up --trainers N`, the other members of its fleet (trainer-1, trainer-2, ...)."""
        return [c for c in self.components if c.name == "trainer" or c.name.startswith("trainer-")]

    def sampler_components(self) -> list[ComponentState]:
        """The sampler and, with `up --samplers N`, the other replicas of its fleet (sampler-1, sampler-2, ...)."""
        return [c for c in self.components if c.name == "sampler" or c.name.startswith("sampler-")]

    def addresses(self) -> dict[str, str]:
        return {c.name: c.endpoint for c in self.components if c.name in SERVICE_NAMES}

    def save(self) -> None:
        path = Path(self.data_dir) / STATE_FILE
        # One temporary name per writer: `up`, `down` and the supervisor may write at nearly the same moment.
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        # Only the owner may read it: the services' recorded environment holds the cluster's service key.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(asdict(self), indent=2))
        tmp.replace(path)


def read_cluster_state(data_dir: Path) -> ClusterState | None:
    path = Path(data_dir) / STATE_FILE
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    known = {f.name for f in fields(ComponentState)}
    return ClusterState(data_dir=raw["data_dir"], started_at=raw.get("started_at", 0.0),
                        supervisor_pid=raw.get("supervisor_pid"),
                        components=[ComponentState(**{k: v for k, v in c.items() if k in known})
                                    for c in raw["components"]])


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
