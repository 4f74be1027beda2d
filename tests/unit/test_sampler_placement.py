"""The sampler placement policy object (loraplane/routing.py): its filter and score plugins and the policy that
combines them, pure, so every edge is checked exactly. (test_sampler_routing.py checks bounded affinity's behaviour
through `route`.)"""

from __future__ import annotations

import random

from loraplane.client.sampler_routing import SamplerRouter
from loraplane.routing import (
    BOUNDED_AFFINITY,
    FEWEST_ADAPTERS,
    PLACEMENTS,
    Candidate,
    HashRing,
    PlacementPolicy,
    Pool,
    capacity,
    fewest_held,
    has_room,
    ring_affinity,
    ring_of,
    under_load_bound,
)
from sampler_svc.engines.sglang_placement import ServerChoice

IDS = [f"s{i}" for i in range(5)]


def pool(*candidates: Candidate, key: str = "acme/run") -> Pool:
    return Pool(key, tuple(candidates))


def test_has_room_takes_no_limit_as_unlimited_and_refuses_at_the_limit():
    assert has_room(Candidate("a", held=10_000), pool())
    assert has_room(Candidate("a", held=1, limit=2), pool())
    assert not has_room(Candidate("a", held=2, limit=2), pool())
    assert not has_room(Candidate("a", held=3, limit=2), pool())


def test_the_load_bound_is_the_pools_and_ignores_negative_loads():
    passes = under_load_bound(1.25)
    a, b, c = Candidate("a", load=3), Candidate("b", load=3), Candidate("c", load=2)
    full = pool(a, b, c)
    assert capacity(full.total_load, 3) == 4 and all(passes(x, full) for x in (a, b, c))
    # At the bound: total 10 + 1 -> ceil(1.25 * 11 / 3) = 5, and a load of 5 is not below it; 4 is.
    at, under = Candidate("a", load=5), Candidate("a", load=4)
    assert not passes(at, pool(at, b, c)) and passes(under, pool(under, b, c))
    # A negative report (a stale subtraction) never lowers the others' bound.
    low, one = Candidate("z", load=-7), Candidate("b", load=1)
    assert pool(low, one).total_load == 1 and passes(one, pool(low, one))  # bound ceil(1.25 * 2 / 2) = 2, not 1
    # Alone and idle: room for one request, never zero.
    assert passes(Candidate("a"), pool(Candidate("a")))


def test_ring_affinity_ranks_as_the_keys_preference_list_and_a_subset_keeps_the_order():
    score = ring_affinity()
    everyone = pool(*(Candidate(i) for i in IDS))
    ring = HashRing(IDS)
    ranked = sorted(IDS, key=lambda i: -score(Candidate(i), everyone))
    assert ranked == list(ring.order("acme/run"))
    # The ring of the live ones orders them as the whole ring does: leaving one out moves no one else.
    for gone in IDS:
        live = [i for i in IDS if i != gone]
        assert list(ring_of(frozenset(live)).order("acme/run")) == [i for i in ring.order("acme/run") if i != gone]


def test_fewest_held_ties_keep_the_callers_order():
    servers = [Candidate("a", held=2), Candidate("b", held=1), Candidate("c", held=1)]
    assert FEWEST_ADAPTERS.rank("k", servers) == ["b", "c", "a"]
    assert fewest_held(servers[0], pool(*servers)) < fewest_held(servers[1], pool(*servers))
    assert FEWEST_ADAPTERS.choose("k", [Candidate("x"), Candidate("y")]) == "x"


def test_choose_skips_candidates_a_filter_refuses_and_gives_none_when_all_are_refused():
    servers = [Candidate("a", held=1, limit=1), Candidate("b", held=3, limit=8), Candidate("c", held=2, limit=2)]
    # The least held is full: the next with room takes it.
    assert FEWEST_ADAPTERS.choose("k", servers) == "b"
    full = [Candidate("a", held=1, limit=1), Candidate("c", held=2, limit=2)]
    assert FEWEST_ADAPTERS.choose("k", full) is None
    # rank still lists every candidate, by score, for a caller that must try something.
    assert FEWEST_ADAPTERS.rank("k", full) == ["a", "c"]
    assert FEWEST_ADAPTERS.choose("k", []) is None and FEWEST_ADAPTERS.rank("k", []) == []


def test_rank_puts_the_chosen_first_then_the_rest_by_score_and_leaves_down_ones_out_unless_all_are():
    by_name = PlacementPolicy("by_name", filters=(lambda c, p: c.load == 0,),
                              scores=(lambda c, p: -int(c.id[1:]),))
    candidates = [Candidate("s3"), Candidate("s0", load=1), Candidate("s1", load=1), Candidate("s2")]
    assert by_name.rank("k", candidates) == ["s2", "s0", "s1", "s3"]
    assert by_name.choose("k", candidates) == "s2"
    down = [Candidate("s0"), Candidate("s1", down=True), Candidate("s2", load=1)]
    assert by_name.rank("k", down) == ["s0", "s2"]
    assert by_name.rank("k", [Candidate("s1", down=True), Candidate("s0", down=True)]) == ["s0", "s1"]
    # Without scores the caller's order stands.
    assert PlacementPolicy("plain").rank("k", candidates) == ["s3", "s0", "s1", "s2"]


def test_a_hot_key_fills_its_home_to_the_bound_then_spills_in_preference_order():
    ring = HashRing(IDS)
    key = "acme/hot"
    loads = dict.fromkeys(IDS, 0)
    for _ in range(40):
        chosen = BOUNDED_AFFINITY.choose(key, [Candidate(i, loads[i]) for i in random.Random(3).sample(IDS, 5)])
        loads[chosen] += 1
    assert loads[ring.order(key)[0]] == max(loads.values()) <= capacity(39, 5)
    assert set(loads.values()) - {0}  # it spread


def test_every_user_of_sampler_placement_shares_one_policy_and_the_registry_names_its_policies():
    assert SamplerRouter("127.0.0.1:1").policy is BOUNDED_AFFINITY
    assert SamplerRouter("127.0.0.1:1", balance=2.0).policy is not BOUNDED_AFFINITY
    assert ServerChoice([]).policy is FEWEST_ADAPTERS
    for name, factory in PLACEMENTS.items():
        assert factory().name == name
    assert {BOUNDED_AFFINITY.name, FEWEST_ADAPTERS.name} <= set(PLACEMENTS)
