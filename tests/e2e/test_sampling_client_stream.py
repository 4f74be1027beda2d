"""SamplingClient.sample_stream / sample_stream_async against a live sampler (torch engine, `tiny`) following a real
registry: every token once and in order with the logprobs the unary Sample gives, the served version, the SDK's
errors, and a consumer that leaves early cancelling the request on the sampler."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplane.client import InvalidArgumentError, NotFoundError, SamplingClient, SamplingParams
from loraplane.v1 import common_pb2, sampler_pb2
from tests.fixtures.sampler import adapter_blob

PROMPT = [5, 6, 7]


def unary(sampler, name: str = "", version: int = 0, **params) -> sampler_pb2.SampleResponse:
    ref = common_pb2.AdapterRef(name=name)
    if version:
        ref.version = version
    return sampler.stub().Sample(sampler_pb2.SampleRequest(
        adapter=ref, prompt_tokens=PROMPT, num_samples=2,
        sampling_params=common_pb2.SamplingParams(**params)), timeout=60)


def gather(chunks) -> dict:
    out: dict = {}
    for chunk in chunks:
        tokens, logprobs, stops, versions = out.setdefault(chunk.sequence_index, ([], [], [], set()))
        assert not stops, "a chunk after the sequence's last one"
        tokens.extend(chunk.tokens)
        logprobs.extend(chunk.logprobs)
        versions.add(chunk.served_version)
        if chunk.stop_reason is not None:
            stops.append(chunk.stop_reason)
    return out


def assert_same(streamed: dict, reply: sampler_pb2.SampleResponse, version: int) -> None:
    assert sorted(streamed) == [0, 1]
    for index, sequence in enumerate(reply.sequences):
        tokens, logprobs, stops, versions = streamed[index]
        assert tokens == list(sequence.tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, sequence.logprobs, strict=True)) <= 1e-5
        assert stops == [{sampler_pb2.FINISH_REASON_LENGTH: "length",
                          sampler_pb2.FINISH_REASON_STOP: "stop"}[sequence.finish_reason]]
        assert versions == {version}


async def test_streamed_tokens_are_the_unary_samples_sync_and_async(sampler):
    sampler.create_adapter("t/streamed")
    sampler.publish("t/streamed", adapter_blob(3))
    reply_base = unary(sampler, max_tokens=12, seed=4)
    reply_adapter = unary(sampler, "t/streamed", 1, max_tokens=12, seed=4)
    assert [list(s.tokens) for s in reply_base.sequences] != [list(s.tokens) for s in reply_adapter.sequences]
    params = SamplingParams(max_tokens=12, seed=4)

    base = SamplingClient(sampler.address)
    assert_same(gather(base.sample_stream(PROMPT, num_samples=2, sampling_params=params)), reply_base, 0)
    adapter = SamplingClient(sampler.address, "t/streamed", version=1)
    assert_same(gather([c async for c in adapter.sample_stream_async(PROMPT, num_samples=2, sampling_params=params)]),
                reply_adapter, 1)


async def test_stream_errors_are_the_sdks_and_name_the_field(sampler):
    with pytest.raises(NotFoundError):
        async for _ in SamplingClient(sampler.address, "t/never-published").sample_stream_async(PROMPT):
            pass
    with pytest.raises(InvalidArgumentError) as caught:
        list(SamplingClient(sampler.address).sample_stream([1] * 600))
    assert caught.value.field == "prompt_tokens"


async def test_leaving_a_stream_early_cancels_it_on_the_sampler(sampler):
    service = sampler.running.service
    client = SamplingClient(sampler.address)
    received = 0
    stream = client.sample_stream_async(PROMPT, sampling_params=SamplingParams(max_tokens=400, seed=1))
    async for chunk in stream:
        received += len(chunk.tokens)
        assert service.in_flight == 1  # the request is being served while we read
        break
    await stream.aclose()
    deadline = time.monotonic() + 10
    while service.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert service.in_flight == 0 and 0 < received < 400


async def test_async_calls_run_on_the_callers_loop_and_leave_the_client_loop_out_of_grpc(sampler):
    """sample_async and sample_stream_async use a channel of the caller's loop: the client's I/O loop never calls
    the sampler, so grpc.aio does not hand it the completions of the caller's streams (a thread hop per message)."""
    from loraplane.client._runtime import runtime

    sampler.create_adapter("t/loop")
    sampler.publish("t/loop", adapter_blob(5))
    client = SamplingClient(sampler.address, "t/loop", version=1)
    params = SamplingParams(max_tokens=8, seed=2)
    reply = await client.sample_async(PROMPT, num_samples=2, sampling_params=params)
    streamed = gather([c async for c in client.sample_stream_async(PROMPT, num_samples=2, sampling_params=params)])
    expected = unary(sampler, "t/loop", 1, max_tokens=8, seed=2)
    assert [s.tokens for s in reply.sequences] == [list(s.tokens) for s in expected.sequences]
    assert_same(streamed, expected, 1)
    assert reply.served_version == 1
    on_client_loop = [key for key in runtime()._channels if key[0] == str(sampler.address)]
    assert on_client_loop == []
    # The synchronous form still runs on the client's loop (and gives the same samples).
    assert [s.tokens for s in client.sample(PROMPT, num_samples=2, sampling_params=params).result(30).sequences] == \
        [s.tokens for s in reply.sequences]
    assert [key for key in runtime()._channels if key[0] == str(sampler.address)] != []
