"""Asyncio client of the adapter registry, used by the trainer, the sampler and the SDK.

It hides the streaming protocol (publish header + chunks, download header + chunks) and turns every gRPC error into
a domain error (`loraplane.errors`), so callers catch `NotFound`, `Unavailable`, ... and never import grpc. What the
sampler's domain code reads (`get_version`, `download`, `watch`) comes back as dataclasses of this module, so that
code never handles a protobuf message either.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import http.client
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

import grpc

from loraplane import errors
from loraplane.rpc import ClientSecurity, aio_channel, domain_error_from_rpc
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
# A download of a version whose trainer acknowledged it before its upload ended waits this long for the bytes.
PENDING_WAIT_S = 300.0


class _OpenEnum(enum.IntEnum):
    """A protobuf enum's values. Protobuf enums are open: a value newer than this library (a newer registry) stays
    its number and equals none of the members, so code that does not know it passes it by instead of failing."""

    @classmethod
    def _missing_(cls, value: object) -> _OpenEnum | None:
        if not isinstance(value, int):
            return None
        newer = int.__new__(cls, value)
        newer._name_ = f"UNKNOWN_{value}"
        newer._value_ = value
        return newer


class VersionKind(_OpenEnum):
    UNSPECIFIED = common_pb2.VERSION_KIND_UNSPECIFIED
    WEIGHTS = common_pb2.VERSION_KIND_WEIGHTS
    TRAINING_STATE = common_pb2.VERSION_KIND_TRAINING_STATE


class EventType(_OpenEnum):
    UNSPECIFIED = registry_pb2.EVENT_TYPE_UNSPECIFIED
    ADAPTER_CREATED = registry_pb2.EVENT_TYPE_ADAPTER_CREATED
    VERSION_PUBLISHED = registry_pb2.EVENT_TYPE_VERSION_PUBLISHED
    ALIAS_SET = registry_pb2.EVENT_TYPE_ALIAS_SET
    VERSION_DELETED = registry_pb2.EVENT_TYPE_VERSION_DELETED
    ADAPTER_DELETED = registry_pb2.EVENT_TYPE_ADAPTER_DELETED


# The names the trainer's service knows VersionKind's members by. It passes publish's result (a protobuf
# AdapterVersion) through to its servicer untouched, naming its type from here rather than importing the stubs.
VERSION_KIND_UNSPECIFIED = VersionKind.UNSPECIFIED
VERSION_KIND_WEIGHTS = VersionKind.WEIGHTS
VERSION_KIND_TRAINING_STATE = VersionKind.TRAINING_STATE
AdapterVersion = common_pb2.AdapterVersion


@dataclass(frozen=True)
class StoredVersion:
    """One published version of an adapter, as `get_version` and `download` describe it."""

    adapter: str
    version: int
    kind: VersionKind
    # Lower-case hex sha256 of the blob.
    sha256: str
    size_bytes: int
    training_step: int
    metadata: dict[str, str]
    # The aliases that point at this version now.
    aliases: tuple[str, ...]
    # Unix seconds; None when the registry sent no time.
    create_time: float | None
    # Reserved by its trainer, the bytes not stored yet: a download waits for them.
    pending: bool = False


@dataclass(frozen=True)
class RegistryEvent:
    """One change in the registry, as `watch` yields it; `cursor` resumes the watch after it."""

    cursor: str
    type: EventType
    adapter: str
    # 0 for adapter events and for a removed alias.
    version: int
    kind: VersionKind
    sha256: str
    # Set for ALIAS_SET.
    alias: str
    # Unix seconds of the commit; None when the registry sent no time.
    time: float | None


def _unix_seconds(message, timestamp_field: str) -> float | None:
    if not message.HasField(timestamp_field):
        return None
    return getattr(message, timestamp_field).ToNanoseconds() / 1e9


def stored_version(proto: common_pb2.AdapterVersion) -> StoredVersion:
    """The StoredVersion of an AdapterVersion off the wire (also of one a trainer reply carries)."""
    return StoredVersion(adapter=proto.adapter, version=proto.version, kind=VersionKind(proto.kind),
                         sha256=proto.sha256, size_bytes=proto.size_bytes, training_step=proto.training_step,
                         metadata=dict(proto.metadata), aliases=tuple(proto.aliases),
                         create_time=_unix_seconds(proto, "create_time"), pending=proto.pending)


def _registry_event(proto: registry_pb2.Event) -> RegistryEvent:
    return RegistryEvent(cursor=proto.cursor, type=EventType(proto.type), adapter=proto.adapter,
                         version=proto.version, kind=VersionKind(proto.kind), sha256=proto.sha256, alias=proto.alias,
                         time=_unix_seconds(proto, "time"))


# LoraConfig.weights_dtype by the names domain code uses (loraplane.adapter_format.WEIGHTS_DTYPES); unspecified
# means float32.
_WEIGHTS_DTYPE_NAMES = {common_pb2.WEIGHTS_DTYPE_UNSPECIFIED: "float32", common_pb2.WEIGHTS_DTYPE_FLOAT32: "float32",
                        common_pb2.WEIGHTS_DTYPE_BFLOAT16: "bfloat16"}
_WEIGHTS_DTYPE_VALUES = {"": common_pb2.WEIGHTS_DTYPE_FLOAT32, "float32": common_pb2.WEIGHTS_DTYPE_FLOAT32,
                         "bfloat16": common_pb2.WEIGHTS_DTYPE_BFLOAT16}


def weights_dtype_name(value: int) -> str:
    """The name of a LoraConfig.weights_dtype value; an unknown value comes back as its number, for the domain's
    validation to reject by name."""
    return _WEIGHTS_DTYPE_NAMES.get(value, str(value))


def weights_dtype_value(name: str) -> int:
    """The LoraConfig.weights_dtype value of a name ("" = float32)."""
    try:
        return _WEIGHTS_DTYPE_VALUES[name]
    except KeyError:
        raise errors.InvalidArgument(
            f"lora_config.weights_dtype: {name[:40]!r} is not one of float32, bfloat16",
            field="lora_config.weights_dtype") from None


def lora_config(rank: int, alpha: float = 0.0, target_modules: Iterable[str] = (), seed: int = 0,
                weights_dtype: str = "float32", expert_layout: str = "") -> common_pb2.LoraConfig:
    """The `lora_config` argument of `RegistryClient.create_adapter`, from plain values."""
    return common_pb2.LoraConfig(rank=rank, alpha=alpha, target_modules=list(target_modules), seed=seed,
                                 weights_dtype=weights_dtype_value(weights_dtype),
                                 expert_layout=expert_layout_value(expert_layout))


# LoraConfig.expert_layout names (loraplane.lora.EXPERT_LAYOUTS) <-> values.
_EXPERT_LAYOUT_VALUES = {"": common_pb2.EXPERT_LORA_LAYOUT_UNSPECIFIED,
                         "per_expert": common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT,
                         "shared_outer": common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER}
_EXPERT_LAYOUT_NAMES = {common_pb2.EXPERT_LORA_LAYOUT_UNSPECIFIED: "",
                        common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT: "per_expert",
                        common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER: "shared_outer"}


def expert_layout_name(value: int) -> str:
    """The name of a LoraConfig.expert_layout value ("" = unspecified); an unknown value comes back as its number,
    for the domain's validation to reject by name."""
    return _EXPERT_LAYOUT_NAMES.get(value, str(value))


