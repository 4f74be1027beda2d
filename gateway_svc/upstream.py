"""The gateway's gRPC clients of the trainer, registry and sampler: the only gateway module that touches the
protobuf stubs. Every call converts plain domain values (gateway_svc.types) to requests and replies back, and every
gRPC error becomes a loraplane domain error (loraplane.rpc.domain_error_from_rpc), which http_errors maps to HTTP."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc

from gateway_svc.types import (
    AdapterInfo,
    DatumIn,
    FwdBwdResult,
    SampledSeq,
    SampleResult,
    SamplingSpec,
    ServerInfo,
    StreamDelta,
    VersionInfo,
)
from loraplane import errors
from loraplane.client.routing import TrainerRouter
from loraplane.client.sampler_routing import SamplerRouter
from loraplane.client.targets import tinker_expert_layout
from loraplane.client.tokenizer import tokenizer_from_info
from loraplane.membership import Membership
from loraplane.registry_client import RegistryClient, adapter_ref, expert_layout_name, expert_layout_value
from loraplane.rpc import ClientSecurity, aio_channel, domain_error_from_rpc
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2

log = logging.getLogger(__name__)
_TRANSIENT = (errors.Unavailable, errors.DeadlineExceeded, errors.ResourceExhausted)
LOG_EVERY_S = 10.0  # a failing service's address and status at WARNING at most this often
# Statuses grpc itself produces for a connection that failed (their details name the peer's address) or that the
# caller cannot act on; their details stay in the gateway's log.
_TRANSPORT_CODES = {
    grpc.StatusCode.UNAVAILABLE: "the service is unavailable; try again shortly",
    grpc.StatusCode.CANCELLED: "the call was cancelled; try again shortly",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the service did not answer in time",
    grpc.StatusCode.UNKNOWN: "the service failed (its details are in the gateway's log)",
    grpc.StatusCode.INTERNAL: "the service failed (its details are in the gateway's log)",
}
_FINISH = {sampler_pb2.FINISH_REASON_STOP: "stop", sampler_pb2.FINISH_REASON_LENGTH: "length"}


def _version(v: common_pb2.AdapterVersion) -> VersionInfo:
    return VersionInfo(
        adapter=v.adapter, version=v.version, sha256=v.sha256, size_bytes=v.size_bytes,
        training_step=v.training_step, create_time=v.create_time.ToNanoseconds() / 1e9,
        kind="training_state" if v.kind == common_pb2.VERSION_KIND_TRAINING_STATE else "weights",
        aliases=list(v.aliases))


def _converted(what: str, build):
    """`build()`, with protobuf's refusal of a value (an int beyond int32 / uint64, a wrong type) as the caller's
    InvalidArgument naming `what`: such a value is the request's fault, never an internal error."""
    try:
        return build()
    except (ValueError, TypeError, OverflowError) as exc:
        raise errors.InvalidArgument(f"{what}: a value out of range or of the wrong type ({exc})", field=what) from None


def _datum(d: DatumIn) -> trainer_pb2.Datum:
    out = trainer_pb2.Datum(input_tokens=d.input_tokens, target_tokens=d.target_tokens,
                            targets_per_position=d.targets_per_position)
    if d.weights is not None:
        out.weights.extend(d.weights)
    if d.logprobs is not None:
        out.logprobs.extend(d.logprobs)
    if d.advantages is not None:
        out.advantages.extend(d.advantages)
    if d.sequence_ratio_mask is not None:
        out.sequence_ratio_mask.extend(d.sequence_ratio_mask)
    return out


def _sampling_params(spec: SamplingSpec) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams(max_tokens=spec.max_tokens, top_k=spec.top_k,
                                       stop_token_ids=spec.stop_token_ids, stop_strings=spec.stop_strings)
    if spec.temperature is not None:
        params.temperature = spec.temperature
    if spec.top_p is not None:
        params.top_p = spec.top_p
    if spec.seed is not None:
        params.seed = spec.seed
    return params


def _checked_sampling_params(spec: SamplingSpec) -> common_pb2.SamplingParams:
    return _converted("sampling_params", lambda: _sampling_params(spec))


