"""SGLang engine routing and authority rules against FAKE SGLang HTTP servers.

This is a fake on purpose and only an addition: it checks what the engine sends (which names, to which server),
which a real server cannot report. The real SGLang 0.5.17 behaviour is covered by tests/gpu/test_sglang_engine.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loraplane import errors
from sampler_svc.engines.base import GenerationRequest, SamplingOptions
from sampler_svc.engines.sglang_engine import SGLangEngine
from tests.fixtures.sampler import adapter_blob


class FakeSGLang:
    """Records every call; /generate answers one fixed token per sample with logprob -1."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.loaded: set[str] = set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply(200, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append((self.path, body))
                if self.path == "/load_lora_adapter":
                    fake.loaded.add(body["lora_name"])
                    return self._reply(200, {"success": True})
                if self.path == "/unload_lora_adapter":
                    fake.loaded.discard(body["lora_name"])
                    return self._reply(200, {"success": True})
                count = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 1
                out = [{"output_ids": [7], "meta_info": {"output_token_logprobs": [[-1.0, 7, None]],
                                                         "finish_reason": {"type": "length"}}}] * count
                return self._reply(200, out)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def names_sent(self) -> list:
        return [body.get("lora_path") for path, body in self.calls if path == "/generate"]


@pytest.fixture
def fakes():
    servers = [FakeSGLang(), FakeSGLang()]
    yield servers
    for server in servers:
        server.http.shutdown()


async def collect(engine, key):
    request = GenerationRequest(prompt_tokens=(5, 6), options=SamplingOptions(max_tokens=1), adapter_key=key)
    return [u async for u in engine.generate(request)]


async def test_routes_to_the_owning_server_and_never_sends_unloaded_names(fakes, tmp_path):
    engine = SGLangEngine("tiny", urls=[f.url for f in fakes], work_dir=tmp_path)
    await engine.start()
    await engine.load_adapter("a@v1", adapter_blob(1))
    await engine.load_adapter("b@v1", adapter_blob(2))
    owner = {key: next(f for f in fakes if key in f.loaded) for key in ("a@v1", "b@v1")}
    assert owner["a@v1"] is not owner["b@v1"]  # spread over the servers
    updates = await collect(engine, "a@v1")
    assert updates[0].tokens == [7] and owner["a@v1"].names_sent() == [["a@v1"]]
    await collect(engine, "b@v1")
    assert owner["b@v1"].names_sent() == [["b@v1"]]

    await engine.unload_adapter("a@v1")
    assert "a@v1" not in owner["a@v1"].loaded
    sent_before = sum(len(f.calls) for f in fakes)
    for key in ("a@v1", "never@v9"):
        with pytest.raises(errors.NotFound):
            await collect(engine, key)
    assert sum(len(f.calls) for f in fakes) == sent_before  # refused before any HTTP call
    await engine.stop()
