"""The registry's domain: adapters, versions, aliases, retention, blob GC and the event stream.

Metadata and events live in Redis (atomic Lua scripts, see `lua.py`); blob bytes live in S3 (`blobs.py`).
Nothing here knows about gRPC: inputs are plain values, outputs are the dataclasses below, failures are
`loraplane.errors` exceptions.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field

import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from loraplane import errors, fields
from loraplane.auth import OPEN, Identity, append_audit, audit_entry, quota_exceeded
from loraplane.config import Settings
from loraplane.errors import shown
from loraplane.fields import validate_alias, validate_name
from loraplane.lora import PER_EXPERT, SHARED_OUTER
from loraplane.models.families import ALL_TARGETS
from loraplane.redis_pool import async_redis
from registry_svc import lua
from registry_svc.blob_check import BlobCheck
from registry_svc.blobs import BlobStore

log = logging.getLogger(__name__)

SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")
BASE_MODEL_RE = re.compile(r"^[A-Za-z0-9._/][A-Za-z0-9._/:@+-]*\Z")
CURSOR_RE = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}\Z")
# How long a presigned download URL stays valid: long enough to start the GET, short enough that a leaked one
# soon opens nothing.
DIRECT_URL_SECONDS = 60
# Every LoRA target a model family offers (dense projections and the routed experts' fused projections).
PROJECTIONS = ALL_TARGETS

KIND_WEIGHTS = 1
KIND_TRAINING_STATE = 2
KINDS = (KIND_WEIGHTS, KIND_TRAINING_STATE)

# LoraConfig.weights_dtype: unspecified (= float32), float32, bfloat16.
WEIGHTS_DTYPES = (0, 1, 2)

EVENT_ADAPTER_CREATED = 1
EVENT_VERSION_PUBLISHED = 2
EVENT_ALIAS_SET = 3
EVENT_VERSION_DELETED = 4
EVENT_ADAPTER_DELETED = 5

# Chunks larger than this are checked on a worker thread, so a big upload does not stall the event loop.
CHECK_OFF_LOOP_BYTES = 256 * 1024

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True)
class RegistryLimits:
    """Bounds on what a caller may store. Defaults can be overridden with LORAPLANE_REGISTRY_* variables."""

    max_blob_bytes: int = 4 * 1024**3
    # A chunk is at most 1 MiB; the slack admits senders that frame 1 MiB of payload plus a little.
    max_chunk_bytes: int = 1024 * 1024 + 64 * 1024
    max_download_chunk_bytes: int = 4 * 1024 * 1024
    max_metadata_entries: int = 64
    max_metadata_key_chars: int = 128
    max_metadata_value_chars: int = 4096
    max_aliases_per_publish: int = 16
    max_idempotency_key_chars: int = 256
    max_base_model_chars: int = 512
    max_lora_rank: int = 65536
    max_prefix_chars: int = 128
    # Events kept in the stream (approximate: XADD MAXLEN ~).
    max_events: int = 1_000_000
    # CollectGarbage aborts multipart uploads older than this (left behind by a registry that crashed mid-publish).
    stale_upload_seconds: int = 24 * 3600
    # Bytes of publishes whose sha256 comes in the trailer held in memory at once (see `publish`); one such blob
    # may be at most this large.
    max_buffered_publish_bytes: int = 2 * 1024**3

    @classmethod
    def from_env(cls) -> RegistryLimits:
        overrides = {}
        for name in cls.__dataclass_fields__:
            raw = os.environ.get(f"LORAPLANE_REGISTRY_{name.upper()}")
            if raw:
                overrides[name] = int(raw)
        return cls(**overrides)


@dataclass
class LoraSpec:
    rank: int = 0
    alpha: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    seed: int = 0
    # One of WEIGHTS_DTYPES: how trainers write the adapter's weights versions (the registry accepts any float blob).
    weights_dtype: int = 0
    # LoraConfig.expert_layout value, kept as the trainer gave it.
    expert_layout: int = 0


@dataclass
class AdapterRecord:
    name: str
    lora: LoraSpec
    base_model: str
    keep_last: int
    metadata: dict[str, str]
    aliases: dict[str, int]
    latest_version: int
    create_time_ms: int


@dataclass
class VersionRecord:
    adapter: str
    version: int
    kind: int
    sha256: str
    size_bytes: int
    training_step: int
    metadata: dict[str, str]
    aliases: list[str]
    create_time_ms: int


@dataclass
class EventRecord:
    cursor: str
    type: int
    adapter: str
    version: int
    sha256: str
    alias: str
    kind: int
    time_ms: int


@dataclass
class PublishHeader:
    adapter: str
    sha256: str
    size_bytes: int
    idempotency_key: str = ""
    training_step: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)
    kind: int = KIND_WEIGHTS


@dataclass
class PublishTrailer:
    """The last item of a publish stream whose header has no sha256."""

    sha256: str


@dataclass
class PublishResult:
    version: VersionRecord
    deduplicated: bool


@dataclass
class GarbageReport:
    deleted_blobs: list[str]
    freed_bytes: int


# ---------------------------------------------------------------------------------------------------- validation

def validate_metadata(metadata: Mapping[str, str], limits: RegistryLimits, field_name: str) -> dict[str, str]:
    return fields.validate_metadata(metadata, field_name, max_entries=limits.max_metadata_entries,
                                    max_key_chars=limits.max_metadata_key_chars,
                                    max_value_chars=limits.max_metadata_value_chars)


def validate_lora(spec: LoraSpec, limits: RegistryLimits, field_name: str = "adapter.lora_config") -> LoraSpec:
    if spec.rank < 1:
        raise errors.InvalidArgument(f"{field_name}.rank: {spec.rank} must be >= 1", field=f"{field_name}.rank")
    if spec.rank > limits.max_lora_rank:
        raise errors.InvalidArgument(f"{field_name}.rank: {spec.rank} exceeds the limit {limits.max_lora_rank}",
                                     field=f"{field_name}.rank")
    if not math.isfinite(spec.alpha) or spec.alpha < 0:
        raise errors.InvalidArgument(f"{field_name}.alpha: {spec.alpha} must be a finite number >= 0",
                                     field=f"{field_name}.alpha")
    unknown = [module for module in spec.target_modules if module not in PROJECTIONS]
    if unknown:
        raise errors.InvalidArgument(
            f"{field_name}.target_modules: {unknown} are not among {', '.join(PROJECTIONS)}",
            field=f"{field_name}.target_modules")
    if len(set(spec.target_modules)) != len(spec.target_modules):
        raise errors.InvalidArgument(f"{field_name}.target_modules: names repeat", field=f"{field_name}.target_modules")
    if spec.weights_dtype not in WEIGHTS_DTYPES:
        raise errors.InvalidArgument(
            f"{field_name}.weights_dtype: {spec.weights_dtype} is not a WeightsDtype (unspecified, float32, bfloat16)",
            field=f"{field_name}.weights_dtype")
    if spec.expert_layout not in (0, 1, 2):
        raise errors.InvalidArgument(
            f"{field_name}.expert_layout: {spec.expert_layout} is not an ExpertLoraLayout (unspecified, per_expert, "
            "shared_outer)", field=f"{field_name}.expert_layout")
    return spec


def validate_base_model(base_model: str, limits: RegistryLimits, field_name: str = "adapter.base_model") -> str:
    """A model id or path as trainers spell it ("org/name", "tiny", "/models/x"): required, printable ASCII
    without spaces, no ".." segment (it may end up in a path)."""
    if not base_model:
        raise errors.InvalidArgument(f"{field_name}: required (the model the adapter was trained on)",
                                     field=field_name)
    if len(base_model) > limits.max_base_model_chars:
        raise errors.InvalidArgument(f"{field_name}: {len(base_model)} characters, at most "
                                     f"{limits.max_base_model_chars}", field=field_name)
    if not BASE_MODEL_RE.match(base_model) or ".." in base_model.split("/"):
        raise errors.InvalidArgument(
            f"{field_name}: {shown(base_model)} is not a model id: letters, digits and ._-/:@+ only, not starting "
            "with '-', and no '..' segment", field=field_name)
    return base_model


def page_size_of(page_size: int) -> int:
    if page_size < 0:
        raise errors.InvalidArgument(f"page_size: {page_size} is negative; use 0 for the default "
                                     f"({DEFAULT_PAGE_SIZE}) or up to {MAX_PAGE_SIZE}", field="page_size")
    return min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def _query_fingerprint(*query: object) -> str:
    return hashlib.sha256(json.dumps(query, separators=(",", ":")).encode()).hexdigest()[:16]


_BAD_TOKEN = "page_token: not a token this registry issued for this query; pass next_page_token unchanged"


def _mac(secret: bytes, payload: bytes) -> str:
    digest = hmac.new(secret, b"loraplane page token\n" + payload, hashlib.sha256).digest()[:16]
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def encode_page_token(secret: bytes, position: str | int, *query: object) -> str:
    """`<payload>.<mac>`: the position after which the next page starts and the fingerprint of the query that made
    it, authenticated with the registry's secret. A caller can neither forge a position nor move a token to another
    query (the caller's scope is part of every query), so a token is only ever a bookmark in a listing the caller
    was already allowed to read."""
    payload = base64.urlsafe_b64encode(json.dumps({"p": position, "q": _query_fingerprint(*query)},
                                                  separators=(",", ":")).encode()).decode().rstrip("=")
    return f"{payload}.{_mac(secret, payload.encode())}"


def decode_page_token(secret: bytes, token: str, *query: object) -> str | int | None:
    """The position after which the next page starts (None for the first page). A token is valid only for the
    query (and caller scope) that produced it (AIP-158), so a changed filter cannot silently skip or repeat items;
    a token with a wrong signature, a changed payload or another query's fingerprint is refused with one message
    (which says nothing about what the token names)."""
    if not token:
        return None
    payload, _, mac = token.partition(".")
    if not mac or not hmac.compare_digest(mac, _mac(secret, payload.encode())):
        raise errors.InvalidArgument(_BAD_TOKEN, field="page_token")
    try:
        decoded = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        position, fingerprint = decoded["p"], decoded["q"]
    except (ValueError, KeyError, TypeError):
        raise errors.InvalidArgument(_BAD_TOKEN, field="page_token") from None
    if fingerprint != _query_fingerprint(*query) or not isinstance(position, (str, int)):
        raise errors.InvalidArgument(_BAD_TOKEN, field="page_token")
    return position


# LoraConfig.expert_layout values as a blob's adapter_config names them; unspecified is per-expert, as the trainer
# reads it.
_LAYOUT_NAMES = {0: PER_EXPERT, 1: PER_EXPERT, 2: SHARED_OUTER}


def _layout_name(value: int) -> str:
    return _LAYOUT_NAMES.get(value, str(value))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


class _Trailer:
    """The trailer of one publish stream: allowed only when the header has no sha256, at most once, last."""

    def __init__(self, header_sha256: str):
        self.allowed = not header_sha256
        self.sha256: str | None = None

    def receive(self, trailer: PublishTrailer) -> None:
        if not self.allowed:
            raise errors.InvalidArgument("trailer: the header carries the sha256; a trailer may only end a stream "
                                         "whose header.sha256 is empty", field="trailer")
        if self.sha256 is not None:
            raise errors.InvalidArgument("trailer: sent twice", field="trailer")
        if not SHA256_RE.match(trailer.sha256):
            raise errors.InvalidArgument(
                f"trailer.sha256: {trailer.sha256[:80]!r} is not 64 lower-case hex digits", field="trailer.sha256")
        self.sha256 = trailer.sha256

    def expected(self) -> str:
        if self.sha256 is None:
            raise errors.InvalidArgument(
                "trailer: the stream ended without one; when header.sha256 is empty the last message must be the "
                "trailer with the blob's sha256 (nothing was committed)", field="trailer")
        return self.sha256


class _ByteBudget:
    """Bytes held at once by publishes that buffer their blob; a publish waits until its blob fits."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._released = asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, size: int):
        while self.used + size > self.limit:
            self._released.clear()
            await self._released.wait()
        self.used += size
        try:
            yield
        finally:
            self.used -= size
            self._released.set()


# ---------------------------------------------------------------------------------------------------- the store

class RegistryStore:
    def __init__(self, settings: Settings, limits: RegistryLimits | None = None):
        self.settings = settings
        self.limits = limits or RegistryLimits.from_env()
        self.prefix = settings.key_prefix
        self.redis_url = settings.redis_url
        if not self.redis_url:
            raise errors.FailedPrecondition("LORAPLANE_REDIS_URL is empty: the registry needs a Redis server")
        if not settings.s3_endpoint:
            raise errors.FailedPrecondition("LORAPLANE_S3_ENDPOINT is empty: the registry needs an S3 server")
        # A restarted Redis leaves stale pooled connections: retry on a fresh one instead of failing the call. A
        # retried PUBLISH is safe (the script remembers its upload token); so are the other scripts' effects.
        common = {"decode_responses": True, "socket_connect_timeout": 3, "health_check_interval": 0,
                  "retry": Retry(ExponentialBackoff(cap=0.25, base=0.02), 3)}
        self.redis = async_redis(self.redis_url, socket_timeout=10, **common)
        # Blocking XREADs get their own pool and a timeout longer than the block. A short block bounds how long an
        # abandoned read lingers (see `_next_events`); new events still arrive at once.
        self._watch_block_ms = 1000
        self.watch_redis = async_redis(self.redis_url, socket_timeout=self._watch_block_ms / 1000 + 10, **common)
        self.blobs = BlobStore(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key,
                               settings.s3_bucket, secure=settings.s3_secure, region=settings.s3_region)
        self.direct_downloads = settings.s3_direct_downloads
        self._scripts = {name: self.redis.register_script(getattr(lua, name)) for name in (
            "CREATE_ADAPTER", "PUBLISH", "SET_ALIAS", "DELETE_VERSION", "DELETE_ADAPTER", "REGISTER_UPLOAD",
            "FORGET_UPLOAD", "CLAIM_GARBAGE", "RELEASE_GARBAGE")}
        self.events_key = self.prefix + "events"
        self._closing = asyncio.Event()
        self._buffered = _ByteBudget(self.limits.max_buffered_publish_bytes)
        self._active_watches = 0
        self._pending_reads: set[asyncio.Future] = set()
        self._page_token_secret: bytes | None = None

    async def start(self) -> None:
        await self.blobs.ensure_bucket()
        with self._redis_errors("connect"):
            await self.redis.ping()

    def begin_shutdown(self) -> None:
        """Ends every WatchEvents stream (their clients resume from their cursor elsewhere or after a restart)."""
        self._closing.set()

    async def wait_for_watches_to_end(self, timeout: float) -> None:
        """After `begin_shutdown`: lets every watch stream finish inside the loop (releasing its Redis connection)
        before the server and the loop go away."""
        deadline = time.monotonic() + timeout
        while self._active_watches and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.begin_shutdown()
        if self._pending_reads:
            await asyncio.wait(set(self._pending_reads), timeout=self._watch_block_ms / 1000 + 2)
        await self.redis.aclose()
        await self.watch_redis.aclose()
        self.blobs.close()

    # ------------------------------------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _redis_errors(self, what: str):
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            # BusyLoadingError (a restarted server replaying its AOF) is a ConnectionError too.
            raise errors.Unavailable(f"Redis at {self.redis_url} is unavailable while trying to {what}: "
                                     f"{type(exc).__name__}: {exc}", reason="REDIS_UNAVAILABLE") from None
        except redis.exceptions.ResponseError as exc:
            if "READONLY" in str(exc) or "LOADING" in str(exc) or "MASTERDOWN" in str(exc):
                raise errors.Unavailable(f"Redis at {self.redis_url} cannot serve writes now ({exc})",
                                         reason="REDIS_UNAVAILABLE") from None
            raise

    async def _script(self, name: str, *args: object) -> object:
        with self._redis_errors(name.lower().replace("_", " ")):
            return await self._scripts[name](args=[self.prefix, self.limits.max_events, *args])

    def _akey(self, name: str, suffix: str = "") -> str:
        return f"{self.prefix}a:{name}{suffix}"

    def _adapter_record(self, fields: dict[str, str], aliases: dict[str, str]) -> AdapterRecord:
        lora = json.loads(fields.get("lora") or "{}")
        return AdapterRecord(
            name=fields["name"], lora=LoraSpec(**lora), base_model=fields.get("base_model", ""),
            keep_last=int(fields.get("keep_last") or 0), metadata=json.loads(fields.get("metadata") or "{}"),
            aliases={alias: int(version) for alias, version in aliases.items()},
            latest_version=int(fields.get("latest") or 0), create_time_ms=int(fields.get("create_time") or 0))

    def _version_record(self, adapter: str, version: int, fields: dict[str, str],
                        aliases: dict[str, str]) -> VersionRecord:
        return VersionRecord(
            adapter=adapter, version=version, kind=int(fields["kind"]), sha256=fields["sha256"],
            size_bytes=int(fields["size"]), training_step=int(fields.get("step") or 0),
            metadata=json.loads(fields.get("metadata") or "{}"),
            aliases=sorted(alias for alias, target in aliases.items() if int(target) == version),
            create_time_ms=int(fields.get("create_time") or 0))

    async def _collect_freed(self, shas: Iterable[str]) -> None:
        """Deletes blobs that a mutation just left unreferenced. A failure here is not the caller's problem: the
        blob stays until the next CollectGarbage."""
        for sha in shas:
            try:
                await self._delete_blob_if_garbage(sha, dry_run=False)
            except errors.LoraplaneError as exc:
                log.warning("blob %s left for the next garbage collection: %s", sha, exc)

    # ------------------------------------------------------------------------------------------------ adapters

    async def create_adapter(self, name: str, lora: LoraSpec, base_model: str, keep_last: int,
                             metadata: Mapping[str, str], *, caller: Identity = OPEN) -> AdapterRecord:
        validate_name(name, "adapter.name")
        caller.authorize(name, "adapter.name")
        validate_lora(lora, self.limits)
        validate_base_model(base_model, self.limits)
        validate_metadata(metadata, self.limits, "adapter.metadata")
        await self._check_adapter_quota(name, caller)
        created = await self._script(
            "CREATE_ADAPTER", name, _now_ms(), json.dumps(lora.__dict__), base_model, keep_last,
            json.dumps(dict(metadata)))
        if not created:
            raise errors.AlreadyExists(f"adapter.name: adapter {shown(name)} already exists", field="adapter.name")
        return await self.get_adapter(name)

    async def get_adapter(self, name: str, field_name: str = "name", *, caller: Identity = OPEN) -> AdapterRecord:
        validate_name(name, field_name)
        caller.authorize(name, field_name)
        with self._redis_errors("read an adapter"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(self._akey(name))
                pipe.hgetall(self._akey(name, ":aliases"))
                fields, aliases = await pipe.execute()
        if not fields:
            raise errors.NotFound(f"{field_name}: adapter {shown(name)} not found", field=field_name)
        return self._adapter_record(fields, aliases)

    async def list_adapters(self, prefix: str, page_size: int, page_token: str, *,
                            caller: Identity = OPEN) -> tuple[list[AdapterRecord], str]:
        if len(prefix) > self.limits.max_prefix_chars:
            raise errors.InvalidArgument(f"prefix: {len(prefix)} characters, at most {self.limits.max_prefix_chars}",
                                         field="prefix")
        size = page_size_of(page_size)
        secret = await self._page_secret()
        query = ("adapters", prefix, caller.scope or "")
        # A scoped caller lists only its own namespace (an empty page when it asks for another one).
        narrowed = caller.narrow_prefix(prefix)
        if narrowed is None:
            decode_page_token(secret, page_token, *query)
            return [], ""
        after = decode_page_token(secret, page_token, *query)
        prefix = narrowed
        # The scan's lower bound never leaves the caller's range, whatever a token says: a position below the
        # prefix starts at the prefix (the upper bound already ends there).
        if after is not None and (not isinstance(after, str) or (prefix and after < prefix)):
            after = None
        low = f"({after}" if after is not None else f"[{prefix}" if prefix else "-"
        high = f"[{prefix}\xff" if prefix else "+"
        with self._redis_errors("list adapters"):
            names = await self.redis.zrangebylex(self.prefix + "adapters", low, high, start=0, num=size + 1)
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in names[:size]:
                    pipe.hgetall(self._akey(name))
                    pipe.hgetall(self._akey(name, ":aliases"))
                replies = await pipe.execute()
        # And each record is shown only if the key may see it (a second, independent check of the range above).
        records = [self._adapter_record(fields, aliases)
                   for fields, aliases in zip(replies[::2], replies[1::2], strict=True)
                   if fields and caller.may_see(fields.get("name", ""))]
        next_token = encode_page_token(secret, names[size - 1], *query) if len(names) > size else ""
        return records, next_token

    async def _page_secret(self) -> bytes:
        """The key page tokens are signed with: made once per registry (the first replica to ask stores it in Redis,
        next to the metadata it protects), so every replica accepts every replica's tokens and a restart keeps
        issued tokens valid."""
        if self._page_token_secret is None:
            key = self.prefix + "page_token_secret"
            with self._redis_errors("read the page-token secret"):
                await self.redis.set(key, secrets.token_hex(32), nx=True)
                stored = await self.redis.get(key)
            self._page_token_secret = bytes.fromhex(stored)
        return self._page_token_secret

    async def delete_adapter(self, name: str, *, caller: Identity = OPEN) -> None:
        validate_name(name)
        caller.authorize(name)
        result = await self._script("DELETE_ADAPTER", name, _now_ms())
        if result[0] == -1:
            raise errors.NotFound(f"name: adapter {shown(name)} not found", field="name")
        await append_audit(self.redis, self.prefix, audit_entry(caller, "DeleteAdapter", name))
        await self._collect_freed(result[1:])

    async def _check_adapter_quota(self, name: str, caller: Identity) -> None:
        limit, tenant = caller.quotas.max_adapters, caller.scoped_tenant
        if not limit or not tenant:
            return
        with self._redis_errors("count adapters"):
            if await self.redis.exists(self._akey(name)):
                return  # the create answers ALREADY_EXISTS, as without a quota
            count = await self.redis.zlexcount(self.prefix + "adapters", f"[{tenant}/", f"[{tenant}/\xff")
        if count + 1 > limit:
            raise quota_exceeded("max_adapters", tenant, count + 1, limit, " adapters")

    async def stored_bytes(self, tenant: str) -> int:
        """Bytes of every version (all kinds) of the adapters under `tenant/`, as the quota counts them."""
        with self._redis_errors("count stored bytes"):
            names = await self.redis.zrangebylex(self.prefix + "adapters", f"[{tenant}/", f"[{tenant}/\xff")
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.zrange(self._akey(name, ":versions"), 0, -1)
                version_lists = await pipe.execute()
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, numbers in zip(names, version_lists, strict=True):
                    for number in numbers:
                        pipe.hget(self._akey(name, f":v:{number}"), "size")
                sizes = await pipe.execute()
        return sum(int(size or 0) for size in sizes)

    async def _check_bytes_quota(self, size: int, caller: Identity) -> None:
        limit, tenant = caller.quotas.max_stored_bytes, caller.scoped_tenant
        if not limit or not tenant:
            return
        used = await self.stored_bytes(tenant) + size
        if used > limit:
            raise quota_exceeded("max_stored_bytes", tenant, used, limit, " bytes")

    # ------------------------------------------------------------------------------------------------ versions

    def validate_publish_header(self, header: PublishHeader) -> PublishHeader:
        validate_name(header.adapter, "header.adapter")
        if header.sha256 and not SHA256_RE.match(header.sha256):
            raise errors.InvalidArgument(
                f"header.sha256: {header.sha256[:80]!r} is not 64 lower-case hex digits (or empty, with the digest "
                "in the trailer)", field="header.sha256")
        if header.size_bytes < 1 or header.size_bytes > self.limits.max_blob_bytes:
            raise errors.InvalidArgument(
                f"header.size_bytes: {header.size_bytes} must be between 1 and {self.limits.max_blob_bytes}",
                field="header.size_bytes")
        if not header.sha256 and header.size_bytes > self.limits.max_buffered_publish_bytes:
            raise errors.InvalidArgument(
                f"header.sha256: required for a blob of {header.size_bytes} bytes; a blob whose digest comes in the "
                f"trailer is held in memory until it is checked, at most {self.limits.max_buffered_publish_bytes} "
                "bytes", field="header.sha256")
        if header.kind not in KINDS:
            raise errors.InvalidArgument(f"header.kind: {header.kind} is not a known VersionKind",
                                         field="header.kind")
        if len(header.idempotency_key) > self.limits.max_idempotency_key_chars:
            raise errors.InvalidArgument(
                f"header.idempotency_key: {len(header.idempotency_key)} characters, at most "
                f"{self.limits.max_idempotency_key_chars}", field="header.idempotency_key")
        validate_metadata(header.metadata, self.limits, "header.metadata")
        if len(header.aliases) > self.limits.max_aliases_per_publish:
            raise errors.InvalidArgument(f"header.aliases: {len(header.aliases)} aliases, at most "
                                         f"{self.limits.max_aliases_per_publish}", field="header.aliases")
        for alias in header.aliases:
            validate_alias(alias, "header.aliases")
        if header.aliases and header.kind != KIND_WEIGHTS:
            raise errors.InvalidArgument("header.aliases: only WEIGHTS versions can carry aliases",
                                         field="header.aliases")
        header.aliases = list(dict.fromkeys(header.aliases))
        return header

    async def publish(self, header: PublishHeader, items: AsyncIterator[bytes | PublishTrailer], *,
                      caller: Identity = OPEN) -> PublishResult:
        """Stores the blob announced by `header` (validated by `validate_publish_header`) from `items` (its
        chunks, then a PublishTrailer when the header has no sha256), then commits the version. Nothing is
        committed unless every byte arrived and matched the digest.

        With the digest in the header, the bytes stream into S3 as they arrive. With the digest in the trailer, the
        blob's key (its digest) is unknown until the last byte, so the bytes are held in memory (within
        `max_buffered_publish_bytes` for all such publishes at once) and written once checked."""
        self.validate_publish_header(header)
        caller.authorize(header.adapter, "header.adapter")
        adapter = await self.get_adapter(header.adapter, "header.adapter")
        trailer = _Trailer(header.sha256)
        if header.idempotency_key:
            prior = await self._prior_publish(adapter.name, header)
            if prior is not None:
                if not header.sha256:
                    # Only the bytes tell whether this is the first publish's content: hash them, store nothing.
                    digest = await self.blobs.digest(self._checked_chunks(items, None, trailer), header.size_bytes,
                                                     trailer.expected)
                    self._check_same_content(prior, header.idempotency_key, digest, "trailer.sha256")
                return PublishResult(prior, deduplicated=True)
        await self._check_bytes_quota(header.size_bytes, caller)
        token = uuid.uuid4().hex
        claimed = ""  # the blob this publish protects from garbage collection until it commits or gives up

        async def claim(sha256: str) -> None:
            nonlocal claimed
            await self._register_upload(sha256, token, header.size_bytes)
            claimed = sha256

        committed = False
        check = BlobCheck(header.size_bytes, training_state=header.kind == KIND_TRAINING_STATE)
        try:
            # Only an adapter (or a training state) that samplers and trainers can load becomes a version: a blob
            # that is not would make every Sample of "latest" fail until someone deleted it. The content check
            # runs once length and digest are right (a truncated stream is reported as truncated) and before the
            # upload completes (a rejected blob never becomes an S3 object).
            def verify() -> None:
                check.finish()
                self._check_blob_matches(adapter, check)

            chunks = self._checked_chunks(items, check, trailer)
            if header.sha256:
                await claim(header.sha256)
                await self.blobs.upload(chunks, header.size_bytes, header.sha256, verify)
            else:
                async with self._buffered.hold(header.size_bytes):
                    await self.blobs.upload_trailed(chunks, header.size_bytes, trailer.expected, verify, claim)
            sha256 = claimed
            result = await self._script(
                "PUBLISH", header.adapter, _now_ms(), header.idempotency_key, header.kind, sha256,
                header.size_bytes, header.training_step, json.dumps(header.metadata), token, *header.aliases)
            committed = True
        finally:
            if claimed and not committed:
                # Shielded: a cancelled publish must still release its claim so GC can collect the blob.
                with contextlib.suppress(errors.LoraplaneError):
                    await asyncio.shield(self._script("FORGET_UPLOAD", claimed, token))
        if result[0] == -1:
            await self._collect_freed([sha256])
            raise errors.NotFound(f"header.adapter: adapter {shown(header.adapter)} was deleted during the upload",
                                  field="header.adapter")
        version, deduplicated, freed = int(result[0]), bool(result[1]), result[2:]
        await self._collect_freed(freed)
        try:
            record = await self.get_version(header.adapter, version=version)
        except errors.NotFound:
            # keep_last=... removed it at once (it can only be an older version deduplicated here).
            record = VersionRecord(header.adapter, version, header.kind, sha256, header.size_bytes,
                                   header.training_step, header.metadata, [], _now_ms())
        return PublishResult(record, deduplicated)

    async def _prior_publish(self, adapter: str, header: PublishHeader) -> VersionRecord | None:
        with self._redis_errors("check the idempotency key"):
            prior = await self.redis.hget(self._akey(adapter, ":idem"), header.idempotency_key)
        if prior is None:
            return None
        try:
            record = await self.get_version(adapter, version=int(prior))
        except errors.NotFound:
            return None
        if header.sha256:
            self._check_same_content(record, header.idempotency_key, header.sha256, "header.sha256")
        return record

    @staticmethod
    def _check_same_content(prior: VersionRecord, idempotency_key: str, sha256: str, where: str) -> None:
        if prior.sha256 != sha256:
            raise errors.AlreadyExists(
                f"header.idempotency_key: {shown(idempotency_key)} was used for version {prior.version} with a "
                f"different sha256 ({prior.sha256}, this {where} is {sha256}); use a new key for different content",
                field="header.idempotency_key")

    async def _register_upload(self, sha256: str, token: str, size: int) -> None:
        # Protects the blob from a concurrent garbage collection between its upload and its commit. Generous
        # expiry: a crashed registry's claim only delays the collection of that one blob.
        expiry = _now_ms() + 3600_000 + size // 1000
        for _ in range(200):
            if await self._script("REGISTER_UPLOAD", sha256, token, expiry):
                return
            await asyncio.sleep(0.05)  # GC is deleting this very blob right now; it finishes quickly.
        raise errors.Unavailable(f"blob {sha256} is being garbage-collected; retry", reason="BLOB_BUSY")

    async def _checked_chunks(self, items: AsyncIterator[bytes | PublishTrailer], check: BlobCheck | None,
                              trailer: _Trailer) -> AsyncIterator[bytes]:
        """The chunks of a publish stream, bounded and fed to `check`; a trailer goes to `trailer`."""
        limit = self.limits.max_chunk_bytes
        async for chunk in items:
            if isinstance(chunk, PublishTrailer):
                trailer.receive(chunk)
                continue
            if trailer.sha256 is not None:
                raise errors.InvalidArgument("trailer: must be the last message; a chunk followed it", field="trailer")
            if len(chunk) > limit:
                raise errors.InvalidArgument(f"chunk: {len(chunk)} bytes, at most {limit} per message",
                                             field="chunk")
            if chunk:
                if check is not None and len(chunk) > CHECK_OFF_LOOP_BYTES:
                    await asyncio.to_thread(check.feed, chunk)
                elif check is not None:
                    check.feed(chunk)
                yield chunk

    @staticmethod
    def _check_blob_matches(adapter: AdapterRecord, check: BlobCheck) -> None:
        """The blob's LoRA shape and base model must be the adapter's (when the adapter states them)."""
        spec = check.spec
        if adapter.lora.rank and spec.rank != adapter.lora.rank:
            raise errors.InvalidArgument(
                f"chunk: the blob has LoRA rank {spec.rank}, adapter {shown(adapter.name)} has rank "
                f"{adapter.lora.rank}", field="chunk")
        if adapter.lora.target_modules and set(spec.target_modules) != set(adapter.lora.target_modules):
            raise errors.InvalidArgument(
                f"chunk: the blob targets {list(spec.target_modules)}, adapter {shown(adapter.name)} targets "
                f"{adapter.lora.target_modules}", field="chunk")
        if spec.has_experts and spec.expert_layout != _layout_name(adapter.lora.expert_layout):
            raise errors.InvalidArgument(
                f"chunk: the blob's expert tensors are {spec.expert_layout}, adapter {shown(adapter.name)} is "
                f"{_layout_name(adapter.lora.expert_layout)} (its lora_config.expert_layout)", field="chunk")
        if adapter.base_model and check.base_model and check.base_model != adapter.base_model:
            raise errors.InvalidArgument(
                f"chunk: the blob was trained on base model {shown(check.base_model)}, adapter "
                f"{shown(adapter.name)} is on {shown(adapter.base_model)}", field="chunk")

    async def resolve(self, adapter: str, version: int = 0, alias: str = "", field_name: str = "ref") -> int:
        """The version number a reference names: explicit version, alias, or the latest weights."""
        validate_name(adapter, f"{field_name}.name")
        if version:
            return version
        record = await self.get_adapter(adapter, f"{field_name}.name")
        if alias:
            validate_alias(alias, f"{field_name}.alias")
            if alias not in record.aliases:
                raise errors.NotFound(f"{field_name}.alias: adapter {shown(adapter)} has no alias {shown(alias)}",
                                      field=f"{field_name}.alias")
            return record.aliases[alias]
        if not record.latest_version:
            raise errors.NotFound(f"{field_name}: adapter {shown(adapter)} has no published weights yet",
                                  field=field_name)
        return record.latest_version

    async def get_version(self, adapter: str, version: int = 0, alias: str = "",
                          field_name: str = "ref", *, caller: Identity = OPEN) -> VersionRecord:
        validate_name(adapter, f"{field_name}.name")
        caller.authorize(adapter, f"{field_name}.name")
        number = await self.resolve(adapter, version, alias, field_name)
        with self._redis_errors("read a version"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.exists(self._akey(adapter))
                pipe.hgetall(self._akey(adapter, f":v:{number}"))
                pipe.hgetall(self._akey(adapter, ":aliases"))
                exists, fields, aliases = await pipe.execute()
        if not exists:
            raise errors.NotFound(f"{field_name}.name: adapter {shown(adapter)} not found", field=f"{field_name}.name")
        if not fields:
            raise errors.NotFound(f"{field_name}.version: adapter {shown(adapter)} has no version {number}",
                                  field=f"{field_name}.version")
        return self._version_record(adapter, number, fields, aliases)

    async def list_versions(self, adapter: str, kind: int, page_size: int,
                            page_token: str, *, caller: Identity = OPEN) -> tuple[list[VersionRecord], str]:
        validate_name(adapter, "adapter")
        caller.authorize(adapter, "adapter")
        if kind and kind not in KINDS:
            raise errors.InvalidArgument(f"kind: {kind} is not a known VersionKind", field="kind")
        size = page_size_of(page_size)
        secret = await self._page_secret()
        query = ("versions", adapter, kind, caller.scope or "")
        after = decode_page_token(secret, page_token, *query)
        if after is not None and (not isinstance(after, int) or isinstance(after, bool)):
            after = None
        index = self._akey(adapter, f":kind:{kind}" if kind else ":versions")
        with self._redis_errors("list versions"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.exists(self._akey(adapter))
                pipe.zrangebyscore(index, f"({after}" if after is not None else "-inf", "+inf", start=0,
                                   num=size + 1)
                pipe.hgetall(self._akey(adapter, ":aliases"))
                exists, numbers, aliases = await pipe.execute()
            if not exists:
                raise errors.NotFound(f"adapter: adapter {shown(adapter)} not found", field="adapter")
            async with self.redis.pipeline(transaction=False) as pipe:
                for number in numbers[:size]:
                    pipe.hgetall(self._akey(adapter, f":v:{number}"))
                replies = await pipe.execute()
        records = [self._version_record(adapter, int(number), fields, aliases)
                   for number, fields in zip(numbers, replies, strict=False) if fields]
        next_token = encode_page_token(secret, int(numbers[size - 1]), *query) if len(numbers) > size else ""
        return records, next_token

    async def delete_version(self, adapter: str, version: int, *, caller: Identity = OPEN) -> None:
        validate_name(adapter, "adapter")
        caller.authorize(adapter, "adapter")
        if version < 1:
            raise errors.InvalidArgument("version: must be >= 1", field="version")
        result = await self._script("DELETE_VERSION", adapter, _now_ms(), version)
        if result[0] == -1:
            raise errors.NotFound(f"adapter: adapter {shown(adapter)} not found", field="adapter")
        if result[0] == -2:
            raise errors.NotFound(f"version: adapter {shown(adapter)} has no version {version}", field="version")
        if result[0] == -3:
            raise errors.FailedPrecondition(
                f"version: version {version} of {shown(adapter)} is the target of alias {result[1]!r}; move or remove "
                "the alias first", field="version", reason="VERSION_ALIASED")
        await append_audit(self.redis, self.prefix, audit_entry(caller, "DeleteVersion", f"{adapter}@v{version}"))
        await self._collect_freed(result[1:])

    async def set_alias(self, adapter: str, alias: str, version: int, *, caller: Identity = OPEN) -> AdapterRecord:
        validate_name(adapter, "adapter")
        caller.authorize(adapter, "adapter")
        validate_alias(alias)
        result = await self._script("SET_ALIAS", adapter, _now_ms(), alias, version)
        code = result[0]
        if code == -1:
            raise errors.NotFound(f"adapter: adapter {shown(adapter)} not found", field="adapter")
        if code == -2:
            raise errors.NotFound(f"version: adapter {shown(adapter)} has no version {version}", field="version")
        if code == -3:
            raise errors.InvalidArgument(
                f"version: version {version} of {shown(adapter)} is not a WEIGHTS version; aliases name weights only",
                field="version")
        await append_audit(self.redis, self.prefix,
                           audit_entry(caller, "SetAlias", f"{adapter}:{alias}", detail=f"version={version}"))
        await self._collect_freed(result[1:])
        return await self.get_adapter(adapter, "adapter")

    async def download(self, adapter: str, version: int, alias: str, offset: int,
                       chunk_size: int, *, caller: Identity = OPEN) -> tuple[VersionRecord, AsyncIterator[bytes]]:
        validate_name(adapter, "ref.name")
        caller.authorize(adapter, "ref.name")
        if chunk_size > self.limits.max_download_chunk_bytes:
            raise errors.InvalidArgument(f"chunk_size: {chunk_size} exceeds the limit "
                                         f"{self.limits.max_download_chunk_bytes}", field="chunk_size")
        record = await self.get_version(adapter, version, alias)
        if offset > record.size_bytes:
            raise errors.InvalidArgument(f"offset: {offset} is past the end of the blob ({record.size_bytes} bytes)",
                                         field="offset")
        chunks = self._verified_read(record, offset, chunk_size or 1024 * 1024)
        return record, chunks

    async def direct_download(self, adapter: str, version: int, alias: str, *,
                              caller: Identity = OPEN) -> tuple[VersionRecord, str] | None:
        """(the version, a presigned GET URL of its blob) when this registry hands out S3 addresses, else None (the
        caller streams instead). Authorized exactly as a streamed download is."""
        if not self.direct_downloads:
            return None
        record = await self.get_version(adapter, version, alias, caller=caller)
        return record, await self.blobs.presigned_get(record.sha256, DIRECT_URL_SECONDS)

    async def _verified_read(self, record: VersionRecord, offset: int, chunk_size: int) -> AsyncIterator[bytes]:
        if offset == record.size_bytes:
            return
        # From the start we can check the stored bytes against the recorded digest before the last chunk leaves,
        # so a corrupted blob ends the stream with DATA_LOSS instead of handing over bad bytes silently.
        hasher = hashlib.sha256() if offset == 0 else None
        sent = offset
        held: bytes | None = None
        async for data in self.blobs.read(record.sha256, offset, chunk_size, hasher):
            if held is not None:
                yield held
            sent += len(data)
            held = data
        if sent != record.size_bytes or (hasher is not None and hasher.hexdigest() != record.sha256):
            raise errors.DataLoss(f"stored blob of {shown(record.adapter)} v{record.version} is corrupt: {sent} bytes, "
                                  f"expected {record.size_bytes} with sha256 {record.sha256}", reason="BLOB_CORRUPT")
        if held is not None:
            yield held

    # ------------------------------------------------------------------------------------------------ garbage

    async def _delete_blob_if_garbage(self, sha: str, *, dry_run: bool) -> bool:
        claimed = await self._script("CLAIM_GARBAGE", sha, _now_ms(), 120_000, "1" if dry_run else "0")
        if not claimed or dry_run:
            return bool(claimed)
        try:
            await self.blobs.remove(sha)
        finally:
            with contextlib.suppress(errors.LoraplaneError):
                await self._script("RELEASE_GARBAGE", sha)
        return True

    async def collect_garbage(self, dry_run: bool, *, caller: Identity = OPEN) -> GarbageReport:
        caller.require_admin("CollectGarbage")
        if not dry_run:
            aborted = await self.blobs.abort_stale_uploads(self.limits.stale_upload_seconds)
            if aborted:
                log.info("aborted %d stale multipart uploads", aborted)
        stored = await self.blobs.list_blobs()
        if not stored:
            return GarbageReport([], 0)
        with self._redis_errors("read blob references"):
            counts = await self.redis.hmget(self.prefix + "blobrefs", [blob.sha256 for blob in stored])
        deleted: list[str] = []
        freed = 0
        for blob, count in zip(stored, counts, strict=True):
            if count is not None and int(count) > 0:
                continue
            if await self._delete_blob_if_garbage(blob.sha256, dry_run=dry_run):
                deleted.append(blob.sha256)
                freed += blob.size
        return GarbageReport(deleted, freed)

    # ------------------------------------------------------------------------------------------------ events

    async def watch(self, after_cursor: str, adapter: str, prefix: str,
                    start_at_end: bool, *, caller: Identity = OPEN) -> AsyncIterator[EventRecord]:
        if after_cursor and not CURSOR_RE.match(after_cursor):
            raise errors.InvalidArgument(f"after_cursor: {after_cursor[:60]!r} is not a cursor this registry issued",
                                         field="after_cursor")
        if adapter:
            validate_name(adapter, "adapter")
            caller.authorize(adapter, "adapter")
        if len(prefix) > self.limits.max_prefix_chars:
            raise errors.InvalidArgument(f"prefix: {len(prefix)} characters, at most {self.limits.max_prefix_chars}",
                                         field="prefix")
        last = after_cursor or "0-0"
        if start_at_end and not after_cursor:
            with self._redis_errors("read the event stream"):
                newest = await self.redis.xrevrange(self.events_key, "+", "-", count=1)
            last = newest[0][0] if newest else "0-0"
        closing = asyncio.ensure_future(self._closing.wait())
        self._active_watches += 1
        try:
            while True:
                reply = await self._next_events(last, closing)
                for _stream, entries in reply or ():
                    for entry_id, fields in entries:
                        last = entry_id
                        name = fields.get("a", "")
                        if adapter and name != adapter:
                            continue
                        if prefix and not name.startswith(prefix):
                            continue
                        if not caller.may_see(name):
                            continue
                        yield EventRecord(
                            cursor=entry_id, type=int(fields.get("t", 0)), adapter=name,
                            version=int(fields.get("v", 0)), sha256=fields.get("s", ""), alias=fields.get("al", ""),
                            kind=int(fields.get("k", 0)), time_ms=int(fields.get("ts", 0)))
        finally:
            closing.cancel()
            self._active_watches -= 1

    async def _next_events(self, last: str, closing: asyncio.Future) -> list:
        """One blocking XREAD. It is never cancelled: redis-py's asyncio client can hang on a cancelled blocking
        read, so an abandoned read (client gone, registry shutting down) finishes by itself within one short
        block and `close` waits for it."""
        read = asyncio.ensure_future(
            self.watch_redis.xread({self.events_key: last}, count=512, block=self._watch_block_ms))
        self._pending_reads.add(read)
        read.add_done_callback(_forget_read(self._pending_reads))
        with self._redis_errors("read the event stream"):
            await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                raise errors.Unavailable("the registry is shutting down; resume from the last cursor elsewhere",
                                         reason="SHUTTING_DOWN")
            return read.result()


def _forget_read(pending: set[asyncio.Future]):
    def forget(read: asyncio.Future) -> None:
        pending.discard(read)
        if not read.cancelled():
            read.exception()  # retrieved, so an abandoned read's error is not reported as never retrieved
    return forget
