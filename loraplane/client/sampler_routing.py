"""Adapter -> sampler replica routing for a sampler fleet (docs/architecture.md, "Sampler fleet").

The client knows one sampler address (a seed: any replica). It asks the fleet for its replicas (ListReplicas, from
the seed or any replica it knows) once before its first call and then every `refresh_s` in the background, and sends
each call to the replica the sampler placement policy ranks first (loraplane/routing.py, BOUNDED_AFFINITY:
consistent hashing on the adapter's name with bounded load, the same policy the fleet preloads by), where the load of a replica is this router's own calls in flight there plus what the others' reported at the last
refresh. A call answered UNAVAILABLE or CANCELLED by the transport (the replica died, is stopping, or cannot be
reached) goes at once to the next replica of the adapter's list, and the replica is left out of every route for
`down_s` (10 s; a restarted replica is back after that): sampling never depends on which replica serves it, since
each serves exactly the version asked for, loading it on demand.

Per call this costs a ring lookup (cached per adapter) and a sum over the replicas: no RPC, no Redis. A sampler that
is not in a fleet, or a key that may not see the replicas (a tenant's), gives a list of one or none: everything then
goes to the seed, as before.

The SDK keeps one router per (seed address, identity) in the process, on the client's loop; the gateway keeps one
over its own channels (`channel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from loraplane.client._runtime import Endpoint, RetryConfig, call_with_retry, runtime
from loraplane.client.routing import RouterCache
from loraplane.routing import BOUNDED_AFFINITY, DEFAULT_BALANCE, Candidate, bounded_affinity
from loraplane.v1 import sampler_pb2, sampler_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

# Statuses of a replica that is gone or going (grpc's own for a refused or reset connection, a server stopping):
# the call did not complete there, and sampling is safe to repeat elsewhere.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
REFRESH_S = 5.0
# Longer than a refresh plus a heartbeat TTL, so a dead replica is normally gone from the list before it is tried again.
DOWN_S = 10.0
_LIST_TIMEOUT_S = 2.0


class SamplerRouter:
    def __init__(self, seed: str, channel: Callable[[str], grpc.aio.Channel] | None = None, *,
                 refresh_s: float = REFRESH_S, down_s: float = DOWN_S, balance: float = DEFAULT_BALANCE):
        """`channel(address)`: the grpc.aio channel to a replica (default: the client runtime's)."""
        self.seed = seed
        self._channel = channel or (lambda address: runtime().channel(address))
        self.refresh_s = refresh_s
        self.down_s = down_s
        self.balance = balance
        self.policy = BOUNDED_AFFINITY if balance == DEFAULT_BALANCE else bounded_affinity(balance)
        self._addresses: dict[str, str] = {}  # replica id -> address (bound to the seed's identity)
        self._others: dict[str, int] = {}  # replica id -> calls in flight there from other clients, last refresh
        self._mine: dict[str, int] = {}  # replica id -> this router's calls in flight there
        self._down: dict[str, float] = {}  # replica id -> until when (monotonic) it is left out
        self._next_refresh = 0.0
        self._refreshing: asyncio.Task | None = None
        self._listed = False  # a replica answered ListReplicas once (perhaps with nothing this key may see)
        self.failovers = 0

    # ---- the replica list
    def _bind(self, address: str) -> str:
        # A learnt address calls as the seed's identity (API key, TLS).
        security = getattr(self.seed, "security", None)
        return Endpoint(address, security) if security is not None else address

    def stub(self, address: str) -> sampler_pb2_grpc.SamplerServiceStub:
        return sampler_pb2_grpc.SamplerServiceStub(self._channel(address))

    @property
    def replicas(self) -> dict[str, str]:
        """replica id -> address, as last listed."""
        return dict(self._addresses)

    async def refresh(self) -> bool:
        """Asks a replica (any known one, the seed last) for the fleet's replicas now. True when one answered."""
        self._start_refresh()
        assert self._refreshing is not None
        return await asyncio.shield(self._refreshing)

    def _start_refresh(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            # The router's own call, never on behalf of the request that triggered it: a gateway request's tenant
            # must not ride along (a tenant may not list the replicas).
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh(), context=contextvars.Context())

    async def _refresh(self) -> bool:
        try:
            candidates = [a for i, a in self._addresses.items() if not self._is_down(i)]
            random.shuffle(candidates)
            for address in [*candidates, self.seed]:
                try:
                    reply = await self.stub(address).ListReplicas(sampler_pb2.ListReplicasRequest(page_size=1000),
                                                                  timeout=_LIST_TIMEOUT_S)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a sampler from before fleets: the seed alone
                        self._set([])
                        self._listed = True
                        return True
                    continue
                self._set(reply.replicas)
                self._listed = True
                return True
            return False
        finally:
            self._next_refresh = time.monotonic() + self.refresh_s

    def _set(self, replicas) -> None:
        addresses = {r.replica_id: self._bind(r.address) for r in replicas if r.replica_id and r.address}
        self._addresses = addresses
        # What the others put there: the reported load less this router's own share of it (as of now).
        self._others = {r.replica_id: max(0, r.in_flight - self._mine.get(r.replica_id, 0)) for r in replicas}
        for replica_id in [i for i in self._down if i not in addresses]:
            del self._down[replica_id]

    async def _ensure_fresh(self) -> None:
        if time.monotonic() < self._next_refresh:
            return
        self._start_refresh()
        if not self._listed:  # the first calls wait for the list (once), so they already go by affinity
            assert self._refreshing is not None
            await asyncio.shield(self._refreshing)

    def _is_down(self, replica_id: str) -> bool:
        until = self._down.get(replica_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._down[replica_id]
            return False
        return True

    def mark_down(self, replica_id: str) -> None:
        self._down[replica_id] = time.monotonic() + self.down_s
        self._next_refresh = 0.0  # and learn the fleet's view soon

    # ---- routing
    async def candidates(self, adapter: str) -> list[tuple[str, str]]:
        """(replica id, address) to try for a call of `adapter`, best first; ("", seed) when no list is known."""
        await self._ensure_fresh()
        if not self._addresses:
            return [("", self.seed)]
        down = {i for i in list(self._down) if self._is_down(i)} if self._down else ()
        order = self.policy.rank(adapter, [
            Candidate(i, self._mine.get(i, 0) + self._others.get(i, 0), down=i in down) for i in self._addresses])
        return [(i, self._addresses[i]) for i in order]

    @contextlib.contextmanager
    def holding(self, replica_id: str):
        """Counts a call in flight on the replica for as long as it runs."""
        self._mine[replica_id] = self._mine.get(replica_id, 0) + 1
        try:
            yield
        finally:
            self._mine[replica_id] -= 1

    def failed(self, replica_id: str, exc: grpc.RpcError) -> bool:
        """After a call on the replica failed with `exc`: True (and the replica is left out for a while) when the
        caller should go to the next replica now."""
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        if code not in FAILOVER_CODES:
            return False
        if replica_id:
            self.mark_down(replica_id)
        self.failovers += 1
        return True

    async def call(self, adapter: str, invoke: Callable[[sampler_pb2_grpc.SamplerServiceStub], Awaitable[T]]) -> T:
        """`invoke(stub)` on the adapter's replica, going on to the next one at once if it is gone."""
        last: grpc.RpcError | None = None
        for replica_id, address in await self.candidates(adapter):
            with self.holding(replica_id):
                try:
                    return await invoke(self.stub(address))
                except grpc.RpcError as exc:
                    if not self.failed(replica_id, exc):
                        raise
                    last = exc
        assert last is not None
        raise last

    async def stream(self, adapter: str, open_call: Callable[[sampler_pb2_grpc.SamplerServiceStub], Any]
                     ) -> AsyncIterator[Any]:
        """The messages of the stream `open_call(stub)` opens on the adapter's replica. A replica that fails before
        the first message is passed over like a unary call's; after it, the error is the caller's (the tokens so far
        were delivered)."""
        last: grpc.RpcError | None = None
        for replica_id, address in await self.candidates(adapter):
            started = False
            with self.holding(replica_id):
                call = open_call(self.stub(address))
                try:
                    async for message in call:
                        started = True
                        yield message
                    return
                except grpc.RpcError as exc:
                    if started or not self.failed(replica_id, exc):
                        raise
                    last = exc
                finally:
                    call.cancel()
        assert last is not None
        raise last


router_for = RouterCache(SamplerRouter)


async def routed_call(seed: str, adapter: str, method: str, request, retry: RetryConfig,
                      router: SamplerRouter | None = None) -> Any:
    """SamplerService.`method` for `adapter` on its replica, failing over between replicas at once and, when every
    replica failed, retrying with the client's backoff policy. `router`: the replica router of the loop the call
    runs on (default: the client I/O loop's, `router_for(seed)`)."""
    router = router or router_for(seed)

    async def attempt(timeout: float | None):
        return await router.call(adapter, lambda stub: getattr(stub, method)(request, timeout=timeout))

    return await call_with_retry(attempt, retry, method=method, address=seed)


__all__ = ["FAILOVER_CODES", "SamplerRouter", "routed_call", "router_for"]
