"""Asyncio client of the adapter registry, used by the trainer, the sampler and the SDK.

It hides the streaming protocol (publish header + chunks, download header + chunks) and turns every gRPC error into
a domain error (`loraplane.errors`), so callers catch `NotFound`, `Unavailable`, ... and never import grpc.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Self

import grpc

from loraplane import errors
from loraplane.rpc import ClientSecurity, aio_channel, domain_error_from_rpc
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc

CHUNK_BYTES = 1024 * 1024

# Plain values and the result type of this client, for domain code that keeps the protobuf stubs out of its own
# imports (the trainer's service: it passes this client's results through, it never builds wire messages).
VERSION_KIND_UNSPECIFIED: int = common_pb2.VERSION_KIND_UNSPECIFIED
VERSION_KIND_WEIGHTS: int = common_pb2.VERSION_KIND_WEIGHTS
VERSION_KIND_TRAINING_STATE: int = common_pb2.VERSION_KIND_TRAINING_STATE
AdapterVersion = common_pb2.AdapterVersion


def lora_config(rank: int, alpha: float = 0.0, target_modules: Iterable[str] = (), seed: int = 0
                ) -> common_pb2.LoraConfig:
    """The `lora_config` argument of `RegistryClient.create_adapter`, from plain values."""
    return common_pb2.LoraConfig(rank=rank, alpha=alpha, target_modules=list(target_modules), seed=seed)


def adapter_ref(name: str, version: int = 0, alias: str = "") -> common_pb2.AdapterRef:
    if version and alias:
        raise errors.InvalidArgument("ref: give either a version or an alias, not both", field="ref")
    ref = common_pb2.AdapterRef(name=name)
    if version:
        ref.version = version
    elif alias:
        ref.alias = alias
    return ref


class RegistryClient:
    """One lazily created grpc.aio channel per client. Create the client anywhere; the channel is opened inside
    the running loop on first use (a grpc.aio channel is bound to the loop that creates it)."""

    def __init__(self, address: str, *, timeout: float = 30.0, security: ClientSecurity | None = None):
        """`security`: API key and TLS (default: from LORAPLANE_* settings)."""
        self.address = address
        self.timeout = timeout
        self.security = security
        self._channel: grpc.aio.Channel | None = None
        self._stub: registry_pb2_grpc.AdapterRegistryServiceStub | None = None

    @property
    def stub(self) -> registry_pb2_grpc.AdapterRegistryServiceStub:
        if self._stub is None:
            self._channel = aio_channel(self.address, self.security)
            self._stub = registry_pb2_grpc.AdapterRegistryServiceStub(self._channel)
        return self._stub

    def _error(self, exc: grpc.RpcError, what: str) -> errors.LoraplaneError:
        return domain_error_from_rpc(exc, f"registry {self.address}: {what}")

    async def create_adapter(
        self,
        name: str,
        *,
        lora_config: common_pb2.LoraConfig | None = None,
        base_model: str = "",
        keep_last: int = 0,
        metadata: Mapping[str, str] | None = None,
        exist_ok: bool = False,
    ) -> registry_pb2.Adapter:
        adapter = registry_pb2.Adapter(name=name, base_model=base_model, keep_last=keep_last,
                                       metadata=dict(metadata or {}))
        if lora_config is not None:
            adapter.lora_config.CopyFrom(lora_config)
        try:
            reply = await self.stub.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=adapter),
                                                  timeout=self.timeout)
            return reply.adapter
        except grpc.RpcError as exc:
            if exist_ok and exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return await self.get_adapter(name)
            raise self._error(exc, f"create adapter {name!r}") from None

    async def get_adapter(self, name: str) -> registry_pb2.Adapter:
        try:
            reply = await self.stub.GetAdapter(registry_pb2.GetAdapterRequest(name=name), timeout=self.timeout)
            return reply.adapter
        except grpc.RpcError as exc:
            raise self._error(exc, f"get adapter {name!r}") from None

    async def list_adapters(self, prefix: str = "") -> list[registry_pb2.Adapter]:
        found: list[registry_pb2.Adapter] = []
        token = ""
        try:
            while True:
                reply = await self.stub.ListAdapters(
                    registry_pb2.ListAdaptersRequest(prefix=prefix, page_size=1000, page_token=token),
                    timeout=self.timeout)
                found.extend(reply.adapters)
                token = reply.next_page_token
                if not token:
                    return found
        except grpc.RpcError as exc:
            raise self._error(exc, "list adapters") from None

    async def delete_adapter(self, name: str) -> None:
        try:
            await self.stub.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, f"delete adapter {name!r}") from None

    async def publish(
        self,
        adapter: str,
        blob: bytes,
        *,
        kind: int = common_pb2.VERSION_KIND_WEIGHTS,
        training_step: int = 0,
        metadata: Mapping[str, str] | None = None,
        aliases: Iterable[str] = (),
        idempotency_key: str = "",
    ) -> common_pb2.AdapterVersion:
        view = memoryview(blob)
        # Hashing 100 MB takes a while; keep the event loop free for other RPCs.
        digest = (await asyncio.to_thread(hashlib.sha256, view) if len(view) > 4 * CHUNK_BYTES
                  else hashlib.sha256(view)).hexdigest()
        header = registry_pb2.PublishVersionHeader(
            adapter=adapter, sha256=digest, size_bytes=len(view), idempotency_key=idempotency_key,
            training_step=training_step, metadata=dict(metadata or {}), aliases=list(aliases), kind=kind)

        def requests():
            yield registry_pb2.PublishVersionRequest(header=header)
            for start in range(0, len(view), CHUNK_BYTES):
                yield registry_pb2.PublishVersionRequest(chunk=bytes(view[start:start + CHUNK_BYTES]))

        try:
            reply = await self.stub.PublishVersion(requests(), timeout=self.timeout + len(view) / 20e6)
            return reply.version
        except grpc.RpcError as exc:
            raise self._error(exc, f"publish to {adapter!r}") from None

    async def get_version(self, name: str, version: int = 0, alias: str = "") -> common_pb2.AdapterVersion:
        try:
            reply = await self.stub.GetVersion(registry_pb2.GetVersionRequest(ref=adapter_ref(name, version, alias)),
                                               timeout=self.timeout)
            return reply.version
        except grpc.RpcError as exc:
            raise self._error(exc, f"get version of {name!r}") from None

    async def list_versions(self, adapter: str, *, kind: int = common_pb2.VERSION_KIND_UNSPECIFIED
                            ) -> list[common_pb2.AdapterVersion]:
        found: list[common_pb2.AdapterVersion] = []
        token = ""
        try:
            while True:
                reply = await self.stub.ListVersions(
                    registry_pb2.ListVersionsRequest(adapter=adapter, page_size=1000, page_token=token, kind=kind),
                    timeout=self.timeout)
                found.extend(reply.versions)
                token = reply.next_page_token
                if not token:
                    return found
        except grpc.RpcError as exc:
            raise self._error(exc, f"list versions of {adapter!r}") from None

    async def delete_version(self, adapter: str, version: int) -> None:
        try:
            await self.stub.DeleteVersion(registry_pb2.DeleteVersionRequest(adapter=adapter, version=version),
                                          timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, f"delete version {version} of {adapter!r}") from None

    async def set_alias(self, adapter: str, alias: str, version: int) -> registry_pb2.Adapter:
        try:
            reply = await self.stub.SetAlias(
                registry_pb2.SetAliasRequest(adapter=adapter, alias=alias, version=version), timeout=self.timeout)
            return reply.adapter
        except grpc.RpcError as exc:
            raise self._error(exc, f"set alias {alias!r} of {adapter!r}") from None

    async def download(self, name: str, version: int = 0, alias: str = "") -> tuple[common_pb2.AdapterVersion, bytes]:
        """The whole blob, verified against the header's size and sha256 (mismatch -> DataLoss)."""
        request = registry_pb2.DownloadVersionRequest(ref=adapter_ref(name, version, alias))
        described: common_pb2.AdapterVersion | None = None
        parts: list[bytes] = []
        digest = hashlib.sha256()
        try:
            async for reply in self.stub.DownloadVersion(request, timeout=None if self.timeout is None
                                                         else self.timeout * 10):
                if reply.HasField("header"):
                    described = reply.header.version
                else:
                    digest.update(reply.chunk)
                    parts.append(reply.chunk)
        except grpc.RpcError as exc:
            raise self._error(exc, f"download {name!r}") from None
        if described is None:
            raise errors.DataLoss(f"registry {self.address}: download of {name!r} sent no header")
        blob = b"".join(parts)
        if len(blob) != described.size_bytes or digest.hexdigest() != described.sha256:
            raise errors.DataLoss(
                f"registry {self.address}: download of {name!r} v{described.version} is corrupt: got {len(blob)} "
                f"bytes sha256 {digest.hexdigest()}, expected {described.size_bytes} bytes sha256 {described.sha256}")
        return described, blob

    async def collect_garbage(self, *, dry_run: bool = False) -> registry_pb2.CollectGarbageResponse:
        try:
            return await self.stub.CollectGarbage(registry_pb2.CollectGarbageRequest(dry_run=dry_run),
                                                  timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, "collect garbage") from None

    async def watch(
        self, *, after_cursor: str = "", adapter: str = "", prefix: str = "", start_at_end: bool = False
    ) -> AsyncIterator[registry_pb2.Event]:
        """Events after `after_cursor`, then new ones as they happen; runs until the caller stops iterating.
        Resume after an error with the cursor of the last event handled."""
        request = registry_pb2.WatchEventsRequest(after_cursor=after_cursor, adapter=adapter, prefix=prefix,
                                                  start_at_end=start_at_end)
        call = self.stub.WatchEvents(request)
        try:
            async for reply in call:
                yield reply.event
        except grpc.RpcError as exc:
            raise self._error(exc, "watch events") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
