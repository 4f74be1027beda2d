"""Shared parts of the fuzz suites (tests/contract/test_fuzz_*.py): hypothesis strategies of malformed values and
the one assertion every malformed request must satisfy."""

from __future__ import annotations

import math
import os
import re

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Sized for the default test command: each suite adds well under a minute on 2 cores. Live servers are shared by
# all examples of a test (function-scoped fixtures, on purpose: the point is that state survives the barrage).
# CI draws the same examples every run (a red CI means a regression, not a lucky draw); set
# LORAPLANE_FUZZ_EXPLORE=1 to draw new ones (and more: LORAPLANE_FUZZ_EXAMPLES) when hunting for bugs.
FUZZ_SETTINGS = settings(
    max_examples=int(os.environ.get("LORAPLANE_FUZZ_EXAMPLES", "200")), deadline=None,
    derandomize=os.environ.get("LORAPLANE_FUZZ_EXPLORE", "") != "1", print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)

# Codes a caller error may get. Never INTERNAL or UNKNOWN, and never a transport error such as RESOURCE_EXHAUSTED
# for oversized trailers.
CALLER_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                           grpc.StatusCode.OUT_OF_RANGE})

_NAME = re.compile(r"^([a-z0-9][a-z0-9._-]{0,62}/)?[a-z0-9][a-z0-9._-]{0,62}\Z")
_ALIAS = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}\Z")

HOSTILE_STRINGS = [
    "", " ", "../x", "a/../b", "/etc/passwd", "..", "a/b/c", "A", "a\n", "a\x00b", "a b", "é", "\U0001f600",
    "a" * 64, "a" * 10_000, "é" * 5000, "\u202eevil", "a;rm -rf /", "%s%n", "a\\b", "<script>",
]


def error_info(exc: grpc.RpcError) -> tuple[str, str]:
    """(reason, field) from the status' ErrorInfo, or ("", "")."""
    status = rpc_status.from_call(exc)
    for detail in status.details if status else []:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason, info.metadata.get("field", "")
    return "", ""


def assert_clear_rejection(exc: BaseException, field: str, codes=frozenset({grpc.StatusCode.INVALID_ARGUMENT}),
                           what: str = "") -> None:
    """A malformed request got a caller-error status whose ErrorInfo names `field` (or an element of it, e.g.
    aliases[3] for aliases) and whose message names it too, in a message small enough for any client."""
    assert isinstance(exc, grpc.RpcError), f"{what}: expected an RPC error, got {exc!r}"
    code, details = exc.code(), exc.details() or ""
    assert code in CALLER_ERRORS, f"{what}: {code} {details[:300]}"
    assert code in codes, f"{what}: {code} (expected {sorted(c.name for c in codes)}) {details[:300]}"
    _, named = error_info(exc)
    assert named.startswith(field), f"{what}: ErrorInfo names {named[:200]!r}, expected {field!r}: {details[:300]}"
    head = field.split("[")[0].split(".")[0]
    assert head in details, f"{what}: message does not name {head!r}: {details[:300]}"
    assert len(details.encode()) <= 2048 and len(named) <= 256, f"{what}: {len(details)}-char message"


def bad_names() -> st.SearchStrategy[str]:
    """Strings that are not valid adapter names."""
    return st.one_of(st.sampled_from(HOSTILE_STRINGS), st.text(max_size=80)).filter(
        lambda s: not _NAME.match(s))


def bad_aliases() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(HOSTILE_STRINGS), st.text(max_size=80)).filter(lambda s: not _ALIAS.match(s))


def hostile_text(min_size: int = 0) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([s for s in HOSTILE_STRINGS if len(s) >= min_size]),
                     st.text(min_size=min_size, max_size=80))


NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def finite_or_not(bad: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    return st.one_of(NON_FINITE, bad)


def oversized_metadata() -> st.SearchStrategy[dict[str, str]]:
    """Metadata over the registry's limits: too many entries, an empty or overlong key, an overlong value."""
    return st.one_of(
        st.just({f"k{i}": "v" for i in range(65)}),
        st.just({"": "v"}),
        st.text(min_size=129, max_size=300).map(lambda k: {k: "v"}),
        st.integers(4097, 20_000).map(lambda n: {"k": "v" * n}),
    )


def registry_view(stub) -> dict:
    """What a registry caller observes of every adapter and version: cheap enough to take around every example
    (the full `registry_state`, which also lists S3, is compared once per test, around all of them)."""
    from loraplane.v1 import registry_pb2

    adapters = stub.ListAdapters(registry_pb2.ListAdaptersRequest(page_size=1000)).adapters
    return {a.name: (a.SerializeToString(deterministic=True), [v.SerializeToString(deterministic=True) for v in
                     stub.ListVersions(registry_pb2.ListVersionsRequest(adapter=a.name, page_size=1000)).versions])
            for a in adapters}
