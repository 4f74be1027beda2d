"""The registry with authentication on (real Valkey, SeaweedFS, gRPC): every RPC × {no key, revoked key, another
tenant's key, own key, admin key}; denials change nothing and name no other tenant; listings and event streams
show only what the caller may see; revocation takes effect within a second; service keys act for one tenant."""

from __future__ import annotations

import time
import uuid

import grpc
import pytest

from loraplane.auth import ACTING_FOR_HEADER
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.contract.auth_helpers import CALLERS, auth_settings, drain, expect_code, issue_standard_keys
from tests.fixtures.registry import TEST_BASE_MODEL, TEST_LORA, adapter_blob, sha256_hex, start_live_registry

Stub = registry_pb2_grpc.AdapterRegistryServiceStub
DENIED = {"none": grpc.StatusCode.UNAUTHENTICATED, "revoked": grpc.StatusCode.UNAUTHENTICATED,
          "other": grpc.StatusCode.PERMISSION_DENIED}


@pytest.fixture
def secured(isolated_settings, background_loop):
    settings = auth_settings(isolated_settings)
    keys = issue_standard_keys(settings, background_loop)
    live = start_live_registry(settings, background_loop)
    yield live, keys
    keys.close()
    live.close()


def publish_requests(name: str, blob: bytes, aliases=()):
    yield registry_pb2.PublishVersionRequest(header=registry_pb2.PublishVersionHeader(
        adapter=name, sha256=sha256_hex(blob), size_bytes=len(blob), aliases=list(aliases)))
    yield registry_pb2.PublishVersionRequest(chunk=blob)


def make_adapter(stub: Stub, name: str, versions: int = 2) -> None:
    stub.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name=name, lora_config=TEST_LORA, base_model=TEST_BASE_MODEL)))
    for i in range(versions):
        stub.PublishVersion(publish_requests(name, adapter_blob(seed=i), aliases=["prod"] if i == 0 else []))


def snapshot(stub: Stub, name: str):
    try:
        adapter = stub.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    except grpc.RpcError as exc:
        return exc.code()
    versions = stub.ListVersions(registry_pb2.ListVersionsRequest(adapter=name)).versions
    return (adapter.SerializeToString(deterministic=True), [v.SerializeToString(deterministic=True) for v in versions])


def ref(name, **kw):
    return common_pb2.AdapterRef(name=name, **kw)


# Each RPC as a call on an adapter `name` that exists with versions 1 (alias prod) and 2. "fresh" ones need a name
# that does not exist yet.
RPCS = {
    "CreateAdapter": (True, lambda s, n: s.CreateAdapter(registry_pb2.CreateAdapterRequest(
        adapter=registry_pb2.Adapter(name=n, lora_config=TEST_LORA, base_model=TEST_BASE_MODEL)))),
    "GetAdapter": (False, lambda s, n: s.GetAdapter(registry_pb2.GetAdapterRequest(name=n))),
    "DeleteAdapter": (False, lambda s, n: s.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=n))),
    "PublishVersion": (False, lambda s, n: s.PublishVersion(publish_requests(n, adapter_blob(seed=9)))),
    "GetVersion": (False, lambda s, n: s.GetVersion(registry_pb2.GetVersionRequest(ref=ref(n, version=1)))),
    "ListVersions": (False, lambda s, n: s.ListVersions(registry_pb2.ListVersionsRequest(adapter=n))),
    "DeleteVersion": (False, lambda s, n: s.DeleteVersion(registry_pb2.DeleteVersionRequest(adapter=n, version=2))),
    "SetAlias": (False, lambda s, n: s.SetAlias(registry_pb2.SetAliasRequest(adapter=n, alias="prod", version=2))),
    "DownloadVersion": (False, lambda s, n: list(s.DownloadVersion(registry_pb2.DownloadVersionRequest(
        ref=ref(n, alias="prod"))))),
    # The S3 address of a blob is handed out under exactly the checks of its bytes.
    "DownloadVersion direct": (False, lambda s, n: list(s.DownloadVersion(registry_pb2.DownloadVersionRequest(
        ref=ref(n, alias="prod"), direct=True)))),
    "WatchEvents": (False, lambda s, n: drain(s.WatchEvents(registry_pb2.WatchEventsRequest(adapter=n), timeout=0.5))),
}