def expert_layout_value(name: str) -> int:
    try:
        return _EXPERT_LAYOUT_VALUES[name]
    except KeyError:
        raise errors.InvalidArgument(f"lora_config.expert_layout: {name[:40]!r} is not one of per_expert, "
                                     "shared_outer", field="lora_config.expert_layout") from None


def adapter_ref(name: str, version: int = 0, alias: str = "") -> common_pb2.AdapterRef:
    if version and alias:
        raise errors.InvalidArgument("ref: give either a version or an alias, not both", field="ref")
    ref = common_pb2.AdapterRef(name=name)
    if version:
        ref.version = version
    elif alias:
        ref.alias = alias
    return ref


class StreamedBlob:
    """A blob made piece by piece, each piece hashed as it is made: no whole copy of it and no pass over it for the
    digest alone.

    `pieces` yields the blob's `size` bytes in pieces of at most CHUNK_BYTES (one upload chunk each). Either `make()`
    it first (off the event loop) and `publish` sends it with the digest in the header, or `publish` it as it is:
    a thread of its own makes the pieces a few ahead of the upload and the digest goes in the stream's trailer (the
    registry then holds the whole blob until the trailer: see registry.proto). The pieces are kept, so a retry (a
    lost reply, a registry restart) sends the same bytes again without making them twice, the digest in the header
    since it is known by then."""

    def __init__(self, size: int, pieces: Iterator[bytes]):
        self.size = size
        # An abandoned upload may leave a piece being made on its worker thread while a retry reads the blob.
        self._lock = threading.Lock()
        self._pieces: Iterator[bytes] | None = pieces
        self._made: list[bytes] = []
        self._made_bytes = 0
        self._hasher = hashlib.sha256()
        # Lower-case hex; empty until every piece has been made.
        self.sha256 = ""

    def piece(self, index: int) -> bytes | None:
        """The index-th piece (made now if it was not yet: call off the event loop), None past the end."""
        with self._lock:
            while index >= len(self._made) and self._pieces is not None:
                piece = next(self._pieces, None)
                if piece is None:
                    self._finished()
                else:
                    self._hasher.update(piece)
                    self._made.append(piece)
                    self._made_bytes += len(piece)
            return self._made[index] if index < len(self._made) else None

    def made(self, index: int) -> bytes | None:
        """The index-th piece if it has been made, else None (makes nothing)."""
        made = self._made
        return made[index] if index < len(made) else None

    def make(self) -> str:
        """Makes every piece not made yet (call off the event loop); returns the sha256. Each piece is hashed on a
        second thread while the next one is made (hashlib lets go of the GIL): for the Llama-8B rank-32 blob
        (168 MB) about the hashing's time less than making and hashing in turn."""
        with self._lock:
            if self._pieces is not None:
                with ThreadPoolExecutor(1, thread_name_prefix="blob-sha256") as hashing:
                    hashed = None
                    for piece in self._pieces:
                        if hashed is not None:
                            hashed.result()  # in order, and at most one piece ahead of the digest
                        hashed = hashing.submit(self._hasher.update, piece)
                        self._made.append(piece)
                        self._made_bytes += len(piece)
                    if hashed is not None:
                        hashed.result()
                self._finished()
        return self.sha256

    def _finished(self) -> None:
        """Under the lock, every piece made and hashed: the blob's size checked, its digest set."""
        self._pieces = None
        if self._made_bytes != self.size:
            raise ValueError(f"the blob's pieces hold {self._made_bytes} bytes, not the announced {self.size}")
        self.sha256 = self._hasher.hexdigest()

    def getvalue(self) -> bytes:
        """The whole blob (made now if it was not yet)."""
        self.make()
        return b"".join(self._made)


