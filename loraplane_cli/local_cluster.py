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
                  extra_env: dict[str, str] | None = None, on_progress=None, gateway: bool = False) -> ClusterState:
    """Starts every component in order; on any failure stops what was started and raises ProcessStartError.
    With `gateway`, the HTTP gateway (gateway_svc) comes last, in front of the three services."""
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
            proc = ManagedProcess(spec.name, [sys.executable, "-m", spec.module], data_dir / "logs" / f"{spec.name}.log",
                                  env=dict(env))
            proc.start()
            address = f"{LOOPBACK}:{port}"
            state.components.append(ComponentState(spec.name, "service", address, proc.pid, str(proc.log_path)))
            state.save()
            wait_until(functools.partial(check_health, address, spec.grpc_service, timeout=1.0),
                       spec.start_timeout, spec.name, proc)
            env[spec.address_env] = address
        if gateway:
            progress("starting gateway")
            _start_gateway(settings, state, env, data_dir)
    except BaseException:
        stop_cluster(state)
        raise
    state.save()
    return state


def gateway_healthy(endpoint: str, timeout: float = 1.0) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{endpoint}/api/v1/healthz", timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


def _start_gateway(settings: Settings, state: ClusterState, env: dict[str, str], data_dir: Path) -> None:
    port = settings.gateway_port or free_port()
    addresses = state.addresses()
    gateway_env = {**env, "LORAPLANE_GATEWAY_HOST": LOOPBACK, "LORAPLANE_GATEWAY_PORT": str(port),
                   "LORAPLANE_GATEWAY_REDIS_URL": state.component("redis").endpoint,
                   "LORAPLANE_GATEWAY_TRAINER_ADDRESS": addresses["trainer"],
                   "LORAPLANE_GATEWAY_REGISTRY_ADDRESS": addresses["registry"],
                   "LORAPLANE_GATEWAY_SAMPLER_ADDRESS": addresses["sampler"],
                   "LORAPLANE_GATEWAY_TOKENIZER_DIR": str(data_dir / "gateway" / "tokenizers")}
    proc = ManagedProcess("gateway", [sys.executable, "-m", "gateway_svc"], data_dir / "logs" / "gateway.log",
                          env=gateway_env)
    proc.start()
    endpoint = f"http://{LOOPBACK}:{port}"
    state.components.append(ComponentState("gateway", "gateway", endpoint, proc.pid, str(proc.log_path)))
    state.save()
    wait_until(functools.partial(gateway_healthy, endpoint), 120.0, "gateway", proc)


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


def component_health(component: ComponentState) -> str:
    """'healthy' | 'down' | 'unhealthy' — 'unhealthy' means the process lives but does not answer."""
    if component.kind == "service":
        spec = next(s for s in SERVICES if s.name == component.name)
        if not pid_alive(component.pid):
            return "down"
        return "healthy" if check_health(component.endpoint, spec.grpc_service, timeout=1.0) else "unhealthy"
    if component.kind == "gateway":
        if not pid_alive(component.pid):
            return "down"
        return "healthy" if gateway_healthy(component.endpoint) else "unhealthy"
    if component.kind == "external":
        return "external"
    return "healthy" if pid_alive(component.pid) else "down"
