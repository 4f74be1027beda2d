"""The gateway's one error-mapping place: loraplane domain errors (raised by the gateway's own checks and by
upstream.py for every gRPC status) become the HTTP status and JSON body each API's official client expects.

- Tinker: `{"error": message, "category": "user"|"server"|"unknown"}` (RequestFailedResponse); a failed future is
  HTTP 200 with that body, a refused submission a 4xx with it (never an empty 4xx body: the SDK would take it
  for a dropped connection and retry 16 times).
- OpenAI: `{"error": {"message", "type", "param", "code"}}`.
- Anthropic: `{"type": "error", "error": {"type", "message"}}`.
Caller errors are never a 500."""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplane import errors

log = logging.getLogger(__name__)

# (domain error, HTTP status, Tinker category, OpenAI type, Anthropic type). AlreadyExists is a 400, not a 409:
# the Tinker SDK retries 409s, and a conflicting duplicate stays a conflict however often it is retried.
_TABLE: list[tuple[type[errors.LoraplaneError], int, str, str, str]] = [
    (errors.InvalidArgument, 400, "user", "invalid_request_error", "invalid_request_error"),
    (errors.NotFound, 404, "user", "not_found_error", "not_found_error"),
    (errors.Unauthenticated, 401, "user", "authentication_error", "authentication_error"),
    (errors.PermissionDenied, 403, "user", "permission_error", "permission_error"),
    (errors.AlreadyExists, 400, "user", "invalid_request_error", "invalid_request_error"),
    (errors.FailedPrecondition, 400, "user", "invalid_request_error", "invalid_request_error"),
    (errors.ResourceExhausted, 429, "server", "rate_limit_error", "rate_limit_error"),
    (errors.Unavailable, 503, "server", "server_error", "overloaded_error"),
    (errors.DeadlineExceeded, 504, "server", "server_error", "api_error"),
    (errors.Aborted, 409, "server", "server_error", "api_error"),
    (errors.Cancelled, 499, "server", "server_error", "api_error"),
    (errors.DataLoss, 500, "server", "server_error", "api_error"),
]


class Unsupported(errors.InvalidArgument):
    """A Tinker endpoint or option loraplane does not implement: a user error naming what is missing."""


# A network address in a message (grpc's transport errors name their peer: `ipv4:10.1.2.3:50053`, `[::1]:50051`,
# `localhost:8333`; a bracketed IPv6 address has a colon, so a field path like `data[0]` stays). Upstream replaces the services' configured addresses by name; this catches whatever else
# slips through, so no answer to a tenant carries an address of the cluster's.
_ADDRESS = re.compile(r"(?:\b(?:ipv4|ipv6|dns|unix|unix-abstract):/{0,3})?"
                      r"(?:\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d{1,5})?|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?|\blocalhost:\d{1,5})")


def scrub(message: str) -> str:
    return _ADDRESS.sub("<internal>", message)


def classify(exc: BaseException) -> tuple[int, str, str, str, str]:
    """(HTTP status, Tinker category, OpenAI type, Anthropic type, message); the message never carries a network
    address."""
    for exc_type, status, category, openai_type, anthropic_type in _TABLE:
        if isinstance(exc, exc_type):
            return status, category, openai_type, anthropic_type, scrub(exc.message)
    if isinstance(exc, errors.LoraplaneError):
        return 500, "server", "server_error", "api_error", scrub(exc.message)
    log.exception("unexpected gateway error", exc_info=exc)
    return 500, "unknown", "server_error", "api_error", f"internal error: {type(exc).__name__}"


def future_failure(exc: BaseException) -> dict:
    """A failed future's RequestFailedResponse."""
    _status, category, _o, _a, message = classify(exc)
    return {"error": message, "category": category}


# Tinker's OpenAI-compatible surface: the same OpenAI routes, mounted under this prefix too.
OAI_PREFIX = "/oai/api"


def _api_of(path: str) -> str:
    if path.startswith(OAI_PREFIX + "/"):
        path = path[len(OAI_PREFIX):]
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    return "tinker"


def error_response(path: str, exc: BaseException) -> JSONResponse:
    status, category, openai_type, anthropic_type, message = classify(exc)
    api = _api_of(path)
    field = getattr(exc, "field", None)
    code = type(exc).__name__
    if api == "openai":
        body = {"error": {"message": message, "type": openai_type, "param": field, "code": code}}
    elif api == "anthropic":
        body = {"type": "error", "error": {"type": anthropic_type, "message": message}}
    else:
        body = {"error": message, "category": category, "code": code}
        if field:
            body["field"] = field
    # The Tinker SDK retries 5xx/429 on its own; x-should-retry tells it not to retry a caller error.
    headers = {"x-should-retry": "true" if status >= 500 or status == 429 else "false"}
    return JSONResponse(body, status_code=status, headers=headers)


def install(app) -> None:
    @app.exception_handler(errors.LoraplaneError)
    async def _domain(request: Request, exc: errors.LoraplaneError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return error_response(request.url.path, errors.InvalidArgument(
            f"{where}: {first.get('msg', 'invalid request')}", field=where))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(request.url.path, errors.NotFound(
                f"{request.method} {errors.clip(request.url.path, 200)}: no such route on the loraplane gateway "
                "(see docs/gateway.md for what is served)", field="path"))
        if exc.status_code == 405:
            return error_response(request.url.path, errors.InvalidArgument(
                f"{request.method} is not allowed on {request.url.path}"))
        return error_response(request.url.path, errors.LoraplaneError(str(exc.detail)))

    app.add_middleware(AnswerEveryError)


class AnswerEveryError:
    """Whatever escapes a handler unexpectedly is answered here, as the API's own error body (logged, never a
    traceback to the caller), and the connection stays usable. Starlette's own last-resort handler re-raises after
    answering, and the server then closes the kept-alive connection under the client's next request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)
        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:  # the one last-resort answer
            if started:
                raise  # a stream already under way: nothing can be answered any more
            await error_response(scope.get("path", ""), exc)(scope, receive, send)
