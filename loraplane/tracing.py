"""OpenTelemetry traces, off unless an OTLP endpoint is configured (LORAPLANE_OTLP_ENDPOINT, e.g.
`http://otel-collector:4317`). The grpc instrumentation then traces every server and client call of the process,
and propagates the context in gRPC metadata, so one trace follows a request from the client through the trainer
into the registry (and the sampler's downloads from the registry). Needs the `tracing` extra."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)
_lock = threading.Lock()
_provider = None


def setup_tracing(settings, service: str) -> bool:
    """Instruments grpc (servers and clients) for `service` when `settings.otlp_endpoint` is set; idempotent.
    Must run before the process creates its gRPC servers and channels."""
    endpoint = getattr(settings, "otlp_endpoint", "")
    if not endpoint:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("LORAPLANE_OTLP_ENDPOINT is set but the tracing extra is not installed "
                    "(pip install 'loraplane[tracing]'): no traces")
        return False
    return instrument(f"loraplane-{service}", OTLPSpanExporter(endpoint=endpoint,
                                                              insecure=endpoint.startswith("http://")))


def instrument(service_name: str, exporter, *, batch: bool = True) -> bool:
    """Sends spans of every grpc call of this process to `exporter` (once per process; later calls keep the first
    exporter)."""
    global _provider
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    with _lock:
        if _provider is not None:
            return True
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        GrpcAioInstrumentorServer().instrument(tracer_provider=provider)
        GrpcAioInstrumentorClient().instrument(tracer_provider=provider)
        GrpcInstrumentorClient().instrument(tracer_provider=provider)
        _provider = provider
        log.info("tracing gRPC calls of %s", service_name)
        return True


def uninstrument() -> None:
    """Undoes `instrument` (tests)."""
    global _provider
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
    )

    with _lock:
        if _provider is None:
            return
        for instrumentor in (GrpcAioInstrumentorServer(), GrpcAioInstrumentorClient(), GrpcInstrumentorClient()):
            instrumentor.uninstrument()
        _provider.shutdown()
        _provider = None
