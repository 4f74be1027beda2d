"""Every gateway route, tried by tenant B (globex) against tenant A's (acme's) Tinker sessions, models, sampling
sessions, checkpoints, futures and adapters, with A's real ids and with never-issued ids of the same shape.

The route list is read from the app's own route table: a route added to the gateway without a case here fails
`test_every_route_has_a_case`, so no new route can escape the suite.

Holes of issue 21 these cases catch, and why each failed before the fix (records were keyed by bare id in a Redis
namespace shared by all tenants, and most lookups checked only that the id existed):
- hole 2: `create_sampling_session` with A's session_id answered 200 and overwrote A's sampler record; `asample` on
  `<A's session>:sample:0` with seq_id 0 answered 200 with A's own request id (the shared dedup key); both now 404,
  as a never-issued session does;
- hole 3: `retrieve_future` with A's request id answered 200 with A's sampled tokens (futures were keyed by id
  only); now 404;
- hole 4: `create_model` / `load_weights` with A's session_id answered 200 (squatting A's model ids) and
  `create_model` with an existing model_seq_id returned A's request id; now 404;
- hole 5: `session_heartbeat` and `sessions/{id}/finish` on A's session answered 200; now 404;
- hole 6: the streaming completions / chat / messages routes answered 200 and put the permission error inside the
  event stream; now 403 before the stream starts (and, via the official clients, PermissionDeniedError);
- counts: `total_count` of /training_runs and /checkpoints counted every tenant's items; B's now counts its own.
The snapshot check (A's state unchanged) failed for holes 2 and 4 before the fix: B's writes landed in A's records.

Issue 31 added the write routes tried with B's own resources and A's ids (B's own checkpoint loaded into a new model
of A's session, B's own sampler weights in a sampling session of A's session), a check that a refused case leaves
B's own registry and trainer listings unchanged too, and the routes that issue added: `/sessions` (listing and
get), `/unload_model`, and Tinker's OpenAI surface `/oai/api/v1` with A's tinker:// sampler path as the model (a 404
exactly like a never-saved path). Before issue 31 those routes did not exist (the suite fails 7 tests there)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import anthropic
import openai
import pytest

from gateway_svc.app import create_app
from gateway_svc.config import GatewaySettings
from gateway_svc.wire import tinker_wire_pb2 as wire
from tests.security.conftest import A, B, Secured
from tests.security.isolation import leaked, missing_like, normalize

Request = tuple[str, str, dict]  # method, path, httpx keyword arguments
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


@dataclass
class Case:
    """`make(ids, c)` builds the request from an id map (A's or missing ones). kind:
    - scoped: B gets `status` for A's ids and for missing ones, indistinguishably; A's key gets a 2xx (`owner` may
      build A's own request, e.g. with a fresh seq_id, when repeating B's exact request would not be a fresh call);
    - own: the route touches no resource of A's (B works on its own, or on nothing); checked for leaks only;
    - refused: served to nobody (unsupported): every caller gets `status`, A and B alike;
    - listing: B lists its own things; `check(c, body)` asserts nothing of A's is counted or shown."""

    make: Callable[[dict, Secured], Request]
    kind: str = "scoped"
    status: int = 404
    owner: Callable[[dict, Secured], Request] | None = None
    check: Callable[[Secured, dict], None] | None = None


def post(path: str, body: Callable[[dict, Secured], dict]) -> Callable[[dict, Secured], Request]:
    return lambda x, c: ("POST", path, {"json": body(x, c)})


def fwdbwd(x: dict, c: Secured, seq: int = 1) -> Request:
    body = wire.ForwardBackwardRequest(model_id=x["model"], seq_id=seq, loss_fn="cross_entropy", forward_only=True)
    return ("POST", "/api/v1/forward_backward",
            {"content": body.SerializeToString(), "headers": {"content-type": "application/x-protobuf"}})


def openai_body(stream: bool, kind: str) -> Callable[[dict, Secured], Request]:
    def make(x, c):
        body = {"model": x["reg"], "max_tokens": 2, "stream": stream}
        if kind == "completions":
            body["prompt"] = "hello"
        else:
            body["messages"] = [{"role": "user", "content": "hello"}]
        return ("POST", {"completions": "/v1/completions", "chat": "/v1/chat/completions",
                         "messages": "/v1/messages"}[kind], {"json": body})
    return make


def oai_body(stream: bool, kind: str) -> Callable[[dict, Secured], Request]:
    """Tinker's OpenAI-compatible surface, with A's save_weights_for_sampler path as the model."""
    def make(x, c):
        body = {"model": x["ckpt_s"], "max_tokens": 2, "stream": stream}
        if kind == "completions":
            body["prompt"] = "hello"
        else:
            body["messages"] = [{"role": "user", "content": "hello"}]
        return ("POST", f"/oai/api/v1/{'completions' if kind == 'completions' else 'chat/completions'}",
                {"json": body})
    return make


def unload_fresh(x: dict, c: Secured) -> Request:
    """The owner's unload_model, on a fresh model of A's session (A's seeded model serves the other cases)."""
    created = c.ok("POST", "/api/v1/create_model", json={"session_id": x["session"], "model_seq_id": 60 + seq(c),
                                                          "base_model": "tiny", "lora_config": {"rank": 4}})
    c.future(created["request_id"])
    return ("POST", "/api/v1/unload_model", {"json": {"model_id": created["model_id"]}})


def no_sessions(c: Secured, body: dict) -> None:
    assert c.a["session"] not in body["sessions"] and body["cursor"]["total_count"] == len(body["sessions"]), body


def ckpt_parts(path: str) -> str:
    return path.split("/", 3)[3]  # tinker://<model>/<kind>/<name> -> <kind>/<name>


def no_runs(c: Secured, body: dict) -> None:
    """B's own runs only (B has one model of its own), counted as B's."""
    runs = body["training_runs"]
    assert runs and not [r for r in runs if c.a["session"] in r["training_run_id"]], body
    assert body["cursor"]["total_count"] == len(runs), body


def no_checkpoints(c: Secured, body: dict) -> None:
    ckpts = body["checkpoints"]
    assert ckpts and not [k for k in ckpts if c.a["session"] in k["tinker_path"]], body
    assert body["cursor"]["total_count"] == len(ckpts), body


def no_a_models(c: Secured, body: dict) -> None:
    assert not [m for m in body["data"] if m["id"].startswith("acme/")], body


def seq(c: Secured) -> int:
    return c.next_model_seq()


CASES: dict[tuple[str, str], list[Case]] = {
    ("POST", "/api/v1/client/config"): [Case(post("/api/v1/client/config", lambda x, c: {}), "own")],
    ("POST", "/api/v1/client/dynamic_config"): [Case(post("/api/v1/client/dynamic_config", lambda x, c: {}), "own")],
    ("GET", "/api/v1/healthz"): [Case(lambda x, c: ("GET", "/api/v1/healthz", {}), "own")],
    ("POST", "/api/v1/telemetry"): [Case(post("/api/v1/telemetry", lambda x, c: {}), "own")],
    ("POST", "/api/v1/create_session"): [Case(post("/api/v1/create_session", lambda x, c: {"tags": []}), "own")],
    ("GET", "/api/v1/get_server_capabilities"): [
        Case(lambda x, c: ("GET", "/api/v1/get_server_capabilities", {}), "own")],
    ("GET", "/api/v1/sessions"): [Case(lambda x, c: ("GET", "/api/v1/sessions", {}), "listing", check=no_sessions)],
    ("GET", "/api/v1/sessions/{session_id}"): [
        Case(lambda x, c: ("GET", f"/api/v1/sessions/{x['session']}", {}))],
    ("POST", "/api/v1/unload_model"): [
        Case(post("/api/v1/unload_model", lambda x, c: {"model_id": x["model"]}), owner=unload_fresh)],
    ("POST", "/api/v1/session_heartbeat"): [
        Case(post("/api/v1/session_heartbeat", lambda x, c: {"session_id": x["session"]}))],
    ("POST", "/api/v1/sessions/{session_id}/finish"): [
        Case(lambda x, c: ("POST", f"/api/v1/sessions/{x['session']}/finish", {"json": {"reason": "b"}}))],
    ("POST", "/api/v1/create_model"): [
        # An existing model_seq_id (B would get A's create_model request id before the fix) and the next one.
        *(Case(post("/api/v1/create_model", lambda x, c, n=n: {
            "session_id": x["session"], "model_seq_id": n, "base_model": "tiny", "lora_config": {"rank": 4}}),
            owner=post("/api/v1/create_model", lambda x, c: {
                "session_id": x["session"], "model_seq_id": 50 + seq(c), "base_model": "tiny",
                "lora_config": {"rank": 4}})) for n in (0, 1))],
    ("POST", "/api/v1/get_info"): [Case(post("/api/v1/get_info", lambda x, c: {"model_id": x["model"]}))],
    ("POST", "/api/v1/forward_backward"): [Case(fwdbwd, owner=lambda x, c: fwdbwd(x, c, seq(c)))],
    ("POST", "/api/v1/forward"): [Case(post("/api/v1/forward", lambda x, c: {"model_id": x["model"]}), "refused",
                                       400)],
    ("POST", "/api/v1/optim_step"): [Case(post("/api/v1/optim_step", lambda x, c: {
        "model_id": x["model"], "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}),
        owner=post("/api/v1/optim_step", lambda x, c: {
            "model_id": x["model"], "seq_id": seq(c), "adam_params": {"learning_rate": 1e-3}}))],
    ("POST", "/api/v1/save_weights"): [Case(post("/api/v1/save_weights", lambda x, c: {
        "model_id": x["model"], "seq_id": 1, "path": "b-ckpt"}),
        owner=post("/api/v1/save_weights", lambda x, c: {"model_id": x["model"], "seq_id": seq(c), "path": "a2"}))],
    ("POST", "/api/v1/save_weights_for_sampler"): [
        Case(post("/api/v1/save_weights_for_sampler", lambda x, c: {"model_id": x["model"], "seq_id": 1}),
             owner=post("/api/v1/save_weights_for_sampler", lambda x, c: {"model_id": x["model"], "seq_id": seq(c)})),
        Case(post("/api/v1/save_weights_for_sampler", lambda x, c: {
            "model_id": x["model"], "seq_id": 1, "path": "b-s"}),
            owner=post("/api/v1/save_weights_for_sampler", lambda x, c: {
                "model_id": x["model"], "seq_id": seq(c), "path": "a-s2"}))],
    ("POST", "/api/v1/load_weights"): [
        # Into A's model; into a new model squatting A's session (the id the SDK computes itself); from A's
        # checkpoint into a model of B's own session.
        Case(post("/api/v1/load_weights", lambda x, c: {"model_id": x["model"], "seq_id": 1, "path": x["ckpt_w"]}),
             owner=post("/api/v1/load_weights", lambda x, c: {
                 "model_id": x["model"], "seq_id": seq(c), "path": x["ckpt_w"]})),
        Case(post("/api/v1/load_weights", lambda x, c: {
            "session_id": x["session"], "model_seq_id": 7, "path": x["ckpt_w"]}),
            owner=post("/api/v1/load_weights", lambda x, c: {
                "session_id": x["session"], "model_seq_id": 50 + seq(c), "path": x["ckpt_w"]})),
        Case(post("/api/v1/load_weights", lambda x, c: {
            "session_id": x["b_session"], "model_seq_id": 7, "path": x["ckpt_w"]}),
            owner=post("/api/v1/load_weights", lambda x, c: {
                "session_id": x["session"], "model_seq_id": 50 + seq(c), "path": x["ckpt_w"]})),
        # Issue 31 item 1: B's own checkpoint into a new model of A's session (it must not appear in A's
        # namespace, nor in B's).
        Case(post("/api/v1/load_weights", lambda x, c: {
            "session_id": x["session"], "model_seq_id": 8, "path": x["b_ckpt_w"]}),
            owner=post("/api/v1/load_weights", lambda x, c: {
                "session_id": x["session"], "model_seq_id": 50 + seq(c), "path": x["ckpt_w"]}))],
    ("POST", "/api/v1/create_sampling_session"): [
        # Hijacking A's sampling session id (hole 2), and sampling A's weights from B's own session.
        Case(post("/api/v1/create_sampling_session", lambda x, c: {
            "session_id": x["session"], "sampling_session_seq_id": 0, "base_model": "tiny"}),
            owner=post("/api/v1/create_sampling_session", lambda x, c: {
                "session_id": x["session"], "sampling_session_seq_id": 50 + seq(c), "model_path": x["ckpt_s"]})),
        Case(post("/api/v1/create_sampling_session", lambda x, c: {
            "session_id": x["session"], "sampling_session_seq_id": 3, "model_path": x["b_ckpt_s"]}),
            owner=post("/api/v1/create_sampling_session", lambda x, c: {
                "session_id": x["session"], "sampling_session_seq_id": 50 + seq(c), "model_path": x["ckpt_s"]})),
        Case(post("/api/v1/create_sampling_session", lambda x, c: {
            "session_id": x["b_session"], "sampling_session_seq_id": 0, "model_path": x["ckpt_s"]}),
            owner=post("/api/v1/create_sampling_session", lambda x, c: {
                "session_id": x["session"], "sampling_session_seq_id": 50 + seq(c), "model_path": x["ckpt_s"]}))],
    ("GET", "/api/v1/samplers/{sampler_id}"): [
        Case(lambda x, c: ("GET", f"/api/v1/samplers/{x['sampler']}", {}))],
    ("POST", "/api/v1/asample"): [Case(post("/api/v1/asample", lambda x, c: {
        "sampling_session_id": x["sampler"], "seq_id": 0, "num_samples": 1, "prompt": PROMPT,
        "sampling_params": {"max_tokens": 2}}))],
    ("POST", "/api/v1/retrieve_future"): [
        Case(post("/api/v1/retrieve_future", lambda x, c: {"request_id": x["request"]})),
        Case(post("/api/v1/retrieve_future", lambda x, c: {"request_id": x["create_request"]}))],
    ("GET", "/api/v1/training_runs"): [
        Case(lambda x, c: ("GET", "/api/v1/training_runs", {}), "listing", check=no_runs)],
    ("GET", "/api/v1/training_runs/{model_id}"): [
        Case(lambda x, c: ("GET", f"/api/v1/training_runs/{x['model']}", {}))],
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints"): [
        Case(lambda x, c: ("GET", f"/api/v1/training_runs/{x['model']}/checkpoints", {}))],
    ("DELETE", "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}"): [
        Case(lambda x, c: ("DELETE", f"/api/v1/training_runs/{x['model']}/checkpoints/{ckpt_parts(x['ckpt_del'])}",
                           {}))],
    ("PUT", "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl"): [
        Case(lambda x, c: ("PUT", f"/api/v1/training_runs/{x['model']}/checkpoints/{ckpt_parts(x['ckpt_x'])}/ttl",
                           {"json": {"ttl_seconds": None}}))],
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls"): [
        Case(lambda x, c: ("GET", (f"/api/v1/training_runs/{x['model']}/checkpoints/{ckpt_parts(x['ckpt_x'])}"
                                   "/external_weights_urls"), {}))],
    ("POST", "/api/v1/save_weights_external"): [Case(post("/api/v1/save_weights_external", lambda x, c: {
        "model_id": x["model"], "seq_id": 1, "path": "b-x"}),
        owner=post("/api/v1/save_weights_external", lambda x, c: {
            "model_id": x["model"], "seq_id": seq(c), "path": "a-x2"}))],
    # Signed download URLs need no key (the token is the credential, as a presigned S3 URL): B's forgery of A's
    # token (A's payload, B's signature) answers as a never-issued token; A's real URL serves the file.
    ("GET", "/api/v1/external_weights/{token}/{name}"): [
        Case(lambda x, c: ("GET", f"/api/v1/external_weights/{x['url_forged']}/adapter_config.json", {}),
             owner=lambda x, c: ("GET", f"/api/v1/external_weights/{x['url_token']}/adapter_config.json", {}))],
    ("GET", "/api/v1/checkpoints"): [
        Case(lambda x, c: ("GET", "/api/v1/checkpoints", {}), "listing", check=no_checkpoints)],
    ("POST", "/api/v1/weights_info"): [Case(post("/api/v1/weights_info", lambda x, c: {"tinker_path": x["ckpt_w"]}))],
    ("GET", "/v1/models"): [Case(lambda x, c: ("GET", "/v1/models", {}), "listing", check=no_a_models)],
    **{("POST", path): [Case(openai_body(stream, kind), status=403) for stream in (False, True)]
       for kind, path in (("completions", "/v1/completions"), ("chat", "/v1/chat/completions"),
                          ("messages", "/v1/messages"))},
    ("GET", "/oai/api/v1/models"): [Case(lambda x, c: ("GET", "/oai/api/v1/models", {}), "listing",
                                         check=no_a_models)],
    **{("POST", path): [Case(oai_body(stream, kind)) for stream in (False, True)]
       for kind, path in (("completions", "/oai/api/v1/completions"), ("chat", "/oai/api/v1/chat/completions"))},
    # FastAPI's own documentation routes: the same static schema for everyone.
    **{("GET", path): [Case(lambda x, c, path=path: ("GET", path, {}), "own")]
       for path in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")},
    **{("POST", f"/api/v1{path}"): [Case(post(f"/api/v1{path}", lambda x, c: {"model_id": x["model"],
                                                                               "request_id": x["request"]}),
                                         "refused", 400)]
       for path in ("/cancel_future", "/retrieve_futures", "/join_sampling_session", "/create_custom_loss",
                    "/auth/token", "/copy_weights")},
}


def _walk(routes, prefix: str = ""):
    for route in routes:
        included = getattr(route, "original_router", None)  # FastAPI >= 0.165 keeps included routers as branches
        if included is not None:
            yield from _walk(included.routes, prefix + getattr(route.include_context, "prefix", ""))
        elif getattr(route, "methods", None):
            yield from ((method, prefix + route.path) for method in route.methods if method != "HEAD")
        elif getattr(route, "routes", None):  # a mounted sub-application or router
            yield from _walk(route.routes, prefix + getattr(route, "path", ""))


def route_table() -> set[tuple[str, str]]:
    """Every (method, path) the gateway app serves, from its route table."""
    app = create_app(GatewaySettings())
    routes = set(_walk(app.routes))
    # A cross-check of the walk itself: everything the OpenAPI schema lists must be in it.
    schema = {(m.upper(), path) for path, item in app.openapi()["paths"].items() for m in item}
    assert schema <= routes, sorted(schema - routes)
    return routes


def test_every_route_has_a_case():
    """A route added to the gateway without an isolation case (or a case for a route that is gone) fails here."""
    routes = route_table()
    assert routes, "the app has no routes?"
    assert routes - set(CASES) == set(), f"routes without an isolation case: {sorted(routes - set(CASES))}"
    assert set(CASES) - routes == set(), f"cases for routes that do not exist: {sorted(set(CASES) - routes)}"


@pytest.fixture(scope="module")
def b_ids(secured: Secured) -> dict[str, str]:
    """B's own Tinker session, model and checkpoints (B may name its own things; only A's must be out of reach)."""
    c = secured
    session = c.ok("POST", "/api/v1/create_session", B, json={"tags": []})["session_id"]
    created = c.ok("POST", "/api/v1/create_model", B, json={"session_id": session, "model_seq_id": 0,
                                                            "base_model": "tiny", "lora_config": {"rank": 4}})
    c.future(created["request_id"], B)
    paths = [c.future(c.ok("POST", f"/api/v1/{route}", B, json={
        "model_id": created["model_id"], "seq_id": n, "path": name})["request_id"], B)["path"]
        for n, route, name in ((1, "save_weights", "b-own-w"), (2, "save_weights_for_sampler", "b-own-s"))]
    return {"b_session": session, "b_ckpt_w": paths[0], "b_ckpt_s": paths[1]}


def _send(c: Secured, label: str, request: Request):
    method, path, kwargs = request
    reply = c.http(label, method, path, **dict(kwargs))
    sent = path.encode() + json.dumps(kwargs.get("json")).encode() + (kwargs.get("content") or b"")
    return reply, sent


@pytest.mark.parametrize("route", sorted(CASES), ids=lambda r: f"{r[0]} {r[1]}")
def test_tenant_b_cannot_reach_tenant_a_through_the_gateway(secured: Secured, b_ids, route):
    c = secured
    for case in CASES[route]:
        a_ids = {**c.a, **b_ids}
        gone = {**missing_like(c.a), **b_ids}
        before, b_before = c.snapshot(), c.tenant_state(B)
        answers = []
        for ids in (a_ids, gone):
            reply, sent = _send(c, B, case.make(ids, c))
            assert reply.status_code < 500, (route, reply.status_code, reply.text)
            assert not leaked(reply.content, sent, c.secrets, c.addresses), (route, leaked(
                reply.content, sent, c.secrets, c.addresses), reply.text)
            answers.append((reply.status_code, normalize(reply.text, a_ids if ids is a_ids else gone)))
            if case.kind == "listing":
                case.check(c, reply.json())
                break
        assert c.snapshot() == before, f"{route}: B's request changed A's state"
        if case.kind == "scoped":
            assert c.tenant_state(B) == b_before, f"{route}: B's refused request created something in B's namespace"
        if case.kind in ("scoped", "refused"):
            (status, text), (gone_status, gone_text) = answers
            assert status == case.status, (route, status, text)
            assert (status, text) == (gone_status, gone_text), (route, text, gone_text)
        if case.kind == "scoped":
            reply, _ = _send(c, A, (case.owner or case.make)(a_ids, c))
            assert 200 <= reply.status_code < 300, ("the owner's own call fails", route, reply.text)
            accepted = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
            if isinstance(accepted, dict) and accepted.get("request_id") and route[1] != "/api/v1/retrieve_future":
                c.future(accepted["request_id"], may_fail=True)  # settled before the next case's snapshot
        elif case.kind == "refused":
            reply, _ = _send(c, A, case.make(a_ids, c))
            assert reply.status_code == case.status, (route, reply.text)
        elif case.kind == "listing":
            owner = c.http(A, *case.make(a_ids, c)[:2]).text
            assert any(s in owner for s in (a_ids["model"], a_ids["reg"], a_ids["session"])), (
                "the owner sees its own", owner)


def test_streaming_refusals_reach_the_official_clients_as_their_own_errors(secured: Secured):
    """Hole 6: before the fix the stream answered HTTP 200 and carried the error as an event, so openai/anthropic
    raised a generic APIError (or none) instead of PermissionDeniedError; and no message may carry an address."""
    c = secured
    oai = openai.OpenAI(base_url=c.gateway.base_url + "/v1", api_key=c.keys.tokens[B], max_retries=0)
    ant = anthropic.Anthropic(base_url=c.gateway.base_url, api_key=c.keys.tokens[B], max_retries=0)
    for model in (c.a["reg"], missing_like(c.a)["reg"]):
        with pytest.raises(openai.PermissionDeniedError):
            list(oai.completions.create(model=model, prompt="hi", max_tokens=2, stream=True))
        with pytest.raises(openai.PermissionDeniedError):
            list(oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, stream=True))
        with pytest.raises(anthropic.PermissionDeniedError), ant.messages.stream(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}]) as events:
            list(events)
    # B's own missing adapter: NotFoundError, before the stream, and the message names no sampler address.
    with pytest.raises(openai.NotFoundError) as info:
        list(oai.completions.create(model="globex/never-made", prompt="hi", max_tokens=2, stream=True))
    assert not [a for a in c.addresses if a in str(info.value)], str(info.value)
    # The owner streams its adapter.
    mine = openai.OpenAI(base_url=c.gateway.base_url + "/v1", api_key=c.keys.tokens[A], max_retries=0)
    chunks = list(mine.chat.completions.create(model=c.a["reg"], messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, stream=True))
    assert chunks and chunks[0].choices


