"""The sampler's domain API: validation of every request field, leases on adapter versions, engine calls.

No grpc here: the servicer converts protobuf messages to these calls and back, and errors raised here are mapped to
status codes by `loraplane.rpc`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import math
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from loraplane import errors
from loraplane.auth import OPEN, Identity, TenantCounter
from loraplane.fields import validate_name
from sampler_svc.adapter_manager import AdapterManager, LoadedVersion
from sampler_svc.engines.base import (
    DEFAULT_MAX_TOKENS,
    Engine,
    GenerationRequest,
    GenerationUpdate,
    SamplingOptions,
    TopkRows,
)
from sampler_svc.fleet import Replica
from sampler_svc.staging import read_shared_memory

ALIAS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_TOKENS_LIMIT = 4096
MAX_TEMPERATURE = 100.0
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Top-k prompt logprobs: k per position (what SGLang and OpenAI-style servers allow).
MAX_TOPK_PROMPT_LOGPROBS = 20
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
SHA256_HEX = re.compile(r"^[0-9a-f]{64}\Z")
MAX_PUSH_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class AdapterSelector:
    """AdapterRef in domain form: empty name = base model; version 0 and no alias = latest."""

    name: str = ""
    version: int = 0
    alias: str = ""


@dataclass(frozen=True)
class SamplingInput:
    """SamplingParams as received; None = the field was not set."""

    max_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class SampledSequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float]
    served_version: int
    topk_prompt: TopkRows | None = None


@dataclass
class StreamChunk:
    sequence_index: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None
    served_version: int


@dataclass
class SamplerStatus:
    engine: str
    base_model: str
    loaded: list[LoadedVersion]
    queue_depth: int
    running_requests: int
    watch_cursor: str
    registry_connected: bool
    keep_versions: int
    max_loaded: int
    engine_servers: list[str]


@dataclass(frozen=True)
class PushHeader:
    """PushVersion's header: the blob a trainer is publishing for `adapter`, in a shared-memory segment of this host
    (`shared_memory_name`) or as the chunks that follow."""

    adapter: str
    sha256: str
    size_bytes: int
    shared_memory_name: str = ""


@dataclass
class ReplicaListing:
    """A page of ListReplicas; `fleet` and `replica_id` (the answering replica) are empty for a tenant's key."""

    replicas: list[Replica]
    next_page_token: str
    fleet: str = ""
    replica_id: str = ""


