"""The fleet's Redis state (trainer_svc/fleet_store.py) on a real Valkey: every placement change is one
compare-and-set under a growing epoch, placed bytes follow the adapters, heartbeats expire."""

from __future__ import annotations

import time
import uuid

import pytest

from trainer_svc.fleet_store import FleetStore, MemberInfo


@pytest.fixture
def store(valkey):
    fleet = FleetStore(valkey.url, key_prefix=f"lpunit:{uuid.uuid4().hex[:8]}:", fleet="unit")
    yield fleet
    fleet.close()


def loads(store: FleetStore) -> dict[str, tuple[int, int]]:
    return {m.trainer_id: (m.placed, m.committed_bytes) for m in store.members()}


def test_a_placement_is_made_once_and_moved_only_from_what_the_mover_saw(store):
    for member in ("a", "b", "c"):
        store.heartbeat(MemberInfo(trainer_id=member, address=f"{member}:1"), ttl_s=30)
    first, created = store.place_new("ten/x", "a", 1000)
    assert created and (first.trainer, first.bytes) == ("a", 1000)
    again, created = store.place_new("ten/x", "b", 5)  # someone else decided too late
    assert not created and (again.trainer, again.epoch) == ("a", first.epoch)

    moved = store.move(first, "b")
    assert moved is not None and moved.trainer == "b" and moved.epoch > first.epoch
    # A second mover that saw the old placement loses: no double adoption.
    assert store.move(first, "c") is None
    assert store.placement("ten/x").trainer == "b"
    # Moving to the same trainer still fences its earlier incarnation with a new epoch.
    same = store.move(moved, "b")
    assert same.trainer == "b" and same.epoch > moved.epoch
    assert loads(store) == {"a": (0, 0), "b": (1, 1000), "c": (0, 0)}

    assert not store.release(first)  # only the current owner at its epoch releases it
    assert store.release(same)
    assert store.placement("ten/x") is None
    assert loads(store) == {"a": (0, 0), "b": (0, 0), "c": (0, 0)}


def test_members_report_expire_and_drain(store):
    store.heartbeat(MemberInfo(trainer_id="a", address="a:1", device_total=10, device_free=7, queue_depth=3),
                    ttl_s=0.3)
    store.heartbeat(MemberInfo(trainer_id="b", address="b:1"), ttl_s=30)
    store.set_draining("b")
    members = {m.trainer_id: m for m in store.members()}
    assert members["a"].live and (members["a"].device_free, members["a"].queue_depth) == (7, 3)
    assert members["b"].draining and not members["a"].draining
    assert store.is_draining("b")
    time.sleep(0.5)
    members = {m.trainer_id: m for m in store.members()}
    assert not members["a"].live and members["a"].address == ""  # known, presumed dead
    assert members["b"].live
    store.set_draining("b", False)
    assert not store.is_draining("b")
    store.forget_member("a")
    assert [m.trainer_id for m in store.members()] == ["b"]


def test_placements_without_an_index_record_are_listed_too(store):
    store.place_new("ten/only-placed", "a", 1)
    store.redis.hset(store.index_key, "ten/indexed", "{}")
    store.place_new("ten/indexed", "b", 2)
    assert set(store.all_placements()) == {"ten/only-placed", "ten/indexed"}
    assert store.adapter_names() == ["ten/indexed"]
