"""A version reserved before its bytes (PublishVersionHeader.upload_later) and stored later (reserved_version), on a
real registry (Valkey + SeaweedFS on loopback): pending until the bytes land, downloads waiting for them, only a
service key may reserve, bad headers refused naming the field, and nothing lost or left behind when the adapter
goes meanwhile (issue 34: a trainer acknowledges a pushed version before its S3 upload)."""

from __future__ import annotations

import threading
import time

import grpc

from loraplane.registry_client import RegistryClient
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.contract.auth_helpers import auth_settings, expect_code, issue_standard_keys
from tests.fixtures.registry import (
    TEST_LORA,
    adapter_blob,
    all_events,
    bucket_objects,
    create_adapter,
    download,
    publish,
    publish_requests,
    rpc_error,
    sha256_hex,
    start_live_registry,
)


def reserve(stub, adapter: str, blob: bytes, **fields) -> registry_pb2.PublishVersionResponse:
    header = {"adapter": adapter, "sha256": sha256_hex(blob), "size_bytes": len(blob), "idempotency_key": "k1",
              "upload_later": True}
    header.update(fields)
    return stub.PublishVersion(iter([registry_pb2.PublishVersionRequest(
        header=registry_pb2.PublishVersionHeader(**header))]), timeout=30)


def get(stub, adapter: str, version: int) -> common_pb2.AdapterVersion:
    return stub.GetVersion(registry_pb2.GetVersionRequest(
        ref=common_pb2.AdapterRef(name=adapter, version=version))).version


def test_a_reserved_version_is_pending_until_its_bytes_are_stored_and_downloads_wait_for_them(
        registry, registry_stub, background_loop):
    create_adapter(registry_stub, "res")
    blob = adapter_blob(300_000, seed=5)
    reply = reserve(registry_stub, "res", blob, aliases=["live"])
    version = reply.version.version
    assert reply.version.pending and reply.version.sha256 == sha256_hex(blob)
    # Committed at once: the event went out with the digest, the alias moved, nothing is in S3 yet.
    published = [e for e in all_events(registry_stub, adapter="res") if e.type == registry_pb2.EVENT_TYPE_VERSION_PUBLISHED]
    assert [(e.version, e.sha256) for e in published] == [(version, sha256_hex(blob))]
    assert get(registry_stub, "res", version).aliases == ["live"]
    assert not [key for key in bucket_objects(registry.settings) if sha256_hex(blob) in key]
    # A retried reservation returns the same version.
    assert reserve(registry_stub, "res", blob).version.version == version
    with rpc_error(grpc.StatusCode.UNAVAILABLE, "still being uploaded"):
        download(registry_stub, "res", version=version)

    # The client's download waits for the bytes: it returns them once the trainer's upload lands.
    client = RegistryClient(registry.address)
    got: dict = {}
    reader = threading.Thread(target=lambda: got.update(
        result=background_loop.run(client.download("res", version), timeout=60)))
    reader.start()
    time.sleep(0.5)
    assert reader.is_alive(), "the download did not wait for the pending version"
    stored = publish(registry_stub, "res", blob, reserved_version=version)
    assert (stored.version.version, stored.version.pending) == (version, False)
    reader.join(30)
    described, data = got["result"]
    assert (described.version, described.pending, data) == (version, False, blob)
    background_loop.run(client.close(), timeout=10)
    assert not get(registry_stub, "res", version).pending
    assert download(registry_stub, "res", version=version)[1] == blob
    # Bytes sent again for a stored version are not stored twice and change nothing.
    again = publish(registry_stub, "res", blob, reserved_version=version)
    assert (again.version.version, again.deduplicated) == (version, True)
    assert [v for v in registry_stub.ListVersions(registry_pb2.ListVersionsRequest(adapter="res")).versions] \
        == [get(registry_stub, "res", version)]


