"""`loraplane keys create | ls | revoke` and `loraplane keys quota`: API keys and per-tenant quotas.

These talk to the cluster's Redis directly (LORAPLANE_REDIS_URL, else the Valkey that `loraplane up` started from
the data dir): whoever can write the cluster's Redis is its administrator anyway."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from loraplane import errors
from loraplane.auth import ROLE_TENANT, KeyStore, Quotas, tinker_api_key
from loraplane.config import Settings
from loraplane.local.state import read_cluster_state
from loraplane_cli.app import app

keys_app = typer.Typer(no_args_is_help=True, help="API keys and per-tenant quotas (docs/security.md).")
app.add_typer(keys_app, name="keys")
console = Console()

DataDirOption = typer.Option(None, "--data-dir", help="The data dir of `loraplane up` (LORAPLANE_DATA_DIR).")


def redis_url_of(settings: Settings) -> str:
    if settings.redis_url:
        return settings.redis_url
    state = read_cluster_state(Path(settings.data_dir).resolve())
    redis = state.component("redis") if state else None
    if redis is None:
        raise typer.BadParameter("no Redis: set LORAPLANE_REDIS_URL or start a cluster with `loraplane up`",
                                 param_hint="LORAPLANE_REDIS_URL")
    return redis.endpoint


def _run(data_dir: Path | None, work):
    settings = Settings()
    if data_dir is not None:
        settings.data_dir = data_dir

    async def go():
        store = KeyStore(redis_url_of(settings), settings.key_prefix)
        try:
            return await work(store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except errors.LoraplaneError as exc:
        console.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None


def _when(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ") if ms else "-"


@keys_app.command("create")
def create(tenant: str = typer.Option(..., "--tenant", help="The tenant the key belongs to (its namespace)."),
           role: str = typer.Option(ROLE_TENANT, "--role", help="tenant | admin | service"),
           description: str = typer.Option("", "--description", help="A note shown by `keys ls`."),
           data_dir: Path = DataDirOption) -> None:
    """Issue a key. It is printed once and stored only as a hash: keep it. The last two lines are ready to paste
    into a .env file (or after `export` in a shell): the Tinker SDK insists on a `tml-` prefix, loraplane accepts
    the key with or without it."""
    from gateway_svc.config import GatewaySettings

    reserved = GatewaySettings().default_tenant
    if role == ROLE_TENANT and tenant == reserved:
        # The gateway runs admin and service keys and its open mode in this tenant's namespace.
        console.print(f"[red]tenant {tenant!r} is the gateway's operator namespace (LORAPLANE_GATEWAY_DEFAULT_TENANT):"
                      " admin keys and the open mode keep their Tinker runs and adapters there; pick another name[/red]")
        raise typer.Exit(2)
    record, token = _run(data_dir, lambda store: store.create_key(tenant, role, description))
    console.print(f"key id: {record.key_id}  tenant: {record.tenant}  role: {record.role}")
    console.print("[bold]This key is shown once; only its hash is stored:[/bold]")
    # Plain print: no wrapping or markup may touch the key.
    print(token, flush=True)
    console.print("For the loraplane client and the OpenAI/Anthropic endpoints, and for the Tinker SDK:")
    print(f"LORAPLANE_API_KEY={token}", flush=True)
    print(f"TINKER_API_KEY={tinker_api_key(token)}", flush=True)


@keys_app.command("ls")
def ls(tenant: str = typer.Option("", "--tenant", help="Only this tenant's keys."),
       include_revoked: bool = typer.Option(False, "--all", help="Include revoked keys."),
       data_dir: Path = DataDirOption) -> None:
    """List keys (ids, tenants, roles; never the keys themselves)."""
    records = _run(data_dir, lambda store: store.list_keys(tenant, include_revoked))
    table = Table(title="API keys")
    for column in ("key id", "tenant", "role", "created", "revoked", "description"):
        table.add_column(column)
    for r in records:
        table.add_row(r.key_id, r.tenant, r.role, _when(r.created_ms), _when(r.revoked_ms), r.description)
    console.print(table)


@keys_app.command("revoke")
def revoke(key_id: str, data_dir: Path = DataDirOption) -> None:
    """Revoke a key; every service refuses it within a second."""
    if not _run(data_dir, lambda store: store.revoke(key_id)):
        console.print(f"[red]no active key {key_id!r}[/red]")
        raise typer.Exit(1)
    console.print(f"revoked {key_id}")


@keys_app.command("quota")
def quota(tenant: str = typer.Argument(None, help="Tenant to show or change; none = every tenant with quotas."),
          max_adapters: int = typer.Option(None, help="Adapters in the registry (0 = unlimited)."),
          max_stored_bytes: int = typer.Option(None, help="Bytes of all versions in the registry."),
          max_queued_requests: int = typer.Option(None, help="Training requests queued or running at once."),
          max_concurrent_samples: int = typer.Option(None, help="Sample requests running at once."),
          data_dir: Path = DataDirOption) -> None:
    """Show or set a tenant's quotas (admins; takes effect within a second)."""
    values = {name: value for name, value in {
        "max_adapters": max_adapters, "max_stored_bytes": max_stored_bytes,
        "max_queued_requests": max_queued_requests, "max_concurrent_samples": max_concurrent_samples}.items()
        if value is not None}
    if tenant is None:
        if values:
            raise typer.BadParameter("name the tenant whose quotas to set", param_hint="TENANT")
        found = _run(data_dir, lambda store: store.list_quotas())
    else:
        found = {tenant: _run(data_dir, lambda store: store.set_quotas(tenant, **values))}
    table = Table(title="quotas (0 = unlimited)")
    table.add_column("tenant")
    for name in Quotas.names():
        table.add_column(name)
    for name, quotas in found.items():
        table.add_row(name, *(str(getattr(quotas, field)) for field in Quotas.names()))
    console.print(table)


