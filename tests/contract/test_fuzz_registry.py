"""Fuzz: malformed requests for every AdapterRegistryService RPC and field, thrown at a live registry (real Valkey
+ SeaweedFS). Each must get a clear caller-error status naming the field and change nothing a caller can observe;
the S3 bucket and Redis-backed state are compared once more around the whole barrage."""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.v1 import common_pb2, registry_pb2
from tests.contract.fuzzing import (
    FUZZ_SETTINGS,
    assert_clear_rejection,
    bad_aliases,
    bad_names,
    finite_or_not,
    hostile_text,
    oversized_metadata,
    registry_view,
)
from tests.fixtures.registry import (
    TEST_BASE_MODEL,
    TEST_LORA,
    adapter_blob,
    publish_requests,
    registry_state,
    sha256_hex,
)

INVALID = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
NOT_FOUND = frozenset({grpc.StatusCode.NOT_FOUND})
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STATE = common_pb2.VERSION_KIND_TRAINING_STATE


@pytest.fixture
def subject(registry):
    """A registry holding one adapter with a weights version (aliased) and a training state."""
    stub = registry.stub()
    stub.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name="fz", lora_config=TEST_LORA, base_model=TEST_BASE_MODEL)))
    stub.PublishVersion(publish_requests("fz", adapter_blob(2000, seed=1), aliases=["prod"]))
    stub.PublishVersion(publish_requests("fz", adapter_blob(2000, seed=2, training_state=True), kind=STATE))
    before = registry_state(stub, registry.settings)
    yield stub
    assert registry_state(stub, registry.settings) == before
    # Still fully usable after the barrage.
    reply = stub.PublishVersion(publish_requests("fz", adapter_blob(2000, seed=3)))
    assert reply.version.version == 3


@st.composite
def bad_create(draw):
    field = draw(st.sampled_from(["name", "rank", "alpha", "target_modules", "base_model", "metadata"]))
    adapter = registry_pb2.Adapter(name="fresh", lora_config=TEST_LORA, base_model=TEST_BASE_MODEL)
    if field == "name":
        adapter.name = draw(bad_names())
        return adapter, "adapter.name"
    if field == "rank":
        adapter.lora_config.rank = draw(st.one_of(st.just(0), st.integers(65537, 2**32 - 1)))
        return adapter, "adapter.lora_config.rank"
    if field == "alpha":
        adapter.lora_config.alpha = draw(finite_or_not(st.floats(max_value=-0.5, allow_nan=False,
                                                                 allow_infinity=False, width=32)))
        return adapter, "adapter.lora_config.alpha"
    if field == "target_modules":
        bad = draw(st.one_of(hostile_text().filter(lambda s: s not in PROJECTIONS), st.just("q_proj")))
        adapter.lora_config.target_modules[:] = ["q_proj", bad]
        return adapter, "adapter.lora_config.target_modules"
    if field == "base_model":
        adapter.base_model = draw(st.one_of(
            st.sampled_from(["", "../x", "a/../../b", "my model", "tiny\n", "-rf", "é", "m" * 513]),
            st.text(min_size=1, max_size=40).filter(lambda s: any(not (c.isascii() and c.isprintable()) or c == " "
                                                                  for c in s))))
        return adapter, "adapter.base_model"
    adapter.metadata.update(draw(oversized_metadata()))
    return adapter, "adapter.metadata"


def _header(**changes) -> registry_pb2.PublishVersionRequest:
    blob = adapter_blob(2000, seed=9)
    fields = {"adapter": "fz", "sha256": sha256_hex(blob), "size_bytes": len(blob), **changes}
    return registry_pb2.PublishVersionRequest(header=registry_pb2.PublishVersionHeader(**fields))


