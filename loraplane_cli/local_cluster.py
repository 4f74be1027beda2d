"""A whole loraplane cluster on loopback (the CLI layer: it starts the services as processes): Valkey + SeaweedFS S3
(unless external ones are configured), then the registry, trainer and sampler, each as its own process, each checked
healthy before the next starts.

`loraplane up` calls `start_cluster`; the processes outlive the command and are recorded, with how to start each
again, in a state file under the data dir, which `loraplane down` and `loraplane status` read. A supervisor process
(loraplane_cli/supervisor.py) restarts whatever dies; `up` on a partly dead cluster starts only what is missing.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from loraplane.client.addresses import client_security
from loraplane.config import Settings
from loraplane.local.processes import (
    LOOPBACK,
    ManagedProcess,
    ProcessStartError,
    free_port,
    redis_ping,
    s3_ready,
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
from loraplane.threads import THREADS_ENV, host_cores, thread_shares
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
# What a service started into an existing cluster takes over from those already there: the same keys and TLS.
SECURITY_ENV = ("LORAPLANE_AUTH", "LORAPLANE_API_KEY", "LORAPLANE_TLS_CERT", "LORAPLANE_TLS_KEY", "LORAPLANE_TLS_CA",
                "LORAPLANE_TLS_CLIENT_CA", "LORAPLANE_TLS_CLIENT_CERT", "LORAPLANE_TLS_CLIENT_KEY")
# The state file's service names and these specs must agree.
assert tuple(spec.name for spec in SERVICES) == SERVICE_NAMES
# `up --trainers N`: the trainers of a local cluster form this fleet (its journal namespace is a lone trainer's, so a
# cluster's adapters carry over); the members are the components trainer, trainer-1, ..., trainer-(N-1).
LOCAL_FLEET = "trainer"
# `up --samplers N`: the samplers form this sampler fleet (replicas sampler, sampler-1, ...); clients and the gateway
# learn the replicas from the first one.
LOCAL_SAMPLER_FLEET = "sampler"
# Per service: the environment that makes an instance a member of its local fleet, and the setting naming it.
_FLEET_ENV = {"trainer": ("LORAPLANE_TRAINER_FLEET", LOCAL_FLEET, "LORAPLANE_TRAINER_ID"),
              "sampler": ("LORAPLANE_SAMPLER_FLEET", LOCAL_SAMPLER_FLEET, "LORAPLANE_SAMPLER_ID")}
# Services that may be pinned to GPUs (`up --trainer-gpus / --sampler-gpus`): the registry and gateway use none.
GPU_SERVICES = ("trainer", "sampler")
# Services whose torch compute shares the host's cores (`cluster_thread_shares`); the registry and gateway do I/O.
COMPUTE_SERVICES = ("trainer", "sampler")


def gpu_assignment(gpus: str, instances: int) -> list[str]:
    """Splits a service's GPU list ("0,1,2,3": indices as nvidia-smi numbers them, or GPU UUIDs) over its
    `instances` (a fleet's members, in order): each gets an equal run of consecutive GPUs ("0,1" and "2,3" for two),
    and one GPU alone is shared by all of them. Returns each instance's CUDA_VISIBLE_DEVICES; ValueError when the
    list is malformed or does not split evenly."""
    ids = [g.strip() for g in gpus.split(",")]
    if not gpus.strip() or any(not g or any(c.isspace() for c in g) for g in ids):
        raise ValueError(f"{gpus!r} is not a comma-separated list of GPU indices or UUIDs (e.g. 0 or 0,1)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{gpus!r} names a GPU twice")
    if len(ids) == 1:
        return ids * instances
    if len(ids) % instances:
        raise ValueError(f"{len(ids)} GPUs ({gpus}) do not split evenly over {instances} instances")
    per = len(ids) // instances
    return [",".join(ids[i * per:(i + 1) * per]) for i in range(instances)]


def gpu_env(gpus: str) -> dict[str, str]:
    """The environment that confines a process (and its children: torchrun's ranks, a launched SGLang server) to
    these GPUs. CUDA numbers devices fastest first by default; PCI bus order makes the indices nvidia-smi's."""
    return {"CUDA_VISIBLE_DEVICES": gpus, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def cluster_thread_shares(instances: list[str], cores: int, env: dict[str, str]) -> dict[str, str]:
    """Each compute instance's LORAPLANE_TORCH_THREADS: its share of the host's cores, so a trainer and a sampler on
    one host do not each run torch on every core and starve each other (issue 31). Empty when the caller set the
    variable: every service then uses the caller's count."""
    if env.get(THREADS_ENV):
        return {}
    return {name: str(share) for name, share in zip(instances, thread_shares(cores, len(instances)), strict=True)}


def start_cluster(settings: Settings, services: tuple[str, ...] = SERVICE_NAMES,
                  extra_env: dict[str, str] | None = None, on_progress=None, *, auth: bool = False,
                  tls: bool = False, mtls: bool = False, gateway: bool = False,
                  commands: dict[str, list[str]] | None = None,
                  trainers: int = 1, samplers: int = 1,
                  gpus: dict[str, str] | None = None) -> tuple[ClusterState, list[str]]:
    """Brings the cluster of this data dir up: starts what was never started, restarts (exactly as first started,
    same ports, data, keys and certificates) what has died, leaves running components alone, then hands the whole
    cluster to a fresh supervisor. Returns the state and the names started. On a failure stops what this call
    started and raises ProcessStartError. `auth`: keys required (an admin key written to the data dir); `tls`: a
    local CA and TLS everywhere; both apply when the cluster is created (an existing one keeps its own). With
    `gateway`, the HTTP gateway (gateway_svc) comes last, in front of the three services. `commands` gives a
    service another argv than `python -m <module>` (the megatron trainer under torchrun, a sampler on SGLang); it
    gets the same environment, health check and supervision. `trainers` > 1 runs that many trainers as one fleet
    (docs/architecture.md, "Trainer fleet"); clients find each adapter's trainer through any of them. `samplers` > 1
    runs that many samplers as one sampler fleet ("Sampler fleet"); clients route each adapter to one of them.
    `gpus` pins services to GPUs: {"trainer": "0", "sampler": "1"} starts the trainer (torchrun and its ranks) with
    only GPU 0 visible and the sampler (and the SGLang servers it launches) with only GPU 1; a fleet's list is split
    over its members (`gpu_assignment`). Unpinned services see what this process sees. Restarts keep the pin."""
    data_dir = Path(settings.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    existing = read_cluster_state(data_dir)
    state = existing or ClusterState(data_dir=str(data_dir))
    unknown = sorted(set(gpus or {}) - set(GPU_SERVICES))
    if unknown:
        raise ValueError(f"only {' and '.join(GPU_SERVICES)} can be pinned to GPUs, not {', '.join(unknown)}")
    # Checked before anything starts: a list that does not split over the fleet leaves nothing half started.
    pins = {service: gpu_assignment(spec, len(_instance_names(service, state, trainers, samplers)))
            for service, spec in (gpus or {}).items() if spec}
    # While this call starts things the supervisor must not restart them too.
    stop_supervisor(state)
    progress = on_progress or (lambda _msg: None)
    env = {**os.environ, **(extra_env or {}), "LORAPLANE_DATA_DIR": str(data_dir)}
    started: list[str] = []
    added: list[str] = []

    def launch(component: ComponentState, process: ManagedProcess, ready) -> None:
        progress(f"starting {component.name}")
        process.start()
        component.pid = process.pid
        started.append(component.name)
        state.save()
        wait_until(ready, _start_timeout(component), component.name, process)

    def add(component: ComponentState, process: ManagedProcess, ready) -> None:
        component.argv, component.env, component.log = list(process.argv), _env_overrides(process.env), \
            str(process.log_path)
        state.components.append(component)
        added.append(component.name)
        launch(component, process, ready)

    # Counted over what will run (those already running keep the share they started with).
    compute = [name for service in COMPUTE_SERVICES for name in _instance_names(service, state, trainers, samplers)
               if service in services or state.component(name) is not None]
    threads = cluster_thread_shares(compute, host_cores(), env) if compute else {}
    try:
        for component in state.components:
            if component.restartable and not pid_alive(component.pid):
                component.supervision, component.last_exit = "", ""
                launch(component, relaunchable(component), functools.partial(component_ready, component, settings))

        if state.component("redis") is None:
            if settings.redis_url:
                state.components.append(ComponentState("redis", "external", settings.redis_url))
            else:
                valkey = valkey_server(data_dir / "valkey")
                add(ComponentState("redis", "valkey", valkey.url), valkey.process,
                    functools.partial(redis_ping, valkey.port))
        env["LORAPLANE_REDIS_URL"] = state.component("redis").endpoint
        services_so_far = [c for c in state.components if c.kind == "service"]
        if services_so_far:
            env.update({k: v for k, v in services_so_far[0].env.items() if k in SECURITY_ENV})
        else:
            env.update(secure_cluster_env(data_dir, env["LORAPLANE_REDIS_URL"], settings.key_prefix, auth=auth,
                                          tls=tls, mtls=mtls))

        if state.component("s3") is None:
            if settings.s3_endpoint:
                state.components.append(ComponentState("s3", "external", settings.s3_endpoint))
            else:
                s3 = seaweed_s3_server(data_dir / "seaweedfs", access_key=settings.s3_access_key,
                                       secret_key=settings.s3_secret_key)
                add(ComponentState("s3", "seaweedfs", s3.endpoint), s3.process,
                    functools.partial(s3_ready, s3.endpoint, s3.access_key, s3.secret_key))
        env["LORAPLANE_S3_ENDPOINT"] = state.component("s3").endpoint

        for spec in SERVICES:
            names = _instance_names(spec.name, state, trainers, samplers)
            # Samplers always form the local sampler fleet (of one, by default) and trainers name it: a trainer hands
            # each new version straight to the fleet's replicas (trainer_svc/handoff.py), which it finds only through
            # the fleet's membership; a lone sampler would take every version from the registry instead.
            fleet = spec.name in _FLEET_ENV and (len(names) > 1 or spec.name == "sampler")
            fleet_env, fleet_name, id_env = _FLEET_ENV.get(spec.name, ("", "", ""))
            for index, name in enumerate(names):
                component = state.component(name)
                if component is not None and fleet and component.env.get(fleet_env) != fleet_name:
                    raise ProcessStartError(f"{name} runs as a lone {spec.name}; to run {len(names)} {spec.name}s as "
                                            f"a fleet, `loraplane down` first, then `loraplane up --{spec.name}s N`")
                if component is None and spec.name in services:
                    port = (getattr(settings, f"{spec.name}_port") if name == spec.name else 0) or free_port()
                    metrics_port = free_port()
                    env.update({spec.port_env: str(port), "LORAPLANE_HOST": LOOPBACK,
                                "LORAPLANE_METRICS_PORT": str(metrics_port)})
                    instance_env = dict(env)
                    if fleet:
                        instance_env.update({fleet_env: fleet_name, id_env: name})
                    if spec.name == "trainer":
                        instance_env["LORAPLANE_SAMPLER_FLEET"] = LOCAL_SAMPLER_FLEET
                    if spec.name in pins:
                        instance_env.update(gpu_env(pins[spec.name][index]))
                    if name in threads:
                        instance_env[THREADS_ENV] = threads[name]
                    component = ComponentState(name, "service", f"{LOOPBACK}:{port}",
                                               metrics=f"http://{LOOPBACK}:{metrics_port}/metrics")
                    argv = (commands or {}).get(spec.name) or [sys.executable, "-m", spec.module]
                    add(component, ManagedProcess(name, list(argv), data_dir / "logs" / f"{name}.log",
                                                  env=instance_env),
                        functools.partial(component_ready, component, settings))
            first = state.component(spec.name)
            if first is not None:
                env[spec.address_env] = first.endpoint
        if gateway and state.component("gateway") is None:
            add(*_gateway_component(settings, state, env, data_dir))
        state.supervisor_pid = start_supervisor(data_dir)
        state.save()
    except BaseException:
        for name in reversed(started):
            _terminate_group(state.component(name).pid, 15.0)
        state.components = [c for c in state.components if c.name not in added]
        if any(pid_alive(c.pid) for c in state.components):
            state.save()
        else:
            _remove_state_file(state)
        raise
    return state, started


def relaunchable(component: ComponentState) -> ManagedProcess:
    """The process that restarts a component as it was first started (its log continues)."""
    return ManagedProcess(component.name, list(component.argv), Path(component.log),
                          env={**os.environ, **component.env})


def component_ready(component: ComponentState, settings: Settings) -> bool:
    if component.kind in ("service", "gateway"):
        return component_health(component, str(Path(settings.data_dir).resolve())) == "healthy"
    if component.kind == "valkey":
        return redis_ping(urlsplit(component.endpoint).port)
    if component.kind == "seaweedfs":
        return s3_ready(component.endpoint, settings.s3_access_key, settings.s3_secret_key)
    return True


def start_supervisor(data_dir: Path) -> int:
    supervisor = ManagedProcess("supervisor", [sys.executable, "-m", "loraplane_cli.supervisor", str(data_dir)],
                                data_dir / "logs" / "supervisor.log")
    supervisor.start()
    return supervisor.pid


def stop_supervisor(state: ClusterState) -> None:
    if pid_alive(state.supervisor_pid):
        _terminate_group(state.supervisor_pid, 10.0)
    state.supervisor_pid = None


def gateway_healthy(endpoint: str, timeout: float = 1.0) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{endpoint}/api/v1/healthz", timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


def _gateway_component(settings: Settings, state: ClusterState, env: dict[str, str], data_dir: Path):
    """The gateway's component, process and readiness check, for `add`."""
    port = settings.gateway_port or free_port()
    addresses = state.addresses()
    gateway_env = {**env, "LORAPLANE_GATEWAY_HOST": LOOPBACK, "LORAPLANE_GATEWAY_PORT": str(port),
                   "LORAPLANE_GATEWAY_REDIS_URL": state.component("redis").endpoint,
                   "LORAPLANE_GATEWAY_TRAINER_ADDRESS": addresses["trainer"],
                   "LORAPLANE_GATEWAY_REGISTRY_ADDRESS": addresses["registry"],
                   "LORAPLANE_GATEWAY_SAMPLER_ADDRESS": addresses["sampler"],
                   "LORAPLANE_GATEWAY_TOKENIZER_DIR": str(data_dir / "gateway" / "tokenizers"),
                   # Where the gateway finds live trainers when the one above is down (`up --trainers N`).
                   "LORAPLANE_TRAINER_FLEET": LOCAL_FLEET}
    process = ManagedProcess("gateway", [sys.executable, "-m", "gateway_svc"], data_dir / "logs" / "gateway.log",
                             env=gateway_env)
    endpoint = f"http://{LOOPBACK}:{port}"
    return ComponentState("gateway", "gateway", endpoint), process, functools.partial(gateway_healthy, endpoint)


# `weed server` answers SIGTERM by waiting out a fixed 10 s grace whatever it has to do; what it stores is on disk
# as each request is answered (its volume and index files, its filer's log), so a kill after a short grace loses
# nothing a client was told is stored.
SEAWEEDFS_GRACE_S = 2.0


def stop_cluster(state: ClusterState, timeout: float = 15.0) -> list[str]:
    """Stops the supervisor, then components in reverse start order (services before their storage). Returns the
    names stopped."""
    stop_supervisor(state)
    # The supervisor may have restarted components since `state` was read: their pids are in the file.
    state = read_cluster_state(Path(state.data_dir)) or state
    stopped = []
    for component in reversed(state.components):
        if not pid_alive(component.pid):
            continue
        _terminate_group(component.pid, SEAWEEDFS_GRACE_S if component.kind == "seaweedfs" else timeout)
        stopped.append(component.name)
    _remove_state_file(state)
    return stopped


def _remove_state_file(state: ClusterState) -> None:
    state_path = Path(state.data_dir) / STATE_FILE
    if state_path.exists():
        state_path.unlink()


def _env_overrides(env: dict[str, str] | None) -> dict[str, str]:
    return {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}


def _spec(name: str) -> ServiceSpec:
    # trainer-1, trainer-2, ... are trainers too.
    return next(s for s in SERVICES if s.name == name.split("-")[0])


def _instance_names(service: str, state: ClusterState, trainers: int, samplers: int = 1) -> list[str]:
    if service == "trainer":
        count = max(trainers, len(state.trainer_components()))
    elif service == "sampler":
        count = max(samplers, len(state.sampler_components()))
    else:
        return [service]
    return [service, *(f"{service}-{i}" for i in range(1, count))]


def _start_timeout(component: ComponentState) -> float:
    return _spec(component.name).start_timeout if component.kind == "service" else 120.0


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
        if not pid_alive(component.pid):
            return "down"
        return "healthy" if check_health(component.endpoint, _spec(component.name).grpc_service, timeout=1.0,
                                         security=client_security(data_dir)) else "unhealthy"
    if component.kind == "gateway":
        if not pid_alive(component.pid):
            return "down"
        return "healthy" if gateway_healthy(component.endpoint) else "unhealthy"
    if component.kind == "external":
        return "external"
    return "healthy" if pid_alive(component.pid) else "down"
