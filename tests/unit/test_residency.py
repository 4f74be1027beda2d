"""The trainer's one residency policy (trainer_svc.pool.Residency), which the shared adapter pool and the megatron
engine's pool both use: least recently used first, never a member of the batch being made resident, within the
slot count and the byte budget."""

from __future__ import annotations

import pytest

from loraplane.errors import InvalidArgument
from trainer_svc.pool import Residency


def _spiller(residency: Residency, spilled: list[str]):
    def spill(name: str) -> None:
        spilled.append(name)
        residency.remove(name)

    return spill


def test_the_least_recently_used_adapter_outside_the_batch_is_spilled():
    r, spilled = Residency(3), []
    for name in ("a", "b", "c"):
        r.make_room(name, [name], _spiller(r, spilled))
        r.add(name)
    r.used("a")  # b is now the least recently used
    r.make_room("d", ["b", "d"], _spiller(r, spilled))  # b is protected: c goes
    r.add("d")
    assert spilled == ["c"] and r.names() == ["b", "a", "d"]
    with pytest.raises(InvalidArgument, match="4 adapters in one batch exceed 3 device slots"):
        r.check_batch(4)
    with pytest.raises(InvalidArgument, match="held by the batch"):
        r.make_room("e", ["a", "b", "d", "e"], _spiller(r, spilled))


def test_a_byte_budget_spills_until_the_newcomer_fits():
    sizes = {"a": 4, "b": 4, "c": 4, "big": 9}
    r, spilled = Residency(8, memory_bytes=12, size_of=sizes.__getitem__), []
    for name in ("a", "b", "c"):
        r.make_room(name, [name], _spiller(r, spilled))
        r.add(name)
    assert spilled == [] and r.bytes == 12
    r.make_room("big", ["big"], _spiller(r, spilled))
    assert spilled == ["a", "b", "c"] and r.bytes == 0  # 9 + 4 > 12: every resident goes, oldest first
