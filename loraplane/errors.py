"""Domain errors. Domain code raises these; `loraplane.rpc` maps them to gRPC status codes in one place."""

from __future__ import annotations


class LoraplaneError(Exception):
    """Base class. `reason` is a stable UPPER_SNAKE machine-readable code (AIP-193 ErrorInfo.reason)."""

    reason = "LORAPLANE_ERROR"

    def __init__(self, message: str, *, reason: str | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if reason:
            self.reason = reason


class InvalidArgument(LoraplaneError):
    """The caller sent something malformed or out of bounds. The message names the field and the limit."""

    reason = "INVALID_ARGUMENT"


class NotFound(LoraplaneError):
    reason = "NOT_FOUND"


class AlreadyExists(LoraplaneError):
    reason = "ALREADY_EXISTS"


class FailedPrecondition(LoraplaneError):
    """The request is well-formed but the system is not in a state to run it (e.g. deleting an aliased version)."""

    reason = "FAILED_PRECONDITION"


class ResourceExhausted(LoraplaneError):
    reason = "RESOURCE_EXHAUSTED"


class Unavailable(LoraplaneError):
    """A dependency (Redis, S3, registry, engine) cannot be reached; retrying later may succeed."""

    reason = "UNAVAILABLE"


class DataLoss(LoraplaneError):
    """Stored or transferred bytes failed an integrity check."""

    reason = "DATA_LOSS"


class DeadlineExceeded(LoraplaneError):
    reason = "DEADLINE_EXCEEDED"


class Aborted(LoraplaneError):
    """A concurrency conflict; the caller may retry."""

    reason = "ABORTED"


class Cancelled(LoraplaneError):
    reason = "CANCELLED"