class SamplerService:
    def __init__(self, engine: Engine, manager: AdapterManager, *, max_num_samples: int = 16):
        self.engine = engine
        self.manager = manager
        self.max_num_samples = max_num_samples
        self._samples = TenantCounter("max_concurrent_samples")
        # Requests being served (Sample, SampleStream, ComputeLogprobs): the load a fleet replica reports.
        self.in_flight = 0
        self.served = 0  # requests finished since start (a counter)
        # Who this sampler is to clients: its replica id and address, and its fleet (sampler_svc.fleet) if any.
        self.replica_id = ""
        self.address = ""
        self.fleet = None

    @contextlib.contextmanager
    def _serving(self, caller: Identity) -> Iterator[None]:
        with self._samples.hold(caller):
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1
                self.served += 1

    # ------------------------------------------------------------------ validation

    def _check_adapter(self, selector: AdapterSelector, field_name: str = "adapter") -> None:
        if selector.name:
            validate_name(selector.name, f"{field_name}.name")
        if not selector.name and (selector.version or selector.alias):
            raise errors.InvalidArgument(f"{field_name}.version / {field_name}.alias need {field_name}.name "
                                         "(an empty name means the base model)", field=f"{field_name}.name")
        if selector.alias and not ALIAS_NAME.match(selector.alias):
            raise errors.InvalidArgument(f"{field_name}.alias {selector.alias!r} is not a valid alias",
                                         field=f"{field_name}.alias")

    def _check_tokens(self, tokens: Sequence[int], field_name: str, *, reserve: int = 0) -> None:
        if not tokens:
            raise errors.InvalidArgument(f"{field_name} is empty; give at least one token", field=field_name)
        limit = self.engine.max_context_length - reserve
        if len(tokens) > limit:
            raise errors.InvalidArgument(
                f"{field_name} has {len(tokens)} tokens; the limit is {limit} (context length "
                f"{self.engine.max_context_length}{f' minus {reserve} to generate' if reserve else ''})",
                field=field_name)
        vocab = self.engine.vocab_size
        for index, token in enumerate(tokens):
            if token < 0 or token >= vocab:
                raise errors.InvalidArgument(
                    f"{field_name}[{index}] = {token} is outside the vocabulary [0, {vocab})", field=field_name)

    def _options(self, params: SamplingInput, prompt_length: int) -> SamplingOptions:
        max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
        if max_tokens > MAX_TOKENS_LIMIT:
            raise errors.InvalidArgument(f"sampling_params.max_tokens {max_tokens} exceeds {MAX_TOKENS_LIMIT}",
                                         field="sampling_params.max_tokens")
        room = self.engine.max_context_length - prompt_length
        if max_tokens > room:
            raise errors.InvalidArgument(
                f"sampling_params.max_tokens {max_tokens} plus the {prompt_length}-token prompt exceeds the context "
                f"length {self.engine.max_context_length} (at most {room} new tokens)",
                field="sampling_params.max_tokens")
        temperature = 1.0 if params.temperature is None else float(params.temperature)
        if not math.isfinite(temperature) or temperature < 0 or temperature > MAX_TEMPERATURE:
            raise errors.InvalidArgument(
                f"sampling_params.temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature}",
                field="sampling_params.temperature")
        top_p = 1.0 if params.top_p is None else float(params.top_p)
        if not math.isfinite(top_p) or top_p <= 0 or top_p > 1:
            raise errors.InvalidArgument(f"sampling_params.top_p must be in (0, 1], got {top_p}",
                                         field="sampling_params.top_p")
        if params.top_k < -1:
            raise errors.InvalidArgument(f"sampling_params.top_k must be >= -1 (0 or -1 = off), got {params.top_k}",
                                         field="sampling_params.top_k")
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise errors.InvalidArgument(
                f"sampling_params.stop_token_ids has {len(params.stop_token_ids)} entries; the limit is "
                f"{MAX_STOP_TOKEN_IDS}", field="sampling_params.stop_token_ids")
        vocab = self.engine.vocab_size
        for token in params.stop_token_ids:
            if token < 0 or token >= vocab:
                raise errors.InvalidArgument(
                    f"sampling_params.stop_token_ids: {token} is outside the vocabulary [0, {vocab})",
                    field="sampling_params.stop_token_ids")
        if len(params.stop_strings) > MAX_STOP_STRINGS:
            raise errors.InvalidArgument(
                f"sampling_params.stop_strings has {len(params.stop_strings)} entries; the limit is "
                f"{MAX_STOP_STRINGS}", field="sampling_params.stop_strings")
        for stop in params.stop_strings:
            if not stop or len(stop) > MAX_STOP_STRING_CHARS:
                raise errors.InvalidArgument(
                    f"sampling_params.stop_strings entries must have 1..{MAX_STOP_STRING_CHARS} characters, got "
                    f"{len(stop)}", field="sampling_params.stop_strings")
        if params.stop_strings and not self.engine.supports_stop_strings:
            raise errors.InvalidArgument(f"the {self.engine.name} engine does not support stop_strings",
                                         field="sampling_params.stop_strings")
        return SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                               top_k=max(params.top_k, 0), stop_token_ids=tuple(params.stop_token_ids),
                               stop_strings=tuple(params.stop_strings), seed=params.seed)

    def _generation_request(self, selector: AdapterSelector, prompt: Sequence[int], num_samples: int,
                            params: SamplingInput, include_prompt_logprobs: bool, topk_prompt_logprobs: int = 0,
                            prompt_logprobs_last_n: int = 0) -> GenerationRequest:
        self._check_adapter(selector)
        num_samples = num_samples or 1
        if num_samples < 1 or num_samples > self.max_num_samples:
            raise errors.InvalidArgument(f"num_samples must be in [1, {self.max_num_samples}], got {num_samples}",
                                         field="num_samples")
        self._check_tokens(prompt, "prompt_tokens", reserve=1)
        if not 0 <= topk_prompt_logprobs <= MAX_TOPK_PROMPT_LOGPROBS:
            raise errors.InvalidArgument(
                f"topk_prompt_logprobs must be in [0, {MAX_TOPK_PROMPT_LOGPROBS}] (0 = none), got "
                f"{topk_prompt_logprobs}", field="topk_prompt_logprobs")
        if prompt_logprobs_last_n:
            if not include_prompt_logprobs and not topk_prompt_logprobs:
                raise errors.InvalidArgument("prompt_logprobs_last_n applies to prompt logprobs: set "
                                             "include_prompt_logprobs or topk_prompt_logprobs",
                                             field="prompt_logprobs_last_n")
            if not 1 <= prompt_logprobs_last_n <= len(prompt) - 1:
                raise errors.InvalidArgument(
                    f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}] (the prompt's length - 1; 0 = the "
                    f"whole prompt), got {prompt_logprobs_last_n}", field="prompt_logprobs_last_n")
        options = self._options(params, len(prompt))
        return GenerationRequest(prompt_tokens=tuple(int(t) for t in prompt), options=options,
                                 num_samples=num_samples, include_prompt_logprobs=include_prompt_logprobs,
                                 topk_prompt_logprobs=topk_prompt_logprobs,
                                 prompt_logprobs_last_n=prompt_logprobs_last_n)

    # ------------------------------------------------------------------ RPCs

    async def sample(self, selector: AdapterSelector, prompt: Sequence[int], num_samples: int,
                     params: SamplingInput, include_prompt_logprobs: bool = False, *,
                     topk_prompt_logprobs: int = 0, prompt_logprobs_last_n: int = 0,
                     caller: Identity = OPEN) -> SampleResult:
        _authorize(caller, selector)
        request = self._generation_request(selector, prompt, num_samples, params, include_prompt_logprobs,
                                           topk_prompt_logprobs, prompt_logprobs_last_n)
        with self._serving(caller):
            return await self._sample(selector, request)

    async def _sample(self, selector: AdapterSelector, request: GenerationRequest) -> SampleResult:
        async with await self.manager.acquire(selector.name, selector.version, selector.alias) as lease:
            request = dataclasses.replace(request, adapter_key=lease.adapter_key)
            sequences = [SampledSequence() for _ in range(request.num_samples)]
            prompt_logprobs: list[float] = []
            topk_prompt: TopkRows | None = None
            stream = self.engine.generate(request)
            try:
                async for update in stream:
                    _merge(sequences, update)
                    if update.prompt_logprobs is not None:
                        prompt_logprobs = update.prompt_logprobs
                    if update.topk_prompt is not None:
                        topk_prompt = update.topk_prompt
            finally:
                await stream.aclose()
            return SampleResult(sequences=sequences, prompt_logprobs=prompt_logprobs, served_version=lease.version,
                                topk_prompt=topk_prompt)

    async def sample_stream(self, selector: AdapterSelector, prompt: Sequence[int], num_samples: int,
                            params: SamplingInput, *, caller: Identity = OPEN) -> AsyncIterator[StreamChunk]:
        _authorize(caller, selector)
        request = self._generation_request(selector, prompt, num_samples, params, False)
        # One generator between the engine and the servicer (each layer costs a frame switch per message).
        with self._serving(caller):
            async with await self.manager.acquire(selector.name, selector.version, selector.alias) as lease:
                version = lease.version
                stream = self.engine.generate(dataclasses.replace(request, adapter_key=lease.adapter_key,
                                                                  stream=True))
                try:
                    async for update in stream:
                        if update.tokens or update.finish_reason is not None:
                            yield StreamChunk(update.sequence_index, update.tokens, update.logprobs,
                                              update.finish_reason, version)
                finally:
                    await stream.aclose()

    async def compute_logprobs(self, selector: AdapterSelector, tokens: Sequence[int], *,
                               caller: Identity = OPEN) -> tuple[list[float], int]:
        self._check_adapter(selector)
        _authorize(caller, selector)
        self._check_tokens(tokens, "tokens")
        with self._serving(caller):
            async with await self.manager.acquire(selector.name, selector.version, selector.alias) as lease:
                values = await self.engine.compute_logprobs([int(t) for t in tokens], lease.adapter_key)
                return values, lease.version

    def list_loaded(self, adapter: str, page_size: int, page_token: str, *,
                    caller: Identity = OPEN) -> tuple[list[LoadedVersion], str]:
        if adapter:
            validate_name(adapter, "adapter")
            caller.authorize(adapter, "adapter")
        if page_size < 0:
            raise errors.InvalidArgument(f"page_size must be >= 0, got {page_size}", field="page_size")
        page_size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        entries = [e for e in self.manager.list_loaded(adapter) if caller.may_see(e.adapter)]
        if page_token:
            after = _decode_page_token(page_token, adapter)
            entries = [e for e in entries if (e.adapter, e.version) > after]
        page = entries[:page_size]
        next_token = _encode_page_token(page[-1], adapter) if len(entries) > page_size else ""
        return page, next_token

    async def load_adapter(self, selector: AdapterSelector, pin: bool, *, caller: Identity = OPEN) -> LoadedVersion:
        self._check_adapter(selector)
        _authorize(caller, selector)
        if not selector.name:
            raise errors.InvalidArgument("adapter.name is required (the base model is always loaded)",
                                         field="adapter.name")
        return await self.manager.pin(selector.name, selector.version, selector.alias, pin=pin)

    def unload_adapter(self, adapter: str, version: int, *, caller: Identity = OPEN) -> None:
        if not adapter:
            raise errors.InvalidArgument("adapter is required", field="adapter")
        validate_name(adapter, "adapter")
        caller.authorize(adapter, "adapter")
        self.manager.unpin(adapter, version)

    def status(self, *, caller: Identity = OPEN) -> SamplerStatus:
        loaded = [e for e in self.manager.list_loaded() if caller.may_see(e.adapter)]
        return SamplerStatus(
            engine=self.engine.name, base_model=self.engine.base_model_name, loaded=loaded,
            queue_depth=self.engine.queue_depth, running_requests=self.engine.running_requests,
            watch_cursor=self.manager.cursor, registry_connected=self.manager.registry_connected,
            keep_versions=self.manager.keep_versions, max_loaded=self.manager.max_loaded,
            engine_servers=self.engine.server_urls if caller.scope is None else [])


    def authorize_push(self, caller: Identity) -> None:
        """Before a push's first message is read: only the services of this deployment (and operators) push."""
        caller.require_service("PushVersion")

    async def push_version(self, header: PushHeader, chunks: AsyncIterator[bytes], *,
                           caller: Identity = OPEN) -> bool:
        """Stages a pushed blob for the adapter manager (sampler_svc/staging.py); True when staged, False when this
        sampler already holds those bytes. Staging serves nothing by itself: the bytes become a version only when the
        registry commits them as one. A push cut off midway, or whose bytes do not hash to header.sha256, stages
        nothing."""
        self.authorize_push(caller)
        validate_name(header.adapter, "header.adapter")
        caller.authorize(header.adapter, "header.adapter")
        if not header.adapter.startswith(self.manager.watch_prefix):
            raise errors.PermissionDenied(f"header.adapter: this sampler serves only adapters named "
                                          f"{self.manager.watch_prefix}*", field="header.adapter")
        if not SHA256_HEX.match(header.sha256):
            raise errors.InvalidArgument(f"header.sha256 {errors.shown(header.sha256)} is not a lower-case hex sha256",
                                         field="header.sha256")
        if header.size_bytes < 1:
            raise errors.InvalidArgument("header.size_bytes must be > 0", field="header.size_bytes")
        staging = self.manager.staging
        if self.manager.holds_blob(header.adapter, header.sha256) or staging.has(header.adapter, header.sha256):
            return False
        incoming = staging.begin(header.adapter, header.sha256, header.size_bytes)
        try:
            if header.shared_memory_name:
                async for _ in chunks:
                    raise errors.InvalidArgument("chunk: a push through shared memory carries no chunks",
                                                 field="chunk")
                blob, hasher = await asyncio.to_thread(read_shared_memory, header.shared_memory_name,
                                                       header.size_bytes)
                await staging.finish(incoming, blob, hasher)
                return True
            received = bytearray()
            hasher = hashlib.sha256()
            async for chunk in chunks:
                if len(chunk) > MAX_PUSH_CHUNK_BYTES:
                    raise errors.InvalidArgument(f"chunk has {len(chunk)} bytes; the limit is {MAX_PUSH_CHUNK_BYTES}",
                                                 field="chunk")
                if len(received) + len(chunk) > header.size_bytes:
                    raise errors.InvalidArgument(f"the chunks exceed header.size_bytes ({header.size_bytes})",
                                                 field="chunk")
                hasher.update(chunk)
                received += chunk
            await staging.finish(incoming, bytes(received), hasher)
            return True
        finally:
            staging.abort(incoming)  # no-op once staged

    def list_replicas(self, page_size: int, page_token: str, *, caller: Identity = OPEN) -> ReplicaListing:
        """The fleet's live replicas (this sampler alone outside a fleet). Replica addresses and loads are the
        operator's: a caller confined to a tenant's namespace gets an empty list (docs/security.md) and keeps
        calling the address it was given, which serves every adapter as well."""
        if page_size < 0:
            raise errors.InvalidArgument(f"page_size must be >= 0, got {page_size}", field="page_size")
        page_size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = ""
        if page_token:
            try:
                after = base64.b64decode(page_token.encode(), altchars=b"-_", validate=True).decode()
            except (ValueError, UnicodeDecodeError):
                after = ""
            if not after:
                raise errors.InvalidArgument("page_token is malformed; pass a next_page_token unchanged",
                                             field="page_token")
        if caller.scope is not None:
            return ReplicaListing([], "")
        if self.fleet is not None:
            replicas = self.fleet.replicas()
        else:
            replicas = [Replica(self.replica_id, self.address, self.in_flight, len(self.manager.list_loaded()))]
        replicas = [r for r in replicas if r.replica_id > after]
        page = replicas[:page_size]
        token = base64.urlsafe_b64encode(page[-1].replica_id.encode()).decode() if len(replicas) > page_size else ""
        return ReplicaListing(page, token, self.fleet.fleet if self.fleet is not None else "", self.replica_id)


def _authorize(caller: Identity, selector: AdapterSelector) -> None:
    # The base model (no name) is every caller's.
    if selector.name:
        caller.authorize(selector.name, "adapter.name")


def _merge(sequences: list[SampledSequence], update: GenerationUpdate) -> None:
    if not update.tokens and update.finish_reason is None:
        return
    target = sequences[update.sequence_index]
    target.tokens.extend(update.tokens)
    target.logprobs.extend(update.logprobs)
    if update.finish_reason is not None:
        target.finish_reason = update.finish_reason


def _encode_page_token(last: LoadedVersion, adapter_filter: str) -> str:
    raw = f"{adapter_filter}\n{last.adapter}\n{last.version}".encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_page_token(token: str, adapter_filter: str) -> tuple[str, int]:
    try:
        scope, adapter, version = base64.urlsafe_b64decode(token.encode()).decode().split("\n")
        position = (adapter, int(version))
    except (ValueError, UnicodeDecodeError):
        raise errors.InvalidArgument("page_token is malformed; pass a next_page_token unchanged",
                                     field="page_token") from None
    if scope != adapter_filter:
        raise errors.InvalidArgument("page_token belongs to a listing with a different adapter filter",
                                     field="page_token")
    return position
