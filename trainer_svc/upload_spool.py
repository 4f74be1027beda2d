"""Versions acknowledged before their upload ended: their bytes on this trainer's disk until the registry stores them.

With `publish_ack = "pushed"` (loraplane/config.py) a trainer that pushes a version to its samplers answers
PublishWeights once the registry has reserved the version (`RegistryClient.reserve`: committed, `pending`, its event
sent) and the samplers hold the bytes; the S3 upload goes on beside. What keeps that acknowledged version from being
lost if the trainer dies before the upload lands is this spool: the blob and a small record of the publish are
written here before the answer (the blob first, the record last, so a record always has its whole blob), removed once
the registry has the bytes, and a restarted trainer (`recover`) reserves each recorded version again (idempotent: the
same version comes back) and uploads it. docs/architecture.md, "Which path a version took".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loraplane import errors
from loraplane.registry_client import CHUNK_BYTES, AdapterVersion, RegistryClient, StreamedBlob

if TYPE_CHECKING:
    from trainer_svc.handoff import Handoff

log = logging.getLogger(__name__)


@dataclass
class SpooledPublish:
    """What a publish said, enough to reserve its version again and upload it."""

    adapter: str
    sha256: str
    size_bytes: int
    idempotency_key: str
    training_step: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)

    @property
    def stem(self) -> str:
        # The idempotency key names the publish (several versions may share one blob); hashed, it is a safe name.
        return f"{self.sha256}-{hashlib.sha256(self.idempotency_key.encode()).hexdigest()[:16]}"


class UploadSpool:
    def __init__(self, directory: Path, registry: RegistryClient, *, max_backoff_s: float = 30.0):
        self.directory = directory
        self.registry = registry
        self.max_backoff_s = max_backoff_s
        self._uploads: set[asyncio.Task] = set()

    @property
    def pending(self) -> int:
        """Versions acknowledged whose bytes the registry does not hold yet (this process's)."""
        return len(self._uploads)

    # ------------------------------------------------------------------ before the answer

    def write(self, entry: SpooledPublish, blob: StreamedBlob) -> None:
        """Writes the made blob, then its record (call off the event loop). Written to the page cache, not synced:
        a dead process loses nothing, a host that loses power before the upload lands can (then fsynced beside the
        upload, see `upload`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        data, record = self._paths(entry)
        with open(_part(data), "wb") as out:
            index = 0
            while (piece := blob.made(index)) is not None:
                out.write(piece)
                index += 1
        os.replace(_part(data), data)
        _part(record).write_text(json.dumps(asdict(entry)))
        os.replace(_part(record), record)

    def discard(self, entry: SpooledPublish) -> None:
        for path in self._paths(entry):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # ------------------------------------------------------------------ beside and after the answer

    def upload(self, entry: SpooledPublish, version: int, blob: StreamedBlob) -> asyncio.Task:
        """Sends the reserved version's bytes in the background until the registry holds them (retrying while it
        or S3 is unavailable), then removes them from the spool."""
        task = asyncio.create_task(self._upload(entry, version, blob), name=f"upload {entry.adapter} v{version}")
        self._uploads.add(task)
        task.add_done_callback(self._uploads.discard)
        return task

    async def _upload(self, entry: SpooledPublish, version: int, blob: StreamedBlob) -> None:
        await asyncio.to_thread(self._sync, entry)
        backoff = 0.2
        while True:
            try:
                await self.registry.publish(entry.adapter, blob, reserved_version=version,
                                            training_step=entry.training_step)
                break
            except errors.NotFound:
                log.info("%s v%d was deleted before its upload landed; its bytes are dropped", entry.adapter, version)
                break
            except (errors.Unavailable, errors.DeadlineExceeded, errors.Aborted) as exc:
                log.warning("upload of %s v%d: %s; retrying in %.1f s", entry.adapter, version, exc.message, backoff)
            except errors.LoraplaneError as exc:
                # Refused for good (the registry deleted the version if it refused the content): retrying cannot help.
                log.error("upload of %s v%d refused: %s", entry.adapter, version, exc.message)
                break
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.max_backoff_s)
        await asyncio.to_thread(self.discard, entry)

    def _sync(self, entry: SpooledPublish) -> None:
        for path in self._paths(entry):
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as handle:
                os.fsync(handle.fileno())

    async def close(self, timeout_s: float = 30.0) -> None:
        """Waits for the uploads in flight (at most `timeout_s`); what is left stays spooled for `recover`."""
        if self._uploads:
            await asyncio.wait(set(self._uploads), timeout=timeout_s)
        for task in list(self._uploads):
            task.cancel()
        if self._uploads:
            await asyncio.wait(set(self._uploads), timeout=5.0)

    # ------------------------------------------------------------------ after a restart

    async def recover(self) -> list[tuple[str, int]]:
        """Starts the upload of every spooled version (reserving it again first: the same version comes back);
        returns (adapter, version) of each. Leftovers of publishes never acknowledged (a blob without its record)
        are removed."""
        if not self.directory.is_dir():
            return []
        started: list[tuple[str, int]] = []
        for record in sorted(self.directory.glob("*.json")):
            try:
                entry = SpooledPublish(**json.loads(record.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.error("unreadable spooled publish %s (%s); left in place", record, exc)
                continue
            data, _ = self._paths(entry)
            if not data.is_file() or data.stat().st_size != entry.size_bytes:
                log.error("spooled publish %s has no whole blob; left in place", record)
                continue
            try:
                reserved = await self.registry.reserve(
                    entry.adapter, entry.sha256, entry.size_bytes, idempotency_key=entry.idempotency_key,
                    training_step=entry.training_step, metadata=entry.metadata, aliases=entry.aliases)
            except errors.NotFound:
                log.info("spooled %s: its adapter is gone; dropped", entry.adapter)
                self.discard(entry)
                continue
            blob = StreamedBlob(entry.size_bytes, _pieces(data))
            await asyncio.to_thread(blob.make)
            if blob.sha256 != entry.sha256:
                log.error("spooled blob %s does not hash to %s; left in place", data, entry.sha256)
                continue
            self.upload(entry, reserved.version, blob)
            started.append((entry.adapter, reserved.version))
        for part in self.directory.glob("*.part"):
            part.unlink(missing_ok=True)
        for data in self.directory.glob("*.blob"):
            if not data.with_suffix(".json").exists():
                data.unlink(missing_ok=True)
        return started

    def _paths(self, entry: SpooledPublish) -> tuple[Path, Path]:
        return self.directory / f"{entry.stem}.blob", self.directory / f"{entry.stem}.json"


async def publish_before_upload(registry: RegistryClient, handoff: Handoff, spool: UploadSpool, adapter: str,
                                blob: StreamedBlob, *, idempotency_key: str, step: int = 0,
                                metadata: Mapping[str, str] | None = None, aliases: Sequence[str] = (),
                                reserved: Callable[[AdapterVersion], Awaitable[None]] | None = None
                                ) -> tuple[AdapterVersion, asyncio.Task | None]:
    """A made blob published as a pushed PublishWeights is answered (`publish_ack = "pushed"`): written to `spool`
    and pushed to the samplers while the registry reserves its version (committed, pending, its event sent); then
    `reserved(version)` (the trainer's journal record), the pushes waited for (at most the handoff's ack_wait_s),
    and the upload started beside. Returns the version and the upload's task (None when the registry needs no
    bytes: it had them). Samplers load the pushed bytes on the event exactly as after an upload; anyone else
    downloading the version waits for the upload."""
    entry = spooled(adapter, blob, idempotency_key, step, metadata or {}, aliases)
    writing = asyncio.ensure_future(asyncio.to_thread(spool.write, entry, blob))
    push = await handoff.start(adapter, blob)
    try:
        # The reservation's event must find the bytes staged: a sampler that hears of the version before its push
        # is announced downloads it instead (and waits for the upload).
        await asyncio.wait({push}, timeout=handoff.ack_wait_s)
        await writing
        version = await registry.reserve(adapter, blob.sha256, blob.size, idempotency_key=idempotency_key,
                                         training_step=step, metadata=dict(metadata or {}), aliases=list(aliases))
    except BaseException:
        await handoff.settle(push, committed=False)
        with contextlib.suppress(BaseException):
            await writing
        await asyncio.to_thread(spool.discard, entry)
        raise
    if reserved is not None:
        await reserved(version)
    upload = spool.upload(entry, version.version, blob) if version.pending else None
    if upload is None:
        await asyncio.to_thread(spool.discard, entry)
    await handoff.settle(push, committed=True)
    return version, upload


def _part(path: Path) -> Path:
    return path.with_name(path.name + ".part")


def _pieces(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as source:
        while piece := source.read(CHUNK_BYTES):
            yield piece


def spooled(adapter: str, blob: StreamedBlob, idempotency_key: str, step: int, metadata: Mapping[str, str],
            aliases: Sequence[str]) -> SpooledPublish:
    return SpooledPublish(adapter=adapter, sha256=blob.sha256, size_bytes=blob.size, idempotency_key=idempotency_key,
                          training_step=step, metadata=dict(metadata), aliases=list(aliases))
