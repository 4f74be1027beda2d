"""Adapter -> trainer routing for a trainer fleet (docs/architecture.md, "Trainer fleet").

The client knows one trainer address (any member of the fleet: a seed) and sends an adapter's calls there until told
otherwise, so a lone trainer costs nothing extra. A call answered UNAVAILABLE (ADAPTER_MOVED from a trainer that does
not serve the adapter, or a trainer that is gone) makes the next attempt of the same call, with the same seq_id, ask
a trainer where the adapter lives first (ResolveAdapter, which any member answers for the whole fleet and a lone
trainer with "here"); the answer is kept for the adapter's later calls. Once the fleet has moved the adapter (a
drain at once, a dead trainer after its heartbeat expires) the retry lands on the new trainer, which replayed the
journal and answers it exactly once.

Calls about no adapter in particular (GetInfo: every member serves the same base model; ListAdapters: any member
lists the whole fleet) go to whichever trainer answered last, and on to the next known one when that one is gone
(`call_any`): the seed, every trainer address learnt, and (the gateway) the live members the fleet's heartbeats in
Redis name (`discover`).

The SDK keeps one router per (seed address, identity) in the process, shared by every client object, on the client's
loop; the gateway keeps one of its own over its own channels (`channel`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from loraplane.client._runtime import Endpoint, RetryConfig, call_with_retry, runtime
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

# Answers of ResolveAdapter that mean "ask the seed itself": nothing placed yet (CreateAdapter places it), a trainer
# without the RPC, or a refusal the real call will report in its own words.
_USE_SEED = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
                       grpc.StatusCode.INVALID_ARGUMENT})
_RESOLVE_TIMEOUT_S = 10.0
# A trainer that is gone or going (grpc's own statuses for a refused or reset connection, a server stopping): a call
# about no adapter in particular is asked of another member instead.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class TrainerRouter:
    def __init__(self, seed: str, channel: Callable[[str], grpc.aio.Channel] | None = None, *,
                 discover: Callable[[], Awaitable[list[str]]] | None = None):
        """`channel(address)`: the grpc.aio channel to a trainer (default: the client runtime's). `discover()`: the
        addresses of the fleet's live members from its own records (the gateway reads the heartbeats in Redis),
        asked when no trainer this router knows answers."""
        self.seed = seed
        self._channel = channel or (lambda address: runtime().channel(address))
        self._discover = discover
        self._answered: str | None = None  # the trainer that last answered a call_any
        # Every trainer address learnt from the fleet, seed first: where to ask when the seed itself is down.
        self._known: list[str] = [seed]
        self._where: dict[str, tuple[str, int]] = {}  # adapter -> (address, epoch)
        self._stale: set[str] = set()  # adapters whose last call said UNAVAILABLE: resolve before the next one

    def _bind(self, address: str) -> str:
        # A learnt address calls as the seed's identity (API key, TLS).
        security = getattr(self.seed, "security", None)
        return Endpoint(address, security) if security is not None else address

    def stub(self, address: str) -> trainer_pb2_grpc.TrainerServiceStub:
        return trainer_pb2_grpc.TrainerServiceStub(self._channel(address))

    async def resolve(self, adapter: str) -> str:
        """Where the fleet says the adapter lives now (asking, whatever is cached; the seed if nobody answers)."""
        self.forget(adapter)
        try:
            return await self.address_of(adapter)
        except grpc.RpcError:
            return self.seed

    def known(self) -> list[str]:
        """Every trainer address this router has met (to keep them out of messages meant for tenants)."""
        return [str(a) for a in self._known] + [str(a) for a, _ in self._where.values()]

    def _learn(self, address: str) -> str:
        bound = self._bind(address)
        if all(str(known) != str(bound) for known in self._known):
            self._known.append(bound)
        return next(known for known in self._known if str(known) == str(bound))

    async def _candidates(self, first: str | None = None) -> AsyncIterator[str]:
        """Trainers to ask in turn: `first`, the seed and every one learnt, then the live members `discover` names
        (read only once the others are used up)."""
        tried: set[str] = set()
        discovered = self._discover is None
        while True:
            order = [a for a in (first, *self._known) if a is not None and str(a) not in tried]
            if not order:
                if discovered:
                    return
                discovered = True
                try:
                    for address in await self._discover():
                        self._learn(address)
                except Exception as exc:  # noqa: BLE001 - the fleet's records are a fallback: the call's error counts
                    log.warning("trainer fleet discovery failed: %s", exc)
                continue
            tried.add(str(order[0]))
            yield order[0]

    async def call_any(self, call: Callable[[trainer_pb2_grpc.TrainerServiceStub], Awaitable[T]]) -> T:
        """`call(stub)` on any live trainer of the fleet: the one that answered last, else each known trainer in
        turn, then those `discover` names; only a trainer that is gone (FAILOVER_CODES) passes the call on."""
        last_error: grpc.RpcError | None = None
        async for address in self._candidates(self._answered):
            try:
                result = await call(self.stub(address))
            except grpc.RpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    raise
                last_error = exc
                if self._answered is not None and str(self._answered) == str(address):
                    self._answered = None
                continue
            self._answered = address
            return result
        assert last_error is not None  # the seed is always a candidate
        raise last_error

    async def live_address(self) -> str:
        """The address of a trainer that answers now (any member: for calls every member answers alike)."""
        await self.call_any(lambda stub: stub.GetInfo(trainer_pb2.GetInfoRequest(), timeout=_RESOLVE_TIMEOUT_S))
        return self._answered or self.seed

    def forget(self, adapter: str) -> None:
        self._where.pop(adapter, None)
        self._stale.add(adapter)

    def cached(self, adapter: str) -> str | None:
        found = self._where.get(adapter)
        return found[0] if found else None

    async def address_of(self, adapter: str) -> str:
        """The trainer to send the adapter's next call to: where it was found, else the seed until a call says
        UNAVAILABLE, then wherever the fleet says it is now."""
        found = self._where.get(adapter)
        if found is not None:
            return found[0]
        if adapter not in self._stale:
            return self.seed
        last_error: grpc.RpcError | None = None
        async for candidate in self._candidates():
            stub = self.stub(candidate)
            try:
                reply = await stub.ResolveAdapter(trainer_pb2.ResolveAdapterRequest(name=adapter),
                                                  timeout=_RESOLVE_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() in _USE_SEED:
                    return candidate
                last_error = exc
                continue  # that trainer is down or the adapter is moving: ask another
            address = self._learn(reply.address) if reply.address else candidate
            for learnt in reply.trainer_addresses:
                self._learn(learnt)
            self._where[adapter] = (address, reply.epoch)
            self._stale.discard(adapter)
            return address
        if last_error is not None:
            raise last_error
        return self.seed


class RouterCache:
    """One router per seed address (and its TLS settings) in the process: every client of one fleet shares what
    its router has learnt (placements, replicas, failures)."""

    def __init__(self, factory):
        self.factory = factory
        self.routers: dict[tuple[str, Any], Any] = {}
        self.lock = threading.Lock()

    def __call__(self, seed: str):
        key = (str(seed), getattr(seed, "security", None))
        with self.lock:
            router = self.routers.get(key)
            if router is None:
                router = self.routers[key] = self.factory(seed)
            return router


router_for = RouterCache(TrainerRouter)


async def routed_call(seed: str, adapter: str, method: str, request, retry: RetryConfig) -> Any:
    """Calls TrainerService.`method` for `adapter` on the trainer that serves it, following moves, with the
    client's retry policy (the same request, so the same seq_id, on every attempt)."""
    router = router_for(seed)
    where = {"address": router.cached(adapter) or seed}

    async def attempt(timeout: float | None):
        address = await router.address_of(adapter)
        where["address"] = address
        rpc: Callable[..., Awaitable[T]] = getattr(router.stub(address), method)
        try:
            return await rpc(request, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                router.forget(adapter)  # moved, or its trainer is gone: resolve again before the retry
            raise

    return await call_with_retry(attempt, retry, method=method, address=where["address"])


async def any_trainer_call(seed: str, method: str, request, retry: RetryConfig) -> Any:
    """TrainerService.`method` about no adapter in particular (GetInfo, the fleet-wide ListAdapters) on any live
    trainer of the seed's fleet, with the client's retry policy once none answers."""
    router = router_for(seed)

    async def attempt(timeout: float | None):
        return await router.call_any(lambda stub: getattr(stub, method)(request, timeout=timeout))

    return await call_with_retry(attempt, retry, method=method, address=str(seed))


__all__ = ["FAILOVER_CODES", "RouterCache", "TrainerRouter", "any_trainer_call", "routed_call", "router_for"]
