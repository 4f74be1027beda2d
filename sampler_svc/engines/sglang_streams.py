"""SGLang's token streams read in helper processes ("stream readers"), so the sampler's one event loop does not.

Measured (docs/benchmarks.md, "Sampler vs the SGLang server it wraps"): at 256 concurrent streams the sampler's
event loop was busy 0.73 s per s, and half of that loop's per-token work (cProfile on the synthetic server,
bench/stream_overhead.py) was reading SGLang: aiohttp's socket reads and HTTP parsing, the SSE split, json.loads,
the per-chunk bookkeeping. The other half (gRPC's writes, the servicer's frames) has to stay with the gRPC server.

With `stream_readers` = K > 0, K processes (`python -m sampler_svc.engines.sglang_streams`) own the streaming
/generate calls: the main process sends each stream's request (already encoded JSON) to the reader with the fewest
open streams; the reader reads SGLang's stream, keeps only what a GenerationUpdate needs (new token ids, logprobs,
finish) and sends everything its streams produced in one turn of its event loop as ONE frame (marshal) on its
stdout. The main process reads one frame per reader per SGLang decode step, not one socket read per stream, and
wakes each stream's consumer; a consumer that fell behind takes its backlog as one update, as on the in-process
path. Non-streaming calls (Sample, adapter loads) stay on the main process's own HTTP session.

Frames, both ways: 4-byte little-endian length, then marshal of
  main -> reader: ("s", stream id, url, JSON body, timeout_s) start | ("c", stream id) cancel (the consumer left:
                  the reader drops the HTTP request, which aborts it on SGLang);
  reader -> main: a list of (stream id, tokens, logprobs, finish, end) where finish is None, "length" or "stop" and
                  end is None (more to come), "" (the stream ended) or an error message.
A reader that exits fails its open streams (UNAVAILABLE); new streams go to the other readers, or back to the
in-process path when none is left.

The parsing (SSE events, SGLang's cumulative or incremental chunks) lives here once and is what the in-process path
(sglang_generation.Generation._stream_here) uses too. A reader process imports only this module, the standard
library, aiohttp and loraplane.errors, so it starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import marshal
import math
import os
import struct
import sys
from collections.abc import AsyncIterator

from loraplane import errors
from sampler_svc.engines.base import FINISH_LENGTH, FINISH_STOP, GenerationUpdate

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
ENV = "LORAPLANE_SGLANG_STREAM_READERS"


def default_readers() -> int:
    """Readers when neither the engine's argument nor LORAPLANE_SGLANG_STREAM_READERS names a count: one per 4
    cores this process may run on, at most 4 (a reader pays only where it has a core of its own: on a 2-core
    machine the main process would compete with it), 0 below 4 cores."""
    value = os.environ.get(ENV, "").strip()
    if value:
        try:
            count = int(value)
        except ValueError:
            raise ValueError(f"{ENV} must be an integer, not {value!r}") from None
        if count < 0:
            raise ValueError(f"{ENV} must be >= 0, not {count}")
        return count
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cores // 4)


# ---------------------------------------------------------------------------------------------- parsing (shared)

def event_data(events: bytes) -> tuple[list[bytes], bool]:
    """The `data:` payloads of complete server-sent events (blank-line separated), and whether `[DONE]` ended
    them (what follows it is ignored)."""
    bodies = []
    for line in events.split(b"\n"):
        if line.startswith(b"data:"):
            body = line[5:].strip()
            if body == b"[DONE]":
                return bodies, True
            bodies.append(body)
    return bodies, False


class EventBuffer:
    """Bytes of an SSE response as they arrive -> the JSON chunks of the events completed so far (one json.loads
    for all of them), and whether `[DONE]` came."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> tuple[list | None, bool]:
        self.pending += data
        if b"\r" in self.pending:  # CRLF line ends (a CR and its LF may come in two reads: the CR waits here)
            self.pending = self.pending.replace(b"\r\n", b"\n")
        end = self.pending.rfind(b"\n\n")
        if end < 0:
            return None, False  # no complete event yet
        events, self.pending = self.pending[:end], self.pending[end + 2:]
        bodies, done = event_data(events)
        return (json.loads(b"[" + b",".join(bodies) + b"]") if bodies else None), done


def new_tokens(chunks: list[dict], sent: int) -> tuple[list[int], list[float], str | None, int]:
    """The tokens of `chunks` (in order) not yet forwarded, their logprobs, the finish reason if one ended the
    sample ("length" or "stop"), and the new count of tokens forwarded. SGLang streams cumulative outputs by
    default (every chunk repeats what came before) and only the new part with --incremental-streaming-output; the
    completion count tells which, so servers given by URL work either way."""
    tokens: list[int] = []
    logprobs: list[float] = []
    finish = None
    for chunk in chunks:
        meta = chunk.get("meta_info", {})
        pairs = meta.get("output_token_logprobs") or []
        produced = int(meta.get("completion_tokens", sent + len(pairs)))
        if len(pairs) == produced:
            pairs = pairs[sent:]
        sent = produced
        for pair in pairs:
            tokens.append(int(pair[1]))
            logprobs.append(float(pair[0]) if pair[0] is not None else math.nan)
        finish = finish_reason(meta) or finish
    return tokens, logprobs, finish, sent


