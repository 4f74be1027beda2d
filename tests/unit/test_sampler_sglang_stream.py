"""The SGLang engine's one-sample stream (the path of every agent's or gateway stream): read in the consumer's own
task, one update per token when the consumer keeps up, the backlog as one merged update when it stalls, nothing lost
or repeated, and a consumer that leaves early releasing the request. Against the HTTP fake of
test_sampler_sglang_routing (SGLang's two chunk forms, one token per 40 ms)."""

from __future__ import annotations

import asyncio

import pytest

from sampler_svc.engines.base import GenerationRequest, SamplingOptions
from sampler_svc.engines.sglang_engine import SGLangEngine
from tests.unit.test_sampler_sglang_routing import FakeSGLang

TOKENS = 12


@pytest.fixture(params=[(False, 0), (True, 0), (False, 2), (True, 2)],
                ids=["cumulative-chunks", "incremental-chunks", "cumulative-chunks-readers",
                     "incremental-chunks-readers"])
async def engine(request, tmp_path):
    """On the serving loop (0 stream readers) and through 2 reader processes (sglang_streams.py)."""
    incremental, readers = request.param
    fake = FakeSGLang(incremental_streaming=incremental, chunk_interval_s=0.04)
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path, stream_readers=readers, stream_readers_from=0)
    await engine.start()
    yield engine
    await engine.stop()
    fake.http.shutdown()


def streamed(max_tokens: int = TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=(5, 6), options=SamplingOptions(max_tokens=max_tokens), stream=True)


@pytest.mark.parametrize("stall", [False, True], ids=["prompt-reader", "stalled-reader"])
async def test_one_sample_stream_arrives_whole_one_by_one_or_merged(engine, stall):
    tokens, logprobs, finishes, updates = [], [], [], 0
    async for update in engine.generate(streamed()):
        if stall and updates == 0:
            await asyncio.sleep(1.0)  # the remaining 11 chunks (40 ms apart) arrive meanwhile
        updates += 1
        assert update.sequence_index == 0 and not finishes
        tokens += update.tokens
        logprobs += update.logprobs
        if update.finish_reason is not None:
            finishes.append(update.finish_reason)
    assert tokens == [10 + i for i in range(TOKENS)]
    assert logprobs == [-(i + 1) / 10 for i in range(TOKENS)]
    assert finishes == ["length"]
    if stall:
        assert updates <= 3, f"backlog not merged: {updates} updates"
    else:
        assert updates >= TOKENS - 2, f"a prompt reader got only {updates} updates"
    assert engine.running_requests == 0 and engine.queue_depth == 0


async def test_leaving_a_stream_early_releases_the_request(engine):
    stream = engine.generate(streamed(200))
    first = await anext(stream)
    assert first.tokens[:1] == [10]
    assert engine.running_requests == 1 and engine.queue_depth == 1
    await stream.aclose()
    assert engine.running_requests == 0 and engine.queue_depth == 0
