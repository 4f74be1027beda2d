"""gRPC plumbing shared by the three services: the one place where domain errors become status codes, and the
server builder that adds health checking, reflection and message-size limits."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from loraplane import auth, errors

log = logging.getLogger(__name__)

ERROR_DOMAIN = "loraplane.dev"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

_STATUS_OF: list[tuple[type[errors.LoraplaneError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DataLoss, grpc.StatusCode.DATA_LOSS),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Aborted, grpc.StatusCode.ABORTED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
]


def status_code_of(exc: BaseException) -> grpc.StatusCode:
    for exc_type, code in _STATUS_OF:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def to_rpc_status(exc: errors.LoraplaneError) -> grpc.Status:
    code = status_code_of(exc)
    info = error_details_pb2.ErrorInfo(reason=errors.clip(exc.reason), domain=ERROR_DOMAIN)
    if exc.field:
        info.metadata["field"] = errors.clip(exc.field)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=getattr(code_pb2, code.name),
                               message=errors.clip(exc.message, errors.MAX_MESSAGE_CHARS), details=[detail])
    return rpc_status.to_status(status)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, errors.LoraplaneError):
        await context.abort_with_status(to_rpc_status(exc))
    log.exception("unhandled error in RPC", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def _passthrough(exc: BaseException) -> bool:
    # abort() raises grpc's own AbortError; it must propagate untouched, as must cancellation.
    return isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit))


def map_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a servicer method (unary or server-streaming, async) so domain errors become statuses."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except BaseException as exc:
                if _passthrough(exc):
                    raise
                await _abort(context, exc)
        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except BaseException as exc:
            if _passthrough(exc):
                raise
            await _abort(context, exc)
    return unary_wrapper


def map_servicer_errors(cls: type) -> type:
    """Class decorator: applies `map_errors` to every public coroutine / async generator method."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_"):
            continue
        if inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member):
            setattr(cls, name, map_errors(member))
    return cls


class GrpcServer:
    """An asyncio gRPC server with health checking and reflection for the given services; with an authenticator,
    every call but health checks and reflection is authenticated (`AuthInterceptor`); with `security`, TLS."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, options: Iterable[tuple[str, Any]] = (), *,
                 authenticator: auth.Authenticator | None = None, security: ServerSecurity | None = None,
                 metrics_port: int = -1):
        """metrics_port: serve Prometheus metrics over HTTP there (0 = a free port, -1 = not at all)."""
        self.authenticator = authenticator
        self.metrics_port = metrics_port
        self.metrics: Any = None
        # Metrics outermost: denied calls are counted too, with their status code.
        interceptors: list = [MetricsInterceptor()]
        if authenticator is not None and not authenticator.open:
            interceptors.append(AuthInterceptor(authenticator))
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            *options,
        ])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        if security is not None and security.enabled:
            self.port = self.server.add_secure_port(f"{host}:{port}", security.credentials())
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
        self.host = host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add_service(self, full_name: str) -> None:
        self._service_names.append(full_name)

    async def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self.server)
        await self.server.start()
        if self.metrics_port >= 0 and self.metrics is None:
            from loraplane.metrics import MetricsEndpoint

            self.metrics = MetricsEndpoint(self.host, self.metrics_port)
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names]:
            result = self.health.set(name, status)
            if inspect.isawaitable(result):
                await result

    async def stop(self, grace: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.authenticator is not None:
            await self.authenticator.close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def wait_for_shutdown_signal() -> None:
    """Returns on SIGINT or SIGTERM: what a service's `python -m` entry point waits on before stopping cleanly."""
    received = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, received.set)
    await received.wait()


