"""loraplane.threads: shared small work runs every item once, keeps the caller's modes, re-raises failures."""

from __future__ import annotations

import threading

import pytest
import torch

from loraplane.threads import one_thread, share_work


def test_every_item_runs_once_with_the_callers_grad_mode_and_one_thread_each():
    seen: dict[int, tuple[bool, int]] = {}
    lock = threading.Lock()

    def one(item: int) -> None:
        with lock:
            assert item not in seen
            seen[item] = (torch.is_grad_enabled(), torch.get_num_threads())

    with torch.no_grad():
        share_work(list(range(200)), one)
    assert sorted(seen) == list(range(200))
    assert all(grad is False and threads == 1 for grad, threads in seen.values())


def test_a_failing_item_is_reraised_on_the_caller():
    def one(item: int) -> None:
        if item == 7:
            raise ValueError("item 7")

    with pytest.raises(ValueError, match="item 7"):
        share_work(list(range(20)), one)


def test_one_thread_restores_the_callers_count():
    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
