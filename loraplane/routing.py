"""Sampler placement: where a request or an adapter version goes among several places that could take it (sampler
replicas of a fleet, SGLang servers behind one sampler). One policy object, as the Kubernetes scheduler's framework
has it: filter plugins say whether a candidate may take the key, score plugins rank the candidates, both pure
functions of the key and the candidates as the caller sees them now (no gRPC, no clocks, no I/O). Every user asks the
same object:

  * the client SDK and the gateway (loraplane/client/sampler_routing.py) rank replicas per call (BOUNDED_AFFINITY);
  * the sampler fleet (sampler_svc/fleet.py) asks the same ranking at zero load which replicas load a new version
    ahead of requests;
  * the SGLang engine (sampler_svc/engines/sglang_placement.py) chooses the server a new adapter version is loaded on
    (FEWEST_ADAPTERS).

Bounded affinity is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing
with Bounded Loads", 2018):

  * Each replica owns VNODES points on a ring; an adapter's key (its name: every version of an adapter goes to the
    same replica, where the versions it keeps are already loaded) walks the ring clockwise from its own point and
    meets the replicas in an order of its own (its preference list): the `ring_affinity` score.
  * Bounded load: a replica takes a request only while its load is below ceil(balance x (total load + 1) / n) (the
    `under_load_bound` filter). A hot adapter whose first replica is at the bound spills to the next replica of its
    list, then the next: it spreads over as many replicas as its load needs, and comes home as the load falls.
  * A replica joining or leaving moves only the keys whose list it heads (about 1/n of them), so the others keep
    their loaded versions warm.
  * Failover is the same list with the dead replica left out.

A new policy is a `PlacementPolicy` of filters and scores, registered in PLACEMENTS.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

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
        self.vnodes = vnodes
        points = sorted((_point(f"{member}#{i}"), member) for member in self.members for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]
        self._orders: dict[str, tuple[tuple[str, ...], dict[str, int]]] = {}

    def __len__(self) -> int:
        return len(self.members)

    def _walk(self, key: str) -> tuple[tuple[str, ...], dict[str, int]]:
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
        order = tuple(seen)
        found = (order, {member: index for index, member in enumerate(order)})
        if len(self._orders) >= _ORDER_CACHE:
            self._orders.clear()
        self._orders[key] = found
        return found

    def order(self, key: str) -> tuple[str, ...]:
        """Every member, in the order met clockwise from the key's point: the key's preference list."""
        return self._walk(key)[0]

    def position(self, key: str, member: str) -> int:
        """Where `member` stands in the key's preference list (0: its first choice)."""
        return self._walk(key)[1][member]


@functools.lru_cache(maxsize=32)
def ring_of(members: frozenset[str], vnodes: int = VNODES) -> HashRing:
    """The ring of these members. Consistent hashing makes the ring of a subset order its members as the whole
    ring does, so callers may build it over the candidates they have (the live ones) rather than keep one."""
    return HashRing(members, vnodes)


def capacity(total_load: int, members: int, balance: float = DEFAULT_BALANCE) -> int:
    """The most requests one of `members` replicas may hold when one more arrives on top of `total_load`."""
    return max(1, math.ceil(balance * (total_load + 1) / max(members, 1)))


# ---------------------------------------------------------------------------------------------- the policy object

@dataclass(frozen=True)
class Candidate:
    """One place a key may go, as the caller sees it now."""

    id: str
    # Requests in flight there.
    load: int = 0
    # Adapter versions it holds or is loading.
    held: int = 0
    # The most adapter versions it may hold; 0: no limit known.
    limit: int = 0
    # Known dead (a failed call): left out unless every candidate is.
    down: bool = False


@dataclass(frozen=True)
class Pool:
    """The candidates one placement considers, with what several plugins need computed once."""

    key: str
    candidates: tuple[Candidate, ...]

    @cached_property
    def total_load(self) -> int:
        return sum(max(c.load, 0) for c in self.candidates)

    @cached_property
    def ids(self) -> frozenset[str]:
        return frozenset(c.id for c in self.candidates)


# A filter: may `candidate` take the pool's key? A score: how much it should (higher first; scores add up).
Filter = Callable[[Candidate, Pool], bool]
Score = Callable[[Candidate, Pool], float]


