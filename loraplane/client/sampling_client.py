"""SamplingClient: samples from one adapter version (or the base model) on a sampler service."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from loraplane.client._runtime import Handoff, RetryConfig, runtime, stream_with_retry
from loraplane.client.futures import APIFuture
from loraplane.client.sampler_routing import SamplerRouter, routed_call, router_for
from loraplane.client.tokenizer import fetch_tokenizer
from loraplane.client.types import (
    _STOP_REASONS,
    SampleResponse,
    SamplingParams,
    StopReason,
    _prompt_logprobs,
    adapter_ref,
    as_model_input,
    format_path,
)
from loraplane.v1 import sampler_pb2


@dataclass(slots=True)
class SampleStreamChunk:
    """Tokens of one sequence generated since its previous chunk, with their logprobs; `stop_reason` is set on the
    sequence's last chunk. A chunk may carry several tokens: those the sampler had at once."""

    sequence_index: int
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason | None
    served_version: int

    @classmethod
    def from_proto(cls, proto: sampler_pb2.SampleStreamResponse) -> SampleStreamChunk:
        return cls(sequence_index=proto.sequence_index, tokens=list(proto.tokens), logprobs=list(proto.logprobs),
                   stop_reason=_STOP_REASONS.get(proto.finish_reason), served_version=proto.served_version)


# Replica routers of callers' own event loops (a router's refresh task and channels belong to one loop), per loop
# and per (seed address, identity), as router_for keeps them for the client's I/O loop.
_loop_routers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict] = weakref.WeakKeyDictionary()
_loop_routers_lock = threading.Lock()


def _router_on(seed: str, loop: asyncio.AbstractEventLoop) -> SamplerRouter:
    if loop is runtime().loop:
        return router_for(seed)
    key = (str(seed), getattr(seed, "security", None))
    with _loop_routers_lock:
        routers = _loop_routers.setdefault(loop, {})
        router = routers.get(key)
        if router is None:
            router = routers[key] = SamplerRouter(seed, lambda address: runtime().channel_on(address, loop))
        return router