def check_health(address: str, service: str = "", timeout: float = 2.0,
                 security: ClientSecurity | None = None) -> bool:
    """Synchronous health probe: True when the server answers SERVING (health checks need no key)."""
    try:
        with sync_channel(address, security, options=()) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def quiet_grpc_poller(loop: asyncio.AbstractEventLoop) -> None:
    """Drops one known-harmless error. With grpc.aio loops on several threads of one process (a client beside
    in-process servers: the demo, tests), every loop watches grpc's shared completion-queue fd; when it fires, one
    loop reads it and the others get EAGAIN, which asyncio would log as a BlockingIOError traceback each time."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if isinstance(context.get("exception"), BlockingIOError) and "PollerCompletionQueue" in repr(
                context.get("handle", "")):
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class BackgroundLoop:
    """An asyncio loop on a daemon thread. Hosts async gRPC servers for synchronous callers (tests, benchmarks,
    the CLI's embedded servers), so blocking stubs never run on the loop that serves them."""

    def __init__(self, name: str = "loraplane-loop"):
        import threading

        self.loop = asyncio.new_event_loop()
        quiet_grpc_poller(self.loop)
        # Several services can share this loop (tests, the demo), and they park blocking waits (thread joins,
        # model loads, file I/O) on its default executor, which is only cpu_count + 4 threads on a small machine:
        # one service's slow wait must not hold up another's stop or start.
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix=name))
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def domain_error_from_rpc(exc: grpc.RpcError, what: str = "") -> errors.LoraplaneError:
    """The inverse mapping, for a service that calls another: keeps the status code and message of the callee
    (a registry NOT_FOUND stays NOT_FOUND for the trainer's caller); transport failures become Unavailable."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    message = f"{what}: {details}" if what else (details or code.name)
    # The callee's ErrorInfo names the field at fault and the reason; the caller's caller needs them too.
    field, reason = _error_info(exc)
    for exc_type, mapped in _STATUS_OF:
        if mapped == code:
            return exc_type(message, field=field, reason=reason)
    return errors.Unavailable(message)


def _error_info(exc: grpc.RpcError) -> tuple[str | None, str | None]:
    """(field, reason) of the status's ErrorInfo, None for what it does not carry."""
    try:
        status = rpc_status.from_call(exc)
    except (AttributeError, ValueError):
        return None, None
    for detail in status.details if status else []:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.metadata.get("field") or None, info.reason or None
    return None, None


# ---------------------------------------------------------------------------------------------------- auth + TLS

# Open to every caller: load balancers and `loraplane status` probe health without a key; reflection describes only
# the public contract.
UNAUTHENTICATED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


@dataclass(frozen=True)
class ServerSecurity:
    """A server's TLS: certificate chain and key (PEM), and optionally the CA whose client certificates it demands
    (mTLS)."""

    cert: bytes | None = None
    key: bytes | None = None
    client_ca: bytes | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @classmethod
    def from_settings(cls, settings) -> ServerSecurity:
        if bool(settings.tls_cert) != bool(settings.tls_key):
            raise errors.InvalidArgument("tls_cert and tls_key: set both or neither (LORAPLANE_TLS_CERT/KEY)",
                                         field="tls_cert")
        if settings.tls_client_ca and not settings.tls_cert:
            raise errors.InvalidArgument("tls_client_ca: mTLS needs the server's own tls_cert and tls_key",
                                         field="tls_client_ca")
        return cls(_read(settings.tls_cert), _read(settings.tls_key), _read(settings.tls_client_ca))

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientSecurity:
    """What a client sends: its API key (as `authorization: Bearer ...`) and, with TLS, the CA it trusts and its
    own certificate for mTLS."""

    api_key: str = ""
    tls: bool = False
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""

    @classmethod
    def from_settings(cls, settings=None) -> ClientSecurity:
        if settings is None:
            from loraplane.config import Settings

            settings = Settings()
        return cls(api_key=settings.api_key,
                   tls=bool(settings.tls or settings.tls_ca or settings.tls_client_cert),
                   ca=_read(settings.tls_ca), cert=_read(settings.tls_client_cert), key=_read(settings.tls_client_key),
                   server_name=settings.tls_server_name)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    def metadata(self) -> list[tuple[str, str]]:
        pairs = [("authorization", f"Bearer {self.api_key}")] if self.api_key else []
        acting_for = auth.acting_for_value()
        if acting_for and self.api_key:
            pairs.append((auth.ACTING_FOR_HEADER, acting_for))
        return pairs


