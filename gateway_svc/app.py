"""The gateway's ASGI app: Tinker wire API under /api/v1, OpenAI / Anthropic-compatible sampling under /v1 (and the
OpenAI routes again under Tinker's /oai/api/v1).

FastAPI (Starlette) on uvicorn: an established ASGI stack whose async handlers suit futures long-polling (a held
retrieve_future costs a coroutine, not a thread) and streaming (server-sent events), with pydantic request models
for the OpenAI / Anthropic bodies."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from gateway_svc import http_errors, openai_routes, tinker_routes
from gateway_svc.config import GatewaySettings
from gateway_svc.openai_service import OpenAIService
from gateway_svc.store import Store
from gateway_svc.tinker_service import TinkerService
from gateway_svc.upstream import Upstream
from loraplane import auth, errors
from loraplane.config import Settings
from loraplane.membership import Membership
from loraplane.metrics import RPC_SECONDS, MetricsEndpoint
from loraplane.rpc import ClientSecurity, quiet_grpc_poller

# Answered without a key: load balancers and `loraplane status` probe it.
OPEN_PATHS = frozenset({"/api/v1/healthz"})
# Signed download URLs (tinker checkpoint download fetches them with plain urllib): the token is the credential.
SIGNED_PREFIX = "/api/v1/external_weights/"


def caller_key(request: Request) -> str:
    """The caller's loraplane API key: `X-API-Key` (the Tinker SDK; Anthropic clients) or `Authorization: Bearer`
    (OpenAI clients). The Tinker SDK insists on a `tml-` prefix, so `tml-lpk_...` is read as `lpk_...`."""
    key = request.headers.get("x-api-key") or ""
    if not key:
        bearer = request.headers.get("authorization") or ""
        key = bearer[7:].strip() if bearer.lower().startswith("bearer ") else ""
    if key.startswith("tml-") and key[4:].startswith(auth.KEY_PREFIX):
        key = key[4:]
    return key


async def authenticate(request: Request) -> None:
    """Every request acts as its caller: the identity is set for the request's task, so every gRPC call made for
    it carries the gateway's service key acting for the caller's tenant, and the services hold it to that
    tenant's namespace and quotas (the one place they are enforced)."""
    if request.url.path in OPEN_PATHS or request.url.path.startswith(SIGNED_PREFIX):
        return
    caller = await request.app.state.authenticator.authenticate(caller_key(request) or None)
    default_tenant = request.app.state.settings.default_tenant
    if caller.role == auth.ROLE_TENANT and caller.tenant == default_tenant:
        # Admin and service keys and the open mode keep their Tinker runs and adapters in the default tenant's
        # namespace: a tenant key of that name would act inside it (`loraplane keys create` refuses the name; a
        # key made otherwise stops here).
        raise errors.PermissionDenied(
            f"tenant {default_tenant!r} is this gateway's operator namespace (LORAPLANE_GATEWAY_DEFAULT_TENANT); "
            "issue the key under another tenant name", reason="RESERVED_TENANT", field="api_key")
    auth.set_caller(caller)


class RouteSeconds:
    """Times each HTTP request into loraplane_rpc_seconds{service="gateway", method=<route template>} (the
    template, not the path: paths carry ids). Plain ASGI, so streamed answers pass through untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            RPC_SECONDS.labels("gateway", route).observe(time.perf_counter() - start)


def create_app(settings: GatewaySettings | None = None, cluster: Settings | None = None) -> FastAPI:
    """`cluster`: the loraplane settings the gateway shares with the services (LORAPLANE_AUTH, the service key in
    LORAPLANE_API_KEY, TLS, the Redis holding the keys); by default read from the environment."""
    settings = settings or GatewaySettings()
    cluster = cluster or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        quiet_grpc_poller(asyncio.get_running_loop())
        store = Store(settings.redis_url, settings.key_prefix, future_ttl_s=settings.future_ttl_s,
                      default_tenant=settings.default_tenant)
        upstream = Upstream(settings.trainer_address, settings.registry_address, settings.sampler_address,
                            timeout=settings.upstream_timeout_s, retry_s=settings.upstream_retry_s,
                            security=ClientSecurity.from_settings(cluster),
                            trainer_fleet=Membership(cluster.redis_url, key_prefix=cluster.key_prefix,
                                                     fleet=cluster.trainer_fleet)
                            if cluster.trainer_fleet and cluster.redis_url else None)
        app.state.tinker = TinkerService(settings, store, upstream)
        app.state.openai = OpenAIService(settings, upstream, tinker_paths=app.state.tinker.sampler_weights)
        endpoint = MetricsEndpoint(settings.host, settings.metrics_port) if settings.metrics_port >= 0 else None
        try:
            yield
        finally:
            if endpoint is not None:
                endpoint.close()
            await app.state.tinker.futures.close()
            await upstream.close()
            await store.close()

    app = FastAPI(title="loraplane gateway", lifespan=lifespan, dependencies=[Depends(authenticate)])
    app.state.settings = settings
    app.state.authenticator = auth.authenticator_from_settings(cluster, "gateway")
    http_errors.install(app)
    app.add_middleware(RouteSeconds)
    app.include_router(tinker_routes.router)
    # One set of OpenAI handlers, two mounts: loraplane's /v1 and Tinker's OpenAI-compatible /oai/api/v1.
    app.include_router(openai_routes.router, prefix="/v1")
    app.include_router(openai_routes.router, prefix=http_errors.OAI_PREFIX + "/v1")
    app.include_router(openai_routes.anthropic_router, prefix="/v1")
    return app
