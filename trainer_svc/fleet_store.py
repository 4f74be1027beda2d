"""A trainer fleet's shared state in Redis: members (heartbeats), drain marks and one placement per adapter.

Layout under `<key_prefix>fleet:<fleet>:`
  member:<id>          string (JSON MemberInfo), expires: the member's heartbeat; absent = presumed dead
  members              set of every member id seen (so `loraplane trainers ls` also lists dead ones)
  draining             set of member ids asked to hand their adapters over (`loraplane trainers drain`)
  placement:<adapter>  hash trainer, epoch, bytes: who serves the adapter, under which fencing epoch
  epoch                counter: every placement change takes the next value, so epochs only ever grow
  committed            hash member id -> adapter state bytes placed on it (the policy's memory view)
  count                hash member id -> adapters placed on it

Every placement change is one Lua script (a compare-and-set on trainer + epoch), so two trainers that decide from
slightly different snapshots never both take an adapter. The fleet's members share one training journal
(`<key_prefix>trainer:<fleet>:`, trainer_svc/journal.py): a member's journal writes are fenced by the placement
(the journal's Lua script checks trainer + epoch in the same step as the write), which is how an adapter adopted
elsewhere can never again be changed by a trainer that was presumed dead and came back.

Synchronous redis-py: the CLI calls it directly, the trainer from a thread. Plain Redis (or Valkey), not Redis
Cluster: the scripts touch several adapters' keys.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import redis

from loraplane.errors import Unavailable
from loraplane.fleet import TrainerLoad
from loraplane.membership import Membership

_PLACE_NEW = """
local current = redis.call('HMGET', KEYS[1], 'trainer', 'epoch')
if current[1] then return {current[1], current[2], 0} end
local epoch = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'trainer', ARGV[1], 'epoch', epoch, 'bytes', ARGV[2])
redis.call('HINCRBY', KEYS[3], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
return {ARGV[1], tostring(epoch), 1}
"""

# ARGV: expected trainer, expected epoch, new trainer. Moves the placement (a new epoch, even to the same trainer:
# that fences an earlier incarnation of it) only if it still is what the caller saw.
_MOVE = """
local current = redis.call('HMGET', KEYS[1], 'trainer', 'epoch', 'bytes')
if current[1] ~= ARGV[1] or current[2] ~= ARGV[2] then
  return {current[1] or '', current[2] or '0', 0}
end
local bytes = tonumber(current[3] or '0')
local epoch = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'trainer', ARGV[3], 'epoch', epoch)
redis.call('HINCRBY', KEYS[3], ARGV[1], -bytes)
redis.call('HINCRBY', KEYS[4], ARGV[1], -1)
redis.call('HINCRBY', KEYS[3], ARGV[3], bytes)
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
return {ARGV[3], tostring(epoch), 1}
"""

# ARGV: expected trainer, expected epoch. Removes the placement (the adapter was deleted, or never created).
_RELEASE = """
local current = redis.call('HMGET', KEYS[1], 'trainer', 'epoch', 'bytes')
if current[1] ~= ARGV[1] or current[2] ~= ARGV[2] then return 0 end
redis.call('HINCRBY', KEYS[3], ARGV[1], -tonumber(current[3] or '0'))
redis.call('HINCRBY', KEYS[4], ARGV[1], -1)
redis.call('DEL', KEYS[1])
return 1
"""


@dataclass(frozen=True)
class Placement:
    adapter: str
    trainer: str
    epoch: int
    bytes: int = 0


@dataclass
class MemberInfo:
    """What a trainer reports in its heartbeat (memory in bytes, as it measured it)."""

    trainer_id: str
    address: str
    device: str = "cpu"
    device_total: int = 0
    device_free: int = 0
    device_used: int = 0
    queue_depth: int = 0
    adapters: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    # Filled in when read back, never written.
    live: bool = False
    draining: bool = False
    committed_bytes: int = 0
    placed: int = 0

    def load(self) -> TrainerLoad:
        return TrainerLoad(trainer_id=self.trainer_id, live=self.live, draining=self.draining,
                           device_total=self.device_total, device_free=self.device_free,
                           queue_depth=self.queue_depth, committed_bytes=self.committed_bytes, adapters=self.placed)


_REPORTED = ("trainer_id", "address", "device", "device_total", "device_free", "device_used", "queue_depth",
             "adapters", "started_at", "heartbeat_at")


class FleetStore:
    def __init__(self, url: str, *, key_prefix: str = "lp:", fleet: str = "trainers", timeout_s: float = 5.0):
        self.fleet = fleet
        self.prefix = f"{key_prefix}fleet:{fleet}:"
        # The shared journal's adapter index (trainer_svc/journal.py), read to find every adapter of the fleet.
        self.index_key = f"{key_prefix}trainer:{fleet}:adapters"
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # The heartbeat keys are the shared membership layout (the sampler fleet's too); members() below reads them
        # in one pipeline with the drain marks and placement counts.
        self.membership = Membership(url, key_prefix=key_prefix, fleet=fleet, client=self.redis)
        self._place_new = self.redis.register_script(_PLACE_NEW)
        self._move = self.redis.register_script(_MOVE)
        self._release = self.redis.register_script(_RELEASE)

    def close(self) -> None:
        self.redis.close()

    def placement_key(self, adapter: str) -> str:
        return f"{self.prefix}placement:{adapter}"

    def _placement_keys(self, adapter: str) -> list[str]:
        return [self.placement_key(adapter), f"{self.prefix}epoch", f"{self.prefix}committed", f"{self.prefix}count"]

    def _call(self, what: str, fn):
        try:
            return fn()
        except redis.RedisError as exc:
            raise Unavailable(f"the trainer fleet's state is unavailable ({what}: {exc}); retry") from exc

    # ---- members
    def heartbeat(self, info: MemberInfo, ttl_s: float) -> None:
        info.heartbeat_at = time.time()
        self.membership.heartbeat(info.trainer_id, {k: getattr(info, k) for k in _REPORTED}, ttl_s)

    def members(self) -> list[MemberInfo]:
        """Every member ever seen, live ones with their last report; sorted by id."""
        def read():
            ids = sorted(i.decode() for i in self.redis.smembers(f"{self.prefix}members"))
            pipe = self.redis.pipeline(transaction=False)
            for member_id in ids:
                pipe.get(f"{self.prefix}member:{member_id}")
            pipe.smembers(f"{self.prefix}draining")
            pipe.hgetall(f"{self.prefix}committed")
            pipe.hgetall(f"{self.prefix}count")
            *reports, draining, committed, counts = pipe.execute()
            return ids, reports, {d.decode() for d in draining}, committed, counts
        ids, reports, draining, committed, counts = self._call("read the members", read)
        members = []
        for member_id, report in zip(ids, reports):
            info = MemberInfo(**{k: v for k, v in json.loads(report).items() if k in _REPORTED}) if report \
                else MemberInfo(trainer_id=member_id, address="")
            info.trainer_id = member_id
            info.live = report is not None
            info.draining = member_id in draining
            info.committed_bytes = int(committed.get(member_id.encode(), 0))
            info.placed = int(counts.get(member_id.encode(), 0))
            members.append(info)
        return members

    def set_draining(self, trainer_id: str, draining: bool = True) -> None:
        key = f"{self.prefix}draining"
        self._call("mark draining", lambda: (self.redis.sadd if draining else self.redis.srem)(key, trainer_id))

    def is_draining(self, trainer_id: str) -> bool:
        return bool(self._call("read draining", lambda: self.redis.sismember(f"{self.prefix}draining", trainer_id)))

    def forget_member(self, trainer_id: str) -> None:
        def forget():
            pipe = self.redis.pipeline()
            pipe.srem(f"{self.prefix}members", trainer_id)
            pipe.srem(f"{self.prefix}draining", trainer_id)
            pipe.delete(f"{self.prefix}member:{trainer_id}")
            pipe.execute()
        self._call("forget the member", forget)

    # ---- placements
    def adapter_names(self) -> list[str]:
        """Every adapter the fleet's journal index holds (the adapters that exist)."""
        return sorted(n.decode() for n in self._call("read the index", lambda: self.redis.hkeys(self.index_key)))

    def placement(self, adapter: str) -> Placement | None:
        return self.placements([adapter]).get(adapter)

    def placements(self, adapters: list[str]) -> dict[str, Placement]:
        def read():
            pipe = self.redis.pipeline(transaction=False)
            for adapter in adapters:
                pipe.hmget(self.placement_key(adapter), "trainer", "epoch", "bytes")
            return pipe.execute()
        found = {}
        for adapter, (trainer, epoch, size) in zip(adapters, self._call("read placements", read)):
            if trainer is not None:
                found[adapter] = Placement(adapter, trainer.decode(), int(epoch), int(size or 0))
        return found

    def all_placements(self) -> dict[str, Placement]:
        """Placements of every adapter in the index, plus placements without an index record (adapters placed but
        not created yet, or never)."""
        def names():
            placed = [k.decode()[len(self.prefix) + len("placement:"):]
                      for k in self.redis.scan_iter(match=f"{self.prefix}placement:*", count=1000)]
            return placed
        return self.placements(sorted(set(self.adapter_names()) | set(self._call("scan placements", names))))

    def place_new(self, adapter: str, trainer_id: str, size: int) -> tuple[Placement, bool]:
        """Places an adapter that has no placement on `trainer_id`; (the placement now in force, whether it is
        this call's)."""
        trainer, epoch, created = self._call("place the adapter", lambda: self._place_new(
            keys=self._placement_keys(adapter), args=[trainer_id, int(size)]))
        return Placement(adapter, _text(trainer), int(epoch), int(size)), bool(created)

    def move(self, seen: Placement, trainer_id: str) -> Placement | None:
        """Moves the adapter to `trainer_id` under a new epoch if its placement is still `seen`; None if not."""
        trainer, epoch, moved = self._call("move the adapter", lambda: self._move(
            keys=self._placement_keys(seen.adapter), args=[seen.trainer, seen.epoch, trainer_id]))
        return Placement(seen.adapter, _text(trainer), int(epoch), seen.bytes) if moved else None

    def release(self, placement: Placement) -> bool:
        return bool(self._call("release the adapter", lambda: self._release(
            keys=self._placement_keys(placement.adapter), args=[placement.trainer, placement.epoch])))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def member_dict(info: MemberInfo) -> dict:
    return dataclasses.asdict(info)