@st.composite
def bad_publish(draw):
    """(request stream, field, codes)"""
    field = draw(st.sampled_from(["adapter", "unknown_adapter", "sha256", "size_bytes", "kind", "aliases",
                                  "metadata", "idempotency_key", "no_header", "content", "content_as_state"]))
    if field == "adapter":
        return [_header(adapter=draw(bad_names()))], "header.adapter", INVALID
    if field == "unknown_adapter":
        return [_header(adapter="nobody")], "header.adapter", NOT_FOUND
    if field == "sha256":
        bad = draw(st.one_of(hostile_text(), st.text("0123456789abcdefABCDEF", min_size=63, max_size=65)).filter(
            # Empty is not malformed: it means the digest comes in the stream's trailer.
            lambda s: s and not (len(s) == 64 and all(c in "0123456789abcdef" for c in s))))
        return [_header(sha256=bad)], "header.sha256", INVALID
    if field == "size_bytes":
        return [_header(size_bytes=draw(st.one_of(st.just(0), st.integers(4 * 1024**3 + 1, 2**64 - 1))))], \
            "header.size_bytes", INVALID
    if field == "kind":
        return [_header(kind=draw(st.integers(3, 2**31 - 1)))], "header.kind", INVALID
    if field == "aliases":
        return [_header(aliases=["ok", draw(bad_aliases())])], "header.aliases", INVALID
    if field == "metadata":
        return [_header(metadata=draw(oversized_metadata()))], "header.metadata", INVALID
    if field == "idempotency_key":
        return [_header(idempotency_key="k" * draw(st.integers(257, 5000)))], "header.idempotency_key", INVALID
    if field == "no_header":
        return [registry_pb2.PublishVersionRequest(chunk=draw(st.binary(max_size=64)))], "header", INVALID
    # Bytes whose length and digest are right but that are not what the kind says.
    if field == "content":
        blob = draw(st.one_of(st.binary(min_size=1, max_size=3000), st.just(os.urandom(4096)),
                              st.just(adapter_blob(2000, seed=4, training_state=True)),
                              st.just(adapter_blob(2000, seed=4, base_model="another-model")),
                              st.just(adapter_blob(3000, seed=5)[:-16] + b"\x00\x00\xc0\x7f" * 4)))
        return list(publish_requests("fz", blob, chunk=draw(st.integers(1, 4096)))), "chunk", INVALID
    blob = draw(st.one_of(st.binary(min_size=1, max_size=3000), st.just(adapter_blob(2000, seed=4))))
    return list(publish_requests("fz", blob, kind=STATE)), "chunk", INVALID


def _ref(name="fz", version=None, alias=None) -> common_pb2.AdapterRef:
    ref = common_pb2.AdapterRef(name=name)
    if version is not None:
        ref.version = version
    if alias is not None:
        ref.alias = alias
    return ref


