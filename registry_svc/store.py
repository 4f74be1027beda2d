"""The registry's domain: adapters, versions, aliases, quotas, retention and blob GC. Its publish pipeline is
`publish.PublishPipeline` (`store.publishing`), its event stream `events.EventStream` (`store.events`).

Metadata and events live in Redis (atomic Lua scripts, see `lua.py`); blob bytes live in S3 (`blobs.py`).
Nothing here knows about gRPC: inputs are plain values, outputs are the dataclasses below, failures are
`loraplane.errors` exceptions.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass

import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from loraplane import errors
from loraplane.auth import OPEN, Identity, append_audit, audit_entry, quota_exceeded
from loraplane.config import Settings
from loraplane.errors import VERSION_PENDING, shown
from loraplane.fields import validate_alias, validate_name
from loraplane.lora import PER_EXPERT, SHARED_OUTER, LoraSpec
from loraplane.models.families import ALL_TARGETS
from loraplane.redis_pool import async_redis
from registry_svc import lua
from registry_svc.blobs import BlobStore
from registry_svc.events import EventStream
from registry_svc.publish import PublishPipeline
from registry_svc.records import (
    KINDS,
    WEIGHTS_DTYPES,
    AdapterRecord,
    RegistryLimits,
    VersionRecord,
    now_ms,
    validate_metadata,
)

log = logging.getLogger(__name__)

BASE_MODEL_RE = re.compile(r"^[A-Za-z0-9._/][A-Za-z0-9._/:@+-]*\Z")
# How long a presigned download URL stays valid: long enough to start the GET, short enough that a leaked one
# soon opens nothing.
DIRECT_URL_SECONDS = 60
# Every LoRA target a model family offers (dense projections and the routed experts' fused projections).
PROJECTIONS = ALL_TARGETS
# LoraConfig.expert_layout names as a LoraSpec holds them ("" = unspecified).
EXPERT_LAYOUT_NAMES = ("", PER_EXPERT, SHARED_OUTER)

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


@dataclass
class GarbageReport:
    deleted_blobs: list[str]
    freed_bytes: int


# ---------------------------------------------------------------------------------------------------- validation

def validate_lora(spec: LoraSpec, weights_dtype: int, limits: RegistryLimits,
                  field_name: str = "adapter.lora_config") -> LoraSpec:
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
    if weights_dtype not in WEIGHTS_DTYPES:
        raise errors.InvalidArgument(
            f"{field_name}.weights_dtype: {weights_dtype} is not a WeightsDtype (unspecified, float32, bfloat16)",
            field=f"{field_name}.weights_dtype")
    if spec.expert_layout not in EXPERT_LAYOUT_NAMES:
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
        self.blobs = BlobStore(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key,
                               settings.s3_bucket, secure=settings.s3_secure, region=settings.s3_region)
        self.direct_downloads = settings.s3_direct_downloads
        self._scripts = {name: self.redis.register_script(getattr(lua, name)) for name in (
            "CREATE_ADAPTER", "PUBLISH", "SET_ALIAS", "DELETE_VERSION", "DELETE_ADAPTER", "REGISTER_UPLOAD",
            "FORGET_UPLOAD", "CLAIM_GARBAGE", "RELEASE_GARBAGE", "STORED")}
        self._page_token_secret: bytes | None = None
        self.publishing = PublishPipeline(self)
        self.events = EventStream(self, **common)

    async def start(self) -> None:
        await self.blobs.ensure_bucket()
        with self.redis_errors("connect"):
            await self.redis.ping()

    def begin_shutdown(self) -> None:
        """Ends every WatchEvents stream (their clients resume from their cursor elsewhere or after a restart)."""
        self.events.begin_shutdown()

    async def wait_for_watches_to_end(self, timeout: float) -> None:
        await self.events.wait_for_watches_to_end(timeout)

    async def close(self) -> None:
        await self.events.close()
        await self.redis.aclose()
        self.blobs.close()

    # ------------------------------------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def redis_errors(self, what: str):
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

    async def script(self, name: str, *args: object) -> object:
        with self.redis_errors(name.lower().replace("_", " ")):
            return await self._scripts[name](args=[self.prefix, self.limits.max_events, *args])

    def akey(self, name: str, suffix: str = "") -> str:
        return f"{self.prefix}a:{name}{suffix}"

    def _adapter_record(self, fields: dict[str, str], aliases: dict[str, str]) -> AdapterRecord:
        lora, weights_dtype = _lora_from_stored(json.loads(fields.get("lora") or "{}"))
        return AdapterRecord(
            name=fields["name"], lora=lora, weights_dtype=weights_dtype, base_model=fields.get("base_model", ""),
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
            create_time_ms=int(fields.get("create_time") or 0), pending=fields.get("pending") == "1")

    async def collect_freed(self, shas: Iterable[str]) -> None:
        """Deletes blobs that a mutation just left unreferenced. A failure here is not the caller's problem: the
        blob stays until the next CollectGarbage."""
        for sha in shas:
            try:
                await self._delete_blob_if_garbage(sha, dry_run=False)
            except errors.LoraplaneError as exc:
                log.warning("blob %s left for the next garbage collection: %s", sha, exc)

    # ------------------------------------------------------------------------------------------------ adapters

    async def create_adapter(self, name: str, lora: LoraSpec, base_model: str, keep_last: int,
                             metadata: Mapping[str, str], *, weights_dtype: int = 0,
                             caller: Identity = OPEN) -> AdapterRecord:
        validate_name(name, "adapter.name")
        caller.authorize(name, "adapter.name")
        validate_lora(lora, weights_dtype, self.limits)
        validate_base_model(base_model, self.limits)
        validate_metadata(metadata, self.limits, "adapter.metadata")
        await self._check_adapter_quota(name, caller)
        created = await self.script(
            "CREATE_ADAPTER", name, now_ms(), json.dumps(_lora_to_stored(lora, weights_dtype)), base_model, keep_last,
            json.dumps(dict(metadata)))
        if not created:
            raise errors.AlreadyExists(f"adapter.name: adapter {shown(name)} already exists", field="adapter.name")
        return await self.get_adapter(name)

    async def get_adapter(self, name: str, field_name: str = "name", *, caller: Identity = OPEN) -> AdapterRecord:
        validate_name(name, field_name)
        caller.authorize(name, field_name)
        with self.redis_errors("read an adapter"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(self.akey(name))
                pipe.hgetall(self.akey(name, ":aliases"))
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
        with self.redis_errors("list adapters"):
            names = await self.redis.zrangebylex(self.prefix + "adapters", low, high, start=0, num=size + 1)
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in names[:size]:
                    pipe.hgetall(self.akey(name))
                    pipe.hgetall(self.akey(name, ":aliases"))
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
            with self.redis_errors("read the page-token secret"):
                await self.redis.set(key, secrets.token_hex(32), nx=True)
                stored = await self.redis.get(key)
            self._page_token_secret = bytes.fromhex(stored)
        return self._page_token_secret

    async def delete_adapter(self, name: str, *, caller: Identity = OPEN) -> None:
        validate_name(name)
        caller.authorize(name)
        result = await self.script("DELETE_ADAPTER", name, now_ms())
        if result[0] == -1:
            raise errors.NotFound(f"name: adapter {shown(name)} not found", field="name")
        await append_audit(self.redis, self.prefix, audit_entry(caller, "DeleteAdapter", name))
        await self.collect_freed(result[1:])

    async def _check_adapter_quota(self, name: str, caller: Identity) -> None:
        limit, tenant = caller.quotas.max_adapters, caller.scoped_tenant
        if not limit or not tenant:
            return
        with self.redis_errors("count adapters"):
            if await self.redis.exists(self.akey(name)):
                return  # the create answers ALREADY_EXISTS, as without a quota
            count = await self.redis.zlexcount(self.prefix + "adapters", f"[{tenant}/", f"[{tenant}/\xff")
        if count + 1 > limit:
            raise quota_exceeded("max_adapters", tenant, count + 1, limit, " adapters")

    async def stored_bytes(self, tenant: str) -> int:
        """Bytes of every version (all kinds) of the adapters under `tenant/`, as the quota counts them."""
        with self.redis_errors("count stored bytes"):
            names = await self.redis.zrangebylex(self.prefix + "adapters", f"[{tenant}/", f"[{tenant}/\xff")
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.zrange(self.akey(name, ":versions"), 0, -1)
                version_lists = await pipe.execute()
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, numbers in zip(names, version_lists, strict=True):
                    for number in numbers:
                        pipe.hget(self.akey(name, f":v:{number}"), "size")
                sizes = await pipe.execute()
        return sum(int(size or 0) for size in sizes)

    async def check_bytes_quota(self, size: int, caller: Identity) -> None:
        limit, tenant = caller.quotas.max_stored_bytes, caller.scoped_tenant
        if not limit or not tenant:
            return
        used = await self.stored_bytes(tenant) + size
        if used > limit:
            raise quota_exceeded("max_stored_bytes", tenant, used, limit, " bytes")

    # ------------------------------------------------------------------------------------------------ versions

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
        with self.redis_errors("read a version"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.exists(self.akey(adapter))
                pipe.hgetall(self.akey(adapter, f":v:{number}"))
                pipe.hgetall(self.akey(adapter, ":aliases"))
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
        index = self.akey(adapter, f":kind:{kind}" if kind else ":versions")
        with self.redis_errors("list versions"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.exists(self.akey(adapter))
                pipe.zrangebyscore(index, f"({after}" if after is not None else "-inf", "+inf", start=0,
                                   num=size + 1)
                pipe.hgetall(self.akey(adapter, ":aliases"))
                exists, numbers, aliases = await pipe.execute()
            if not exists:
                raise errors.NotFound(f"adapter: adapter {shown(adapter)} not found", field="adapter")
            async with self.redis.pipeline(transaction=False) as pipe:
                for number in numbers[:size]:
                    pipe.hgetall(self.akey(adapter, f":v:{number}"))
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
        result = await self.script("DELETE_VERSION", adapter, now_ms(), version)
        if result[0] == -1:
            raise errors.NotFound(f"adapter: adapter {shown(adapter)} not found", field="adapter")
        if result[0] == -2:
            raise errors.NotFound(f"version: adapter {shown(adapter)} has no version {version}", field="version")
        if result[0] == -3:
            raise errors.FailedPrecondition(
                f"version: version {version} of {shown(adapter)} is the target of alias {result[1]!r}; move or remove "
                "the alias first", field="version", reason="VERSION_ALIASED")
        await append_audit(self.redis, self.prefix, audit_entry(caller, "DeleteVersion", f"{adapter}@v{version}"))
        await self.collect_freed(result[1:])

    async def set_alias(self, adapter: str, alias: str, version: int, *, caller: Identity = OPEN) -> AdapterRecord:
        validate_name(adapter, "adapter")
        caller.authorize(adapter, "adapter")
        validate_alias(alias)
        result = await self.script("SET_ALIAS", adapter, now_ms(), alias, version)
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
        await self.collect_freed(result[1:])
        return await self.get_adapter(adapter, "adapter")

    async def download(self, adapter: str, version: int, alias: str, offset: int,
                       chunk_size: int, *, caller: Identity = OPEN) -> tuple[VersionRecord, AsyncIterator[bytes]]:
        validate_name(adapter, "ref.name")
        caller.authorize(adapter, "ref.name")
        if chunk_size > self.limits.max_download_chunk_bytes:
            raise errors.InvalidArgument(f"chunk_size: {chunk_size} exceeds the limit "
                                         f"{self.limits.max_download_chunk_bytes}", field="chunk_size")
        record = _stored(await self.get_version(adapter, version, alias))
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
        record = _stored(await self.get_version(adapter, version, alias, caller=caller))
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
        claimed = await self.script("CLAIM_GARBAGE", sha, now_ms(), 120_000, "1" if dry_run else "0")
        if not claimed or dry_run:
            return bool(claimed)
        try:
            await self.blobs.remove(sha)
        finally:
            with contextlib.suppress(errors.LoraplaneError):
                await self.script("RELEASE_GARBAGE", sha)
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
        with self.redis_errors("read blob references"):
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


def _stored(record: VersionRecord) -> VersionRecord:
    """`record`, unless its bytes are still on their way from the trainer that reserved it."""
    if record.pending:
        raise errors.Unavailable(
            f"ref: version {record.version} of {shown(record.adapter)} is still being uploaded by its trainer; retry",
            reason=VERSION_PENDING, field="ref")
    return record


# The stored form of an adapter's LoRA config (its Redis hash's "lora" field): the LoraConfig values as the wire
# carries them, so records written by any registry version read back the same.
_LAYOUT_CODES = {"": 0, PER_EXPERT: 1, SHARED_OUTER: 2}


def _lora_to_stored(lora: LoraSpec, weights_dtype: int) -> dict:
    return {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules), "seed": lora.seed,
            "weights_dtype": weights_dtype, "expert_layout": _LAYOUT_CODES[lora.expert_layout]}


def _lora_from_stored(stored: dict) -> tuple[LoraSpec, int]:
    layouts = {code: name for name, code in _LAYOUT_CODES.items()}
    lora = LoraSpec(rank=int(stored.get("rank", 0)), alpha=float(stored.get("alpha", 0.0)),
                    target_modules=tuple(stored.get("target_modules") or ()), seed=int(stored.get("seed", 0)),
                    expert_layout=layouts.get(int(stored.get("expert_layout", 0)), ""))
    return lora, int(stored.get("weights_dtype", 0))