def test_forged_ids_never_reach_another_tenants_records(secured: Secured, b_ids):
    """Ids crafted to walk out of B's namespace in the store's key layout (`<prefix>t:<tenant>:<kind>:<id>`): a
    separator, another tenant's segment, wildcards. Each is only ever a key inside B's own namespace: 404."""
    c = secured
    sid = c.a["session"]
    for forged in (f"../t:acme:session:{sid}", f":t:acme:session:{sid}", f"t:acme:session:{sid}", "*", f"{sid}*",
                   f"acme/{sid}", f"acme:{sid}"):
        reply = c.http(B, "POST", "/api/v1/session_heartbeat", json={"session_id": forged})
        assert reply.status_code == 404, (forged, reply.text)
        reply = c.http(B, "POST", "/api/v1/retrieve_future", json={"request_id": forged.replace(sid, c.a["request"])})
        assert reply.status_code == 404, (forged, reply.text)
    own = c.ok("GET", "/api/v1/training_runs?limit=1000", B)["cursor"]["total_count"]
    for offset, limit in ((0, 1000), (1, 1), (10**6, 5)):
        body = c.ok("GET", f"/api/v1/training_runs?offset={offset}&limit={limit}", B)
        assert not [r for r in body["training_runs"] if sid in r["training_run_id"]], body
        assert body["cursor"]["total_count"] == own, body
    assert c.ok("GET", "/api/v1/training_runs", A)["cursor"]["total_count"] >= 1


