"""`loraplane up | down | status`: the local cluster."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from loraplane.client.addresses import ADMIN_KEY_FILE, TLS_DIR
from loraplane.config import Settings
from loraplane.local.processes import ProcessStartError
from loraplane_cli.app import app
from loraplane_cli.local_cluster import (
    SERVICE_NAMES,
    ClusterState,
    component_health,
    gpu_assignment,
    pid_alive,
    read_cluster_state,
    start_cluster,
    stop_cluster,
)

console = Console()

DataDirOption = typer.Option(None, "--data-dir", help="Where servers keep data and logs (LORAPLANE_DATA_DIR).")


def _settings(data_dir: Path | None, **overrides) -> Settings:
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    if data_dir is not None:
        settings.data_dir = data_dir
    return settings


def _endpoint_table(state: ClusterState, with_health: bool) -> Table:
    table = Table(title=f"loraplane cluster ({state.data_dir})")
    table.add_column("component")
    table.add_column("kind")
    table.add_column("endpoint")
    table.add_column("pid")
    if with_health:
        table.add_column("health")
        table.add_column("restarts")
    for c in state.components:
        row = [c.name, c.kind, c.endpoint, str(c.pid or "-")]
        if with_health:
            health = component_health(c, state.data_dir)
            color = {"healthy": "green", "external": "cyan"}.get(health, "red")
            supervision = f" ([red]{c.supervision}[/red]: {c.last_exit})" if c.supervision else ""
            row += [f"[{color}]{health}[/{color}]{supervision}", str(c.restarts)]
        table.add_row(*row)
    return table


@app.command()
def up(
    data_dir: Path = DataDirOption,
    services: str = typer.Option(",".join(SERVICE_NAMES), help="Comma-separated services to start."),
    base_model: str = typer.Option(None, help="Base model for trainer and sampler (LORAPLANE_BASE_MODEL)."),
    registry_port: int = typer.Option(None, help="Fixed registry port (default: a free one)."),
    trainer_port: int = typer.Option(None, help="Fixed trainer port."),
    sampler_port: int = typer.Option(None, help="Fixed sampler port."),
    auth: bool = typer.Option(True, "--auth/--no-auth", help="Require API keys (an admin key is written to the "
                              "data dir, mode 0600). --no-auth runs the open mode: anyone on the host can do anything."),
    tls: bool = typer.Option(False, "--tls", help="Make a local CA and certificates (in <data dir>/tls) and run "
                             "every service over TLS."),
    mtls: bool = typer.Option(False, "--mtls", help="--tls, and every service demands a client certificate from that "
                              "CA (the CLI and SDK present <data dir>/tls/client.pem)."),
    gateway: bool = typer.Option(True, help="Also start the HTTP gateway (Tinker SDK, OpenAI, Anthropic clients)."),
    gateway_port: int = typer.Option(None, help="Fixed gateway port."),
    trainers: int = typer.Option(1, min=1, max=64, help="Run this many trainers as one fleet: each adapter lives "
                                 "on one of them, moving to another if it dies or is drained (`loraplane trainers`)."),
    samplers: int = typer.Option(1, min=1, max=64, help="Run this many samplers as one fleet: clients and the "
                                 "gateway send each adapter to one of them (by affinity, spreading a hot adapter) "
                                 "and route around one that dies."),
    sampler_engine: str = typer.Option(None, help="torch (in-process; the default) or sglang (each sampler launches "
                                       "an SGLang server on a GPU; LORAPLANE_SAMPLER_ENGINE). Extra SGLang server "
                                       "arguments: LORAPLANE_SAMPLER_SGLANG_ARGS."),
    trainer_gpus: str = typer.Option(None, envvar="LORAPLANE_TRAINER_GPUS",
                                     help="GPUs the trainer may use, e.g. 0 or 0,1 (nvidia-smi indices or UUIDs; "
                                     "its CUDA_VISIBLE_DEVICES). With --trainers N the list is split evenly over "
                                     "the members; one GPU is shared by all. Default: every GPU this shell sees."),
    sampler_gpus: str = typer.Option(None, envvar="LORAPLANE_SAMPLER_GPUS",
                                     help="GPUs the sampler and the SGLang server it launches may use, e.g. 1; "
                                     "split over --samplers N replicas as --trainer-gpus is. Trainer on 0 and "
                                     "sampler on 1 is the disaggregated shape; the same GPU for both shares it."),
) -> None:
    """Start Valkey + SeaweedFS S3 (unless LORAPLANE_REDIS_URL / LORAPLANE_S3_ENDPOINT point elsewhere) and the
    services, wait until each is healthy, and print their endpoints. On a cluster that already runs, starts only
    what is missing or dead. A supervisor restarts any component that dies."""
    settings = _settings(data_dir, base_model=base_model, registry_port=registry_port,
                         trainer_port=trainer_port, sampler_port=sampler_port, gateway_port=gateway_port)
    wanted = tuple(s.strip() for s in services.split(",") if s.strip())
    unknown = [s for s in wanted if s not in SERVICE_NAMES]
    if unknown:
        raise typer.BadParameter(f"unknown service(s) {unknown}; choose from {list(SERVICE_NAMES)}",
                                 param_hint="--services")
    extra_env = {"LORAPLANE_BASE_MODEL": settings.base_model}
    if sampler_engine is not None:
        from sampler_svc.engines import ENGINE_NAMES

        if sampler_engine not in ENGINE_NAMES:
            raise typer.BadParameter(f"unknown engine {sampler_engine!r}: use {' or '.join(ENGINE_NAMES)}",
                                     param_hint="--sampler-engine")
        extra_env["LORAPLANE_SAMPLER_ENGINE"] = sampler_engine
    gpus = {"trainer": trainer_gpus, "sampler": sampler_gpus}
    for service, count in (("trainer", trainers), ("sampler", samplers)):
        if gpus[service] is not None:
            try:
                gpu_assignment(gpus[service], count)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=f"--{service}-gpus") from exc
    try:
        with console.status("starting cluster") as status:
            state, started = start_cluster(settings, wanted, extra_env, on_progress=status.update, auth=auth,
                                           tls=tls or mtls, mtls=mtls,
                                           gateway=gateway and set(wanted) == set(SERVICE_NAMES),
                                           trainers=trainers, samplers=samplers,
                                           gpus={k: v for k, v in gpus.items() if v is not None})
    except (ProcessStartError, ValueError) as exc:  # ValueError: a GPU list that does not split over the fleet
        console.print(f"[red]failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print(_endpoint_table(state, with_health=False))
    data = Path(state.data_dir)
    # What the cluster runs with, which for a cluster that already ran is what it was created with.
    if (data / ADMIN_KEY_FILE).exists():
        console.print(f"auth: on; admin key in {data / ADMIN_KEY_FILE} (mode 0600; the CLI and SDK use it from this "
                      "data dir, or set LORAPLANE_API_KEY). Tenant keys: `loraplane keys create --tenant NAME`.")
    else:
        console.print("[bold red]auth: OFF[/bold red] (--no-auth): anyone who can reach these ports can read and "
                      "change every tenant's adapters.")
    for component in state.components:
        if component.metrics:
            console.print(f"{component.name} metrics: {component.metrics}")
    if (data / TLS_DIR / "ca.pem").exists():
        console.print(f"tls: on; CA certificate {data / TLS_DIR / 'ca.pem'} (set LORAPLANE_TLS_CA to it elsewhere).")
    if (gw := state.component("gateway")) is not None:
        key = "<a tenant key from `loraplane keys create`>" if (data / ADMIN_KEY_FILE).exists() else "tml-local"
        console.print(f"export TINKER_BASE_URL={gw.endpoint} TINKER_API_KEY={key}   "
                      f"# OpenAI / Anthropic clients: {gw.endpoint}/v1")
    if started:
        console.print(f"[green]cluster is up[/green] (started: {', '.join(started)}); a supervisor restarts what "
                      "dies; `loraplane down` stops it.")
    else:
        console.print("[green]cluster is already running[/green]: nothing to start.")


@app.command()
def down(data_dir: Path = DataDirOption) -> None:
    """Stop the cluster started from this data dir."""
    settings = _settings(data_dir)
    state = read_cluster_state(Path(settings.data_dir).resolve())
    if state is None:
        console.print("no cluster is running from " + str(Path(settings.data_dir).resolve()))
        return
    stopped = stop_cluster(state)
    console.print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


@app.command()
def status(data_dir: Path = DataDirOption) -> None:
    """Show each component, its endpoint and whether it is healthy."""
    settings = _settings(data_dir)
    state = read_cluster_state(Path(settings.data_dir).resolve())
    if state is None:
        console.print("no cluster is running from " + str(Path(settings.data_dir).resolve()))
        raise typer.Exit(1)
    console.print(_endpoint_table(state, with_health=True))
    supervised = "[green]running[/green]" if pid_alive(state.supervisor_pid) else \
        "[red]down[/red] (run `loraplane up` to restart it and anything dead)"
    console.print(f"supervisor: {supervised}")
    details = _service_details(state)
    if details.row_count:
        console.print(details)


def _service_details(state: ClusterState) -> Table:
    """What the services hold now: the trainer's adapters, the sampler's loaded versions and queue depth."""
    import grpc

    from loraplane.client.addresses import client_security
    from loraplane.rpc import sync_channel
    from loraplane.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

    table = Table(title="services")
    table.add_column("service")
    table.add_column("detail")
    security = client_security(state.data_dir)
    for trainer in state.trainer_components():  # one, or each member of `up --trainers N`'s fleet
        try:
            with sync_channel(trainer.endpoint, security) as channel:
                stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                info = stub.GetInfo(trainer_pb2.GetInfoRequest(), timeout=3)
                # Each member's own adapters (a member's plain listing is the whole fleet's).
                listed = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(
                    page_size=1000, this_trainer_only=True), timeout=3)
            names = ", ".join(f"{a.name} (step {a.step})" for a in listed.adapters) or "none"
            table.add_row(trainer.name, f"{info.base_model} on {info.backend}/{info.device}; adapters: {names}")
        except grpc.RpcError as exc:
            table.add_row(trainer.name, f"[red]{exc.code().name}[/red]: {exc.details()}")
    for sampler in state.sampler_components():  # one, or each replica of `up --samplers N`'s fleet
        try:
            with sync_channel(sampler.endpoint, security) as channel:
                reply = sampler_pb2_grpc.SamplerServiceStub(channel).GetStatus(sampler_pb2.GetStatusRequest(), timeout=3)
            loaded = ", ".join(f"{a.adapter}@v{a.version}" for a in reply.loaded) or "none"
            table.add_row(sampler.name, f"{reply.engine} engine; queue depth {reply.queue_depth}, running "
                                        f"{reply.running_requests}; loaded: {loaded}")
        except grpc.RpcError as exc:
            table.add_row(sampler.name, f"[red]{exc.code().name}[/red]: {exc.details()}")
    return table
