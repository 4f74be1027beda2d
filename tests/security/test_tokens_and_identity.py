"""Forged and replayed page tokens on every paginated listing, and the client library's identity when several
ServiceClients with different keys live in one process."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import uuid

import grpc
import pytest
import redis

from loraplane.client import APIError, ServiceClient, datum_from_sequence
from loraplane.v1 import registry_pb2, sampler_pb2, trainer_pb2
from tests.security.conftest import LORA, A, B, Secured
from tests.security.isolation import leaked


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _fingerprint(*query) -> str:
    return hashlib.sha256(json.dumps(query, separators=(",", ":")).encode()).hexdigest()[:16]


def _old_style(position: str, *query) -> str:
    """A token as the registry issued them before the fix: unsigned JSON whose fingerprint anyone computes."""
    return _b64(json.dumps({"p": position, "q": _fingerprint(*query)}, separators=(",", ":")).encode())


def _list(c: Secured, label: str, prefix: str, token: str, page_size: int = 100):
    try:
        reply = c.registry_stub(label).ListAdapters(registry_pb2.ListAdaptersRequest(
            prefix=prefix, page_size=page_size, page_token=token))
        return grpc.StatusCode.OK, reply
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


@pytest.fixture(scope="module")
def b_adapters(secured: Secured) -> list[str]:
    names = sorted(f"globex/page-{i}-{uuid.uuid4().hex[:6]}" for i in range(3))
    for name in names:
        secured.registry_stub(B).CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
            name=name, lora_config=LORA, base_model="tiny")))
    return names


def test_forged_registry_page_tokens_are_refused_and_never_widen_a_listing(secured: Secured, b_adapters):
    """Hole 1. Before the fix a token was unsigned base64 JSON `{"p": position, "q": fingerprint(query)}`, the
    fingerprint computable from B's own query, and the position became the scan's lower bound unclamped: the
    `_old_style("acme/", "adapters", "")` token below returned acme's adapters (names, metadata, aliases) to globex.
    Now every forged, altered or replayed token is INVALID_ARGUMENT, and the answer carries nothing of A's."""
    c = secured
    # The issue's forgery first: old-style tokens positioned at A's namespace.
    for prefix in ("", "globex/"):
        for query in (("adapters", prefix), ("adapters", prefix, "globex/")):
            token = _old_style("acme/", *query)
            code, reply = _list(c, B, prefix, token)
            answer = reply.SerializeToString() if code == grpc.StatusCode.OK else reply.encode()
            assert not leaked(answer, token.encode(), c.secrets, c.addresses), (query, reply)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (query, code, reply)
    # B pages through its own adapters one at a time: genuine tokens keep working.
    seen, token = [], ""
    while True:
        code, reply = _list(c, B, "globex/page-", token, page_size=1)
        assert code == grpc.StatusCode.OK, reply
        seen += [a.name for a in reply.adapters]
        token = reply.next_page_token
        if not token:
            break
    assert seen == b_adapters
    _code, first = _list(c, B, "", "", page_size=1)
    genuine = first.next_page_token
    payload, _, mac = genuine.partition(".")
    # A's own token for a listing of A's namespace.
    _code, a_page = _list(c, A, "acme/", "", page_size=1)
    a_token = a_page.next_page_token
    assert a_token and a_page.adapters
    forged = {
        "the issue's token (prefix empty)": _old_style("acme/", "adapters", ""),
        "the issue's token (own prefix)": _old_style("acme/", "adapters", "globex/"),
        "old style, the narrowed query": _old_style("acme/", "adapters", "globex/", "globex/"),
        "new payload, B's genuine mac": _b64(json.dumps({"p": "acme/", "q": _fingerprint(
            "adapters", "", "globex/")}, separators=(",", ":")).encode()) + "." + mac,
        "B's genuine payload, no mac": payload,
        "B's genuine token, mac flipped": payload + "." + ("A" if mac[0] != "A" else "B") + mac[1:],
        "A's genuine token replayed by B": a_token,
        "garbage": "not-a-token",
    }
    for what, token in forged.items():
        for prefix in ("", "globex/", "acme/"):
            code, reply = _list(c, B, prefix, token)
            answer = reply.SerializeToString() if code == grpc.StatusCode.OK else reply.encode()
            assert not leaked(answer, token.encode(), c.secrets, c.addresses), (what, prefix)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, prefix, code, reply)
            assert "page_token" in reply
    # The owner's own token pages on for the owner.
    code, reply = _list(c, A, "acme/", a_token, page_size=1)
    assert code == grpc.StatusCode.OK and reply.adapters


def test_even_a_correctly_signed_token_cannot_widen_a_listing(secured: Secured, b_adapters):
    """Defence in depth, as if the signing secret had leaked: a token signed with the registry's own secret whose
    position lies below B's namespace starts at B's namespace, and every record is filtered by B's key."""
    c = secured
    r = redis.Redis.from_url(c.settings.redis_url, decode_responses=True)
    try:
        secret = bytes.fromhex(r.get(c.settings.key_prefix + "page_token_secret"))
    finally:
        r.close()
    for prefix in ("", "globex/"):
        for position in ("acme/", "", "a", "\x00"):
            payload = _b64(json.dumps({"p": position, "q": _fingerprint("adapters", prefix, "globex/")},
                                      separators=(",", ":")).encode())
            mac = _b64(hmac.new(secret, b"loraplane page token\n" + payload.encode(), hashlib.sha256).digest()[:16])
            code, reply = _list(c, B, prefix, f"{payload}.{mac}")
            assert code == grpc.StatusCode.OK, (position, reply)
            assert [a.name for a in reply.adapters if not a.name.startswith("globex/")] == []
            assert not leaked(reply.SerializeToString(), b"", c.secrets, c.addresses)
            assert set(b_adapters) <= {a.name for a in reply.adapters}