def aio_channel(address: str, security: ClientSecurity | None = None,
                options: Iterable[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to a loraplane service: TLS and API key from `security` (default: LORAPLANE_* settings)."""
    security = ClientSecurity.from_settings() if security is None else security
    opts = [*(channel_options() if options is None else options), *security.options()]
    interceptors = _aio_key_interceptors(security) if security.api_key else None
    if security.tls:
        return grpc.aio.secure_channel(address, security.channel_credentials(), options=opts,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)


def sync_channel(address: str, security: ClientSecurity | None = None,
                 options: Iterable[tuple[str, Any]] | None = None) -> grpc.Channel:
    """The blocking counterpart of `aio_channel` (CLI, tests)."""
    security = ClientSecurity.from_settings() if security is None else security
    opts = [*(channel_options() if options is None else options), *security.options()]
    if security.tls:
        channel = grpc.secure_channel(address, security.channel_credentials(), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    return grpc.intercept_channel(channel, _SyncKeyInterceptor(security)) if security.api_key else channel


def _with_metadata(details, security: ClientSecurity, aio: bool):
    extra = security.metadata()
    pairs = [*(details.metadata or ()), *extra]
    return details._replace(metadata=grpc.aio.Metadata(*pairs) if aio else pairs)


def _aio_key_interceptors(security: ClientSecurity) -> list:
    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(_with_metadata(details, security, True), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(_with_metadata(details, security, True), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, request_iterator):
            return await continuation(_with_metadata(details, security, True), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            return await continuation(_with_metadata(details, security, True), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


class _SyncDetails(__import__("collections").namedtuple(
        "_SyncDetails", ["method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"]),
        grpc.ClientCallDetails):
    pass


class _SyncKeyInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                          grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, security: ClientSecurity):
        self.security = security

    def _details(self, details):
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), *self.security.metadata()],
                            details.credentials, details.wait_for_ready, getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """The one place a service authenticates: resolves the `authorization` metadata to an `auth.Identity` and runs
    the handler with it as the current caller (servicers pass `auth.current_caller()` to the domain), or answers
    UNAUTHENTICATED without running it."""

    def __init__(self, authenticator: auth.Authenticator):
        self.authenticator = authenticator

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(UNAUTHENTICATED_SERVICES):
            return handler
        metadata = {key: value for key, value in (details.invocation_metadata or ())}
        try:
            identity = await self.authenticator.authenticate(metadata.get("authorization"),
                                                             metadata.get(auth.ACTING_FOR_HEADER))
        except errors.LoraplaneError as exc:
            denial = exc
        else:
            return _replace_behavior(handler, lambda inner: self._as_caller(inner, identity, details.method))
        await self.authenticator.audit_denial(None, details.method, "UNAUTHENTICATED", denial.message)
        return _replace_behavior(handler, lambda inner: _deny(denial, streaming_response=handler.response_streaming))

    def _as_caller(self, inner, identity: auth.Identity, method: str):
        """Runs the handler as `identity`; a PERMISSION_DENIED it answers goes to the audit stream."""

        async def audit_if_denied(context) -> None:
            code = None
            with contextlib.suppress(Exception):
                code = context.code()
            if code == grpc.StatusCode.PERMISSION_DENIED:
                details = ""
                with contextlib.suppress(Exception):
                    details = context.details() or ""
                await self.authenticator.audit_denial(identity, method, code.name,
                                                      details.decode() if isinstance(details, bytes) else details,
                                                      target=auth.denied_target())

        if inspect.isasyncgenfunction(inner):
            async def stream(request, context):
                auth.set_caller(identity)
                try:
                    async for item in inner(request, context):
                        yield item
                except grpc.aio.AbortError:
                    await audit_if_denied(context)
                    raise
            return stream

        async def unary(request, context):
            # Each RPC runs in its own task: the caller stays set for exactly this call (and tasks it starts).
            auth.set_caller(identity)
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                await audit_if_denied(context)
                raise
        return unary


def _replace_behavior(handler, wrap):
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        inner = getattr(handler, kind)
        if inner is not None:
            return handler._replace(**{kind: wrap(inner)})
    return handler


def _deny(exc: errors.LoraplaneError, streaming_response: bool):
    if streaming_response:
        async def stream(request, context):
            await context.abort_with_status(to_rpc_status(exc))
            yield  # pragma: no cover - unreachable; makes this an async generator
        return stream

    async def unary(request, context):
        await context.abort_with_status(to_rpc_status(exc))
    return unary


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC (but health checks and reflection) by service, method and status code, and times it."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(UNAUTHENTICATED_SERVICES):
            return handler
        from loraplane.metrics import RPC_SECONDS, RPCS

        _, service, method = details.method.split("/", 2)
        service = service.rsplit(".", 1)[-1]
        timer = RPC_SECONDS.labels(service, method)

        def record(context, started: float, failed: BaseException | None) -> None:
            timer.observe(time.perf_counter() - started)
            code = None
            with contextlib.suppress(Exception):
                code = context.code()
            if code is None or code == grpc.StatusCode.OK and failed is not None:
                code = grpc.StatusCode.CANCELLED if isinstance(failed, asyncio.CancelledError) else (
                    grpc.StatusCode.UNKNOWN if failed is not None else grpc.StatusCode.OK)
            RPCS.labels(service, method, getattr(code, "name", str(code))).inc()

        def wrap(inner):
            if inspect.isasyncgenfunction(inner):
                async def stream(request, context):
                    started, failed = time.perf_counter(), None
                    try:
                        async for item in inner(request, context):
                            yield item
                    except BaseException as exc:
                        failed = exc
                        raise
                    finally:
                        record(context, started, failed)
                return stream

            async def unary(request, context):
                started, failed = time.perf_counter(), None
                try:
                    return await inner(request, context)
                except BaseException as exc:
                    failed = exc
                    raise
                finally:
                    record(context, started, failed)
            return unary

        return _replace_behavior(handler, wrap)
