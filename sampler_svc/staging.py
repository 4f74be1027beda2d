"""Blobs a trainer pushed to this sampler ahead of the registry's commit (docs/architecture.md, "Which path a version
took"), held until the adapter manager claims them for a committed version or they expire.

A pushed blob is only a candidate: it is keyed by (adapter, sha256), verified against that sha256 when it arrives,
and becomes version N only when the registry says version N has that digest (its commit event, or GetVersion for an
on-demand load). So a version is served from pushed bytes only if the registry committed exactly those bytes under
it, and a push the registry never commits (a trainer killed mid-publish, a refused blob) is simply dropped: after
`ttl_s`, or sooner when newer pushes need the room under `max_bytes`.

All state is touched on the asyncio loop only (like the adapter manager's).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
import time
from dataclasses import dataclass, field

from loraplane import errors

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 120.0
DEFAULT_MAX_BYTES = 8 << 30
# How long a load waits for a push that is still arriving before it downloads from the registry instead.
DEFAULT_CLAIM_WAIT_S = 30.0
# The segments a pusher makes (trainer_svc/handoff.py): a sampler opens no other, so a push can never make it read
# some other process's shared memory (an engine's tensor segments, say).
SHARED_MEMORY_NAME = re.compile(r"^lp_handoff_[0-9a-f]{16,64}\Z")


def read_shared_memory(name: str, size: int):
    """(the first `size` bytes of the pusher's segment `name`, copied out (the pusher unlinks it once answered); a
    sha256 fed those bytes). The digest is computed on a second thread while this one copies (hashlib lets go of
    the GIL): half the time of copying, then hashing. Blocking: call off the loop. FAILED_PRECONDITION when there is
    no such segment here (the pusher is on another host after all: it streams the bytes instead)."""
    from multiprocessing import resource_tracker, shared_memory

    if not SHARED_MEMORY_NAME.match(name):
        raise errors.InvalidArgument(f"header.shared_memory_name {errors.shown(name)} is not a handoff segment "
                                     "(lp_handoff_<hex>)", field="header.shared_memory_name")
    try:
        segment = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        raise errors.FailedPrecondition(f"header.shared_memory_name: no segment {name} on this sampler's host; send "
                                        "the bytes as chunks", field="header.shared_memory_name") from None
    try:
        # Attaching registers the segment with this process's resource tracker (before Python 3.13), which would
        # unlink the pusher's segment when this process exits: the pusher owns it.
        resource_tracker.unregister(segment._name, "shared_memory")
        if segment.size < size:
            raise errors.InvalidArgument(f"shared-memory segment {name} holds {segment.size} bytes, header.size_bytes "
                                         f"says {size}", field="header.size_bytes")
        hasher = hashlib.sha256()
        with segment.buf[:size] as view:
            hashing = threading.Thread(target=hasher.update, args=(view,), name="push-sha256")
            hashing.start()
            try:
                blob = bytes(view)
            finally:
                hashing.join()
        return blob, hasher
    finally:
        segment.close()


@dataclass
class _Incoming:
    adapter: str
    sha256: str
    size: int
    # Resolved with the blob once verified, or None when the push failed.
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class _Staged:
    blob: bytes
    staged_at: float


class Staging:
    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 claim_wait_s: float = DEFAULT_CLAIM_WAIT_S):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.claim_wait_s = claim_wait_s
        self._staged: dict[tuple[str, str], _Staged] = {}
        self._incoming: dict[tuple[str, str], _Incoming] = {}
        self.dropped = 0  # staged blobs dropped unclaimed (expired, evicted for room, adapter deleted): a counter

    # ------------------------------------------------------------------ what is held

    @property
    def held_bytes(self) -> int:
        """Bytes staged plus bytes reserved by pushes still arriving."""
        return sum(len(s.blob) for s in self._staged.values()) + sum(i.size for i in self._incoming.values())

    def keys(self) -> list[tuple[str, str]]:
        """(adapter, sha256) of every staged blob (not those still arriving)."""
        return sorted(self._staged)

    def holds(self, adapter: str) -> bool:
        """Whether anything of `adapter` is staged or arriving (so an on-demand load should ask the registry which
        digest the version has before downloading it)."""
        return any(a == adapter for a, _ in self._staged) or any(a == adapter for a, _ in self._incoming)

    def has(self, adapter: str, sha256: str) -> bool:
        return (adapter, sha256) in self._staged or (adapter, sha256) in self._incoming

    # ------------------------------------------------------------------ a push

    def begin(self, adapter: str, sha256: str, size: int) -> _Incoming:
        """Reserves room for a push about to arrive. Older staged blobs make way (oldest first) when the budget is
        short; a push that cannot fit even then is RESOURCE_EXHAUSTED (the sampler downloads it later instead)."""
        self.sweep()
        key = (adapter, sha256)
        if key in self._incoming:
            raise errors.AlreadyExists(f"a push of this blob of {adapter!r} is already arriving", field="header.sha256")
        if size > self.max_bytes:
            raise errors.ResourceExhausted(f"header.size_bytes {size} exceeds this sampler's staging budget "
                                           f"({self.max_bytes} bytes)", field="header.size_bytes")
        while self.held_bytes + size > self.max_bytes and self._staged:
            oldest = min(self._staged, key=lambda k: self._staged[k].staged_at)
            log.info("dropping staged %s@%s for room", oldest[0], oldest[1][:12])
            self._drop(oldest)
        if self.held_bytes + size > self.max_bytes:
            raise errors.ResourceExhausted("this sampler's staging budget is taken by pushes still arriving; retry "
                                           "later", field="header.size_bytes")
        incoming = _Incoming(adapter, sha256, size)
        # Nobody may await it (no load wanted it yet): its outcome must not be reported as never retrieved.
        incoming.done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._incoming[key] = incoming
        return incoming

    async def finish(self, incoming: _Incoming, blob: bytes, hasher=None) -> None:
        """Stages the arrived blob once its size and sha256 match the header (DATA_LOSS otherwise: nothing staged).
        `hasher`: a sha256 already fed the bytes as they arrived; else they are hashed here, off the loop."""
        try:
            if len(blob) != incoming.size:
                raise errors.InvalidArgument(f"the push carried {len(blob)} bytes, header.size_bytes says "
                                             f"{incoming.size}", field="header.size_bytes")
            digest = (hasher.hexdigest() if hasher is not None
                      else (await asyncio.to_thread(hashlib.sha256, blob)).hexdigest())
            if digest != incoming.sha256:
                raise errors.DataLoss(f"the pushed bytes hash to {digest}, header.sha256 says {incoming.sha256}",
                                      field="header.sha256")
        except BaseException:
            self.abort(incoming)
            raise
        key = (incoming.adapter, incoming.sha256)
        if self._incoming.get(key) is incoming:
            del self._incoming[key]
            self._staged[key] = _Staged(blob, time.monotonic())
            if not incoming.done.done():
                incoming.done.set_result(blob)

    def abort(self, incoming: _Incoming) -> None:
        """A push that ended without a verified blob (cancelled, cut off, wrong bytes): its room is freed."""
        key = (incoming.adapter, incoming.sha256)
        if self._incoming.get(key) is incoming:
            del self._incoming[key]
        if not incoming.done.done():
            incoming.done.set_result(None)

    # ------------------------------------------------------------------ claims

    async def claim(self, adapter: str, sha256: str) -> bytes | None:
        """The staged blob of `adapter` with this digest, taken out of staging, or None. A push of it still
        arriving is waited for (at most `claim_wait_s`): the bytes are on their way already, and sooner here than
        from the registry."""
        key = (adapter, sha256)
        incoming = self._incoming.get(key)
        if incoming is not None:
            done, _ = await asyncio.wait({incoming.done}, timeout=self.claim_wait_s)
            if not done:
                log.info("push of %s@%s still arriving after %.0fs; downloading instead", adapter, sha256[:12],
                         self.claim_wait_s)
                return None
        staged = self._staged.pop(key, None)
        return staged.blob if staged is not None else None

    def forget(self, adapter: str) -> None:
        """Drops everything staged for an adapter (it was deleted)."""
        for key in [k for k in self._staged if k[0] == adapter]:
            self._drop(key)

    def sweep(self) -> None:
        """Drops staged blobs older than `ttl_s`: pushes whose version was never committed, or is not wanted here."""
        limit = time.monotonic() - self.ttl_s
        for key in [k for k, s in self._staged.items() if s.staged_at < limit]:
            log.info("dropping staged %s@%s: not committed or claimed within %.0fs", key[0], key[1][:12], self.ttl_s)
            self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        if self._staged.pop(key, None) is not None:
            self.dropped += 1
