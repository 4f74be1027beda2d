"""A sampler as one replica of a fleet: several samplers serving one base model, any of them able to serve any adapter
version (each follows the registry and loads on demand), clients choosing among them by adapter affinity with
bounded load (loraplane/routing.py, BOUNDED_AFFINITY: the policy this replica also preloads by).

The replica heartbeats its load (requests in flight, loaded versions) into Redis (loraplane/membership.py) every
TTL/3 and keeps the fleet's live members from the same round trip, so ListReplicas answers from memory: clients
refresh their replica list from any replica, never from Redis. There is no placement to hand over: a replica that
dies is simply left out by the clients (at once, on the first failed call) and by the list (when its heartbeat
expires, or at once on a clean stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from loraplane.membership import Membership
from loraplane.routing import BOUNDED_AFFINITY, Candidate

log = logging.getLogger(__name__)
# The report carries the names of at most this many loaded versions (for operators; clients get counts only).
MAX_REPORTED_VERSIONS = 256


@dataclass(frozen=True)
class Replica:
    replica_id: str
    address: str
    in_flight: int = 0
    loaded_versions: int = 0
    heartbeat_at: float = 0.0


class SamplerFleetMember:
    def __init__(self, service, membership: Membership, replica_id: str, *, ttl_s: float = 3.0, preload: int = 2):
        """`preload`: how many replicas of an adapter's routing order load its new versions ahead of requests
        (0 = all)."""
        self.service = service
        self.preload = preload
        self.membership = membership
        self.fleet = membership.fleet
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.interval_s = max(0.05, ttl_s / 3)
        self.address = ""
        self._started_at = time.time()
        self._live: list[Replica] = []
        self._task: asyncio.Task | None = None

    def report(self) -> dict:
        loaded = [e.key for e in self.service.manager.list_loaded()]
        return {"replica_id": self.replica_id, "address": self.address, "in_flight": self.service.in_flight,
                "loaded_versions": len(loaded), "loaded": loaded[:MAX_REPORTED_VERSIONS],
                "started_at": self._started_at}

    def me(self) -> Replica:
        return Replica(self.replica_id, self.address, self.service.in_flight,
                       len(self.service.manager.list_loaded()), time.time())

    def replicas(self) -> list[Replica]:
        """The live replicas as of the last heartbeat round, this one always among them (with its load now)."""
        others = [r for r in self._live if r.replica_id != self.replica_id]
        return sorted([self.me(), *others], key=lambda r: r.replica_id)

    async def tick(self) -> None:
        await asyncio.to_thread(self.membership.heartbeat, self.replica_id, self.report(), self.ttl_s)
        members = await asyncio.to_thread(self.membership.members)
        self._live = [Replica(m.member_id, str(m.report.get("address", "")), int(m.report.get("in_flight", 0)),
                              int(m.report.get("loaded_versions", 0)), float(m.report.get("heartbeat_at", 0.0)))
                      for m in members if m.live and m.report.get("address")]

    def preloads(self, adapter: str) -> bool:
        """Whether this replica is among the first `preload` the clients' placement policy ranks for the adapter
        over the live replicas at no load: where its requests go while load allows, so where its new versions should
        be waiting."""
        if not self.preload:
            return True
        ids = {r.replica_id for r in self._live} | {self.replica_id}
        return self.replica_id in BOUNDED_AFFINITY.rank(adapter, (Candidate(i) for i in sorted(ids)))[:self.preload]

    def start(self, address: str) -> None:
        self.address = address
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sampler-fleet-{self.replica_id}")

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away: keep serving, clients keep their lists
                log.warning("sampler fleet heartbeat of %s failed: %s", self.replica_id, exc)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.to_thread(self.membership.leave, self.replica_id), 2.0)
        await asyncio.to_thread(self.membership.close)
