"""The sampler fleet's routing policy (loraplane/routing.py): consistent hashing with bounded loads, pure."""

from __future__ import annotations

import math
import random
from collections import Counter

from loraplane.routing import HashRing, capacity, route

REPLICAS = ["sampler-0", "sampler-1", "sampler-2"]


def test_an_adapter_always_goes_to_the_same_replica_whatever_the_member_order():
    ring = HashRing(REPLICAS)
    shuffled = HashRing(random.Random(7).sample(REPLICAS, 3))
    for i in range(50):
        key = f"acme/run-{i}"
        assert route(ring, key, {})[0] == route(shuffled, key, {})[0] == ring.order(key)[0]
        # Every replica is in the list exactly once: the failover order.
        assert sorted(route(ring, key, {})) == REPLICAS


def test_adapters_spread_over_the_replicas():
    ring = HashRing(REPLICAS)
    homes = Counter(route(ring, f"tenant/adapter-{i}", {})[0] for i in range(600))
    assert set(homes) == set(REPLICAS)
    for replica in REPLICAS:
        assert 150 <= homes[replica] <= 260, homes  # 200 each on average


def test_a_replica_leaving_moves_only_its_own_adapters():
    before, after = HashRing(REPLICAS), HashRing(REPLICAS[:2])
    keys = [f"t/a{i}" for i in range(300)]
    for key in keys:
        home = before.order(key)[0]
        if home != "sampler-2":
            assert after.order(key)[0] == home
        else:  # its next choice takes it: the same replica failover would have sent it to
            assert after.order(key)[0] == before.order(key)[1]


def test_capacity_is_the_ceiling_of_balance_times_mean_load():
    assert capacity(0, 3) == 1
    assert capacity(11, 3) == math.ceil(1.25 * 12 / 3) == 5
    assert capacity(11, 3, balance=2.0) == 8


def test_a_replica_at_the_bound_passes_the_request_to_the_next_in_the_adapters_list():
    ring = HashRing(REPLICAS)
    key = "acme/hot"
    home, second, third = ring.order(key)
    # Under the bound the home replica takes it even if it is the busiest.
    assert route(ring, key, {home: 3, second: 2, third: 2})[0] == home
    # At the bound (total 7 + 1 = 8 -> ceil(1.25 * 8 / 3) = 4) it goes to the next one, the home replica second.
    assert route(ring, key, {home: 4, second: 2, third: 1}) == [second, home, third]
    assert route(ring, key, {home: 4, second: 4, third: 0}) == [third, home, second]


def test_a_hot_adapter_spreads_over_every_replica_and_no_replica_exceeds_the_bound():
    ring = HashRing(REPLICAS)
    loads = Counter()
    for _ in range(24):
        total = sum(loads.values())
        chosen = route(ring, "acme/hot", loads)[0]
        loads[chosen] += 1
        assert loads[chosen] <= capacity(total, 3)
    assert set(loads) == set(REPLICAS)
    assert max(loads.values()) <= math.ceil(1.25 * 24 / 3)
    # A cold adapter next to it still goes home when its home has room.
    cold = next(f"acme/cold-{i}" for i in range(100) if ring.order(f"acme/cold-{i}")[0] != ring.order("acme/hot")[0])
    assert route(ring, cold, {})[0] == ring.order(cold)[0]


def test_dead_replicas_are_left_out_unless_nothing_else_is_left():
    ring = HashRing(REPLICAS)
    key = "acme/run"
    home = ring.order(key)[0]
    order = route(ring, key, {}, exclude={home})
    assert home not in order and order == [r for r in ring.order(key) if r != home]
    assert route(ring, key, {}, exclude=set(REPLICAS)) == list(ring.order(key))
    assert route(HashRing(()), key, {}) == []
