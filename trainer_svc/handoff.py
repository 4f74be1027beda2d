"""The in-memory handoff: while the trainer streams a version to the registry, it pushes the same bytes straight to
the samplers of its own deployment that will load that version (docs/architecture.md, "Which path a version took").

Which samplers: the live replicas of the sampler fleet in this trainer's own Redis under its own key prefix
(loraplane/membership.py: the same deployment, so another deployment's samplers are never found), ranked for the
adapter by the clients' placement policy (loraplane/routing.py, BOUNDED_AFFINITY) and cut to the replicas that preload
its new versions (`preload`, the fleet's LORAPLANE_SAMPLER_FLEET_PRELOAD; 0 = all): exactly where the version would
otherwise be downloaded first. How: a sampler on this host maps one POSIX shared-memory segment the trainer filled
(all such samplers the same one), any other gets the pieces as a gRPC stream; a sampler that cannot open the segment
gets the stream too.

A push is only a head start. Samplers stage the bytes and use them only when the registry commits them as the version
(same sha256), so the registry stays the record: the publish is acknowledged after the registry's commit, as before,
and a push that fails, is cut off or is never committed costs a sampler a download and nothing else. The publish
waits for its pushes at most `ack_wait_s` after the commit; then they finish (or not) on their own. A small blob (up
to `lead_bytes`) is pushed before its upload starts instead of beside it: that takes milliseconds, and a sampler
then holds the bytes before the commit event can reach it, rather than racing its own download of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from functools import cache

from loraplane import errors
from loraplane.membership import Membership
from loraplane.registry_client import StreamedBlob
from loraplane.routing import BOUNDED_AFFINITY, Candidate
from loraplane.rpc import ClientSecurity
from loraplane.sampler_push import SamplerPushClient

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "lp_handoff_"
# Outcomes of one push to one sampler (what `push` returns per address).
SHARED_MEMORY = "shared_memory"
STREAM = "stream"
HELD = "held"  # the sampler had those bytes already
FAILED = "failed"


@cache
def _own_addresses() -> frozenset[str]:
    names = {"localhost", socket.gethostname()}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn())
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return frozenset(names)


def on_this_host(address: str) -> bool:
    """Whether a sampler at `address` (host:port) runs on this host, so it can map this host's shared memory."""
    host = address.rsplit(":", 1)[0].strip("[]")
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return True
    return host in _own_addresses()


