"""`loraplane adapters ls|show|versions|rm|alias`, `watch`, `sample`, `demo`, `bench`: the commands a user of a
running cluster types. Addresses come from --registry/--trainer/--sampler, else LORAPLANE_*_ADDRESS, else the state
file `loraplane up` wrote (under --data-dir / LORAPLANE_DATA_DIR)."""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from loraplane.client import APIError, SamplingParams, ServiceClient
from loraplane.client.addresses import resolve_address
from loraplane.registry_client import EventType, RegistryEvent, VersionKind
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
from loraplane_cli.app import app
from loraplane_cli.common import encode_prompt

console = Console()
err_console = Console(stderr=True)

adapters_app = typer.Typer(no_args_is_help=True, help="Adapters and their versions in the registry.")
app.add_typer(adapters_app, name="adapters")

RegistryOption = typer.Option(None, "--registry", help="Registry host:port (LORAPLANE_REGISTRY_ADDRESS).")
TrainerOption = typer.Option(None, "--trainer", help="Trainer host:port (LORAPLANE_TRAINER_ADDRESS).")
SamplerOption = typer.Option(None, "--sampler", help="Sampler host:port (LORAPLANE_SAMPLER_ADDRESS).")
DataDirOption = typer.Option(None, "--data-dir", help="Data dir of `loraplane up` (LORAPLANE_DATA_DIR).")
DemoOutOption = typer.Option(Path("demo-output"), help="Where the loss plot and log are written.")
BenchArgsOption = typer.Option(None, "--arg", help="Extra argument passed to the script (repeatable).")

_KINDS = {VersionKind.WEIGHTS: "weights", VersionKind.TRAINING_STATE: "state"}
_EVENT_NAMES = {
    EventType.ADAPTER_CREATED: ("created", "green"),
    EventType.VERSION_PUBLISHED: ("published", "cyan"),
    EventType.ALIAS_SET: ("alias", "magenta"),
    EventType.VERSION_DELETED: ("version deleted", "yellow"),
    EventType.ADAPTER_DELETED: ("adapter deleted", "red"),
}


def _service(registry=None, trainer=None, sampler=None, data_dir=None) -> ServiceClient:
    return ServiceClient(trainer=trainer, sampler=sampler, registry=registry, data_dir=data_dir)


def _fail(exc: BaseException) -> typer.Exit:
    """Prints an API or address error as one readable line and exits non-zero (no traceback for user errors)."""
    if isinstance(exc, APIError):
        err_console.print(f"[red]error[/red] {exc.code.name}: {exc.server_message}")
    else:
        err_console.print(f"[red]error[/red] {exc}")
    return typer.Exit(1)


