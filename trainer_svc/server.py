"""Builds and runs the trainer: backend + service + gRPC server (health, reflection)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, fields

from loraplane import errors
from loraplane.auth import authenticator_from_settings
from loraplane.config import Settings
from loraplane.metrics import register_source, unregister_source
from loraplane.registry_client import RegistryClient
from loraplane.rpc import ClientSecurity, GrpcServer, ServerSecurity
from loraplane.tracing import setup_tracing
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc
from trainer_svc.backends.base import TrainerBackend
from trainer_svc.journal import TrainingJournal
from trainer_svc.service import TrainerLimits, TrainerService
from trainer_svc.servicer import TrainerServicer

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
log = logging.getLogger(__name__)


@dataclass
class RunningTrainer:
    server: GrpcServer
    service: TrainerService
    registry: RegistryClient
    settings: Settings
    registry_address: str
    metrics_source: int | None = None

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace: float = 1.0) -> None:
        unregister_source(self.metrics_source)
        try:
            await self.server.stop(grace)
        finally:
            await self.service.close()
            self.service.backend.close()
            await self.registry.close()


def build_backend(backend: str, base_model: str, device: str) -> TrainerBackend:
    if backend == "torch":
        from trainer_svc.backends.torch_backend import TorchBackend

        return TorchBackend(base_model, device=device)
    raise errors.InvalidArgument(f"unknown trainer backend {backend!r}: use 'torch'", field="backend")


def limits_from(**overrides) -> TrainerLimits:
    known = {f.name for f in fields(TrainerLimits)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise errors.InvalidArgument(f"unknown trainer limits {unknown}; known: {sorted(known)}", field="limits")
    return TrainerLimits(**overrides)


async def start_trainer_server(
    settings: Settings,
    *,
    base_model: str = "tiny",
    registry_address: str,
    host: str = "127.0.0.1",
    port: int = 0,
    device: str = "cpu",
    backend: str | TrainerBackend = "torch",
    service_class: type[TrainerService] = TrainerService,
    journal: bool | None = None,
    **limits,
) -> RunningTrainer:
    """Loads the base model (in a thread: it takes a while for real models) and serves TrainerService.
    `service_class` lets a backend that owns its adapter tensors (megatron) bring its TrainerService subclass.
    With a journal (the default whenever `settings.redis_url` is set) the trainer first recovers every adapter it
    had before a crash, and only then starts serving."""
    if not registry_address:
        raise errors.InvalidArgument("registry_address is required", field="registry_address")
    setup_tracing(settings, "trainer")
    limits.setdefault("checkpoint_every_steps", settings.checkpoint_every_steps)
    limits.setdefault("checkpoint_every_s", settings.checkpoint_every_s)
    trainer_limits = limits_from(**limits)
    backend_impl = backend if isinstance(backend, TrainerBackend) else await asyncio.to_thread(
        build_backend, backend, base_model, device)
    # The trainer reaches the registry with the service key (settings.api_key), acting for the tenant it serves.
    registry = RegistryClient(registry_address, timeout=trainer_limits.registry_timeout_s,
                              security=ClientSecurity.from_settings(settings))
    use_journal = settings.trainer_journal and bool(settings.redis_url) if journal is None else journal
    training_journal = None
    if use_journal:
        training_journal = TrainingJournal(settings.redis_url, key_prefix=settings.key_prefix,
                                           trainer_id=settings.trainer_id)
    else:
        log.warning("NO TRAINING JOURNAL: set LORAPLANE_REDIS_URL to make training durable; a crash of this trainer "
                    "loses every adapter's state since its last SaveState")
    service = service_class(backend_impl, registry, trainer_limits, journal=training_journal)
    server = GrpcServer(host, port, authenticator=authenticator_from_settings(settings, "trainer"),
                        security=ServerSecurity.from_settings(settings), metrics_port=settings.metrics_port)
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(service), server.server)
    server.add_service(SERVICE_NAME)
    try:
        failed = await service.recover()
        if failed:
            log.error("serving without %d unrecoverable adapters: %s", len(failed), failed)
        await server.start()
    except BaseException:
        await service.close()
        await registry.close()
        raise
    running = RunningTrainer(server=server, service=service, registry=registry, settings=settings,
                             registry_address=registry_address)
    running.metrics_source = register_source("trainer", server.address, {
        # Read from the metrics thread while the worker changes them: a failed read is skipped (metrics.py).
        "loraplane_trainer_queue_depth": ("Sequenced requests queued or running", lambda: service.scheduler._queued),
        "loraplane_trainer_adapters": ("Adapters on this trainer", lambda: len(service.pool)),
        "loraplane_trainer_resident_adapters": ("Adapters resident on the device",
                                                lambda: len(service.pool._resident)),
        "loraplane_trainer_pool_misses": ("Activations that had to bring a spilled adapter back (a counter)",
                                          lambda: service.pool.misses),
    })
    return running
