"""Builds and runs the sampler: engine + adapter manager + gRPC server (health, reflection)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass

from loraplane import errors
from loraplane.auth import authenticator_from_settings
from loraplane.config import Settings
from loraplane.membership import Membership
from loraplane.metrics import register_source, unregister_source
from loraplane.registry_client import RegistryClient
from loraplane.rpc import ClientSecurity, GrpcServer, ServerSecurity
from loraplane.tracing import setup_tracing
from loraplane.v1 import sampler_pb2, sampler_pb2_grpc
from sampler_svc import engines
from sampler_svc.adapter_manager import AdapterManager
from sampler_svc.engines.base import Engine
from sampler_svc.fleet import SamplerFleetMember
from sampler_svc.service import SamplerService
from sampler_svc.servicer import SamplerServicer

log = logging.getLogger(__name__)
SERVICE_NAME = sampler_pb2.DESCRIPTOR.services_by_name["SamplerService"].full_name
DEFAULT_MAX_LOADED = 64


@dataclass
class RunningSampler:
    server: GrpcServer
    engine: Engine
    manager: AdapterManager
    service: SamplerService
    registry: RegistryClient
    settings: Settings
    registry_address: str
    metrics_source: int | None = None
    fleet: SamplerFleetMember | None = None

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self) -> None:
        unregister_source(self.metrics_source)
        if self.fleet is not None:  # out of the replica list first, so clients' next refresh leaves it out
            await self.fleet.stop()
        await self.server.stop(grace=1.0)
        await self.manager.stop()
        await self.engine.stop()
        await self.registry.close()


def run_event_loop(main: Coroutine) -> None:
    """Runs the sampler's `main` to completion on uvloop when it is installed (LORAPLANE_UVLOOP=0: asyncio's own
    loop). Every stream the sampler serves passes through this one loop (an HTTP read from the engine, a gRPC write
    to the client, per chunk), so its per-callback cost bounds how many tokens per second it can forward."""
    if os.environ.get("LORAPLANE_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def build_engine(engine: str, base_model: str, settings: Settings, *, sglang_urls: Sequence[str] = (),
                 sglang_launch: int = 0, max_batch_rows: int = 16, sglang_options: dict | None = None) -> Engine:
    """The engine registered as `engine` (sampler_svc/engines/__init__.py, ENGINES)."""
    return engines.build_engine(engine, engines.EngineConfig(
        base_model, device=settings.device, data_dir=settings.data_dir, max_batch_rows=max_batch_rows,
        server_urls=tuple(sglang_urls), launch_servers=sglang_launch, options=dict(sglang_options or {})))


async def start_sampler_server(
    settings: Settings,
    *,
    registry_address: str,
    base_model: str = "tiny",
    engine: str | Engine = "torch",
    instance_id: str | None = None,
    fleet: str | None = None,
    keep_versions: int = 2,
    max_loaded: int = DEFAULT_MAX_LOADED,
    host: str = "127.0.0.1",
    port: int = 0,
    watch_prefix: str = "",
    sglang_urls: Sequence[str] = (),
    sglang_launch: int = 0,
    max_batch_rows: int = 16,
    sglang_options: dict | None = None,
) -> RunningSampler:
    """Starts the engine, the adapter manager (which restores its persisted state and follows the registry) and
    the gRPC server. `sglang_options` are extra SGLangEngine keyword arguments (max_lora_rank, ...). `instance_id`
    (default settings.sampler_id) names the replica and its persisted state; with `fleet` (default
    settings.sampler_fleet) it heartbeats into that sampler fleet (sampler_svc/fleet.py)."""
    instance_id = instance_id or settings.sampler_id
    fleet_name = settings.sampler_fleet if fleet is None else fleet
    if fleet_name and not settings.redis_url:
        raise errors.FailedPrecondition("a sampler fleet needs Redis for its membership: set LORAPLANE_REDIS_URL",
                                        field="sampler_fleet")
    engine_impl = engine if isinstance(engine, Engine) else build_engine(
        engine, base_model, settings, sglang_urls=sglang_urls, sglang_launch=sglang_launch,
        max_batch_rows=max_batch_rows, sglang_options=sglang_options)
    await engine_impl.start()
    setup_tracing(settings, "sampler")
    # The sampler watches and downloads with the service key (settings.api_key).
    registry = RegistryClient(registry_address, security=ClientSecurity.from_settings(settings))
    manager = AdapterManager(engine_impl, registry, redis_url=settings.redis_url, key_prefix=settings.key_prefix,
                             instance_id=instance_id, keep_versions=keep_versions, max_loaded=max_loaded,
                             watch_prefix=watch_prefix)
    service = SamplerService(engine_impl, manager, max_num_samples=max_batch_rows)
    server = GrpcServer(host, port, authenticator=authenticator_from_settings(settings, "sampler"),
                        security=ServerSecurity.from_settings(settings), metrics_port=settings.metrics_port)
    sampler_pb2_grpc.add_SamplerServiceServicer_to_server(SamplerServicer(service), server.server)
    server.add_service(SERVICE_NAME)
    service.replica_id = instance_id
    member = None
    try:
        await manager.start()
        await server.start()
        service.address = settings.sampler_advertise_address or server.address
        if fleet_name:
            member = SamplerFleetMember(service, Membership(settings.redis_url, key_prefix=settings.key_prefix,
                                                            fleet=fleet_name),
                                        instance_id, ttl_s=settings.sampler_heartbeat_ttl_s,
                                        preload=settings.sampler_fleet_preload)
            service.fleet = member
            manager.preloads = member.preloads
            member.address = service.address
            try:
                await member.tick()  # listed before the first client asks
            except errors.Unavailable as exc:  # Redis away: serve anyway; the heartbeat loop keeps trying
                log.warning("sampler %s could not join fleet %s yet: %s", instance_id, fleet_name, exc.message)
            member.start(service.address)
    except BaseException:
        if member is not None:
            await member.stop()
            with contextlib.suppress(Exception):
                await server.stop(grace=0)
        await manager.stop()
        await engine_impl.stop()
        await registry.close()
        raise
    running = RunningSampler(server=server, engine=engine_impl, manager=manager, service=service,
                             registry=registry, settings=settings, registry_address=registry_address, fleet=member)
    running.metrics_source = register_source("sampler", server.address, {
        "loraplane_sampler_loaded_versions": ("Adapter versions loaded in the engine",
                                              lambda: len(manager.list_loaded())),
        "loraplane_sampler_loads": ("Adapter versions loaded since start (a counter)", lambda: manager.loads),
        "loraplane_sampler_events_applied": ("Registry events applied since start", lambda: manager.events_applied),
        "loraplane_sampler_staged_bytes": ("Bytes pushed by trainers and staged, not yet committed and loaded",
                                           lambda: manager.staging.held_bytes),
        "loraplane_sampler_staged_dropped": ("Pushed blobs dropped unused (a counter)",
                                             lambda: manager.staging.dropped),
        "loraplane_sampler_engine_queue_depth": ("Requests waiting in the engine", lambda: engine_impl.queue_depth),
        "loraplane_sampler_running_requests": ("Requests the engine is running", lambda: engine_impl.running_requests),
    })
    return running
