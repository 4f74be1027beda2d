"""Generation on SGLang servers: a Sample is one non-streaming /generate call (all samples as one batch, with
`input_ids`, `lora_path` and `return_logprob`); a SampleStream is one streaming call per sample, forwarding each
token as SGLang produces it, read on the serving loop or, once enough streams are open, by the stream reader
processes (sglang_streams.py). The server a request goes to is the placement's (sglang_placement.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from loraplane import errors
from sampler_svc.engines.base import FINISH_STOP, GenerationRequest, GenerationUpdate, TopkRows
from sampler_svc.engines.sglang_placement import ServerChoice
from sampler_svc.engines.sglang_servers import SGLangHTTP, SGLangServer
from sampler_svc.engines.sglang_streams import EventBuffer, StreamReaders, finish_reason, new_tokens


class Generation:
    def __init__(self, http: SGLangHTTP, choice: ServerChoice, *, send_seed: bool = True,
                 stream_readers: int = 0, stream_readers_from: int = 16):
        self.http = http
        self.choice = choice
        self.send_seed = send_seed
        # Helper processes that read SGLang's token streams (sglang_streams.py); 0: every stream is read on the
        # serving loop itself.
        self.stream_readers = stream_readers
        self.readers: StreamReaders | None = None
        # Streams go to the readers only once this many are open: below it the serving loop has time to spare and
        # the hop through a reader would only add its latency (about 1 ms to the first token on a loaded machine).
        self.stream_readers_from = stream_readers_from
        self.streams_here = 0
        # Requests sent and not yet answered (the engine's queue depth).
        self.waiting = 0
        # The base model's end-of-sequence ids, stop tokens of every request (set once the base model is read).
        self.eos: list[int] = []

    async def start(self) -> None:
        if self.stream_readers:
            self.readers = StreamReaders(self.stream_readers, request_timeout_s=self.http.request_timeout_s)
            await self.readers.start()

    async def stop(self) -> None:
        if self.readers is not None:
            await self.readers.stop()
            self.readers = None

    def server_for(self, key: str | None) -> SGLangServer:
        return self.choice.for_request(key)

    def _stream_sample(self, request: GenerationRequest, index: int) -> AsyncIterator[GenerationUpdate]:
        """Sample `index` of a streamed request, read by a stream reader process when there are some
        (sglang_streams.py), else on this loop."""
        if (self.readers is not None and self.readers.running
                and self.streams_here + self.readers.open_streams >= self.stream_readers_from):
            # The readers' generator itself, not one that re-yields it: a streamed token crosses one layer fewer.
            return self.readers.stream(self, request, index)
        return self._stream_here(request, index)

    async def _stream_here(self, request: GenerationRequest, index: int) -> AsyncIterator[GenerationUpdate]:
        """Sample `index` of a streamed request on this loop: one streaming /generate call (server-sent events
        `data: {...}` up to `data: [DONE]`). Each read takes every event that has arrived and leaves as one update
        (their chunks parsed with one json.loads): a consumer that keeps up gets one token at a time; one that falls
        behind (hundreds of streams on one event loop) gets the backlog in one piece instead of paying a loop round
        trip and a gRPC message per token. This generator is the whole engine-side path of a one-sample stream (each
        layer between SGLang and the servicer costs a frame switch per message)."""
        import aiohttp

        server = self.server_for(request.adapter_key)
        payload = {**self.payload(request, [index]), "stream": True}
        follower = _Follower(index)
        self.waiting += 1
        server.in_flight += 1
        self.streams_here += 1
        try:
            async with self.http.session.post(server.url + "/generate", json=payload,
                                          timeout=aiohttp.ClientTimeout(total=self.http.request_timeout_s)) as reply:
                if reply.status != 200:
                    body = (await reply.read()).decode(errors="replace")
                    raise errors.Unavailable(f"SGLang {server.url} /generate failed with HTTP {reply.status}: "
                                             f"{body[:500]}")
                content = reply.content
                events = EventBuffer()
                while data := await content.readany():
                    chunks, done = events.feed(data)
                    if chunks:
                        update = follower.update(chunks)
                        if update is not None:
                            yield update
                    if done:
                        # The response's end follows [DONE] at once; read it, so the connection goes back to the
                        # pool for the next request instead of being closed (a TCP connect per stream otherwise).
                        # A server that holds the response open past [DONE] only loses its connection.
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(1.0):
                                await content.read()
                        return
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise errors.Unavailable(f"SGLang server {server.url} unreachable: {type(exc).__name__}: {exc}") from None
        finally:
            self.waiting -= 1
            server.in_flight -= 1
            self.streams_here -= 1

    def _sampling_params(self, request: GenerationRequest, sample_index: int) -> dict:
        options = request.options
        params = {
            "max_new_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "top_k": options.top_k if options.top_k > 0 else -1,
            "stop_token_ids": sorted(set(options.stop_token_ids) | (set() if options.ignore_eos else set(self.eos))),
        }
        if options.ignore_eos:
            params["ignore_eos"] = True
        if options.stop_strings:
            params["stop"] = list(options.stop_strings)
        if options.seed is not None and self.send_seed and not options.greedy:
            params["sampling_seed"] = (options.seed * 1_000_003 + sample_index) % (2**63)
        return params

    async def _generate_call(self, server: SGLangServer, payload: dict) -> list[dict]:
        self.waiting += 1
        server.in_flight += 1
        try:
            status, body = await self.http.request(server, "/generate", payload)
        finally:
            self.waiting -= 1
            server.in_flight -= 1
        if status != 200:
            raise errors.Unavailable(f"SGLang {server.url} /generate failed with HTTP {status}: {str(body)[:500]}")
        return body if isinstance(body, list) else [body]

    def payload(self, request: GenerationRequest, indices: Sequence[int]) -> dict:
        # A Sample sends its samples as one batch; a streamed sample goes alone (SGLang streams single requests).
        batch = not request.stream
        params = [self._sampling_params(request, i) for i in indices]
        payload = {
            "input_ids": [list(request.prompt_tokens)] * len(indices) if batch else list(request.prompt_tokens),
            "sampling_params": params if batch else params[0],
            "return_logprob": True,
            # Prompt logprobs cost a prefill-length logprob pass: only when asked, and only from the first scored
            # position (prompt_logprobs_last_n lets SGLang serve the prefix before it from its cache).
            "logprob_start_len": _logprob_start_len(request),
            "lora_path": [request.adapter_key] * len(indices) if batch else request.adapter_key,
        }
        if request.topk_prompt_logprobs:
            payload["top_logprobs_num"] = request.topk_prompt_logprobs
        return payload

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        # The generator itself, not one that re-yields it: a streamed token crosses one layer fewer.
        if not request.stream:
            return self._generate_whole(request)
        return self._stream_sample(request, 0) if request.num_samples == 1 else self._generate_samples(request)

    async def _generate_whole(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        server = self.server_for(request.adapter_key)
        outputs = await self._generate_call(server, self.payload(request, range(request.num_samples)))
        for index, output in enumerate(outputs):
            meta = output.get("meta_info", {})
            pairs = meta.get("output_token_logprobs") or []
            tokens = [int(p[1]) for p in pairs] or list(output.get("output_ids", []))
            update = GenerationUpdate(sequence_index=index, tokens=tokens, logprobs=_logprob_values(pairs),
                                      finish_reason=finish_reason(meta) or FINISH_STOP)
            if index == 0 and request.include_prompt_logprobs:
                update.prompt_logprobs = _input_logprobs(meta, request)
            if index == 0 and request.topk_prompt_logprobs:
                update.topk_prompt = _input_top_logprobs(meta, request)
            yield update

    async def _generate_samples(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        """Several samples of a streamed request: one streaming call per sample, all at once, each read by a task of
        its own into one queue; updates are yielded in the order SGLang produces them, and those that queued up
        while the consumer was busy leave merged per sequence."""
        self.server_for(request.adapter_key)  # an unknown version fails here, before any call starts
        updates: asyncio.Queue = asyncio.Queue()
        done = object()

        async def follow(index: int) -> None:
            try:
                async for update in self._stream_sample(request, index):
                    updates.put_nowait(update)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer below
                updates.put_nowait(exc)
            finally:
                updates.put_nowait(done)

        tasks = [asyncio.create_task(follow(i)) for i in range(request.num_samples)]
        try:
            remaining = len(tasks)
            while remaining:
                items = [await updates.get()]
                while not updates.empty():
                    items.append(updates.get_nowait())
                # A backlog (the consumer fell behind SGLang) leaves as one update per sequence.
                for item in _coalesced(items):
                    if item is done:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield item
        finally:
            for task in tasks:
                task.cancel()  # a consumer that stops early (client went away) aborts the SGLang requests
            await asyncio.gather(*tasks, return_exceptions=True)

    async def compute_logprobs(self, tokens: Sequence[int], adapter_key: str | None) -> list[float]:
        server = self.server_for(adapter_key)
        payload = {"input_ids": list(tokens), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                   "return_logprob": True, "logprob_start_len": 0, "lora_path": adapter_key}
        outputs = await self._generate_call(server, payload)
        # Every position scored (NaN at 0, which has no context), as for a prompt's logprobs.
        return _input_logprobs(outputs[0].get("meta_info", {}),
                               GenerationRequest(prompt_tokens=tuple(tokens), include_prompt_logprobs=True))



class _Follower:
    """One sample's SGLang stream as GenerationUpdates. SGLang streams cumulative outputs by default (every chunk
    repeats what came before) and only the new part with --incremental-streaming-output; the completion count tells
    which, so servers given by URL work either way."""

    __slots__ = ("index", "sent")

    def __init__(self, index: int):
        self.index = index
        self.sent = 0  # tokens of this sample already forwarded

    def update(self, chunks: list[dict]) -> GenerationUpdate | None:
        """The new tokens of `chunks` (in order) as one update, None when they carry none and no finish."""
        tokens, logprobs, finish, self.sent = new_tokens(chunks, self.sent)
        if not tokens and finish is None:
            return None
        return GenerationUpdate(sequence_index=self.index, tokens=tokens, logprobs=logprobs, finish_reason=finish)


def _coalesced(items: list) -> list:
    """Consecutive queued updates merged per sequence, in the order their sequences first appear; anything else
    (an end marker, an error) keeps its place after the updates queued before it."""
    out: list = []
    open_updates: dict[int, GenerationUpdate] = {}
    for item in items:
        if not isinstance(item, GenerationUpdate):
            out.append(item)
            open_updates.clear()
            continue
        merged = open_updates.get(item.sequence_index)
        if merged is None:
            merged = replace(item, tokens=list(item.tokens), logprobs=list(item.logprobs))
            out.append(merged)
            if item.finish_reason is None:
                open_updates[item.sequence_index] = merged
            continue
        merged.tokens.extend(item.tokens)
        merged.logprobs.extend(item.logprobs)
        merged.finish_reason = item.finish_reason
        if item.prompt_logprobs is not None:
            merged.prompt_logprobs = item.prompt_logprobs
        if item.topk_prompt is not None:
            merged.topk_prompt = item.topk_prompt
        if item.finish_reason is not None:
            del open_updates[item.sequence_index]
    return out



def _logprob_values(pairs: list) -> list[float]:
    return [float(p[0]) if p[0] is not None else math.nan for p in pairs]


def _logprob_start_len(request: GenerationRequest) -> int:
    if not request.wants_prompt_scores:
        return -1
    return request.first_scored_position if request.prompt_logprobs_last_n else 0


def _input_logprobs(meta: dict, request: GenerationRequest) -> list[float]:
    """SGLang's input_token_logprobs ([logprob, token_id, text] from logprob_start_len on; None where it has no
    value) as one entry per prompt token: NaN at position 0 and before the first scored position."""
    n, start = len(request.prompt_tokens), request.first_scored_position
    values = _logprob_values((meta.get("input_token_logprobs") or [])[-n:])
    out = [math.nan] * (n - len(values)) + values
    for i in range(min(start, n)):
        out[i] = math.nan
    return out


def _input_top_logprobs(meta: dict, request: GenerationRequest) -> TopkRows:
    """SGLang's input_top_logprobs (per position from logprob_start_len: a list of [logprob, token_id, text], most
    likely first, or None) as dense rows of k per prompt position."""
    n, k, start = len(request.prompt_tokens), request.topk_prompt_logprobs, request.first_scored_position
    rows = TopkRows.empty(n, k)
    entries = (meta.get("input_top_logprobs") or [])[-n:]
    first = n - len(entries)
    for offset, entry in enumerate(entries):
        position = first + offset
        if position < start or not entry:
            continue
        cells = [c for c in entry if c is not None and c[0] is not None][:k]
        rows.token_ids[position][:len(cells)] = [int(c[1]) for c in cells]
        rows.logprobs[position][:len(cells)] = [float(c[0]) for c in cells]
    return rows
