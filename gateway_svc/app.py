"""The gateway's ASGI app: Tinker wire API under /api/v1, OpenAI / Anthropic-compatible sampling under /v1.

FastAPI (Starlette) on uvicorn: an established ASGI stack whose async handlers suit futures long-polling (a held
retrieve_future costs a coroutine, not a thread) and streaming (server-sent events), with pydantic request models
for the OpenAI / Anthropic bodies."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway_svc import http_errors, openai_routes, tinker_routes
from gateway_svc.config import GatewaySettings
from gateway_svc.openai_service import OpenAIService
from gateway_svc.store import Store
from gateway_svc.tinker_service import TinkerService
from gateway_svc.upstream import Upstream
from loraplane.rpc import quiet_grpc_poller


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        quiet_grpc_poller(asyncio.get_running_loop())
        store = Store(settings.redis_url, settings.key_prefix, future_ttl_s=settings.future_ttl_s)
        upstream = Upstream(settings.trainer_address, settings.registry_address, settings.sampler_address,
                            timeout=settings.upstream_timeout_s, retry_s=settings.upstream_retry_s)
        app.state.tinker = TinkerService(settings, store, upstream)
        app.state.openai = OpenAIService(settings, upstream)
        try:
            yield
        finally:
            await app.state.tinker.futures.close()
            await upstream.close()
            await store.close()

    app = FastAPI(title="loraplane gateway", lifespan=lifespan)
    app.state.settings = settings
    http_errors.install(app)
    app.include_router(tinker_routes.router)
    app.include_router(openai_routes.router)
    return app
