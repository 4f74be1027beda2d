"""Domain errors. Domain code raises these; `loraplane.rpc` maps them to gRPC status codes in one place."""

from __future__ import annotations

# Caller-supplied values echoed in an error (names, keys, aliases) are cut to this many characters: a status travels
# in gRPC trailers, whose default size limit (8-16 KB) a long echoed name would exceed, turning the caller's
# INVALID_ARGUMENT into a transport error.
MAX_ECHO_CHARS = 128
# The whole message and each ErrorInfo metadata value are capped too, whatever composed them.
MAX_MESSAGE_CHARS = 1024
# Unavailable.reason of a download whose version a trainer reserved and has not finished uploading: wait and retry.
VERSION_PENDING = "VERSION_PENDING"


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` cut to at most about `limit` bytes. Text of up to `limit` bytes is returned as it is; anything longer
    is escaped to ASCII first (gRPC percent-encodes every other byte of a status message, tripling it), then
    cut with an ellipsis and the original length."""
    if len(text.encode()) <= limit:
        return text
    escaped = text.encode("ascii", "backslashreplace").decode("ascii")
    if len(escaped) <= limit:
        return escaped
    return f"{escaped[:limit]}...({len(text)} chars)"


def shown(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """repr(value) for an error message, clipped: what to write instead of {value!r}."""
    return clip(repr(value), limit)


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


class Unauthenticated(LoraplaneError):
    """No API key, or one the cluster does not know (never issued, or revoked)."""

    reason = "UNAUTHENTICATED"


class PermissionDenied(LoraplaneError):
    """A known key reaching outside what its role and tenant allow. The message names only the caller's own scope,
    never the resource's owner or whether it exists."""

    reason = "PERMISSION_DENIED"
