"""The contract itself: committed stubs match the protos, the protos follow the style we promise, and every RPC
of every service is answered by its running server with something other than UNIMPLEMENTED."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory

from loraplane.v1 import registry_pb2, sampler_pb2, trainer_pb2

ROOT = Path(__file__).resolve().parents[2]
FILES = {"registry": registry_pb2.DESCRIPTOR, "trainer": trainer_pb2.DESCRIPTOR, "sampler": sampler_pb2.DESCRIPTOR}


def test_committed_stubs_match_a_fresh_generation():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _all_methods():
    for fixture, file_descriptor in FILES.items():
        for service in file_descriptor.services_by_name.values():
            for method in service.methods:
                yield fixture, method


@pytest.mark.parametrize("fixture,method", list(_all_methods()),
                         ids=[f"{m.containing_service.name}.{m.name}" for _, m in _all_methods()])
def test_buf_standard_names(fixture, method):
    service = method.containing_service
    assert service.name.endswith("Service"), service.name
    allowed = {method.name + "Request", service.name + method.name + "Request"}
    assert method.input_type.name in allowed, (method.full_name, method.input_type.name)
    allowed = {method.name + "Response", service.name + method.name + "Response"}
    assert method.output_type.name in allowed, (method.full_name, method.output_type.name)


def test_every_list_rpc_is_paginated():
    for _, method in _all_methods():
        if not method.name.startswith("List"):
            continue
        request_fields = set(method.input_type.fields_by_name)
        response_fields = set(method.output_type.fields_by_name)
        assert {"page_size", "page_token"} <= request_fields, method.full_name
        assert "next_page_token" in response_fields, method.full_name


def test_enum_zero_values_are_unspecified():
    for file_descriptor in FILES.values():
        for enum in list(file_descriptor.enum_types_by_name.values()):
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), (enum.full_name, zero)


def _call(channel: grpc.Channel, method, timeout: float) -> grpc.StatusCode:
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    path = f"/{method.containing_service.full_name}/{method.name}"
    args = {"request_serializer": request_class.SerializeToString,
            "response_deserializer": response_class.FromString}
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(path, **args)(iter([request_class()]), timeout=timeout))
        elif method.client_streaming:
            channel.stream_unary(path, **args)(iter([request_class()]), timeout=timeout)
        elif method.server_streaming:
            list(channel.unary_stream(path, **args)(request_class(), timeout=timeout))
        else:
            channel.unary_unary(path, **args)(request_class(), timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("fixture,method", list(_all_methods()),
                         ids=[f"{m.containing_service.name}.{m.name}" for _, m in _all_methods()])
def test_every_method_is_implemented(request, fixture, method):
    """An empty request to every RPC: any answer (OK, INVALID_ARGUMENT, NOT_FOUND, a streaming deadline...) but
    UNIMPLEMENTED and INTERNAL proves the servicer handles the method and maps its errors."""
    server = request.getfixturevalue(fixture)
    with grpc.insecure_channel(server.address) as channel:
        code = _call(channel, method, timeout=3.0)
    assert code not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), \
        f"{method.full_name} answered {code}"
