"""Exceptions of the client SDK. Each carries the gRPC status code, the server's message, the RPC that failed and,
when the server sent one, the AIP-193 ErrorInfo reason and field.

Every class also derives from the matching `loraplane.errors` domain class, so `except loraplane.errors.NotFound`
and `except loraplane.client.NotFoundError` both work.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from loraplane import errors

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class APIError(errors.LoraplaneError):
    """A call to a loraplane service failed. `code` is the gRPC status code (grpc.StatusCode)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, method: str = "", address: str = "",
                 reason: str | None = None, field: str | None = None, attempts: int = 1):
        self.code = code or type(self).code
        self.method = method
        self.address = address
        self.attempts = attempts
        where = f"{method} on {address}" if address else method
        text = f"{self.code.name}: {message}"
        if where:
            text = f"{where} failed with {text}"
        if attempts > 1:
            text += f" (after {attempts} attempts)"
        super().__init__(text, reason=reason, field=field)
        # The server's own words, without our prefix.
        self.server_message = message

    @property
    def retryable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)


class InvalidArgumentError(APIError, errors.InvalidArgument):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(APIError, errors.NotFound):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(APIError, errors.AlreadyExists):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(APIError, errors.FailedPrecondition):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(APIError, errors.ResourceExhausted):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(APIError, errors.Unavailable):
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(APIError, errors.DataLoss):
    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceededError(APIError, errors.DeadlineExceeded):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(APIError, errors.Aborted):
    code = grpc.StatusCode.ABORTED


class CancelledError(APIError, errors.Cancelled):
    code = grpc.StatusCode.CANCELLED


class InternalError(APIError):
    code = grpc.StatusCode.INTERNAL


_ERROR_OF_CODE: dict[grpc.StatusCode, type[APIError]] = {
    cls.code: cls for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, FailedPreconditionError,
                              ResourceExhaustedError, UnavailableError, DataLossError, DeadlineExceededError,
                              AbortedError, CancelledError, InternalError)
}


def _error_info(exc: grpc.RpcError) -> tuple[str | None, str | None]:
    """(reason, field) from the google.rpc.Status details the server attached, if any."""
    try:
        trailing = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - some RpcErrors carry no call
        return None, None
    for key, value in trailing:
        if key != _STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info.reason or None, info.metadata.get("field") or None
    return None, None


def error_from_rpc(exc: grpc.RpcError, *, method: str = "", address: str = "", attempts: int = 1) -> APIError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else "") or str(code.name)
    reason, field = _error_info(exc)
    cls = _ERROR_OF_CODE.get(code, APIError)
    return cls(message, code=code, method=method, address=address, reason=reason, field=field, attempts=attempts)


def error_from_domain(exc: errors.LoraplaneError, *, method: str = "", address: str = "") -> APIError:
    """Wraps a domain error (as raised by loraplane.registry_client) in the SDK's matching class."""
    if isinstance(exc, APIError):
        return exc
    from loraplane.rpc import status_code_of

    code = status_code_of(exc)
    cls = _ERROR_OF_CODE.get(code, APIError)
    return cls(exc.message, code=code, method=method, address=address, reason=exc.reason, field=exc.field)
