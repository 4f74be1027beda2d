"""Tinker wire API handlers (`/api/v1/...`): each converts the HTTP request to TinkerService arguments and its
answer to the HTTP reply; errors go to http_errors."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from gateway_svc import tinker_bodies as shape
from gateway_svc.http_errors import Unsupported
from gateway_svc.tinker_service import TinkerService
from loraplane import errors


def _svc(request: Request) -> TinkerService:
    return request.app.state.tinker


async def _body(request: Request, model: type[shape._Body] | None = None) -> dict[str, Any]:
    """The JSON object the request carries, checked against its route's shape (tinker_bodies)."""
    raw = await request.body()
    body: Any = {}
    if raw:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise errors.InvalidArgument("body: not valid JSON", field="body") from None
    if not isinstance(body, dict):
        raise errors.InvalidArgument("body: must be a JSON object", field="body")
    return shape.checked(model, body) if model is not None else body


router = APIRouter(prefix="/api/v1")
# Page sizes above the served maximum (1000) are clipped, not refused; beyond this they are nonsense.
_PAGE_MAX = shape.INT32_MAX


@router.post("/client/config")
async def client_config(request: Request):
    # Plain httpx keeps header names as sent; the SDK's defaults suit us otherwise.
    settings = request.app.state.settings
    return {"use_pyqwest_transport": False, "pjwt_auth_enabled": False,
            "fwdbwd_max_chunk_len": settings.fwdbwd_max_chunk_len, "proto_compress_fwdbwd": settings.compress_fwdbwd}


@router.post("/client/dynamic_config")
async def dynamic_config(request: Request):
    return {}


@router.get("/healthz")
async def healthz(request: Request):
    await _svc(request).store.ping()
    return {"status": "ok"}


@router.post("/telemetry")
async def telemetry(request: Request):
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(request: Request):
    return await _svc(request).create_session(await _body(request, shape.CreateSession))


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request):
    return await _svc(request).heartbeat((await _body(request, shape.SessionRef)).get("session_id", ""))


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request):
    return await _svc(request).finish_session(session_id, (await _body(request, shape.FinishSession)).get("reason"))


@router.get("/sessions")
async def list_sessions(request: Request, limit: int = Query(20, ge=0, le=_PAGE_MAX),
                        offset: int = Query(0, ge=0, le=shape.INT32_MAX)):
    return await _svc(request).list_sessions(min(limit, 1000), offset)


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request):
    return await _svc(request).get_session(session_id)


@router.get("/get_server_capabilities")
async def capabilities(request: Request):
    return await _svc(request).capabilities()


@router.post("/create_model")
async def create_model(request: Request):
    return await _svc(request).create_model(await _body(request, shape.CreateModel))


@router.post("/get_info")
async def get_info(request: Request):
    return await _svc(request).get_info(await _body(request, shape.ModelRef))


@router.post("/forward_backward")
async def forward_backward(request: Request):
    content_type = request.headers.get("content-type", "")
    if "protobuf" not in content_type:
        raise Unsupported("forward_backward takes a protobuf body (Content-Type: application/x-protobuf), as the "
                          "tinker SDK sends it")
    return await _svc(request).forward_backward(await request.body(), request.headers.get("content-encoding", ""))


@router.post("/forward")
async def forward(request: Request):
    raise Unsupported("/forward is not served: the SDK sends forward passes to /forward_backward (forward_only)")


@router.post("/optim_step")
async def optim_step(request: Request):
    return await _svc(request).optim_step(await _body(request, shape.Sequenced))


@router.post("/save_weights")
async def save_weights(request: Request):
    return await _svc(request).save_weights(await _body(request, shape.Sequenced))


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request):
    return await _svc(request).save_weights_for_sampler(await _body(request, shape.Sequenced))


@router.post("/load_weights")
async def load_weights(request: Request):
    return await _svc(request).load_weights(await _body(request, shape.LoadWeights))


@router.post("/unload_model")
async def unload_model(request: Request):
    return await _svc(request).unload_model(await _body(request, shape.ModelRef))


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    return await _svc(request).create_sampling_session(await _body(request, shape.CreateSamplingSession))


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    return await _svc(request).get_sampler(sampler_id)


@router.post("/asample")
async def asample(request: Request):
    return await _svc(request).asample(await _body(request, shape.Sample))


@router.post("/retrieve_future")
async def retrieve_future(request: Request):
    body = await _body(request, shape.RequestRef)
    request_id = body.get("request_id", "")
    reply = await _svc(request).futures.retrieve(request_id)
    if reply is None:
        raise errors.NotFound(f"request_id {errors.shown(request_id)} not found", field="request_id")
    if reply.state == "pending":
        return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    return Response(content=reply.body, media_type=reply.content_type)


@router.get("/training_runs")
async def training_runs(request: Request, limit: int = Query(20, ge=0, le=_PAGE_MAX),
                        offset: int = Query(0, ge=0, le=shape.INT32_MAX)):
    return await _svc(request).training_runs(min(limit, 1000), offset)


@router.get("/training_runs/{model_id}")
async def training_run(model_id: str, request: Request):
    return await _svc(request).training_run(model_id)


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, request: Request):
    return await _svc(request).checkpoints(model_id)


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(model_id: str, kind: str, name: str, request: Request):
    await _svc(request).delete_checkpoint(model_id, f"{kind}/{name}")
    return JSONResponse({})


@router.put("/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
async def set_checkpoint_ttl(model_id: str, kind: str, name: str, request: Request):
    await _svc(request).set_checkpoint_ttl(model_id, f"{kind}/{name}", (await _body(request, shape.CheckpointTtl)).get("ttl_seconds"))
    return JSONResponse({})


@router.get("/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(model_id: str, kind: str, name: str, request: Request):
    return await _svc(request).external_weights_urls(model_id, f"{kind}/{name}", str(request.base_url))


@router.post("/save_weights_external")
async def save_weights_external(request: Request):
    return await _svc(request).save_weights_external(await _body(request, shape.Sequenced))


@router.get("/external_weights/{token}/{name}")
async def external_file(token: str, name: str, request: Request):
    # Served without an API key (the CLI downloads with plain urllib): the signed token is the credential.
    return Response(content=await _svc(request).external_file(token, name), media_type="application/octet-stream")


@router.get("/checkpoints")
async def user_checkpoints(request: Request, limit: int = Query(100, ge=0, le=_PAGE_MAX),
                           offset: int = Query(0, ge=0, le=shape.INT32_MAX)):
    return await _svc(request).user_checkpoints(min(limit, 1000), offset)


@router.post("/weights_info")
async def weights_info(request: Request):
    return await _svc(request).weights_info((await _body(request, shape.WeightsInfo)).get("tinker_path", ""))


_UNSUPPORTED = {
    "/cancel_future": "cancel_future", "/retrieve_futures": "batched futures (retrieve_futures)",
    "/join_sampling_session": "join_sampling_session", "/create_custom_loss": "server-side custom losses",
    "/auth/token": "JWT auth",
    "/copy_weights": "copy_weights",
}


def _refuse(what: str):
    async def handler(request: Request):
        raise Unsupported(f"{what} is not supported by the loraplane gateway")
    return handler


for _path, _what in _UNSUPPORTED.items():
    router.add_api_route(_path, _refuse(_what), methods=["POST"])
