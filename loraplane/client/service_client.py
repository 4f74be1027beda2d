"""ServiceClient: the entry point. Knows the three service addresses and makes training and sampling clients."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from loraplane import errors
from loraplane.client._runtime import RetryConfig, call_with_retry, runtime
from loraplane.client.addresses import resolve_address
from loraplane.client.chunking import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNK_DATUMS
from loraplane.client.errors import AlreadyExistsError, NotFoundError, error_from_domain
from loraplane.client.sampling_client import SamplingClient
from loraplane.client.tokenizer import tokenizer_from_info
from loraplane.client.training_client import SeqCounter, TrainingClient
from loraplane.client.types import TrainerAdapterInfo, VersionInfo, parse_path
from loraplane.registry_client import RegistryClient
from loraplane.v1 import common_pb2, registry_pb2, trainer_pb2, trainer_pb2_grpc

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

_tokenizers: dict[tuple[str, str, int], Any] = {}
_tokenizers_lock = threading.Lock()
_seq_counters: dict[tuple[str, str], SeqCounter] = {}
_seq_lock = threading.Lock()


async def _get_info(trainer_address: str, include_tokenizer: bool, retry: RetryConfig
                    ) -> trainer_pb2.GetInfoResponse:
    stub = trainer_pb2_grpc.TrainerServiceStub(runtime().channel(trainer_address))
    request = trainer_pb2.GetInfoRequest(include_tokenizer=include_tokenizer)
    return await call_with_retry(lambda timeout: stub.GetInfo(request, timeout=timeout), retry, method="GetInfo",
                                 address=trainer_address)


def fetch_tokenizer(trainer_address: str, retry: RetryConfig | None = None):
    """The trainer base model's tokenizer. Built once per (trainer, base model): a cheap GetInfo first tells whether
    the cached one still fits the server now at that address."""
    retry = retry or RetryConfig()
    info = runtime().run(_get_info(trainer_address, False, retry))
    key = (trainer_address, info.base_model, info.tokenizer.vocab_size)
    with _tokenizers_lock:
        if key not in _tokenizers:
            full = runtime().run(_get_info(trainer_address, True, retry))
            _tokenizers[key] = tokenizer_from_info(full.tokenizer)
        return _tokenizers[key]


class ServiceClient:
    """Addresses default to LORAPLANE_TRAINER_ADDRESS / LORAPLANE_SAMPLER_ADDRESS / LORAPLANE_REGISTRY_ADDRESS,
    then to the cluster that `loraplane up` started (its state file under LORAPLANE_DATA_DIR or ./.loraplane).

    `max_chunk_datums` / `max_chunk_bytes` bound each forward_backward request; larger batches are split into
    several sequenced requests whose gradients accumulate."""

    def __init__(self, trainer: str | None = None, sampler: str | None = None, registry: str | None = None, *,
                 retry: RetryConfig | None = None, data_dir: str | Path | None = None,
                 max_chunk_datums: int = DEFAULT_MAX_CHUNK_DATUMS, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES):
        self._trainer = resolve_address("trainer", trainer, data_dir)
        self._sampler = resolve_address("sampler", sampler, data_dir)
        self._registry = resolve_address("registry", registry, data_dir)
        self.retry = retry or RetryConfig()
        self.max_chunk_datums = max_chunk_datums
        self.max_chunk_bytes = max_chunk_bytes
        self._info: trainer_pb2.GetInfoResponse | None = None
        self._registry_client: RegistryClient | None = None

    def __repr__(self) -> str:
        return f"ServiceClient(trainer={self._trainer}, sampler={self._sampler}, registry={self._registry})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @staticmethod
    def _need(address: str | None, service: str) -> str:
        if not address:
            raise ValueError(f"no {service} address: pass {service}=host:port, set "
                             f"LORAPLANE_{service.upper()}_ADDRESS, or start a cluster with `loraplane up`")
        return address

    @property
    def trainer_address(self) -> str:
        return self._need(self._trainer, "trainer")

    @property
    def sampler_address(self) -> str:
        return self._need(self._sampler, "sampler")

    @property
    def registry_address(self) -> str:
        return self._need(self._registry, "registry")

    def close(self) -> None:
        """Closes this client's registry channel. Trainer/sampler channels are shared by the process and stay."""
        if self._registry_client is not None:
            client, self._registry_client = self._registry_client, None
            runtime().run(client.close(), timeout=10)

    # ---- server info ----------------------------------------------------------------------------------------

    def get_server_capabilities(self) -> trainer_pb2.GetInfoResponse:
        """The trainer's GetInfo: base model, backend, limits, supported losses and target modules."""
        if self._info is None:
            self._info = runtime().run(_get_info(self.trainer_address, False, self.retry))
        return self._info

    def get_tokenizer(self):
        return fetch_tokenizer(self.trainer_address, self.retry)

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
        stub = trainer_pb2_grpc.TrainerServiceStub(runtime().channel(self.trainer_address))
        # CreateAdapter carries no seq_id; a retry after a lost reply may meet ALREADY_EXISTS for our own adapter.
        reply = await call_with_retry(lambda timeout: stub.CreateAdapter(request, timeout=timeout), self.retry,
                                      method="CreateAdapter", address=self.trainer_address)
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
    ) -> TrainingClient:
        """Creates a LoRA adapter on the trainer (and in the registry) and returns its TrainingClient.

        `base_model` must be the trainer's (None = whatever it serves). `alpha` None = rank (scale 1).
        `target_modules` None = all attention and MLP projections, narrowed by `train_attn` / `train_mlp`.
        `seed` None = random. `name` None = a generated "run-xxxxxxxx". With `exist_ok`, an existing adapter of
        that name is attached to instead (numbering continues after its last seq_id)."""
        if target_modules is None:
            if not (train_attn or train_mlp):
                raise ValueError("at least one of train_attn / train_mlp must be true")
            target_modules = [*(ATTENTION_MODULES if train_attn else ()), *(MLP_MODULES if train_mlp else ())]
            if train_attn and train_mlp:
                target_modules = []  # the server's default: every projection
        name = name or f"run-{uuid.uuid4().hex[:8]}"
        lora = common_pb2.LoraConfig(rank=rank, alpha=float(alpha or 0.0), target_modules=list(target_modules),
                                     seed=random.getrandbits(63) if seed is None else seed)
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

    async def _list_trainer_adapters(self) -> list[TrainerAdapterInfo]:
        stub = trainer_pb2_grpc.TrainerServiceStub(runtime().channel(self.trainer_address))
        found: list[TrainerAdapterInfo] = []
        token = ""
        while True:
            request = trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000, page_token=token)
            reply = await call_with_retry(lambda timeout, r=request: stub.ListAdapters(r, timeout=timeout), self.retry,
                                          method="ListAdapters", address=self.trainer_address)
            found.extend(TrainerAdapterInfo.from_proto(a) for a in reply.adapters)
            token = reply.next_page_token
            if not token:
                return found

    async def _find_trainer_adapter(self, name: str) -> TrainerAdapterInfo:
        for info in await self._list_trainer_adapters():
            if info.name == name:
                return info
        raise NotFoundError(f"adapter {name!r} is not on the trainer", method="ListAdapters",
                            address=self.trainer_address)

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
            target_modules=list(lora.target_modules), seed=lora.seed if seed is None else seed, name=name)
        client.load_state(path, with_optimizer=with_optimizer).result()
        return client

    # ---- sampling clients -----------------------------------------------------------------------------------

    def create_sampling_client(self, adapter: str | None = None, version: int = 0, alias: str = "", *,
                               model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """A SamplingClient of `adapter` at `version` (or `alias`; neither = its latest), of `model_path`
        ("loraplane://name@v3"), or of the base model (no adapter)."""
        if model_path:
            adapter, version, alias = parse_path(model_path)
        return SamplingClient(self.sampler_address, adapter or "", version, alias, retry=self.retry,
                              trainer_address=self._trainer)

    # ---- registry -------------------------------------------------------------------------------------------

    def _registry_call(self, method: str, make_coro):
        if self._registry_client is None:
            self._registry_client = RegistryClient(self.registry_address)
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
        return VersionInfo.from_proto(self._registry_call("GetVersion",
                                                          lambda c: c.get_version(adapter, version, alias)))

    def delete_adapter(self, name: str) -> None:
        self._registry_call("DeleteAdapter", lambda c: c.delete_adapter(name))

    def delete_version(self, adapter: str, version: int) -> None:
        self._registry_call("DeleteVersion", lambda c: c.delete_version(adapter, version))

    def set_alias(self, adapter: str, alias: str, version: int) -> registry_pb2.Adapter:
        return self._registry_call("SetAlias", lambda c: c.set_alias(adapter, alias, version))

    def delete_training_adapter(self, name: str, *, delete_from_registry: bool = False) -> None:
        async def run():
            stub = trainer_pb2_grpc.TrainerServiceStub(runtime().channel(self.trainer_address))
            request = trainer_pb2.TrainerServiceDeleteAdapterRequest(name=name,
                                                                      delete_from_registry=delete_from_registry)
            await call_with_retry(lambda timeout: stub.DeleteAdapter(request, timeout=timeout), self.retry,
                                  method="DeleteAdapter", address=self.trainer_address)

        runtime().run(run())

    async def watch_events(self, *, after_cursor: str = "", adapter: str = "", prefix: str = "",
                           start_at_end: bool = False) -> AsyncIterator[registry_pb2.Event]:
        """Registry events (on the caller's own loop, with its own channel); runs until the caller stops."""
        async with RegistryClient(self.registry_address, timeout=None) as client:
            try:
                async for event in client.watch(after_cursor=after_cursor, adapter=adapter, prefix=prefix,
                                                start_at_end=start_at_end):
                    yield event
            except errors.LoraplaneError as exc:
                raise error_from_domain(exc, method="WatchEvents", address=self.registry_address) from None
