"""OpenTelemetry traces follow one request across services (real servers, real grpc instrumentation, an in-memory
exporter instead of an OTLP collector): the client's PublishWeights, the trainer serving it, the trainer's
PublishVersion call and the registry serving that share one trace, each span the child of the one before."""

from __future__ import annotations

import pytest

from loraplane import tracing
from loraplane.rpc import ClientSecurity, aio_channel
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.fixtures.registry import start_live_registry
from tests.fixtures.trainer import start_live_trainer

pytest.importorskip("opentelemetry.sdk")


def test_one_trace_from_client_through_trainer_into_registry(isolated_settings, background_loop):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.uninstrument()
    assert tracing.instrument("loraplane-test", exporter, batch=False)
    registry = trainer = None
    try:
        registry = start_live_registry(isolated_settings, background_loop)
        trainer = start_live_trainer(isolated_settings, background_loop, registry.address)
        stub = trainer.stub()
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="traced/a", lora_config=common_pb2.LoraConfig(rank=2, alpha=4.0)))
        exporter.clear()

        async def publish_as_the_sdk_does():
            # The SDK's channels: grpc.aio, made after the instrumentation (`loraplane.rpc.aio_channel`).
            async with aio_channel(trainer.address, ClientSecurity()) as channel:
                await trainer_pb2_grpc.TrainerServiceStub(channel).PublishWeights(
                    trainer_pb2.PublishWeightsRequest(adapter="traced/a", seq_id=1))

        background_loop.run(publish_as_the_sdk_does(), timeout=60)
        spans = exporter.get_finished_spans()
        by_kind = {}
        for span in spans:
            by_kind.setdefault((span.name, span.kind.name), span)
        client = by_kind[("/loraplane.v1.TrainerService/PublishWeights", "CLIENT")]
        served = by_kind[("/loraplane.v1.TrainerService/PublishWeights", "SERVER")]
        outgoing = by_kind[("/loraplane.v1.AdapterRegistryService/PublishVersion", "CLIENT")]
        stored = by_kind[("/loraplane.v1.AdapterRegistryService/PublishVersion", "SERVER")]
        assert len({s.context.trace_id for s in (client, served, outgoing, stored)}) == 1
        assert served.parent.span_id == client.context.span_id
        assert stored.parent.span_id == outgoing.context.span_id
    finally:
        if trainer is not None:
            trainer.close()
        if registry is not None:
            registry.close()
        tracing.uninstrument()
