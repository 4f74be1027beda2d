"""SamplerService over gRPC: protobuf <-> domain conversion only; errors are mapped by `map_servicer_errors`."""

from __future__ import annotations

import re

from google.protobuf import timestamp_pb2

from loraplane import errors, metrics
from loraplane.auth import current_caller
from loraplane.rpc import map_servicer_errors
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
from sampler_svc.adapter_manager import LoadedVersion
from sampler_svc.engines.base import FINISH_LENGTH, FINISH_STOP
from sampler_svc.service import AdapterSelector, PushHeader, SamplerService, SamplingInput

_FINISH = {
    None: sampler_pb2.FINISH_REASON_UNSPECIFIED,
    FINISH_LENGTH: sampler_pb2.FINISH_REASON_LENGTH,
    FINISH_STOP: sampler_pb2.FINISH_REASON_STOP,
}


# The registry's spelling of names and aliases. \Z, not $: "$" also matches before a trailing newline.
_NAME = re.compile(r"^(?:[a-z0-9][a-z0-9._-]{0,62}/)?[a-z0-9][a-z0-9._-]{0,62}\Z")
_ALIAS = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}\Z")


def _selector(ref: common_pb2.AdapterRef, field: str = "adapter") -> AdapterSelector:
    """Wire checks of a reference, before the service resolves it: a name or alias the registry would refuse is
    this request's INVALID_ARGUMENT (naming this request's field), not a registry error about its own."""
    which = ref.WhichOneof("selector")
    if ref.name and not _NAME.match(ref.name):
        raise errors.InvalidArgument(f"{field}.name {errors.shown(ref.name)} is not a valid adapter name "
                                     "([a-z0-9][a-z0-9._-]{0,62}, optionally tenant/name)", field=f"{field}.name")
    if which == "alias" and not _ALIAS.match(ref.alias):
        raise errors.InvalidArgument(f"{field}.alias {errors.shown(ref.alias)} is not a valid alias "
                                     "([a-z0-9][a-z0-9._-]{0,62}; unset it for the latest version)",
                                     field=f"{field}.alias")
    return AdapterSelector(name=ref.name, version=ref.version if which == "version" else 0,
                           alias=ref.alias if which == "alias" else "")


def _sampling(params: common_pb2.SamplingParams) -> SamplingInput:
    return SamplingInput(
        max_tokens=params.max_tokens,
        temperature=params.temperature if params.HasField("temperature") else None,
        top_p=params.top_p if params.HasField("top_p") else None,
        top_k=params.top_k,
        stop_token_ids=tuple(params.stop_token_ids),
        stop_strings=tuple(params.stop_strings),
        seed=params.seed if params.HasField("seed") else None,
    )


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _loaded(entry: LoadedVersion) -> sampler_pb2.LoadedAdapter:
    return sampler_pb2.LoadedAdapter(
        adapter=entry.adapter, version=entry.version, sha256=entry.sha256, pinned=entry.pinned,
        active_requests=max(entry.active_requests, 0), rank=entry.rank, load_time=_timestamp(entry.load_time),
        last_used_time=_timestamp(entry.last_used_time))


