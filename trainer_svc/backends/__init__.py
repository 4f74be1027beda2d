"""The trainer's backends, one registry entry each: name -> how to build it, how its processes are launched, its own
command-line options, what it needs and what it lacks.

`start_trainer_server` builds a named backend from here (`build_backend`), and the one command line
(`python -m trainer_svc`, `torchrun ... -m trainer_svc.torchrun`) offers `BACKEND_NAMES`, adds the chosen backend's
options and hands the process over to its `launch`. A new backend is a module beside these with a `TrainerBackend`
subclass (backends/base.py) plus one `BackendEntry` below. Entries import their module only when called, so reading
the registry costs no megatron-core import. Nothing here imports the service or the server above it: a launcher is
given the function that serves a built backend.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplane import errors
from trainer_svc.backends.base import TrainerBackend

# How a backend's processes start: one process (`python -m trainer_svc`), or one per GPU under torchrun with rank 0
# serving gRPC and driving the others.
PROCESS = "process"
TORCHRUN = "torchrun"


@dataclass(frozen=True)
class BackendConfig:
    """What a backend is built from. `options`: the backend's own command-line options (its `add_arguments`), by
    their argparse names, as they are."""

    base_model: str
    device: str = "cpu"
    device_slots: int = 8
    max_fused_adapters: int = 8
    options: Mapping[str, Any] = field(default_factory=dict)


# Serves a built backend until shutdown (trainer_svc/__main__.py gives it); a launcher calls it on the serving process.
Serve = Callable[[TrainerBackend], Awaitable[None]]


def _no_arguments(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    return ()


def _launch_in_process(entry: BackendEntry) -> Callable[[BackendConfig, Serve], None]:
    def launch(config: BackendConfig, serve: Serve) -> None:
        async def run() -> None:
            # Loading a real model takes a while: off the loop, as start_trainer_server does.
            await serve(await asyncio.to_thread(entry.build, config))

        asyncio.run(run())
    return launch


@dataclass(frozen=True)
class BackendEntry:
    name: str
    description: str
    # One backend in this process (start_trainer_server, tests, the in-process launcher).
    build: Callable[[BackendConfig], TrainerBackend]
    launcher: str = PROCESS
    # Runs the trainer's process(es) from its command line, calling `serve` with the built backend where gRPC is
    # served; None: build it here and serve it.
    launch_with: Callable[[BackendConfig, Serve], None] | None = None
    # Adds the backend's own command-line options; returns their argparse names (they go to BackendConfig.options).
    add_arguments: Callable[[argparse.ArgumentParser], tuple[str, ...]] = _no_arguments
    # What the host must provide for it to start.
    needs: tuple[str, ...] = ()
    # What of the trainer contract or its deployments it does not do.
    lacks: tuple[str, ...] = ()

    def launch(self, config: BackendConfig, serve: Serve) -> None:
        (self.launch_with or _launch_in_process(self))(config, serve)


def _torch(config: BackendConfig) -> TrainerBackend:
    import torch

    from trainer_svc.backends.torch_backend import TorchBackend

    dtype = getattr(torch, config.options.get("dtype") or "float32")
    return TorchBackend(config.base_model, device=config.device, dtype=dtype)


def _torch_arguments(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    from loraplane.config import Settings

    group = parser.add_argument_group("torch backend")
    actions = [
        group.add_argument("--dtype", choices=["float32", "bfloat16"], default=Settings().trainer_dtype,
                           help="the base model's weights (LoRA masters, gradients and AdamW moments stay float32): "
                                "bfloat16 on a GPU halves their memory and runs its bf16 kernels, as a PEFT loop "
                                "in bf16 does; float32 is the CPU's bit-exact reference (LORAPLANE_TRAINER_DTYPE)"),
    ]
    return tuple(action.dest for action in actions)


def _megatron(config: BackendConfig) -> TrainerBackend:
    from trainer_svc.backends.megatron.launch import build

    return build(config)


def _megatron_launch(config: BackendConfig, serve: Serve) -> None:
    from trainer_svc.backends.megatron.launch import launch

    launch(config, serve)


def _megatron_arguments(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    from trainer_svc.backends.megatron.launch import add_arguments

    return add_arguments(parser)


BACKENDS: dict[str, BackendEntry] = {entry.name: entry for entry in (
    BackendEntry("torch", "HF transformers models in this process, CPU or GPU (the default)", _torch,
                 add_arguments=_torch_arguments, lacks=("tensor, pipeline and expert parallelism across GPUs",)),
    BackendEntry("megatron", "megatron-core GPTModel, tensor/data/expert parallel, one process per GPU under torchrun",
                 _megatron, launcher=TORCHRUN, launch_with=_megatron_launch, add_arguments=_megatron_arguments,
                 needs=("CUDA GPUs", "the megatron extra (megatron-core)"),
                 lacks=("CPU training (only through the test shims)",)),
)}
BACKEND_NAMES = tuple(BACKENDS)


def backend_entry(name: str) -> BackendEntry:
    entry = BACKENDS.get(name)
    if entry is None:
        raise errors.InvalidArgument(f"unknown trainer backend {name!r}: use "
                                     f"{' or '.join(repr(n) for n in BACKEND_NAMES)}", field="backend")
    return entry


def build_backend(name: str, base_model: str, device: str = "cpu", **config: Any) -> TrainerBackend:
    """The named backend, built in this process (`config`: the other BackendConfig fields)."""
    return backend_entry(name).build(BackendConfig(base_model, device, **config))
