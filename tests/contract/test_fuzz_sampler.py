"""Fuzz: malformed requests for every SamplerService RPC and field, thrown at a live sampler (torch engine, tiny
model) following a live registry. Each must get a clear caller-error status naming the field and change nothing:
the loaded versions and their pins, and the registry."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.v1 import common_pb2, sampler_pb2
from tests.contract.fuzzing import (
    FUZZ_SETTINGS,
    NON_FINITE,
    assert_clear_rejection,
    bad_aliases,
    bad_names,
    hostile_text,
    registry_view,
)
from tests.fixtures.sampler import adapter_blob

INVALID = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
VOCAB = 261
CONTEXT = 512

bad_token = st.one_of(st.integers(-(2**31), -1), st.integers(VOCAB, 2**31 - 1))


@pytest.fixture
def subject(sampler, registry):
    registry_stub = registry.stub()
    sampler.registry_view = lambda: registry_view(registry_stub)
    sampler.fuzz_stub = sampler.stub()
    sampler.create_adapter("fz")
    sampler.publish("fz", adapter_blob(5), aliases=["prod"])
    sampler.wait_loaded({"fz@v1"})
    yield sampler
    # Still serving after the barrage.
    reply = sampler.stub().Sample(sampler_pb2.SampleRequest(
        adapter=common_pb2.AdapterRef(name="fz"), prompt_tokens=[1, 20, 21],
        sampling_params=common_pb2.SamplingParams(max_tokens=3, temperature=0.0)), timeout=30)
    assert reply.served_version == 1 and len(reply.sequences[0].tokens) == 3


def state(live) -> tuple:
    status = live.fuzz_stub.GetStatus(sampler_pb2.GetStatusRequest(), timeout=30)
    loaded = sorted((a.adapter, a.version, a.sha256, a.pinned) for a in status.loaded)
    return loaded, live.registry_view()


@st.composite
def bad_ref(draw) -> tuple[common_pb2.AdapterRef, str]:
    choice = draw(st.sampled_from(["name", "alias", "version_without_name", "alias_without_name"]))
    if choice == "name":
        return common_pb2.AdapterRef(name=draw(bad_names().filter(bool))), "adapter.name"
    if choice == "alias":
        return common_pb2.AdapterRef(name="fz", alias=draw(bad_aliases())), "adapter.alias"
    if choice == "version_without_name":
        return common_pb2.AdapterRef(version=draw(st.integers(1, 2**64 - 1))), "adapter.name"
    return common_pb2.AdapterRef(alias="prod"), "adapter.name"


@st.composite
def bad_sampling(draw) -> tuple[common_pb2.SamplingParams, str]:
    field = draw(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                                  "stop_strings"]))
    params = common_pb2.SamplingParams(max_tokens=2)
    if field == "max_tokens":
        params.max_tokens = draw(st.integers(CONTEXT, 2**32 - 1))
    elif field == "temperature":
        params.temperature = draw(st.one_of(NON_FINITE, st.floats(max_value=-0.5, allow_nan=False,
                                                                  allow_infinity=False, width=32),
                                            st.floats(min_value=101.0, allow_nan=False, allow_infinity=False,
                                                      width=32)))
    elif field == "top_p":
        params.top_p = draw(st.one_of(NON_FINITE, st.floats(max_value=0.0, allow_nan=False, allow_infinity=False,
                                                            width=32),
                                      st.floats(min_value=1.5, allow_nan=False, allow_infinity=False, width=32)))
    elif field == "top_k":
        params.top_k = draw(st.integers(-(2**31), -2))
    elif field == "stop_token_ids":
        params.stop_token_ids[:] = draw(st.one_of(st.lists(bad_token, min_size=1, max_size=3),
                                                  st.just(list(range(65)))))
    else:
        params.stop_strings[:] = draw(st.one_of(st.just([""]), st.just(["x" * 257]),
                                                st.just([f"s{i}" for i in range(17)])))
    return params, f"sampling_params.{field}"


@st.composite
def bad_generation(draw):
    """(rpc, request, field) for Sample, SampleStream and ComputeLogprobs."""
    rpc = draw(st.sampled_from(["Sample", "SampleStream", "ComputeLogprobs"]))
    tokens_field = "tokens" if rpc == "ComputeLogprobs" else "prompt_tokens"
    choice = draw(st.sampled_from(["ref", "tokens", "empty", "too_long"]
                                  + ([] if rpc == "ComputeLogprobs" else ["num_samples", "sampling"] * 2)))
    ref, tokens, field = common_pb2.AdapterRef(name="fz"), [1, 20, 21], None
    num_samples, params = 1, common_pb2.SamplingParams(max_tokens=2)
    if choice == "ref":
        ref, field = draw(bad_ref())
    elif choice == "tokens":
        tokens = list(tokens)
        tokens[draw(st.integers(0, 2))] = draw(bad_token)
        field = tokens_field
    elif choice == "empty":
        tokens, field = [], tokens_field
    elif choice == "too_long":
        # ComputeLogprobs takes a whole context (CONTEXT tokens); Sample must leave room for one more.
        tokens, field = [5] * draw(st.integers(CONTEXT + 1, CONTEXT + 50)), tokens_field
    elif choice == "num_samples":
        num_samples, field = draw(st.integers(17, 2**32 - 1)), "num_samples"
    else:
        params, field = draw(bad_sampling())
    if rpc == "ComputeLogprobs":
        return rpc, sampler_pb2.ComputeLogprobsRequest(adapter=ref, tokens=tokens), field
    request_type = sampler_pb2.SampleRequest if rpc == "Sample" else sampler_pb2.SampleStreamRequest
    return rpc, request_type(adapter=ref, prompt_tokens=tokens, num_samples=num_samples, sampling_params=params), \
        field


@st.composite
def bad_management(draw):
    rpc = draw(st.sampled_from(["ListLoadedAdapters", "LoadAdapter", "UnloadAdapter"]))
    if rpc == "ListLoadedAdapters":
        choice = draw(st.sampled_from(["adapter", "page_size", "page_token"]))
        if choice == "adapter":
            return rpc, sampler_pb2.ListLoadedAdaptersRequest(adapter=draw(bad_names().filter(bool))), "adapter"
        if choice == "page_size":
            return rpc, sampler_pb2.ListLoadedAdaptersRequest(page_size=draw(st.integers(-(2**31), -1))), "page_size"
        return rpc, sampler_pb2.ListLoadedAdaptersRequest(page_token=draw(hostile_text(1))), "page_token"
    if rpc == "LoadAdapter":
        if draw(st.booleans()):
            return rpc, sampler_pb2.LoadAdapterRequest(adapter=common_pb2.AdapterRef(), pin=True), "adapter.name"
        ref, field = draw(bad_ref())
        return rpc, sampler_pb2.LoadAdapterRequest(adapter=ref, pin=draw(st.booleans())), field
    return rpc, sampler_pb2.UnloadAdapterRequest(adapter=draw(bad_names()), version=draw(st.integers(0, 5))), \
        "adapter"


def _fails(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_sampler_rpcs(subject, data):
    before = state(subject)
    stub = subject.fuzz_stub
    if data.draw(st.booleans()):
        rpc, request, field = data.draw(bad_generation())
    else:
        rpc, request, field = data.draw(bad_management())
    method = getattr(stub, rpc)
    if rpc == "SampleStream":
        exc = _fails(lambda: list(method(request, timeout=30)))
    else:
        exc = _fails(lambda: method(request, timeout=30))
    assert_clear_rejection(exc, field, INVALID, what=rpc)
    assert state(subject) == before