@st.composite
def bad_read(draw):
    """(rpc, request, field, codes) for the unary reads and deletes."""
    rpc = draw(st.sampled_from(["GetAdapter", "ListAdapters", "DeleteAdapter", "GetVersion", "ListVersions",
                                "DeleteVersion", "SetAlias", "DownloadVersion", "WatchEvents"]))
    if rpc in ("GetAdapter", "DeleteAdapter"):
        request_type = registry_pb2.GetAdapterRequest if rpc == "GetAdapter" else registry_pb2.DeleteAdapterRequest
        return rpc, request_type(name=draw(bad_names())), "name", INVALID
    if rpc == "ListAdapters":
        choice = draw(st.sampled_from(["prefix", "page_size", "page_token"]))
        if choice == "prefix":
            return rpc, registry_pb2.ListAdaptersRequest(prefix="p" * draw(st.integers(129, 5000))), "prefix", INVALID
        if choice == "page_size":
            return rpc, registry_pb2.ListAdaptersRequest(page_size=draw(st.integers(-(2**31), -1))), "page_size", \
                INVALID
        return rpc, registry_pb2.ListAdaptersRequest(page_token=draw(hostile_text(1))), "page_token", INVALID
    if rpc in ("GetVersion", "DownloadVersion"):
        request_type = registry_pb2.GetVersionRequest if rpc == "GetVersion" else registry_pb2.DownloadVersionRequest
        choice = draw(st.sampled_from(["name", "alias", "unknown_version", "unknown_alias", "empty_alias"]
                                      + (["offset", "chunk_size"] if rpc == "DownloadVersion" else [])))
        if choice == "name":
            return rpc, request_type(ref=_ref(draw(bad_names()))), "ref.name", INVALID
        if choice == "alias":
            return rpc, request_type(ref=_ref(alias=draw(bad_aliases().filter(bool)))), "ref.alias", INVALID
        if choice == "empty_alias":
            return rpc, request_type(ref=_ref(alias="")), "ref.alias", INVALID
        if choice == "unknown_version":
            return rpc, request_type(ref=_ref(version=draw(st.integers(3, 2**64 - 1)))), "ref.version", NOT_FOUND
        if choice == "unknown_alias":
            return rpc, request_type(ref=_ref(alias="canary")), "ref.alias", NOT_FOUND
        if choice == "offset":
            return rpc, request_type(ref=_ref(version=1), offset=draw(st.integers(100_000, 2**64 - 1))), "offset", \
                INVALID
        return rpc, request_type(ref=_ref(version=1), chunk_size=draw(st.integers(4 * 1024 * 1024 + 1, 2**32 - 1))), \
            "chunk_size", INVALID
    if rpc == "ListVersions":
        choice = draw(st.sampled_from(["adapter", "kind", "page_size", "page_token"]))
        if choice == "adapter":
            return rpc, registry_pb2.ListVersionsRequest(adapter=draw(bad_names())), "adapter", INVALID
        if choice == "kind":
            return rpc, registry_pb2.ListVersionsRequest(adapter="fz", kind=draw(st.integers(3, 2**31 - 1))), \
                "kind", INVALID
        if choice == "page_size":
            return rpc, registry_pb2.ListVersionsRequest(adapter="fz", page_size=draw(st.integers(-(2**31), -1))), \
                "page_size", INVALID
        return rpc, registry_pb2.ListVersionsRequest(adapter="fz", page_token=draw(hostile_text(1))), "page_token", \
            INVALID
    if rpc == "DeleteVersion":
        choice = draw(st.sampled_from(["adapter", "zero", "unknown", "aliased"]))
        if choice == "adapter":
            return rpc, registry_pb2.DeleteVersionRequest(adapter=draw(bad_names()), version=1), "adapter", INVALID
        if choice == "zero":
            return rpc, registry_pb2.DeleteVersionRequest(adapter="fz", version=0), "version", INVALID
        if choice == "unknown":
            return rpc, registry_pb2.DeleteVersionRequest(adapter="fz", version=draw(st.integers(3, 2**64 - 1))), \
                "version", NOT_FOUND
        return rpc, registry_pb2.DeleteVersionRequest(adapter="fz", version=1), "version", \
            frozenset({grpc.StatusCode.FAILED_PRECONDITION})
    if rpc == "SetAlias":
        choice = draw(st.sampled_from(["adapter", "alias", "unknown_version", "state_version"]))
        if choice == "adapter":
            return rpc, registry_pb2.SetAliasRequest(adapter=draw(bad_names()), alias="x", version=1), "adapter", \
                INVALID
        if choice == "alias":
            return rpc, registry_pb2.SetAliasRequest(adapter="fz", alias=draw(bad_aliases()), version=1), "alias", \
                INVALID
        if choice == "unknown_version":
            return rpc, registry_pb2.SetAliasRequest(adapter="fz", alias="x", version=draw(st.integers(3, 2**64 - 1))), \
                "version", NOT_FOUND
        return rpc, registry_pb2.SetAliasRequest(adapter="fz", alias="x", version=2), "version", INVALID
    choice = draw(st.sampled_from(["cursor", "prefix"]))
    if choice == "cursor":
        cursor = draw(hostile_text(1).filter(lambda s: not (s.replace("-", "").isdigit() and s.count("-") == 1)))
        return rpc, registry_pb2.WatchEventsRequest(after_cursor=cursor), "after_cursor", INVALID
    return rpc, registry_pb2.WatchEventsRequest(prefix="p" * draw(st.integers(129, 5000))), "prefix", INVALID


def _fails(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_registry_writes(subject, data):
    before = registry_view(subject)
    if data.draw(st.booleans()):
        adapter, field = data.draw(bad_create())
        exc = _fails(lambda: subject.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=adapter), timeout=30))
        assert_clear_rejection(exc, field, INVALID, what=f"CreateAdapter {field}")
    else:
        requests, field, codes = data.draw(bad_publish())
        exc = _fails(lambda: subject.PublishVersion(iter(requests), timeout=30))
        assert_clear_rejection(exc, field, codes, what=f"PublishVersion {field}")
    assert registry_view(subject) == before


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_registry_reads_and_deletes(subject, data):
    before = registry_view(subject)
    rpc, request, field, codes = data.draw(bad_read())
    method = getattr(subject, rpc)
    if rpc in ("DownloadVersion", "WatchEvents"):
        exc = _fails(lambda: list(method(request, timeout=30)))
    else:
        exc = _fails(lambda: method(request, timeout=30))
    assert_clear_rejection(exc, field, codes, what=rpc)
    assert registry_view(subject) == before
