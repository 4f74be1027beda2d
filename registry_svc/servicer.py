"""gRPC transport of the registry: protobuf <-> domain conversion only; the work is in `store.RegistryStore`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf import timestamp_pb2

from loraplane import errors, metrics
from loraplane.auth import current_caller
from loraplane.lora import LoraSpec
from loraplane.registry_client import expert_layout_name, expert_layout_value
from loraplane.rpc import map_servicer_errors
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from registry_svc.events import EventRecord
from registry_svc.publish import PublishHeader, PublishTrailer
from registry_svc.records import KIND_WEIGHTS, AdapterRecord, VersionRecord
from registry_svc.store import RegistryStore


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def adapter_pb(record: AdapterRecord) -> registry_pb2.Adapter:
    return registry_pb2.Adapter(
        name=record.name,
        lora_config=common_pb2.LoraConfig(rank=record.lora.rank, alpha=record.lora.alpha,
                                          target_modules=record.lora.target_modules, seed=record.lora.seed,
                                          weights_dtype=record.weights_dtype,
                                          expert_layout=expert_layout_value(record.lora.expert_layout)),
        base_model=record.base_model, keep_last=record.keep_last, metadata=record.metadata, aliases=record.aliases,
        latest_version=record.latest_version, create_time=_timestamp(record.create_time_ms))


def version_pb(record: VersionRecord) -> common_pb2.AdapterVersion:
    return common_pb2.AdapterVersion(
        adapter=record.adapter, version=record.version, kind=record.kind, sha256=record.sha256,
        size_bytes=record.size_bytes, training_step=record.training_step, metadata=record.metadata,
        aliases=record.aliases, create_time=_timestamp(record.create_time_ms), pending=record.pending)


def event_pb(record: EventRecord) -> registry_pb2.Event:
    return registry_pb2.Event(
        cursor=record.cursor, type=record.type, adapter=record.adapter, version=record.version, sha256=record.sha256,
        alias=record.alias, kind=record.kind, time=_timestamp(record.time_ms))


def _ref_fields(ref: common_pb2.AdapterRef) -> tuple[str, int, str]:
    selector = ref.WhichOneof("selector")
    if selector == "alias" and not ref.alias:
        raise errors.InvalidArgument("ref.alias: set but empty", field="ref.alias")
    return ref.name, ref.version if selector == "version" else 0, ref.alias if selector == "alias" else ""


@map_servicer_errors
class RegistryServicer(registry_pb2_grpc.AdapterRegistryServiceServicer):
    def __init__(self, store: RegistryStore):
        self.store = store

    async def CreateAdapter(self, request, context):
        adapter = request.adapter
        lora = adapter.lora_config
        record = await self.store.create_adapter(
            adapter.name, LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=tuple(lora.target_modules),
                                   seed=lora.seed, expert_layout=expert_layout_name(lora.expert_layout)),
            adapter.base_model, adapter.keep_last, dict(adapter.metadata), weights_dtype=lora.weights_dtype,
            caller=current_caller())
        return registry_pb2.CreateAdapterResponse(adapter=adapter_pb(record))

    async def GetAdapter(self, request, context):
        return registry_pb2.GetAdapterResponse(adapter=adapter_pb(await self.store.get_adapter(request.name, caller=current_caller())))

    async def ListAdapters(self, request, context):
        records, token = await self.store.list_adapters(request.prefix, request.page_size, request.page_token,
                                                          caller=current_caller())
        return registry_pb2.ListAdaptersResponse(adapters=[adapter_pb(r) for r in records], next_page_token=token)

    async def DeleteAdapter(self, request, context):
        await self.store.delete_adapter(request.name, caller=current_caller())
        return registry_pb2.DeleteAdapterResponse()

    async def PublishVersion(self, request_iterator, context):
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise errors.InvalidArgument("header: the first message of PublishVersion must be the header",
                                         field="header")
        header_pb = first.header
        header = PublishHeader(
            adapter=header_pb.adapter, sha256=header_pb.sha256, size_bytes=header_pb.size_bytes,
            idempotency_key=header_pb.idempotency_key, training_step=header_pb.training_step,
            metadata=dict(header_pb.metadata), aliases=list(header_pb.aliases),
            kind=header_pb.kind or KIND_WEIGHTS, upload_later=header_pb.upload_later,
            reserved_version=header_pb.reserved_version)

        async def chunks() -> AsyncIterator[bytes | PublishTrailer]:
            async for message in requests:
                payload = message.WhichOneof("payload")
                if payload == "chunk":
                    yield message.chunk
                elif payload == "trailer":
                    yield PublishTrailer(message.trailer.sha256)
                else:
                    raise errors.InvalidArgument("header: sent twice; only the first message may be a header",
                                                 field="header")

        with metrics.PUBLISH_SECONDS.time():
            result = await self.store.publishing.publish(header, chunks(), caller=current_caller())
        if not result.deduplicated:
            metrics.PUBLISH_BYTES.labels(metrics.tenant_of(header.adapter)).inc(header.size_bytes)
        return registry_pb2.PublishVersionResponse(version=version_pb(result.version),
                                                   deduplicated=result.deduplicated)

    async def GetVersion(self, request, context):
        name, version, alias = _ref_fields(request.ref)
        record = await self.store.get_version(name, version, alias, caller=current_caller())
        return registry_pb2.GetVersionResponse(version=version_pb(record))

    async def ListVersions(self, request, context):
        records, token = await self.store.list_versions(request.adapter, request.kind, request.page_size,
                                                        request.page_token, caller=current_caller())
        return registry_pb2.ListVersionsResponse(versions=[version_pb(r) for r in records], next_page_token=token)

    async def DeleteVersion(self, request, context):
        await self.store.delete_version(request.adapter, request.version, caller=current_caller())
        return registry_pb2.DeleteVersionResponse()

    async def SetAlias(self, request, context):
        record = await self.store.set_alias(request.adapter, request.alias, request.version,
                                           caller=current_caller())
        return registry_pb2.SetAliasResponse(adapter=adapter_pb(record))

    async def DownloadVersion(self, request, context):
        name, version, alias = _ref_fields(request.ref)
        direct = (await self.store.direct_download(name, version, alias, caller=current_caller())
                  if request.direct else None)
        if direct is not None:
            record, url = direct
            metrics.DOWNLOAD_BYTES.labels(metrics.tenant_of(record.adapter)).inc(record.size_bytes)
            yield registry_pb2.DownloadVersionResponse(
                header=registry_pb2.DownloadVersionHeader(version=version_pb(record), direct_url=url))
            return
        record, chunks = await self.store.download(name, version, alias, request.offset, request.chunk_size,
                                                    caller=current_caller())
        yield registry_pb2.DownloadVersionResponse(
            header=registry_pb2.DownloadVersionHeader(version=version_pb(record), offset=request.offset))
        downloaded = metrics.DOWNLOAD_BYTES.labels(metrics.tenant_of(record.adapter))
        async for data in chunks:
            downloaded.inc(len(data))
            yield registry_pb2.DownloadVersionResponse(chunk=data)

    async def WatchEvents(self, request, context):
        async for record in self.store.events.watch(request.after_cursor, request.adapter, request.prefix,
                                             request.start_at_end, caller=current_caller()):
            metrics.EVENT_LAG_SECONDS.observe(max(0.0, time.time() - record.time_ms / 1000))
            yield registry_pb2.WatchEventsResponse(event=event_pb(record))

    async def CollectGarbage(self, request, context):
        report = await self.store.collect_garbage(request.dry_run, caller=current_caller())
        return registry_pb2.CollectGarbageResponse(deleted_blobs=report.deleted_blobs, freed_bytes=report.freed_bytes)


def add_to_server(servicer: RegistryServicer, server: grpc.aio.Server) -> None:
    registry_pb2_grpc.add_AdapterRegistryServiceServicer_to_server(servicer, server)