@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_every_registry_rpc_under_every_key(secured, rpc):
    live, keys = secured
    fresh, call = RPCS[rpc]
    admin = keys.stub(Stub, live.address, "admin")
    targets = {who: f"acme/{rpc.lower().replace(' ', '-')}-{who}-{uuid.uuid4().hex[:6]}" for who in CALLERS}
    if not fresh:
        for name in targets.values():
            make_adapter(admin, name)
    for who in ("none", "revoked", "other"):
        before = snapshot(admin, targets[who])
        stub = keys.stub(Stub, live.address, who)
        error = expect_code(lambda stub=stub, name=targets[who]: call(stub, name), DENIED[who])
        # Neither the adapter's owner nor its existence shows in the answer.
        assert "acme" not in (error.details() or ""), error.details()
        assert targets[who] not in (error.details() or "")
        assert snapshot(admin, targets[who]) == before, f"{rpc} by {who} changed state"
    for who in ("own", "admin"):
        call(keys.stub(Stub, live.address, who), targets[who])


def test_collect_garbage_is_for_admins_only(secured):
    live, keys = secured
    for who in ("own", "other", "service"):
        expect_code(lambda who=who: keys.stub(Stub, live.address, who).CollectGarbage(
            registry_pb2.CollectGarbageRequest(dry_run=True)), grpc.StatusCode.PERMISSION_DENIED)
    expect_code(lambda: keys.stub(Stub, live.address, "none").CollectGarbage(
        registry_pb2.CollectGarbageRequest(dry_run=True)), grpc.StatusCode.UNAUTHENTICATED)
    keys.stub(Stub, live.address, "admin").CollectGarbage(registry_pb2.CollectGarbageRequest(dry_run=True))


def test_foreign_names_are_denied_alike_whether_they_exist_or_not(secured):
    live, keys = secured
    admin, other = keys.stub(Stub, live.address, "admin"), keys.stub(Stub, live.address, "other")
    make_adapter(admin, "acme/exists", versions=1)
    answers = []
    for name in ("acme/exists", "acme/never-created"):
        error = expect_code(lambda name=name: other.GetAdapter(registry_pb2.GetAdapterRequest(name=name)),
                            grpc.StatusCode.PERMISSION_DENIED)
        answers.append(error.details().replace(name, "NAME"))
    assert answers[0] == answers[1]
    assert "globex/" in answers[0]  # it names the caller's own namespace


def test_listing_and_events_show_only_the_callers_namespace(secured):
    live, keys = secured
    admin = keys.stub(Stub, live.address, "admin")
    for name in ("acme/a", "acme/b", "globex/x", "shared"):
        make_adapter(admin, name, versions=1)
    own = keys.stub(Stub, live.address, "own")
    listed = [a.name for a in own.ListAdapters(registry_pb2.ListAdaptersRequest()).adapters]
    assert listed == ["acme/a", "acme/b"]
    assert [a.name for a in own.ListAdapters(registry_pb2.ListAdaptersRequest(prefix="glob")).adapters] == []
    assert [a.name for a in own.ListAdapters(registry_pb2.ListAdaptersRequest(prefix="acme/b")).adapters] == ["acme/b"]
    page = own.ListAdapters(registry_pb2.ListAdaptersRequest(page_size=1))
    assert [a.name for a in page.adapters] == ["acme/a"]
    rest = own.ListAdapters(registry_pb2.ListAdaptersRequest(page_size=1, page_token=page.next_page_token))
    assert [a.name for a in rest.adapters] == ["acme/b"] and not rest.next_page_token
    everything = [a.name for a in admin.ListAdapters(registry_pb2.ListAdaptersRequest()).adapters]
    assert everything == ["acme/a", "acme/b", "globex/x", "shared"]

    seen = {e.event.adapter for e in drain(own.WatchEvents(registry_pb2.WatchEventsRequest(), timeout=1.0))}
    assert seen == {"acme/a", "acme/b"}
    seen_other = {e.event.adapter for e in drain(keys.stub(Stub, live.address, "other").WatchEvents(
        registry_pb2.WatchEventsRequest(), timeout=1.0))}
    assert seen_other == {"globex/x"}
    seen_admin = {e.event.adapter for e in drain(admin.WatchEvents(registry_pb2.WatchEventsRequest(), timeout=1.0))}
    assert seen_admin == {"acme/a", "acme/b", "globex/x", "shared"}


def test_a_tenant_cannot_reach_unprefixed_names(secured):
    live, keys = secured
    make_adapter(keys.stub(Stub, live.address, "admin"), "shared", versions=1)
    own = keys.stub(Stub, live.address, "own")
    expect_code(lambda: own.GetAdapter(registry_pb2.GetAdapterRequest(name="shared")),
                grpc.StatusCode.PERMISSION_DENIED)
    expect_code(lambda: own.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name="mine", lora_config=TEST_LORA, base_model=TEST_BASE_MODEL))), grpc.StatusCode.PERMISSION_DENIED)


