"""Versions acknowledged before their upload ended: their bytes on this trainer's disk until the registry stores them.

With `publish_ack = "pushed"` (loraplane/config.py) a trainer that pushes a version to its samplers answers
PublishWeights once the registry has reserved the version (`RegistryClient.reserve`: committed, `pending`, its event
sent) and the samplers hold the bytes; the S3 upload goes on beside. What keeps that acknowledged version from being
lost if the trainer (or its host) dies before the upload lands is this spool: the blob and a small record of the
publish are written and fsynced here before the answer (the blob first, the record last, so a record always has its
whole blob), the version number added to the record once reserved, both removed once the registry has the bytes. A
restarted trainer (`recover`) uploads each recorded version in the background: to the recorded version (a version
deleted meanwhile stays deleted), or, when the record has none yet (the trainer died before the reservation's answer
was written), reserving it again first (idempotent: the same version comes back). docs/architecture.md, "Which path
a version took".
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
    # The reserved version, once known (0 = not recorded yet: recovery reserves again under the idempotency key).
    version: int = 0

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
        # The recovery of a restart's spool (it uploads the versions one at a time, each blob in memory) and how
        # many of them it has still to finish.
        self._recovery: asyncio.Task | None = None
        self._recovering = 0

    @property
    def pending(self) -> int:
        """Versions acknowledged whose bytes the registry does not hold yet (this process's, and those recovered)."""
        return len(self._uploads) + self._recovering

    # ------------------------------------------------------------------ before the answer

    def write(self, entry: SpooledPublish, blob: StreamedBlob) -> None:
        """Writes the made blob, then its record, each fsynced (call off the event loop): once this returns, the
        version survives a power loss of this host, not only the death of this process."""
        self.directory.mkdir(parents=True, exist_ok=True)
        data, _ = self._paths(entry)
        with open(_part(data), "wb") as out:
            index = 0
            while (piece := blob.made(index)) is not None:
                out.write(piece)
                index += 1
            out.flush()
            os.fsync(out.fileno())
        os.replace(_part(data), data)
        self._write_record(entry)

    def _write_record(self, entry: SpooledPublish) -> None:
        _, record = self._paths(entry)
        with open(_part(record), "w") as out:
            out.write(json.dumps(asdict(entry)))
            out.flush()
            os.fsync(out.fileno())
        os.replace(_part(record), record)
        # The renames themselves are durable only once the directory is.
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

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
        if entry.version != version:
            entry.version = version
            # Recorded so that a recovery uploads to this version and never reserves a new one for bytes whose
            # version was deleted meanwhile. Best effort: without it recovery reserves under the idempotency key.
            try:
                await asyncio.to_thread(self._write_record, entry)
            except OSError as exc:
                log.warning("spooled %s v%d: its version not recorded (%s)", entry.adapter, version, exc)
        backoff = 0.2
        while True:
            try:
                await self.registry.publish(entry.adapter, blob, reserved_version=version,
                                            training_step=entry.training_step)
                log.info("%s v%d stored in the registry (acknowledged before its upload)", entry.adapter, version)
                break
            except errors.NotFound:
                log.info("%s v%d was deleted before its upload landed; its bytes are dropped", entry.adapter, version)
                break
            except (errors.Unavailable, errors.DeadlineExceeded, errors.Aborted, errors.DataLoss) as exc:
                # DataLoss: the bytes arrived damaged (the registry keeps the version pending); send them again.
                log.warning("upload of %s v%d: %s; retrying in %.1f s", entry.adapter, version, exc.message, backoff)
            except errors.LoraplaneError as exc:
                # Refused for good (the registry deleted the version if it refused the content): retrying cannot help.
                log.error("upload of %s v%d refused: %s", entry.adapter, version, exc.message)
                break
            backoff = await self._pause(backoff)
        await asyncio.to_thread(self.discard, entry)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Waits for the uploads in flight (at most `timeout_s`); what is left stays spooled for `recover`."""
        running = self._running()
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        for task in self._running():
            task.cancel()
        if self._running():
            await asyncio.wait(self._running(), timeout=5.0)

    def _running(self) -> set[asyncio.Task]:
        tasks = set(self._uploads)
        if self._recovery is not None and not self._recovery.done():
            tasks.add(self._recovery)
        return tasks

    # ------------------------------------------------------------------ after a restart

    async def recover(self) -> list[tuple[str, int]]:
        """Starts uploading every spooled version in the background, one at a time; returns (adapter, version) of
        each (version 0: not recorded, reserved again under its idempotency key first). Leftovers of publishes
        never acknowledged (a blob without its record) are removed."""
        if not self.directory.is_dir():
            return []
        for part in self.directory.glob("*.part"):
            part.unlink(missing_ok=True)
        entries: list[SpooledPublish] = []
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
            entries.append(entry)
        for data in self.directory.glob("*.blob"):
            if not data.with_suffix(".json").exists():
                data.unlink(missing_ok=True)
        if entries:
            self._recovering = len(entries)
            self._recovery = asyncio.create_task(self._recover(entries), name="upload spooled versions")
        return [(entry.adapter, entry.version) for entry in entries]

    async def _recover(self, entries: list[SpooledPublish]) -> None:
        try:
            for entry in entries:
                try:
                    version = entry.version or await self._reserve_again(entry)
                    if version:
                        data, _ = self._paths(entry)
                        blob = StreamedBlob(entry.size_bytes, _pieces(data))
                        await asyncio.to_thread(blob.make)
                        if blob.sha256 != entry.sha256:
                            log.error("spooled blob %s does not hash to %s; left in place", data, entry.sha256)
                            continue
                        await self._upload(entry, version, blob)
                except (OSError, ValueError, errors.LoraplaneError) as exc:
                    log.error("spooled %s: %s; left in place for the next start", entry.adapter, exc)
                finally:
                    self._recovering -= 1
        finally:
            self._recovering = 0

    async def _reserve_again(self, entry: SpooledPublish) -> int:
        """The version reserved for `entry` (the same one the first reservation made, if it still exists), 0 when
        its adapter is gone (then the spooled files are removed)."""
        backoff = 0.2
        while True:
            try:
                reserved = await self.registry.reserve(
                    entry.adapter, entry.sha256, entry.size_bytes, idempotency_key=entry.idempotency_key,
                    training_step=entry.training_step, metadata=entry.metadata, aliases=entry.aliases)
                return reserved.version
            except errors.NotFound:
                log.info("spooled %s: its adapter is gone; dropped", entry.adapter)
                await asyncio.to_thread(self.discard, entry)
                return 0
            except (errors.Unavailable, errors.DeadlineExceeded, errors.Aborted) as exc:
                log.warning("reserving spooled %s again: %s; retrying in %.1f s", entry.adapter, exc.message, backoff)
            backoff = await self._pause(backoff)

    async def _pause(self, backoff: float) -> float:
        """Sleeps about `backoff` seconds (jittered, so restarted trainers do not retry in step); the next one."""
        await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
        return min(backoff * 2, self.max_backoff_s)

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
    else:
        log.info("%s v%d (%s, %d bytes) acknowledged before upload: pushed, reserved and spooled; the upload goes on "
                 "beside", adapter, version.version, blob.sha256[:12], blob.size)
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
