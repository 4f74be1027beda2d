"""Scheduler batch formation: the batch window gathers concurrent adapters' requests into one fused batch, and
never delays a request nobody could join."""

from __future__ import annotations

import threading
import time

from trainer_svc.scheduler import Job, Scheduler


class Recorder:
    def __init__(self):
        self.batches: list[list[str]] = []
        self.lock = threading.Lock()

    def __call__(self, jobs: list[Job]) -> list:
        with self.lock:
            self.batches.append([job.adapter for job in jobs])
        return [job.seq_id for job in jobs]


def job(adapter: str, seq_id: int, kind: str = "forward_backward") -> Job:
    return Job(adapter=adapter, seq_id=seq_id, kind=kind, payload=None, payload_hash=f"{adapter}{seq_id}".encode())


def warm_up(scheduler: Scheduler, lanes: list[str]) -> None:
    """One request per lane, so each counts as active (expected to send more)."""
    futures = [scheduler.submit(job(name, 1)) for name in lanes]
    for future in futures:
        future.result(10)


def test_staggered_requests_of_active_adapters_fuse_into_one_batch():
    recorder = Recorder()
    scheduler = Scheduler(recorder, batch_window_s=3.0, max_fused_adapters=8)
    lanes = ["a", "b", "c"]
    try:
        for name in lanes:
            scheduler.open_lane(name)
        warm_up(scheduler, lanes)
        recorder.batches.clear()
        started = time.monotonic()
        futures = []
        for name in lanes:  # arriving a few ms apart, as concurrent clients' requests do
            futures.append(scheduler.submit(job(name, 2)))
            time.sleep(0.01)
        assert [f.result(10) for f in futures] == [2, 2, 2]
        assert recorder.batches == [["a", "b", "c"]]
        # Every active adapter had joined: the batch ran then, not at the end of the window.
        assert time.monotonic() - started < 1.5
    finally:
        scheduler.stop()


def test_without_a_window_the_first_request_runs_alone():
    recorder = Recorder()
    gate = threading.Event()

    def slow(jobs):
        gate.wait(10)
        return recorder(jobs)

    scheduler = Scheduler(slow, batch_window_s=0.0)
    try:
        for name in ("a", "b"):
            scheduler.open_lane(name)
        first = scheduler.submit(job("a", 1))
        time.sleep(0.05)
        second = scheduler.submit(job("b", 1))
        gate.set()
        first.result(10), second.result(10)
        assert recorder.batches == [["a"], ["b"]]
    finally:
        scheduler.stop()


def test_window_never_delays_a_lone_adapter():
    recorder = Recorder()
    scheduler = Scheduler(recorder, batch_window_s=5.0)
    try:
        scheduler.open_lane("solo")
        scheduler.open_lane("idle")  # open but never used: not waited for
        started = time.monotonic()
        for seq_id in (1, 2, 3):
            scheduler.submit(job("solo", seq_id)).result(10)
        assert time.monotonic() - started < 2.0
        assert recorder.batches == [["solo"]] * 3
    finally:
        scheduler.stop()
