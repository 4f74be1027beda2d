"""Drives one or more SGLang servers (0.5.x) over their HTTP API.

Each adapter version is loaded under its own name (`<adapter>@v<N>`: SGLang cannot replace a loaded name), one of
two ways (`adapter_transport`):
- "file": written as a PEFT directory and loaded with `/load_lora_adapter` (the server must see this filesystem);
- "tensors": sent to `/load_lora_adapter_from_tensors` (SGLang >= 0.5.8): to a server on another host with their
  bytes in the request body; to a server this engine launched (`shared_memory_tensors`) as the name of a /dev/shm
  segment holding them, which SGLang's ranks map (a 2.6 GB Qwen3-30B-A3B expert adapter: a 100 KB request instead
  of 3.4 GB of base64 that SGLang decodes, copies to its scheduler and unpickles). Nothing is written to a file
  system, so it works where SGLang cannot read adapter files (`--load-format dummy`). A server without that
  endpoint (HTTP 404/405, or 422 from the older request shape) gets files from then on.
- "auto" (default): files for servers on this host, tensors for the others. On SGLang 0.5.17 over HTTP the tensor
  path is the slower one on one host (H100, 8B-shape rank-32 adapter: 4.0 s vs 1.2 s; docs/benchmarks.md): the
  tensors travel base64 in JSON and are pickled twice on the way, while the file path reads the page cache. Requests go to `/generate` with `input_ids`, `lora_path`
and `return_logprob`. With several servers, a version lives on one server (the one with the fewest loaded adapters
when it was loaded) and its requests are routed there; base-model requests go round-robin.

The sampler is the only authority on which versions exist. SGLang 0.5.17 silently reloads an unloaded name from its
cached path, so this engine removes a name from its routing table BEFORE asking SGLang to unload it, and refuses
(NotFound) any request naming a version that is not in the table: such a name never reaches SGLang.

Logprobs: SGLang returns logprobs of the temperature-scaled distribution unless the server runs with
SGLANG_RETURN_ORIGINAL_LOGPROB=True; servers this engine launches get it, so logprobs mean the same as the torch
engine's (unmodified distribution). Servers given by URL must be started with it.

Transport: one pooled aiohttp session per engine, no thread per request and no connection cap (the engine must
not throttle below SGLang's own batch size: a 20-thread pool once held it to a third of SGLang's throughput).
A Sample is one non-streaming /generate call (all samples as one batch); a SampleStream is one streaming call per
sample, forwarding each token as SGLang produces it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import math
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from loraplane import errors
from loraplane.adapter_format import (
    adapter_header,
    adapter_tensor_views,
    materialize_peft_dir,
    materialize_sglang_dir,
    peft_adapter_config,
    sglang_packing,
)
from sampler_svc.engines.base import (
    FINISH_STOP,
    Engine,
    GenerationRequest,
    GenerationUpdate,
    LoadedAdapterInfo,
    TopkRows,
)
from sampler_svc.engines.sglang_streams import (
    EventBuffer,
    StreamReaders,
    default_readers,
    finish_reason,
    new_tokens,
)

log = logging.getLogger(__name__)


@dataclass
class SGLangServer:
    url: str
    process: subprocess.Popen | None = None
    adapters: set[str] = field(default_factory=set)
    in_flight: int = 0
    # Versions on their way to this server (chosen, not yet answered): counted with `adapters` when choosing one, so
    # loads that overlap spread over the servers instead of all picking the one that was emptiest when they began.
    loading: int = 0
    # Whether /load_lora_adapter_from_tensors works there: None until first tried, False once it was missing.
    tensor_loads: bool | None = None
    tp_size: int = 1
    dtype: str = "auto"
    # SGLang's --max-loaded-loras: past it SGLang itself would evict its least recently used name (0: unknown).
    max_loaded: int = 0


TRANSPORTS = ("auto", "tensors", "file")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _no_tensor_endpoint(status: int, body: object) -> bool:
    """A server that lacks /load_lora_adapter_from_tensors (404/405), knows only its pre-0.5.17 request shape
    (422), or whose unpickler refuses a class the tensors need: it gets files instead."""
    return status in (404, 405, 422) or (status != 200 and "Blocked unsafe class" in str(body))


class SGLangEngine(Engine):
    name = "sglang"

    def __init__(
        self,
        base_model: str,
        *,
        urls: Sequence[str] = (),
        launch_servers: int = 0,
        work_dir: Path | str = ".loraplane/sglang",
        max_lora_rank: int = 64,
        max_loras_per_batch: int = 8,
        max_loaded_loras: int = 64,
        lora_target_modules: Sequence[str] = ("all",),
        extra_server_args: Sequence[str] = (),
        request_timeout_s: float = 600.0,
        startup_timeout_s: float = 900.0,
        send_seed: bool = True,
        adapter_transport: str = "auto",
        stream_readers: int | None = None,
        stream_readers_from: int = 16,
    ):
        if not urls and launch_servers < 1:
            raise errors.InvalidArgument("the sglang engine needs server URLs or launch_servers >= 1",
                                         field="sglang_urls")
        if adapter_transport not in TRANSPORTS:
            raise errors.InvalidArgument(f"adapter_transport must be one of {TRANSPORTS}, not {adapter_transport!r}",
                                         field="adapter_transport")
        self._base_model_name = base_model
        self._urls = list(urls)
        self._launch = launch_servers
        self.work_dir = Path(work_dir)
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded_loras = max_loaded_loras
        self.lora_target_modules = list(lora_target_modules)
        self.extra_server_args = list(extra_server_args)
        self.request_timeout_s = request_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.send_seed = send_seed
        self.adapter_transport = adapter_transport
        # Helper processes that read SGLang's token streams (sglang_streams.py); None: LORAPLANE_SGLANG_STREAM_READERS
        # or one per 4 cores (at most 4). 0: every stream is read on the serving loop itself.
        self.stream_readers = default_readers() if stream_readers is None else stream_readers
        if self.stream_readers < 0:
            raise errors.InvalidArgument(f"stream_readers must be >= 0, not {stream_readers}", field="stream_readers")
        self._readers: StreamReaders | None = None
        # Streams go to the readers only once this many are open: below it the serving loop has time to spare and
        # the hop through a reader would only add its latency (about 1 ms to the first token on a loaded machine).
        self.stream_readers_from = stream_readers_from
        self._streams_here = 0
        self._checkpoint_dtype = ""
        self.servers: list[SGLangServer] = []
        # The authority: version name -> the server that has it loaded.
        self._route: dict[str, SGLangServer] = {}
        self._loading: set[str] = set()  # versions whose load is under way
        self._round_robin = itertools.count()
        self._vocab_size = 0
        self._max_context = 0
        self._eos: list[int] = []
        self._tokenizer = None
        self._waiting = 0
        self._session = None  # aiohttp.ClientSession, made in start() on the serving loop

    # ------------------------------------------------------------------ properties

    @property
    def base_model_name(self) -> str:
        return self._base_model_name

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context_length(self) -> int:
        return self._max_context

    @property
    def queue_depth(self) -> int:
        return self._waiting

    @property
    def running_requests(self) -> int:
        return sum(server.in_flight for server in self.servers)

    @property
    def server_urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def loaded_names(self) -> dict[str, str]:
        return {key: server.url for key, server in self._route.items()}

    # ------------------------------------------------------------------ lifecycle

    async def _request(self, server: SGLangServer, path: str, payload: dict | bytes | None = None, *,
                       timeout: float | None = None) -> tuple[int, object]:
        """One HTTP call on the pooled session: (status, parsed JSON body or text). `payload` as bytes is an
        already encoded JSON body (the adapter tensors: hundreds of MB that json.dumps would scan again)."""
        import aiohttp

        method = "GET" if payload is None else "POST"
        body_args = ({"data": payload, "headers": {"Content-Type": "application/json"}}
                     if isinstance(payload, bytes) else {"json": payload})
        try:
            async with self._session.request(method, server.url + path, **body_args,
                                             timeout=aiohttp.ClientTimeout(total=timeout or self.request_timeout_s)
                                             ) as reply:
                body = await reply.read()
                status = reply.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise errors.Unavailable(f"SGLang server {server.url} unreachable: {type(exc).__name__}: {exc}") from None
        try:
            return status, json.loads(body) if body else None
        except ValueError:
            return status, body.decode(errors="replace")

    def _stream_sample(self, request: GenerationRequest, index: int) -> AsyncIterator[GenerationUpdate]:
        """Sample `index` of a streamed request, read by a stream reader process when there are some
        (sglang_streams.py), else on this loop."""
        if (self._readers is not None and self._readers.running
                and self._streams_here + self._readers.open_streams >= self.stream_readers_from):
            # The readers' generator itself, not one that re-yields it: a streamed token crosses one layer fewer.
            return self._readers.stream(self, request, index)
        return self._stream_here(request, index)

    async def _stream_here(self, request: GenerationRequest, index: int) -> AsyncIterator[GenerationUpdate]:
        """Sample `index` of a streamed request on this loop: one streaming /generate call (server-sent events
        `data: {...}` up to `data: [DONE]`). Each read takes every event that has arrived and leaves as one update
        (their chunks parsed with one json.loads): a consumer that keeps up gets one token at a time; one that falls
        behind (hundreds of streams on one event loop) gets the backlog in one piece instead of paying a loop round
        trip and a gRPC message per token. This generator is the whole engine-side path of a one-sample stream (each
        layer between SGLang and the servicer costs a frame switch per message)."""
        import aiohttp

        server = self._server_for(request.adapter_key)
        payload = {**self._payload(request, [index]), "stream": True}
        follower = _Follower(index)
        self._waiting += 1
        server.in_flight += 1
        self._streams_here += 1
        try:
            async with self._session.post(server.url + "/generate", json=payload,
                                          timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as reply:
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
            self._waiting -= 1
            server.in_flight -= 1
            self._streams_here -= 1

    async def start(self) -> None:
        import aiohttp

        # No per-host connection cap: every request the sampler accepts goes to SGLang at once and SGLang's own
        # scheduler decides the batch. Idle connections are dropped before uvicorn's 5 s keep-alive closes them on
        # its side: reusing one it closed fails the request with ServerDisconnectedError.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4),
            json_serialize=json.dumps)

        # Vocabulary, context length and EOS come from the same base model the trainer uses; the weights SGLang
        # serves come from its checkpoint directory, so none are loaded here (an 8B model would cost 32 GB of host
        # memory and a minute for three numbers).
        base = await asyncio.to_thread(_base_model_facts, self._base_model_name)
        self._checkpoint_dtype = str(getattr(base.config, "dtype", None) or getattr(base.config, "torch_dtype", "")
                                     ).removeprefix("torch.")
        self._vocab_size = base.vocab_size
        self._max_context = base.max_context_length
        self._eos = list(base.eos_token_ids)
        self._tokenizer = base.tokenizer
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.servers = [SGLangServer(url.rstrip("/")) for url in self._urls]
        if self._launch:
            model_dir = await asyncio.to_thread(self._model_dir, base)
            for index in range(self._launch):
                self.servers.append(await asyncio.to_thread(self._launch_server, model_dir, index))
        for server in self.servers:
            await self._wait_healthy(server)
            await self._read_server_info(server)
            if server.process is None:
                await self._drop_leftovers(server)
        if self.stream_readers:
            self._readers = StreamReaders(self.stream_readers, request_timeout_s=self.request_timeout_s)
            await self._readers.start()

    async def _read_server_info(self, server: SGLangServer) -> None:
        """Tensor parallel size (a tensor load carries one copy per rank) and the serving dtype."""
        try:
            status, body = await self._request(server, "/server_info", timeout=30)
        except errors.Unavailable:
            return
        if status == 200 and isinstance(body, dict):
            server.tp_size = max(1, int(body.get("tp_size") or 1))
            server.dtype = str(body.get("dtype") or "auto")
            server.max_loaded = int(body.get("max_loaded_loras") or 0)

    async def _drop_leftovers(self, server: SGLangServer) -> None:
        """A server given by URL may still hold names a previous sampler loaded (it crashed, or restarted). Only
        this sampler's manager decides what exists, so everything found there is unloaded first."""
        status, body = await self._request(server, "/v1/models", timeout=30)
        if status != 200 or not isinstance(body, dict):
            return
        for model in body.get("data", []):
            if model.get("parent"):
                log.info("unloading %s left on %s by an earlier sampler", model.get("id"), server.url)
                await self._request(server, "/unload_lora_adapter", {"lora_name": model["id"]})

    def _model_dir(self, base) -> Path:
        """The directory SGLang loads: the checkpoint itself when the model has one (its weights in their own
        dtype: bf16 stays bf16, nothing is rewritten), else (`tiny`, built in memory) a one-time save."""
        from loraplane.models.base import checkpoint_directory

        checkpoint = checkpoint_directory(self._base_model_name)
        if checkpoint is not None:
            return checkpoint
        directory = self.work_dir / "base" / self._base_model_name.replace("/", "_")
        if not (directory / "config.json").exists():
            directory.mkdir(parents=True, exist_ok=True)
            base.model.save_pretrained(directory)
            base.tokenizer.save_pretrained(directory)
        return directory

    def _launch_server(self, model_dir: Path, index: int) -> SGLangServer:
        from loraplane.local.processes import free_port

        port = free_port()
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                "--host", "127.0.0.1", "--port", str(port), "--enable-lora",
                "--max-lora-rank", str(self.max_lora_rank),
                "--lora-target-modules", *self.lora_target_modules,
                "--max-loras-per-batch", str(self.max_loras_per_batch),
                "--max-loaded-loras", str(self.max_loaded_loras),
                # Each streamed chunk carries only its new tokens and logprobs; by default every chunk repeats the
                # whole output so far, and both SGLang and this engine pay O(n^2) JSON per streamed sample.
                "--incremental-streaming-output", *self.extra_server_args]
        env = dict(os.environ, SGLANG_RETURN_ORIGINAL_LOGPROB="True")
        env.setdefault("CUDA_VISIBLE_DEVICES", str(index))
        log_path = self.work_dir / f"server-{index}.log"
        with open(log_path, "ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return SGLangServer(url=f"http://127.0.0.1:{port}", process=process)

    async def _wait_healthy(self, server: SGLangServer) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if server.process is not None and server.process.poll() is not None:
                raise errors.Unavailable(f"SGLang server {server.url} exited with {server.process.returncode}")
            try:
                status, _ = await self._request(server, "/health", timeout=5)
                if status == 200:
                    return
            except errors.Unavailable:
                pass
            await asyncio.sleep(1.0)
        raise errors.Unavailable(f"SGLang server {server.url} not healthy after {self.startup_timeout_s:.0f}s")

    async def stop(self) -> None:
        if self._readers is not None:
            await self._readers.stop()
            self._readers = None
        for key in list(self._route):
            try:
                await self.unload_adapter(key)
            except errors.Unavailable:
                break
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                os.killpg(server.process.pid, 15)
                try:
                    await asyncio.to_thread(server.process.wait, 30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.process.pid, 9)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ adapters

    def _adapter_dir(self, key: str) -> Path:
        return self.work_dir / "adapters" / key.replace("/", "__")

    # The form expert LoRA travels in as tensors (adapter_format.sglang_packing): "per_expert" keys (the form the GPU tests
    # verified) or "stacked" 3-D tensors (4 per layer instead of 6 per expert: 288 keys for Qwen3-30B-A3B, not 37k).
    tensor_expert_form = "per_expert"
    # Which servers get tensors through shared memory instead of in the request body: "launched" (the servers this
    # engine started, on this host for sure), "loopback" (also those given by a loopback URL), "never". Only where
    # the server surely shares this host's /dev/shm: SGLang 0.5.17 unpickles in its scheduler without a guard, so a
    # segment it cannot open would end the server, not fail the request.
    shared_memory_tensors = "launched"

    async def load_adapter(self, key: str, blob: bytes) -> LoadedAdapterInfo:
        if key in self._route or key in self._loading:
            raise errors.AlreadyExists(f"{key} is already loaded", field="adapter")
        server = min(self.servers, key=lambda s: len(s.adapters) + s.loading)
        self._loading.add(key)
        server.loading += 1
        try:
            return await self._load_on(server, key, blob)
        finally:
            server.loading -= 1
            self._loading.discard(key)

    async def _load_on(self, server: SGLangServer, key: str, blob: bytes) -> LoadedAdapterInfo:
        tensors = self._sends_tensors(server)
        # The digest was checked on download and the values by the registry: the header is all that must be read (a
        # file is the blob's own bytes; tensors go as views of them, in their stored dtype, until packed).
        header = await asyncio.to_thread(adapter_header, blob)
        spec, base_name, _dtypes = header
        if base_name and base_name != self._base_model_name:
            raise errors.FailedPrecondition(
                f"{key} was trained on {base_name!r}; this sampler serves {self._base_model_name!r}", field="adapter")
        if spec.rank > self.max_lora_rank:
            raise errors.FailedPrecondition(
                f"{key} has rank {spec.rank}; the SGLang servers allow at most {self.max_lora_rank}", field="adapter")
        if server.max_loaded and len(server.adapters) + server.loading > server.max_loaded:
            # SGLang would make room by evicting a name on its own, behind the manager's back (and a version that
            # came as tensors cannot be reloaded from anywhere): the manager's max_loaded must stay within this.
            raise errors.ResourceExhausted(
                f"every SGLang server holds its --max-loaded-loras ({server.max_loaded}) adapter versions; "
                f"unload some or raise the limit", field="adapter")
        status, body = None, None
        if tensors:
            status, body = await self._load_tensors(server, key, blob)
            if _no_tensor_endpoint(status, body):
                log.warning("SGLang %s has no usable /load_lora_adapter_from_tensors (HTTP %s: %s); adapter versions "
                            "go to it as files from now on", server.url, status, str(body)[:200])
                server.tensor_loads = False
                status = None
            else:
                server.tensor_loads = server.tensor_loads or status == 200
        if status is None:
            directory = self._adapter_dir(key)
            await asyncio.to_thread(_write_peft_dir, blob, directory, header)
            status, body = await self._load_call(server, key, "/load_lora_adapter",
                                                 {"lora_name": key, "lora_path": str(directory)})
            if status != 200 or (isinstance(body, dict) and body.get("success") is False):
                await asyncio.to_thread(shutil.rmtree, directory, True)
        if status != 200 or (isinstance(body, dict) and body.get("success") is False):
            raise errors.FailedPrecondition(f"SGLang {server.url} refused to load {key}: {str(body)[:500]}",
                                            field="adapter")
        server.adapters.add(key)
        self._route[key] = server
        return LoadedAdapterInfo(key=key, rank=spec.rank)

    def _sends_tensors(self, server: SGLangServer) -> bool:
        if server.tensor_loads is False or self.adapter_transport == "file":
            return False
        if self.adapter_transport == "tensors":
            return True
        from urllib.parse import urlsplit

        return server.process is None and urlsplit(server.url).hostname not in _LOOPBACK_HOSTS

    async def _load_call(self, server: SGLangServer, key: str, path: str, request: dict | bytes
                         ) -> tuple[int, object]:
        status, body = await self._request(server, path, request)
        if status == 400 and "already loaded" in str(body):
            # Left there by an earlier sampler process: the bytes may differ, so replace it.
            await self._request(server, "/unload_lora_adapter", {"lora_name": key})
            status, body = await self._request(server, path, request)
        return status, body

    def _transfer_dtype(self, spec, server: SGLangServer):
        """The dtype the tensors travel in. SGLang copies each weight into its LoRA buffers in the serving dtype
        (MoE layers first multiply B by alpha/rank in the dtype it arrives in). Sent in fp32, the result is exactly
        the file path's; sent in bf16 it is the same bits when SGLang serves bf16 and alpha/rank is a power of two
        (rounding then commutes with the scaling), at half the bytes. Otherwise fp32."""
        import torch

        serving = server.dtype if server.dtype not in ("auto", "") else self._checkpoint_dtype
        scale = spec.scale
        power_of_two = scale > 0 and math.frexp(scale)[0] == 0.5
        return torch.bfloat16 if serving == "bfloat16" and power_of_two else torch.float32

    def _shares_memory(self, server: SGLangServer) -> bool:
        """Whether tensors reach `server` through shared memory (see shared_memory_tensors)."""
        if self.shared_memory_tensors == "never":
            return False
        if server.process is not None:
            return True
        from urllib.parse import urlsplit

        return self.shared_memory_tensors == "loopback" and urlsplit(server.url).hostname in _LOOPBACK_HOSTS

    async def _load_tensors(self, server: SGLangServer, key: str, blob: bytes) -> tuple[int, object]:
        """/load_lora_adapter_from_tensors with the blob's tensors, through shared memory where the server shares
        this host's. The segment's name is unlinked when this engine lets go of it, right after SGLang answered
        (its rank has mapped it by then; the mapping lives on as long as SGLang keeps the adapter), so nothing is
        left in /dev/shm whatever SGLang did with the call. With several TP ranks, SGLang answers when rank 0 has
        loaded: the name is kept _LATE_RANKS_S longer for the others to map it."""

        def build() -> tuple[bytes, _PackedTensors]:
            params, spec, base_name = adapter_tensor_views(blob)
            return self._tensor_body(key, params, spec, base_name, server, self._shares_memory(server))

        request, packed = await asyncio.to_thread(build)
        try:
            return await self._load_call(server, key, "/load_lora_adapter_from_tensors", request)
        finally:
            if packed.shared and server.tp_size > 1:
                asyncio.get_running_loop().call_later(_LATE_RANKS_S, packed.release)
            else:
                packed.release()

    def _tensor_body(self, key: str, params: dict, spec, base_name: str, server: SGLangServer, shared: bool
                     ) -> tuple[bytes, _PackedTensors]:
        """The JSON body of /load_lora_adapter_from_tensors: the PEFT config and the PEFT-named tensors (expert
        LoRA in the form SGLang serves, tensor_expert_form) in the transfer dtype, pickled as views of one buffer
        (_PackedTensors), the same pickle once per TP rank; and the buffer, which must outlive the call when shared."""
        dtype = self._transfer_dtype(spec, server)
        config = peft_adapter_config(spec, base_name)
        if spec.has_experts:
            # SGLang serves expert LoRA from per-expert keys or 3-D expert tensors; PEFT's target_parameters layout
            # would be accepted with its experts silently dropped (adapter_format.sglang_packing).
            params, parts, config = sglang_packing(params, spec, form=self.tensor_expert_form)
            config["base_model_name_or_path"] = base_name
        else:
            parts = None
        packed = _PackedTensors(params, dtype, shared, parts)
        encoded = base64.b64encode(packed.pickled())
        if not packed.shared:
            packed.release()  # its bytes are in the pickle
        config.pop("loraplane_seed", None)
        config.pop("loraplane_expert_layout", None)
        head = json.dumps({"lora_name": key, "config_dict": config}).encode()[:-1]
        copies = b",".join([b'"' + encoded + b'"'] * server.tp_size)
        return head + b', "serialized_named_tensors": [' + copies + b"]}", packed

    async def unload_adapter(self, key: str) -> None:
        server = self._route.pop(key, None)  # first: from now on no request can name it
        if server is None:
            return
        server.adapters.discard(key)
        status, body = await self._request(server, "/unload_lora_adapter", {"lora_name": key})
        if status != 200:
            log.warning("SGLang %s failed to unload %s: %s", server.url, key, body)
        await asyncio.to_thread(shutil.rmtree, self._adapter_dir(key), True)

    def _server_for(self, key: str | None) -> SGLangServer:
        if key is None:
            return self.servers[next(self._round_robin) % len(self.servers)]
        server = self._route.get(key)
        if server is None:
            raise errors.NotFound(f"adapter version {key} is not loaded", field="adapter")
        return server

    # ------------------------------------------------------------------ requests

    def _sampling_params(self, request: GenerationRequest, sample_index: int) -> dict:
        options = request.options
        params = {
            "max_new_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "top_k": options.top_k if options.top_k > 0 else -1,
            "stop_token_ids": sorted(set(options.stop_token_ids) | (set() if options.ignore_eos else set(self._eos))),
        }
        if options.ignore_eos:
            params["ignore_eos"] = True
        if options.stop_strings:
            params["stop"] = list(options.stop_strings)
        if options.seed is not None and self.send_seed and not options.greedy:
            params["sampling_seed"] = (options.seed * 1_000_003 + sample_index) % (2**63)
        return params

    async def _generate_call(self, server: SGLangServer, payload: dict) -> list[dict]:
        self._waiting += 1
        server.in_flight += 1
        try:
            status, body = await self._request(server, "/generate", payload)
        finally:
            self._waiting -= 1
            server.in_flight -= 1
        if status != 200:
            raise errors.Unavailable(f"SGLang {server.url} /generate failed with HTTP {status}: {str(body)[:500]}")
        return body if isinstance(body, list) else [body]

    def _payload(self, request: GenerationRequest, indices: Sequence[int]) -> dict:
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
        server = self._server_for(request.adapter_key)
        outputs = await self._generate_call(server, self._payload(request, range(request.num_samples)))
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
        self._server_for(request.adapter_key)  # an unknown version fails here, before any call starts
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
        server = self._server_for(adapter_key)
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


def _write_peft_dir(blob: bytes, directory: Path, header: tuple | None = None) -> Path:
    """The PEFT directory SGLang loads. A float32 or bfloat16 blob already is the adapter_model.safetensors SGLang
    reads (PEFT tensor names; its extra metadata is ignored; SGLang casts to the server's dtype, which is exact from
    either), so its bytes are written as they are, without parsing and re-serializing them (for an 8B-shape
    rank-32 adapter, 335 MB, that pair cost as much as SGLang's load; a bf16 version stays half of it). Other
    dtypes go through materialize_peft_dir, which writes float32. ``header``: the blob's ``adapter_header`` where the
    caller already read it."""
    spec, base_name, dtypes = header or adapter_header(blob)
    if spec.has_experts:
        return materialize_sglang_dir(blob, directory)  # per-expert keys: the expert layout SGLang serves
    if any(dtype not in ("F32", "BF16") for dtype in dtypes.values()):
        return materialize_peft_dir(blob, directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = peft_adapter_config(spec, base_name)
    config.pop("loraplane_seed", None)
    for name, data in (("adapter_model.safetensors", blob),
                       ("adapter_config.json", json.dumps(config, indent=2, sort_keys=True).encode())):
        temporary = directory / f".{name}.tmp"
        temporary.write_bytes(data)
        temporary.replace(directory / name)
    return directory


class _PackedTensors:
    """Named tensors copied, cast to one dtype, into one flat buffer (a tensor object named twice, such as the A
    gate_proj and up_proj share, is stored once), and pickled as views of it that SGLang's restricted unpickler
    rebuilds (torch.multiprocessing.reductions.rebuild_tensor: every name the pickle needs is torch's). The buffer
    is pickled once (the pickle memo), not per tensor: plain pickle of 37k tensors costs a torch.save per tensor
    on each side, and a view pickles its whole storage.

    shared: the buffer is a POSIX shared-memory segment (torch's file_system sharing, /dev/shm) and the pickle
    carries its name, not its bytes; each SGLang rank (a process of its own) maps it once (torch.multiprocessing.
    reductions.rebuild_storage_filename, one storage object per pickle). torch's own reduction adds a reference
    for each reader, which leaks the segment when the reader never comes (a refused call, a dead server); none is
    added here, so the segment's name goes when release() drops this buffer (a reader's rebuild takes back the
    reference its mapping added), and the memory when the last mapping goes. Falls back to private memory when
    /dev/shm has no room for it (a full tmpfs would kill this process with SIGBUS mid-copy)."""

    def __init__(self, named: dict, dtype, shared: bool, parts: dict | None = None):
        import torch

        slots: dict[int, tuple[int, torch.Tensor]] = {}
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        total = 0
        for name, tensor in named.items():
            slot = slots.get(id(tensor))
            if slot is None:
                slot = slots[id(tensor)] = (total, tensor)
                total += tensor.numel()
            split = parts.get(name) if parts else None
            if split is None:
                self.layout[name] = (slot[0], tuple(tensor.shape))
                continue
            # A stacked expert tensor [E, rows, cols] goes in with one copy and is named by its per-expert slices
            # (adapter_format.sglang_packing): 37k copies of strided slices took 7 s at 48 layers on an idle H100
            # host and 100 s beside a busy process, against 0.8 s for the 576 stacked copies (docs/benchmarks.md).
            _, rows, cols = tensor.shape
            for part, expert, first, end in split:
                self.layout[part] = (slot[0] + (expert * rows + first) * cols, (end - first, cols))
        nbytes = max(1, total * torch.empty((), dtype=dtype).element_size())
        self.shared = shared and _shm_room(nbytes)
        storage = None
        if self.shared:
            try:
                storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
            except RuntimeError as exc:  # no torch_shm_manager, no /dev/shm: the bytes go inline
                log.warning("no shared memory for adapter tensors (%s); sending them in the request", exc)
                self.shared = False
        if storage is None:
            storage = torch.UntypedStorage(nbytes)
        self.dtype = dtype
        self.flat = torch.empty(0, dtype=dtype).set_(storage, 0, (total,), (1,))
        for offset, tensor in slots.values():
            self.flat[offset:offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        self.nbytes = nbytes

    def pickled(self) -> bytes:
        import torch

        if self.shared:
            manager, handle, nbytes = self.flat.untyped_storage()._share_filename_cpu_()
            storage = _SharedStorage(manager, handle, nbytes, self.dtype)
        else:
            storage = torch.TypedStorage(wrap_storage=self.flat.untyped_storage(), dtype=self.dtype, _internal=True)
        views = {name: _View(storage, offset, shape) for name, (offset, shape) in self.layout.items()}
        return pickle.dumps(views, protocol=pickle.HIGHEST_PROTOCOL)

    def release(self) -> None:
        self.flat = None


class _View:
    """Pickles as rebuild_tensor(Tensor, storage, (offset, shape, contiguous strides, no grad)); one `storage`
    object shared by every view, so the pickle holds it once."""

    __slots__ = ("offset", "shape", "storage")

    def __init__(self, storage, offset: int, shape: tuple[int, ...]):
        self.storage, self.offset, self.shape = storage, offset, shape

    def __reduce__(self):
        import torch
        from torch.multiprocessing.reductions import rebuild_tensor

        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return rebuild_tensor, (torch.Tensor, self.storage, (self.offset, self.shape, tuple(reversed(strides)), False))


class _SharedStorage:
    """Pickles as a typed storage mapped from shared-memory segment `handle` (torch's manager socket `manager`)."""

    def __init__(self, manager: bytes, handle: bytes, nbytes: int, dtype):
        self.args = (manager, handle, nbytes)
        self.dtype = dtype

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_typed_storage

        return rebuild_typed_storage, (_SharedSegment(*self.args), self.dtype)


class _SharedSegment:
    def __init__(self, manager: bytes, handle: bytes, nbytes: int):
        self.args = (manager, handle, nbytes)

    def __reduce__(self):
        import torch
        from torch.multiprocessing.reductions import rebuild_storage_filename

        return rebuild_storage_filename, (torch.UntypedStorage, *self.args)


# How long a shared segment's name outlives SGLang's answer when the server has several TP ranks (see _load_tensors).
_LATE_RANKS_S = 60.0


def _shm_room(nbytes: int) -> bool:
    """Whether /dev/shm has room for `nbytes` more (with 256 MB to spare)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= nbytes + (256 << 20)


def _base_model_facts(name: str):
    """The base model's config, tokenizer, vocabulary, context length and EOS ids, without its weights when it has
    a checkpoint directory (the module tree is built on the meta device; the tokenizer and generation config are
    read as `load_base_model` reads them). A model built in memory (`tiny`) is loaded whole: it is small and its
    weights are what SGLang is given."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from loraplane.models import load_base_model
    from loraplane.models.base import checkpoint_directory, from_hf_model

    directory = checkpoint_directory(name)
    if directory is None:
        return load_base_model(name, "cpu")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    return from_hf_model(name, model, tokenizer, device="meta")


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
