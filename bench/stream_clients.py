"""The clients the sampler benchmarks compare, each in a process of its own (a worker).

  raw     aiohttp straight to the SGLang server's /generate (what a user would run instead of loraplane);
  stubs   bare grpc.aio SamplerService stubs on one channel (one HTTP/2 connection) to sampler_svc;
  client  loraplane.client's SamplingClient (`sample_stream` / `sample_async`) to the same sampler_svc;
  openai  aiohttp straight to the HTTP gateway's OpenAI `/v1/completions` (stream: true), which calls the same
          sampler_svc: what an agent speaking OpenAI's protocol pays for the gateway (not in PATHS: the driver
          starts a gateway only when asked for this path).

Each runs in its own process so that no path pays for another's threads and event loops (grpc.aio wakes every
event loop of a process that has used it on each completion: a SamplingClient measured beside bare stubs in one
process pays for both). The driver (bench/stream_overhead.py, bench/sampler_vs_sglang.py) starts one worker per
path and sends it one JSON command per line on stdin; the worker answers one JSON line on stdout:

  {"op": "stream" | "unary", "concurrency": C, "requests": [[adapter index or -1, [prompt ids...]], ...],
   "max_tokens": N, "num_samples": n (unary only, default 1)}

"stream" opens every request as a stream (C at a time) and reports TTFT, inter-token latency (the gaps between a
stream's consecutive messages: an SSE chunk for raw, a SampleStreamResponse for the others; a message that carries
several tokens makes one gap, so a path that falls behind and delivers tokens in batches shows longer gaps, not
shorter), time per output token (TPOT: a stream's first-to-last time over its tokens - 1), tokens per message and
tokens/s; "unary" sends non-streaming requests and reports tokens/s. With "raw_records": true the worker answers its
per-request results, its start and end (perf_counter) and its CPU seconds instead of a summary: what Worker(...,
processes=N) merges when it spreads one command over N worker processes.

    python bench/stream_clients.py --path stubs --sampler 127.0.0.1:50051 --url http://127.0.0.1:30000
    python bench/stream_clients.py --path openai --gateway http://127.0.0.1:8900
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import percentile  # after the path set-up: this file also runs as a script

PATHS = ("raw", "stubs", "client")
# Diagnostic, not in the default set: bare stubs in a process whose SDK runtime loop (a thread) has also made a gRPC
# call, as in any process that uses the SDK's synchronous API or sample_async beside its own async streams.
DIAGNOSTIC_PATHS = ("stubs_rt",)
# Through the HTTP gateway (gateway_svc): not in PATHS, since a driver measuring it starts a gateway (and the trainer
# it asks for the base model's tokenizer) beside the sampler: bench/stream_overhead.py does by default.
GATEWAY_PATHS = ("openai",)
# The adapters' names are PREFIX0 .. PREFIX7 (--adapter-prefix: a second sampler beside the first follows its own set,
# so neither unloads the other's names on the SGLang server they share).
PREFIX = "bench/a"


def summarize(per_request: list[tuple[float, list[tuple[float, int]]]], wall_s: float) -> dict:
    """per_request: (start, [(arrival, tokens in that message), ...])."""
    ttft, gaps, tpot, tokens, messages = [], [], [], 0, 0
    for start, arrivals in per_request:
        arrivals = [(t, k) for t, k in arrivals if k]
        if not arrivals:
            continue
        ttft.append((arrivals[0][0] - start) * 1000)
        gaps.extend((now - before) * 1000 for (before, _), (now, _) in itertools.pairwise(arrivals))
        count = sum(k for _, k in arrivals)
        tokens += count
        messages += len(arrivals)
        if count > 1:
            tpot.append((arrivals[-1][0] - arrivals[0][0]) * 1000 / (count - 1))
    return {"requests": len(per_request), "tokens": tokens, "messages": messages, "wall_s": wall_s,
            "tok_s": tokens / wall_s if wall_s else 0.0,
            **{f"ttft_p{q}_ms": percentile(ttft, q) for q in (50, 99)},
            **{f"itl_p{q}_ms": percentile(gaps, q) for q in (50, 99)},
            **{f"tpot_p{q}_ms": percentile(tpot, q) for q in (50, 99)}}


def adapter_key(index: int) -> str | None:
    return None if index < 0 else f"{PREFIX}{index}@v1"


class Raw:
    def __init__(self, url: str):
        import aiohttp

        # Several servers (comma-separated): adapter i goes to urls[i % len(urls)], the base model to urls[0], as
        # the two-server sampler places the versions (odd adapters on the second server): raw SGLang spread over
        # both servers, the engine's own ceiling beside the sampler that spreads them.
        self.urls = url.split(",")
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4))

    def _payload(self, adapter: int, prompt: list[int], max_tokens: int, stream: bool, n: int = 1) -> dict:
        params = {"max_new_tokens": max_tokens, "temperature": 1.0}
        if n > 1:  # a batch, as SGLang takes several samples of one prompt
            return {"input_ids": [prompt] * n, "sampling_params": [params] * n, "return_logprob": True,
                    "lora_path": [adapter_key(adapter)] * n}
        return {"input_ids": prompt, "sampling_params": params, "return_logprob": True,
                "lora_path": adapter_key(adapter), "stream": stream}

    def _url(self, adapter: int) -> str:
        return self.urls[adapter % len(self.urls)] if adapter >= 0 else self.urls[0]

    async def stream(self, adapter: int, prompt: list[int], max_tokens: int):
        arrivals = []
        start = time.perf_counter()
        async with self.session.post(f"{self._url(adapter)}/generate", json=self._payload(adapter, prompt, max_tokens, True)
                                     ) as reply:
            async for line in reply.content:
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)  # what a user of SGLang's stream does with each chunk
                    arrivals.append((time.perf_counter(), len(chunk["meta_info"]["output_token_logprobs"])))
        return start, arrivals

    async def unary(self, adapter: int, prompt: list[int], max_tokens: int, n: int = 1) -> int:
        async with self.session.post(f"{self._url(adapter)}/generate",
                                     json=self._payload(adapter, prompt, max_tokens, False, n)) as reply:
            body = await reply.json()
        return sum(len(o["meta_info"]["output_token_logprobs"]) for o in (body if isinstance(body, list) else [body]))

    async def close(self) -> None:
        await self.session.close()


def _request(adapter: int, prompt: list[int], max_tokens: int):
    from loraplane.v1 import common_pb2, sampler_pb2

    ref = common_pb2.AdapterRef(name="" if adapter < 0 else f"{PREFIX}{adapter}")
    if adapter >= 0:
        ref.version = 1
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    return ref, params, sampler_pb2


class Stubs:
    def __init__(self, address: str):
        import grpc

        from loraplane.rpc import channel_options
        from loraplane.v1 import sampler_pb2_grpc

        self.channel = grpc.aio.insecure_channel(address, options=channel_options())
        self.stub = sampler_pb2_grpc.SamplerServiceStub(self.channel)

    async def stream(self, adapter: int, prompt: list[int], max_tokens: int):
        ref, params, pb = _request(adapter, prompt, max_tokens)
        arrivals = []
        start = time.perf_counter()
        async for message in self.stub.SampleStream(pb.SampleStreamRequest(adapter=ref, prompt_tokens=prompt,
                                                                            sampling_params=params), timeout=600):
            arrivals.append((time.perf_counter(), len(message.tokens)))
        return start, arrivals

    async def unary(self, adapter: int, prompt: list[int], max_tokens: int, n: int = 1) -> int:
        ref, params, pb = _request(adapter, prompt, max_tokens)
        reply = await self.stub.Sample(pb.SampleRequest(adapter=ref, prompt_tokens=prompt, num_samples=n,
                                                        sampling_params=params), timeout=600)
        return sum(len(s.tokens) for s in reply.sequences)

    async def close(self) -> None:
        await self.channel.close()


class StubsBesideRuntime(Stubs):
    def __init__(self, address: str):
        super().__init__(address)
        from loraplane.client._runtime import runtime
        from loraplane.v1 import sampler_pb2, sampler_pb2_grpc

        async def touch():
            stub = sampler_pb2_grpc.SamplerServiceStub(runtime().channel(address))
            await stub.GetStatus(sampler_pb2.GetStatusRequest(), timeout=30)

        runtime().run(touch())


class OpenAI:
    """The gateway's OpenAI completions endpoint by hand (aiohttp, no SDK: the server is what is measured). Every
    request asks for `"logprobs": 1`, as the other paths return logprobs too (raw sets return_logprob; the sampler
    always sends them): a stream chunk's token count is len(choices[0].logprobs.tokens), exact even when the gateway
    holds a partial UTF-8 character back and sends two tokens in one chunk (a streamed completion carries no
    `usage`); a non-streaming reply's is usage.completion_tokens."""

    def __init__(self, gateway: str):
        import aiohttp

        self.url = gateway.rstrip("/")
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4))
        self.base_model = ""

    async def _model(self, adapter: int) -> str:
        if adapter >= 0:
            return f"{PREFIX}{adapter}@v1"  # version 1, as the other paths ask for
        if not self.base_model:  # the gateway lists the base model's own name first
            async with self.session.get(f"{self.url}/v1/models") as reply:
                reply.raise_for_status()
                self.base_model = (await reply.json())["data"][0]["id"]
        return self.base_model

    async def _payload(self, adapter: int, prompt: list[int], max_tokens: int, stream: bool, n: int = 1) -> dict:
        return {"model": await self._model(adapter), "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                "n": n, "logprobs": 1, "stream": stream}

    async def _refused(self, reply) -> None:
        if reply.status != 200:
            raise RuntimeError(f"gateway answered {reply.status}: {(await reply.text())[:300]}")

    async def stream(self, adapter: int, prompt: list[int], max_tokens: int):
        payload = await self._payload(adapter, prompt, max_tokens, True)
        arrivals = []
        start = time.perf_counter()
        async with self.session.post(f"{self.url}/v1/completions", json=payload) as reply:
            await self._refused(reply)
            async for line in reply.content:
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # an error after the headers went out comes in-stream
                        raise RuntimeError(f"gateway stream error: {chunk['error']}")
                    logprobs = chunk["choices"][0]["logprobs"]
                    arrivals.append((time.perf_counter(), len(logprobs["tokens"]) if logprobs else 0))
        return start, arrivals

    async def unary(self, adapter: int, prompt: list[int], max_tokens: int, n: int = 1) -> int:
        payload = await self._payload(adapter, prompt, max_tokens, False, n)
        async with self.session.post(f"{self.url}/v1/completions", json=payload) as reply:
            await self._refused(reply)
            body = await reply.json()
        return body["usage"]["completion_tokens"]

    async def close(self) -> None:
        await self.session.close()


class Client:
    def __init__(self, address: str):
        from loraplane.client import SamplingClient

        self.address = address
        self.clients: dict[int, SamplingClient] = {}

    def _client(self, adapter: int):
        from loraplane.client import SamplingClient

        client = self.clients.get(adapter)
        if client is None:
            client = self.clients[adapter] = (SamplingClient(self.address) if adapter < 0 else
                                              SamplingClient(self.address, f"{PREFIX}{adapter}", version=1))
        return client

    async def stream(self, adapter: int, prompt: list[int], max_tokens: int):
        from loraplane.client import SamplingParams

        arrivals = []
        start = time.perf_counter()
        async for chunk in self._client(adapter).sample_stream_async(
                prompt, sampling_params=SamplingParams(max_tokens=max_tokens, temperature=1.0)):
            arrivals.append((time.perf_counter(), len(chunk.tokens)))
        return start, arrivals

    async def unary(self, adapter: int, prompt: list[int], max_tokens: int, n: int = 1) -> int:
        from loraplane.client import SamplingParams

        reply = await self._client(adapter).sample_async(
            prompt, num_samples=n, sampling_params=SamplingParams(max_tokens=max_tokens, temperature=1.0))
        return sum(len(s.tokens) for s in reply.sequences)

    async def close(self) -> None:
        pass


async def run(worker, command: dict) -> dict:
    gate = asyncio.Semaphore(command["concurrency"])
    max_tokens = command["max_tokens"]
    n = command.get("num_samples", 1)

    async def one(adapter: int, prompt: list[int]):
        async with gate:
            if command["op"] == "stream":
                return await worker.stream(adapter, prompt, max_tokens)
            return await worker.unary(adapter, prompt, max_tokens, n)

    start, cpu = time.perf_counter(), _cpu()
    results = await asyncio.gather(*(one(a, p) for a, p in command["requests"]))
    end, cpu = time.perf_counter(), _cpu() - cpu
    if command.get("raw_records"):
        # For a Worker that spread one command over several processes: it summarizes the union itself, since
        # percentiles of parts do not combine. Times are perf_counter, like the arrivals (see Worker.run).
        return {"results": results, "start": start, "end": end, "cpu_s": cpu}
    return _summary(command["op"], results, end - start, cpu)


def _summary(op: str, results: list, wall: float, cpu: float) -> dict:
    """results: run's per-request results (stream: summarize's records; unary: tokens), of one or several processes;
    cpu: their CPU seconds together."""
    if op == "stream":
        summary = summarize(results, wall)
    else:
        summary = {"requests": len(results), "tokens": sum(results), "wall_s": wall, "tok_s": sum(results) / wall}
    # The client's own CPU per token (all its threads): what this path costs the user's process.
    summary["client_cpu_us_per_token"] = cpu * 1e6 / max(summary["tokens"], 1)
    return summary


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


async def serve(args) -> None:
    worker = (Raw(args.url) if args.path == "raw" else Stubs(args.sampler) if args.path == "stubs" else
              StubsBesideRuntime(args.sampler) if args.path == "stubs_rt" else
              OpenAI(args.gateway) if args.path == "openai" else Client(args.sampler))
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 28)  # a command carries every prompt of a run
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": args.path}), flush=True)
    try:
        while line := await reader.readline():
            command = json.loads(line)
            try:
                result = await run(worker, command)
            except Exception as exc:  # noqa: BLE001 - the driver reports it with the path that failed
                result = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(result), flush=True)
    finally:
        await worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=PATHS + DIAGNOSTIC_PATHS + GATEWAY_PATHS, required=True)
    parser.add_argument("--url", default="", help="the SGLang (or synthetic) server(s), comma-separated, for raw")
    parser.add_argument("--sampler", default="", help="sampler_svc's address, for stubs and client")
    parser.add_argument("--gateway", default="", help="the gateway's base URL (http://host:port), for openai")
    parser.add_argument("--uvloop", action="store_true", help="run this worker's event loop on uvloop")
    parser.add_argument("--adapter-prefix", default="bench/a")
    args = parser.parse_args()
    global PREFIX
    PREFIX = args.adapter_prefix
    if args.uvloop:
        import uvloop

        uvloop.install()
    profile_dir = os.environ.get("LORAPLANE_BENCH_PROFILE_DIR")
    if not profile_dir:
        asyncio.run(serve(args))
        return
    # Where a client's time goes (bench/stream_overhead.py --profile-clients): its whole life under cProfile.
    import cProfile

    profiler = cProfile.Profile()
    try:
        profiler.runcall(asyncio.run, serve(args))
    finally:
        profiler.dump_stats(str(Path(profile_dir) / f"client-{args.path}.prof"))