@map_servicer_errors
class SamplerServicer(sampler_pb2_grpc.SamplerServiceServicer):
    def __init__(self, service: SamplerService):
        self.service = service

    async def Sample(self, request: sampler_pb2.SampleRequest, context) -> sampler_pb2.SampleResponse:
        result = await self.service.sample(_selector(request.adapter), request.prompt_tokens, request.num_samples,
                                           _sampling(request.sampling_params), request.include_prompt_logprobs,
                                           topk_prompt_logprobs=request.topk_prompt_logprobs,
                                           prompt_logprobs_last_n=request.prompt_logprobs_last_n,
                                           caller=current_caller())
        metrics.SAMPLED_TOKENS.labels(metrics.tenant_of(request.adapter.name)).inc(
            sum(len(s.tokens) for s in result.sequences))
        reply = sampler_pb2.SampleResponse(
            sequences=[sampler_pb2.SampledSequence(tokens=s.tokens, logprobs=s.logprobs,
                                                   finish_reason=_FINISH[s.finish_reason])
                       for s in result.sequences],
            prompt_logprobs=result.prompt_logprobs, served_version=result.served_version)
        if result.topk_prompt is not None:
            reply.topk_prompt_k = request.topk_prompt_logprobs
            reply.topk_prompt_token_ids.extend(t for row in result.topk_prompt.token_ids for t in row)
            reply.topk_prompt_logprobs.extend(v for row in result.topk_prompt.logprobs for v in row)
        return reply

    async def SampleStream(self, request: sampler_pb2.SampleStreamRequest, context):
        # One message per engine update: an update carries every token the engine had when the previous message
        # left (one under light load, a backlog under heavy load), so a stream never waits behind its own messages.
        sampled = None  # the tenant's counter, looked up at the first chunk (a refused request adds no label)
        response = sampler_pb2.SampleStreamResponse
        finish = _FINISH
        async for chunk in self.service.sample_stream(_selector(request.adapter), request.prompt_tokens,
                                                      request.num_samples, _sampling(request.sampling_params),
                                                      caller=current_caller()):
            if sampled is None:
                sampled = metrics.SAMPLED_TOKENS.labels(metrics.tenant_of(request.adapter.name))
            sampled.inc(len(chunk.tokens))
            yield response(sequence_index=chunk.sequence_index, tokens=chunk.tokens, logprobs=chunk.logprobs,
                           finish_reason=finish[chunk.finish_reason], served_version=chunk.served_version)

    async def ComputeLogprobs(self, request: sampler_pb2.ComputeLogprobsRequest,
                              context) -> sampler_pb2.ComputeLogprobsResponse:
        values, version = await self.service.compute_logprobs(_selector(request.adapter), request.tokens,
                                                              caller=current_caller())
        return sampler_pb2.ComputeLogprobsResponse(logprobs=values, served_version=version)

    async def ListLoadedAdapters(self, request: sampler_pb2.ListLoadedAdaptersRequest,
                                 context) -> sampler_pb2.ListLoadedAdaptersResponse:
        if request.adapter and not _NAME.match(request.adapter):
            raise errors.InvalidArgument(f"adapter {errors.shown(request.adapter)} is not a valid adapter name",
                                         field="adapter")
        page, token = self.service.list_loaded(request.adapter, request.page_size, request.page_token,
                                                   caller=current_caller())
        return sampler_pb2.ListLoadedAdaptersResponse(adapters=[_loaded(e) for e in page], next_page_token=token)

    async def LoadAdapter(self, request: sampler_pb2.LoadAdapterRequest, context) -> sampler_pb2.LoadAdapterResponse:
        entry = await self.service.load_adapter(_selector(request.adapter), request.pin, caller=current_caller())
        return sampler_pb2.LoadAdapterResponse(adapter=_loaded(entry))

    async def UnloadAdapter(self, request: sampler_pb2.UnloadAdapterRequest,
                            context) -> sampler_pb2.UnloadAdapterResponse:
        if request.adapter and not _NAME.match(request.adapter):
            raise errors.InvalidArgument(f"adapter {errors.shown(request.adapter)} is not a valid adapter name",
                                         field="adapter")
        self.service.unload_adapter(request.adapter, request.version, caller=current_caller())
        return sampler_pb2.UnloadAdapterResponse()

    async def GetStatus(self, request: sampler_pb2.GetStatusRequest, context) -> sampler_pb2.GetStatusResponse:
        status = self.service.status(caller=current_caller())
        return sampler_pb2.GetStatusResponse(
            engine=status.engine, base_model=status.base_model, loaded=[_loaded(e) for e in status.loaded],
            queue_depth=status.queue_depth, running_requests=status.running_requests,
            watch_cursor=status.watch_cursor, registry_connected=status.registry_connected,
            keep_versions=status.keep_versions, max_loaded=status.max_loaded, engine_servers=status.engine_servers)

    async def ListReplicas(self, request: sampler_pb2.ListReplicasRequest,
                           context) -> sampler_pb2.ListReplicasResponse:
        listing = self.service.list_replicas(request.page_size, request.page_token, caller=current_caller())
        return sampler_pb2.ListReplicasResponse(
            replicas=[sampler_pb2.SamplerReplica(
                replica_id=r.replica_id, address=r.address, in_flight=max(r.in_flight, 0),
                loaded_versions=r.loaded_versions,
                heartbeat_time=_timestamp(r.heartbeat_at) if r.heartbeat_at else None) for r in listing.replicas],
            next_page_token=listing.next_page_token, fleet=listing.fleet, replica_id=listing.replica_id)

    async def PushVersion(self, request_iterator, context) -> sampler_pb2.PushVersionResponse:
        caller = current_caller()
        self.service.authorize_push(caller)  # before reading anything of the stream
        requests = request_iterator.__aiter__()
        first = await anext(requests, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise errors.InvalidArgument("the first message of PushVersion must be the header", field="header")
        header = first.header

        async def chunks():
            async for message in requests:
                if message.WhichOneof("payload") != "chunk":
                    raise errors.InvalidArgument("only chunks follow the header", field="chunk")
                yield message.chunk

        staged = await self.service.push_version(
            PushHeader(adapter=header.adapter, sha256=header.sha256, size_bytes=header.size_bytes,
                       shared_memory_name=header.shared_memory_name), chunks(), caller=caller)
        return sampler_pb2.PushVersionResponse(staged=staged)
