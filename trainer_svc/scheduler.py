"""Request scheduler: one worker thread runs all model work; callers (the asyncio servicer) submit jobs.

Per adapter, jobs run in seq_id order: a job whose predecessor has not arrived waits, and fails with
FAILED_PRECONDITION after `gap_timeout_s` if the gap is not filled. A retried seq_id with the same payload hash gets
the first job's outcome (a bounded per-adapter cache, keyed by seq_id + payload hash) and is never applied twice; a
different payload under a used seq_id is ALREADY_EXISTS. Across adapters the worker serves runnable adapters
round-robin, and gathers the head Forward/ForwardBackward jobs of several adapters into one fused batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplane.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LoraplaneError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger(__name__)

FUSABLE = frozenset({"forward_backward", "forward"})
# The kind of a request that failed validation: it runs in its seq_id's turn, changes nothing, and its error is
# that seq_id's recorded outcome (the payload is the error).
REJECTED = "rejected"
# A lane that submitted a fusable job this recently is expected to send another: the batch window waits for it.
ACTIVE_LANE_S = 30.0
# The longest a batch keeps gathering, in batch windows from its leader's arrival.
GATHER_LIMIT = 20
# Failures that say nothing about the request itself: the seq_id is not consumed and a retry runs it again.
TRANSIENT = (Unavailable, DeadlineExceeded, ResourceExhausted)


@dataclass
class Job:
    adapter: str
    seq_id: int
    kind: str
    payload: Any
    payload_hash: bytes
    tokens: int = 0
    # Re-run from the journal by a restarted trainer: not journaled again.
    replayed: bool = False
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class _Lane:
    """One adapter's ordering state."""

    next_seq: int = 1
    pending: dict[int, Job] = field(default_factory=dict)
    done: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # seq -> (hash, future)
    waiting_since: float | None = None
    # When this adapter last submitted a fusable job (the batch window waits only for lanes in use).
    last_fusable: float | None = None


@dataclass
class SchedulerStats:
    batches: int = 0
    fused_batches: int = 0
    max_fused_adapters: int = 0
    jobs: int = 0