def test_revocation_takes_effect_within_a_second(secured):
    live, keys = secured
    keys.issue("soon-gone", "acme", "tenant")
    stub = keys.stub(Stub, live.address, "soon-gone")
    stub.ListAdapters(registry_pb2.ListAdaptersRequest())
    assert keys.revoke("soon-gone")
    time.sleep(1.0)
    expect_code(lambda: stub.ListAdapters(registry_pb2.ListAdaptersRequest()), grpc.StatusCode.UNAUTHENTICATED)
    assert not keys.revoke("soon-gone")


def test_malformed_and_forged_keys_are_unauthenticated(secured):
    live, keys = secured
    real = keys.tokens["own"]
    forged = real[:-4] + ("AAAA" if not real.endswith("AAAA") else "BBBB")
    for token in ("nonsense", forged, "Bearer", real.replace("lpk_", "lpx_")):
        keys.tokens["bad"] = token
        expect_code(lambda: keys.stub(Stub, live.address, "bad").ListAdapters(registry_pb2.ListAdaptersRequest()),
                    grpc.StatusCode.UNAUTHENTICATED)


def test_health_needs_no_key(secured):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    live, keys = secured
    reply = keys.stub(health_pb2_grpc.HealthStub, live.address, "none").Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_service_key_reaches_every_tenant_but_only_one_while_acting_for_it(secured):
    live, keys = secured
    admin = keys.stub(Stub, live.address, "admin")
    make_adapter(admin, "acme/m", versions=1)
    make_adapter(admin, "globex/m", versions=1)
    service = keys.stub(Stub, live.address, "service")
    for name in ("acme/m", "globex/m"):
        service.GetAdapter(registry_pb2.GetAdapterRequest(name=name))
        list(service.DownloadVersion(registry_pb2.DownloadVersionRequest(ref=ref(name))))
    acting = [(ACTING_FOR_HEADER, "acme")]
    service.GetAdapter(registry_pb2.GetAdapterRequest(name="acme/m"), metadata=acting)
    error = expect_code(lambda: service.GetAdapter(registry_pb2.GetAdapterRequest(name="globex/m"), metadata=acting),
                        grpc.StatusCode.PERMISSION_DENIED)
    assert "globex" not in error.details()
    listed = service.ListAdapters(registry_pb2.ListAdaptersRequest(), metadata=acting).adapters
    assert [a.name for a in listed] == ["acme/m"]
    # A tenant key cannot widen or move its scope with the header.
    own = keys.stub(Stub, live.address, "own")
    expect_code(lambda: own.GetAdapter(registry_pb2.GetAdapterRequest(name="globex/m"),
                                       metadata=[(ACTING_FOR_HEADER, "globex")]), grpc.StatusCode.PERMISSION_DENIED)


def test_audit_stream_records_changes_key_events_and_denials(secured):
    live, keys = secured
    admin = keys.stub(Stub, live.address, "admin")
    make_adapter(admin, "acme/audited", versions=2)
    own = keys.stub(Stub, live.address, "own")
    own.SetAlias(registry_pb2.SetAliasRequest(adapter="acme/audited", alias="prod", version=2))
    own.DeleteVersion(registry_pb2.DeleteVersionRequest(adapter="acme/audited", version=1))
    expect_code(lambda: keys.stub(Stub, live.address, "other").DeleteAdapter(
        registry_pb2.DeleteAdapterRequest(name="acme/audited")), grpc.StatusCode.PERMISSION_DENIED)
    expect_code(lambda: keys.stub(Stub, live.address, "none").ListAdapters(registry_pb2.ListAdaptersRequest()),
                grpc.StatusCode.UNAUTHENTICATED)
    admin.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name="acme/audited"))

    records = keys.run(lambda store: store.read_audit(100))
    seen = [(r["action"], r.get("target", ""), r.get("outcome"), r.get("key_id", r.get("actor"))) for r in records]
    ids = keys.ids
    assert ("CreateKey", ids["own"], "ok", records[0].get("actor")) in seen
    assert ("RevokeKey", ids["revoked"], "ok", records[0].get("actor")) in seen
    assert ("SetAlias", "acme/audited:prod", "ok", ids["own"]) in seen
    assert ("DeleteVersion", "acme/audited@v1", "ok", ids["own"]) in seen
    # The record (for admins) names what was asked for; the caller's answer did not.
    assert ("/loraplane.v1.AdapterRegistryService/DeleteAdapter", "acme/audited", "PERMISSION_DENIED",
            ids["other"]) in seen
    assert ("/loraplane.v1.AdapterRegistryService/ListAdapters", "", "UNAUTHENTICATED", None) in seen
    assert ("DeleteAdapter", "acme/audited", "ok", ids["admin"]) in seen