@dataclass(frozen=True)
class PlacementPolicy:
    name: str
    filters: tuple[Filter, ...] = ()
    scores: tuple[Score, ...] = ()

    def _considered(self, key: str, candidates: Iterable[Candidate]) -> tuple[Pool, list[Candidate]]:
        given = tuple(candidates)
        pool = Pool(key, tuple(c for c in given if not c.down) or given)
        if not self.scores:
            return pool, list(pool.candidates)
        # Stable: equal scores keep the caller's order.
        return pool, sorted(pool.candidates, key=lambda c: -sum(score(c, pool) for score in self.scores))

    def feasible(self, candidate: Candidate, pool: Pool) -> bool:
        return all(passes(candidate, pool) for passes in self.filters)

    def choose(self, key: str, candidates: Iterable[Candidate]) -> str | None:
        """The best-scored candidate that passes every filter; None when none does."""
        pool, ordered = self._considered(key, candidates)
        return next((c.id for c in ordered if self.feasible(c, pool)), None)

    def rank(self, key: str, candidates: Iterable[Candidate]) -> list[str]:
        """Every candidate to try, best first: the one `choose` gives, then the others by score (where to go if it
        fails); by score alone when no candidate passes the filters. Down candidates are left out unless all are.
        Empty only for no candidates."""
        pool, ordered = self._considered(key, candidates)
        for index, candidate in enumerate(ordered):
            if self.feasible(candidate, pool):
                return [candidate.id, *(c.id for c in ordered[:index]), *(c.id for c in ordered[index + 1:])]
        return [c.id for c in ordered]


# ---------------------------------------------------------------------------------------------- plugins

def under_load_bound(balance: float = DEFAULT_BALANCE) -> Filter:
    """Passes a candidate whose load is below the bounded-load capacity of the pool (`capacity`)."""

    def passes(candidate: Candidate, pool: Pool) -> bool:
        return candidate.load < capacity(pool.total_load, len(pool.candidates), balance)

    return passes


def has_room(candidate: Candidate, pool: Pool) -> bool:
    """Passes a candidate that can hold one more adapter version."""
    return not candidate.limit or candidate.held < candidate.limit


def ring_affinity(vnodes: int = VNODES) -> Score:
    """Higher the earlier the candidate stands in the key's preference list on the pool's ring."""

    def score(candidate: Candidate, pool: Pool) -> float:
        return -ring_of(pool.ids, vnodes).position(pool.key, candidate.id)

    return score


def fewest_held(candidate: Candidate, pool: Pool) -> float:
    """Higher the fewer adapter versions the candidate holds or is loading."""
    return -candidate.held


def bounded_affinity(balance: float = DEFAULT_BALANCE, vnodes: int = VNODES) -> PlacementPolicy:
    return PlacementPolicy("bounded_affinity", filters=(under_load_bound(balance),), scores=(ring_affinity(vnodes),))


def fewest_adapters() -> PlacementPolicy:
    return PlacementPolicy("fewest_adapters", filters=(has_room,), scores=(fewest_held,))


# Where requests of an adapter go among sampler replicas (clients, the gateway; the fleet's preloading).
BOUNDED_AFFINITY = bounded_affinity()
# Where a new adapter version is loaded among the servers of one engine (SGLang).
FEWEST_ADAPTERS = fewest_adapters()
# The placement policies by name: name -> factory (keyword arguments: the policy's own knobs).
PLACEMENTS: dict[str, Callable[..., PlacementPolicy]] = {
    "bounded_affinity": bounded_affinity,
    "fewest_adapters": fewest_adapters,
}


def route(ring: HashRing, key: str, loads: Mapping[str, int], *, balance: float = DEFAULT_BALANCE,
          exclude: Collection[str] = ()) -> list[str]:
    """Bounded affinity's ranking of the ring's members for `key` given their loads; members in `exclude` (known
    dead) are left out unless nothing else is left. Empty only for an empty ring."""
    policy = BOUNDED_AFFINITY if (balance, ring.vnodes) == (DEFAULT_BALANCE, VNODES) else bounded_affinity(
        balance, ring.vnodes)
    return policy.rank(key, (Candidate(m, loads.get(m, 0), down=m in exclude) for m in ring.members))


__all__ = [
    "BOUNDED_AFFINITY", "DEFAULT_BALANCE", "FEWEST_ADAPTERS", "PLACEMENTS", "VNODES", "Candidate", "Filter",
    "HashRing", "PlacementPolicy", "Pool", "Score", "bounded_affinity", "capacity", "fewest_adapters", "fewest_held",
    "has_room", "ring_affinity", "ring_of", "route", "under_load_bound",
]
