"""The trainer's domain object: adapters, sequenced training requests, publishing. No gRPC here; the servicer
converts protobuf <-> these calls and `loraplane.rpc` maps the domain errors to status codes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from loraplane.adapter_format import TrainingState, parse_training_state, serialize_adapter, serialize_training_state
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
from loraplane.registry_client import RegistryClient
from loraplane.v1 import common_pb2
from trainer_svc.backends.base import BatchItem, ItemResult, TrainerBackend
from trainer_svc.losses import supported_losses
from trainer_svc.optimizer import AdamHyper, StepOutcome
from trainer_svc.pool import AdapterPool, AdapterState
from trainer_svc.scheduler import FUSABLE, REJECTED, Job, Scheduler
from trainer_svc.validation import (
    validate_adapter_name,
    validate_alias,
    validate_aliases,
    validate_data,
    validate_metadata,
    validate_page,
)

log = logging.getLogger(__name__)


@dataclass
class TrainerLimits:
    max_lora_rank: int = 128
    device_slots: int = 8
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
    # Extra wait before running a fusable batch so concurrent requests can join it (0 = run at once).
    batch_window_s: float = 0.0
    registry_timeout_s: float = 60.0


@dataclass
class AdapterInfo:
    name: str
    spec: LoraSpec
    base_model: str
    step: int
    last_seq_id: int
    resident: bool
    parameter_count: int


@dataclass
class ExportedBlob:
    """The worker-side result of PublishWeights/SaveState: the blob captured at that seq_id. A retry gets this same
    object back and re-publishes it under the same idempotency key, so the registry returns the same version."""

    blob: bytes | None
    step: int
    idempotency_key: str
    version: common_pb2.AdapterVersion | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class TrainerService:
    def __init__(self, backend: TrainerBackend, registry: RegistryClient, limits: TrainerLimits | None = None):
        self.backend = backend
        self.registry = registry
        self.limits = limits or TrainerLimits()
        description = backend.description
        self.max_context_length = (min(self.limits.max_context_length, description.max_context_length)
                                   if self.limits.max_context_length else description.max_context_length)
        self.pool = AdapterPool(backend.device, self.limits.device_slots, self.limits.max_adapters)
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

    @property
    def base_model(self) -> str:
        return self.backend.description.name

    async def close(self) -> None:
        await asyncio.to_thread(self.scheduler.stop)

    async def _on_worker(self, fn):
        return await asyncio.wrap_future(self.scheduler.control(fn))

    # ---------------------------------------------------------------- adapters
    async def create_adapter(self, name: str, lora_config: common_pb2.LoraConfig, base_model: str = "",
                             keep_last: int = 0, metadata: Mapping[str, str] | None = None) -> AdapterInfo:
        self._loop = asyncio.get_running_loop()
        validate_adapter_name(name)
        validate_metadata(metadata or {})
        if base_model and base_model != self.base_model:
            raise InvalidArgument(f"base_model {shown(base_model)} differs from this trainer's {self.base_model!r}",
                                  field="base_model")
        spec = LoraSpec.create(int(lora_config.rank), float(lora_config.alpha), list(lora_config.target_modules),
                               int(lora_config.seed), max_rank=self.limits.max_lora_rank)
        if name in self.pool or name in self._creating:
            raise AlreadyExists(f"adapter {name!r} already exists on this trainer", field="name")
        self._creating.add(name)
        try:
            canonical = common_pb2.LoraConfig(rank=spec.rank, alpha=spec.effective_alpha,
                                              target_modules=list(spec.target_modules), seed=spec.seed)
            registered = await self.registry.create_adapter(
                name, lora_config=canonical, base_model=self.base_model, keep_last=keep_last,
                metadata=dict(metadata or {}), exist_ok=True)
            self._check_registry_match(name, registered, canonical)

            def create():
                params = self.backend.init_params(spec)
                state = AdapterState(
                    name=name, spec=spec, base_model=self.base_model, params=params,
                    exp_avg={k: torch.zeros_like(v) for k, v in params.items()},
                    exp_avg_sq={k: torch.zeros_like(v) for k, v in params.items()},
                    metadata=dict(metadata or {}))
                self.pool.add(state)
                self.pool.activate([name])
                return self._info(state)

            info = await self._on_worker(create)
            self._uids[name] = uuid.uuid4().hex
            self.scheduler.open_lane(name)
            return info
        finally:
            self._creating.discard(name)

    def _check_registry_match(self, name, registered, canonical: common_pb2.LoraConfig) -> None:
        # exist_ok lets a restarted trainer train an adapter the registry already knows, but only the same shape.
        got = registered.lora_config
        same = (got.rank == canonical.rank and abs(got.alpha - canonical.alpha) < 1e-6
                and (list(got.target_modules) or list(canonical.target_modules)) == list(canonical.target_modules)
                and (not registered.base_model or registered.base_model == self.base_model))
        if not same:
            raise AlreadyExists(
                f"adapter {name!r} already exists in the registry with a different LoRA config or base model",
                field="name")

    async def delete_adapter(self, name: str, delete_from_registry: bool = False) -> None:
        validate_adapter_name(name)
        local = name in self.pool
        if not local and not delete_from_registry:
            raise NotFound(f"name: adapter {shown(name)} does not exist on this trainer", field="name")
        if local:
            self.scheduler.close_lane(name, f"adapter {name!r} was deleted")
            await self._on_worker(lambda: self.pool.remove(name))
            self._uids.pop(name, None)
        if delete_from_registry:
            try:
                await self.registry.delete_adapter(name)
            except NotFound:
                if not local:
                    raise

    async def list_adapters(self, page_size: int = 0, page_token: str = "") -> tuple[list[AdapterInfo], str]:
        size = validate_page(page_size)
        names = [n for n in self.pool.names() if n > page_token] if page_token else self.pool.names()
        page = names[:size]
        infos = [self._info(self.pool.get(n)) for n in page if n in self.pool]
        next_token = page[-1] if len(names) > size else ""
        return infos, next_token

    def _info(self, state: AdapterState) -> AdapterInfo:
        return AdapterInfo(name=state.name, spec=state.spec, base_model=state.base_model, step=state.step,
                           last_seq_id=self.scheduler.last_seq_id(state.name) if state.name in self._uids else 0,
                           resident=state.resident, parameter_count=state.parameter_count)

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
        if adapter not in self.pool:
            raise NotFound(f"adapter {shown(adapter)} does not exist on this trainer", field="adapter")

    async def _submit(self, adapter: str, seq_id: int, kind: str, payload, payload_hash: bytes, tokens: int = 0):
        self._loop = asyncio.get_running_loop()
        job = Job(adapter=adapter, seq_id=seq_id, kind=kind, payload=payload, payload_hash=payload_hash,
                  tokens=tokens)
        return await asyncio.wrap_future(self.scheduler.submit(job))

    async def _sequenced(self, adapter: str, seq_id: int, kind: str, payload_hash: bytes,
                         checked: Callable[[], tuple[object, int]]):
        """Validates (`checked` returns the payload and its token count, or raises InvalidArgument) and submits.
        A rejection still takes its seq_id's turn and is recorded as that seq_id's outcome (the seq_id rule in
        trainer.proto), so client and trainer never disagree on the next seq_id; it touches no state."""
        self._require(adapter)
        try:
            payload, tokens = checked()
        except InvalidArgument as exc:
            return await self._submit(adapter, seq_id, REJECTED, exc, payload_hash)
        return await self._submit(adapter, seq_id, kind, payload, payload_hash, tokens=tokens)

    async def forward_backward(self, adapter: str, seq_id: int, data: Sequence, loss_fn: str,
                               loss_config: Mapping[str, float], payload_hash: bytes, *, backward: bool = True
                               ) -> ItemResult:
        def checked():
            datums, name, config = validate_data(
                data, loss_fn, loss_config, vocab_size=self.backend.description.vocab_size,
                max_context_length=self.max_context_length, max_batch_datums=self.limits.max_batch_datums,
                max_request_tokens=self.limits.max_request_tokens)
            return (datums, name, config), sum(d.length for d in datums)

        kind = "forward_backward" if backward else "forward"
        return await self._sequenced(adapter, seq_id, kind, payload_hash, checked)

    async def optim_step(self, adapter: str, seq_id: int, hyper: AdamHyper, payload_hash: bytes) -> StepOutcome:
        return await self._sequenced(adapter, seq_id, "optim_step", payload_hash, lambda: (hyper.validate(), 0))

    async def publish_weights(self, adapter: str, seq_id: int, aliases: Sequence[str], metadata: Mapping[str, str],
                              payload_hash: bytes) -> common_pb2.AdapterVersion:
        def checked():
            # The registry's own rules, checked before anything is exported.
            validate_aliases(aliases)
            validate_metadata(metadata)
            return None, 0

        exported: ExportedBlob = await self._sequenced(adapter, seq_id, "publish", payload_hash, checked)
        return await self._finish_publish(adapter, exported, common_pb2.VERSION_KIND_WEIGHTS, aliases, metadata)

    async def save_state(self, adapter: str, seq_id: int, metadata: Mapping[str, str], payload_hash: bytes
                         ) -> common_pb2.AdapterVersion:
        def checked():
            validate_metadata(metadata)
            return None, 0

        exported: ExportedBlob = await self._sequenced(adapter, seq_id, "save_state", payload_hash, checked)
        return await self._finish_publish(adapter, exported, common_pb2.VERSION_KIND_TRAINING_STATE, (), metadata)

    async def _finish_publish(self, adapter: str, exported: ExportedBlob, kind: int, aliases: Sequence[str],
                              metadata: Mapping[str, str]) -> common_pb2.AdapterVersion:
        async with exported.lock:
            if exported.version is None:
                version = await self.registry.publish(
                    adapter, exported.blob, kind=kind, training_step=exported.step, metadata=dict(metadata),
                    aliases=list(aliases), idempotency_key=exported.idempotency_key)
                exported.version = version
                exported.blob = None  # the cache keeps the version, not the bytes
            return exported.version

    async def load_state(self, adapter: str, seq_id: int, source: common_pb2.AdapterRef, with_optimizer: bool,
                         payload_hash: bytes) -> AdapterInfo:
        def checked():
            if not source.name:
                raise InvalidArgument("source.name is empty", field="source.name")
            validate_adapter_name(source.name, "source.name")
            if source.HasField("alias"):
                validate_alias(source.alias, "source.alias")
            return (source, with_optimizer), 0

        return await self._sequenced(adapter, seq_id, "load_state", payload_hash, checked)

    # ---------------------------------------------------------------- worker side
    def _execute(self, jobs: list[Job]) -> list:
        """Runs on the worker thread. Returns one outcome (value or exception) per job."""
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
        state = self.pool.get(job.adapter)
        blob = serialize_adapter(self.backend.export_params(state), state.spec, state.base_model)
        return ExportedBlob(blob=blob, step=state.step, idempotency_key=self._idempotency_key(job))

    def _run_save_state(self, job: Job) -> ExportedBlob:
        state = self.pool.get(job.adapter)
        training = TrainingState(
            params=self.backend.export_params(state),
            exp_avg={k: v.detach().cpu() for k, v in state.exp_avg.items()},
            exp_avg_sq={k: v.detach().cpu() for k, v in state.exp_avg_sq.items()},
            step=state.step, spec=state.spec, base_model_name=state.base_model)
        return ExportedBlob(blob=serialize_training_state(training), step=state.step,
                            idempotency_key=self._idempotency_key(job))

    def _run_load_state(self, job: Job) -> AdapterInfo:
        source, with_optimizer = job.payload
        # The download runs on the event loop while this worker waits: LoadState keeps its place in the seq_id
        # order (it may load a version a SaveState earlier in the same pipeline just wrote).
        future = asyncio.run_coroutine_threadsafe(self._download_state(source), self._loop)
        try:
            loaded = future.result(self.limits.registry_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded(f"downloading the LoadState source took over {self.limits.registry_timeout_s}s",
                                   field="source") from None
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
        self.pool.replace_tensors(state, loaded.params, exp_avg, exp_avg_sq)
        state.step = step
        info = self._info(state)
        info.last_seq_id = job.seq_id
        return info

    async def _download_state(self, source: common_pb2.AdapterRef) -> TrainingState:
        version = source.version if source.HasField("version") else 0
        alias = source.alias if source.HasField("alias") else ""
        if not version and not alias:
            # "latest" in the registry means weights; for LoadState it means the newest training state.
            versions = await self.registry.list_versions(source.name, kind=common_pb2.VERSION_KIND_TRAINING_STATE)
            if not versions:
                raise NotFound(f"adapter {source.name!r} has no training-state version (SaveState first)",
                               field="source")
            version = max(v.version for v in versions)
        meta, blob = await self.registry.download(source.name, version=version, alias=alias)
        if meta.kind != common_pb2.VERSION_KIND_TRAINING_STATE:
            raise InvalidArgument(
                f"source {source.name} v{meta.version} is a weights version; LoadState needs a SaveState version",
                field="source")
        return parse_training_state(blob)
