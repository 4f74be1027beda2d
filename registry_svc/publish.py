"""The registry's publish pipeline: a PublishVersion stream from its header to a committed version.

The header is checked, the caller authorized, an idempotent retry answered from its first version, the tenant's
byte quota checked; the chunks stream into S3 (or, with the digest in a trailer, into memory within a budget) while
they are hashed and their content checked (`blob_check.BlobCheck`, against the adapter's LoRA config); only when
length, digest and content are right does one Lua script commit the version. A failed or cancelled publish leaves no
version and no visible blob. The records, quotas and blobs are the store's (`store.RegistryStore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane import errors
from loraplane.auth import OPEN, ROLE_ADMIN, ROLE_SERVICE, Identity
from loraplane.errors import shown
from loraplane.fields import validate_alias, validate_name
from loraplane.lora import PER_EXPERT
from registry_svc.blob_check import BlobCheck
from registry_svc.records import (
    KIND_TRAINING_STATE,
    KIND_WEIGHTS,
    KINDS,
    AdapterRecord,
    VersionRecord,
    now_ms,
    validate_metadata,
)

if TYPE_CHECKING:
    from registry_svc.store import RegistryStore

log = logging.getLogger(__name__)

SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")
# Chunks larger than this are checked on a worker thread, so a big upload does not stall the event loop.
CHECK_OFF_LOOP_BYTES = 256 * 1024


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
    # Reserve the version now, its bytes to follow (a service only); see PublishPipeline.publish.
    upload_later: bool = False
    # The bytes of this version, reserved before (0 = none).
    reserved_version: int = 0


@dataclass
class PublishTrailer:
    """The last item of a publish stream whose header has no sha256."""

    sha256: str


@dataclass
class PublishResult:
    version: VersionRecord
    deduplicated: bool



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



class PublishPipeline:
    """PublishVersion for one registry (`store`): checks, upload, content check, commit."""

    def __init__(self, store: RegistryStore):
        self.store = store
        self.limits = store.limits
        self._buffered = _ByteBudget(self.limits.max_buffered_publish_bytes)

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
        if header.upload_later or header.reserved_version:
            which = "header.upload_later" if header.upload_later else "header.reserved_version"
            if header.upload_later and header.reserved_version:
                raise errors.InvalidArgument("header.reserved_version: a stream either reserves a version "
                                             "(header.upload_later) or brings a reserved version's bytes, not both",
                                             field="header.reserved_version")
            if not header.sha256:
                raise errors.InvalidArgument(f"header.sha256: required with {which}", field="header.sha256")
            if header.kind != KIND_WEIGHTS:
                raise errors.InvalidArgument(f"header.kind: only WEIGHTS versions are reserved ({which})",
                                             field="header.kind")
        if header.upload_later and not header.idempotency_key:
            raise errors.InvalidArgument(
                "header.idempotency_key: required with header.upload_later, so that a retried reservation returns "
                "the version the first one made", field="header.idempotency_key")
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
        if (header.upload_later or header.reserved_version) and caller.role not in (ROLE_SERVICE, ROLE_ADMIN):
            # A tenant could otherwise announce versions it never uploads, or bytes for one it did not reserve.
            which = "header.upload_later" if header.upload_later else "header.reserved_version"
            raise errors.PermissionDenied(f"{which}: reserving a version and uploading it later needs a service key",
                                          field=which)
        caller.authorize(header.adapter, "header.adapter")
        adapter = await self.store.get_adapter(header.adapter, "header.adapter")
        if header.reserved_version:
            return await self._store_reserved(adapter, await self._reserved(adapter, header), header, items, caller)
        trailer = _Trailer(header.sha256)
        if header.idempotency_key:
            prior = await self._prior_publish(adapter.name, header)
            if prior is not None and prior.pending and not header.upload_later:
                # The bytes of a version reserved under this key: stored now (an ordinary publish may bring them,
                # its digest is checked against the reservation's; any caller allowed to publish to the adapter).
                return await self._store_reserved(adapter, prior, header, items, caller)
            if prior is not None:
                if not header.sha256:
                    # Only the bytes tell whether this is the first publish's content: hash them, store nothing.
                    digest = await self.store.blobs.digest(self._checked_chunks(items, None, trailer),
                                                           header.size_bytes, trailer.expected)
                    self._check_same_content(prior, header.idempotency_key, digest, "trailer.sha256")
                return PublishResult(prior, deduplicated=True)
        await self.store.check_bytes_quota(header.size_bytes, caller)
        token = uuid.uuid4().hex
        if header.upload_later:
            return await self._reserve(header, items, token)
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
                await self.store.blobs.upload(chunks, header.size_bytes, header.sha256, verify)
            else:
                async with self._buffered.hold(header.size_bytes):
                    await self.store.blobs.upload_trailed(chunks, header.size_bytes, trailer.expected, verify, claim)
            sha256 = claimed
            result = await self._commit(header, sha256, token, pending=False)
            committed = True
        finally:
            if claimed and not committed:
                await self._forget(claimed, token)
        return await self._committed(header, sha256, result)

    async def _commit(self, header: PublishHeader, sha256: str, token: str, *, pending: bool) -> list:
        return await self.store.script(
            "PUBLISH", header.adapter, now_ms(), header.idempotency_key, header.kind, sha256, header.size_bytes,
            header.training_step, json.dumps(header.metadata), token, "1" if pending else "0", *header.aliases)

    async def _forget(self, sha256: str, token: str) -> None:
        # Shielded: a cancelled publish must still release its claim so GC can collect the blob.
        with contextlib.suppress(errors.LoraplaneError):
            await asyncio.shield(self.store.script("FORGET_UPLOAD", sha256, token))

    async def _committed(self, header: PublishHeader, sha256: str, result: list) -> PublishResult:
        if result[0] == -1:
            await self.store.collect_freed([sha256])
            raise errors.NotFound(f"header.adapter: adapter {shown(header.adapter)} was deleted during the upload",
                                  field="header.adapter")
        version, deduplicated, freed = int(result[0]), bool(result[1]), result[2:]
        await self.store.collect_freed(freed)
        try:
            record = await self.store.get_version(header.adapter, version=version)
        except errors.NotFound:
            # keep_last=... removed it at once (it can only be an older version deduplicated here).
            record = VersionRecord(header.adapter, version, header.kind, sha256, header.size_bytes,
                                   header.training_step, header.metadata, [], now_ms())
        return PublishResult(record, deduplicated)

    async def _reserve(self, header: PublishHeader, items: AsyncIterator[bytes | PublishTrailer],
                       token: str) -> PublishResult:
        """Commits the version of a header with upload_later, pending, before its bytes; stored at once when a
        stored version already holds that blob (PUBLISH tells from its references: no S3 request). Nothing here
        waits for S3: the reservation is what a trainer's answer waits for."""
        async for _ in items:
            raise errors.InvalidArgument("chunk: a stream that reserves a version (header.upload_later) carries no "
                                         "bytes; send them with header.reserved_version", field="chunk")
        result = await self._commit(header, header.sha256, token, pending=True)
        return await self._committed(header, header.sha256, result)

    async def _reserved(self, adapter: AdapterRecord, header: PublishHeader) -> VersionRecord:
        """The version `header.reserved_version` names, reserved for the header's blob."""
        try:
            record = await self.store.get_version(adapter.name, header.reserved_version)
        except errors.NotFound:
            raise errors.NotFound(f"header.reserved_version: adapter {shown(adapter.name)} has no version "
                                  f"{header.reserved_version}", field="header.reserved_version") from None
        if record.sha256 != header.sha256:
            raise errors.InvalidArgument(
                f"header.sha256: version {record.version} of {shown(adapter.name)} was reserved for sha256 "
                f"{record.sha256}, not {header.sha256}", field="header.sha256")
        return record

    async def _store_reserved(self, adapter: AdapterRecord, record: VersionRecord, header: PublishHeader,
                              items: AsyncIterator[bytes | PublishTrailer], caller: Identity) -> PublishResult:
        """Stores the bytes of the reserved version `record` and marks it stored. Bytes whose content the adapter
        refuses delete the reserved version: it can never become loadable. Bytes that do not hash to its sha256
        leave it pending (a transport fault, not the trainer's content: its retry may bring the right bytes)."""
        trailer = _Trailer(header.sha256)
        if not header.sha256:
            # An ordinary publish with its digest in the trailer: the bytes must hash to the reservation's, and
            # the trailer must say so (checked once it arrives, before anything is committed).
            trailer = _Trailer("")
            header.sha256 = record.sha256
        if record.size_bytes != header.size_bytes:
            raise errors.InvalidArgument(
                f"header.size_bytes: version {record.version} was reserved for {record.size_bytes} bytes, not "
                f"{header.size_bytes}", field="header.size_bytes")
        if not record.pending:
            return PublishResult(record, deduplicated=True)
        token = uuid.uuid4().hex
        await self._register_upload(header.sha256, token, header.size_bytes)
        check = BlobCheck(header.size_bytes, training_state=False)
        refused = False

        def verify() -> None:
            nonlocal refused
            if trailer.allowed and trailer.expected() != record.sha256:
                self._check_same_content(record, header.idempotency_key, trailer.expected(), "trailer.sha256")
            try:
                check.finish()
                self._check_blob_matches(adapter, check)
            except errors.InvalidArgument:
                refused = True
                raise

        try:
            if not await self.store.blobs.exists(header.sha256):
                try:
                    await self.store.blobs.upload(self._checked_chunks(items, check, trailer),
                                                  header.size_bytes, header.sha256, verify)
                except errors.InvalidArgument as exc:
                    if refused:  # the content, not the stream (cut short, too long)
                        try:
                            await self.store.delete_version(adapter.name, record.version, caller=caller)
                        except errors.LoraplaneError as gone:
                            log.warning("reserved version %d of %s refused (%s) but not deleted: %s",
                                        record.version, adapter.name, exc.message, gone.message)
                    raise
            stored = await self.store.script("STORED", adapter.name, record.version, header.sha256)
        finally:
            await self._forget(header.sha256, token)
        if not stored:
            await self.store.collect_freed([header.sha256])  # the version went while its bytes arrived
            which = "header.reserved_version" if header.reserved_version else "header.idempotency_key"
            raise errors.NotFound(f"{which}: adapter {shown(adapter.name)} has no version {record.version} any "
                                  "more (deleted while its bytes arrived)", field=which)
        record.pending = False
        return PublishResult(record, deduplicated=True)

    async def _prior_publish(self, adapter: str, header: PublishHeader) -> VersionRecord | None:
        with self.store.redis_errors("check the idempotency key"):
            prior = await self.store.redis.hget(self.store.akey(adapter, ":idem"), header.idempotency_key)
        if prior is None:
            return None
        try:
            record = await self.store.get_version(adapter, version=int(prior))
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
        expiry = now_ms() + 3600_000 + size // 1000
        for _ in range(200):
            if await self.store.script("REGISTER_UPLOAD", sha256, token, expiry):
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
                f"{list(adapter.lora.target_modules)}", field="chunk")
        layout = adapter.lora.expert_layout or PER_EXPERT  # unspecified is per-expert, as the trainer reads it
        if spec.has_experts and spec.expert_layout != layout:
            raise errors.InvalidArgument(
                f"chunk: tensor {check.shared_factor_key()} is laid out {spec.expert_layout} (the blob's "
                f"adapter_config), adapter {shown(adapter.name)} is {layout} (its lora_config.expert_layout)",
                field="chunk")
        if adapter.base_model and check.base_model and check.base_model != adapter.base_model:
            raise errors.InvalidArgument(
                f"chunk: the blob was trained on base model {shown(check.base_model)}, adapter "
                f"{shown(adapter.name)} is on {shown(adapter.base_model)}", field="chunk")
