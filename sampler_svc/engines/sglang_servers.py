"""The SGLang servers an SGLangEngine drives, and their lifecycle: launched here (one per GPU) or given by URL, waited
for until healthy, asked what they run (TP size, dtype, --max-loaded-loras), cleared of names an earlier sampler
left, and stopped. Also the one pooled HTTP session every call to them goes through.

Transport: one pooled aiohttp session per engine, no thread per request and no connection cap (the engine must not
throttle below SGLang's own batch size: a 20-thread pool once held it to a third of SGLang's throughput).

Logprobs: SGLang returns logprobs of the temperature-scaled distribution unless the server runs with
SGLANG_RETURN_ORIGINAL_LOGPROB=True; servers launched here get it, so logprobs mean the same as the torch engine's
(unmodified distribution). Servers given by URL must be started with it, and with
SGLANG_EXTERNAL_MODEL_PACKAGE=sampler_svc.engines.sglang_models for LoRA on a text-only Qwen3.5 checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loraplane import errors

log = logging.getLogger(__name__)

# The model classes launched servers load in place of SGLang's own (sampler_svc/engines/sglang_models), importable
# there from the project's root whatever the server's working directory.
EXTERNAL_MODELS = "sampler_svc.engines.sglang_models"
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


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


class SGLangHTTP:
    """The pooled aiohttp session to the servers, opened on the serving loop (`open`)."""

    def __init__(self, request_timeout_s: float = 600.0):
        self.request_timeout_s = request_timeout_s
        self.session = None  # aiohttp.ClientSession

    def open(self) -> None:
        import aiohttp

        # No per-host connection cap: every request the sampler accepts goes to SGLang at once and SGLang's own
        # scheduler decides the batch. Idle connections are dropped before uvicorn's 5 s keep-alive closes them on
        # its side: reusing one it closed fails the request with ServerDisconnectedError.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4),
            json_serialize=json.dumps)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def request(self, server: SGLangServer, path: str, payload: dict | bytes | None = None, *,
                      timeout: float | None = None) -> tuple[int, object]:
        """One HTTP call: (status, parsed JSON body or text). `payload` as bytes is an already encoded JSON body (the
        adapter tensors: hundreds of MB that json.dumps would scan again)."""
        import aiohttp

        method = "GET" if payload is None else "POST"
        body_args = ({"data": payload, "headers": {"Content-Type": "application/json"}}
                     if isinstance(payload, bytes) else {"json": payload})
        try:
            async with self.session.request(method, server.url + path, **body_args,
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


@dataclass
class ServerLauncher:
    """Brings the servers up (launching `launch` of them, one per GPU) and down. The flags a launched server gets are
    the engine's LoRA limits; a server given by URL must have been started with matching ones."""

    http: SGLangHTTP
    work_dir: Path
    max_lora_rank: int = 64
    max_loras_per_batch: int = 8
    max_loaded_loras: int = 64
    lora_target_modules: Sequence[str] = ("all",)
    extra_server_args: Sequence[str] = ()
    startup_timeout_s: float = 900.0
    # Every server this engine drives, listed as soon as it is known (so `stop` ends a launched one even when another
    # failed to come up).
    servers: list[SGLangServer] = field(default_factory=list, init=False)

    async def start(self, urls: Sequence[str], launch: int, base_model_name: str, base) -> list[SGLangServer]:
        """The servers at `urls` and `launch` new ones serving `base` (a loaded BaseModel, meta weights unless it has
        no checkpoint), each healthy and described; those given by URL emptied of adapters."""
        self.servers[:] = [SGLangServer(url.rstrip("/")) for url in urls]
        if launch:
            model_dir = await asyncio.to_thread(self._model_dir, base_model_name, base)
            for index in range(launch):
                self.servers.append(await asyncio.to_thread(self._launch_server, model_dir, index))
        for server in self.servers:
            await self._wait_healthy(server)
            await self._read_server_info(server)
            if server.process is None:
                await self._drop_leftovers(server)
        return self.servers

    async def _read_server_info(self, server: SGLangServer) -> None:
        """Tensor parallel size (a tensor load carries one copy per rank) and the serving dtype."""
        try:
            status, body = await self.http.request(server, "/server_info", timeout=30)
        except errors.Unavailable:
            return
        if status == 200 and isinstance(body, dict):
            server.tp_size = max(1, int(body.get("tp_size") or 1))
            server.dtype = str(body.get("dtype") or "auto")
            server.max_loaded = int(body.get("max_loaded_loras") or 0)

    async def _drop_leftovers(self, server: SGLangServer) -> None:
        """A server given by URL may still hold names a previous sampler loaded (it crashed, or restarted). Only
        this sampler's manager decides what exists, so everything found there is unloaded first."""
        status, body = await self.http.request(server, "/v1/models", timeout=30)
        if status != 200 or not isinstance(body, dict):
            return
        for model in body.get("data", []):
            if model.get("parent"):
                log.info("unloading %s left on %s by an earlier sampler", model.get("id"), server.url)
                await self.http.request(server, "/unload_lora_adapter", {"lora_name": model["id"]})

    def _model_dir(self, base_model_name: str, base) -> Path:
        """The directory SGLang loads: the checkpoint itself when the model has one (its weights in their own
        dtype: bf16 stays bf16, nothing is rewritten), else (`tiny`, built in memory) a one-time save."""
        from loraplane.models.base import checkpoint_directory

        checkpoint = checkpoint_directory(base_model_name)
        if checkpoint is not None:
            return checkpoint
        directory = self.work_dir / "base" / base_model_name.replace("/", "_")
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
        if "SGLANG_EXTERNAL_MODEL_PACKAGE" not in env:  # an operator's own package wins
            env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = EXTERNAL_MODELS
            env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
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
                status, _ = await self.http.request(server, "/health", timeout=5)
                if status == 200:
                    return
            except errors.Unavailable:
                pass
            await asyncio.sleep(1.0)
        raise errors.Unavailable(f"SGLang server {server.url} not healthy after {self.startup_timeout_s:.0f}s")

    async def stop(self) -> None:
        """Ends the servers launched here (a server given by URL is someone else's)."""
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                os.killpg(server.process.pid, 15)
                try:
                    await asyncio.to_thread(server.process.wait, 30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.process.pid, 9)
