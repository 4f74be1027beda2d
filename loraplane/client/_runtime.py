"""The client's I/O: one asyncio loop on a daemon thread per process, holding one grpc.aio channel per address.

Every public call converts its inputs in the caller's thread (so bad input fails at once, before a seq_id is spent),
then hands a coroutine to this loop and returns a future. Sharing one loop keeps channels (and their HTTP/2
connections) shared by every client object of the process.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import random
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import grpc

from loraplane.client.errors import APIError, error_from_rpc
from loraplane.rpc import BackgroundLoop, ClientSecurity, aio_channel, channel_options

T = TypeVar("T")

# UNAVAILABLE / DEADLINE_EXCEEDED: the request may or may not have run; the same seq_id makes a retry safe.
# RESOURCE_EXHAUSTED: a full queue rejected it before it was queued; waiting it out beats leaving a seq_id gap.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryConfig:
    """Retries of a failed attempt with exponential backoff and jitter. A sequenced trainer call is retried with
    its original seq_id, so the trainer applies it once however many attempts reach it."""

    # Attempts are bounded by time (total_timeout_s), so a trainer restart that takes a minute is ridden out.
    max_attempts: int = 1000
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    # Give up retrying once this much time has passed since the first attempt.
    total_timeout_s: float = 300.0
    # Deadline of each attempt. A sequenced call may wait on the trainer for its predecessors, so it is generous.
    attempt_timeout_s: float | None = 600.0
    codes: frozenset[grpc.StatusCode] = field(default=_RETRYABLE)


NO_RETRY = RetryConfig(max_attempts=1)


def _client_channel_options() -> list[tuple[str, Any]]:
    return [
        *channel_options(),
        # Reconnect quickly after a dropped connection: the retry loop is the one that waits.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


class Endpoint(str):
    """A service address bound to the identity (API key, TLS) that calls it. It is the address string itself
    (printed, compared and hashed as one), so every client object that is handed its Session's address (training
    and sampling clients, the tokenizer fetch) calls as that Session's identity, and two ServiceClients with
    different keys in one process never borrow each other's key. A plain `str` address calls as the process's
    default identity (LORAPLANE_API_KEY, else the data dir's admin key)."""

    security: ClientSecurity

    def __new__(cls, address: str, security: ClientSecurity) -> Self:
        endpoint = super().__new__(cls, address)
        endpoint.security = security
        return endpoint

    def __reduce__(self):
        # A pickled client (e.g. a SamplingClient sent to a worker process) keeps calling as the same identity.
        return (Endpoint, (str(self), self.security))

    def __repr__(self) -> str:
        return repr(str(self))  # never the key


class ClientRuntime:
    def __init__(self) -> None:
        self._loop = BackgroundLoop("loraplane-client")
        self.pid = os.getpid()
        # One channel per (address, identity): channels are shared by every client object that calls one service
        # as one identity, and never across identities (the key rides on the channel's interceptor).
        self._channels: dict[tuple[str, ClientSecurity | None], grpc.aio.Channel] = {}
        # Channels on callers' own event loops (streams consumed there: no thread hop per message), per loop.
        self._loop_channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict] = weakref.WeakKeyDictionary()
        self._loop_lock = threading.Lock()
        self._default_security: ClientSecurity | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop.loop

    def _security_of(self, address: str) -> ClientSecurity:
        security = getattr(address, "security", None)
        if security is not None:
            return security
        if self._default_security is None:
            from loraplane.client.addresses import client_security

            self._default_security = client_security()
        return self._default_security

    def channel(self, address: str) -> grpc.aio.Channel:
        """Only on the runtime's loop: a grpc.aio channel belongs to the loop that creates it. `address` an
        Endpoint calls as its identity, a plain string as the process default."""
        security = self._security_of(address)
        key = (str(address), security)
        channel = self._channels.get(key)
        if channel is None:
            channel = aio_channel(str(address), security, options=_client_channel_options())
            self._channels[key] = channel
        return channel

    def channel_on(self, address: str, loop: asyncio.AbstractEventLoop) -> grpc.aio.Channel:
        """A channel to `address` bound to `loop` (the caller's running loop, for a stream consumed there), as
        `channel` binds one to the runtime's: same identity, TLS and options, one per (address, identity, loop)."""
        if loop is self.loop:
            return self.channel(address)
        security = self._security_of(address)
        key = (str(address), security)
        with self._loop_lock:
            channels = self._loop_channels.get(loop)
            if channels is None:
                channels = self._loop_channels[loop] = {}
                _quiet_grpc_poller_on(loop)
            channel = channels.get(key)
            if channel is None:
                channel = channels[key] = aio_channel(str(address), security, options=_client_channel_options())
            return channel

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    async def _close_channels(self, addresses: list[str] | None) -> None:
        wanted = None if addresses is None else {str(a) for a in addresses}
        for key in [k for k in self._channels if wanted is None or k[0] in wanted]:
            channel = self._channels.pop(key, None)
            if channel is not None:
                await channel.close()

    def close_channels(self, addresses: list[str] | None = None) -> None:
        if not self.loop.is_closed():
            self.run(self._close_channels(addresses), timeout=10)

    def close(self) -> None:
        self.close_channels()
        # Channels of callers' loops: closed where their loop still runs; the others are only dropped (a closed
        # loop cannot run a close).
        with self._loop_lock:
            loop_channels = list(self._loop_channels.items())
            self._loop_channels.clear()
        for loop, channels in loop_channels:
            if not loop.is_closed() and loop.is_running():
                for channel in channels.values():
                    with contextlib.suppress(Exception):
                        asyncio.run_coroutine_threadsafe(channel.close(), loop)
        self._loop.close()


