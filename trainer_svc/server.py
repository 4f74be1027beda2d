"""Builds and runs the trainer: backend + service + gRPC server (health, reflection)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, fields
from pathlib import Path

from loraplane import errors
from loraplane.auth import authenticator_from_settings
from loraplane.config import Settings
from loraplane.membership import Membership
from loraplane.metrics import register_source, unregister_source
from loraplane.registry_client import RegistryClient
from loraplane.rpc import ClientSecurity, GrpcServer, ServerSecurity
from loraplane.tracing import setup_tracing
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc
from trainer_svc.backends import build_backend
from trainer_svc.backends.base import TrainerBackend
from trainer_svc.fleet import FleetMember
from trainer_svc.fleet_store import FleetStore
from trainer_svc.handoff import Handoff
from trainer_svc.journal import TrainingJournal
from trainer_svc.service import TrainerLimits, TrainerService
from trainer_svc.servicer import TrainerServicer
from trainer_svc.upload_spool import UploadSpool

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
    fleet: FleetMember | None = None
    servicer: TrainerServicer | None = None

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace: float = 1.0) -> None:
        unregister_source(self.metrics_source)
        try:
            if self.fleet is not None:
                await self.fleet.stop()
            await self.server.stop(grace)
        finally:
            if self.servicer is not None:
                await self.servicer._close()
            if self.service.handoff is not None:
                await self.service.handoff.close()
            await self.service.close()
            self.service.backend.close()
            await self.registry.close()


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
    """Loads the base model (in a thread: it takes a while for real models) and serves TrainerService. `backend`:
    a built backend, or the name of one in the backend registry (trainer_svc/backends), built in this process.
    Every backend runs behind the same TrainerService (a backend that owns its adapter tensors says so through
    the backend interface); `service_class` remains for tests that wrap the service.
    With a journal (the default whenever `settings.redis_url` is set) the trainer first recovers every adapter it
    had before a crash, and only then starts serving. With `settings.trainer_fleet` it is one member of that fleet
    (trainer_svc/fleet.py): it recovers the adapters still placed on it and takes part in placement and failover."""
    if not registry_address:
        raise errors.InvalidArgument("registry_address is required", field="registry_address")
    setup_tracing(settings, "trainer")
    limits.setdefault("checkpoint_every_steps", settings.checkpoint_every_steps)
    limits.setdefault("checkpoint_every_s", settings.checkpoint_every_s)
    trainer_limits = limits_from(**limits)
    backend_impl = backend if isinstance(backend, TrainerBackend) else await asyncio.to_thread(
        build_backend, backend, base_model, device, device_slots=trainer_limits.device_slots,
        max_fused_adapters=trainer_limits.max_fused_adapters)
    # The trainer reaches the registry with the service key (settings.api_key), acting for the tenant it serves.
    registry = RegistryClient(registry_address, timeout=trainer_limits.registry_timeout_s,
                              security=ClientSecurity.from_settings(settings))
    use_journal = settings.trainer_journal and bool(settings.redis_url) if journal is None else journal
    fleet_name = settings.trainer_fleet
    if fleet_name and not (use_journal and settings.redis_url):
        await registry.close()
        raise errors.FailedPrecondition("a trainer fleet needs the training journal: set LORAPLANE_REDIS_URL and "
                                        "leave LORAPLANE_TRAINER_JOURNAL on", field="trainer_fleet")
    training_journal = None
    if use_journal:
        # A fleet's members share one journal (any of them can take over any adapter); a lone trainer has its own.
        training_journal = TrainingJournal(settings.redis_url, key_prefix=settings.key_prefix,
                                           trainer_id=fleet_name or settings.trainer_id)
    else:
        log.warning("NO TRAINING JOURNAL: set LORAPLANE_REDIS_URL to make training durable; a crash of this trainer "
                    "loses every adapter's state since its last SaveState")
    service = service_class(backend_impl, registry, trainer_limits, journal=training_journal)
    if settings.sampler_fleet and settings.redis_url:
        # Published versions also go straight to the replicas of this deployment's sampler fleet that load them
        # first (trainer_svc/handoff.py); the registry stays the record.
        service.handoff = Handoff(Membership(settings.redis_url, key_prefix=settings.key_prefix,
                                             fleet=settings.sampler_fleet),
                                  ClientSecurity.from_settings(settings), preload=settings.sampler_fleet_preload)
        service.ack_before_upload = settings.publish_ack == "pushed"
    # Versions a previous run acknowledged before their upload ended are uploaded from here (after recovery).
    service.spool = UploadSpool(Path(settings.data_dir) / "trainer-uploads" / settings.trainer_id, registry)
    server = GrpcServer(host, port, authenticator=authenticator_from_settings(settings, "trainer"),
                        security=ServerSecurity.from_settings(settings), metrics_port=settings.metrics_port)
    servicer = TrainerServicer(service, trainer_id=settings.trainer_id,
                               peer_security=ClientSecurity.from_settings(settings))
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server.server)
    server.add_service(SERVICE_NAME)
    member = None
    try:
        names = None
        if fleet_name:
            member = FleetMember(service, FleetStore(settings.redis_url, key_prefix=settings.key_prefix,
                                                     fleet=fleet_name),
                                 settings.trainer_id, ttl_s=settings.trainer_heartbeat_ttl_s)
            training_journal.fence = member
            service.fleet = member
            # Alive (without an address yet) before it takes its adapters back, so nobody else takes them meanwhile.
            await asyncio.to_thread(member.store.heartbeat, member.report(), member.ttl_s)
            names = await member.claim_own()
            member.start("")
        failed = await service.recover(names=names)
        if failed:
            log.error("serving without %d unrecoverable adapters: %s", len(failed), failed)
        resumed = await service.spool.recover()
        if resumed:
            log.info("uploading %d versions acknowledged before a restart: %s", len(resumed), resumed)
        await server.start()
    except BaseException:
        if member is not None:
            await member.stop()
        if service.handoff is not None:
            await service.handoff.close()
        await service.close()
        await registry.close()
        raise
    servicer.address = settings.trainer_advertise_address or server.address
    if member is not None:
        member.address = servicer.address
        await asyncio.to_thread(member.store.heartbeat, member.report(), member.ttl_s)
    running = RunningTrainer(server=server, service=service, registry=registry, settings=settings,
                             registry_address=registry_address, fleet=member, servicer=servicer)
    fleet_metrics = {} if member is None else {
        "loraplane_trainer_fleet_adapters": ("Adapters placed on this fleet member and served by it",
                                             lambda: len(member.owned())),
        "loraplane_trainer_fleet_draining": ("1 while this fleet member hands its adapters over",
                                             lambda: int(member.draining)),
    }
    handoff = service.handoff
    handoff_metrics = {} if handoff is None else {
        "loraplane_trainer_handoff_pushes": ("Versions pushed to a sampler by this trainer (a counter)",
                                             lambda: handoff.pushes["shared_memory"] + handoff.pushes["stream"]),
        "loraplane_trainer_handoff_push_failures": ("Pushes to a sampler that failed (a counter)",
                                                    lambda: handoff.pushes["failed"]),
    }
    spool = service.spool
    running.metrics_source = register_source("trainer", server.address, {
        **fleet_metrics,
        **handoff_metrics,
        # Read from the metrics thread while the worker changes them: a failed read is skipped (metrics.py).
        "loraplane_trainer_uploads_pending": ("Versions acknowledged whose upload to the registry has not landed",
                                              lambda: spool.pending),
        "loraplane_trainer_queue_depth": ("Sequenced requests queued or running", lambda: service.scheduler._queued),
        "loraplane_trainer_adapters": ("Adapters on this trainer", lambda: len(service.pool)),
        "loraplane_trainer_resident_adapters": ("Adapters resident on the device",
                                                lambda: len(service.pool._resident)),
        "loraplane_trainer_pool_misses": ("Activations that had to bring a spilled adapter back (a counter)",
                                          lambda: service.pool.misses),
    })
    return running
