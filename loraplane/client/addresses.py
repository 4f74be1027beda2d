"""Where the services are: an explicit address, else LORAPLANE_<SERVICE>_ADDRESS, else the state file that
`loraplane up` wrote under the data dir (LORAPLANE_DATA_DIR, default ./.loraplane)."""

from __future__ import annotations

import os
from pathlib import Path

SERVICES = ("trainer", "sampler", "registry")


def cluster_state_addresses(data_dir: str | Path | None = None) -> dict[str, str]:
    directory = Path(data_dir or os.environ.get("LORAPLANE_DATA_DIR") or ".loraplane")
    try:
        from loraplane.local.state import read_cluster_state
    except ImportError:
        return {}
    try:
        state = read_cluster_state(directory)
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if state is None:
        return {}
    if isinstance(state, dict):
        found = state.get("addresses", state)
        return {k: v for k, v in found.items() if k in SERVICES and isinstance(v, str)}
    return dict(state.addresses())


def resolve_address(service: str, explicit: str | None = None, data_dir: str | Path | None = None) -> str | None:
    if explicit:
        return explicit
    from_env = os.environ.get(f"LORAPLANE_{service.upper()}_ADDRESS")
    if from_env:
        return from_env
    return cluster_state_addresses(data_dir).get(service)


ADMIN_KEY_FILE = "admin.key"
TLS_DIR = "tls"


def client_security(data_dir: str | Path | None = None, api_key: str | None = None):
    """What a client sends and trusts: the API key (explicit, else LORAPLANE_API_KEY, else the admin key that
    `loraplane up` wrote to the data dir) and TLS (LORAPLANE_TLS_* settings, else the CA of `loraplane up --tls`
    in the data dir)."""
    from loraplane.config import Settings
    from loraplane.rpc import ClientSecurity

    settings = Settings()
    directory = Path(data_dir or os.environ.get("LORAPLANE_DATA_DIR") or ".loraplane")
    key = api_key or settings.api_key
    if not key:
        try:
            key = (directory / ADMIN_KEY_FILE).read_text().strip()
        except OSError:
            key = ""
    security = ClientSecurity.from_settings(settings)
    ca = directory / TLS_DIR / "ca.pem"
    if not security.tls and ca.is_file():
        # The client certificate of `loraplane up --tls` too: an mTLS cluster demands it, a TLS one ignores it.
        cert, cert_key = directory / TLS_DIR / "client.pem", directory / TLS_DIR / "client.key"
        both = cert.is_file() and cert_key.is_file()
        security = ClientSecurity(tls=True, ca=ca.read_bytes(), cert=cert.read_bytes() if both else None,
                                  key=cert_key.read_bytes() if both else None)
    from dataclasses import replace

    return replace(security, api_key=key)
