"""SGLangEngine.compute_logprobs (the sampler's ComputeLogprobs on SGLang) against a FAKE SGLang HTTP server that
answers /generate with input_token_logprobs as SGLang 0.5.17 does for logprob_start_len 0 (one entry per input
token, None at position 0). A fake on purpose and only an addition: it pins the engine's reading of that reply
(the real server is exercised by tests/gpu/test_sglang_moe.py, whose ComputeLogprobs calls go through it)."""

from __future__ import annotations

import math

import pytest

from sampler_svc.engines.sglang_engine import SGLangEngine
from tests.fixtures.http import JsonHandler, serve


@pytest.fixture
def scoring_server():
    calls: list[dict] = []

    class Handler(JsonHandler):
        def do_GET(self):
            self.reply(200, {"data": []} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = self.json_body()
            calls.append(body)
            ids = body["input_ids"]
            pairs = [[None if i == 0 else -0.5 * i, t, None] for i, t in enumerate(ids)]
            self.reply(200, {"output_ids": [7], "meta_info": {"input_token_logprobs": pairs,
                                                               "output_token_logprobs": [[-1.0, 7, None]]}})

    http, url = serve(Handler)
    yield url, calls
    http.shutdown()


async def test_compute_logprobs_scores_every_position_after_the_first(scoring_server, tmp_path):
    url, calls = scoring_server
    engine = SGLangEngine("tiny", urls=[url], work_dir=tmp_path)
    await engine.start()
    try:
        values = await engine.compute_logprobs([11, 12, 13, 14], None)
    finally:
        await engine.stop()
    assert math.isnan(values[0]) and values[1:] == [-0.5, -1.0, -1.5]
    assert calls[-1]["logprob_start_len"] == 0 and calls[-1]["input_ids"] == [11, 12, 13, 14]
