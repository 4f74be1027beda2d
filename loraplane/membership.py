"""Fleet membership in Redis: each member heartbeats a JSON report under a key that expires; no key = presumed dead.

Layout under `<key_prefix>fleet:<fleet>:` (the trainer fleet's, trainer_svc/fleet_store.py, and the sampler fleet's,
sampler_svc/fleet.py, share it; a fleet name is unique across both):
  member:<id>   string (JSON report), expires after the member's TTL: its heartbeat
  members       set of every member id seen (so listings also show dead ones)

Synchronous redis-py: the CLI calls it directly, services from a thread.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from loraplane.errors import Unavailable


@dataclass
class Member:
    member_id: str
    # The member's last report (empty for a member whose heartbeat expired).
    report: dict = field(default_factory=dict)
    live: bool = False


class Membership:
    def __init__(self, url: str, *, key_prefix: str = "lp:", fleet: str, timeout_s: float = 5.0,
                 client: redis.Redis | None = None):
        self.fleet = fleet
        self.prefix = f"{key_prefix}fleet:{fleet}:"
        self.redis = client or redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def close(self) -> None:
        self.redis.close()

    def _call(self, what: str, fn):
        try:
            return fn()
        except redis.RedisError as exc:
            raise Unavailable(f"the fleet's membership is unavailable ({what}: {exc}); retry") from exc

    def heartbeat(self, member_id: str, report: dict, ttl_s: float) -> None:
        """Writes the member's report, live for `ttl_s` from now (the report gains `heartbeat_at`)."""
        body = json.dumps({**report, "heartbeat_at": time.time()})

        def write():
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(f"{self.prefix}member:{member_id}", body, px=max(1, int(ttl_s * 1000)))
            pipe.sadd(f"{self.prefix}members", member_id)
            pipe.execute()
        self._call("heartbeat", write)

    def members(self) -> list[Member]:
        """Every member ever seen, live ones with their last report; sorted by id."""
        def read():
            ids = sorted(i.decode() for i in self.redis.smembers(f"{self.prefix}members"))
            pipe = self.redis.pipeline(transaction=False)
            for member_id in ids:
                pipe.get(f"{self.prefix}member:{member_id}")
            return ids, pipe.execute() if ids else []
        ids, reports = self._call("read the members", read)
        return [Member(member_id, json.loads(report) if report else {}, report is not None)
                for member_id, report in zip(ids, reports)]

    def leave(self, member_id: str) -> None:
        """The member stops now (a clean shutdown): others see it gone at once instead of after its TTL."""
        self._call("leave", lambda: self.redis.delete(f"{self.prefix}member:{member_id}"))

    def forget(self, member_id: str) -> None:
        def forget():
            pipe = self.redis.pipeline()
            pipe.srem(f"{self.prefix}members", member_id)
            pipe.delete(f"{self.prefix}member:{member_id}")
            pipe.execute()
        self._call("forget the member", forget)


__all__ = ["Member", "Membership"]
