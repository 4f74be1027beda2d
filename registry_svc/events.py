"""The registry's event stream: every change to adapters, versions and aliases, as a Redis Stream that watchers read
from a cursor (`XADD … MAXLEN ~`, never Pub/Sub), so a watcher that reconnects with its last cursor sees every event
once, in order. The events are written by the store's Lua scripts in the same step as the change they describe."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplane import errors
from loraplane.auth import OPEN, Identity
from loraplane.fields import validate_name
from loraplane.redis_pool import async_redis

if TYPE_CHECKING:
    from registry_svc.store import RegistryStore

CURSOR_RE = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}\Z")

EVENT_ADAPTER_CREATED = 1
EVENT_VERSION_PUBLISHED = 2
EVENT_ALIAS_SET = 3
EVENT_VERSION_DELETED = 4
EVENT_ADAPTER_DELETED = 5


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


class EventStream:
    """WatchEvents of one registry (`store`: its Redis and key prefix). Blocking reads get their own connection
    pool, with a timeout longer than the block."""

    def __init__(self, store: RegistryStore, **connection):
        self.store = store
        self.events_key = store.prefix + "events"
        # A short block bounds how long an abandoned read lingers (see `_next_events`); new events still arrive at
        # once.
        self._watch_block_ms = 1000
        self.watch_redis = async_redis(store.redis_url, socket_timeout=self._watch_block_ms / 1000 + 10, **connection)
        self._closing = asyncio.Event()
        self._active_watches = 0
        self._pending_reads: set[asyncio.Future] = set()

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
        await self.watch_redis.aclose()

    async def watch(self, after_cursor: str, adapter: str, prefix: str,
                    start_at_end: bool, *, caller: Identity = OPEN) -> AsyncIterator[EventRecord]:
        if after_cursor and not CURSOR_RE.match(after_cursor):
            raise errors.InvalidArgument(f"after_cursor: {after_cursor[:60]!r} is not a cursor this registry issued",
                                         field="after_cursor")
        if adapter:
            validate_name(adapter, "adapter")
            caller.authorize(adapter, "adapter")
        if len(prefix) > self.store.limits.max_prefix_chars:
            raise errors.InvalidArgument(f"prefix: {len(prefix)} characters, at most {self.store.limits.max_prefix_chars}",
                                         field="prefix")
        last = after_cursor or "0-0"
        if start_at_end and not after_cursor:
            with self.store.redis_errors("read the event stream"):
                newest = await self.store.redis.xrevrange(self.events_key, "+", "-", count=1)
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
        with self.store.redis_errors("read the event stream"):
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
