"""A whole loraplane cluster on loopback (the CLI layer: it starts the services as processes): Valkey + SeaweedFS S3 (unless external ones are configured), then the
registry, trainer and sampler, each as its own process, each checked healthy before the next starts.

`loraplane up` calls `start_cluster`; the processes outlive the command and are recorded in a state file under
the data dir, which `loraplane down` and `loraplane status` read.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loraplane.client.addresses import client_security
from loraplane.config import Settings
from loraplane.local.processes import (
    LOOPBACK,
    ManagedProcess,
    ProcessStartError,
    free_port,
    seaweed_s3_server,
    valkey_server,
    wait_until,
)
from loraplane.local.state import (
    SERVICE_NAMES,
    STATE_FILE,
    ClusterState,
    ComponentState,
    pid_alive,
    read_cluster_state,
)
from loraplane.rpc import check_health
from loraplane_cli.keys import secure_cluster_env


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    module: str
    grpc_service: str
    port_env: str
    address_env: str
    # Model loading (SmolLM2 conversion on first use) can take minutes on a small machine.
    start_timeout: float = 60.0


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("registry", "registry_svc", "loraplane.v1.AdapterRegistryService",
                "LORAPLANE_REGISTRY_PORT", "LORAPLANE_REGISTRY_ADDRESS"),
    ServiceSpec("trainer", "trainer_svc", "loraplane.v1.TrainerService",
                "LORAPLANE_TRAINER_PORT", "LORAPLANE_TRAINER_ADDRESS", start_timeout=900.0),
    ServiceSpec("sampler", "sampler_svc", "loraplane.v1.SamplerService",
                "LORAPLANE_SAMPLER_PORT", "LORAPLANE_SAMPLER_ADDRESS", start_timeout=900.0),
)
# The state file's service names and these specs must agree.
assert tuple(spec.name for spec in SERVICES) == SERVICE_NAMES


def start_cluster(settings: Settings, services: tuple[str, ...] = SERVICE_NAMES,
                  extra_env: dict[str, str] | None = None, on_progress=None, *, auth: bool = False,
                  tls: bool = False) -> ClusterState:
    """Starts every component in order; on any failure stops what was started and raises ProcessStartError.
    `auth`: keys required (an admin key written to the data dir); `tls`: a local CA and TLS everywhere."""
    data_dir = Path(settings.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    existing = read_cluster_state(data_dir)
    if existing and any(pid_alive(c.pid) for c in existing.components):
        raise ProcessStartError(f"a cluster is already running from {data_dir} (run `loraplane down` first)")
    state = ClusterState(data_dir=str(data_dir))
    progress = on_progress or (lambda _msg: None)
    env = {**os.environ, **(extra_env or {}), "LORAPLANE_DATA_DIR": str(data_dir)}
    try:
        if settings.redis_url:
            state.components.append(ComponentState("redis", "external", settings.redis_url))
        else:
            progress("starting valkey")
            valkey = valkey_server(data_dir / "valkey")
            valkey.start()
            state.components.append(ComponentState("redis", "valkey", valkey.url, valkey.process.pid,
                                                   str(valkey.process.log_path)))
        env["LORAPLANE_REDIS_URL"] = state.component("redis").endpoint
        state.save()
        env.update(secure_cluster_env(data_dir, env["LORAPLANE_REDIS_URL"], settings.key_prefix, auth=auth, tls=tls))
        probe = client_security(data_dir)

        if settings.s3_endpoint:
            state.components.append(ComponentState("s3", "external", settings.s3_endpoint))
        else:
            progress("starting seaweedfs s3")
            s3 = seaweed_s3_server(data_dir / "seaweedfs", access_key=settings.s3_access_key,
                                   secret_key=settings.s3_secret_key)
            s3.start()
            state.components.append(ComponentState("s3", "seaweedfs", s3.endpoint, s3.process.pid,
                                                   str(s3.process.log_path)))
        env["LORAPLANE_S3_ENDPOINT"] = state.component("s3").endpoint
        state.save()

        for spec in SERVICES:
            if spec.name not in services:
                continue
            progress(f"starting {spec.name}")
            configured = getattr(settings, f"{spec.name}_port")
            port = configured or free_port()
            env[spec.port_env] = str(port)
            env["LORAPLANE_HOST"] = LOOPBACK
            metrics_port = free_port()
            env["LORAPLANE_METRICS_PORT"] = str(metrics_port)
            proc = ManagedProcess(spec.name, [sys.executable, "-m", spec.module], data_dir / "logs" / f"{spec.name}.log",
                                  env=dict(env))
            proc.start()
            address = f"{LOOPBACK}:{port}"
            state.components.append(ComponentState(spec.name, "service", address, proc.pid, str(proc.log_path),
                                                   metrics=f"http://{LOOPBACK}:{metrics_port}/metrics"))
            state.save()
            wait_until(functools.partial(check_health, address, spec.grpc_service, timeout=1.0, security=probe),
                       spec.start_timeout, spec.name, proc)
            env[spec.address_env] = address
    except BaseException:
        stop_cluster(state)
        raise
    state.save()
    return state


def stop_cluster(state: ClusterState, timeout: float = 15.0) -> list[str]:
    """Stops components in reverse start order (services before their storage). Returns the names stopped."""
    stopped = []
    for component in reversed(state.components):
        if not pid_alive(component.pid):
            continue
        _terminate_group(component.pid, timeout)
        stopped.append(component.name)
    state_path = Path(state.data_dir) / STATE_FILE
    if state_path.exists():
        state_path.unlink()
    return stopped


def _terminate_group(pid: int, timeout: float) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def component_health(component: ComponentState, data_dir: str | None = None) -> str:
    """'healthy' | 'down' | 'unhealthy' — 'unhealthy' means the process lives but does not answer."""
    if component.kind == "service":
        spec = next(s for s in SERVICES if s.name == component.name)
        if not pid_alive(component.pid):
            return "down"
        return "healthy" if check_health(component.endpoint, spec.grpc_service, timeout=1.0,
                                         security=client_security(data_dir)) else "unhealthy"
    if component.kind == "external":
        return "external"
    return "healthy" if pid_alive(component.pid) else "down"
