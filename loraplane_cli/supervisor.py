"""Keeps a local cluster alive: `loraplane up` leaves this process running beside the components it started
(`python -m loraplane_cli.supervisor DATA_DIR`). It restarts any component that dies, exactly as it was first
started (same argv, environment, ports and data, so clients and the other components find it where it was), after
an exponential backoff; several crashes in a row, each soon after a start, mark the component "crash-loop" in the
state file, which `loraplane status` shows. Restarts go on at the longest backoff: whatever broke (a port taken, a
full disk) may be fixed without touching the cluster.

The supervisor owns the state file while it runs: `up` and `down` stop it before they change anything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from loraplane.local.state import STATE_FILE, ClusterState, ComponentState, pid_alive, read_cluster_state
from loraplane_cli.local_cluster import relaunchable

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
# A component that ran this long before dying crashed "for a reason of its own": its backoff starts over.
STABLE_AFTER_S = 30.0
CRASH_LOOP_AFTER = 3
TICK_S = 0.25


@dataclass
class _Watch:
    """What the supervisor knows of one component beyond the state file."""

    started_at: float
    failures: int = 0
    retry_at: float | None = None
    child: subprocess.Popen | None = None  # set once the supervisor itself started it (then exit codes are known)


class Supervisor:
    def __init__(self, data_dir: Path, clock=time.monotonic, log=print) -> None:
        self.data_dir = data_dir
        self.clock = clock
        self.log = log
        self.watches: dict[str, _Watch] = {}

    def tick(self, state: ClusterState) -> bool:
        """One look at every component; restarts what is due. True when the state changed."""
        changed = False
        now = self.clock()
        for component in state.components:
            if component.restartable:
                changed |= self._look_after(component, now)
        return changed

    def _look_after(self, component: ComponentState, now: float) -> bool:
        watch = self.watches.setdefault(component.name, _Watch(started_at=now))
        if self._alive(component, watch):
            if watch.failures and now - watch.started_at >= STABLE_AFTER_S:
                watch.failures = 0
                component.supervision = ""
                return True
            return False
        changed = False
        if watch.retry_at is None:
            # Just found dead.
            if now - watch.started_at >= STABLE_AFTER_S:
                watch.failures = 0
            watch.failures += 1
            watch.retry_at = now + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (watch.failures - 1))
            component.last_exit = _exit_description(watch.child)
            component.supervision = "crash-loop" if watch.failures >= CRASH_LOOP_AFTER else "restarting"
            self.log(f"{component.name} (pid {component.pid}) died: {component.last_exit}; restart "
                     f"#{component.restarts + 1} in {watch.retry_at - now:.0f} s ({component.supervision})")
            changed = True
        if now >= watch.retry_at:
            process = relaunchable(component)
            try:
                process.start()
            except OSError as exc:
                self.log(f"{component.name} could not be started: {exc}")
                watch.retry_at = None
                return changed
            component.pid = process.pid
            component.restarts += 1
            watch.child, watch.started_at, watch.retry_at = process.popen, now, None
            self.log(f"{component.name} restarted as pid {component.pid}")
            changed = True
        return changed

    @staticmethod
    def _alive(component: ComponentState, watch: _Watch) -> bool:
        if watch.child is not None and watch.child.pid == component.pid:
            return watch.child.poll() is None  # also reaps it
        return pid_alive(component.pid)

    def run(self, stop: threading.Event) -> None:
        state = read_cluster_state(self.data_dir)
        if state is not None:
            state.supervisor_pid = os.getpid()
            state.save()
        while state is not None and not stop.is_set():
            if self.tick(state):
                state.save()
            stop.wait(TICK_S)
            if not (self.data_dir / STATE_FILE).exists():
                self.log("the cluster's state file is gone (`loraplane down`): exiting")
                return


def _exit_description(child: subprocess.Popen | None) -> str:
    if child is None or child.returncode is None:
        return "exited (not our child: exit status unknown)"
    if child.returncode < 0:
        return f"killed by signal {signal.Signals(-child.returncode).name}"
    return f"exit code {child.returncode}"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m loraplane_cli.supervisor DATA_DIR")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def log(message: str) -> None:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}", flush=True)

    log(f"supervising the cluster in {args[0]}")
    Supervisor(Path(args[0]), log=log).run(stop)


if __name__ == "__main__":
    main()