def test_trainer_and_sampler_listings_ignore_what_a_forged_token_says(secured: Secured):
    """Their page tokens only move the start of a listing already filtered by the key: a position in A's namespace
    (or before it) shows B nothing of A's."""
    c = secured
    for token in ("", "acme/", "a", c.a["train"]):
        try:
            reply = c.trainer_stub(B).ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(page_token=token))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            continue
        assert not [a.name for a in reply.adapters if not a.name.startswith("globex/")], reply
        assert not leaked(reply.SerializeToString(), token.encode(), c.secrets, c.addresses)
    for raw in (b"\nacme/\n0", b"\n\n0", f"\n{c.a['reg']}\n0".encode()):
        token = base64.urlsafe_b64encode(raw).decode()
        try:
            reply = c.sampler_stub(B).ListLoadedAdapters(sampler_pb2.ListLoadedAdaptersRequest(page_token=token))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            continue
        assert not [e.adapter for e in reply.adapters if not e.adapter.startswith("globex/")], reply
        assert not leaked(reply.SerializeToString(), raw, c.secrets, c.addresses)


def test_each_service_client_keeps_its_own_identity(secured: Secured):
    """Hole 7. Before the fix the process-wide client runtime kept one identity per address, and a new
    ServiceClient re-keyed the trainer/sampler channels with its own key: after `globex` was created, `acme`'s
    forward_backward below went out with globex's key and failed PERMISSION_DENIED. Now every ServiceClient's
    addresses carry its own identity, so both act as themselves, in any order."""
    c = secured
    addresses = {"trainer": c.trainer.address, "sampler": c.sampler.address, "registry": c.registry.address}
    acme = ServiceClient(**addresses, api_key=c.keys.tokens[A])
    name = f"acme/client-{uuid.uuid4().hex[:6]}"
    training = acme.create_lora_training_client("tiny", rank=4, seed=1, name=name)
    globex = ServiceClient(**addresses, api_key=c.keys.tokens[B])
    try:
        data = [datum_from_sequence([5, 6, 7, 8, 9])]
        assert training.forward_backward(data).result(60).loss_fn_outputs
        training.optim_step().result(60)
        version = training.save_weights_for_sampler().result(60)  # a SamplingClient of the new version
        # globex, created later, is globex: A's adapter is out of its reach on every service.
        with pytest.raises(APIError) as denied:
            globex.get_adapter(name)
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(APIError) as denied:
            globex.create_sampling_client(name, version.version).sample([5, 6], 1).result(60)
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert name not in [a.name for a in globex.list_training_adapters()]
        # ... and acme is still acme, on the trainer, the sampler and the registry.
        assert version.sample([5, 6], 1).result(60).sequences
        assert acme.create_sampling_client(name, version.version).sample([5, 6], 1).result(60).sequences
        assert acme.get_adapter(name).name == name

        async def on_my_loop():  # sample_async runs on the caller's loop, on channels of that loop: same identities
            reply = await acme.create_sampling_client(name, version.version).sample_async([5, 6], 1)
            with pytest.raises(APIError) as denied:
                await globex.create_sampling_client(name, version.version).sample_async([5, 6], 1)
            return reply, denied.value.code

        reply, code = asyncio.run(on_my_loop())
        assert reply.sequences and code == grpc.StatusCode.PERMISSION_DENIED
        assert training.forward_backward(data).result(60).loss_fn_outputs
        assert name in [a.name for a in acme.list_training_adapters()]
    finally:
        acme.close()
        globex.close()


def test_a_tenant_key_named_after_the_operator_namespace_is_refused_by_the_gateway(secured: Secured):
    """Admin keys (and the open mode) keep their Tinker sessions, runs and adapters in the gateway's default
    tenant. `loraplane keys create` refuses that tenant name; a key made under it some other way (directly in the
    key store, as here) must still not act inside that namespace. The admin's own call succeeds."""
    c = secured
    label = f"squatter-{uuid.uuid4().hex[:6]}"
    c.keys.issue(label, c.gateway_settings.default_tenant, "tenant")
    try:
        for method, path, body in (("POST", "/api/v1/create_session", {"tags": []}),
                                   ("GET", "/api/v1/training_runs", None),
                                   ("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                                                                     "messages": [{"role": "user", "content": "hi"}]})):
            refused = c.http(label, method, path, **({"json": body} if body is not None else {}))
            assert refused.status_code == 403, (path, refused.status_code, refused.text)
            assert "operator namespace" in refused.text
            assert not leaked(refused.content, json.dumps(body or {}).encode(), c.secrets, c.addresses), path
        c.ok("POST", "/api/v1/create_session", label="admin", json={"tags": []})
    finally:
        assert c.keys.revoke(label)
