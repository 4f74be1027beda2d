"""Drives one or more SGLang servers (0.5.x) over their HTTP API. SGLangEngine is the Engine interface over four
parts, one concern each:

- sglang_servers.py: the servers' lifecycle (launch, health, what they run, stop) and the pooled HTTP session;
- sglang_placement.py: which server a version lives on and a request goes to (the sampler placement policy of
  loraplane/routing.py), the authority on which versions exist;
- sglang_transport.py: adapter versions to and from a server (files or tensors);
- sglang_generation.py: Sample, SampleStream and ComputeLogprobs as /generate calls (sglang_streams.py: the
  stream reader processes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from loraplane import errors
from loraplane.adapter_format import SGLANG_EXPERT_FORMS, SGLANG_SHARED_OUTER
from sampler_svc.engines.base import Engine, GenerationRequest, GenerationUpdate, LoadedAdapterInfo
from sampler_svc.engines.sglang_generation import Generation
from sampler_svc.engines.sglang_placement import ServerChoice
from sampler_svc.engines.sglang_servers import ServerLauncher, SGLangHTTP, SGLangServer
from sampler_svc.engines.sglang_streams import default_readers
from sampler_svc.engines.sglang_transport import AdapterTransport


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
        expert_form: str = "per_expert",
    ):
        if not urls and launch_servers < 1:
            raise errors.InvalidArgument("the sglang engine needs server URLs or launch_servers >= 1",
                                         field="sglang_urls")
        # None: LORAPLANE_SGLANG_STREAM_READERS or one per 4 cores (at most 4).
        readers = default_readers() if stream_readers is None else stream_readers
        if readers < 0:
            raise errors.InvalidArgument(f"stream_readers must be >= 0, not {stream_readers}", field="stream_readers")
        self._base_model_name = base_model
        self._urls = list(urls)
        self._launch = launch_servers
        self.work_dir = Path(work_dir)
        self.max_lora_rank = max_lora_rank
        self.http = SGLangHTTP(request_timeout_s)
        if expert_form not in SGLANG_EXPERT_FORMS:
            raise errors.InvalidArgument(f"expert_form must be one of {SGLANG_EXPERT_FORMS}, not {expert_form!r}",
                                         field="expert_form")
        server_args = list(extra_server_args)
        if expert_form == SGLANG_SHARED_OUTER:
            # The servers hold every MoE adapter's shared factors once (a third of Qwen3-30B-A3B's expert LoRA);
            # such a server takes shared-outer adapters only, and only as tensors (a PEFT directory is per-expert).
            if adapter_transport == "file":
                raise errors.InvalidArgument("adapter_transport: expert_form shared_outer needs the tensor transport, not file",
                                             field="adapter_transport")
            adapter_transport = "tensors"
            server_args.append("--experts-shared-outer-loras")
        self.transport = AdapterTransport(self.http, base_model, self.work_dir, max_lora_rank=max_lora_rank,
                                          adapter_transport=adapter_transport, tensor_expert_form=expert_form)
        self.launcher = ServerLauncher(self.http, self.work_dir, max_lora_rank=max_lora_rank,
                                       max_loras_per_batch=max_loras_per_batch, max_loaded_loras=max_loaded_loras,
                                       lora_target_modules=list(lora_target_modules),
                                       extra_server_args=server_args, startup_timeout_s=startup_timeout_s)
        self.choice = ServerChoice(self.launcher.servers)
        self.generation = Generation(self.http, self.choice, send_seed=send_seed, stream_readers=readers,
                                     stream_readers_from=stream_readers_from)
        self._vocab_size = 0
        self._max_context = 0

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
        return self.generation.waiting

    @property
    def running_requests(self) -> int:
        return sum(server.in_flight for server in self.servers)

    @property
    def servers(self) -> list[SGLangServer]:
        return self.launcher.servers

    @property
    def server_urls(self) -> list[str]:
        return [server.url for server in self.servers]

    @property
    def loaded_names(self) -> dict[str, str]:
        return self.choice.loaded_names

    # The adapter transport's knobs (sglang_transport.py), settable on the engine between loads, as benchmarks and
    # GPU tests compare them on one running engine.
    @property
    def adapter_transport(self) -> str:
        return self.transport.adapter_transport

    @adapter_transport.setter
    def adapter_transport(self, value: str) -> None:
        self.transport.adapter_transport = value

    @property
    def shared_memory_tensors(self) -> str:
        return self.transport.shared_memory_tensors

    @shared_memory_tensors.setter
    def shared_memory_tensors(self, value: str) -> None:
        self.transport.shared_memory_tensors = value

    @property
    def tensor_expert_form(self) -> str:
        return self.transport.tensor_expert_form

    @tensor_expert_form.setter
    def tensor_expert_form(self, value: str) -> None:
        self.transport.tensor_expert_form = value

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.http.open()
        # Vocabulary, context length and EOS come from the same base model the trainer uses; the weights SGLang
        # serves come from its checkpoint directory, so none are loaded here (an 8B model would cost 32 GB of host
        # memory and a minute for three numbers).
        base = await asyncio.to_thread(_base_model_facts, self._base_model_name)
        self.transport.checkpoint_dtype = str(getattr(base.config, "dtype", None)
                                              or getattr(base.config, "torch_dtype", "")).removeprefix("torch.")
        self.transport.family = base.family
        family_args = list(getattr(base.family, "sglang_server_args", ()))
        if family_args and family_args[0] not in self.launcher.extra_server_args:  # an operator's own choice wins
            self.launcher.extra_server_args.extend(family_args)
        self._vocab_size = base.vocab_size
        self._max_context = base.max_context_length
        self.generation.eos = list(base.eos_token_ids)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        await self.launcher.start(self._urls, self._launch, self._base_model_name, base)
        await self.generation.start()

    async def stop(self) -> None:
        await self.generation.stop()
        for key in self.choice.loaded_keys():
            try:
                await self.unload_adapter(key)
            except errors.Unavailable:
                break
        await self.launcher.stop()
        await self.http.close()

    # ------------------------------------------------------------------ adapters

    async def load_adapter(self, key: str, blob: bytes) -> LoadedAdapterInfo:
        with self.choice.placing(key) as server:
            info = await self.transport.load(server, key, blob)
            self.choice.placed(key, server)
        return info

    async def unload_adapter(self, key: str) -> None:
        server = self.choice.remove(key)  # first: from now on no request can name it
        if server is not None:
            await self.transport.unload(server, key)

    # ------------------------------------------------------------------ requests

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        return self.generation.generate(request)

    async def compute_logprobs(self, tokens: Sequence[int], adapter_key: str | None) -> list[float]:
        return await self.generation.compute_logprobs(tokens, adapter_key)


def _base_model_facts(name: str):
    """The base model's config, tokenizer, vocabulary, context length and EOS ids, without its weights when it has
    a checkpoint directory (the module tree is built on the meta device; the tokenizer and generation config are
    read as `load_base_model` reads them). A model built in memory (`tiny`) is loaded whole: it is small and its
    weights are what SGLang is given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from loraplane.models import load_base_model
    from loraplane.models.base import checkpoint_directory, from_hf_model, loading_config

    directory = checkpoint_directory(name)
    if directory is None:
        return load_base_model(name, "cpu")
    config = loading_config(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    return from_hf_model(name, model, tokenizer, device="meta")