async def _made_ahead(blob: StreamedBlob, lookahead: int = 8) -> AsyncIterator[bytes]:
    """The blob's pieces: those made already at once, the rest made by a thread of their own that runs up to
    `lookahead` pieces ahead of the upload. (A thread hop per piece, or a thread of the loop's shared pool, costs more
    than the making under load: the loop wakes only to take what is ready.)"""
    index = 0
    finished = bool(blob.sha256)  # read first: once it is set, every piece is there
    while (piece := blob.made(index)) is not None:
        yield piece
        index += 1
    if finished:
        return
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue = asyncio.Queue()
    room = threading.Semaphore(lookahead)
    stopped = threading.Event()

    def hand_over(item: object) -> bool:
        try:
            loop.call_soon_threadsafe(ready.put_nowait, item)
            return True
        except RuntimeError:  # the loop is gone
            return False

    def produce(index: int) -> None:
        try:
            while room.acquire() and not stopped.is_set():
                piece = blob.piece(index)
                if not hand_over(piece) or piece is None:
                    return
                index += 1
        except Exception as exc:  # noqa: BLE001 - raised by the reader
            hand_over(exc)

    threading.Thread(target=produce, args=(index,), name="publish-maker", daemon=True).start()
    try:
        while (item := await ready.get()) is not None:
            if isinstance(item, Exception):
                raise item
            room.release()
            yield item
    finally:
        # An upload that stops early leaves the maker to finish its piece and end.
        stopped.set()
        room.release()


# The pieces a direct download reads and hashes at a time, and how long any one socket operation of it may wait.
DIRECT_READ_BYTES = 4 * 1024 * 1024
DIRECT_TIMEOUT_S = 10.0


def _fetch_direct(url: str, size: int, timeout: float) -> tuple[bytes, str]:
    """The bytes at a presigned S3 URL and their sha256, reading at most one piece past `size` (a longer body is
    corrupt anyway, and must not fill memory)."""
    hasher = hashlib.sha256()
    parts: list[bytes] = []
    received = 0
    # A second thread hashes each piece while the next one is read.
    with ThreadPoolExecutor(1, thread_name_prefix="direct-sha256") as hashing, \
            urllib.request.urlopen(url, timeout=timeout) as reply:
        while received <= size and (piece := reply.read(DIRECT_READ_BYTES)):
            hashing.submit(hasher.update, piece)
            parts.append(piece)
            received += len(piece)
    return b"".join(parts), hasher.hexdigest()


