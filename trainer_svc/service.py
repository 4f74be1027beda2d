"""The trainer's domain object: adapters, sequenced training requests, publishing. No gRPC here; the servicer
converts protobuf <-> these calls and `loraplane.rpc` maps the domain errors to status codes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from loraplane.adapter_format import TrainingState, adapter_writer, parse_training_state, serialize_training_state
from loraplane.auth import OPEN, Identity, TenantCounter
from loraplane.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LoraplaneError,
    NotFound,
    shown,
)
from loraplane.lora import LoraSpec
from loraplane.registry_client import (
    CHUNK_BYTES,
    VERSION_KIND_TRAINING_STATE,
    VERSION_KIND_WEIGHTS,
    AdapterVersion,
    RegistryClient,
    StreamedBlob,
    expert_layout_name,
    lora_config,
    weights_dtype_name,
)
from trainer_svc.backends.base import BatchItem, ItemResult, TrainerBackend
from trainer_svc.durability import CHECKPOINT_KEY, Durability
from trainer_svc.journal import (
    AdapterRecord,
    JournalEntry,
    ResolvedSource,
    TrainingJournal,
    outcome_from_plain,
)
from trainer_svc.losses import supported_losses
from trainer_svc.optimizer import AdamHyper, StepOutcome
from trainer_svc.pool import AdapterPool, AdapterState
from trainer_svc.scheduler import FUSABLE, REJECTED, Job, Scheduler
from trainer_svc.upload_spool import publish_before_upload
from trainer_svc.validation import (
    DatumPayload,
    validate_adapter_name,
    validate_alias,
    validate_aliases,
    validate_data,
    validate_metadata,
    validate_page,
    validate_weights_dtype,
)

log = logging.getLogger(__name__)



@dataclass
class TrainerLimits:
    max_lora_rank: int = 128
    device_slots: int = 8
    # 0 = off; else resident adapters' measured bytes (params, grads, AdamW moments) stay within it (pool.py).
    device_memory_bytes: int = 0
    max_adapters: int = 1024
    max_batch_datums: int = 1024
    # 0 = the base model's own limit.
    max_context_length: int = 0
    max_request_tokens: int = 65536
    max_fused_adapters: int = 8
    max_fused_tokens: int = 16384
    gap_timeout_s: float = 30.0
    max_queue: int = 1024
    max_queue_per_adapter: int = 64
    result_cache_size: int = 256
    # How long an idle worker waits, from a fusable request's arrival, for other active adapters' requests to join
    # its batch (0 = run at once). Concurrent clients' requests arrive ~1 ms apart; without a window the first
    # runs alone and the rest as a second batch. Never waited when all active adapters are already queued.
    batch_window_s: float = 0.003
    registry_timeout_s: float = 60.0
    # Durability (with a journal): an automatic training-state checkpoint after the OptimStep that completes this
    # many steps since the last one, or the first OptimStep this many seconds after it (0 = never by that rule).
    checkpoint_every_steps: int = 50
    checkpoint_every_s: float = 300.0
    checkpoints_kept: int = 2
    # How many of the newest requests a checkpoint leaves in the journal, so a client's retry of a request that a
    # checkpoint already covers is still answered after a restart (pipelined clients have this many in flight).
    journal_retry_window: int = 16


@dataclass
class AdapterInfo:
    name: str
    spec: LoraSpec
    base_model: str
    step: int
    last_seq_id: int
    resident: bool
    parameter_count: int
    weights_dtype: str = "float32"


@dataclass(frozen=True)
class LoraConfig:
    """CreateAdapter's LoRA settings as the caller gave them (0 / empty = the defaults); `LoraSpec.create`
    validates and canonicalizes them against this trainer's limits."""

    rank: int
    alpha: float = 0.0
    target_modules: tuple[str, ...] = ()
    seed: int = 0
    # The dtype of published weights versions (adapter_format.WEIGHTS_DTYPES); params and optimizer state stay
    # float32 whatever it is.
    weights_dtype: str = "float32"
    # loraplane.lora.EXPERT_LAYOUTS; "" = per_expert. Only meaningful with expert targets.
    expert_layout: str = ""


@dataclass(frozen=True)
class SourceRef:
    """A LoadState source as the caller named it: a version number, an alias, or neither (the newest state).
    alias None = not given; an empty alias that was given is invalid, not "the newest"."""

    name: str
    version: int = 0
    alias: str | None = None