def finish_reason(meta: dict) -> str | None:
    """SGLang's meta_info.finish_reason as ours: FINISH_LENGTH when it stopped at max_new_tokens, FINISH_STOP for
    any other end; None while the sample runs."""
    reason = meta.get("finish_reason")
    if not reason:
        return None
    return FINISH_LENGTH if isinstance(reason, dict) and reason.get("type") == "length" else FINISH_STOP


def _frame(value) -> bytes:
    body = marshal.dumps(value)
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader):
    """The next frame's value, None at the end of the pipe."""
    try:
        head = await reader.readexactly(4)
        return marshal.loads(await reader.readexactly(_LENGTH.unpack(head)[0]))
    except asyncio.IncompleteReadError:
        return None


# ---------------------------------------------------------------------------------------------- the main process

class _Slot:
    """One stream's tokens that arrived and were not yet taken, and how it ended."""

    __slots__ = ("end", "finish", "logprobs", "tokens", "waiter")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        self.end: str | None = None
        self.waiter: asyncio.Future | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Reader:
    def __init__(self, index: int, process: asyncio.subprocess.Process):
        self.index = index
        self.process = process
        self.slots: dict[int, _Slot] = {}
        self.alive = True
        self.started = 0  # streams sent to it so far
        self.commands: list[bytes] = []
        self.pump: asyncio.Task | None = None

    def send(self, value) -> None:
        """Queues a command; this turn's commands leave in one write when the turn is done (a write to the pipe
        costs a wake-up of the reader: 256 streams that start together are one write, not 256)."""
        if not self.alive:
            return
        self.commands.append(_frame(value))
        if len(self.commands) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        commands, self.commands = self.commands, []
        if self.alive and commands:
            with contextlib.suppress(ConnectionError, RuntimeError):  # the reader is gone: its pump fails its streams
                self.process.stdin.write(b"".join(commands))

    async def run_pump(self) -> None:
        """Frames from the reader into its streams' slots, until its pipe ends."""
        slots = self.slots
        try:
            while (records := await _read_frame(self.process.stdout)) is not None:
                for sid, tokens, logprobs, finish, end in records:
                    slot = slots.get(sid)
                    if slot is None:
                        continue  # its consumer left (a cancel crossed this frame)
                    if tokens:
                        slot.tokens += tokens
                        slot.logprobs += logprobs
                    if finish is not None:
                        slot.finish = finish
                    if end is not None:
                        slot.end = end
                    slot.wake()
        except Exception:
            log.exception("SGLang stream reader %d sent a bad frame", self.index)
        finally:
            self.alive = False
            for slot in slots.values():
                if slot.end is None:
                    slot.end = f"the SGLang stream reader process {self.index} exited"
                slot.wake()
            slots.clear()


