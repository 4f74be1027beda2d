"""No answer to a tenant names an internal address of the cluster, on its own failures either: a service that
fails while calling another (the trainer or sampler reading the registry, the gateway calling the sampler) names
the other by role. Before the fix the gateway's errors read `sampler 127.0.0.1:PORT: ...` (issue 21, hole 6) and
the trainer's and sampler's read `registry 127.0.0.1:PORT: ...`; every assertion below failed on those."""

from __future__ import annotations

import grpc
import httpx

from loraplane.v1 import common_pb2, sampler_pb2, trainer_pb2
from tests.security.conftest import A, Secured


def _details(call) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    raise AssertionError("the call was expected to fail")


def test_service_errors_name_no_internal_address(secured: Secured):
    c = secured
    answers = [
        _details(lambda: c.trainer_stub(A).LoadState(trainer_pb2.LoadStateRequest(
            adapter=c.a["train"], seq_id=c.next_trainer_seq(),
            source=common_pb2.AdapterRef(name=c.a["train"], version=999)))),
        _details(lambda: c.sampler_stub(A).Sample(sampler_pb2.SampleRequest(
            adapter=common_pb2.AdapterRef(name=c.a["reg"], version=999), prompt_tokens=[5], num_samples=1))),
        _details(lambda: c.sampler_stub(A).Sample(sampler_pb2.SampleRequest(
            adapter=common_pb2.AdapterRef(name="acme/never-made"), prompt_tokens=[5], num_samples=1))),
    ]
    for answer in answers:
        assert answer.startswith("NOT_FOUND"), answer
        assert "registry" in answer, answer  # the failing service is still named, by role
        assert not [a for a in c.addresses if a in answer], answer


def test_gateway_errors_name_no_internal_address(secured: Secured):
    c = secured
    for body in ({"model": "acme/never-made", "prompt": "hi", "max_tokens": 2},
                 {"model": "acme/never-made", "prompt": "hi", "max_tokens": 2, "stream": True},
                 {"model": f"{c.a['reg']}@v999", "prompt": "hi", "max_tokens": 2, "stream": True}):
        reply = c.http(A, "POST", "/v1/completions", json=body)
        assert reply.status_code == 404, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith("sampler: "), message
        assert not [a for a in c.addresses if a in reply.text] and "<internal>" not in message, message


def test_an_unreachable_service_is_named_by_role(secured: Secured):
    """grpc's own transport errors name the peer (`ipv4:127.0.0.1:PORT: Failed to connect ...`): a gateway whose
    sampler is down answers 503 naming the sampler by role only (the details go to the gateway's log)."""
    from tests.gateway.conftest import LiveGateway, free_port

    c = secured
    dead = f"127.0.0.1:{free_port()}"
    gateway = LiveGateway(c.gateway_settings.model_copy(update={
        "port": free_port(), "sampler_address": dead, "upstream_retry_s": 0.3}), cluster=c.gateway.cluster).start()
    try:
        for stream in (False, True):
            reply = httpx.post(f"{gateway.base_url}/v1/completions",
                               headers={"Authorization": f"Bearer {c.keys.tokens[A]}"}, timeout=60,
                               json={"model": c.a["reg"], "prompt": "hi", "max_tokens": 2, "stream": stream})
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["message"].startswith("sampler: "), reply.text
            assert dead not in reply.text and not [a for a in c.addresses if a in reply.text], reply.text
    finally:
        gateway.stop()