class Scheduler:
    def __init__(
        self,
        execute: Callable[[list[Job]], list[Any]],
        *,
        gap_timeout_s: float = 30.0,
        max_queue: int = 1024,
        max_queue_per_adapter: int = 64,
        result_cache_size: int = 256,
        max_fused_adapters: int = 8,
        max_fused_tokens: int = 16384,
        batch_window_s: float = 0.0,
    ):
        self._execute = execute
        self.gap_timeout_s = gap_timeout_s
        self.max_queue = max_queue
        self.max_queue_per_adapter = max_queue_per_adapter
        self.result_cache_size = result_cache_size
        self.max_fused_adapters = max_fused_adapters
        self.max_fused_tokens = max_fused_tokens
        self.batch_window_s = batch_window_s
        self.stats = SchedulerStats()
        self._lanes: dict[str, _Lane] = {}
        self._rotation: collections.deque[str] = collections.deque()
        self._control: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._cond = threading.Condition()
        self._queued = 0
        self._held = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="trainer-worker", daemon=True)
        self._thread.start()

    # ---- lanes ----
    def open_lane(self, adapter: str, next_seq: int = 1) -> None:
        with self._cond:
            self._lanes[adapter] = _Lane(next_seq=next_seq)
            self._rotation.append(adapter)

    def close_lane(self, adapter: str, reason: str, error: Exception | None = None) -> None:
        """Queued requests fail with NOT_FOUND(reason), or with `error` (a fleet moved the adapter away)."""
        with self._cond:
            lane = self._lanes.pop(adapter, None)
            if adapter in self._rotation:
                self._rotation.remove(adapter)
            if lane is None:
                return
            for job in lane.pending.values():
                self._queued -= 1
                if not job.future.done():
                    job.future.set_exception(error or NotFound(reason, field="adapter"))

    def remember(self, adapter: str, seq_id: int, payload_hash: bytes, outcome) -> None:
        """Records the outcome of a seq_id that ran before a restart (from the journal), so a retry of it is
        answered with that outcome and the lane continues after it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        with self._cond:
            lane = self._lanes[adapter]
            lane.done[seq_id] = (payload_hash, future)
            lane.done.move_to_end(seq_id)
            while len(lane.done) > self.result_cache_size:
                lane.done.popitem(last=False)
            lane.next_seq = max(lane.next_seq, seq_id + 1)

    def last_seq_id(self, adapter: str) -> int:
        with self._cond:
            lane = self._lanes.get(adapter)
            return 0 if lane is None else lane.next_seq - 1

    # ---- submission ----
    def submit(self, job: Job) -> concurrent.futures.Future:
        """Queues a sequenced job (or returns the earlier outcome of the same seq_id)."""
        if job.seq_id < 1:
            raise InvalidArgument(f"seq_id must be >= 1 (1, 2, 3, ... per adapter), got {job.seq_id}",
                                  field="seq_id")
        with self._cond:
            lane = self._lanes.get(job.adapter)
            if lane is None:
                raise NotFound(f"adapter {job.adapter!r} does not exist on this trainer", field="adapter")
            earlier = lane.done.get(job.seq_id)
            if earlier is None and job.seq_id in lane.pending:
                queued = lane.pending[job.seq_id]
                earlier = (queued.payload_hash, queued.future)
            if earlier is not None:
                payload_hash, future = earlier
                if payload_hash != job.payload_hash:
                    raise AlreadyExists(
                        f"seq_id {job.seq_id} of adapter {job.adapter!r} was already used with a different payload",
                        field="seq_id")
                return future
            if job.seq_id < lane.next_seq:
                raise AlreadyExists(
                    f"seq_id {job.seq_id} of adapter {job.adapter!r} already ran (next expected: {lane.next_seq}) "
                    f"and its result is no longer cached", field="seq_id")
            if self._queued >= self.max_queue:
                raise ResourceExhausted(f"trainer queue is full ({self.max_queue} requests); retry later",
                                        field="seq_id")
            if len(lane.pending) >= self.max_queue_per_adapter:
                raise ResourceExhausted(
                    f"adapter {job.adapter!r} has {len(lane.pending)} queued requests (limit "
                    f"{self.max_queue_per_adapter}); retry later", field="seq_id")
            lane.pending[job.seq_id] = job
            self._queued += 1
            if job.kind in FUSABLE:
                lane.last_fusable = job.arrived
            if job.seq_id != lane.next_seq and lane.waiting_since is None:
                lane.waiting_since = time.monotonic()
            self._cond.notify_all()
            return job.future

    def control(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs fn on the worker thread between batches (pool changes that must not race model work)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise Unavailable("trainer is shutting down")
            self._control.append((fn, future))
            self._cond.notify_all()
        return future

    # ---- test/ops hook: hold the worker so several requests queue up and fuse deterministically ----
    def peek_next(self, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
        """The adapter whose queued job the worker will most likely take next (outside `exclude`), for backends
        that start copying its state to the device while the current batch runs. A hint: nothing is reserved."""
        with self._cond:
            for adapter in self._rotation:
                if adapter not in exclude and self._head(adapter) is not None:
                    return adapter
        return None

    def hold(self) -> None:
        with self._cond:
            self._held += 1

    def release(self) -> None:
        with self._cond:
            self._held = max(0, self._held - 1)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(30)

    # ---- worker ----
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping:
                        self._fail_everything()
                        return
                    self._expire_gaps()
                    if self._control:
                        control = self._control.popleft()
                        batch = None
                        break
                    timeout = self._wait_timeout()
                    if not self._held:
                        gather = self._gather_wait()
                        if gather > 0:
                            # A fusable batch forms now but others are likely to join within the window: wait
                            # for them (woken early by each arrival) and form the batch afterwards.
                            self._cond.wait(timeout=min(gather, timeout))
                            continue
                        batch = self._next_batch()
                        if batch:
                            control = None
                            break
                    self._cond.wait(timeout=timeout)
            if control is not None:
                fn, future = control
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                    future.set_exception(exc)
                continue
            self._run_batch(batch)

    def _wait_timeout(self) -> float:
        waits = [lane.waiting_since for lane in self._lanes.values() if lane.waiting_since is not None]
        if not waits:
            return 1.0
        return max(0.001, min(waits) + self.gap_timeout_s - time.monotonic())

    def _expire_gaps(self) -> None:
        now = time.monotonic()
        for adapter, lane in self._lanes.items():
            if lane.waiting_since is None or lane.next_seq in lane.pending:
                continue
            if now - lane.waiting_since < self.gap_timeout_s:
                continue
            for seq_id in sorted(lane.pending):
                job = lane.pending.pop(seq_id)
                self._queued -= 1
                if not job.future.done():
                    job.future.set_exception(FailedPrecondition(
                        f"seq_id {seq_id} of adapter {adapter!r} waited {self.gap_timeout_s:g}s for seq_id "
                        f"{lane.next_seq}, which never arrived; resend from seq_id {lane.next_seq}",
                        field="seq_id"))
            lane.waiting_since = None

    def _gather_wait(self) -> float:
        """Seconds the next fusable batch should still wait for more adapters to join (0 = form it now).

        Forming the batch only after the window matters: a client's tenants' requests arrive a millisecond or so
        apart, and a batch formed at the first arrival runs that one alone and the rest as a second batch. The
        window restarts with every joiner (up to GATHER_LIMIT windows after the leader arrived), so requests that
        queued while the worker was busy run at once. Only lanes that submitted a fusable job within
        ACTIVE_LANE_S count as possible joiners; once all of them (or max_fused_adapters) have a head of the
        leader's kind queued, nothing is gained by waiting."""
        if not self.batch_window_s:
            return 0.0
        leader = None
        for adapter in self._rotation:
            head = self._head(adapter)
            if head is not None:
                leader = head
                break
        if leader is None or leader.kind not in FUSABLE:
            return 0.0
        now = time.monotonic()
        ready = 0
        active = 0
        latest = leader.arrived
        for adapter, lane in self._lanes.items():
            head = lane.pending.get(lane.next_seq)
            if head is not None and head.kind == leader.kind:
                ready += 1
                active += 1
                latest = max(latest, head.arrived)
            elif lane.last_fusable is not None and now - lane.last_fusable < ACTIVE_LANE_S:
                active += 1
        if ready >= min(self.max_fused_adapters, active):
            return 0.0
        # The window restarts with every joiner (a client sends its tenants' requests one after another, each a
        # millisecond or so apart), up to GATHER_LIMIT windows after the leader arrived.
        deadline = min(latest + self.batch_window_s, leader.arrived + GATHER_LIMIT * self.batch_window_s)
        return max(0.0, deadline - now)

    def _head(self, adapter: str) -> Job | None:
        lane = self._lanes[adapter]
        return lane.pending.get(lane.next_seq)

    def _next_batch(self) -> list[Job] | None:
        """Round-robin: the first runnable adapter in rotation order leads; if its head job is fusable, the heads
        of the following runnable adapters of the same kind join (one job per adapter) within the limits."""
        for _ in range(len(self._rotation)):
            adapter = self._rotation[0]
            self._rotation.rotate(-1)
            head = self._head(adapter)
            if head is None:
                continue
            batch = [head]
            if head.kind in FUSABLE:
                tokens = head.tokens
                for other in list(self._rotation):
                    if len(batch) >= self.max_fused_adapters:
                        break
                    if other == adapter:
                        continue
                    candidate = self._head(other)
                    if (candidate is None or candidate.kind != head.kind
                            or tokens + candidate.tokens > self.max_fused_tokens):
                        continue
                    batch.append(candidate)
                    tokens += candidate.tokens
                    # The adapters that rode along go to the back too, so nobody is served twice in a row.
                    self._rotation.remove(other)
                    self._rotation.append(other)
            for job in batch:
                self._take(job)
            return batch
        return None

    def _take(self, job: Job) -> None:
        lane = self._lanes[job.adapter]
        del lane.pending[job.seq_id]
        self._queued -= 1

    def _run_batch(self, batch: list[Job]) -> None:
        try:
            outcomes = self._execute(batch)
        except Exception as exc:  # each caller of the batch gets the failure
            if not isinstance(exc, LoraplaneError):
                log.exception("batch of %d jobs failed", len(batch))
            outcomes = [exc] * len(batch)
        self.stats.batches += 1
        self.stats.jobs += len(batch)
        if len(batch) > 1:
            self.stats.fused_batches += 1
        self.stats.max_fused_adapters = max(self.stats.max_fused_adapters, len(batch))
        with self._cond:
            for job, outcome in zip(batch, outcomes):
                lane = self._lanes.get(job.adapter)
                transient = isinstance(outcome, TRANSIENT)
                if lane is not None and not transient:
                    lane.next_seq = job.seq_id + 1
                    lane.done[job.seq_id] = (job.payload_hash, job.future)
                    while len(lane.done) > self.result_cache_size:
                        lane.done.popitem(last=False)
                    lane.waiting_since = (time.monotonic() if lane.pending and lane.next_seq not in lane.pending
                                          else None)
                if not job.future.done():
                    if isinstance(outcome, BaseException):
                        job.future.set_exception(outcome)
                    else:
                        job.future.set_result(outcome)
            self._cond.notify_all()

    def _fail_everything(self) -> None:
        for lane in self._lanes.values():
            for job in lane.pending.values():
                if not job.future.done():
                    job.future.set_exception(Unavailable("trainer is shutting down"))
            lane.pending.clear()
        for _, future in self._control:
            if not future.done():
                future.set_exception(Unavailable("trainer is shutting down"))
        self._control.clear()
