"""No answer to a tenant names an internal address of the cluster, on its own failures either: a service that
fails while calling another (the trainer or sampler reading the registry, the gateway calling the sampler) names
the other by role. Before the fix the gateway's errors read `sampler 127.0.0.1:PORT: ...` (issue 21, hole 6) and
the trainer's and sampler's read `registry 127.0.0.1:PORT: ...`; every assertion below failed on those."""

from __future__ import annotations

import grpc

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
