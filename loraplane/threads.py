"""CPU threads: how many each service of a host gets, and small work on two threads without OpenMP's fork/join.

Services that share a host share its cores: torch's default (an intra-op and an inter-op pool as large as the
machine, in every process) makes a trainer and a sampler on the same cores oversubscribe them, and each op of each
then waits for threads the other process holds (issue 31: an 8-token sample went from 0.7 s alone to 10-16 s
while another tenant trained on a 2-core machine). The local cluster knows which services it runs and hands each
its share (`thread_shares`) through LORAPLANE_TORCH_THREADS; a service applies it at start (`apply_service_threads`).
A service started alone, with the setting unset, keeps torch's default: every core.

`share_work` is for work of many small independent pieces (LoRA products of one adapter's token range, AdamW on a group
of tensors): each piece runs single-threaded, and the pieces are shared between the calling thread and one helper
thread (torch releases the GIL inside its kernels). On a CPU whose cores other processes also use, an intra-op
parallel region waits for its slowest thread at every op; here a descheduled helper only means the caller does
more pieces itself.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator

THREADS_ENV = "LORAPLANE_TORCH_THREADS"
log = logging.getLogger(__name__)


def host_cores() -> int:
    """The cores this process may run on: its CPU affinity, which taskset, cpusets and container pinning narrow."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def thread_shares(cores: int, services: int) -> list[int]:
    """Threads for each of `services` compute services (trainers, samplers) sharing `cores`: the cores split as
    evenly as they go, the first services taking the remainder, and never fewer than one thread each (more services
    than cores then share cores, one thread apiece, which is still far better than every service using all of them)."""
    if cores < 1:
        raise ValueError(f"cores must be at least 1, got {cores}")
    if services < 1:
        raise ValueError(f"services must be at least 1, got {services}")
    each, extra = divmod(cores, services)
    return [max(1, each + (1 if i < extra else 0)) for i in range(services)]


def apply_service_threads(service: str, threads: int | None = None) -> int:
    """Sizes this process's torch thread pools (intra-op and inter-op) for the service it runs, once, at start:
    `threads`, else the torch_threads setting (LORAPLANE_TORCH_THREADS, which the local cluster sets to each
    service's share), else torch's default (every core). Exports the count as the loraplane_torch_threads gauge.
    Returns the intra-op count in effect."""
    import torch

    from loraplane.config import Settings
    from loraplane.metrics import register_source

    if threads is None:
        threads = Settings().torch_threads
    if threads < 0:
        raise ValueError(f"torch_threads ({THREADS_ENV}) must be 0 (every core) or a positive count, got {threads}")
    if threads:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            # Only possible before the first inter-op work; an embedding process may have started some already.
            log.info("inter-op threads stay at %d (already in use)", torch.get_num_interop_threads())
    log.info("%s: %d torch threads (%d inter-op) on %d cores", service, torch.get_num_threads(),
             torch.get_num_interop_threads(), host_cores())
    register_source(service, str(os.getpid()), {
        "loraplane_torch_threads": ("Intra-op CPU threads of this service's torch (its share of the host's cores)",
                                    torch.get_num_threads)})
    return torch.get_num_threads()


def share_work(items: list, one: Callable) -> None:
    """one(item) for every item, on the calling thread and the helper thread, each single-threaded. Grad and
    inference modes of the caller apply on the helper too. The first exception is re-raised here."""
    _SHARED.run(items, one)


@contextlib.contextmanager
def one_thread(threads: int | None = None) -> Iterator[None]:
    """One intra-op thread for the calling thread only (OpenMP's and MKL's counts are per thread), restored after."""
    import torch

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
        import torch

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
        import torch

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
