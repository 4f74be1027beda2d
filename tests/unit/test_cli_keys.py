"""`loraplane keys create` prints ready-to-paste LORAPLANE_API_KEY= and TINKER_API_KEY= lines, and both forms of the
key authenticate as its tenant against the real key store (Valkey); the Tinker SDK accepts the TINKER_API_KEY form."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest
from typer.testing import CliRunner

from loraplane import errors
from loraplane.auth import Authenticator, KeyStore
from loraplane_cli import app


def authenticate(url: str, prefix: str, key: str):
    async def go():
        store = KeyStore(url, prefix)
        try:
            return await Authenticator(store).authenticate(key)
        finally:
            await store.close()

    return asyncio.run(go())


def test_keys_create_prints_both_env_lines_and_both_forms_authenticate(valkey, monkeypatch):
    from tinker.lib._auth_token_provider import ApiKeyAuthProvider

    prefix = f"lptest:{uuid.uuid4().hex[:10]}:"
    monkeypatch.setenv("LORAPLANE_REDIS_URL", valkey.url)
    monkeypatch.setenv("LORAPLANE_KEY_PREFIX", prefix)
    result = CliRunner().invoke(app, ["keys", "create", "--tenant", "acme"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    loraplane_key = next(line for line in lines if line.startswith("LORAPLANE_API_KEY=")).split("=", 1)[1]
    tinker_key = next(line for line in lines if line.startswith("TINKER_API_KEY=")).split("=", 1)[1]
    assert re.fullmatch(r"lpk_[0-9a-f]{16}_[A-Za-z0-9_-]+", loraplane_key)
    assert tinker_key == "tml-" + loraplane_key
    assert loraplane_key in lines  # the bare key stays on a line of its own

    # The Tinker SDK refuses the bare key and takes the printed TINKER_API_KEY.
    with pytest.raises(Exception, match="tml-"):
        ApiKeyAuthProvider(loraplane_key)
    assert ApiKeyAuthProvider(tinker_key).api_key == tinker_key

    for form in (loraplane_key, tinker_key, f"Bearer {tinker_key}"):
        identity = authenticate(valkey.url, prefix, form)
        assert identity.tenant == "acme" and identity.role == "tenant", form
    # The prefix is no wildcard: a changed secret, or the key under another prefix, is refused.
    for bad in ("tml-" + loraplane_key[:-1] + ("A" if loraplane_key[-1] != "A" else "B"), "xyz-" + loraplane_key,
                "tml-tml-" + loraplane_key):
        with pytest.raises(errors.Unauthenticated):
            authenticate(valkey.url, prefix, bad)


def test_keys_create_refuses_the_gateways_operator_namespace(valkey, monkeypatch):
    """The gateway's default tenant holds the Tinker runs and adapters of admin keys and the open mode: a tenant
    key of that name would act inside them, so the CLI refuses it (whatever the name is configured to be)."""
    prefix = f"lptest:{uuid.uuid4().hex[:10]}:"
    monkeypatch.setenv("LORAPLANE_REDIS_URL", valkey.url)
    monkeypatch.setenv("LORAPLANE_KEY_PREFIX", prefix)

    def keys_of(tenant: str) -> list:
        async def go():
            store = KeyStore(valkey.url, prefix)
            try:
                return await store.list_keys(tenant)
            finally:
                await store.close()

        return asyncio.run(go())

    refused = CliRunner().invoke(app, ["keys", "create", "--tenant", "tinker"])
    assert refused.exit_code == 2 and "operator namespace" in refused.output, refused.output
    assert keys_of("tinker") == []
    monkeypatch.setenv("LORAPLANE_GATEWAY_DEFAULT_TENANT", "ops")
    assert CliRunner().invoke(app, ["keys", "create", "--tenant", "ops"]).exit_code == 2
    issued = CliRunner().invoke(app, ["keys", "create", "--tenant", "tinker"])
    assert issued.exit_code == 0, issued.output
    assert [k.tenant for k in keys_of("tinker")] == ["tinker"]