def _recorded_fwdbwd(model_id: str, seq_id: int, tokens: list[int], sampled: list[int], sequence_id: str) -> Request:
    """A stable_reinforce forward_backward whose sampled targets name `sequence_id` (rl_loop's datum layout)."""
    import numpy as np

    body = wire.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="stable_reinforce")
    d = body.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens + sampled[:-1], dtype="<i4").tobytes()
    ob = len(tokens) - 1
    for name, values, dtype in (("target_tokens", tokens[1:] + sampled, wire.DTYPE_INT64),
                                ("advantages", [0.0] * ob + [1.0] * len(sampled), wire.DTYPE_FLOAT32),
                                ("logprobs", [0.0] * (ob + len(sampled)), wire.DTYPE_FLOAT32)):
        d.loss_fn_inputs[name].dense = np.asarray(values, dtype="<i8" if dtype == wire.DTYPE_INT64 else "<f4").tobytes()
        d.loss_fn_inputs[name].dtype = dtype
        d.loss_fn_inputs[name].shape.append(len(values))
    for spans, prompt_offset, prompt_len, sampled_len in ((d.model_input_spans, 0, len(tokens), len(sampled) - 1),
                                                           (d.loss_fn_input_spans, 1, ob, len(sampled))):
        spans.add().prompt_tokens.CopyFrom(wire.PromptProvenanceSpan(sequence_id=sequence_id, offset=prompt_offset,
                                                                     length=prompt_len))
        spans.add().sampled_tokens.CopyFrom(wire.SampledProvenanceSpan(sequence_id=sequence_id, length=sampled_len))
    return ("POST", "/api/v1/forward_backward",
            {"content": body.SerializeToString(), "headers": {"content-type": "application/x-protobuf"}})


