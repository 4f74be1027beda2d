"""The sampler's engines, one registry entry each: name -> how to build it, what it needs, what it lacks.

The server builds its engine from here (`build_engine`), and the command lines offer and check `ENGINE_NAMES`. A new
engine is a module beside these with an `Engine` subclass (engines/base.py) plus one `EngineEntry` below. Factories
import their module only when called, so reading the registry costs no torch, aiohttp or SGLang import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplane import errors
from sampler_svc.engines.base import Engine


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from. `options`: the engine's own keyword arguments (SGLangEngine's max_lora_rank,
    adapter_transport, ...), passed through as they are."""

    base_model: str
    device: str = "cpu"
    data_dir: Path = Path(".loraplane")
    max_batch_rows: int = 16
    server_urls: Sequence[str] = ()
    launch_servers: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineEntry:
    name: str
    description: str
    build: Callable[[EngineConfig], Engine]
    # What the host must provide for it to start (it fails at start-up, never at the first request, without it).
    needs: tuple[str, ...] = ()
    # What of the sampler contract it does not serve.
    lacks: tuple[str, ...] = ()
    # Whether it drives inference servers outside this process (server_urls / launch_servers apply).
    uses_servers: bool = False


def _torch(config: EngineConfig) -> Engine:
    from sampler_svc.engines.torch_engine import TorchEngine

    return TorchEngine(config.base_model, device=config.device, max_batch_rows=config.max_batch_rows)


def _sglang(config: EngineConfig) -> Engine:
    from sampler_svc.engines.sglang_engine import SGLangEngine

    return SGLangEngine(config.base_model, urls=list(config.server_urls), launch_servers=config.launch_servers,
                        work_dir=config.data_dir / "sglang", **config.options)


ENGINES: dict[str, EngineEntry] = {entry.name: entry for entry in (
    EngineEntry("torch", "in-process batched multi-LoRA generation (CPU or GPU; the default)", _torch),
    EngineEntry("sglang", "SGLang servers over HTTP: running ones (--sglang-url) or launched one per GPU", _sglang,
                needs=(("running SGLang servers started with SGLANG_RETURN_ORIGINAL_LOGPROB=True, or the sglang "
                        "package and a GPU per launched server"),),
                uses_servers=True),
)}
ENGINE_NAMES = tuple(ENGINES)


def engine_entry(name: str) -> EngineEntry:
    entry = ENGINES.get(name)
    if entry is None:
        raise errors.InvalidArgument(f"unknown engine {name!r}: use {' or '.join(repr(n) for n in ENGINE_NAMES)}",
                                     field="engine")
    return entry


def build_engine(name: str, config: EngineConfig) -> Engine:
    return engine_entry(name).build(config)


__all__ = ["ENGINES", "ENGINE_NAMES", "EngineConfig", "EngineEntry", "build_engine", "engine_entry"]