class Upstream:
    """One grpc.aio channel per service, opened lazily inside the running loop."""

    def __init__(self, trainer: str, registry: str, sampler: str, *, timeout: float = 600.0, retry_s: float = 60.0,
                 security: ClientSecurity | None = None, trainer_fleet: Membership | None = None):
        """`security`: the gateway's own API key (a service key) and TLS; each call adds the caller's tenant.
        `trainer_fleet`: the trainer fleet's membership in Redis, where the gateway finds live trainers when none it
        knows answers (the configured `trainer` address is then any member, or a Service in front of them)."""
        self.addresses = {"trainer": trainer, "registry": registry, "sampler": sampler}
        self.timeout = timeout
        self.retry_s = retry_s
        self.security = security or ClientSecurity()
        self.registry = RegistryClient(registry, timeout=60.0, security=self.security)
        self._channels: dict[str, grpc.aio.Channel] = {}
        # When each (service, status) last went to the log at WARNING: a service that is down fails every attempt
        # of every waiting call, and the operator needs its address once per LOG_EVERY_S, not per attempt.
        self._logged: dict[tuple[str, str], float] = {}
        self._info: ServerInfo | None = None
        self._tokenizer = None
        self._info_lock = asyncio.Lock()
        # A sampler fleet behind the configured address: each adapter's calls go to its replica (affinity with
        # bounded load), on to another at once if that one is gone. The gateway's service key sees the replicas.
        self.sampler_router = SamplerRouter(sampler, channel=functools.partial(self._member_channel, "sampler"))
        # A trainer fleet behind the configured address: each adapter's calls go to the member serving it, found
        # through any member (ResolveAdapter), and follow it when it moves (ADAPTER_MOVED, a member gone).
        self.trainer_fleet = trainer_fleet
        self.trainer_router = TrainerRouter(trainer, channel=functools.partial(self._member_channel, "trainer"),
                                            discover=self._live_trainers if trainer_fleet is not None else None)

    async def _live_trainers(self) -> list[str]:
        members = await asyncio.to_thread(self.trainer_fleet.members)
        return [m.report["address"] for m in members if m.live and m.report.get("address")]

    def _channel(self, service: str) -> grpc.aio.Channel:
        if service not in self._channels:
            self._channels[service] = aio_channel(self.addresses[service], self.security)
        return self._channels[service]

    def _member_channel(self, service: str, address: str) -> grpc.aio.Channel:
        """The channel to one fleet member of `service` (the configured address shares the service's channel)."""
        if address == self.addresses[service]:
            return self._channel(service)
        key = f"{service} {address}"
        if key not in self._channels:
            self._channels[key] = aio_channel(address, self.security)
        return self._channels[key]

    def _routed(self, adapter: str, call):
        """The attempt of a trainer call for `adapter`: `call(stub)` on the fleet member serving it. UNAVAILABLE
        (ADAPTER_MOVED, or that member gone) makes the retry, with the same seq_id, ask the fleet again."""
        async def attempt():
            stub = self.trainer_router.stub(await self.trainer_router.address_of(adapter))
            try:
                return await call(stub)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.trainer_router.forget(adapter)
                raise
        return attempt

    @property
    def sampler(self) -> sampler_pb2_grpc.SamplerServiceStub:
        return sampler_pb2_grpc.SamplerServiceStub(self._channel("sampler"))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await self.registry.close()
        if self.trainer_fleet is not None:
            self.trainer_fleet.close()

    async def _call(self, service: str, what: str, attempt):
        """`await attempt()`, retried with backoff for up to `retry_s` while the service is unreachable or busy
        (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED: the trainer consumed nothing then, and a repeated
        seq_id is applied once anyway), so a restarting trainer or sampler delays a Tinker future instead of
        failing it."""
        return await self._retrying(what, lambda: self._grpc(service, what, attempt))

    async def _grpc(self, service: str, what: str, attempt):
        try:
            return await attempt()
        except grpc.RpcError as exc:
            raise self._caller_error(exc, service, what) from None

    def _caller_error(self, exc: grpc.RpcError, service: str, what: str) -> errors.LoraplaneError:
        """The domain error a tenant is shown: the service's own status and message, but never the cluster's
        internals. A service's address (and grpc's transport details, which carry it: `ipv4:10.0.0.5:50053: Failed
        to connect`) is logged here for the operator and left out of the answer, as GetStatus keeps it from
        tenants."""
        error = domain_error_from_rpc(exc, f"{service}: {what}")
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        if code in _TRANSPORT_CODES:
            now, key = time.monotonic(), (service, code.name)
            level = logging.WARNING if now - self._logged.get(key, -LOG_EVERY_S) >= LOG_EVERY_S else logging.DEBUG
            if level == logging.WARNING:
                self._logged[key] = now
            log.log(level, "%s %s: %s: %s %s", service, self.addresses[service], what, code.name,
                    exc.details() if hasattr(exc, "details") else exc)
            error = type(error)(f"{service}: {what}: {_TRANSPORT_CODES[code]}", field=error.field)
        return self._hidden(error)

    async def _retrying(self, what: str, attempt):
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        retries = 0
        while True:
            try:
                return await attempt()
            except _TRANSIENT as exc:
                if time.monotonic() + delay > deadline:
                    if retries:
                        log.info("%s: %s after %d retries; giving up", what, type(exc).__name__, retries)
                    raise self._hidden(exc) from None
                # A call's first retry at INFO, the rest of its backoff at DEBUG: under load every waiting call
                # retries (15k INFO lines in one RL run against a busy trainer).
                log.log(logging.INFO if retries == 0 else logging.DEBUG, "%s: %s; retrying in %.1f s", what,
                        type(exc).__name__, delay)
                retries += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except errors.LoraplaneError as exc:
                raise self._hidden(exc) from None

    def _hidden(self, exc: errors.LoraplaneError) -> errors.LoraplaneError:
        """`exc` without the services' addresses (the registry client names its own in every message)."""
        message = exc.message
        for service, address in self.addresses.items():
            message = message.replace(f"{service} {address}", service).replace(address, service)
        for address in self.sampler_router.replicas.values():
            message = message.replace(address, "sampler")
        for address in self.trainer_router.known():
            message = message.replace(address, "trainer")
        if message == exc.message:
            return exc
        hidden = type(exc)(message, field=exc.field)
        hidden.reason = exc.reason
        return hidden

    # ---- trainer -------------------------------------------------------------------------------------------
    async def info(self) -> ServerInfo:
        if self._info is not None:  # every request asks (model names, tokenizer): no lock once known
            return self._info
        async with self._info_lock:
            if self._info is None:
                # Every member of a trainer fleet serves the same base model: any live one answers.
                reply = await self._call("trainer", "GetInfo", lambda: self.trainer_router.call_any(
                    lambda trainer: trainer.GetInfo(trainer_pb2.GetInfoRequest(include_tokenizer=True), timeout=60)))
                self._tokenizer = tokenizer_from_info(reply.tokenizer)
                self._info = ServerInfo(
                    base_model=reply.base_model, max_context_length=reply.max_context_length,
                    max_lora_rank=reply.max_lora_rank, supported_losses=list(reply.supported_losses),
                    eos_token_ids=list(reply.tokenizer.eos_token_ids), tokenizer_name=reply.tokenizer.name,
                    target_modules=list(reply.supported_target_modules))
            return self._info

    async def tokenizer(self):
        await self.info()
        return self._tokenizer

    async def create_adapter(self, name: str, *, rank: int, seed: int, targets: list[str],
                             metadata: dict[str, str], alpha: float = 0.0, expert_layout: str = "") -> None:
        """`expert_layout` "" = Tinker's: on a base model with routed gated experts, shared-outer (one LoRA factor on
        the hidden side shared by a layer's experts: tinker-cookbook's hyperparam_utils counts an adapter so, and
        its checkpoints hold it so), which the trainer's own default (per-expert) is not."""
        if not expert_layout:
            expert_layout = tinker_expert_layout(targets or (await self.info()).target_modules)
        config = _converted("lora_config", lambda: common_pb2.LoraConfig(
            rank=rank, alpha=alpha, seed=seed, target_modules=targets,
            expert_layout=expert_layout_value(expert_layout)))
        await self._call("trainer", f"CreateAdapter {name}", self._routed(name, lambda trainer: trainer.CreateAdapter(
            trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=config, metadata=metadata),
            timeout=self.timeout)))

    @staticmethod
    def prepare_forward_backward(adapter: str, seq_id: int, data: list[DatumIn], loss_fn: str,
                                 config: dict[str, float], forward_only: bool):
        """The trainer request (Forward or ForwardBackward), built apart from sending it so that a value protobuf
        refuses is known before anything reaches the trainer (InvalidArgument naming the datum)."""
        datums = [_converted(f"data[{i}]", lambda d=d: _datum(d)) for i, d in enumerate(data)]
        kind = trainer_pb2.ForwardRequest if forward_only else trainer_pb2.ForwardBackwardRequest
        return _converted("loss_fn_config", lambda: kind(adapter=adapter, seq_id=seq_id, data=datums,
                                                          loss_fn=loss_fn, loss_fn_config=config))

    async def delete_adapter(self, name: str) -> None:
        """The trainer's adapter only (slot, optimizer state, journal); its registry versions stay."""
        await self._call("trainer", f"DeleteAdapter {name}", self._routed(name, lambda trainer: trainer.DeleteAdapter(
            trainer_pb2.TrainerServiceDeleteAdapterRequest(name=name, delete_from_registry=False),
            timeout=self.timeout)))

    async def forward_backward(self, adapter: str, seq_id: int, data: list[DatumIn], loss_fn: str,
                               config: dict[str, float], forward_only: bool) -> FwdBwdResult:
        return await self.send_forward_backward(
            self.prepare_forward_backward(adapter, seq_id, data, loss_fn, config, forward_only))

    async def send_forward_backward(self, request) -> FwdBwdResult:
        adapter, seq_id = request.adapter, request.seq_id
        if isinstance(request, trainer_pb2.ForwardRequest):
            reply = await self._call("trainer", f"Forward {adapter}#{seq_id}", self._routed(
                adapter, lambda trainer: trainer.Forward(request, timeout=self.timeout)))
        else:
            reply = await self._call("trainer", f"ForwardBackward {adapter}#{seq_id}", self._routed(
                adapter, lambda trainer: trainer.ForwardBackward(request, timeout=self.timeout)))
        return FwdBwdResult(logprobs=[list(o.logprobs) for o in reply.outputs],
                            elementwise_loss=[list(o.elementwise_loss) for o in reply.outputs],
                            metrics=dict(reply.metrics))

    async def optim_step(self, adapter: str, seq_id: int, adam: dict[str, float]) -> dict[str, float]:
        adam_params = _converted("adam_params", lambda: trainer_pb2.AdamParams(**adam))
        reply = await self._call("trainer", f"OptimStep {adapter}#{seq_id}", self._routed(
            adapter, lambda trainer: trainer.OptimStep(trainer_pb2.OptimStepRequest(
                adapter=adapter, seq_id=seq_id, adam_params=adam_params), timeout=self.timeout)))
        metrics = dict(reply.metrics)
        names = {k.split(":")[0] for k in metrics}
        for name, value in (("grad_norm", reply.grad_norm), ("step", float(reply.step)),
                            ("skipped", float(reply.skipped))):
            if name not in names:
                metrics[name] = value
        return metrics

    async def publish_weights(self, adapter: str, seq_id: int, metadata: dict[str, str]) -> VersionInfo:
        reply = await self._call("trainer", f"PublishWeights {adapter}#{seq_id}", self._routed(
            adapter, lambda trainer: trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(
                adapter=adapter, seq_id=seq_id, metadata=metadata), timeout=self.timeout)))
        return _version(reply.version)

    async def save_state(self, adapter: str, seq_id: int, metadata: dict[str, str]) -> VersionInfo:
        reply = await self._call("trainer", f"SaveState {adapter}#{seq_id}", self._routed(
            adapter, lambda trainer: trainer.SaveState(trainer_pb2.SaveStateRequest(
                adapter=adapter, seq_id=seq_id, metadata=metadata), timeout=self.timeout)))
        return _version(reply.version)

    async def load_state(self, adapter: str, seq_id: int, source: str, version: int, with_optimizer: bool) -> None:
        await self._call("trainer", f"LoadState {adapter}#{seq_id}", self._routed(
            adapter, lambda trainer: trainer.LoadState(trainer_pb2.LoadStateRequest(
                adapter=adapter, seq_id=seq_id, with_optimizer=with_optimizer,
                source=common_pb2.AdapterRef(name=source, version=version)), timeout=self.timeout)))

    # ---- registry ------------------------------------------------------------------------------------------
    async def get_adapter(self, name: str) -> AdapterInfo:
        a = await self._retrying(f"GetAdapter {name}", lambda: self.registry.get_adapter(name))
        return AdapterInfo(name=a.name, rank=a.lora_config.rank, alpha=a.lora_config.alpha, base_model=a.base_model,
                           latest_version=a.latest_version, aliases=dict(a.aliases),
                           create_time=a.create_time.ToNanoseconds() / 1e9,
                           expert_layout=expert_layout_name(a.lora_config.expert_layout))

    async def list_adapters(self, prefix: str = "") -> list[AdapterInfo]:
        return [AdapterInfo(name=a.name, rank=a.lora_config.rank, alpha=a.lora_config.alpha,
                            base_model=a.base_model, latest_version=a.latest_version, aliases=dict(a.aliases),
                            create_time=a.create_time.ToNanoseconds() / 1e9)
                for a in await self._retrying("ListAdapters", lambda: self.registry.list_adapters(prefix))]

    async def list_versions(self, adapter: str) -> list[VersionInfo]:
        return [_version(v) for v in await self._retrying(
            f"ListVersions {adapter}", lambda: self.registry.list_versions(adapter))]

    async def download_version(self, adapter: str, version: int) -> bytes:
        """The version's PEFT safetensors blob (verified against its sha256 by the registry client)."""
        _described, blob = await self._retrying(f"DownloadVersion {adapter}@v{version}",
                                                lambda: self.registry.download(adapter, version))
        return blob

    async def delete_version(self, adapter: str, version: int) -> None:
        await self._retrying(f"DeleteVersion {adapter}@v{version}",
                             lambda: self.registry.delete_version(adapter, version))

    # ---- sampler -------------------------------------------------------------------------------------------
    @staticmethod
    def _ref(adapter: str, version: int = 0, alias: str = "") -> common_pb2.AdapterRef:
        return adapter_ref(adapter, version=version, alias=alias) if adapter else common_pb2.AdapterRef()

    async def sample(self, adapter: str, version: int, prompt: list[int], num_samples: int, spec: SamplingSpec,
                     prompt_logprobs: bool, alias: str = "", topk_prompt_logprobs: int = 0,
                     prompt_logprobs_last_n: int = 0) -> SampleResult:
        request = _converted("prompt", lambda: sampler_pb2.SampleRequest(
            adapter=self._ref(adapter, version, alias), prompt_tokens=prompt, num_samples=num_samples,
            sampling_params=_checked_sampling_params(spec), include_prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs, prompt_logprobs_last_n=prompt_logprobs_last_n))
        reply = await self._call("sampler", f"Sample {adapter or '<base>'}@{version or alias or 'latest'}",
                                 lambda: self.sampler_router.call(
                                     adapter, lambda stub: stub.Sample(request, timeout=self.timeout)))
        return SampleResult(
            sequences=[SampledSeq(list(s.tokens), list(s.logprobs), _FINISH.get(s.finish_reason, "length"))
                       for s in reply.sequences],
            prompt_logprobs=list(reply.prompt_logprobs) if prompt_logprobs else None,
            served_version=reply.served_version, topk_k=reply.topk_prompt_k,
            topk_token_ids=list(reply.topk_prompt_token_ids), topk_logprobs=list(reply.topk_prompt_logprobs))

    async def sampler_engine(self) -> str:
        """The sampler's engine ("torch" | "sglang"), asked once (recorded with every stability record)."""
        if not getattr(self, "_engine", ""):
            reply = await self._call("sampler", "GetStatus", lambda: self.sampler.GetStatus(
                sampler_pb2.GetStatusRequest(), timeout=60))
            self._engine = reply.engine
        return self._engine

    async def sample_stream(self, adapter: str, version: int, prompt: list[int], num_samples: int,
                            spec: SamplingSpec, alias: str = "") -> AsyncIterator[StreamDelta]:
        request = _converted("prompt", lambda: sampler_pb2.SampleStreamRequest(
            adapter=self._ref(adapter, version, alias), prompt_tokens=prompt, num_samples=num_samples,
            sampling_params=_checked_sampling_params(spec)))
        stream = self.sampler_router.stream(adapter, lambda stub: stub.SampleStream(request, timeout=self.timeout))
        try:
            async for msg in stream:
                yield StreamDelta(index=msg.sequence_index, tokens=list(msg.tokens), logprobs=list(msg.logprobs),
                                  finish_reason=_FINISH.get(msg.finish_reason))
        except grpc.RpcError as exc:
            raise self._caller_error(exc, "sampler", "SampleStream") from None
        finally:
            await stream.aclose()


__all__ = ["Upstream", "errors"]
