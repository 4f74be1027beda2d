"""The trainer fleet's placement policy (loraplane/fleet.py): pure, so every rule is checked exactly."""

from __future__ import annotations

from collections import Counter

from loraplane.errors import Unavailable
from loraplane.fleet import MOVED_REASON, TrainerLoad, assign, choose_trainer, is_moved, moved

GIB = 1 << 30


def fleet(n: int, **kw) -> dict[str, TrainerLoad]:
    return {f"t{i}": TrainerLoad(trainer_id=f"t{i}", device_total=80 * GIB, device_free=60 * GIB, **kw)
            for i in range(n)}


def place_all(members: dict[str, TrainerLoad], sizes: list[int]) -> list[str]:
    """Places adapters one by one as CreateAdapter does: each choice counts towards the next."""
    chosen = []
    for size in sizes:
        target = choose_trainer(members.values(), size)
        members[target] = members[target].plus(size)
        chosen.append(target)
    return chosen


def test_twelve_equal_adapters_spread_four_per_trainer_round_robin():
    chosen = place_all(fleet(3), [64 << 20] * 12)
    assert Counter(chosen) == {"t0": 4, "t1": 4, "t2": 4}
    assert chosen[:3] == ["t0", "t1", "t2"]  # deterministic ties: by id


def test_unknown_device_sizes_still_spread_by_committed_bytes():
    members = {f"t{i}": TrainerLoad(trainer_id=f"t{i}") for i in range(3)}
    assert Counter(place_all(members, [1000] * 12)) == {"t0": 4, "t1": 4, "t2": 4}


def test_memory_decides_a_big_adapter_lands_where_it_weighs_least():
    members = fleet(2)
    members["t0"] = members["t0"].plus(8 * GIB)  # one big tenant already on t0
    chosen = place_all(members, [1 * GIB] * 8)
    assert Counter(chosen) == {"t1": 8}  # 8 GiB on each now


def test_a_long_queue_counts_as_load():
    members = fleet(2)
    members["t0"] = TrainerLoad(trainer_id="t0", device_total=80 * GIB, device_free=60 * GIB, queue_depth=64)
    assert choose_trainer(members.values(), 1 << 20) == "t1"


def test_dead_draining_and_full_trainers_get_nothing():
    members = fleet(4)
    members["t0"] = TrainerLoad(trainer_id="t0", live=False)
    members["t1"] = TrainerLoad(trainer_id="t1", draining=True, device_total=80 * GIB, device_free=80 * GIB)
    members["t2"] = TrainerLoad(trainer_id="t2", device_total=80 * GIB, device_free=5 * GIB)  # 5 GiB, needs 4 + 5%
    assert choose_trainer(members.values(), 4 * GIB) == "t3"
    assert choose_trainer([members["t0"], members["t1"], members["t2"]], 4 * GIB) is None


def test_orphans_spread_over_the_survivors_biggest_first_and_identically_everywhere():
    members = fleet(3)
    members["t0"] = TrainerLoad(trainer_id="t0", live=False)
    orphans = [(f"a{i}", (i % 3 + 1) << 20) for i in range(6)]
    plan = assign(orphans, members.values())
    assert set(plan) == {name for name, _ in orphans}
    assert set(plan.values()) == {"t1", "t2"}
    per_trainer = Counter()
    for name, size in orphans:
        per_trainer[plan[name]] += size
    assert per_trainer["t1"] == per_trainer["t2"]  # 6 MiB each: first-fit decreasing balances them
    assert assign(list(reversed(orphans)), list(reversed(list(members.values())))) == plan


def test_orphans_nobody_can_hold_wait():
    members = {"t1": TrainerLoad(trainer_id="t1", device_total=10 * GIB, device_free=2 * GIB)}
    assert assign([("big", 4 * GIB), ("small", 1 * GIB)], members.values()) == {"small": "t1"}


def test_moved_is_a_retryable_unavailable_that_names_no_address():
    error = moved("ten/a")
    assert isinstance(error, Unavailable) and error.reason == MOVED_REASON and error.field == "adapter"
    assert is_moved(error) and not is_moved(Unavailable("down"))
    assert ":" not in error.message.replace("ten/a", "")