def test_reservations_and_their_uploads_refuse_bad_headers_naming_the_field(registry_stub):
    create_adapter(registry_stub, "bad")
    blob = adapter_blob(2_000, seed=1)
    for fields, name in [({"sha256": ""}, "header.sha256"),
                         ({"idempotency_key": ""}, "header.idempotency_key"),
                         ({"kind": common_pb2.VERSION_KIND_TRAINING_STATE}, "header.kind"),
                         ({"reserved_version": 3}, "header.reserved_version")]:
        with rpc_error(grpc.StatusCode.INVALID_ARGUMENT, name):
            reserve(registry_stub, "bad", blob, **fields)
    with rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "chunk"):
        registry_stub.PublishVersion(publish_requests("bad", blob, idempotency_key="k", upload_later=True))
    assert not registry_stub.ListVersions(registry_pb2.ListVersionsRequest(adapter="bad")).versions

    version = reserve(registry_stub, "bad", blob).version.version
    other = adapter_blob(2_000, seed=2)
    with rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "header.sha256"):  # bytes of another blob
        publish(registry_stub, "bad", other, reserved_version=version)
    with rpc_error(grpc.StatusCode.NOT_FOUND, "header.reserved_version"):
        publish(registry_stub, "bad", blob, reserved_version=version + 7)
    assert get(registry_stub, "bad", version).pending  # still waiting for its own bytes
    assert publish(registry_stub, "bad", blob, reserved_version=version).version.pending is False


def test_an_adapter_deleted_while_its_version_is_pending_leaves_no_version_and_no_blob(registry, registry_stub):
    create_adapter(registry_stub, "gone")
    blob = adapter_blob(4_000, seed=9)
    version = reserve(registry_stub, "gone", blob).version.version
    registry_stub.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name="gone"))
    with rpc_error(grpc.StatusCode.NOT_FOUND):
        publish(registry_stub, "gone", blob, reserved_version=version)
    assert not [key for key in bucket_objects(registry.settings) if sha256_hex(blob) in key]


def test_only_a_service_key_reserves_and_uploads_later(isolated_settings, background_loop):
    settings = auth_settings(isolated_settings)
    keys = issue_standard_keys(settings, background_loop)
    live = start_live_registry(settings, background_loop)
    try:
        admin = keys.stub(registry_pb2_grpc.AdapterRegistryServiceStub, live.address, "admin")
        admin.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
            name="acme/r", lora_config=TEST_LORA, base_model="tiny")))
        blob = adapter_blob(2_000, seed=3)
        own = keys.stub(registry_pb2_grpc.AdapterRegistryServiceStub, live.address, "own")
        error = expect_code(lambda: reserve(own, "acme/r", blob), grpc.StatusCode.PERMISSION_DENIED)
        assert "header.upload_later" in error.details() and "service key" in error.details()
        error = expect_code(lambda: publish(own, "acme/r", blob, reserved_version=1),
                            grpc.StatusCode.PERMISSION_DENIED)
        assert "header.reserved_version" in error.details()
        assert not own.ListVersions(registry_pb2.ListVersionsRequest(adapter="acme/r")).versions
        service = keys.stub(registry_pb2_grpc.AdapterRegistryServiceStub, live.address, "service")
        acting = [("x-loraplane-acting-for", "acme")]
        # The service key acting for another tenant is held to that tenant's names.
        expect_code(lambda: service.PublishVersion(iter([registry_pb2.PublishVersionRequest(
            header=registry_pb2.PublishVersionHeader(adapter="acme/r", sha256=sha256_hex(blob), size_bytes=len(blob),
                                                     idempotency_key="k", upload_later=True))]),
            metadata=[("x-loraplane-acting-for", "globex")]), grpc.StatusCode.PERMISSION_DENIED)
        # The same reservation with the service key acting for the owner succeeds, and so does its upload.
        reply = service.PublishVersion(iter([registry_pb2.PublishVersionRequest(
            header=registry_pb2.PublishVersionHeader(adapter="acme/r", sha256=sha256_hex(blob), size_bytes=len(blob),
                                                     idempotency_key="k", upload_later=True))]), metadata=acting)
        assert reply.version.pending
        stored = service.PublishVersion(publish_requests("acme/r", blob, reserved_version=reply.version.version),
                                        metadata=acting)
        assert not stored.version.pending
        assert download(own, "acme/r", version=reply.version.version)[1] == blob
    finally:
        keys.close()
        live.close()