def _time(unix_seconds: float | None) -> str:
    if not unix_seconds:
        return "-"
    return dt.datetime.fromtimestamp(unix_seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _timestamp(proto_ts) -> str:
    return _time(proto_ts.ToNanoseconds() / 1e9)


def _size(num: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return str(num)


# ---- adapters ---------------------------------------------------------------------------------------------------


@adapters_app.command("ls")
def adapters_ls(prefix: str = typer.Option("", help="Only names starting with this (e.g. 'tenant/')."),
                registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """List adapters: base model, LoRA shape, latest version, aliases."""
    try:
        found = _service(registry=registry, data_dir=data_dir).list_adapters(prefix)
    except (APIError, ValueError) as exc:
        raise _fail(exc) from None
    table = Table(title=f"adapters ({len(found)})")
    for column in ("name", "base model", "rank", "alpha", "latest", "aliases", "created"):
        table.add_column(column)
    for a in found:
        aliases = ", ".join(f"{k}→v{v}" for k, v in sorted(a.aliases.items()))
        table.add_row(a.name, a.base_model, str(a.lora_config.rank), f"{a.lora_config.alpha or a.lora_config.rank:g}",
                      f"v{a.latest_version}" if a.latest_version else "-", aliases or "-", _timestamp(a.create_time))
    console.print(table)


@adapters_app.command("show")
def adapters_show(name: str, registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """Details of one adapter and a summary of its versions."""
    service = _service(registry=registry, data_dir=data_dir)
    try:
        adapter = service.get_adapter(name)
        versions = service.list_versions(name)
    except (APIError, ValueError) as exc:
        raise _fail(exc) from None
    lora = adapter.lora_config
    table = Table(show_header=False, title=f"adapter {adapter.name}")
    table.add_column("field", style="bold")
    table.add_column("value")
    weights = [v for v in versions if v.kind == "weights"]
    states = [v for v in versions if v.kind == "training_state"]
    rows = [
        ("base model", adapter.base_model or "-"),
        ("rank / alpha", f"{lora.rank} / {lora.alpha or lora.rank:g}"),
        ("target modules", ", ".join(lora.target_modules) or "all projections"),
        ("seed", str(lora.seed)),
        ("keep last", str(adapter.keep_last or "all")),
        ("latest version", f"v{adapter.latest_version}" if adapter.latest_version else "-"),
        ("aliases", ", ".join(f"{k}→v{v}" for k, v in sorted(adapter.aliases.items())) or "-"),
        ("weights versions", str(len(weights))),
        ("training states", str(len(states))),
        ("created", _timestamp(adapter.create_time)),
        *((f"metadata.{k}", v) for k, v in sorted(adapter.metadata.items())),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


@adapters_app.command("versions")
def adapters_versions(name: str,
                      kind: str = typer.Option("all", help="weights | state | all"),
                      registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """List an adapter's versions (oldest first)."""
    kinds = {"all": common_pb2.VERSION_KIND_UNSPECIFIED, "weights": common_pb2.VERSION_KIND_WEIGHTS,
             "state": common_pb2.VERSION_KIND_TRAINING_STATE}
    if kind not in kinds:
        raise typer.BadParameter(f"--kind must be one of {', '.join(kinds)}")
    try:
        versions = _service(registry=registry, data_dir=data_dir).list_versions(name, kind=kinds[kind])
    except (APIError, ValueError) as exc:
        raise _fail(exc) from None
    table = Table(title=f"{name}: {len(versions)} versions")
    for column in ("version", "kind", "step", "size", "sha256", "aliases", "created", "metadata"):
        table.add_column(column)
    for v in versions:
        table.add_row(f"v{v.version}", v.kind.replace("training_state", "state"), str(v.training_step),
                      _size(v.size_bytes), v.sha256[:12], ", ".join(v.aliases) or "-", _time(v.create_time),
                      ", ".join(f"{k}={val}" for k, val in sorted(v.metadata.items())) or "-")
    console.print(table)


@adapters_app.command("rm")
def adapters_rm(name: str,
                version: int = typer.Option(0, "--version", "-v", help="Delete only this version."),
                yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
                registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """Delete an adapter (all its versions and aliases) or one version."""
    what = f"version {version} of {name}" if version else f"adapter {name} and all its versions"
    if not yes and not typer.confirm(f"Delete {what}?"):
        raise typer.Exit(1)
    service = _service(registry=registry, data_dir=data_dir)
    try:
        if version:
            service.delete_version(name, version)
        else:
            service.delete_adapter(name)
    except (APIError, ValueError) as exc:
        raise _fail(exc) from None
    console.print(f"deleted {what}")


@adapters_app.command("alias")
def adapters_alias(name: str, alias: str,
                   version: int = typer.Argument(..., help="Version the alias points at; 0 removes the alias."),
                   registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """Point ALIAS of adapter NAME at VERSION (0 removes it)."""
    try:
        adapter = _service(registry=registry, data_dir=data_dir).set_alias(name, alias, version)
    except (APIError, ValueError) as exc:
        raise _fail(exc) from None
    if version:
        console.print(f"{name}@{alias} → v{adapter.aliases.get(alias, version)}")
    else:
        console.print(f"removed alias {alias} of {name}")


# ---- watch ------------------------------------------------------------------------------------------------------


def _event_line(event: RegistryEvent) -> str:
    label, color = _EVENT_NAMES.get(event.type, ("event", "white"))
    when = _time(event.time)
    detail = ""
    if event.type == EventType.VERSION_PUBLISHED:
        detail = f" v{event.version} ({_KINDS.get(event.kind, 'weights')}, sha256 {event.sha256[:12]})"
    elif event.type == EventType.ALIAS_SET:
        detail = f" {event.alias} → v{event.version}" if event.version else f" {event.alias} removed"
    elif event.type == EventType.VERSION_DELETED:
        detail = f" v{event.version}"
    return f"{when}  [{color}]{label:<16}[/{color}] [bold]{event.adapter}[/bold]{detail}"


@app.command()
def watch(adapter: str = typer.Option("", help="Only this adapter's events."),
          prefix: str = typer.Option("", help="Only adapters whose name starts with this."),
          from_start: bool = typer.Option(False, "--from-start", help="Replay retained history first."),
          after: str = typer.Option("", "--after", help="Resume after this event cursor."),
          max_events: int = typer.Option(0, help="Stop after this many events (0 = run until Ctrl-C)."),
          timeout: float = typer.Option(0.0, help="Stop after this many seconds (0 = never)."),
          registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """Live feed of registry events: adapters created, versions published, aliases moved, deletions."""
    service = _service(registry=registry, data_dir=data_dir)
    try:
        address = service.registry_address
    except ValueError as exc:
        raise _fail(exc) from None

    async def follow() -> int:
        seen = 0
        async for event in service.watch_events(after_cursor=after, adapter=adapter, prefix=prefix,
                                                start_at_end=not (from_start or after)):
            console.print(_event_line(event), highlight=False)
            seen += 1
            if max_events and seen >= max_events:
                break
        return seen

    async def run() -> int:
        return await (asyncio.wait_for(follow(), timeout) if timeout else follow())

    err_console.print(f"[dim]watching registry {address} (Ctrl-C to stop)[/dim]")
    try:
        asyncio.run(run())
    except (TimeoutError, KeyboardInterrupt):
        pass
    except APIError as exc:
        raise _fail(exc) from None


# ---- sample -----------------------------------------------------------------------------------------------------


def _tokenizer(service: ServiceClient, sampler_address: str):
    """The trainer's tokenizer when a trainer is known, else the sampler's base model's tokenizer loaded here."""
    if resolve_address("trainer", service._trainer):
        try:
            return service.get_tokenizer()
        except APIError as exc:
            err_console.print(f"[dim]trainer tokenizer unavailable ({exc.code.name}); using the base model's[/dim]")
    from loraplane.client._runtime import runtime

    async def status():
        stub = sampler_pb2_grpc.SamplerServiceStub(runtime().channel(sampler_address))
        return await stub.GetStatus(sampler_pb2.GetStatusRequest(), timeout=10)

    return base_model_tokenizer(runtime().run(status()).base_model)


def base_model_tokenizer(base_model: str):
    """The tokenizer of a base model, loaded locally (no hub): tiny, tiny-moe, smollm2-135m-instruct or an HF
    directory."""
    from loraplane.models import base

    if base_model in (base.TINY_NAME, base.TINY_MOE_NAME):
        from loraplane.models.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    directory = base.ensure_smollm2_cache() if base_model == base.SMOLLM2_NAME else Path(base_model).expanduser()
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


@app.command()
def sample(prompt: str = typer.Argument(..., help="Prompt text."),
           adapter: str = typer.Option("", "--adapter", "-a", help="Adapter name (empty = the base model)."),
           version: int = typer.Option(0, "--version", "-v", help="Adapter version (0 = latest)."),
           alias: str = typer.Option("", "--alias", help="Adapter alias instead of a version."),
           max_tokens: int = typer.Option(64, help="Tokens to generate."),
           temperature: float = typer.Option(0.0, help="0 = greedy."),
           top_p: float = typer.Option(1.0),
           num_samples: int = typer.Option(1, "--num-samples", "-n"),
           seed: int = typer.Option(None, help="Sampling seed."),
           chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the chat template if any."),
           trainer: str = TrainerOption, sampler: str = SamplerOption, data_dir: Path = DataDirOption) -> None:
    """Generate text from the base model or an adapter version."""
    service = _service(trainer=trainer, sampler=sampler, data_dir=data_dir)
    try:
        client = service.create_sampling_client(adapter or None, version=version, alias=alias)
        tokenizer = _tokenizer(service, client.sampler_address)
        tokens = encode_prompt(tokenizer, prompt, chat)
        reply = client.sample(tokens, num_samples, SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
            stop=[t for t in [tokenizer.eos_token_id] if t is not None])).result()
    except (APIError, ValueError) as exc:
        raise _fail(exc) from None
    source = "base model" if not adapter else f"{adapter}@v{reply.served_version}"
    for index, sequence in enumerate(reply.sequences):
        text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        header = f"[dim]{source}" + (f" #{index + 1}" if num_samples > 1 else "") + f" ({sequence.stop_reason})[/dim]"
        console.print(header)
        console.print(text, highlight=False, markup=False)


# ---- demo and bench ---------------------------------------------------------------------------------------------


@app.command()
def demo(quick: bool = typer.Option(False, "--quick", help="A short run (tiny model, few steps) to check it works."),
         model: str = typer.Option(None, "--model", help="Base model (default smollm2-135m-instruct; tiny with "
                                                         "--quick)."),
         steps: int = typer.Option(None, help="Optimizer steps per tenant."),
         publish_every: int = typer.Option(None, help="Publish a version every N steps."),
         out: Path = DemoOutOption,
         live: bool = typer.Option(True, "--live/--no-live", help="Rich live display (off = plain log lines).")
         ) -> None:
    """Two tenants teach SmolLM2 two behaviours at once on one local cluster; watch both take effect."""
    from loraplane_cli.demo import DemoConfig, run_demo

    config = DemoConfig.quick() if quick else DemoConfig()
    if model:
        config.base_model = model
    if steps:
        config.steps = steps
    if publish_every:
        config.publish_every = publish_every
    config.out_dir = out
    config.live = live
    result = run_demo(config, console=console)
    console.print(f"loss plot: {result.plot_path}")


def _bench_dir() -> Path:
    here = Path.cwd() / "bench"
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "bench"


@app.command()
def bench(name: str = typer.Argument(None, help="Benchmark to run (a bench/<name>.py script); none = list them."),
          run_all: bool = typer.Option(False, "--all", help="Run every benchmark."),
          args: list[str] = BenchArgsOption) -> None:
    """List or run the benchmarks under bench/ (each prints a table and writes JSON to bench/results/)."""
    directory = _bench_dir()
    scripts = sorted(p for p in directory.glob("*.py") if not p.name.startswith("_")) if directory.is_dir() else []
    if not name and not run_all:
        if not scripts:
            console.print(f"no benchmarks found in {directory}")
            return
        table = Table(title=f"benchmarks in {directory}")
        table.add_column("name")
        table.add_column("what it measures")
        for script in scripts:
            table.add_row(script.stem, _first_doc_line(script))
        console.print(table)
        return
    chosen = scripts if run_all else [p for p in scripts if p.stem == name.removesuffix(".py")]
    if not chosen:
        err_console.print(f"[red]error[/red] no benchmark {name!r}; have: {', '.join(p.stem for p in scripts)}")
        raise typer.Exit(2)
    failed = 0
    for script in chosen:
        console.rule(script.stem)
        code = subprocess.call([sys.executable, str(script), *(args or [])], cwd=directory.parent)
        failed += code != 0
    if failed:
        raise typer.Exit(1)


def _first_doc_line(script: Path) -> str:
    import ast

    try:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    except SyntaxError:
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""
