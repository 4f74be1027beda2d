"""PublishVersion with the sha256 in a trailer (a client that hashes the blob while it sends it), against a live
registry on real Valkey + SeaweedFS: it commits exactly like the header form, and a stream whose digest is wrong,
missing or misplaced commits nothing and leaves nothing a caller can observe. The header form keeps working."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from loraplane.registry_client import CHUNK_BYTES, RegistryClient, StreamedBlob
from loraplane.v1 import common_pb2, registry_pb2
from registry_svc.store import RegistryLimits
from tests.fixtures.registry import (
    TEST_BASE_MODEL,
    TEST_LORA,
    adapter_blob,
    all_events,
    bucket_objects,
    create_adapter,
    download,
    multipart_uploads,
    publish,
    publish_requests,
    registry_state,
    sha256_hex,
    start_live_registry,
    versions_of,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
E = registry_pb2
# Above S3's 5 MiB multipart minimum: the trailer form writes it in parts once checked.
LARGE = 12 * 1024 * 1024


def trailed(adapter: str, blob: bytes, *, trailer: str | None = None, chunk: int = 1024 * 1024, **header_fields):
    """A publish stream with an empty header sha256 and the digest (or `trailer`) in a trailer last."""
    yield from publish_requests(adapter, blob, sha256="", chunk=chunk, **header_fields)
    yield E.PublishVersionRequest(trailer=E.PublishVersionTrailer(
        sha256=sha256_hex(blob) if trailer is None else trailer))


def without_trailer(adapter: str, blob: bytes):
    yield from publish_requests(adapter, blob, sha256="")


@pytest.mark.parametrize("size", [3000, LARGE], ids=["one-put", "multipart"])
def test_a_publish_with_the_digest_in_the_trailer_commits_the_same_version(registry, registry_stub, size):
    stub = registry_stub
    create_adapter(stub, "tr")
    blob = adapter_blob(size)
    reply = stub.PublishVersion(trailed("tr", blob, training_step=4, aliases=["prod"], metadata={"k": "v"}),
                                timeout=120)
    version = reply.version
    assert not reply.deduplicated
    assert (version.version, version.sha256, version.size_bytes) == (1, sha256_hex(blob), len(blob))
    assert (version.training_step, list(version.aliases), dict(version.metadata)) == (4, ["prod"], {"k": "v"})
    header, data = download(stub, "tr", alias="prod")
    assert data == blob and header.version.sha256 == sha256_hex(blob)
    # Content-addressed under its digest, exactly one object, no multipart upload left open.
    assert bucket_objects(registry.settings) == {f"blobs/sha256/{sha256_hex(blob)}": len(blob)}
    assert multipart_uploads(registry.settings) == []
    published = [e for e in all_events(stub, adapter="tr") if e.type == E.EVENT_TYPE_VERSION_PUBLISHED]
    assert [(e.version, e.sha256) for e in published] == [(1, sha256_hex(blob))]


def test_a_stream_whose_trailer_is_wrong_missing_or_misplaced_commits_nothing(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "target")
    publish(stub, "target", adapter_blob(3000))
    before = registry_state(stub, registry.settings)
    large, small = adapter_blob(LARGE), adapter_blob(3000)
    other = sha256_hex(b"something else")

    def header_then(*messages):
        yield from publish_requests("target", small, sha256="")
        yield from messages

    trailer = E.PublishVersionRequest(trailer=E.PublishVersionTrailer(sha256=sha256_hex(small)))
    cases = [
        # (what was tried, request stream, expected code, field named in the message)
        ("a trailer digest that does not match (multipart)", trailed("target", large, trailer=other),
         grpc.StatusCode.DATA_LOSS, "trailer.sha256"),
        ("a trailer digest that does not match (one put)", trailed("target", small, trailer=other),
         grpc.StatusCode.DATA_LOSS, "trailer.sha256"),
        ("an empty header digest and no trailer (multipart)", without_trailer("target", large), INVALID, "trailer"),
        ("an empty header digest and no trailer (one put)", without_trailer("target", small), INVALID, "trailer"),
        ("a malformed trailer digest", trailed("target", small, trailer="ABC"), INVALID, "trailer.sha256"),
        ("an empty trailer digest", trailed("target", small, trailer=""), INVALID, "trailer.sha256"),
        ("a trailer after a header that has the digest",
         iter([*publish_requests("target", small), trailer]), INVALID, "trailer"),
        ("a chunk after the trailer", header_then(trailer, E.PublishVersionRequest(chunk=b"x")), INVALID, "trailer"),
        ("two trailers", header_then(trailer, trailer), INVALID, "trailer"),
        ("fewer bytes than announced, then a trailer",
         trailed("target", small, size_bytes=len(small) + 1), INVALID, "header.size_bytes"),
        ("garbage with its own correct digest", trailed("target", b"\x00" * 4096), INVALID, "chunk"),
    ]
    for what, requests, code, field in cases:
        with pytest.raises(grpc.RpcError) as caught:
            stub.PublishVersion(requests, timeout=120)
        assert caught.value.code() == code, f"{what}: {caught.value.code()} {caught.value.details()}"
        assert field in caught.value.details(), f"{what}: {caught.value.details()}"
    # No version, no event, no visible blob, no open multipart upload.
    assert registry_state(stub, registry.settings) == before


def test_the_header_digest_form_still_works_and_shares_blobs_with_the_trailer_form(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "both")
    blob = adapter_blob(LARGE)
    first = publish(stub, "both", blob).version  # the digest in the header, as every existing client sends it
    second = stub.PublishVersion(trailed("both", blob), timeout=120).version
    assert (first.version, second.version) == (1, 2)
    assert first.sha256 == second.sha256 == sha256_hex(blob)
    # Same content, one blob: the trailer form found it stored and wrote nothing new.
    assert bucket_objects(registry.settings) == {f"blobs/sha256/{sha256_hex(blob)}": len(blob)}
    for version in (1, 2):
        assert download(stub, "both", version=version)[1] == blob
    stub.DeleteVersion(E.DeleteVersionRequest(adapter="both", version=1))
    assert download(stub, "both", version=2)[1] == blob


def test_idempotency_keys_hold_whichever_form_carries_the_digest(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "idem")
    blob = adapter_blob(LARGE)
    first = stub.PublishVersion(trailed("idem", blob, idempotency_key="k1"), timeout=120)
    assert first.version.version == 1 and not first.deduplicated
    # A retry in either form returns the first version and writes nothing.
    again = stub.PublishVersion(trailed("idem", blob, idempotency_key="k1"), timeout=120)
    assert again.deduplicated and again.version.version == 1
    assert publish(stub, "idem", blob, idempotency_key="k1").version.version == 1
    before = registry_state(stub, registry.settings)
    # The same key for other content is refused: the trailer form is read to the end to know.
    other = adapter_blob(3000)
    with pytest.raises(grpc.RpcError) as caught:
        stub.PublishVersion(trailed("idem", other, idempotency_key="k1"), timeout=120)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "header.idempotency_key" in caught.value.details()
    # ... and a retry whose trailer is missing is still a broken stream, not a match.
    with pytest.raises(grpc.RpcError) as caught:
        stub.PublishVersion(iter([*publish_requests("idem", blob, sha256="", idempotency_key="k1")]), timeout=120)
    assert caught.value.code() == INVALID and "trailer" in caught.value.details()
    assert registry_state(stub, registry.settings) == before
    assert versions_of(stub, "idem") == [1]


def test_a_blob_larger_than_the_buffer_budget_needs_its_digest_in_the_header(isolated_settings, background_loop):
    live = start_live_registry(isolated_settings, background_loop,
                               limits=RegistryLimits(max_buffered_publish_bytes=8 * 1024 * 1024))
    try:
        stub = live.stub()
        create_adapter(stub, "big")
        blob = adapter_blob(LARGE)
        with pytest.raises(grpc.RpcError) as caught:
            stub.PublishVersion(trailed("big", blob), timeout=120)
        assert caught.value.code() == INVALID and "header.sha256" in caught.value.details()
        assert versions_of(stub, "big") == [] and bucket_objects(live.settings) == {}
        # With the digest up front it streams straight to S3, whatever the budget.
        assert publish(stub, "big", blob).version.version == 1
        # Blobs that fit the budget together or one after the other all commit.
        small = [adapter_blob(5 * 1024 * 1024) for _ in range(3)]
        futures = [stub.PublishVersion.future(trailed("big", b), timeout=120) for b in small]
        assert sorted(f.result().version.version for f in futures) == [2, 3, 4]
        assert {download(stub, "big", version=v)[1] for v in (2, 3, 4)} == set(small)
    finally:
        live.close()


async def test_the_client_streams_a_blob_while_it_is_made_and_retries_with_the_digest_in_the_header(registry):
    blob = adapter_blob(LARGE)
    made: list[int] = []

    def pieces():
        for start in range(0, len(blob), CHUNK_BYTES):
            made.append(start)
            yield blob[start:start + CHUNK_BYTES]

    async with RegistryClient(registry.address) as client:
        await client.create_adapter("cl", lora_config=TEST_LORA, base_model=TEST_BASE_MODEL)
        streamed = StreamedBlob(len(blob), pieces())
        assert streamed.sha256 == ""
        version = await client.publish("cl", streamed, idempotency_key="once")
        assert (version.version, version.sha256) == (1, sha256_hex(blob))
        assert streamed.sha256 == sha256_hex(blob) and len(made) == -(-len(blob) // CHUNK_BYTES)
        # A retry sends the kept pieces (nothing is made twice), digest in the header: the same version.
        assert (await client.publish("cl", streamed, idempotency_key="once")).version == 1
        assert len(made) == -(-len(blob) // CHUNK_BYTES)
        assert (await client.download("cl", version=1))[1] == blob

        # A maker that yields fewer bytes than it announced fails the publish, which commits nothing.
        short = StreamedBlob(len(blob), iter([blob[:CHUNK_BYTES]]))
        with pytest.raises(ValueError, match="announced"):
            await client.publish("cl", short)
        assert [v.version for v in await client.list_versions("cl")] == [1]


async def test_an_abandoned_streamed_publish_leaves_nothing_and_the_blob_can_be_published_again(registry):
    blob = adapter_blob(LARGE)
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    def pieces():
        for index, start in enumerate(range(0, len(blob), CHUNK_BYTES)):
            if index == 6:
                loop.call_soon_threadsafe(gate.set)
            yield blob[start:start + CHUNK_BYTES]

    async with RegistryClient(registry.address) as client:
        await client.create_adapter("ab", lora_config=TEST_LORA, base_model=TEST_BASE_MODEL)
        streamed = StreamedBlob(len(blob), pieces())
        attempt = asyncio.ensure_future(client.publish("ab", streamed, idempotency_key="k"))
        await gate.wait()
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        await asyncio.sleep(0.5)  # the registry sees the cancellation and drops what it held
        assert await client.list_versions("ab") == []
        assert bucket_objects(registry.settings) == {} and multipart_uploads(registry.settings) == []
        version = await client.publish("ab", streamed, idempotency_key="k")
        assert version.version == 1 and version.sha256 == hashlib.sha256(blob).hexdigest()


def test_the_registry_keeps_an_adapters_weights_dtype_and_rejects_unknown_ones(registry, registry_stub):
    stub = registry_stub
    lora = common_pb2.LoraConfig(rank=4, alpha=8, target_modules=["q_proj"],
                                 weights_dtype=common_pb2.WEIGHTS_DTYPE_BFLOAT16)
    made = stub.CreateAdapter(E.CreateAdapterRequest(adapter=E.Adapter(name="half", lora_config=lora,
                                                                       base_model=TEST_BASE_MODEL))).adapter
    assert made.lora_config.weights_dtype == common_pb2.WEIGHTS_DTYPE_BFLOAT16
    assert stub.GetAdapter(E.GetAdapterRequest(name="half")).adapter.lora_config == lora
    before = registry_state(stub, registry.settings)
    bad = common_pb2.LoraConfig(rank=4, weights_dtype=7)
    with pytest.raises(grpc.RpcError) as caught:
        stub.CreateAdapter(E.CreateAdapterRequest(adapter=E.Adapter(name="odd", lora_config=bad,
                                                                    base_model=TEST_BASE_MODEL)))
    assert caught.value.code() == INVALID and "adapter.lora_config.weights_dtype" in caught.value.details()
    assert registry_state(stub, registry.settings) == before