def test_reserving_a_blob_a_stored_version_holds_commits_it_stored(registry_stub):
    create_adapter(registry_stub, "dup")
    blob = adapter_blob(3_000, seed=11)
    first = reserve(registry_stub, "dup", blob, idempotency_key="a").version
    # Two reservations of bytes nobody stored yet: both pending (a reservation does not store the blob).
    second = reserve(registry_stub, "dup", blob, idempotency_key="b").version
    assert first.pending and second.pending
    publish(registry_stub, "dup", blob, reserved_version=first.version)
    assert not get(registry_stub, "dup", first.version).pending
    assert get(registry_stub, "dup", second.version).pending  # its own bytes are still owed
    # Now that a stored version holds the blob, a reservation of it is stored at once and downloads at once.
    third = reserve(registry_stub, "dup", blob, idempotency_key="c").version
    assert not third.pending and not get(registry_stub, "dup", third.version).pending
    assert download(registry_stub, "dup", version=third.version)[1] == blob
    # Deleting every stored version leaves only the pending one: a new reservation is pending again.
    for version in (first.version, third.version):
        registry_stub.DeleteVersion(registry_pb2.DeleteVersionRequest(adapter="dup", version=version))
    assert reserve(registry_stub, "dup", blob, idempotency_key="d").version.pending


def test_an_ordinary_publish_under_the_reservations_key_stores_its_bytes(registry_stub):
    create_adapter(registry_stub, "plain")
    blob = adapter_blob(3_000, seed=12)
    version = reserve(registry_stub, "plain", blob, idempotency_key="k").version.version
    stored = publish(registry_stub, "plain", blob, idempotency_key="k")
    assert (stored.version.version, stored.version.pending) == (version, False)
    assert download(registry_stub, "plain", version=version)[1] == blob

    # The same with the digest in a trailer: the bytes and the trailer must both match the reservation.
    other = adapter_blob(3_000, seed=13)
    version = reserve(registry_stub, "plain", other, idempotency_key="t").version.version

    def trailed(data: bytes, digest: str):
        yield registry_pb2.PublishVersionRequest(header=registry_pb2.PublishVersionHeader(
            adapter="plain", size_bytes=len(data), idempotency_key="t"))
        yield registry_pb2.PublishVersionRequest(chunk=data)
        yield registry_pb2.PublishVersionRequest(trailer=registry_pb2.PublishVersionTrailer(sha256=digest))

    with rpc_error(grpc.StatusCode.DATA_LOSS, "header.sha256"):  # same length, not the reserved bytes
        registry_stub.PublishVersion(trailed(blob[:len(other)].ljust(len(other), b"\0"), sha256_hex(other)))
    assert get(registry_stub, "plain", version).pending
    reply = registry_stub.PublishVersion(trailed(other, sha256_hex(other)))
    assert (reply.version.version, reply.version.pending) == (version, False)
    assert download(registry_stub, "plain", version=version)[1] == other


def test_bytes_that_miss_the_reserved_digest_leave_it_pending_and_refused_content_deletes_it(registry, registry_stub):
    create_adapter(registry_stub, "chk")
    blob = adapter_blob(300_000, seed=14)
    version = reserve(registry_stub, "chk", blob).version.version
    wrong = adapter_blob(300_000, seed=15)
    assert len(wrong) == len(blob)
    # The header names the reserved digest but the bytes are others (a corrupted transfer): refused, still pending,
    # nothing stored, and the right bytes are still taken.
    with rpc_error(grpc.StatusCode.DATA_LOSS, "header.sha256"):
        publish(registry_stub, "chk", wrong, sha256=sha256_hex(blob), reserved_version=version)
    assert get(registry_stub, "chk", version).pending
    assert not [key for key in bucket_objects(registry.settings) if sha256_hex(blob) in key]
    assert not publish(registry_stub, "chk", blob, reserved_version=version).version.pending

    # Bytes that hash right but that the adapter can never load (another base model): the version is deleted.
    alien = adapter_blob(3_000, seed=16, base_model="another-model")
    doomed = reserve(registry_stub, "chk", alien, idempotency_key="alien").version.version
    with rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "base model"):
        publish(registry_stub, "chk", alien, reserved_version=doomed)
    with rpc_error(grpc.StatusCode.NOT_FOUND):
        get(registry_stub, "chk", doomed)
    assert not [key for key in bucket_objects(registry.settings) if sha256_hex(alien) in key]
    deleted = [e.version for e in all_events(registry_stub, adapter="chk")
               if e.type == registry_pb2.EVENT_TYPE_VERSION_DELETED]
    assert deleted == [doomed]
