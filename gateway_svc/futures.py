"""Tinker futures: a request is accepted at once (its id returned), run in the background, and its result (or
failure) written to Redis, where `retrieve_future` on any replica finds it. retrieve_future long-polls: the SDK
re-polls a `try_again` immediately, so the gateway holds the poll until the result is ready or `long_poll_s`
passes. Each running future holds a renewed lease; a future whose owner died (gateway restart, lost replica) is
re-run from its stored spec by whichever replica polls it next, which is safe because the trainer applies a
retried seq_id once and samples are stateless."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway_svc.http_errors import future_failure
from gateway_svc.store import Store

log = logging.getLogger(__name__)

Runner = Callable[[dict[str, Any]], Awaitable[tuple[str, bytes]]]


class _Running:
    """A future running on this replica: its waiters here wake when it ends and take the reply it stored (no
    Redis read back; waiters on other replicas read Redis)."""

    def __init__(self):
        self.done = asyncio.Event()
        self.reply: FutureReply | None = None  # None: it ended without storing an outcome (cancelled, Redis lost)

    def finish(self, reply: FutureReply | None) -> None:
        self.reply = reply
        self.done.set()


@dataclass
class FutureReply:
    state: str  # done | failed | pending
    content_type: str = "application/json"
    body: bytes = b""


class Futures:
    def __init__(self, store: Store, runner: Runner, *, long_poll_s: float = 25.0, lease_s: float = 15.0):
        self.store = store
        self.runner = runner
        self.long_poll_s = long_poll_s
        self.lease_s = lease_s
        self.owner = uuid.uuid4().hex
        self._local: dict[str, _Running] = {}
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, request_id: str, spec: dict[str, Any]) -> str:
        if await self.store.create_future(request_id, spec, self.owner, self.lease_s):
            self._start(request_id, spec)
        return request_id

    def _local_key(self, request_id: str) -> str:
        # Request ids are unique per tenant only as far as the store is concerned: key local waits like the store.
        return self.store.k("future", request_id)

    def _start(self, request_id: str, spec: dict[str, Any]) -> None:
        self._local[self._local_key(request_id)] = _Running()
        task = asyncio.create_task(self._run(request_id, spec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, request_id: str, spec: dict[str, Any]) -> None:
        renew = asyncio.create_task(self._renew(request_id))
        reply = None
        try:
            try:
                content_type, body = await self.runner(spec)
                state = "done"
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - every failure is the caller's answer
                state, content_type = "failed", "application/json"
                body = json.dumps(future_failure(exc)).encode()
            await self.store.finish_future(request_id, state, content_type, body)
            reply = FutureReply(state, content_type, body)
        finally:
            renew.cancel()
            running = self._local.pop(self._local_key(request_id), None)
            if running:
                running.finish(reply)

    async def _renew(self, request_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self.store.renew_lease(request_id, self.owner, self.lease_s)

    async def retrieve(self, request_id: str, wait_s: float | None = None) -> FutureReply | None:
        deadline = time.monotonic() + (self.long_poll_s if wait_s is None else wait_s)
        delay = 0.005
        while True:
            record = await self.store.get_future(request_id)
            if record is None:
                return None
            state = record["state"].decode()
            if state != "pending":
                return FutureReply(state, record.get("content_type", b"application/json").decode(),
                                   record.get("body", b""))
            if self._local_key(request_id) not in self._local and await self.store.take_lease(
                    request_id, self.owner, self.lease_s):
                log.info("taking over future %s (its owner is gone)", request_id)
                self._start(request_id, json.loads(record["spec"]))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return FutureReply("pending")
            running = self._local.get(self._local_key(request_id))
            if running is not None:
                try:
                    await asyncio.wait_for(running.done.wait(), timeout=remaining)
                except TimeoutError:
                    pass
                if running.reply is not None:
                    return running.reply
            else:
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.1)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
