"""ServiceClient: the entry point. Knows the three service addresses and makes training and sampling clients."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence

from loraplane import errors
from loraplane.client._runtime import runtime
from loraplane.client._session import Session
from loraplane.client.errors import AlreadyExistsError, error_from_domain
from loraplane.client.routing import routed_call
from loraplane.client.targets import narrow_targets
from loraplane.client.training_client import SeqCounter, TrainingClient
from loraplane.client.types import TrainerAdapterInfo, VersionInfo, parse_path
from loraplane.registry_client import (
    RegistryClient,
    RegistryEvent,
    expert_layout_name,
    expert_layout_value,
    weights_dtype_name,
    weights_dtype_value,
)
from loraplane.v1 import common_pb2, registry_pb2, trainer_pb2

_seq_counters: dict[tuple[str, str], SeqCounter] = {}
_seq_lock = threading.Lock()


class ServiceClient(Session):
    """Addresses default to LORAPLANE_TRAINER_ADDRESS / LORAPLANE_SAMPLER_ADDRESS / LORAPLANE_REGISTRY_ADDRESS,
    then to the cluster that `loraplane up` started (its state file under LORAPLANE_DATA_DIR or ./.loraplane).

    `max_chunk_datums` / `max_chunk_bytes` bound each forward_backward request; larger batches are split into
    several sequenced requests whose gradients accumulate."""

    # ---- training clients -----------------------------------------------------------------------------------

    def _counter(self, adapter: str, last_seq_id: int, *, created: bool) -> SeqCounter:
        # One counter per (trainer, adapter) in the whole process, so every TrainingClient of an adapter, from any
        # ServiceClient, numbers from the same sequence. A just-created adapter starts afresh (an old counter of
        # that name would belong to a deleted adapter or to an earlier server at the same address).
        with _seq_lock:
            key = (self.trainer_address, adapter)
            if created or key not in _seq_counters:
                _seq_counters[key] = SeqCounter(last_seq_id)
            counter = _seq_counters[key]
            counter.advance_to(last_seq_id)
            return counter

    def _training_client(self, info: TrainerAdapterInfo, *, created: bool = False) -> TrainingClient:
        limit = self.get_server_capabilities().max_batch_datums
        max_datums = min(self.max_chunk_datums, limit) if limit else self.max_chunk_datums
        return TrainingClient(self, info.name, self._counter(info.name, info.last_seq_id, created=created), info=info,
                              max_chunk_datums=max_datums, max_chunk_bytes=self.max_chunk_bytes, retry=self.retry)

    async def _create_adapter(self, request: trainer_pb2.TrainerServiceCreateAdapterRequest
                              ) -> TrainerAdapterInfo:
        # CreateAdapter carries no seq_id; a retry after a lost reply may meet ALREADY_EXISTS for our own adapter.
        # In a trainer fleet the trainer asked places the adapter and may send us to another (routing.py).
        reply = await routed_call(self.trainer_address, request.name, "CreateAdapter", request, self.retry)
        return TrainerAdapterInfo.from_proto(reply.adapter)

    def create_lora_training_client(
        self,
        base_model: str | None = None,
        rank: int = 32,
        alpha: float | None = None,
        target_modules: Sequence[str] | None = None,
        seed: int | None = None,
        name: str | None = None,
        *,
        train_mlp: bool = True,
        train_attn: bool = True,
        keep_last: int = 0,
        metadata: Mapping[str, str] | None = None,
        exist_ok: bool = False,
        weights_dtype: str = "float32",
        expert_layout: str = "",
    ) -> TrainingClient:
        """Creates a LoRA adapter on the trainer (and in the registry) and returns its TrainingClient.

        `base_model` must be the trainer's (None = whatever it serves). `alpha` None = rank (scale 1).
        `target_modules` None = all attention and MLP projections, narrowed by `train_attn` / `train_mlp`.
        `seed` None = random. `name` None = a generated "run-xxxxxxxx". With `exist_ok`, an existing adapter of
        that name is attached to instead (numbering continues after its last seq_id). `weights_dtype` "bfloat16"
        publishes weights versions as the float32 params rounded to bfloat16 (half the bytes; samplers then serve
        the rounded weights, so their logprobs differ from the trainer's by that rounding); training stays float32.
        `expert_layout` (a MoE base): "per_expert" or "shared_outer" (one gate_up A and one down B shared by a layer's
        experts, Tinker's); "" = the trainer's default."""
        if weights_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"weights_dtype must be 'float32' or 'bfloat16', not {weights_dtype!r}")
        if target_modules is None:
            if not (train_attn or train_mlp):
                raise ValueError("at least one of train_attn / train_mlp must be true")
            if train_attn and train_mlp:
                target_modules = []  # the server's default: every projection
            else:
                # By the base model's family: its token mixers vs the MLP it has (dense, shared, routed experts).
                target_modules = narrow_targets(self.get_server_capabilities().supported_target_modules,
                                                train_attn=train_attn, train_mlp=train_mlp)
        name = name or f"run-{uuid.uuid4().hex[:8]}"
        lora = common_pb2.LoraConfig(rank=rank, alpha=float(alpha or 0.0), target_modules=list(target_modules),
                                     seed=random.getrandbits(63) if seed is None else seed,
                                     weights_dtype=weights_dtype_value(weights_dtype),
                                     expert_layout=expert_layout_value(expert_layout))
        request = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=name, lora_config=lora, base_model=base_model or "", keep_last=keep_last,
            metadata={str(k): str(v) for k, v in (metadata or {}).items()})
        try:
            info = runtime().run(self._create_adapter(request))
            created = True
        except AlreadyExistsError:
            if not exist_ok:
                raise
            info = runtime().run(self._find_trainer_adapter(name))
            created = False
        return self._training_client(info, created=created)

    async def create_lora_training_client_async(self, *args, **kwargs) -> TrainingClient:
        import asyncio

        return await asyncio.to_thread(self.create_lora_training_client, *args, **kwargs)

    def list_training_adapters(self) -> list[TrainerAdapterInfo]:
        return runtime().run(self._list_trainer_adapters())

    def get_training_client(self, name: str) -> TrainingClient:
        """Attaches to an adapter that already lives on the trainer; seq_ids continue after its last one."""
        return self._training_client(runtime().run(self._find_trainer_adapter(name)))

    def create_training_client_from_state(self, path: str, name: str | None = None, *,
                                          with_optimizer: bool = False, seed: int | None = None) -> TrainingClient:
        """A new adapter with the LoRA shape of the state's adapter, loaded from a training-state version."""
        source, _, _ = parse_path(path)
        adapter = self.get_adapter(source)
        lora = adapter.lora_config
        client = self.create_lora_training_client(
            adapter.base_model or None, rank=lora.rank, alpha=lora.alpha or None,
            target_modules=list(lora.target_modules), seed=lora.seed if seed is None else seed, name=name,
            weights_dtype=weights_dtype_name(lora.weights_dtype), expert_layout=expert_layout_name(lora.expert_layout))
        client.load_state(path, with_optimizer=with_optimizer).result()
        return client

    # ---- registry -------------------------------------------------------------------------------------------

    def _registry_call(self, method: str, make_coro):
        if self._registry_client is None:
            self._registry_client = RegistryClient(self.registry_address, security=self.security)
        client = self._registry_client

        async def run():
            try:
                return await make_coro(client)
            except errors.LoraplaneError as exc:
                raise error_from_domain(exc, method=method, address=self.registry_address) from None

        return runtime().run(run())

    def list_adapters(self, prefix: str = "") -> list[registry_pb2.Adapter]:
        return self._registry_call("ListAdapters", lambda c: c.list_adapters(prefix))

    def get_adapter(self, name: str) -> registry_pb2.Adapter:
        return self._registry_call("GetAdapter", lambda c: c.get_adapter(name))

    def list_versions(self, adapter: str, *, kind: int = common_pb2.VERSION_KIND_UNSPECIFIED) -> list[VersionInfo]:
        found = self._registry_call("ListVersions", lambda c: c.list_versions(adapter, kind=kind))
        return [VersionInfo.from_proto(v) for v in found]

    def get_version(self, adapter: str, version: int = 0, alias: str = "") -> VersionInfo:
        return VersionInfo.from_stored(self._registry_call("GetVersion",
                                                           lambda c: c.get_version(adapter, version, alias)))

    def delete_adapter(self, name: str) -> None:
        self._registry_call("DeleteAdapter", lambda c: c.delete_adapter(name))

    def delete_version(self, adapter: str, version: int) -> None:
        self._registry_call("DeleteVersion", lambda c: c.delete_version(adapter, version))

    def set_alias(self, adapter: str, alias: str, version: int) -> registry_pb2.Adapter:
        return self._registry_call("SetAlias", lambda c: c.set_alias(adapter, alias, version))

    def delete_training_adapter(self, name: str, *, delete_from_registry: bool = False) -> None:
        async def run():
            request = trainer_pb2.TrainerServiceDeleteAdapterRequest(name=name,
                                                                      delete_from_registry=delete_from_registry)
            await routed_call(self.trainer_address, name, "DeleteAdapter", request, self.retry)

        runtime().run(run())

    async def watch_events(self, *, after_cursor: str = "", adapter: str = "", prefix: str = "",
                           start_at_end: bool = False) -> AsyncIterator[RegistryEvent]:
        """Registry events (on the caller's own loop, with its own channel); runs until the caller stops."""
        async with RegistryClient(self.registry_address, timeout=None, security=self.security) as client:
            try:
                async for event in client.watch(after_cursor=after_cursor, adapter=adapter, prefix=prefix,
                                                start_at_end=start_at_end):
                    yield event
            except errors.LoraplaneError as exc:
                raise error_from_domain(exc, method="WatchEvents", address=self.registry_address) from None
