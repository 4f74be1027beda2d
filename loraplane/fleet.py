"""Placement policy of a trainer fleet: which trainer an adapter lives on. Pure: no Redis, no clocks, no gRPC; the
trainers' fleet runtime (trainer_svc/fleet.py) feeds it snapshots of the fleet it reads from Redis and writes the
answer back with a compare-and-set, so two trainers deciding from slightly different snapshots never both win.

The rules a platform team expects:
  * new adapters go to the least loaded live trainer that is not draining and has the device memory for them;
    load = the adapter memory already committed to it (its placements, counted at placement time, so a burst of
    creations spreads before any heartbeat reports the new memory) as a fraction of its device memory, plus its
    queue depth scaled by QUEUE_WEIGHT / QUEUE_SCALE (a trainer with a long queue is busy even if it has memory);
  * placement is sticky: an adapter stays where it is until its trainer dies (heartbeat expired) or is drained;
  * orphans (the adapters of a dead or drained trainer) are spread by the same rule, one at a time, each choice
    counting towards the next, biggest adapters first (first-fit decreasing keeps large adapters placeable).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from loraplane.errors import Unavailable

# Queue depth at which a trainer counts as "one device memory full" busier; QUEUE_WEIGHT scales that.
QUEUE_SCALE = 64
QUEUE_WEIGHT = 0.5
# A trainer must keep this fraction of its device memory free after taking an adapter (activations, fragmentation).
HEADROOM = 0.05


@dataclass(frozen=True)
class TrainerLoad:
    """One fleet member as the policy sees it. Memory in bytes; `device_total`/`device_free` as the trainer last
    measured them (0 total = unknown: memory then does not constrain, only committed bytes compare)."""

    trainer_id: str
    live: bool = True
    draining: bool = False
    device_total: int = 0
    device_free: int = 0
    queue_depth: int = 0
    # What placements have committed to it (bytes of adapter state, and how many adapters).
    committed_bytes: int = 0
    adapters: int = 0

    @property
    def accepts(self) -> bool:
        return self.live and not self.draining

    def load(self) -> float:
        memory = self.committed_bytes / self.device_total if self.device_total else 0.0
        return memory + QUEUE_WEIGHT * min(self.queue_depth, QUEUE_SCALE * 4) / QUEUE_SCALE

    def fits(self, need_bytes: int) -> bool:
        if not self.device_total:
            return True
        return self.device_free - need_bytes >= HEADROOM * self.device_total

    def plus(self, need_bytes: int) -> TrainerLoad:
        return replace(self, committed_bytes=self.committed_bytes + need_bytes, adapters=self.adapters + 1,
                       device_free=max(0, self.device_free - need_bytes) if self.device_total else 0)


def _key(member: TrainerLoad, need_bytes: int) -> tuple:
    # Committed bytes rather than load() break ties first when device sizes are unknown (all 0): then the adapter
    # counts and finally the id decide, so equal trainers fill round-robin and the choice is deterministic.
    after = member.plus(need_bytes)
    return (round(after.load(), 9), after.committed_bytes if not member.device_total else 0, member.adapters,
            member.trainer_id)


def choose_trainer(members: Iterable[TrainerLoad], need_bytes: int) -> str | None:
    """The trainer a new adapter of `need_bytes` goes to, or None when no live, non-draining trainer fits it."""
    candidates = [m for m in members if m.accepts and m.fits(need_bytes)]
    if not candidates:
        return None
    return min(candidates, key=lambda m: _key(m, need_bytes)).trainer_id


def assign(orphans: Sequence[tuple[str, int]], members: Iterable[TrainerLoad]) -> dict[str, str]:
    """adapter -> trainer for orphaned adapters ((name, bytes) each), spread one at a time (biggest first, then by
    name, so every trainer computing this from the same snapshot gets the same answer). Adapters nobody can take
    are left out (they wait for capacity)."""
    loads = {m.trainer_id: m for m in members}
    placed: dict[str, str] = {}
    for name, need in sorted(orphans, key=lambda o: (-o[1], o[0])):
        chosen = choose_trainer(loads.values(), need)
        if chosen is None:
            continue
        placed[name] = chosen
        loads[chosen] = loads[chosen].plus(need)
    return placed


# ErrorInfo.reason of the UNAVAILABLE a trainer answers for an adapter it does not (or no longer) serve: the client
# asks any trainer (ResolveAdapter) where the adapter lives now and retries there with the same seq_id.
MOVED_REASON = "ADAPTER_MOVED"


def moved(adapter: str) -> Unavailable:
    # No address in the message: it may travel on to a tenant through the gateway; ResolveAdapter tells clients.
    return Unavailable(f"adapter {adapter!r} is served by another trainer of the fleet now (or is moving there); "
                       "resolve its trainer again and retry the same seq_id", reason=MOVED_REASON, field="adapter")


def is_moved(exc: BaseException) -> bool:
    return getattr(exc, "reason", None) == MOVED_REASON