class Handoff:
    def __init__(self, membership: Membership, security: ClientSecurity | None = None, *, preload: int = 2,
                 timeout_s: float = 60.0, ack_wait_s: float = 5.0, refresh_s: float = 1.0,
                 shared_memory: bool = True, lead_bytes: int = 16 << 20):
        self.membership = membership
        self.security = security
        self.preload = preload
        self.timeout_s = timeout_s
        self.ack_wait_s = ack_wait_s
        self.refresh_s = refresh_s
        self.shared_memory = shared_memory
        self.lead_bytes = lead_bytes
        self._members: list[tuple[str, str]] = []  # (replica id, address) of the live replicas
        self._read_at = 0.0
        self._clients: dict[str, SamplerPushClient] = {}
        self._background: set[asyncio.Task] = set()
        # Per outcome, pushes since start (a counter per outcome; the trainer's metrics read it).
        self.pushes = {SHARED_MEMORY: 0, STREAM: 0, HELD: 0, FAILED: 0}

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=5.0)
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        await asyncio.to_thread(self.membership.close)

    # ------------------------------------------------------------------ which samplers

    async def targets(self, adapter: str) -> list[str]:
        """Addresses of the live sampler replicas that preload `adapter`'s new versions, best first."""
        if time.monotonic() - self._read_at > self.refresh_s:
            members = await asyncio.to_thread(self.membership.members)
            self._members = [(m.member_id, str(m.report["address"])) for m in members
                             if m.live and m.report.get("address")]
            self._read_at = time.monotonic()
        address = dict(self._members)
        ranked = BOUNDED_AFFINITY.rank(adapter, (Candidate(i) for i in sorted(address)))
        return [address[c] for c in (ranked[:self.preload] if self.preload else ranked)]

    # ------------------------------------------------------------------ pushing

    async def start(self, adapter: str, blob: StreamedBlob) -> asyncio.Task:
        """Starts pushing a made blob (its digest known), to go on beside the registry upload; returns once the
        upload may start (at once, or for a small blob when its push is done); see `settle`."""
        task = asyncio.create_task(self.push(adapter, blob), name=f"handoff {adapter}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        # A push's failures are its own: logged, never the publish's.
        task.add_done_callback(_log_failure)
        if blob.size <= self.lead_bytes:
            try:
                await asyncio.wait({task}, timeout=self.ack_wait_s)
            except asyncio.CancelledError:
                task.cancel()
                raise
        return task

    async def settle(self, task: asyncio.Task, *, committed: bool) -> None:
        """After the registry answered: a push of bytes the registry refused is stopped (its samplers stage
        nothing); one of a committed version is waited for at most `ack_wait_s`, then left to finish alone."""
        if not committed:
            task.cancel()
            return
        await asyncio.wait({task}, timeout=self.ack_wait_s)

    async def push(self, adapter: str, blob: StreamedBlob) -> dict[str, str]:
        """Pushes the blob to every target; returns each target's outcome. Never raises for a sampler's failure."""
        if not blob.sha256:
            raise errors.FailedPrecondition("a blob is pushed once made (its digest known)")
        try:
            addresses = await self.targets(adapter)
        except errors.Unavailable as exc:
            log.warning("handoff of %s skipped: %s", adapter, exc.message)
            return {}
        if not addresses:
            return {}
        local = [a for a in addresses if self.shared_memory and on_this_host(a)]
        outcomes: dict[str, str] = {}
        segment = None
        try:
            if local:
                filling = asyncio.ensure_future(asyncio.to_thread(_filled_segment, blob))
                try:
                    segment = await asyncio.shield(filling)
                except asyncio.CancelledError:
                    # The thread goes on filling: its segment is unlinked when it is done.
                    filling.add_done_callback(lambda f: f.cancelled() or f.exception() or _unlink(f.result()))
                    raise
                except OSError as exc:  # /dev/shm full or absent: these samplers get the stream too
                    log.warning("handoff of %s through shared memory impossible (%s); streaming it", adapter, exc)
            await asyncio.gather(*(self._push_one(adapter, blob, a, segment.name if segment and a in local else "",
                                                  outcomes) for a in addresses))
        finally:
            if segment is not None:
                _unlink(segment)
        for outcome in outcomes.values():
            self.pushes[outcome] += 1
        log.info("handoff of %s (%s, %d bytes): %s", adapter, blob.sha256[:12], blob.size, outcomes)
        return outcomes

    async def _push_one(self, adapter: str, blob: StreamedBlob, address: str, segment: str,
                        outcomes: dict[str, str]) -> None:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = SamplerPushClient(address, self.security, timeout=self.timeout_s)
        try:
            if segment:
                try:
                    staged = await client.push(adapter, blob.sha256, blob.size, shared_memory_name=segment)
                    outcomes[address] = SHARED_MEMORY if staged else HELD
                    return
                except errors.FailedPrecondition:
                    pass  # not this host's shared memory after all: stream it
            staged = await client.push(adapter, blob.sha256, blob.size, pieces=_pieces(blob))
            outcomes[address] = STREAM if staged else HELD
        except errors.LoraplaneError as exc:
            outcomes[address] = FAILED
            log.warning("handoff of %s to a sampler failed (it will download the version): %s", adapter,
                        exc.message)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("handoff failed (its samplers download the version instead)", exc_info=task.exception())


def _filled_segment(blob: StreamedBlob):
    """A new shared-memory segment holding the blob (blocking: run off the loop). The caller unlinks it."""
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(name=SEGMENT_PREFIX + secrets.token_hex(16), create=True, size=blob.size)
    try:
        # Its pages allocated at once rather than one fault per page as the copy first touches them.
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fallocate(segment._fd, 0, blob.size)
        offset, index = 0, 0
        while (piece := blob.piece(index)) is not None:
            segment.buf[offset:offset + len(piece)] = piece
            offset += len(piece)
            index += 1
    except BaseException:
        _unlink(segment)
        raise
    return segment


def _unlink(segment) -> None:
    segment.close()
    segment.unlink()


async def _pieces(blob: StreamedBlob) -> AsyncIterator[bytes]:
    index = 0
    while (piece := blob.made(index)) is not None:
        yield piece
        index += 1