class StreamReaders:
    """K reader processes and the streams open on them (module docstring)."""

    def __init__(self, count: int, *, request_timeout_s: float = 600.0):
        self.count = count
        self.request_timeout_s = request_timeout_s
        self.readers: list[_Reader] = []
        self._ids = itertools.count(1)

    @property
    def running(self) -> bool:
        return any(reader.alive for reader in self.readers)

    @property
    def open_streams(self) -> int:
        return sum(len(reader.slots) for reader in self.readers)

    async def start(self) -> None:
        env = dict(os.environ)
        # The reader imports this package from wherever the sampler does.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH", "")) if p)
        for index in range(self.count):
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sampler_svc.engines.sglang_streams", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env, limit=1 << 24)
            reader = _Reader(index, process)
            reader.pump = asyncio.get_running_loop().create_task(reader.run_pump())
            self.readers.append(reader)

    async def stop(self) -> None:
        for reader in self.readers:
            reader.alive = False
            with contextlib.suppress(Exception):
                reader.process.stdin.close()  # the reader exits at the end of its input
        for reader in self.readers:
            try:
                await asyncio.wait_for(reader.process.wait(), 5)
            except TimeoutError:
                reader.process.kill()
                await reader.process.wait()
            if reader.pump is not None:
                await asyncio.gather(reader.pump, return_exceptions=True)
        self.readers = []

    async def stream(self, generation, request, index: int) -> AsyncIterator[GenerationUpdate]:
        """Sample `index` of `request` (streamed, for sglang_generation.Generation `generation`, whose in-flight
        counts it holds while it runs) as GenerationUpdates: one per token for a consumer that keeps up, a backlog in
        one piece; raises errors.Unavailable when SGLang fails or cannot be reached."""
        server = generation.server_for(request.adapter_key)  # an unknown version fails before anything is sent
        payload = {**generation.payload(request, [index]), "stream": True}
        alive = [r for r in self.readers if r.alive]
        if not alive:
            raise errors.Unavailable("no SGLang stream reader process is running")
        reader = min(alive, key=lambda r: len(r.slots))
        sid = next(self._ids)
        slot = reader.slots[sid] = _Slot()
        reader.started += 1
        loop = asyncio.get_running_loop()
        reader.send(("s", sid, server.url + "/generate", json.dumps(payload).encode(), self.request_timeout_s))
        ended = False
        generation.waiting += 1
        server.in_flight += 1
        try:
            while True:
                if slot.tokens or slot.finish is not None:
                    tokens, logprobs, finish = slot.tokens, slot.logprobs, slot.finish
                    slot.tokens, slot.logprobs = [], []
                    if finish is not None:
                        ended = True  # the reader finishes the response on its own (its connection is reused)
                    yield GenerationUpdate(index, tokens, logprobs, finish)
                    if finish is not None:
                        return
                elif slot.end is not None:  # only once every token that came before the end was taken
                    ended = True
                    if slot.end:
                        raise errors.Unavailable(slot.end)
                    return
                else:
                    slot.waiter = loop.create_future()
                    await slot.waiter
                    slot.waiter = None
        finally:
            generation.waiting -= 1
            server.in_flight -= 1
            if reader.slots.pop(sid, None) is not None and not ended:
                reader.send(("c", sid))


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------- a reader process

class _Outbox:
    """Records of this turn of the event loop, sent as one frame when the turn's callbacks are done."""

    def __init__(self, transport: asyncio.WriteTransport):
        self.transport = transport
        self.records: list[tuple] = []
        self.scheduled = False

    def put(self, record: tuple) -> None:
        self.records.append(record)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        records, self.records = self.records, []
        if records and not self.transport.is_closing():
            self.transport.write(_frame(records))


async def _follow(session, outbox: _Outbox, sid: int, url: str, body: bytes, timeout_s: float) -> None:
    import aiohttp

    base = url.rsplit("/generate", 1)[0]
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
            if reply.status != 200:
                text = (await reply.read()).decode(errors="replace")
                message = f"SGLang {base} /generate failed with HTTP {reply.status}: {text[:500]}"
                outbox.put((sid, None, None, None, message))
                return
            content = reply.content
            events = EventBuffer()
            sent = 0
            while data := await content.readany():
                chunks, done = events.feed(data)
                if chunks:
                    tokens, logprobs, finish, sent = new_tokens(chunks, sent)
                    if tokens or finish is not None:
                        outbox.put((sid, tokens, logprobs, finish, None))
                if done:
                    outbox.put((sid, None, None, None, ""))
                    # The response's end follows [DONE] at once: read it, so the connection goes back to the pool.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await content.read()
                    return
        outbox.put((sid, None, None, None, ""))
    except asyncio.CancelledError:
        raise
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        outbox.put((sid, None, None, None, f"SGLang server {base} unreachable: {type(exc).__name__}: {exc}"))
    except Exception as exc:  # noqa: BLE001 - the main process raises it for the stream
        outbox.put((sid, None, None, None, f"SGLang stream reader failed: {type(exc).__name__}: {exc}"))


async def _reader_main() -> None:
    import aiohttp

    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin.buffer)
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, sys.stdout.buffer)
    sys.stdout = sys.stderr  # the pipe carries frames only: a stray print goes to the sampler's log instead
    outbox = _Outbox(transport)
    # As the engine's own session: no connection cap (SGLang's scheduler decides the batch), idle connections
    # dropped before uvicorn's 5 s keep-alive closes them on its side.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4))
    tasks: dict[int, asyncio.Task] = {}
    try:
        while (command := await _read_frame(commands)) is not None:
            if command[0] == "s":
                _, sid, url, body, timeout_s = command
                task = loop.create_task(_follow(session, outbox, sid, url, body, timeout_s))
                tasks[sid] = task
                task.add_done_callback(lambda _, sid=sid: tasks.pop(sid, None))
            elif command[0] == "c":
                task = tasks.pop(command[1], None)
                if task is not None:
                    task.cancel()
    finally:
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await session.close()
        outbox.flush()
        transport.close()


def main() -> None:
    if os.environ.get("LORAPLANE_UVLOOP", "1") != "0":
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.run(_reader_main())
            return
    asyncio.run(_reader_main())


if __name__ == "__main__":
    main()
