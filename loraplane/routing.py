"""Which sampler replica serves an adapter: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
"Consistent Hashing with Bounded Loads", 2018). Pure: no gRPC, no clocks; the routers (loraplane/client/
sampler_routing.py, used by the SDK and the gateway) feed it the replica list and the loads they see.

  * Each replica owns VNODES points on a ring; an adapter's key (its name: every version of an adapter goes to the
    same replica, where the versions it keeps are already loaded) walks the ring clockwise from its own point and
    meets the replicas in an order of its own (its preference list).
  * Bounded load: a replica takes a request only while its load is below ceil(balance x (total load + 1) / n). A hot
    adapter whose first replica is at the bound spills to the next replica of its list, then the next: it spreads
    over as many replicas as its load needs, and comes home as the load falls.
  * A replica joining or leaving moves only the keys whose list it heads (about 1/n of them), so the others keep
    their loaded versions warm.
  * Failover is the same list with the dead replica left out.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

# Points per replica: enough that n replicas share the ring within a few percent of 1/n each.
VNODES = 160
# A replica takes requests up to this multiple of the mean load (1.25: the paper's epsilon of 0.25).
DEFAULT_BALANCE = 1.25
_ORDER_CACHE = 4096


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """The replicas' points on the ring. Immutable: a changed member set is a new ring."""

    def __init__(self, members: Iterable[str], vnodes: int = VNODES):
        self.members = tuple(sorted(set(members)))
        points = sorted((_point(f"{member}#{i}"), member) for member in self.members for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]
        self._orders: dict[str, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self.members)

    def order(self, key: str) -> tuple[str, ...]:
        """Every member, in the order met clockwise from the key's point: the key's preference list."""
        found = self._orders.get(key)
        if found is not None:
            return found
        n = len(self.members)
        seen: dict[str, None] = {}
        if n:
            start = bisect.bisect_left(self._points, _point(key))
            for i in range(len(self._owners)):
                seen.setdefault(self._owners[(start + i) % len(self._owners)])
                if len(seen) == n:
                    break
        found = tuple(seen)
        if len(self._orders) >= _ORDER_CACHE:
            self._orders.clear()
        self._orders[key] = found
        return found


def capacity(total_load: int, members: int, balance: float = DEFAULT_BALANCE) -> int:
    """The most requests one of `members` replicas may hold when one more arrives on top of `total_load`."""
    return max(1, math.ceil(balance * (total_load + 1) / max(members, 1)))


def route(ring: HashRing, key: str, loads: Mapping[str, int], *, balance: float = DEFAULT_BALANCE,
          exclude: Collection[str] = ()) -> list[str]:
    """The replicas to try for a request of `key`, best first: the first of its preference list under the load bound,
    then the rest of the list in order (where to go if that one fails). Replicas in `exclude` (known dead) are left
    out, unless nothing else is left. Empty only for an empty ring."""
    order: Sequence[str] = ring.order(key)
    if exclude:
        alive = [m for m in order if m not in exclude]
        order = alive or order
    if not order:
        return []
    bound = capacity(sum(max(loads.get(m, 0), 0) for m in order), len(order), balance)
    for index, member in enumerate(order):
        if loads.get(member, 0) < bound:
            return [member, *order[:index], *order[index + 1:]]
    return list(order)


__all__ = ["DEFAULT_BALANCE", "VNODES", "HashRing", "capacity", "route"]
