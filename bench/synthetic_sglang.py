"""A load generator that speaks the part of SGLang's HTTP API the sampler's SGLang engine uses, with no model.

It answers `/generate` (streaming and not, single and batched, `lora_path` accepted), `/load_lora_adapter`,
`/unload_lora_adapter`, `/health`, `/server_info` and `/v1/models`, and `/synthetic_stats` (its own: requests running
and decode steps so far). Generation is a clock: every `--itl-ms` one
"decode step" appends one token to every running request (a batch, as SGLang's scheduler does), and a request
joins at the next step (its first token is its TTFT). Tokens are pseudo-random ids with made-up logprobs; the chunks
have the shape of SGLang 0.5's `--incremental-streaming-output` chunks with `return_logprob` (each carries only its
new token), so whatever parses them does the same work as against SGLang.

It exists to measure what sits between SGLang and a user (bench/stream_overhead.py) on a machine with no GPU: the
server itself is a plain asyncio protocol (one write per chunk, no framework), so its own cost stays small next to
the paths it feeds. Not a test double: nothing asserts on what it returns.

    python bench/synthetic_sglang.py --port 30000 --itl-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid

_HEAD = {200: b"200 OK", 400: b"400 Bad Request", 404: b"404 Not Found"}


class _Request:
    __slots__ = (
        "batch",
        "conn",
        "ids",
        "logprobs",
        "outputs",
        "produced",
        "prompt_len",
        "remaining",
        "rid",
        "rng",
        "start",
        "stop",
        "stream",
    )

    def __init__(self, conn, stream: bool, max_new: int, prompt_len: int, batch: bool, stop: set[int], seed: int):
        self.conn = conn
        self.stream = stream
        self.remaining = max_new
        self.produced = 0
        self.prompt_len = prompt_len
        self.batch = batch
        self.rid = uuid.uuid4().hex
        self.rng = random.Random(seed)
        self.stop = stop
        self.start = time.perf_counter()
        self.ids: list[int] = []
        self.logprobs: list[float] = []


class Server:
    def __init__(self, itl_s: float, vocab: int, token_ids: list[int] | None = None):
        self.itl_s = itl_s
        self.vocab = vocab
        # The ids sampled from: every id from 10 up, or a given set (e.g. ids that decode to whole characters, so
        # that what reads the stream as text never waits for a character's missing bytes).
        self.token_ids = token_ids or list(range(10, vocab))
        self.running: list[list[_Request]] = []  # a request's samples (one list per HTTP request)
        self.joining: list[list[_Request]] = []
        self.ticker: asyncio.Task | None = None
        self.steps = 0
        self.loras: set[str] = set()  # names loaded (listed by /v1/models as SGLang lists its LoRA adapters)

    def add(self, group: list[_Request]) -> None:
        self.joining.append(group)
        if self.ticker is None or self.ticker.done():
            self.ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + self.itl_s
        while self.running or self.joining:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at += self.itl_s
            self.running.extend(self.joining)
            self.joining = []
            self.steps += 1
            still = []
            for group in self.running:
                if group[0].conn.closed:
                    continue
                done = all(self._step(r) for r in group)
                if done:
                    if not group[0].stream:
                        self._reply_whole(group)
                else:
                    still.append(group)
            self.running = still

    def _step(self, r: _Request) -> bool:
        """One more token for `r`; True when it is finished."""
        if r.remaining <= 0:
            return True
        token = r.rng.choice(self.token_ids)
        while token in r.stop:
            token = r.rng.choice(self.token_ids)
        logprob = -r.rng.random() * 8
        r.remaining -= 1
        r.produced += 1
        finished = r.remaining == 0
        if r.stream:
            finish = f'{{"type":"length","length":{r.produced}}}' if finished else "null"
            body = (f'{{"output_ids":[{token}],"meta_info":{{"id":"{r.rid}","finish_reason":{finish},'
                    f'"prompt_tokens":{r.prompt_len},"weight_version":"default","completion_tokens":{r.produced},'
                    f'"cached_tokens":0,"input_token_logprobs":[],"output_token_logprobs":[[{logprob:.6f},{token},'
                    f'null]],"e2e_latency":{time.perf_counter() - r.start:.4f}}}}}')
            event = b"data: " + body.encode() + b"\n\n"
            if finished:
                event += b"data: [DONE]\n\n"
            r.conn.chunk(event, last=finished)
        else:
            r.ids.append(token)
            r.logprobs.append(logprob)
        return finished

    def _reply_whole(self, group: list[_Request]) -> None:
        outputs = [{"output_ids": r.ids, "meta_info": {
            "id": r.rid, "finish_reason": {"type": "length", "length": r.produced}, "prompt_tokens": r.prompt_len,
            "completion_tokens": r.produced, "cached_tokens": 0, "input_token_logprobs": [],
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.ids, strict=True)],
            "e2e_latency": time.perf_counter() - r.start}} for r in group]
        group[0].conn.respond(200, json.dumps(outputs if group[0].batch else outputs[0]).encode())


class Connection(asyncio.Protocol):
    """HTTP/1.1 with keep-alive: one request at a time per connection (what aiohttp's pool sends)."""

    def __init__(self, server: Server):
        self.server = server
        self.buffer = b""
        self.transport = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, path = head[0].split(" ")[:2]
            self.handle(method, path, body)

    def respond(self, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        if self.closed:
            return
        self.transport.write(b"HTTP/1.1 " + _HEAD.get(status, b"500 Error") + b"\r\nContent-Type: " + content_type
                             + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def chunk(self, data: bytes, last: bool = False) -> None:
        if self.closed:
            return
        self.transport.write(b"%x\r\n%s\r\n%s" % (len(data), data, b"0\r\n\r\n" if last else b""))

    def handle(self, method: str, path: str, body: bytes) -> None:
        if path == "/generate":
            return self.generate(json.loads(body))
        if path in ("/health", "/health_generate"):
            return self.respond(200, b"")
        if path == "/server_info":
            return self.respond(200, json.dumps({"tp_size": 1, "dtype": "bfloat16", "max_loaded_loras": 0}).encode())
        if path == "/synthetic_stats":  # not SGLang's: how many requests are running (tests watch aborts with it)
            running = sum(1 for group in self.server.running + self.server.joining if not group[0].conn.closed)
            return self.respond(200, json.dumps({"running": running, "steps": self.server.steps}).encode())
        if path == "/v1/models":
            data = [{"id": name, "object": "model", "parent": "base"} for name in sorted(self.server.loras)]
            return self.respond(200, json.dumps({"object": "list", "data": data}).encode())
        if path in ("/load_lora_adapter", "/unload_lora_adapter"):
            name = json.loads(body or b"{}").get("lora_name", "")
            if path == "/load_lora_adapter":
                self.server.loras.add(name)
            else:
                self.server.loras.discard(name)
            return self.respond(200, b'{"success":true,"error_message":""}')
        return self.respond(404, b'{"detail":"Not Found"}')

    def generate(self, payload: dict) -> None:
        ids = payload["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        params = payload.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        stream = bool(payload.get("stream"))
        group = [_Request(self, stream, int(p.get("max_new_tokens") or 16), len(prompt), batch,
                          set(p.get("stop_token_ids") or ()), hash((tuple(prompt[:8]), i)))
                 for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))]
        if stream:
            if self.closed:
                return
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
        self.server.add(group)


async def serve(host: str, port: int, itl_ms: float, vocab: int, token_ids: list[int] | None = None) -> None:
    server = Server(itl_ms / 1000, vocab, token_ids)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: Connection(server), host, port, backlog=4096)
    print(f"SYNTHETIC_SGLANG_READY http://{host}:{port}", flush=True)
    async with listener:
        await listener.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--itl-ms", type=float, default=10.0, help="one decode step (a token for every request)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--token-ids", default="", help="comma-separated ids to sample from (default: 10 .. vocab-1)")
    args = parser.parse_args()
    token_ids = [int(t) for t in args.token_ids.split(",") if t]
    asyncio.run(serve(args.host, args.port, args.itl_ms, args.vocab, token_ids or None))


if __name__ == "__main__":
    main()
