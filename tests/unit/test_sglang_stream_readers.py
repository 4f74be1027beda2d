"""The SGLang engine's stream readers (sampler_svc/engines/sglang_streams.py): helper processes that read SGLang's
token streams and hand the serving loop one frame per decode step. Against bench/synthetic_sglang.py (a real HTTP
server that streams SGLang's chunks on a clock) in a process of its own: the readers deliver exactly what the
in-process path delivers, a consumer that leaves aborts its request on the server, a reader that dies fails only its
own streams (UNAVAILABLE) while new streams go to the others and, when none is left, back to the serving loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from pathlib import Path

import pytest

from loraplane import errors
from loraplane.local.processes import free_port
from sampler_svc.engines.base import GenerationRequest, SamplingOptions
from sampler_svc.engines.sglang_engine import SGLangEngine
from sampler_svc.engines.sglang_streams import ENV, default_readers
from tests.fixtures.http import synthetic_sglang


@pytest.fixture
def synthetic():
    with synthetic_sglang() as url:
        yield url


def running_on(url: str) -> int:
    with urllib.request.urlopen(url + "/synthetic_stats", timeout=5) as reply:
        return json.loads(reply.read())["running"]


def streamed(prompt: tuple[int, ...], max_tokens: int = 16, num_samples: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=prompt, options=SamplingOptions(max_tokens=max_tokens),
                             num_samples=num_samples, stream=True)


async def collect(engine: SGLangEngine, request: GenerationRequest) -> dict[int, tuple]:
    out: dict[int, tuple[list, list, list]] = {}
    async for update in engine.generate(request):
        tokens, logprobs, finishes = out.setdefault(update.sequence_index, ([], [], []))
        tokens += update.tokens
        logprobs += update.logprobs
        if update.finish_reason is not None:
            finishes.append(update.finish_reason)
    return out


async def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_engine(synthetic: str, work_dir: Path, readers: int, readers_from: int = 0):
    """An SGLang engine on the synthetic server with `readers` stream readers, used from `readers_from` open streams."""
    engine = SGLangEngine("tiny", urls=[synthetic], work_dir=work_dir, stream_readers=readers,
                          stream_readers_from=readers_from)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def test_readers_deliver_exactly_what_the_serving_loop_does(synthetic, tmp_path):
    async with running_engine(synthetic, tmp_path / "a", 0) as here, \
            running_engine(synthetic, tmp_path / "b", 2) as readers:
        assert here.generation.readers is None and len(readers.generation.readers.readers) == 2
        # 40 streams at once (one sample each) and a 3-sample stream; the synthetic server's tokens and logprobs
        # depend only on the prompt, so both paths must agree token for token.
        requests = [streamed((20 + i, 7, 9), max_tokens=12 + i % 5) for i in range(40)]
        requests.append(streamed((3, 4, 5), max_tokens=10, num_samples=3))
        expected = await asyncio.gather(*(collect(here, r) for r in requests))
        got = await asyncio.gather(*(collect(readers, r) for r in requests))
        assert got == expected
        for request, result in zip(requests, got, strict=True):
            assert sorted(result) == list(range(request.num_samples))
            for tokens, logprobs, finishes in result.values():
                assert len(tokens) == len(logprobs) == request.options.max_tokens and finishes == ["length"]
        # Both readers took streams (the one with fewer open streams gets the next).
        assert all(r.started > 0 for r in readers.generation.readers.readers)
        assert readers.running_requests == 0 and readers.queue_depth == 0
        assert readers.generation.readers.open_streams == 0


async def test_a_consumer_that_leaves_aborts_its_request_on_the_server(synthetic, tmp_path):
    async with running_engine(synthetic, tmp_path, 1) as engine:
        stream = engine.generate(streamed((1, 2, 3), max_tokens=100_000))
        first = await anext(stream)
        assert first.tokens
        assert running_on(synthetic) == 1 and engine.running_requests == 1
        await stream.aclose()
        assert engine.running_requests == 0 and engine.generation.readers.open_streams == 0
        # The reader dropped the HTTP request: the server stops generating for it.
        await wait_for(lambda: running_on(synthetic) == 0)
        # And the reader goes on serving.
        result = await collect(engine, streamed((1, 2, 3), max_tokens=5))
        assert len(result[0][0]) == 5


async def test_a_reader_that_dies_fails_its_own_streams_and_the_others_carry_on(synthetic, tmp_path):
    async with running_engine(synthetic, tmp_path, 2) as engine:
        first, second = engine.generation.readers.readers
        streams = [engine.generate(streamed((i, 5), max_tokens=100_000)) for i in range(4)]
        for stream in streams:
            await anext(stream)
        assert len(first.slots) == 2 and len(second.slots) == 2
        on_first = [s for s in streams if s.ag_frame.f_locals.get("reader") is first]
        on_second = [s for s in streams if s not in on_first]
        first.process.kill()
        for stream in on_first:
            with pytest.raises(errors.Unavailable, match="stream reader process 0 exited"):
                while True:
                    await anext(stream)
        for stream in on_second:  # still streaming
            assert (await anext(stream)).tokens
            await stream.aclose()
        assert not first.alive and engine.generation.readers.running
        result = await collect(engine, streamed((9, 9), max_tokens=6))  # on the reader left
        assert len(result[0][0]) == 6 and second.started == 3
        second.process.kill()
        await wait_for(lambda: not engine.generation.readers.running)
        result = await collect(engine, streamed((9, 9), max_tokens=6))  # back on the serving loop
        assert len(result[0][0]) == 6
        assert engine.running_requests == 0 and engine.queue_depth == 0
        await wait_for(lambda: running_on(synthetic) == 0)


async def test_an_unreachable_server_is_unavailable_on_both_paths(synthetic, tmp_path):
    for readers in (0, 1):
        async with running_engine(synthetic, tmp_path / str(readers), readers) as engine:
            engine.servers[0].url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            with pytest.raises(errors.Unavailable, match="unreachable"):
                await collect(engine, streamed((1, 2)))
            assert engine.running_requests == 0 and engine.queue_depth == 0


async def test_an_unknown_version_is_refused_before_anything_is_sent(synthetic, tmp_path):
    async with running_engine(synthetic, tmp_path, 1) as engine:
        request = GenerationRequest(prompt_tokens=(1, 2), options=SamplingOptions(max_tokens=3), stream=True,
                                    adapter_key="nobody/x@v1")
        with pytest.raises(errors.NotFound):
            await collect(engine, request)
        assert engine.generation.readers.readers[0].started == 0


async def test_streams_stay_on_the_serving_loop_until_enough_are_open(synthetic, tmp_path):
    async with running_engine(synthetic, tmp_path, 1, 3) as engine:
        reader = engine.generation.readers.readers[0]
        streams = []
        for i in range(5):  # each started before the next is asked for, as the servicer's calls do
            streams.append(engine.generate(streamed((i, 5), max_tokens=100_000)))
            assert (await anext(streams[-1])).tokens
        # The first three on the loop (0, 1, 2 open before each), the next two through the reader.
        assert engine.generation.streams_here == 3 and reader.started == 2 and len(reader.slots) == 2
        for stream in streams:
            await stream.aclose()
        assert engine.generation.streams_here == 0 and engine.generation.readers.open_streams == 0
        assert engine.running_requests == 0
        await wait_for(lambda: running_on(synthetic) == 0)


def test_the_reader_count_comes_from_the_argument_the_environment_or_the_cores(monkeypatch):
    monkeypatch.setenv(ENV, "3")
    assert default_readers() == 3
    assert SGLangEngine("tiny", urls=["http://x"]).generation.stream_readers == 3
    assert SGLangEngine("tiny", urls=["http://x"], stream_readers=0).generation.stream_readers == 0
    monkeypatch.setenv(ENV, "many")
    with pytest.raises(ValueError, match=ENV):
        default_readers()
    monkeypatch.setenv(ENV, "-1")
    with pytest.raises(ValueError, match=">= 0"):
        default_readers()
    monkeypatch.delenv(ENV)
    assert 0 <= default_readers() <= 4
    with pytest.raises(errors.InvalidArgument) as refused:
        SGLangEngine("tiny", urls=["http://x"], stream_readers=-2)
    assert refused.value.field == "stream_readers"


def test_events_split_anywhere_with_either_line_ending_parse_to_the_same_tokens():
    """The parser both paths share: SSE bytes cut at arbitrary points, CRLF or LF, SGLang's cumulative or incremental
    chunks, and `[DONE]` ending it (anything after it ignored)."""
    from sampler_svc.engines.sglang_streams import EventBuffer, new_tokens

    def chunk(i: int, cumulative: bool, last: bool) -> bytes:
        pairs = [[-(k + 1) / 10, 10 + k, None] for k in range(i + 1)] if cumulative else [[-(i + 1) / 10, 10 + i, None]]
        meta = {"output_token_logprobs": pairs, "completion_tokens": i + 1,
                "finish_reason": {"type": "stop"} if last else None}
        return b"data: " + json.dumps({"meta_info": meta}).encode()

    for cumulative in (False, True):
        for newline in (b"\n", b"\r\n"):
            body = b"".join(chunk(i, cumulative, i == 5) + newline * 2 for i in range(6))
            body += b"data: [DONE]" + newline * 2 + b"data: {junk"
            for cut in (1, 7, 50, len(body)):
                events, sent, tokens, logprobs, finishes, done = EventBuffer(), 0, [], [], [], False
                for start in range(0, len(body), cut):
                    chunks, done = events.feed(body[start:start + cut])
                    if chunks:
                        new, values, finish, sent = new_tokens(chunks, sent)
                        tokens += new
                        logprobs += values
                        finishes += [finish] if finish else []
                    if done:
                        break
                assert done and tokens == [10 + k for k in range(6)], (cumulative, newline, cut)
                assert logprobs == [-(k + 1) / 10 for k in range(6)] and finishes == ["stop"]