def _quiet_grpc_poller_on(loop: asyncio.AbstractEventLoop) -> None:
    """`loraplane.rpc.quiet_grpc_poller` for a caller's loop, keeping the caller's own exception handler: with
    grpc.aio on this loop and the runtime's, each completion wakes both and one of them finds nothing to read
    (BlockingIOError), which asyncio would log with a traceback every time."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if isinstance(context.get("exception"), BlockingIOError) and "PollerCompletionQueue" in repr(
                context.get("handle", "")):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def stream_with_retry(open_stream: Callable[[float | None], AsyncIterator[Any]], retry: RetryConfig, *,
                            method: str, address: str, convert: Callable[[Any], T] | None = None
                            ) -> AsyncIterator[T]:
    """The items of the stream `open_stream(timeout)` opens (each passed through `convert` if given). A failure
    before its first item is retried as `call_with_retry` retries a unary call; after it, it ends the stream (what
    was delivered stays delivered). Raises the SDK's APIError subclass for the final status."""
    started = time.monotonic()
    backoff = retry.initial_backoff_s
    attempts = 0
    while True:
        attempts += 1
        delivered = False
        try:
            async for item in open_stream(retry.attempt_timeout_s):
                delivered = True
                yield item if convert is None else convert(item)
            return
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            elapsed = time.monotonic() - started
            if (delivered or code not in retry.codes or attempts >= retry.max_attempts
                    or elapsed >= retry.total_timeout_s):
                raise error_from_rpc(exc, method=method, address=address, attempts=attempts) from None
        await asyncio.sleep(min(backoff, retry.max_backoff_s) * random.uniform(0.8, 1.2))
        backoff *= retry.multiplier


class Handoff:
    """Items made on the runtime's loop for a consumer on another thread or event loop (a stream's messages).

    The consumer takes everything queued so far in one go, and the producer wakes it only when it is waiting:
    one cross-thread wake-up per batch instead of one per item. Under load (messages arriving faster than the
    consumer takes them) they pile up and leave together; an idle consumer still gets each one at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Any] = []
        self._finished = False
        self._error: BaseException | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | threading.Event | None = None

    # ---- producer (the runtime's loop)
    def put(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake(waiter)

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._finished = True
            self._error = error
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake(waiter)

    # ---- consumer
    def _take(self) -> list[Any] | None:
        """Under the lock: what is queued, [] at the end, None when the caller must wait."""
        if self._items:
            items, self._items = self._items, []
            return items
        if self._finished:
            if self._error is not None:
                raise self._error
            return []
        return None

    async def take(self) -> list[Any]:
        """The items queued since the last take (waiting for one if there are none); [] once finished."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                items = self._take()
                if items is not None:
                    return items
                future = loop.create_future()
                self._waiter = (loop, future)
            await future

    def take_blocking(self) -> list[Any]:
        event = threading.Event()
        while True:
            with self._lock:
                items = self._take()
                if items is not None:
                    return items
                event.clear()
                self._waiter = event
            event.wait()


def _wake(waiter) -> None:
    if isinstance(waiter, threading.Event):
        waiter.set()
        return
    loop, future = waiter
    with contextlib.suppress(RuntimeError):  # the consumer's loop is closed: nobody is waiting any more
        loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


_runtime: ClientRuntime | None = None
_runtime_lock = threading.Lock()


def runtime() -> ClientRuntime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            from loraplane.config import Settings
            from loraplane.tracing import setup_tracing

            setup_tracing(Settings(), "client")
        # After a fork the parent's loop thread does not exist in the child: start a fresh one.
        if _runtime is None or _runtime.pid != os.getpid() or _runtime.loop.is_closed():
            _runtime = ClientRuntime()
            atexit.register(_shutdown, _runtime)
        return _runtime


def _shutdown(rt: ClientRuntime) -> None:
    # Closing channels before the interpreter tears down the loop thread avoids grpc's noisy exit-time errors.
    with contextlib.suppress(Exception):
        if rt.pid == os.getpid():
            rt.close()


async def call_with_retry(attempt: Callable[[float | None], Awaitable[T]], retry: RetryConfig, *, method: str,
                          address: str) -> T:
    """Runs `attempt(timeout)` until it succeeds, fails with a non-retryable status, or the retry budget is spent.
    Raises the SDK's APIError subclass for the final status."""
    started = time.monotonic()
    backoff = retry.initial_backoff_s
    attempts = 0
    while True:
        attempts += 1
        try:
            return await attempt(retry.attempt_timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            elapsed = time.monotonic() - started
            if code not in retry.codes or attempts >= retry.max_attempts or elapsed >= retry.total_timeout_s:
                raise error_from_rpc(exc, method=method, address=address, attempts=attempts) from None
        await asyncio.sleep(min(backoff, retry.max_backoff_s) * random.uniform(0.8, 1.2))
        backoff *= retry.multiplier


__all__ = ["NO_RETRY", "APIError", "ClientRuntime", "Endpoint", "Handoff", "RetryConfig", "call_with_retry", "runtime",
           "stream_with_retry"]
