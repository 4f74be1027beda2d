"""`loraplane trainers ls | drain | undrain`: the members of a trainer fleet (`loraplane up --trainers N`, or any
trainers started with the same LORAPLANE_TRAINER_FLEET).

Like `loraplane keys`, these talk to the cluster's Redis directly (LORAPLANE_REDIS_URL, else the Valkey that
`loraplane up` started): the fleet's members and placements live there, and whoever can write that Redis is the
cluster's administrator anyway."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from loraplane import errors
from loraplane.config import Settings
from loraplane_cli.app import app
from loraplane_cli.keys import redis_url_of
from loraplane_cli.local_cluster import LOCAL_FLEET
from trainer_svc.fleet_store import FleetStore, MemberInfo

trainers_app = typer.Typer(no_args_is_help=True, help="A trainer fleet's members: list them, drain one.")
app.add_typer(trainers_app, name="trainers")
console = Console()

DataDirOption = typer.Option(None, "--data-dir", help="The data dir of `loraplane up` (LORAPLANE_DATA_DIR).")
FleetOption = typer.Option(None, "--fleet", help="The fleet's name (LORAPLANE_TRAINER_FLEET; default: the local "
                           f"cluster's, {LOCAL_FLEET!r}).")


def _store(data_dir: Path | None, fleet: str | None) -> FleetStore:
    settings = Settings()
    if data_dir is not None:
        settings.data_dir = data_dir
    return FleetStore(redis_url_of(settings), key_prefix=settings.key_prefix,
                      fleet=fleet or settings.trainer_fleet or LOCAL_FLEET)


def _mib(value: int) -> str:
    return f"{value / (1 << 20):,.1f}"


def _member(members: list[MemberInfo], which: str) -> MemberInfo:
    """A member by id, or by its number in a local cluster (0 = trainer, N = trainer-N)."""
    by_id = {m.trainer_id: m for m in members}
    if which in by_id:
        return by_id[which]
    if which.isdigit():
        local = "trainer" if which == "0" else f"trainer-{which}"
        if local in by_id:
            return by_id[local]
    known = ", ".join(sorted(by_id)) or "none"
    raise typer.BadParameter(f"no trainer {which!r} in this fleet (members: {known})", param_hint="TRAINER")


@trainers_app.command("ls")
def ls(data_dir: Path = DataDirOption, fleet: str = FleetOption) -> None:
    """Every member: live or not, draining, where it listens, adapters placed on it, device memory and queue."""
    store = _store(data_dir, fleet)
    try:
        members = store.members()
    except errors.LoraplaneError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None
    finally:
        store.close()
    table = Table(title=f"trainer fleet {store.fleet!r}")
    for column in ("trainer", "state", "address", "adapters", "adapter MiB", "device", "free MiB", "used MiB",
                   "queue", "heartbeat"):
        table.add_column(column)
    now = time.time()
    for m in members:
        state = "[green]live[/green]" if m.live else "[red]dead[/red]"
        if m.draining:
            state += " [yellow]draining[/yellow]"
        age = f"{now - m.heartbeat_at:.1f}s ago" if m.live else "expired"
        table.add_row(m.trainer_id, state, m.address or "-", str(m.placed), _mib(m.committed_bytes),
                      m.device if m.live else "-", _mib(m.device_free) if m.live else "-",
                      _mib(m.device_used) if m.live else "-", str(m.queue_depth) if m.live else "-", age)
    console.print(table)
    if not members:
        console.print("no trainer has joined this fleet (start some with `loraplane up --trainers N`)")


@trainers_app.command("drain")
def drain(trainer: str = typer.Argument(..., help="The member's id, or its number in a local cluster (0, 1, ...)."),
          wait: bool = typer.Option(True, help="Wait until every adapter has moved off it."),
          timeout: float = typer.Option(120.0, help="Seconds to wait."),
          data_dir: Path = DataDirOption, fleet: str = FleetOption) -> None:
    """Move every adapter of one trainer to the others (through checkpoints + journal: nothing acknowledged is
    lost, clients follow), and place nothing new on it. It keeps running: stop or upgrade it once drained."""
    store = _store(data_dir, fleet)
    try:
        member = _member(store.members(), trainer)
        if not member.live:
            console.print(f"[yellow]{member.trainer_id} is not live[/yellow]: its adapters move to the others "
                          "anyway once its heartbeat has expired")
        store.set_draining(member.trainer_id)
        console.print(f"draining {member.trainer_id} ({member.placed} adapters)")
        deadline = time.monotonic() + timeout
        while wait:
            left = next(m for m in store.members() if m.trainer_id == member.trainer_id).placed
            if left == 0:
                console.print(f"[green]{member.trainer_id} is drained[/green]; `loraplane trainers undrain "
                              f"{member.trainer_id}` lets it take adapters again")
                break
            if time.monotonic() > deadline:
                console.print(f"[red]{left} adapters still on {member.trainer_id} after {timeout:g}s[/red] (no "
                              "other live trainer has room?); it stays draining")
                raise typer.Exit(1)
            time.sleep(0.25)
    except errors.LoraplaneError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None
    finally:
        store.close()


@trainers_app.command("undrain")
def undrain(trainer: str = typer.Argument(..., help="The member's id, or its number in a local cluster."),
            data_dir: Path = DataDirOption, fleet: str = FleetOption) -> None:
    """Let a drained trainer take new adapters again (nothing moves back by itself: placement is sticky)."""
    store = _store(data_dir, fleet)
    try:
        member = _member(store.members(), trainer)
        store.set_draining(member.trainer_id, False)
        console.print(f"{member.trainer_id} takes new adapters again")
    finally:
        store.close()
