"""The SGLang engine's prompt-logprob conversion: what it asks /generate for (logprob_start_len, top_logprobs_num)
and how it turns SGLang's input_token_logprobs / input_top_logprobs into per-position values and dense (len, k)
top-k rows. SGLang itself needs a GPU, so a small HTTP server answers /generate in SGLang 0.5's response format with
values computed from the real `tiny` model; the result must equal the direct computation from its logits."""

from __future__ import annotations

import math

import pytest
import torch

from sampler_svc.engines.base import GenerationRequest, SamplingOptions
from sampler_svc.engines.sglang_engine import SGLangEngine
from tests.fixtures.http import JsonHandler, serve
from tests.fixtures.sampler import tiny_base

PROMPT = (17, 42, 99, 7, 120, 64, 5)


def model_logprobs(tokens) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(tiny_base().model(torch.tensor([list(tokens)])).logits[0].double(), dim=-1)


class ModelBackedSGLang:
    """/generate as SGLang writes it: meta_info.input_token_logprobs holds [logprob, token_id, None] for the prompt
    positions from logprob_start_len on (logprob None at position 0), input_top_logprobs the top
    `top_logprobs_num` [logprob, token_id, None] per such position (None at position 0)."""

    def __init__(self):
        self.bodies: list[dict] = []
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                self.reply(200, {"tp_size": 1, "dtype": "auto", "max_loaded_loras": 8} if self.path == "/server_info"
                           else {})

            def do_POST(self):
                body = self.json_body()
                fake.bodies.append(body)
                prompt = body["input_ids"][0]
                meta = {"output_token_logprobs": [[-1.0, 7, None]], "finish_reason": {"type": "length"}}
                start = body.get("logprob_start_len", -1)
                if start >= 0:
                    lp = model_logprobs(prompt)
                    k = body.get("top_logprobs_num", 0)
                    meta["input_token_logprobs"] = [
                        [None if i == 0 else float(lp[i - 1, prompt[i]]), prompt[i], None]
                        for i in range(start, len(prompt))]
                    if k:
                        rows = []
                        for i in range(start, len(prompt)):
                            if i == 0:
                                rows.append(None)
                                continue
                            top = torch.topk(lp[i - 1], k)
                            rows.append([[float(v), int(t), None] for v, t in zip(top.values, top.indices)])
                        meta["input_top_logprobs"] = rows
                self.reply(200, [{"output_ids": [7], "meta_info": meta}] * len(body["input_ids"]))

        self.http, self.url = serve(Handler)


@pytest.fixture
async def engine(tmp_path):
    fake = ModelBackedSGLang()
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path)
    await engine.start()
    yield engine, fake
    await engine.stop()
    fake.http.shutdown()


async def prompt_update(engine, **fields):
    request = GenerationRequest(prompt_tokens=PROMPT, options=SamplingOptions(max_tokens=1), num_samples=2,
                                **fields)
    updates = [u async for u in engine.generate(request)]
    assert [u.sequence_index for u in updates] == [0, 1]
    return updates[0]


@pytest.mark.parametrize("last_n", [0, 3])
async def test_topk_and_prompt_logprobs_equal_the_models_own(engine, last_n):
    engine, fake = engine
    update = await prompt_update(engine, include_prompt_logprobs=True, topk_prompt_logprobs=4,
                                 prompt_logprobs_last_n=last_n)
    body = fake.bodies[-1]
    first = len(PROMPT) - last_n if last_n else 1
    assert body["top_logprobs_num"] == 4 and body["return_logprob"] is True
    assert body["logprob_start_len"] == (first if last_n else 0)
    lp = model_logprobs(PROMPT)
    assert len(update.prompt_logprobs) == len(PROMPT)
    assert all(math.isnan(v) for v in update.prompt_logprobs[:first])
    for i in range(first, len(PROMPT)):
        assert update.prompt_logprobs[i] == pytest.approx(float(lp[i - 1, PROMPT[i]]), abs=1e-6)
    rows = update.topk_prompt
    assert len(rows.token_ids) == len(PROMPT) and all(len(r) == 4 for r in rows.token_ids)
    for i in range(first):
        assert rows.token_ids[i] == [0] * 4 and rows.logprobs[i] == [-99999.0] * 4
    for i in range(first, len(PROMPT)):
        top = torch.topk(lp[i - 1], 4)
        assert rows.token_ids[i] == top.indices.tolist()
        assert rows.logprobs[i] == pytest.approx(top.values.tolist(), abs=1e-6)


async def test_nothing_is_asked_or_returned_unless_requested(engine):
    engine, fake = engine
    update = await prompt_update(engine)
    assert fake.bodies[-1]["logprob_start_len"] == -1 and "top_logprobs_num" not in fake.bodies[-1]
    assert update.prompt_logprobs is None and update.topk_prompt is None
    # Top-k alone: SGLang is asked for the prompt pass, only the top-k comes back.
    update = await prompt_update(engine, topk_prompt_logprobs=2)
    assert fake.bodies[-1]["logprob_start_len"] == 0 and fake.bodies[-1]["top_logprobs_num"] == 2
    assert update.prompt_logprobs is None and len(update.topk_prompt.token_ids) == len(PROMPT)
