"""The trainer's durability, beside its service: the adapter index, the write-ahead journal of sequenced requests,
checkpoints of training state to the registry, and recovery (latest checkpoint, then the journal replayed).

The service asks it at each point where an acknowledged mutation must survive a crash: a new adapter (its record,
durable before it is acknowledged), every batch the worker runs (requests journaled before they run, outcomes
after), a published version (its outcome once the registry answered), a deleted adapter; after an OptimStep or a
LoadState it takes a checkpoint when one is due. At start-up `recover` rebuilds every adapter through the service's
own worker-side operations, so a crash loses no acknowledged work and clients continue with their next seq_id.
Without a journal (no Redis) it keeps only the adapters' records (their weights dtype and uid).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from loraplane.adapter_format import TrainingState, parse_training_state, serialize_training_state
from loraplane.errors import FailedPrecondition, LoraplaneError, NotFound, Unavailable
from loraplane.fleet import is_moved
from loraplane.lora import LoraSpec
from loraplane.registry_client import VERSION_KIND_TRAINING_STATE, AdapterVersion, RegistryClient
from trainer_svc.journal import (
    OUTCOME,
    VOID,
    AdapterRecord,
    Checkpoint,
    JournalEntry,
    TrainingJournal,
    outcome_to_plain,
    payload_from_plain,
    payload_to_plain,
)
from trainer_svc.scheduler import FUSABLE, REJECTED, TRANSIENT, Job

if TYPE_CHECKING:
    from trainer_svc.service import TrainerLimits, TrainerService

log = logging.getLogger(__name__)

# Registry metadata that marks a training-state version as the trainer's own recovery checkpoint.
CHECKPOINT_KEY = "loraplane.checkpoint"
# Kinds whose recorded outcome answers a replay without running them again (they change no adapter tensors).
ANSWERED_FROM_JOURNAL = frozenset({"forward", REJECTED, "publish", "save_state"})


class Durability:
    """One trainer's journal, checkpoints and recovery. `trainer` is the service it keeps durable: recovery and
    checkpoints go through its worker (`_on_worker`), its pool and scheduler, and its worker-side operations
    (`_new_state`, `_install`, `_training_state`, `_info`, `_recorded_outcome`)."""

    def __init__(self, trainer: TrainerService, registry: RegistryClient, limits: TrainerLimits,
                 journal: TrainingJournal | None):
        self.trainer = trainer
        self.registry = registry
        self.limits = limits
        self.journal = journal
        # Per adapter: its index record, the newest journal entry ids (a checkpoint trims up to the oldest of them),
        # and (step, time) of the last checkpoint.
        self._records: dict[str, AdapterRecord] = {}
        self._recent_entries: dict[str, collections.deque[str]] = {}
        self._checkpoint_marks: dict[str, tuple[int, float]] = {}
        # Outcomes journaled with the next requests' append rather than on their own (worker thread only): one
        # fsync per request instead of two. Safe to lose in a crash: replay recomputes them (see journal_outcomes).
        self._deferred_outcomes: list[tuple[str, int, bytes, object]] = []
        self._checkpoint_locks: dict[str, asyncio.Lock] = {}

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    # ---------------------------------------------------------------- the adapters' records
    def record(self, name: str) -> AdapterRecord | None:
        return self._records.get(name)

    def weights_dtype(self, name: str) -> str:
        record = self._records.get(name)
        return record.weights_dtype if record is not None else "float32"

    async def put_new(self, record: AdapterRecord) -> None:
        """Durable before it is acknowledged: a restarted trainer rebuilds the adapter from this record."""
        if self.journal is not None:
            await asyncio.to_thread(self.journal.put_adapter, record)

    async def drop_new(self, name: str) -> None:
        """Undoes `put_new` of an adapter whose creation failed."""
        if self.journal is not None:
            await asyncio.to_thread(self.journal.drop_adapter, name)

    def adopt(self, record: AdapterRecord) -> None:
        self._records[record.name] = record
        self._recent_entries[record.name] = collections.deque(maxlen=max(1, self.limits.journal_retry_window))
        checkpoint = record.checkpoint
        self._checkpoint_marks[record.name] = (checkpoint.step if checkpoint else 0, time.monotonic())

    def forget(self, name: str) -> AdapterRecord | None:
        """Stops tracking the adapter here (its journal and checkpoints stay); returns its record."""
        self._recent_entries.pop(name, None)
        self._checkpoint_marks.pop(name, None)
        return self._records.pop(name, None)

    async def deleted(self, name: str, record: AdapterRecord | None, *, with_registry: bool) -> None:
        """The adapter was deleted: its journal goes, and its checkpoints (one by one, unless `with_registry`: the
        registry's copy of the adapter goes as a whole, checkpoints and all)."""
        if self.journal is None:
            return
        await asyncio.to_thread(self.journal.drop_adapter, name)
        if record is not None and not with_registry:
            await self.delete_checkpoints(name, record.checkpoints)

    # ---------------------------------------------------------------- the journal (worker side)
    def run_journaled(self, jobs: list[Job], run: Callable[[list[Job]], list]) -> list:
        """Runs `jobs` with `run` on the worker thread. With a journal, each new request is journaled before it runs
        (LoadState once its source is resolved, in its runner: `journal_resolved`) and its outcome after; a journal
        that cannot be written fails the jobs as UNAVAILABLE before they change anything."""
        if self.journal is None:
            return run(jobs)
        fresh = [job for job in jobs if not job.replayed and job.kind != "load_state"]
        if fresh:
            try:
                self._journal_requests(fresh)
            except Unavailable as exc:
                return [exc] * len(jobs)
        outcomes = run(jobs)
        self._journal_outcomes(jobs, outcomes)
        return outcomes

    def journal_resolved(self, job: Job) -> None:
        """A live LoadState, journaled with the exact version its source resolved to (`job.payload`)."""
        if self.journal is not None and not job.replayed:
            self._journal_requests([job])

    def _journal_requests(self, jobs: list[Job]) -> None:
        deferred = self._live_deferred_outcomes()
        entry_ids = self.journal.append_requests(
            [(job.adapter, job.seq_id, job.kind, job.payload_hash, payload_to_plain(job.kind, job.payload))
             for job in jobs], outcomes=deferred)
        del self._deferred_outcomes[:len(deferred)]
        for job, entry_id in zip(jobs, entry_ids):
            recent = self._recent_entries.get(job.adapter)
            if recent is not None:
                recent.append(entry_id)

    def _journal_outcomes(self, jobs: list[Job], outcomes: list) -> None:
        records = []
        for job, outcome in zip(jobs, outcomes):
            if job.replayed:
                continue
            if isinstance(outcome, TRANSIENT):
                records.append((job.adapter, job.seq_id, VOID, None))
            elif isinstance(outcome, BaseException):
                records.append((job.adapter, job.seq_id, OUTCOME, outcome_to_plain(outcome)))
            elif job.kind == "load_state":
                records.append((job.adapter, job.seq_id, OUTCOME, {"load_state_step": outcome.step}))
            elif job.kind not in ("publish", "save_state"):  # those once the registry has answered
                records.append((job.adapter, job.seq_id, OUTCOME, outcome_to_plain(outcome)))
        # A request's outcome only answers a retry of it after a restart; if it is lost with the process, replay
        # runs the request again and recomputes it (deterministically), so it may wait for the next request's
        # append. Not so a void (replay would apply what the client was told did not happen) nor an outcome a
        # checkpoint is about to cover (that request is not replayed): those are written now.
        voids = [r for r in records if r[2] == VOID]
        self._deferred_outcomes.extend(r for r in records if r[2] != VOID)
        if voids:
            self._flush_outcomes(voids)
        for job, outcome in zip(jobs, outcomes):
            if not job.replayed and job.kind in ("optim_step", "load_state") and not isinstance(outcome,
                                                                                               BaseException):
                self._maybe_checkpoint(job)

    def _live_deferred_outcomes(self) -> list[tuple[str, int, bytes, object]]:
        """The deferred outcomes, less those of adapters deleted meanwhile (their journal is gone for good)."""
        self._deferred_outcomes = [r for r in self._deferred_outcomes if r[0] in self._records]
        return list(self._deferred_outcomes)

    def _flush_outcomes(self, voids: list | None = None) -> None:
        deferred = self._live_deferred_outcomes()
        self.journal.append_outcomes(deferred + (voids or []))
        del self._deferred_outcomes[:len(deferred)]

    async def published(self, adapter: str, seq_id: int, version: AdapterVersion, step: int,
                        idempotency_key: str) -> None:
        """The outcome of a PublishWeights/SaveState, once the registry has answered (a retry after a restart gets
        the same version)."""
        if self.journal is not None and seq_id:
            await asyncio.to_thread(self.journal.append_outcomes, [(adapter, seq_id, OUTCOME, {
                "version": version.SerializeToString(), "step": step, "idempotency_key": idempotency_key})])

    # ---------------------------------------------------------------- checkpoints
    def _maybe_checkpoint(self, job: Job) -> None:
        """Worker side, after an OptimStep or LoadState: when a checkpoint is due, captures the adapter's state
        (host copies, no pending gradients right after a step) and hands the upload to the event loop."""
        state = self.trainer.pool.get(job.adapter)
        record = self._records.get(job.adapter)
        if record is None or state.has_grads():
            return
        last_step, last_time = self._checkpoint_marks.get(job.adapter, (0, time.monotonic()))
        every_steps, every_s = self.limits.checkpoint_every_steps, self.limits.checkpoint_every_s
        due = (job.kind == "load_state"
               or (every_steps > 0 and state.step - last_step >= every_steps)
               or (every_s > 0 and state.step != last_step and time.monotonic() - last_time >= every_s))
        if not due:
            return
        self._checkpoint_marks[job.adapter] = (state.step, time.monotonic())
        self._flush_outcomes()
        recent = self._recent_entries.get(job.adapter)
        trim_from = recent[0] if recent else ""
        training = self.trainer._training_state(state)
        asyncio.run_coroutine_threadsafe(
            self._store_checkpoint(job.adapter, record.uid, job.seq_id, training, trim_from), self.trainer._loop)

    async def _store_checkpoint(self, adapter: str, uid: str, seq_id: int, training: TrainingState,
                                trim_from: str) -> Checkpoint | None:
        """Uploads a checkpoint, points the adapter's record at it, then trims the journal it covers. Until the
        record points at it nothing relies on it, so a failure anywhere leaves the previous checkpoint and the
        whole journal in force."""
        lock = self._checkpoint_locks.setdefault(adapter, asyncio.Lock())
        async with lock:
            try:
                blob = await asyncio.to_thread(serialize_training_state, training)
                version = await self.registry.publish(
                    adapter, blob, kind=VERSION_KIND_TRAINING_STATE, training_step=training.step,
                    metadata={CHECKPOINT_KEY: "auto", "loraplane.seq_id": str(seq_id)},
                    idempotency_key=f"trainer:{uid}:checkpoint:{seq_id}")
                record = self._records.get(adapter)
                if record is None or record.uid != uid:  # deleted (or recreated) while uploading
                    await self.delete_checkpoints(adapter, [Checkpoint(version.version, seq_id, training.step)])
                    return None
                if record.checkpoint is not None and record.checkpoint.seq_id >= seq_id:
                    return record.checkpoint
                checkpoint = Checkpoint(version=version.version, seq_id=seq_id, step=training.step)
                kept = max(1, self.limits.checkpoints_kept)
                dropped = (record.checkpoints + [checkpoint])[:-kept]
                try:
                    await asyncio.to_thread(self.journal.put_adapter, record.with_checkpoint(checkpoint, kept))
                except Unavailable as exc:
                    if is_moved(exc):  # another fleet member serves it now: this upload is nobody's
                        await self.delete_checkpoints(adapter, [checkpoint])
                        return None
                    raise
                record.checkpoints = (record.checkpoints + [checkpoint])[-kept:]
                if trim_from:
                    await asyncio.to_thread(self.journal.trim, adapter, trim_from)
                await self.delete_checkpoints(adapter, dropped)
                return checkpoint
            except Exception:
                log.warning("checkpoint of %s at seq_id %d failed; the journal keeps everything since the last one",
                            adapter, seq_id, exc_info=True)
                return None

    async def delete_checkpoints(self, adapter: str, checkpoints: Sequence[Checkpoint]) -> None:
        for checkpoint in checkpoints:
            try:
                await self.registry.delete_version(adapter, checkpoint.version)
            except LoraplaneError as exc:
                if not isinstance(exc, NotFound):
                    log.warning("could not delete checkpoint v%d of %s: %s", checkpoint.version, adapter, exc)

    # ---------------------------------------------------------------- recovery
    async def recover(self, names: Sequence[str] | None = None) -> list[str]:
        """Rebuilds every adapter the journal's index names: its latest checkpoint, then its journal replayed in
        order, so params, moments, step and last_seq_id equal those before the crash and a client's retry of a
        journaled request is answered with its outcome. Returns the adapters that could not be recovered (a
        non-transient failure: logged loudly, their records kept for an operator); transient failures raise."""
        if self.journal is None:
            return []
        records = await asyncio.to_thread(self.journal.adapters)
        if names is not None:  # a fleet member: only what is placed on it
            records = [r for r in records if r.name in names]
        results = await asyncio.gather(*(self._recover_adapter(r) for r in records), return_exceptions=True)
        failed = []
        for record, result in zip(records, results):
            if isinstance(result, TRANSIENT):
                raise result
            if isinstance(result, BaseException):
                log.error("adapter %s could not be recovered: %s", record.name, result,
                          exc_info=not isinstance(result, LoraplaneError))
                failed.append(record.name)
        return failed

    async def _recover_adapter(self, record: AdapterRecord) -> None:
        trainer = self.trainer
        if record.base_model != trainer.base_model:
            raise FailedPrecondition(f"adapter {record.name!r} was trained on {record.base_model!r}, this trainer "
                                     f"serves {trainer.base_model!r}")
        spec = LoraSpec.create(record.rank, record.alpha, record.target_modules, record.seed,
                               max_rank=max(record.rank, self.limits.max_lora_rank),
                               expert_layout=record.expert_layout)
        checkpoint = record.checkpoint
        loaded = None
        if checkpoint is not None:
            _meta, blob = await self.registry.download(record.name, version=checkpoint.version)
            loaded = await asyncio.to_thread(parse_training_state, blob)
        entries = await asyncio.to_thread(self.journal.entries, record.name)

        def rebuild():
            state = trainer._new_state(record, spec)
            if loaded is not None:
                trainer._install(state, loaded.params, loaded.exp_avg, loaded.exp_avg_sq, loaded.step)
            return state

        state = await trainer._on_worker(rebuild)
        trainer._adopt(record)
        covered = checkpoint.seq_id if checkpoint is not None else 0
        trainer.scheduler.open_lane(record.name, next_seq=covered + 1)
        for entry in entries:
            self._recent_entries[record.name].append(entry.entry_id)
            if entry.seq_id <= covered or (entry.has_outcome and entry.kind in ANSWERED_FROM_JOURNAL):
                if entry.has_outcome:
                    trainer.scheduler.remember(record.name, entry.seq_id, entry.payload_hash,
                                               trainer._recorded_outcome(state, entry))
                continue
            await self._replay(record.name, entry)
        log.info("recovered adapter %s: checkpoint %s, %d journal entries, step %d, last seq_id %d", record.name,
                 f"v{checkpoint.version}" if checkpoint else "none", len(entries), state.step,
                 trainer.scheduler.last_seq_id(record.name))

    async def _replay(self, adapter: str, entry: JournalEntry) -> None:
        payload = payload_from_plain(entry.kind, entry.payload)
        tokens = sum(d.length for d in payload[0]) if entry.kind in FUSABLE else 0
        job = Job(adapter=adapter, seq_id=entry.seq_id, kind=entry.kind, payload=payload,
                  payload_hash=entry.payload_hash, tokens=tokens, replayed=True)
        try:
            await asyncio.wrap_future(self.trainer.scheduler.submit(job))
        except TRANSIENT:
            raise
        except LoraplaneError:
            pass  # the live run got the same error; it is this seq_id's recorded outcome now