class Worker:
    """The driver's handle on one path's worker process, or on several (processes=N): one Python process saturates
    near 1 CPU s/s at a few hundred concurrent streams (bare stubs: ~100 us of CPU per token, so ~9k tok/s), and
    past that its own event loop, not the server, sets the inter-token gaps. N processes, each with its own
    connection (channel or session), share one command's requests and report as one."""

    def __init__(self, path: str, *, url: str = "", sampler: str = "", gateway: str = "", env: dict | None = None,
                 python: str = sys.executable, adapter_prefix: str = PREFIX, processes: int = 1):
        import subprocess

        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.path = path
        # All started before any is waited for: their imports overlap.
        self.processes = [subprocess.Popen([python, str(Path(__file__).resolve()), "--path", path, "--url", url,
                                            "--sampler", sampler, "--gateway", gateway,
                                            "--adapter-prefix", adapter_prefix],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                           env=env)
                          for _ in range(processes)]
        self.process = self.processes[0]
        try:
            for process in self.processes:
                if not process.stdout.readline():
                    raise RuntimeError(f"the {path} worker exited with {process.wait()}")
        except BaseException:
            self.close()
            raise

    def run(self, command: dict) -> dict:
        if len(self.processes) == 1:
            self._send(self.process, command)
            return self._checked(self._read(self.process))
        # Split round-robin, and the concurrency as evenly (the first concurrency % N parts take one more), so the
        # processes together keep `concurrency` requests open. Fewer processes than N when concurrency < N: a
        # part with no slot would never run its requests.
        procs = self.processes[:max(1, min(len(self.processes), command["concurrency"]))]
        count = len(procs)
        parts = [{**command, "raw_records": True, "requests": command["requests"][i::count],
                  "concurrency": command["concurrency"] // count + (i < command["concurrency"] % count)}
                 for i in range(count)]
        # Every part is sent before any reply is read, so they run at the same time.
        for process, part in zip(procs, parts, strict=True):
            self._send(process, part)
        replies = [self._read(process) for process in procs]  # all read, an error or not, to keep the pipes in step
        for reply in replies:
            self._checked(reply)
        # perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of the host, so the processes'
        # start, end and arrival times compare directly: the wall is the first start to the last end.
        wall = max(r["end"] for r in replies) - min(r["start"] for r in replies)
        summary = _summary(command["op"], [x for r in replies for x in r["results"]], wall,
                           sum(r["cpu_s"] for r in replies))
        summary["client_processes"] = count
        return summary

    def _send(self, process, command: dict) -> None:
        process.stdin.write(json.dumps(command) + "\n")
        process.stdin.flush()

    def _read(self, process) -> dict:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.path} worker exited with {process.wait()}")
        return json.loads(line)

    def _checked(self, result: dict) -> dict:
        if "error" in result:
            raise RuntimeError(f"{self.path}: {result['error']}")
        return result

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(20)
            except Exception:  # noqa: BLE001
                process.kill()
                process.wait()


if __name__ == "__main__":
    main()
