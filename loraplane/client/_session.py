"""Session: what every client of one cluster shares: the service addresses, the retry policy, the trainer's
server info and tokenizer, the trainer's adapter listing and the making of sampling clients. ServiceClient builds on
it; TrainingClient holds one. It sits below both, so the client modules import in one direction only."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Self

from loraplane.client._runtime import Endpoint, RetryConfig, call_with_retry, runtime
from loraplane.client.addresses import client_security, resolve_address
from loraplane.client.chunking import DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNK_DATUMS
from loraplane.client.errors import NotFoundError, UnavailableError
from loraplane.client.routing import any_trainer_call, router_for
from loraplane.client.sampling_client import SamplingClient
from loraplane.client.tokenizer import fetch_tokenizer
from loraplane.client.types import TrainerAdapterInfo, parse_path
from loraplane.registry_client import RegistryClient
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc


class Session:
    def __init__(self, trainer: str | None = None, sampler: str | None = None, registry: str | None = None, *,
                 retry: RetryConfig | None = None, data_dir: str | Path | None = None,
                 max_chunk_datums: int = DEFAULT_MAX_CHUNK_DATUMS, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 api_key: str | None = None):
        """`api_key`: default LORAPLANE_API_KEY, else the admin key `loraplane up` left in the data dir."""
        self.security = client_security(data_dir, api_key)
        # Each address carries this client's identity to every call made with it (see Endpoint): several clients
        # with different keys in one process each act as their own.
        self._trainer = self._endpoint(resolve_address("trainer", trainer, data_dir))
        self._sampler = self._endpoint(resolve_address("sampler", sampler, data_dir))
        self._registry = self._endpoint(resolve_address("registry", registry, data_dir))
        self.retry = retry or RetryConfig()
        self.max_chunk_datums = max_chunk_datums
        self.max_chunk_bytes = max_chunk_bytes
        self._info: trainer_pb2.GetInfoResponse | None = None
        self._registry_client: RegistryClient | None = None

    def _endpoint(self, address: str | None) -> Endpoint | None:
        return Endpoint(address, self.security) if address else address

    def __repr__(self) -> str:
        return f"{type(self).__name__}(trainer={self._trainer}, sampler={self._sampler}, registry={self._registry})"

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
        """The trainer's GetInfo: base model, backend, limits, supported losses and target modules. In a trainer
        fleet any live member answers (they serve one base model)."""
        if self._info is None:
            self._info = runtime().run(any_trainer_call(self.trainer_address, "GetInfo",
                                                        trainer_pb2.GetInfoRequest(), self.retry))
        return self._info

    def get_tokenizer(self):
        # Every member of a trainer fleet serves the same base model: the tokenizer of whichever answers now.
        return fetch_tokenizer(runtime().run(self._live_trainer()), self.retry)

    async def _live_trainer(self) -> str:
        router = router_for(self.trainer_address)

        async def attempt(_timeout: float | None) -> str:
            return await router.live_address()

        return await call_with_retry(attempt, self.retry, method="GetInfo", address=self.trainer_address)

    async def _list_trainer_adapters(self) -> list[TrainerAdapterInfo]:
        """Every adapter on the trainer (in a fleet: on every trainer of it; any live member lists them all), in
        name order."""
        found: list[TrainerAdapterInfo] = []
        token = ""
        while True:
            reply = await any_trainer_call(self.trainer_address, "ListAdapters",
                                           trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000,
                                                                                         page_token=token),
                                           self.retry)
            found.extend(TrainerAdapterInfo.from_proto(a) for a in reply.adapters)
            token = reply.next_page_token
            if not token:
                return found

    async def _own_adapters(self, address: str, retry: RetryConfig) -> list[TrainerAdapterInfo]:
        """The adapters the trainer at `address` serves itself (its state now, not the fleet's view of it)."""
        stub = trainer_pb2_grpc.TrainerServiceStub(runtime().channel(address))
        found: list[TrainerAdapterInfo] = []
        token = ""
        while True:
            request = trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000, page_token=token,
                                                                    this_trainer_only=True)
            reply = await call_with_retry(lambda timeout, r=request: stub.ListAdapters(r, timeout=timeout), retry,
                                          method="ListAdapters", address=address)
            found.extend(TrainerAdapterInfo.from_proto(a) for a in reply.adapters)
            token = reply.next_page_token
            if not token:
                return found

    async def _find_trainer_adapter(self, name: str) -> TrainerAdapterInfo:
        # In a trainer fleet the adapter may live on another trainer than ours: ask where, then ask that trainer
        # (exact step and seq_id). While it moves between trainers nobody serves it: the fleet's listing then
        # describes it as its next owner restores it (its last seq_id is what counts for the next call).
        address = await router_for(self.trainer_address).resolve(name)
        try:
            # One attempt: a trainer that does not answer is as good as one that moved the adapter away.
            for info in await self._own_adapters(address, dataclasses.replace(self.retry, max_attempts=1)):
                if info.name == name:
                    return info
        except UnavailableError:
            pass
        for info in await self._list_trainer_adapters():
            if info.name == name:
                return info
        raise NotFoundError(f"adapter {name!r} is not on the trainer", method="ListAdapters",
                            address=self.trainer_address)

    # ---- sampling clients -----------------------------------------------------------------------------------

    def create_sampling_client(self, adapter: str | None = None, version: int = 0, alias: str = "", *,
                               model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """A SamplingClient of `adapter` at `version` (or `alias`; neither = its latest), of `model_path`
        ("loraplane://name@v3"), or of the base model (no adapter)."""
        if model_path:
            adapter, version, alias = parse_path(model_path)
        return SamplingClient(self.sampler_address, adapter or "", version, alias, retry=self.retry,
                              trainer_address=self._trainer)