ADMIN_KEY_FILE = "admin.key"


def secure_cluster_env(data_dir: Path, redis_url: str, key_prefix: str, *, auth: bool, tls: bool,
                       mtls: bool = False) -> dict[str, str]:
    """What `loraplane up` adds to its services' environment. auth: LORAPLANE_AUTH=1, a fresh service key for
    trainer and sampler, and a fresh admin key in <data dir>/admin.key (0600; the previous one is revoked). tls: a
    local CA and certificates in <data dir>/tls. Without them, leftovers of an earlier secured run are removed so
    clients reading the data dir do not send keys or expect TLS."""
    import os
    import shutil

    from loraplane.client.addresses import TLS_DIR
    from loraplane.local.tls import make_local_pki

    env: dict[str, str] = {}
    key_file = data_dir / ADMIN_KEY_FILE
    if auth:
        async def issue():
            store = KeyStore(redis_url, key_prefix)
            try:
                if key_file.exists():
                    previous = key_file.read_text().strip().split("_")
                    if len(previous) >= 3:
                        await store.revoke(previous[1])
                _, admin = await store.create_key("ops", "admin", "loraplane up: admin")
                _, service = await store.create_key("system", "service", "loraplane up: trainer and sampler")
                return admin, service
            finally:
                await store.close()

        admin, service = asyncio.run(issue())
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(admin + "\n")
        os.chmod(key_file, 0o600)
        env.update({"LORAPLANE_AUTH": "1", "LORAPLANE_API_KEY": service})
    else:
        key_file.unlink(missing_ok=True)
        env["LORAPLANE_AUTH"] = "0"
    tls_dir = data_dir / TLS_DIR
    if tls:
        pki = make_local_pki(tls_dir)
        env.update({"LORAPLANE_TLS_CERT": str(pki.server_cert), "LORAPLANE_TLS_KEY": str(pki.server_key),
                    "LORAPLANE_TLS_CA": str(pki.ca)})
        if mtls:
            # Servers demand a certificate of this CA; trainer and sampler present the client one to the registry.
            env.update({"LORAPLANE_TLS_CLIENT_CA": str(pki.ca), "LORAPLANE_TLS_CLIENT_CERT": str(pki.client_cert),
                        "LORAPLANE_TLS_CLIENT_KEY": str(pki.client_key)})
    else:
        shutil.rmtree(tls_dir, ignore_errors=True)
    return env


@keys_app.command("audit")
def audit(limit: int = typer.Option(50, "--limit", help="How many of the newest records."),
          data_dir: Path = DataDirOption) -> None:
    """The audit stream: deletes, alias moves, key creation/revocation and denials, with the acting key id."""
    rows = _run(data_dir, lambda store: store.read_audit(limit))
    table = Table(title="audit (oldest first)")
    for column in ("time", "action", "target", "outcome", "key id", "tenant", "role", "acting for", "detail"):
        table.add_column(column)
    for row in rows:
        table.add_row(_when(int(row.get("time_ms", 0))), row.get("action", ""), row.get("target", ""),
                      row.get("outcome", ""), row.get("key_id", row.get("actor", "")), row.get("tenant", ""),
                      row.get("role", ""), row.get("acting_for", ""), row.get("detail", ""))
    console.print(table)