def test_recorded_sequences_are_the_tenants_own(secured: Secured, b_ids):
    """A's recorded sample (record_stability_info) named in B's stable_reinforce forward_backward fails exactly as a
    never-issued sequence id does, and leaks nothing of A's; the same datum trains for A."""
    import numpy as np

    c = secured
    tokens = [5, 6, 7]
    accepted = c.ok("POST", "/api/v1/asample", json={
        "sampling_session_id": c.a["sampler"], "num_samples": 1, "prompt": PROMPT, "record_stability_info": True,
        "sampling_params": {"max_tokens": 3, "seed": 2}})
    a_sequence = accepted["sample_sequence_ids"][0]
    sample = wire.SampleResponse.FromString(c.future(accepted["request_id"])["bytes"])
    sampled = np.frombuffer(sample.sequences[0].tokens, dtype="<i4").tolist()
    c.secrets |= {accepted["request_id"], a_sequence}
    # B's own model, in B's own session.
    created = c.ok("POST", "/api/v1/create_model", B, json={"session_id": b_ids["b_session"], "model_seq_id": 1,
                                                            "base_model": "tiny", "lora_config": {"rank": 4}})
    c.future(created["request_id"], B)
    answers = []
    for seq_id, sequence_id in ((1, a_sequence), (2, "0" * 32 + ":0")):
        reply, sent = _send(c, B, _recorded_fwdbwd(created["model_id"], seq_id, tokens, sampled, sequence_id))
        failed = c.future(reply.json()["request_id"], B, may_fail=True)
        assert "has no stability record" in failed["error"], failed
        assert not leaked(json.dumps(failed).encode(), sent, c.secrets - {a_sequence}, c.addresses)
        answers.append(failed["error"].replace(sequence_id, "<id>"))
    assert answers[0] == answers[1], answers
    # The owner trains on it (the same request, on a fresh model of A's session): the case can fail.
    own = c.ok("POST", "/api/v1/create_model", json={"session_id": c.a["session"], "model_seq_id": 90,
                                                      "base_model": "tiny", "lora_config": {"rank": 4}})
    c.future(own["request_id"])
    method, path, kwargs = _recorded_fwdbwd(own["model_id"], 1, tokens, sampled, a_sequence)
    out = c.future(c.ok(method, path, A, **kwargs)["request_id"], A)
    assert "bytes" in out and wire.ForwardBackwardOutput.FromString(out["bytes"]).metrics["recorded_logprobs:sum"] > 0
