"""Every field of every JSON body the gateway takes, set to values of the wrong type or out of range, over one
kept-alive connection: each answer is a 4xx in the API's own error shape (or a 200 whose future fails with category
`user`), never a 500 and never a future failing with category `unknown`, and the connection survives every one.

The fields come from the routes' shape models (gateway_svc.tinker_bodies), so a field added there is swept too. Before
issue 31's fix, `prompt` as a list and chunk `tokens` as a number were 500s, and max_tokens / seed / top_k out of
range failed their futures with category `unknown`."""

from __future__ import annotations

import itertools

import httpx
import pytest

from gateway_svc import tinker_bodies as shape

JUNK = [None, [], {}, "x", -1, 2**31, 2**70, 1.5, True, [[-1]], {"chunks": "x"}, float("1e300")]


class Conn:
    def __init__(self, base_url: str):
        self.http = httpx.Client(base_url=base_url, timeout=60,
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
        self.port = None

    def send(self, method: str, path: str, **kwargs) -> httpx.Response:
        reply = self.http.request(method, path, **kwargs)
        port = reply.extensions["network_stream"].get_extra_info("client_addr")[1]
        assert self.port in (None, port), ("the gateway dropped the connection", path, kwargs)
        self.port = port
        return reply

    def future(self, request_id: str) -> dict:
        while True:
            reply = self.send("POST", "/api/v1/retrieve_future", json={"request_id": request_id})
            assert reply.status_code == 200, reply.text
            if not reply.headers["content-type"].startswith("application/json"):
                return {}
            body = reply.json()
            if body.get("type") != "try_again":
                return body


@pytest.fixture(scope="module")
def ids(cluster) -> dict:
    c = Conn(cluster.base_url)
    session = c.send("POST", "/api/v1/create_session", json={}).json()["session_id"]
    created = c.send("POST", "/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                            "base_model": "tiny", "lora_config": {"rank": 4}}).json()
    c.future(created["request_id"])
    sampler = c.send("POST", "/api/v1/create_sampling_session", json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}).json()["sampling_session_id"]
    return {"session": session, "model": created["model_id"], "sampler": sampler, "seq": itertools.count(1)}


def bases(x: dict) -> dict[str, tuple[type, dict]]:
    """Per route: its shape and a valid body, into which each field's junk goes."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    return {
        "/api/v1/create_session": (shape.CreateSession, {}),
        "/api/v1/session_heartbeat": (shape.SessionRef, {"session_id": x["session"]}),
        "/api/v1/create_model": (shape.CreateModel, {"session_id": x["session"], "base_model": "tiny",
                                                     "model_seq_id": 900, "lora_config": {"rank": 4, "seed": 1}}),
        "/api/v1/get_info": (shape.ModelRef, {"model_id": x["model"]}),
        "/api/v1/optim_step": (shape.Sequenced, {"model_id": x["model"], "adam_params": {"learning_rate": 1e-3}}),
        "/api/v1/create_sampling_session": (shape.CreateSamplingSession, {
            "session_id": x["session"], "sampling_session_seq_id": 5, "base_model": "tiny"}),
        "/api/v1/asample": (shape.Sample, {"sampling_session_id": x["sampler"], "num_samples": 1, "prompt": prompt,
                                           "sampling_params": {"max_tokens": 1, "seed": 1}}),
        "/api/v1/retrieve_future": (shape.RequestRef, {"request_id": "0" * 32}),
        "/api/v1/weights_info": (shape.WeightsInfo, {"tinker_path": f"tinker://{x['model']}/weights/none"}),
        "/api/v1/unload_model": (shape.ModelRef, {"model_id": "never:train:0"}),
    }


def fields(model: type, prefix: tuple = ()) -> list[tuple]:
    """Every field path of a shape model, nested models included (prompt.chunks, sampling_params.max_tokens, ...)."""
    out = []
    for name, info in model.model_fields.items():
        out.append((*prefix, name))
        inner = info.annotation
        for candidate in getattr(inner, "__args__", (inner,)):
            if isinstance(candidate, type) and issubclass(candidate, shape._Body):
                out += fields(candidate, (*prefix, name))
    return out


def with_value(body: dict, path: tuple, value) -> dict:
    out = dict(body)
    node = out
    for key in path[:-1]:
        child = node.get(key)
        node[key] = dict(child) if isinstance(child, dict) else {}
        node = node[key]
    node[path[-1]] = value
    return out


def test_no_junk_field_reaches_a_500_or_an_unknown_failure(cluster, ids):
    c = Conn(cluster.base_url)
    answers = 0
    for path, (model, base) in bases(ids).items():
        # A sequenced route's content is checked in its future (which spends the seq_id): swept too.
        content = [("adam_params",), ("adam_params", "learning_rate"), ("adam_params", "beta1"),
                   ("optimizer_params",)] if path == "/api/v1/optim_step" else []
        for field in fields(model) + content:
            for value in JUNK:
                body = with_value(base, field, value)
                if path == "/api/v1/optim_step" and field[0] != "seq_id":
                    # Only a request that reaches our model may take its next seq_id (another model id's would be a
                    # gap in ours).
                    body["seq_id"] = next(ids["seq"]) if field[0] != "model_id" else 1
                reply = c.send("POST", path, json=body)
                where = (path, ".".join(field), value, reply.status_code, reply.text[:300])
                assert reply.status_code < 500, where
                payload = reply.json()
                if reply.status_code >= 400:
                    assert payload["category"] == "user" and payload["error"], where
                elif isinstance(payload, dict) and payload.get("request_id") and path != "/api/v1/retrieve_future":
                    done = c.future(payload["request_id"])
                    assert done.get("category") in (None, "user"), (where, done)
                answers += 1
    # The optim_steps above each spent their seq_id (refused or not): the model still trains at the next one.
    done = c.future(c.send("POST", "/api/v1/optim_step", json={
        "model_id": ids["model"], "seq_id": next(ids["seq"]), "adam_params": {"learning_rate": 1e-3}}).json()[
        "request_id"])
    assert done.get("type") == "optim_step", done
    assert answers > 300


OPENAI = [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("/oai/api/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("/oai/api/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_and_anthropic_junk_is_a_4xx(cluster, stream):
    c = Conn(cluster.base_url)
    for path, base in OPENAI:
        for field in ("max_tokens", "seed", "n", "temperature", "top_p", "prompt", "messages", "model", "stop"):
            for value in (-1, 2**40, 2**70, "x", [[1, 2], 3], {"a": 1}, float("1e300")):
                body = {**base, field: value, "stream": stream}
                reply = c.send("POST", path, json=body)
                assert reply.status_code < 500, (path, field, value, reply.status_code, reply.text[:300])
                if reply.status_code == 200 and stream:
                    assert "error" not in reply.text, (path, field, value, reply.text[:300])
