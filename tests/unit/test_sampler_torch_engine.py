"""The torch engine on the tiny model, driven directly (no server): continuous batching, batch invariance, stop
conditions, cancellation, queue bounds."""

from __future__ import annotations

import asyncio

import pytest

from loraplane import errors
from sampler_svc.engines.base import FINISH_LENGTH, FINISH_STOP, GenerationRequest, SamplingOptions
from sampler_svc.engines.torch_engine import TorchEngine
from tests.fixtures.sampler import adapter_blob


@pytest.fixture(scope="module")
def engine_loop():
    loop = asyncio.new_event_loop()
    engine = TorchEngine("tiny", max_queue=4)
    loop.run_until_complete(engine.start())
    loop.run_until_complete(engine.load_adapter("u@v1", adapter_blob(41)))
    loop.run_until_complete(engine.load_adapter("w@v1", adapter_blob(42)))
    yield engine, loop
    loop.run_until_complete(engine.stop())
    loop.close()


async def collect(engine, request):
    sequences: dict[int, tuple[list[int], list[float], list[str | None]]] = {}
    async for update in engine.generate(request):
        tokens, logprobs, finish = sequences.setdefault(update.sequence_index, ([], [], [None]))
        tokens.extend(update.tokens)
        logprobs.extend(update.logprobs)
        if update.finish_reason is not None:
            finish[0] = update.finish_reason
    return [sequences[i] for i in sorted(sequences)]


def req(key=None, prompt=(10, 11, 12, 13), n=1, **options):
    options.setdefault("max_tokens", 24)
    return GenerationRequest(prompt_tokens=tuple(prompt), options=SamplingOptions(**options), num_samples=n,
                             adapter_key=key)


def test_a_request_joining_a_running_batch_gets_exactly_its_solo_output(engine_loop):
    engine, loop = engine_loop
    long_running = req("u@v1", max_tokens=60, seed=1)
    joiner = req("w@v1", prompt=(50, 60), max_tokens=20, seed=2, temperature=0.8, top_k=50, top_p=0.9)
    solo = loop.run_until_complete(collect(engine, joiner))

    async def staggered():
        first = asyncio.ensure_future(collect(engine, long_running))
        while engine.decode_steps < steps_before + 10:  # the first request is mid-decode
            await asyncio.sleep(0.001)
        second = await collect(engine, joiner)
        return await first, second

    steps_before = engine.decode_steps
    _, joined = loop.run_until_complete(staggered())
    assert joined == solo


def test_samples_differ_but_are_reproducible(engine_loop):
    engine, loop = engine_loop
    first = loop.run_until_complete(collect(engine, req(n=3, seed=9)))
    again = loop.run_until_complete(collect(engine, req(n=3, seed=9)))
    assert first == again
    assert len({tuple(s[0]) for s in first}) == 3


def test_stop_strings_and_stop_tokens(engine_loop):
    engine, loop = engine_loop
    (greedy,) = loop.run_until_complete(collect(engine, req(temperature=0.0, max_tokens=24)))
    tokens = greedy[0]
    assert greedy[2][0] in (FINISH_LENGTH, FINISH_STOP)
    text_tokenizer = engine.base.tokenizer
    # A stop string made of the text of tokens 3..4 stops right after token 4.
    stop = text_tokenizer.decode(tokens[3:5])
    (stopped,) = loop.run_until_complete(collect(engine, req(temperature=0.0, max_tokens=24, stop_strings=(stop,))))
    assert stopped[2][0] == FINISH_STOP
    assert stopped[0] == tokens[: len(stopped[0])] and len(stopped[0]) <= 5
    assert stop in text_tokenizer.decode(stopped[0])


def test_cancelled_request_leaves_the_batch_and_unknown_adapter_is_not_found(engine_loop):
    engine, loop = engine_loop

    async def cancel_midway():
        stream = engine.generate(req(max_tokens=200, ignore_eos=True))
        received = 0
        async for update in stream:
            received += len(update.tokens)
            if received >= 3:
                break
        await stream.aclose()
        for _ in range(200):
            if engine.running_requests == 0:
                return received
            await asyncio.sleep(0.005)
        raise AssertionError("cancelled rows still running")

    assert loop.run_until_complete(cancel_midway()) == 3

    async def unknown():
        return [u async for u in engine.generate(req("nope@v1"))]

    with pytest.raises(errors.NotFound):
        loop.run_until_complete(unknown())