class SamplingClient:
    """Immutable and picklable: (sampler address, adapter, version or alias). An empty adapter is the base model;
    version 0 with no alias follows the adapter's latest loaded version. The address may be any replica of a sampler
    fleet: calls go to the adapter's replica by affinity with bounded load, and on at once to another if that one
    is gone (loraplane/client/sampler_routing.py).

    `sample` returns an APIFuture; `sample_async` is a coroutine that returns the SampleResponse itself (Tinker's
    sampling convention)."""

    def __init__(self, sampler_address: str, adapter: str = "", version: int = 0, alias: str = "", *,
                 retry: RetryConfig | None = None, trainer_address: str | None = None):
        if not sampler_address:
            raise ValueError("no sampler address: pass sampler=... or set LORAPLANE_SAMPLER_ADDRESS")
        if version and alias:
            raise ValueError("give a version or an alias, not both")
        self.sampler_address = sampler_address
        self.adapter = adapter
        self.version = version
        self.alias = alias
        self.retry = retry or RetryConfig()
        self.trainer_address = trainer_address

    def __repr__(self) -> str:
        target = self.path if self.adapter else "base model"
        return f"SamplingClient({target} on {self.sampler_address})"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def path(self) -> str:
        return format_path(self.adapter, self.version, self.alias) if self.adapter else ""

    def _ref(self):
        return adapter_ref(self.adapter, self.version, self.alias)

    # ---- sample ---------------------------------------------------------------------------------------------

    def _sample_request(self, prompt, num_samples: int, sampling_params: SamplingParams | None,
                        include_prompt_logprobs: bool, topk_prompt_logprobs: int = 0,
                        prompt_logprobs_last_n: int | None = None) -> sampler_pb2.SampleRequest:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if topk_prompt_logprobs < 0:
            raise ValueError(f"topk_prompt_logprobs must be >= 0, got {topk_prompt_logprobs}")
        if prompt_logprobs_last_n is not None and prompt_logprobs_last_n < 1:
            raise ValueError(f"prompt_logprobs_last_n must be >= 1 (None = the whole prompt), got "
                             f"{prompt_logprobs_last_n}")
        params = sampling_params or SamplingParams()
        return sampler_pb2.SampleRequest(adapter=self._ref(), prompt_tokens=as_model_input(prompt).tokens,
                                         num_samples=num_samples, sampling_params=params.to_proto(),
                                         include_prompt_logprobs=include_prompt_logprobs,
                                         topk_prompt_logprobs=topk_prompt_logprobs,
                                         prompt_logprobs_last_n=prompt_logprobs_last_n or 0)

    async def _sample(self, request: sampler_pb2.SampleRequest, router: SamplerRouter | None = None
                      ) -> SampleResponse:
        reply = await routed_call(self.sampler_address, self.adapter, "Sample", request, self.retry, router)
        return SampleResponse.from_proto(reply)

    def sample(self, prompt, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, *,
               prompt_logprobs_last_n: int | None = None) -> APIFuture[SampleResponse]:
        """As Tinker's: `topk_prompt_logprobs=k` adds the k most likely tokens at every prompt position
        (`SampleResponse.topk_prompt_logprobs_np`, dense (len, k)); `prompt_logprobs_last_n=n` scores only the last
        n prompt tokens."""
        request = self._sample_request(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                       topk_prompt_logprobs, prompt_logprobs_last_n)
        return APIFuture(runtime().submit(self._sample(request)))

    async def sample_async(self, prompt, num_samples: int = 1, sampling_params: SamplingParams | None = None,
                           include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, *,
                           prompt_logprobs_last_n: int | None = None) -> SampleResponse:
        """`sample` as a coroutine, run on the caller's own event loop (a channel and replica router of that loop,
        as `sample_stream_async`). Not on the client's I/O loop: once that loop has made a gRPC call, grpc.aio
        hands it the completions of every loop of the process (whichever loop wakes first reads them), so each
        message of the caller's own streams would cross threads; measured, bare stubs beside it paid ~30% more
        CPU per streamed token (bench/stream_overhead.py --paths stubs stubs_rt)."""
        request = self._sample_request(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                       topk_prompt_logprobs, prompt_logprobs_last_n)
        return await self._sample(request, _router_on(self.sampler_address, asyncio.get_running_loop()))

    # ---- streaming ------------------------------------------------------------------------------------------

    def _stream_request(self, prompt, num_samples: int,
                        sampling_params: SamplingParams | None) -> sampler_pb2.SampleStreamRequest:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        params = sampling_params or SamplingParams()
        return sampler_pb2.SampleStreamRequest(adapter=self._ref(), prompt_tokens=as_model_input(prompt).tokens,
                                               num_samples=num_samples, sampling_params=params.to_proto())

    def _messages(self, router: SamplerRouter | None, request: sampler_pb2.SampleStreamRequest, convert=None):
        """The stream's messages from the adapter's replica (another one, then the retry policy, before the first
        message). `router` None: the running loop's own (looked up when the stream starts)."""

        def open_stream(timeout: float | None):
            on = router or _router_on(self.sampler_address, asyncio.get_running_loop())
            return on.stream(self.adapter, lambda stub: stub.SampleStream(request, timeout=timeout))

        return stream_with_retry(open_stream, self.retry, method="SampleStream", address=self.sampler_address,
                                 convert=convert)

    async def _produce(self, request: sampler_pb2.SampleStreamRequest, handoff: Handoff) -> None:
        """On the runtime's loop, for a consumer on another thread: the messages into `handoff` as they arrive (no
        conversion here: this loop serves every call of the process)."""
        try:
            async for message in self._messages(router_for(self.sampler_address), request):
                handoff.put(message)
        except asyncio.CancelledError:
            handoff.finish(asyncio.CancelledError())
            raise
        except BaseException as exc:  # noqa: BLE001 - the consumer raises it
            handoff.finish(exc)
        else:
            handoff.finish()

    def sample_stream_async(self, prompt, num_samples: int = 1,
                            sampling_params: SamplingParams | None = None) -> AsyncIterator[SampleStreamChunk]:
        """The generated tokens as the sampler produces them (SampleStream), to iterate with `async for`: chunks of
        each of the `num_samples` sequences, in order per sequence, every token once. Leaving the loop early (break,
        an exception, the task cancelled) cancels the request on the sampler. Bad input raises here; the call's
        errors are the SDK's APIError subclasses, as for `sample`.

        The stream runs on the caller's own event loop (a channel and replica router of that loop), so its
        messages reach the consumer with no hop between threads, and through one generator."""
        request = self._stream_request(prompt, num_samples, sampling_params)
        return self._messages(None, request, SampleStreamChunk.from_proto)

    def sample_stream(self, prompt, num_samples: int = 1,
                      sampling_params: SamplingParams | None = None) -> Iterator[SampleStreamChunk]:
        """`sample_stream_async` for a thread without an event loop: blocks for each chunk. The stream runs on the
        client's I/O loop and reaches this thread in batches (`Handoff`: one wake-up per batch, not per message)."""
        request = self._stream_request(prompt, num_samples, sampling_params)
        handoff = Handoff()
        producer = runtime().submit(self._produce(request, handoff))
        try:
            while messages := handoff.take_blocking():
                for message in messages:
                    yield SampleStreamChunk.from_proto(message)
        finally:
            producer.cancel()

    # ---- logprobs -------------------------------------------------------------------------------------------

    async def _compute_logprobs(self, request: sampler_pb2.ComputeLogprobsRequest) -> list[float | None]:
        reply = await routed_call(self.sampler_address, self.adapter, "ComputeLogprobs", request, self.retry)
        return _prompt_logprobs(reply.logprobs)

    def compute_logprobs(self, prompt) -> APIFuture[list[float | None]]:
        """Logprob of each token given the ones before it; entry 0 is None (no context)."""
        request = sampler_pb2.ComputeLogprobsRequest(adapter=self._ref(), tokens=as_model_input(prompt).tokens)
        return APIFuture(runtime().submit(self._compute_logprobs(request)))

    async def compute_logprobs_async(self, prompt) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    # ---- helpers --------------------------------------------------------------------------------------------

    def get_tokenizer(self):
        if not self.trainer_address:
            raise ValueError("this SamplingClient knows no trainer to ask for the tokenizer; "
                             "use ServiceClient(...).get_tokenizer()")
        return fetch_tokenizer(self.trainer_address)