async def _sliced(view: memoryview) -> AsyncIterator[bytes]:
    for start in range(0, len(view), CHUNK_BYTES):
        yield bytes(view[start:start + CHUNK_BYTES])


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
        # Ask for blobs' S3 addresses until one proves unreachable from here.
        self._direct = True
        # How long a download waits for a version whose trainer is still uploading its bytes.
        self.pending_wait_s = PENDING_WAIT_S

    @property
    def stub(self) -> registry_pb2_grpc.AdapterRegistryServiceStub:
        if self._stub is None:
            self._channel = aio_channel(self.address, self.security)
            self._stub = registry_pb2_grpc.AdapterRegistryServiceStub(self._channel)
        return self._stub

    def _error(self, exc: grpc.RpcError, what: str) -> errors.LoraplaneError:
        # Named by role, not address: trainer and sampler pass this message on to tenants, who must not learn
        # the cluster's internal addresses (the SDK adds the address it called itself).
        return domain_error_from_rpc(exc, f"registry: {what}")

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
        blob: bytes | StreamedBlob,
        *,
        kind: int = common_pb2.VERSION_KIND_WEIGHTS,
        training_step: int = 0,
        metadata: Mapping[str, str] | None = None,
        aliases: Iterable[str] = (),
        idempotency_key: str = "",
        reserved_version: int = 0,
    ) -> common_pb2.AdapterVersion:
        """Publishes `blob` as a new version. Bytes are hashed first and the digest sent in the header; so is a
        StreamedBlob already made; one not made yet is sent while it is made, its digest in the trailer. With
        `reserved_version` (a service only), `blob` is the bytes of that version `reserve` made."""
        if isinstance(blob, StreamedBlob):
            size, digest = blob.size, blob.sha256
            chunks = _made_ahead(blob)
        else:
            view = memoryview(blob)
            size = len(view)
            # Hashing 100 MB takes a while; keep the event loop free for other RPCs.
            digest = (await asyncio.to_thread(hashlib.sha256, view) if size > 4 * CHUNK_BYTES
                      else hashlib.sha256(view)).hexdigest()
            chunks = _sliced(view)
        header = registry_pb2.PublishVersionHeader(
            adapter=adapter, sha256=digest, size_bytes=size, idempotency_key=idempotency_key,
            training_step=training_step, metadata=dict(metadata or {}), aliases=list(aliases), kind=kind,
            reserved_version=reserved_version)

        failed: list[Exception] = []

        async def requests():
            yield registry_pb2.PublishVersionRequest(header=header)
            try:
                async for chunk in chunks:
                    yield registry_pb2.PublishVersionRequest(chunk=chunk)
            except Exception as exc:  # noqa: BLE001 - raised below, once the call has ended
                # Raised inside the request stream, grpc would turn it into a CancelledError. Ending the stream
                # short instead is safe: the registry commits nothing without all the bytes and the trailer.
                failed.append(exc)
                return
            if not digest:
                yield registry_pb2.PublishVersionRequest(
                    trailer=registry_pb2.PublishVersionTrailer(sha256=blob.sha256))

        try:
            reply = await self.stub.PublishVersion(requests(), timeout=self.timeout + size / 20e6)
        except grpc.RpcError as exc:
            if failed:
                raise failed[0]
            raise self._error(exc, f"publish to {adapter!r}") from None
        return reply.version

    async def reserve(self, adapter: str, sha256: str, size_bytes: int, *, idempotency_key: str,
                      training_step: int = 0, metadata: Mapping[str, str] | None = None,
                      aliases: Iterable[str] = ()) -> common_pb2.AdapterVersion:
        """Commits a WEIGHTS version of the blob `sha256` before its bytes (a service only): `pending` until
        `publish(..., reserved_version=)` has stored them; a retry with the same key returns the same version."""
        header = registry_pb2.PublishVersionHeader(
            adapter=adapter, sha256=sha256, size_bytes=size_bytes, idempotency_key=idempotency_key,
            training_step=training_step, metadata=dict(metadata or {}), aliases=list(aliases),
            kind=common_pb2.VERSION_KIND_WEIGHTS, upload_later=True)

        async def requests():
            yield registry_pb2.PublishVersionRequest(header=header)

        try:
            reply = await self.stub.PublishVersion(requests(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, f"reserve a version of {adapter!r}") from None
        return reply.version

    async def get_version(self, name: str, version: int = 0, alias: str = "") -> StoredVersion:
        try:
            reply = await self.stub.GetVersion(registry_pb2.GetVersionRequest(ref=adapter_ref(name, version, alias)),
                                               timeout=self.timeout)
            return stored_version(reply.version)
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

    async def download(self, name: str, version: int = 0, alias: str = "") -> tuple[StoredVersion, bytes]:
        """The whole blob, verified against the header's size and sha256 (mismatch -> DataLoss). Straight from S3
        when the registry hands out the blob's address and this client reaches it (the bytes then skip the
        registry and gRPC, several times faster for large adapters), through the registry otherwise."""
        request = registry_pb2.DownloadVersionRequest(ref=adapter_ref(name, version, alias), direct=self._direct)
        described, direct_url, blob, digest = await self._download_waiting(request, name)
        if direct_url:
            try:
                # A short socket timeout: an S3 host that drops this client's packets should cost one wait of
                # seconds, not of the RPC timeout, before the stream takes over.
                blob, digest = await asyncio.to_thread(_fetch_direct, direct_url, described.size_bytes,
                                                       min(self.timeout or DIRECT_TIMEOUT_S, DIRECT_TIMEOUT_S))
            except (OSError, http.client.HTTPException) as exc:
                if not isinstance(exc, urllib.error.HTTPError):
                    # S3 is not reachable from here (another network): stop asking for its address.
                    self._direct = False
                log.warning("registry %s: the S3 address of %r v%d failed (%s); streaming it through the "
                            "registry%s", self.address, name, described.version, exc,
                            "" if self._direct else " from now on")
                request = registry_pb2.DownloadVersionRequest(ref=adapter_ref(name, described.version))
                described, _, blob, digest = await self._download_stream(request, name)
        if len(blob) != described.size_bytes or digest != described.sha256:
            raise errors.DataLoss(
                f"registry: download of {name!r} v{described.version} is corrupt: got {len(blob)} "
                f"bytes sha256 {digest}, expected {described.size_bytes} bytes sha256 {described.sha256}")
        return described, blob

    async def _download_waiting(self, request: registry_pb2.DownloadVersionRequest, name: str
                                ) -> tuple[StoredVersion, str, bytes, str]:
        """`_download_stream`, waiting (up to `pending_wait_s`) while the version's trainer is still uploading it:
        every reader (a sampler, a trainer's load, the gateway) gets a just-acknowledged version's bytes this way."""
        deadline = time.monotonic() + self.pending_wait_s
        pause = 0.05
        while True:
            try:
                return await self._download_stream(request, name)
            except errors.Unavailable as exc:
                if exc.reason != errors.VERSION_PENDING or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 0.5)

    async def _download_stream(self, request: registry_pb2.DownloadVersionRequest, name: str
                               ) -> tuple[StoredVersion, str, bytes, str]:
        """(version, direct URL or "", the streamed bytes, their sha256) of one DownloadVersion call."""
        described: StoredVersion | None = None
        direct_url = ""
        parts: list[bytes] = []
        digest = hashlib.sha256()
        # One thread hashes the chunks in order while the next ones arrive (hashlib lets go of the GIL): hashing on
        # the event loop added its whole time (~0.1 s per 168 MB) to every download.
        hashing = ThreadPoolExecutor(1, thread_name_prefix="download-sha256")
        hashed: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        try:
            async for reply in self.stub.DownloadVersion(request, timeout=None if self.timeout is None
                                                         else self.timeout * 10):
                if reply.HasField("header"):
                    described = stored_version(reply.header.version)
                    direct_url = reply.header.direct_url
                else:
                    hashed = loop.run_in_executor(hashing, digest.update, reply.chunk)
                    parts.append(reply.chunk)
            if hashed is not None:
                await hashed  # the last update, queued after all others on the one thread
        except grpc.RpcError as exc:
            raise self._error(exc, f"download {name!r}") from None
        finally:
            hashing.shutdown(wait=False, cancel_futures=True)
        if described is None:
            raise errors.DataLoss(f"registry: download of {name!r} sent no header")
        return described, direct_url, b"".join(parts), digest.hexdigest()

    async def collect_garbage(self, *, dry_run: bool = False) -> registry_pb2.CollectGarbageResponse:
        try:
            return await self.stub.CollectGarbage(registry_pb2.CollectGarbageRequest(dry_run=dry_run),
                                                  timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc, "collect garbage") from None

    async def watch(
        self, *, after_cursor: str = "", adapter: str = "", prefix: str = "", start_at_end: bool = False
    ) -> AsyncIterator[RegistryEvent]:
        """Events after `after_cursor`, then new ones as they happen; runs until the caller stops iterating.
        Resume after an error with the cursor of the last event handled."""
        request = registry_pb2.WatchEventsRequest(after_cursor=after_cursor, adapter=adapter, prefix=prefix,
                                                  start_at_end=start_at_end)
        call = self.stub.WatchEvents(request)
        try:
            async for reply in call:
                yield _registry_event(reply.event)
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
