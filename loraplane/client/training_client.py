"""TrainingClient: one LoRA adapter on a trainer service.

Every trainer RPC of an adapter carries a seq_id (1, 2, 3, ...) taken at the moment the call is made, and the
trainer runs them in seq_id order. So a caller may submit forward_backward and optim_step back to back without
waiting for either (pipelining), and a retry after a lost connection reuses the seq_id it was given (the trainer
returns the first result instead of applying the request twice). A seq_id, once taken, is never given back: the
trainer consumes it whatever the outcome (a rejected request is that seq_id's recorded error; the rule is in
trainer.proto), so the counter only moves forward and one bad request never wedges the ones after it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from loraplane.client._runtime import RetryConfig, runtime
from loraplane.client.chunking import (
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNK_DATUMS,
    merge_metrics,
    split_into_chunks,
)
from loraplane.client.futures import APIFuture
from loraplane.client.routing import routed_call
from loraplane.client.sampling_client import SamplingClient
from loraplane.client.types import (
    AdamParams,
    ForwardBackwardOutput,
    LoadStateResponse,
    OptimStepResponse,
    SaveStateResponse,
    TrainerAdapterInfo,
    VersionInfo,
    adapter_ref,
    as_datum,
    format_path,
    outputs_from_proto,
    parse_path,
)
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc

if TYPE_CHECKING:
    from loraplane.client._session import Session

class SeqCounter:
    """The next seq_ids of one adapter. Shared by every TrainingClient of that adapter in this process."""

    def __init__(self, last_seq_id: int = 0):
        self._last = last_seq_id
        self._lock = threading.Lock()

    def take(self, count: int = 1) -> list[int]:
        with self._lock:
            first = self._last + 1
            self._last += count
            return list(range(first, first + count))

    def advance_to(self, last_seq_id: int) -> None:
        """Never reuse a seq_id the trainer has already executed (e.g. sent by another process)."""
        with self._lock:
            self._last = max(self._last, last_seq_id)

    @property
    def last(self) -> int:
        return self._last


class TrainingClient:
    """Calls return an APIFuture at once; `*_async` twins are coroutines that submit (taking the seq_id) and return
    the APIFuture, so `fut = await tc.forward_backward_async(...)` then `out = await fut` (Tinker's double await)."""

    def __init__(self, service: Session, adapter: str, seq: SeqCounter, *,
                 info: TrainerAdapterInfo | None = None, max_chunk_datums: int = DEFAULT_MAX_CHUNK_DATUMS,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, retry: RetryConfig | None = None):
        self.service = service
        self.adapter = adapter
        self._seq = seq
        self.info = info
        self.max_chunk_datums = max_chunk_datums
        self.max_chunk_bytes = max_chunk_bytes
        self.retry = retry or service.retry

    def __repr__(self) -> str:
        return f"TrainingClient({self.adapter!r} on {self.trainer_address})"

    @property
    def model_id(self) -> str:
        return self.adapter

    @property
    def trainer_address(self) -> str:
        return self.service.trainer_address

    @property
    def last_seq_id(self) -> int:
        return self._seq.last

    def _stub(self) -> trainer_pb2_grpc.TrainerServiceStub:
        return trainer_pb2_grpc.TrainerServiceStub(runtime().channel(self.trainer_address))

    async def _call(self, method: str, request) -> Any:
        # To the trainer that serves this adapter (one of a fleet, or the only one), following it when it moves.
        return await routed_call(self.trainer_address, self.adapter, method, request, self.retry)

    # ---- forward / backward ---------------------------------------------------------------------------------

    def _supported_losses(self) -> tuple[str, ...]:
        """The loss functions the trainer serves, as its GetInfo lists them (asked once per ServiceClient and kept):
        the trainer's loss registry is the only list."""
        return tuple(self.service.get_server_capabilities().supported_losses)

    def _prepare(self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None):
        # Checked before a seq_id is taken, so a misspelt loss costs no round trip and leaves no gap in the sequence.
        supported = self._supported_losses()
        if supported and loss_fn not in supported:
            raise ValueError(f"loss_fn must be one of {', '.join(supported)} (the trainer's); got {loss_fn!r}")
        datums = [as_datum(d).to_proto() for d in data]
        if not datums:
            raise ValueError("data is empty: give at least one Datum")
        config = {str(k): float(v) for k, v in (loss_fn_config or {}).items()}
        return split_into_chunks(datums, self.max_chunk_datums, self.max_chunk_bytes), config

    async def _run_chunks(self, method: str, chunks, seq_ids: list[int], loss_fn: str,
                          config: dict[str, float]) -> ForwardBackwardOutput:
        request_type = trainer_pb2.ForwardBackwardRequest if method == "ForwardBackward" else trainer_pb2.ForwardRequest
        requests = [request_type(adapter=self.adapter, seq_id=seq_id, data=chunk, loss_fn=loss_fn,
                                 loss_fn_config=config) for seq_id, chunk in zip(seq_ids, chunks)]
        # All chunks go out at once; the trainer runs them in seq_id order and adds up their gradients.
        replies = await asyncio.gather(*(self._call(method, r) for r in requests))
        outputs = [o for reply, chunk in zip(replies, chunks) for o in outputs_from_proto(reply.outputs, chunk)]
        metrics = merge_metrics([dict(reply.metrics) for reply in replies], [len(c) for c in chunks])
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics, loss_fn_output_type=loss_fn)

    def _submit_fb(self, method: str, data, loss_fn: str, loss_fn_config) -> APIFuture[ForwardBackwardOutput]:
        chunks, config = self._prepare(data, loss_fn, loss_fn_config)
        seq_ids = self._seq.take(len(chunks))
        return APIFuture(runtime().submit(self._run_chunks(method, chunks, seq_ids, loss_fn, config)))

    def forward_backward(self, data: Sequence[Any], loss_fn: str = "cross_entropy",
                         loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Computes the loss and adds its gradient to the adapter's accumulated gradient."""
        return self._submit_fb("ForwardBackward", data, loss_fn, loss_fn_config)

    async def forward_backward_async(self, data: Sequence[Any], loss_fn: str = "cross_entropy",
                                     loss_fn_config: Mapping[str, float] | None = None
                                     ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward(self, data: Sequence[Any], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Same outputs as forward_backward, no gradient."""
        return self._submit_fb("Forward", data, loss_fn, loss_fn_config)

    async def forward_async(self, data: Sequence[Any], loss_fn: str = "cross_entropy",
                            loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        return self.forward(data, loss_fn, loss_fn_config)

    # ---- optimizer ------------------------------------------------------------------------------------------

    async def _optim_step(self, request: trainer_pb2.OptimStepRequest) -> OptimStepResponse:
        reply = await self._call("OptimStep", request)
        return OptimStepResponse(step=reply.step, grad_norm=reply.grad_norm, skipped=reply.skipped,
                                 metrics=dict(reply.metrics))

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the accumulated gradient, then zeroes it."""
        params = (adam_params or AdamParams()).to_proto()
        (seq_id,) = self._seq.take()
        request = trainer_pb2.OptimStepRequest(adapter=self.adapter, seq_id=seq_id, adam_params=params)
        return APIFuture(runtime().submit(self._optim_step(request)))

    async def optim_step_async(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        return self.optim_step(adam_params)

    # ---- weights for sampling -------------------------------------------------------------------------------

    async def _publish(self, request: trainer_pb2.PublishWeightsRequest) -> SamplingClient:
        reply = await self._call("PublishWeights", request)
        version = VersionInfo.from_proto(reply.version)
        client = self.service.create_sampling_client(self.adapter, version=version.version)
        client.published = version  # type: ignore[attr-defined]
        return client

    def save_weights_for_sampler(self, name: str | None = None, *, aliases: Sequence[str] = (),
                                 metadata: Mapping[str, str] | None = None) -> APIFuture[SamplingClient]:
        """Publishes the current weights as a new immutable version and returns a SamplingClient pinned to it
        (its `.version` is the version number, `.path` e.g. "loraplane://name@v3", `.published` the details).
        `name` is kept in the version's metadata; `aliases` move to the new version."""
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        if name:
            meta["name"] = name
        (seq_id,) = self._seq.take()
        request = trainer_pb2.PublishWeightsRequest(adapter=self.adapter, seq_id=seq_id, aliases=list(aliases),
                                                    metadata=meta)
        return APIFuture(runtime().submit(self._publish(request)))

    async def save_weights_for_sampler_async(self, name: str | None = None, *, aliases: Sequence[str] = (),
                                             metadata: Mapping[str, str] | None = None
                                             ) -> APIFuture[SamplingClient]:
        return self.save_weights_for_sampler(name, aliases=aliases, metadata=metadata)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Tinker's blocking shortcut."""
        return self.save_weights_for_sampler(name).result()

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        return await self.save_weights_for_sampler(name)

    # ---- training state -------------------------------------------------------------------------------------

    async def _save_state(self, request: trainer_pb2.SaveStateRequest) -> SaveStateResponse:
        reply = await self._call("SaveState", request)
        version = VersionInfo.from_proto(reply.version)
        return SaveStateResponse(path=format_path(version.adapter, version.version), version=version)

    def save_state(self, name: str | None = None, *, metadata: Mapping[str, str] | None = None
                   ) -> APIFuture[SaveStateResponse]:
        """Stores params + AdamW moments + step as a training-state version; `.path` loads it back."""
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        if name:
            meta["name"] = name
        (seq_id,) = self._seq.take()
        request = trainer_pb2.SaveStateRequest(adapter=self.adapter, seq_id=seq_id, metadata=meta)
        return APIFuture(runtime().submit(self._save_state(request)))

    async def save_state_async(self, name: str | None = None, *, metadata: Mapping[str, str] | None = None
                               ) -> APIFuture[SaveStateResponse]:
        return self.save_state(name, metadata=metadata)

    async def _load_state(self, request: trainer_pb2.LoadStateRequest, path: str) -> LoadStateResponse:
        reply = await self._call("LoadState", request)
        self.info = TrainerAdapterInfo.from_proto(reply.adapter)
        return LoadStateResponse(path=path, model_id=self.adapter, step=reply.adapter.step)

    def load_state(self, path: str, *, with_optimizer: bool = False) -> APIFuture[LoadStateResponse]:
        """Loads a training-state version ("loraplane://name@v4"): params only, with a fresh optimizer, unless
        `with_optimizer` (then AdamW moments and step too)."""
        name, version, alias = parse_path(path)
        (seq_id,) = self._seq.take()
        request = trainer_pb2.LoadStateRequest(adapter=self.adapter, seq_id=seq_id,
                                               source=adapter_ref(name, version, alias),
                                               with_optimizer=with_optimizer)
        return APIFuture(runtime().submit(self._load_state(request, path)))

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadStateResponse]:
        return self.load_state(path, with_optimizer=True)

    async def load_state_async(self, path: str, *, with_optimizer: bool = False) -> APIFuture[LoadStateResponse]:
        return self.load_state(path, with_optimizer=with_optimizer)

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[LoadStateResponse]:
        return self.load_state(path, with_optimizer=True)

    # ---- info -----------------------------------------------------------------------------------------------

    def get_info(self) -> TrainerAdapterInfo:
        """This adapter as the trainer sees it now (step, last seq_id, residency). Blocking, like Tinker's."""
        self.info = runtime().run(self.service._find_trainer_adapter(self.adapter))
        return self.info

    async def get_info_async(self) -> TrainerAdapterInfo:
        self.info = await APIFuture(runtime().submit(self.service._find_trainer_adapter(self.adapter)))
        return self.info

    def get_tokenizer(self):
        """The base model's tokenizer (a transformers fast tokenizer built from the trainer's tokenizer.json)."""
        return self.service.get_tokenizer()

    def create_sampling_client(self, version: int = 0, alias: str = "") -> SamplingClient:
        return self.service.create_sampling_client(self.adapter, version=version, alias=alias)
