"""Shared by the auth contract tests: a set of real API keys in the test's Valkey, and authenticated stubs."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import pytest

from loraplane.auth import KeyStore
from loraplane.config import Settings
from loraplane.rpc import BackgroundLoop, ClientSecurity, sync_channel

# Who calls, in the matrix every RPC is tried with.
CALLERS = ("none", "revoked", "other", "own", "admin")


@dataclass
class Keys:
    """admin, service, acme (tenant), globex (tenant) and a revoked acme key, issued in `settings`' key prefix."""

    settings: Settings
    loop: BackgroundLoop
    tokens: dict[str, str] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)
    _channels: list = field(default_factory=list)

    def store(self) -> KeyStore:
        return KeyStore(self.settings.redis_url, self.settings.key_prefix)

    def run(self, make):
        """Runs `make(KeyStore)` (a coroutine factory) on the background loop with a fresh store."""

        async def go():
            store = self.store()
            try:
                return await make(store)
            finally:
                await store.close()

        return self.loop.run(go(), timeout=30)

    def issue(self, label: str, tenant: str, role: str) -> str:
        record, token = self.run(lambda s: s.create_key(tenant, role, description=label))
        self.tokens[label], self.ids[label] = token, record.key_id
        return token

    def revoke(self, label: str) -> bool:
        return self.run(lambda s: s.revoke(self.ids[label]))

    def set_quotas(self, tenant: str, **values):
        return self.run(lambda s: s.set_quotas(tenant, **values))

    def security(self, label: str, **tls) -> ClientSecurity:
        return ClientSecurity(api_key=self.tokens.get(label, ""), **tls)

    def stub(self, stub_class, address: str, label: str, **tls):
        channel = sync_channel(address, self.security(label, **tls))
        self._channels.append(channel)
        return stub_class(channel)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def issue_standard_keys(settings: Settings, loop: BackgroundLoop) -> Keys:
    keys = Keys(settings, loop)
    keys.issue("admin", "ops", "admin")
    keys.issue("service", "system", "service")
    keys.issue("own", "acme", "tenant")
    keys.issue("other", "globex", "tenant")
    keys.issue("revoked", "acme", "tenant")
    assert keys.revoke("revoked")
    return keys


def auth_settings(settings: Settings, **extra) -> Settings:
    return settings.model_copy(update={"auth": True, **extra})


def expect_code(call, code: grpc.StatusCode) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__next__"):  # server streaming: the status comes with the first read
            list(result)
    assert info.value.code() == code, (info.value.code(), info.value.details())
    return info.value


def drain(stream) -> list:
    """Every message of a stream until it ends or its deadline passes."""
    out: list = []
    try:
        out.extend(stream)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    return out
