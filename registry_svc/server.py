"""Hosting the registry: `start_registry_server` for tests, the CLI and benchmarks; `main` for
`python -m registry_svc` (settings from LORAPLANE_* variables)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass

from loraplane import errors
from loraplane.auth import authenticator_from_settings
from loraplane.config import Settings
from loraplane.rpc import GrpcServer, ServerSecurity, wait_for_shutdown_signal
from loraplane.tracing import setup_tracing
from loraplane.v1 import registry_pb2
from registry_svc.servicer import RegistryServicer, add_to_server
from registry_svc.store import RegistryLimits, RegistryStore

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["AdapterRegistryService"].full_name


@dataclass
class RunningRegistry:
    server: GrpcServer
    store: RegistryStore
    settings: Settings

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace: float = 2.0) -> None:
        self.store.begin_shutdown()
        await self.store.wait_for_watches_to_end(timeout=grace)
        try:
            await self.server.stop(grace)
        finally:
            await self.store.close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_registry_server(settings: Settings, host: str = "127.0.0.1", port: int = 0,
                                limits: RegistryLimits | None = None) -> RunningRegistry:
    """Connects to Redis and S3 (creating the bucket if absent) and serves the registry on host:port."""
    setup_tracing(settings, "registry")
    store = RegistryStore(settings, limits)
    try:
        await store.start()
        server = GrpcServer(host, port, authenticator=authenticator_from_settings(settings, "registry"),
                            security=ServerSecurity.from_settings(settings), metrics_port=settings.metrics_port)
        add_to_server(RegistryServicer(store), server.server)
        server.add_service(SERVICE_NAME)
        await server.start()
    except BaseException:
        await store.close()
        raise
    return RunningRegistry(server, store, settings)


async def _serve(settings: Settings, host: str, port: int) -> None:
    running = await start_registry_server(settings, host, port)
    print(f"registry listening on {running.address}", flush=True)
    if running.server.metrics is not None:
        print(f"registry metrics on {running.server.metrics.url}", flush=True)
    await wait_for_shutdown_signal()
    await running.stop()


def main() -> None:
    settings = Settings()
    parser = argparse.ArgumentParser(prog="python -m registry_svc", description="Serve the adapter registry.")
    parser.add_argument("--host", default=settings.host)
    parser.add_argument("--port", type=int, default=settings.registry_port)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(settings, args.host, args.port))
    except errors.LoraplaneError as exc:
        # Missing configuration or an unreachable Redis/S3 at startup: say so plainly, no traceback.
        print(f"registry: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