@dataclass
class ExportedBlob:
    """The worker-side result of PublishWeights/SaveState: the blob captured at that seq_id. A retry gets this same
    object back and re-publishes it under the same idempotency key, so the registry returns the same version. A
    weights blob is a StreamedBlob: made once, in upload-sized chunks, and kept, so a retry sends the same bytes."""

    blob: bytes | StreamedBlob | None
    step: int
    idempotency_key: str
    version: AdapterVersion | None = None
    seq_id: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class TrainerService:
    def __init__(self, backend: TrainerBackend, registry: RegistryClient, limits: TrainerLimits | None = None,
                 journal: TrainingJournal | None = None):
        self.backend = backend
        self.registry = registry
        self.limits = limits or TrainerLimits()
        # Journal, checkpoints and recovery (trainer_svc/durability.py).
        self.durability = Durability(self, registry, self.limits, journal)
        description = backend.description
        self.max_context_length = (min(self.limits.max_context_length, description.max_context_length)
                                   if self.limits.max_context_length else description.max_context_length)
        if backend.owns_adapter_tensors:
            # Host bookkeeping only: the backend holds the tensors and its own device residency (base.py).
            self.pool = AdapterPool(torch.device("cpu"), self.limits.max_adapters, self.limits.max_adapters)
        else:
            self.pool = AdapterPool(backend.device, self.limits.device_slots, self.limits.max_adapters,
                                    self.limits.device_memory_bytes)
        self.scheduler = Scheduler(
            self._execute,
            gap_timeout_s=self.limits.gap_timeout_s,
            max_queue=self.limits.max_queue,
            max_queue_per_adapter=self.limits.max_queue_per_adapter,
            result_cache_size=self.limits.result_cache_size,
            max_fused_adapters=min(self.limits.max_fused_adapters, self.limits.device_slots),
            max_fused_tokens=self.limits.max_fused_tokens,
            batch_window_s=self.limits.batch_window_s,
        )
        self._uids: dict[str, str] = {}
        self._creating: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued = TenantCounter("max_queued_requests")
        # A trainer_svc.fleet.FleetMember when this trainer is one of a fleet (it decides which adapters it serves).
        self.fleet = None
        # A trainer_svc.handoff.Handoff when published versions are also pushed to the deployment's samplers.
        self.handoff = None
        # Where versions acknowledged before their upload ended wait for it (trainer_svc/upload_spool.py; None
        # without a data dir), and whether a pushed version is acknowledged so (settings.publish_ack = "pushed").
        self.spool = None
        self.ack_before_upload = False

    @property
    def base_model(self) -> str:
        return self.backend.description.name

    @property
    def journal(self) -> TrainingJournal | None:
        return self.durability.journal

    async def close(self) -> None:
        if self.spool is not None:
            await self.spool.close()
        await asyncio.to_thread(self.scheduler.stop)
        self.durability.close()

    async def _on_worker(self, fn):
        return await asyncio.wrap_future(self.scheduler.control(fn))

    # ---------------------------------------------------------------- adapters
    async def create_adapter(self, name: str, config: LoraConfig, base_model: str = "",
                             keep_last: int = 0, metadata: Mapping[str, str] | None = None, *,
                             caller: Identity = OPEN) -> AdapterInfo:
        self._loop = asyncio.get_running_loop()
        validate_adapter_name(name)
        caller.authorize(name)
        validate_metadata(metadata or {})
        if base_model and base_model != self.base_model:
            raise InvalidArgument(f"base_model {shown(base_model)} differs from this trainer's {self.base_model!r}",
                                  field="base_model")
        spec = LoraSpec.create(int(config.rank), float(config.alpha), list(config.target_modules),
                               int(config.seed), max_rank=self.limits.max_lora_rank,
                               expert_layout=config.expert_layout,
                               available=tuple(self.backend.description.module_dims))
        weights_dtype = validate_weights_dtype(config.weights_dtype)
        if name in self.pool or name in self._creating:
            raise AlreadyExists(f"adapter {name!r} already exists on this trainer", field="name")
        placed = self.fleet is not None and await self.fleet.place_new(name, spec)  # ADAPTER_MOVED if elsewhere
        self._creating.add(name)
        try:
            registered = await self.registry.create_adapter(
                name, lora_config=lora_config(spec.rank, spec.effective_alpha, spec.target_modules, spec.seed,
                                              weights_dtype, spec.expert_layout if spec.has_experts else ""),
                base_model=self.base_model, keep_last=keep_last, metadata=dict(metadata or {}), exist_ok=True)
            self._check_registry_match(name, registered, spec, weights_dtype)

            uid = uuid.uuid4().hex
            record = AdapterRecord(name=name, rank=spec.rank, alpha=spec.alpha, target_modules=list(spec.target_modules),
                                   seed=spec.seed, base_model=self.base_model, uid=uid, weights_dtype=weights_dtype,
                                   expert_layout=spec.expert_layout,
                                   metadata=dict(metadata or {}))
            await self.durability.put_new(record)
            try:
                state = await self._on_worker(lambda: self._new_state(record, spec))
            except BaseException:
                await self.durability.drop_new(name)
                raise
            self._adopt(record)
            self.scheduler.open_lane(name)
            return self._info(state)
        except BaseException:
            if placed:
                await self.fleet.abandon(name)
            raise
        finally:
            self._creating.discard(name)

    def _new_state(self, record: AdapterRecord, spec: LoraSpec) -> AdapterState:
        """Worker side: a fresh adapter (seeded init, zero moments) in the pool."""
        params = self.backend.init_params(spec)
        state = AdapterState(
            name=record.name, spec=spec, base_model=self.base_model, params=params,
            exp_avg={k: torch.zeros_like(v) for k, v in params.items()},
            exp_avg_sq={k: torch.zeros_like(v) for k, v in params.items()},
            metadata=dict(record.metadata))
        self.pool.add(state)
        self.pool.activate([record.name])
        return state

    def _adopt(self, record: AdapterRecord) -> None:
        self._uids[record.name] = record.uid
        self.durability.adopt(record)

    def _check_registry_match(self, name, registered, spec: LoraSpec, weights_dtype: str) -> None:
        # exist_ok lets a restarted trainer train an adapter the registry already knows, but only the same shape.
        got = registered.lora_config
        same = (got.rank == spec.rank and abs(got.alpha - spec.effective_alpha) < 1e-6
                and (list(got.target_modules) or list(spec.target_modules)) == list(spec.target_modules)
                and weights_dtype_name(got.weights_dtype) == weights_dtype
                and (expert_layout_name(got.expert_layout) or "per_expert") == (
                    spec.expert_layout if spec.has_experts else "per_expert")
                and (not registered.base_model or registered.base_model == self.base_model))
        if not same:
            raise AlreadyExists(
                f"adapter {name!r} already exists in the registry with a different LoRA config or base model",
                field="name")

    async def delete_adapter(self, name: str, delete_from_registry: bool = False, *,
                             caller: Identity = OPEN) -> None:
        validate_adapter_name(name)
        caller.authorize(name)
        local = name in self.pool
        if self.fleet is not None:
            self.fleet.require(name)
        if not local and not delete_from_registry:
            raise NotFound(f"name: adapter {shown(name)} does not exist on this trainer", field="name")
        if local:
            self.scheduler.close_lane(name, f"adapter {name!r} was deleted")
            await self._on_worker(lambda: self.pool.remove(name))
            await self._on_worker(lambda: self.backend.delete_adapter(name))
            self._uids.pop(name, None)
            record = self.durability.forget(name)
            await self.durability.deleted(name, record, with_registry=delete_from_registry)
            if self.fleet is not None:
                await self.fleet.deleted(name)
        if delete_from_registry:
            try:
                await self.registry.delete_adapter(name)
            except NotFound:
                if not local:
                    raise

    async def list_adapters(self, page_size: int = 0, page_token: str = "", *,
                            caller: Identity = OPEN) -> tuple[list[AdapterInfo], str]:
        size = validate_page(page_size)
        names = [n for n in self.pool.names() if (not page_token or n > page_token) and caller.may_see(n)
                 and (self.fleet is None or self.fleet.serves(n))]  # not one a fleet member is still restoring
        page = names[:size]
        infos = [self._info(self.pool.get(n)) for n in page if n in self.pool]
        next_token = page[-1] if len(names) > size else ""
        return infos, next_token

    def _info(self, state: AdapterState) -> AdapterInfo:
        resident = self.backend.is_resident(state.name)
        return AdapterInfo(name=state.name, spec=state.spec, base_model=state.base_model, step=state.step,
                           last_seq_id=self.scheduler.last_seq_id(state.name) if state.name in self._uids else 0,
                           resident=state.resident if resident is None else resident,
                           parameter_count=state.parameter_count,
                           weights_dtype=self._weights_dtype(state.name))

    def info(self) -> dict:
        description = self.backend.description
        return {
            "description": description,
            "backend": self.backend.name,
            "device": str(self.backend.device),
            "max_context_length": self.max_context_length,
            "max_lora_rank": self.limits.max_lora_rank,
            "supported_losses": supported_losses(),
            "device_slots": self.limits.device_slots,
            "max_batch_datums": self.limits.max_batch_datums,
        }

    def tokenizer_json(self) -> bytes:
        return self.backend.tokenizer_json()

    # ---------------------------------------------------------------- sequenced requests
    def _require(self, adapter: str) -> None:
        if self.fleet is not None:
            self.fleet.require(adapter)
        if adapter not in self.pool:
            raise NotFound(f"adapter {shown(adapter)} does not exist on this trainer", field="adapter")

    async def _submit(self, adapter: str, seq_id: int, kind: str, payload, payload_hash: bytes, tokens: int = 0):
        self._loop = asyncio.get_running_loop()
        job = Job(adapter=adapter, seq_id=seq_id, kind=kind, payload=payload, payload_hash=payload_hash,
                  tokens=tokens)
        return await asyncio.wrap_future(self.scheduler.submit(job))

    async def _sequenced(self, adapter: str, seq_id: int, kind: str, payload_hash: bytes,
                         checked: Callable[[], tuple[object, int]], caller: Identity = OPEN):
        """Validates (`checked` returns the payload and its token count, or raises InvalidArgument) and submits.
        A rejection still takes its seq_id's turn and is recorded as that seq_id's outcome (the seq_id rule in
        trainer.proto), so client and trainer never disagree on the next seq_id; it touches no state. A caller
        outside the adapter's namespace or over its queue quota is refused before it takes a turn."""
        caller.authorize(adapter, "adapter")
        self._require(adapter)
        with self._queued.hold(caller):
            try:
                payload, tokens = checked()
            except InvalidArgument as exc:
                return await self._submit(adapter, seq_id, REJECTED, exc, payload_hash)
            return await self._submit(adapter, seq_id, kind, payload, payload_hash, tokens=tokens)

    async def forward_backward(self, adapter: str, seq_id: int, data: Sequence[DatumPayload], loss_fn: str,
                               loss_config: Mapping[str, float], payload_hash: bytes, *, backward: bool = True,
                               caller: Identity = OPEN) -> ItemResult:
        def checked():
            datums, name, config = validate_data(
                data, loss_fn, loss_config, vocab_size=self.backend.description.vocab_size,
                max_context_length=self.max_context_length, max_batch_datums=self.limits.max_batch_datums,
                max_request_tokens=self.limits.max_request_tokens,
                max_targets_per_position=self.backend.max_targets_per_position, backend=self.backend.name)
            return (datums, name, config), sum(d.length for d in datums)

        kind = "forward_backward" if backward else "forward"
        return await self._sequenced(adapter, seq_id, kind, payload_hash, checked, caller)

    async def optim_step(self, adapter: str, seq_id: int, hyper: AdamHyper, payload_hash: bytes, *,
                         caller: Identity = OPEN) -> StepOutcome:
        return await self._sequenced(adapter, seq_id, "optim_step", payload_hash, lambda: (hyper.validate(), 0),
                                     caller)

    async def publish_weights(self, adapter: str, seq_id: int, aliases: Sequence[str], metadata: Mapping[str, str],
                              payload_hash: bytes, *, caller: Identity = OPEN) -> AdapterVersion:
        def checked():
            # The registry's own rules, checked before anything is exported.
            validate_aliases(aliases)
            validate_metadata(metadata)
            return None, 0

        exported: ExportedBlob = await self._sequenced(adapter, seq_id, "publish", payload_hash, checked, caller)
        return await self._finish_publish(adapter, exported, VERSION_KIND_WEIGHTS, aliases, metadata)

    async def save_state(self, adapter: str, seq_id: int, metadata: Mapping[str, str], payload_hash: bytes, *,
                         caller: Identity = OPEN) -> AdapterVersion:
        def checked():
            validate_metadata(metadata)
            return None, 0

        exported: ExportedBlob = await self._sequenced(adapter, seq_id, "save_state", payload_hash, checked,
                                                       caller)
        return await self._finish_publish(adapter, exported, VERSION_KIND_TRAINING_STATE, (), metadata)

    async def _finish_publish(self, adapter: str, exported: ExportedBlob, kind: int, aliases: Sequence[str],
                              metadata: Mapping[str, str]) -> AdapterVersion:
        async with exported.lock:
            if exported.version is None:
                if isinstance(exported.blob, StreamedBlob):
                    # Made and hashed in one pass before the upload rather than during it (with the digest in a
                    # trailer): the registry stores a blob under its digest, so it can write S3 while the bytes
                    # arrive only when the digest comes first; with a trailer it holds the blob and writes it
                    # after the stream, measured slower at the 8B shape (docs/benchmarks.md, bench/publish.py).
                    await asyncio.to_thread(exported.blob.make)
                # The samplers that will load this version get its bytes straight from here, beside the upload
                # (trainer_svc/handoff.py); they use them only once the registry has committed them.
                pushed = (self.handoff is not None and kind == VERSION_KIND_WEIGHTS
                          and isinstance(exported.blob, StreamedBlob))
                if pushed and self.ack_before_upload and self.spool is not None:
                    exported.version = await self._publish_before_upload(adapter, exported, aliases, metadata)
                    return exported.version
                push = await self.handoff.start(adapter, exported.blob) if pushed else None
                try:
                    version = await self.registry.publish(
                        adapter, exported.blob, kind=kind, training_step=exported.step, metadata=dict(metadata),
                        aliases=list(aliases), idempotency_key=exported.idempotency_key)
                except BaseException:
                    if push is not None:
                        await self.handoff.settle(push, committed=False)
                    raise
                exported.version = version
                exported.blob = None  # the cache keeps the version, not the bytes
                await self.durability.published(adapter, exported.seq_id, version, exported.step,
                                                exported.idempotency_key)
                if push is not None:
                    await self.handoff.settle(push, committed=True)
            return exported.version

    async def _publish_before_upload(self, adapter: str, exported: ExportedBlob, aliases: Sequence[str],
                                     metadata: Mapping[str, str]) -> AdapterVersion:
        """The pushed publish acknowledged before its S3 upload (trainer_svc/upload_spool.py)."""
        blob, exported.blob = exported.blob, None

        async def journaled(version: AdapterVersion) -> None:
            await self.durability.published(adapter, exported.seq_id, version, exported.step,
                                            exported.idempotency_key)

        try:
            version, _ = await publish_before_upload(
                self.registry, self.handoff, self.spool, adapter, blob, idempotency_key=exported.idempotency_key,
                step=exported.step, metadata=metadata, aliases=aliases, reserved=journaled)
        except BaseException:
            exported.blob = blob  # a retry of this PublishWeights sends the same bytes
            raise
        return version

    async def load_state(self, adapter: str, seq_id: int, source: SourceRef, with_optimizer: bool,
                         payload_hash: bytes, *, caller: Identity = OPEN) -> AdapterInfo:
        def checked():
            if not source.name:
                raise InvalidArgument("source.name is empty", field="source.name")
            validate_adapter_name(source.name, "source.name")
            if source.alias is not None:
                validate_alias(source.alias, "source.alias")
            if source.version and source.alias is not None:
                raise InvalidArgument("source: give either a version or an alias, not both", field="source")
            return (source, with_optimizer), 0

        if source.name:
            caller.authorize(source.name, "source.name")
        return await self._sequenced(adapter, seq_id, "load_state", payload_hash, checked, caller)

    # ---------------------------------------------------------------- worker side
    def _execute(self, jobs: list[Job]) -> list:
        self._prefetch_next({job.adapter for job in jobs})
        if self.fleet is not None:
            refused = self.fleet.refusals(jobs)  # adapters this fleet member stopped serving: ADAPTER_MOVED
            if any(refused):
                kept = [job for job, error in zip(jobs, refused) if error is None]
                outcomes = iter(self._execute_here(kept) if kept else ())
                return [error if error is not None else next(outcomes) for error in refused]
        return self._execute_here(jobs)

    def _execute_here(self, jobs: list[Job]) -> list:
        """Runs on the worker thread. Returns one outcome (value or exception) per job, journaled around the run
        (Durability.run_journaled)."""
        return self.durability.run_journaled(jobs, self._run_jobs)

    def _run_jobs(self, jobs: list[Job]) -> list:
        if jobs[0].kind in FUSABLE:
            try:
                states = self.pool.activate([job.adapter for job in jobs])
                items = [BatchItem(state, *job.payload) for state, job in zip(states, jobs)]
                return list(self.backend.run(items, backward=jobs[0].kind == "forward_backward"))
            except Exception as exc:
                if not isinstance(exc, LoraplaneError):
                    log.exception("fused batch failed")
                return [exc] * len(jobs)
        outcomes = []
        for job in jobs:
            try:
                outcomes.append(getattr(self, f"_run_{job.kind}")(job))
            except Exception as exc:
                if not isinstance(exc, LoraplaneError):
                    log.exception("%s of %s failed", job.kind, job.adapter)
                outcomes.append(exc)
        return outcomes

    def _run_rejected(self, job: Job):
        raise job.payload

    def _run_optim_step(self, job: Job) -> StepOutcome:
        (state,) = self.pool.activate([job.adapter])
        outcome = self.backend.optim_step(state, job.payload)
        state.step = outcome.step
        return outcome

    def _idempotency_key(self, job: Job) -> str:
        return f"trainer:{self._uids.get(job.adapter, '')}:{job.seq_id}:{hashlib.sha256(job.payload_hash).hexdigest()[:16]}"

    def _run_publish(self, job: Job) -> ExportedBlob:
        """Worker side: only the export (a host snapshot of the params, so training may go on). The file is made
        from it off the worker (`_finish_publish`): cast to the adapter's weights dtype, cut into upload chunks and
        hashed, in one pass."""
        state = self.pool.get(job.adapter)
        writer = adapter_writer(self.backend.export_params(state), state.spec, state.base_model,
                                self._weights_dtype(job.adapter), model_type=self.backend.base.family.model_type)
        return ExportedBlob(blob=StreamedBlob(writer.size, writer.chunks(CHUNK_BYTES)), step=state.step,
                            idempotency_key=self._idempotency_key(job), seq_id=job.seq_id)

    def _prefetch_next(self, current: set[str]) -> None:
        """Worker side: asks the backend to start bringing the adapter the scheduler will most likely run next to
        the device, overlapping this batch (a hint: the batch activates what it needs)."""
        if not self.backend.owns_adapter_tensors:
            return  # the pool's own residency: activated per batch
        following = self.scheduler.peek_next(exclude=current)
        if following is not None and not self.backend.is_resident(following):
            try:
                self.backend.prefetch(following, protect=tuple(current))
            except Exception:  # only a hint
                log.debug("prefetch of %s skipped", following, exc_info=True)

    def _training_state(self, state: AdapterState) -> TrainingState:
        """Host copies of the adapter's params, moments and step (copies: training goes on while they are saved)."""
        params, exp_avg, exp_avg_sq, step = self.backend.export_training_state(state)
        return TrainingState(params=params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step, spec=state.spec,
                             base_model_name=state.base_model)

    def _run_save_state(self, job: Job) -> ExportedBlob:
        training = self._training_state(self.pool.get(job.adapter))
        return ExportedBlob(blob=serialize_training_state(training), step=training.step,
                            idempotency_key=self._idempotency_key(job), seq_id=job.seq_id)

    def _run_load_state(self, job: Job) -> AdapterInfo:
        if isinstance(job.payload, ResolvedSource):  # a replay: exactly the version the live run loaded
            source, with_optimizer = SourceRef(job.payload.name, job.payload.version), job.payload.with_optimizer
        else:
            source, with_optimizer = job.payload
        # The download runs on the event loop while this worker waits: LoadState keeps its place in the seq_id
        # order (it may load a version a SaveState earlier in the same pipeline just wrote).
        future = asyncio.run_coroutine_threadsafe(self._download_state(source), self._loop)
        try:
            version, loaded = future.result(self.limits.registry_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"downloading the LoadState source took over {self.limits.registry_timeout_s}s",
                                   field="source") from None
        self.durability.journal_resolved(
            dataclasses.replace(job, payload=ResolvedSource(source.name, version, with_optimizer)))
        state = self.pool.get(job.adapter)
        if loaded.base_model_name and loaded.base_model_name != state.base_model:
            raise FailedPrecondition(
                f"source was trained on base model {loaded.base_model_name!r}, this adapter uses "
                f"{state.base_model!r}", field="source")
        if (loaded.spec.rank, loaded.spec.target_modules) != (state.spec.rank, state.spec.target_modules):
            raise FailedPrecondition(
                f"source has rank {loaded.spec.rank} on {list(loaded.spec.target_modules)}; adapter {state.name!r} "
                f"has rank {state.spec.rank} on {list(state.spec.target_modules)}", field="source")
        if set(loaded.params) != set(state.params):
            raise FailedPrecondition(
                f"source has {len(loaded.params)} LoRA tensors, adapter {state.name!r} has {len(state.params)} "
                "(a different number of layers?)", field="source")
        for key, tensor in state.params.items():
            if loaded.params[key].shape != tensor.shape:
                raise FailedPrecondition(f"source tensor {key} has shape {tuple(loaded.params[key].shape)}, "
                                         f"expected {tuple(tensor.shape)}", field="source")
        if with_optimizer:
            exp_avg, exp_avg_sq, step = loaded.exp_avg, loaded.exp_avg_sq, loaded.step
        else:
            exp_avg = {k: torch.zeros_like(v) for k, v in loaded.params.items()}
            exp_avg_sq = {k: torch.zeros_like(v) for k, v in loaded.params.items()}
            step = 0
        self._install(state, loaded.params, exp_avg, exp_avg_sq, step)
        info = self._info(state)
        info.last_seq_id = job.seq_id
        return info

    def _install(self, state: AdapterState, params, exp_avg, exp_avg_sq, step: int) -> None:
        """Worker side: replaces the adapter's tensors and step (LoadState, recovery from a checkpoint)."""
        self.pool.replace_tensors(state, params, exp_avg, exp_avg_sq)
        state.step = step
        self.backend.load_training_state(state, state.params, state.exp_avg, state.exp_avg_sq, state.step)

    async def _download_state(self, source: SourceRef) -> tuple[int, TrainingState]:
        version = source.version
        if not version and not source.alias:
            # "latest" in the registry means weights; for LoadState it means the newest training state the user
            # saved (the trainer's own recovery checkpoints do not count).
            versions = [v for v in await self.registry.list_versions(
                source.name, kind=VERSION_KIND_TRAINING_STATE) if v.metadata.get(CHECKPOINT_KEY) != "auto"]
            if not versions:
                raise NotFound(f"adapter {source.name!r} has no training-state version (SaveState first)",
                               field="source")
            version = max(v.version for v in versions)
        meta, blob = await self.registry.download(source.name, version=version, alias=source.alias or "")
        if meta.kind != VERSION_KIND_TRAINING_STATE:
            raise InvalidArgument(
                f"source {source.name} v{meta.version} is a weights version; LoadState needs a SaveState version",
                field="source")
        return meta.version, parse_training_state(blob)

    # ---------------------------------------------------------------- recovery and fleet moves
    async def forget_local(self, name: str, error: LoraplaneError | None = None) -> None:
        """Drops the adapter from this trainer only (a fleet moved it away): its journal and checkpoints stay for
        the trainer that serves it now; queued requests fail with `error` (ADAPTER_MOVED: retried there)."""
        self.scheduler.close_lane(name, f"adapter {name!r} left this trainer", error=error)
        if name in self.pool:
            await self._on_worker(lambda: self.pool.remove(name))
        self._uids.pop(name, None)
        self.durability.forget(name)

    async def recover(self, names: Sequence[str] | None = None) -> list[str]:
        """Rebuilds the journal's adapters (all, or `names`) before serving (Durability.recover); returns those that
        could not be recovered."""
        self._loop = asyncio.get_running_loop()
        return await self.durability.recover(names)

    def _weights_dtype(self, name: str) -> str:
        return self.durability.weights_dtype(name)

    def _recorded_outcome(self, state: AdapterState, entry: JournalEntry):
        """A journaled outcome as this service answers it (a retry after a restart gets it back)."""
        data = entry.outcome
        if entry.kind in ("publish", "save_state") and "version" in data:
            return ExportedBlob(blob=None, step=data["step"], idempotency_key=data["idempotency_key"],
                                version=AdapterVersion.FromString(data["version"]), seq_id=entry.seq_id)
        if "load_state_step" in data:
            info = self._info(state)
            info.step, info.last_seq_id = data["load_state_step"], entry.seq_id
            return info
        return outcome_from_plain(data)
