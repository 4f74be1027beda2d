"""Small CPU work on two threads without OpenMP's fork/join per op.

Used where the work is many small independent pieces (LoRA products of one adapter's token range, AdamW on a group
of tensors): each piece runs single-threaded, and the pieces are shared between the calling thread and one helper
thread (torch releases the GIL inside its kernels). On a CPU whose cores other processes also use, an intra-op
parallel region waits for its slowest thread at every op; here a descheduled helper only means the caller does
more pieces itself.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

import torch


def share_work(items: list, one: Callable) -> None:
    """one(item) for every item, on the calling thread and the helper thread, each single-threaded. Grad and
    inference modes of the caller apply on the helper too. The first exception is re-raised here."""
    _SHARED.run(items, one)


@contextlib.contextmanager
def one_thread(threads: int | None = None) -> Iterator[None]:
    """One intra-op thread for the calling thread only (OpenMP's and MKL's counts are per thread), restored after."""
    threads = torch.get_num_threads() if threads is None else threads
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _Shared:
    """Items spread over the calling thread and one helper thread, each item computed single-threaded (so its bits
    do not depend on which thread ran it). Work is taken item by item from a shared counter: a caller never waits
    for a helper that has not started (another process may hold the other core), only for the item it runs."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def run(self, items: list[int], one) -> None:
        threads = torch.get_num_threads()
        job = _Job(items, one, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if threads > 1 and len(items) > 1:
            self._ensure_thread()
            self._queue.put(job)
        with one_thread(threads):
            job.work()
        job.wait()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="loraplane-helper", daemon=True)
                    self._thread.start()
                    # Ended before the interpreter finalizes: a thread still parked in torch/OpenMP state while
                    # the C++ runtime tears down can abort the process at exit.
                    atexit.register(self._stop)

    def _stop(self) -> None:
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with one_thread(torch.get_num_threads()), torch.inference_mode(job.inference), \
                    torch.set_grad_enabled(job.grad):
                job.work()


class _Job:
    def __init__(self, items: list[int], one, grad: bool, inference: bool):
        self.items, self.one, self.grad, self.inference = items, one, grad, inference
        self._next = 0
        self._pending = len(items)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        while True:
            with self._lock:
                if self._next >= len(self.items):
                    return
                item = self.items[self._next]
                self._next += 1
            try:
                if self.error is None:
                    self.one(item)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                self.error = exc
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


_SHARED = _Shared()
