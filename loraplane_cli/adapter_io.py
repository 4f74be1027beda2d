"""`loraplane adapters import|export`: adapters in and out of the registry in the layouts other tools use.

- import: a Tinker-layout adapter directory (adapter_model.safetensors + adapter_config.json, as `tinker checkpoint
  download` or tinker-cookbook's weights tools hold it; the layout is detected from its keys) becomes a new registry
  adapter with a training-state version (the params, zero AdamW moments, step 0: what LoadState starts training
  from) and a weights version (what samplers serve). A directory in another layout is refused naming the key.
- export: a weights version as HF PEFT (`--format peft`: routed experts per expert, the layout HF PEFT, vLLM and
  SGLang load) or Tinker's layout (`--format tinker`: 3-D experts, a shared-outer adapter's shared side once).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import typer

from loraplane.errors import InvalidArgument, LoraplaneError
from loraplane.registry_client import RegistryClient, VersionKind, lora_config
from loraplane_cli.product import DataDirOption, RegistryOption, _fail, _service, adapters_app, console

EXPORT_FORMATS = ("peft", "tinker")
IMPORTED_FROM = "imported_from"


@dataclass(frozen=True)
class Imported:
    name: str
    state_version: int
    weights_version: int
    expert_layout: str


async def import_tinker_adapter(registry: RegistryClient, directory: str | Path, name: str, *,
                                base_model: str = "", keep_last: int = 0) -> Imported:
    """Reads a Tinker-layout adapter directory and publishes it as the new adapter `name`: its LoRA config (rank,
    alpha, targets, expert layout read from the tensors), a training-state version, then a weights version."""
    # Imported here, as in every command of the CLI: torch and the model registry cost every `loraplane` call
    # (up, down, status...) ~3 s otherwise.
    import torch

    from loraplane.adapter_format import TrainingState, read_tinker_dir, serialize_adapter, serialize_training_state

    params, spec, config_base = await asyncio.to_thread(read_tinker_dir, directory)
    base = base_model or config_base
    await registry.create_adapter(
        name, lora_config=lora_config(spec.rank, spec.effective_alpha, spec.target_modules, spec.seed, "float32",
                                      spec.expert_layout if spec.has_experts else ""),
        base_model=base, keep_last=keep_last, metadata={IMPORTED_FROM: "tinker"})
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    state = TrainingState(params=params, exp_avg=zeros, exp_avg_sq=zeros, step=0, spec=spec, base_model_name=base)
    state_blob = await asyncio.to_thread(serialize_training_state, state)
    state_version = await registry.publish(name, state_blob, kind=VersionKind.TRAINING_STATE,
                                           metadata={IMPORTED_FROM: "tinker"})
    weights_blob = await asyncio.to_thread(serialize_adapter, params, spec, base)
    weights_version = await registry.publish(name, weights_blob, metadata={IMPORTED_FROM: "tinker"})
    return Imported(name, state_version.version, weights_version.version, spec.expert_layout)


async def export_adapter(registry: RegistryClient, name: str, directory: str | Path, *, version: int = 0,
                         alias: str = "", fmt: str = "peft") -> Path:
    """Writes a weights version of `name` (the latest when neither `version` nor `alias`) to `directory` as
    adapter_model.safetensors + adapter_config.json in `fmt` (EXPORT_FORMATS)."""
    if fmt not in EXPORT_FORMATS:
        raise InvalidArgument(f"format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}", field="format")
    stored, blob = await registry.download(name, version=version, alias=alias)
    if stored.kind != VersionKind.WEIGHTS:
        raise InvalidArgument(f"{name} v{stored.version} is a training state; export takes a weights version",
                              field="version")
    from loraplane.adapter_format import materialize_peft_dir, materialize_tinker_dir

    write = materialize_peft_dir if fmt == "peft" else materialize_tinker_dir
    return await asyncio.to_thread(write, blob, directory)


def _registry(registry: str | None, data_dir: Path | None) -> RegistryClient:
    service = _service(registry=registry, data_dir=data_dir)
    return RegistryClient(service.registry_address, security=service.security)


@adapters_app.command("import")
def adapters_import(directory: Path, name: str = typer.Option(..., "--name", help="The new adapter's name."),
                    base_model: str = typer.Option("", help="Base model (default: the adapter_config's)."),
                    registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """Import a Tinker-layout adapter directory as a new adapter (a training state to train on, and weights)."""
    async def run() -> Imported:
        async with _registry(registry, data_dir) as client:
            return await import_tinker_adapter(client, directory, name, base_model=base_model)
    try:
        done = asyncio.run(run())
    except (LoraplaneError, ValueError) as exc:
        raise _fail(exc) from None
    console.print(f"imported {done.name} ({done.expert_layout}): training state v{done.state_version}, weights "
                  f"v{done.weights_version}")


@adapters_app.command("export")
def adapters_export(name: str, directory: Path,
                    version: int = typer.Option(0, help="Weights version (0 = latest)."),
                    alias: str = typer.Option("", help="Version alias instead of a number."),
                    fmt: str = typer.Option("peft", "--format", help="peft (HF PEFT, per expert) | tinker"),
                    registry: str = RegistryOption, data_dir: Path = DataDirOption) -> None:
    """Export a weights version as HF PEFT or Tinker's adapter layout."""
    async def run() -> Path:
        async with _registry(registry, data_dir) as client:
            return await export_adapter(client, name, directory, version=version, alias=alias, fmt=fmt)
    try:
        written = asyncio.run(run())
    except (LoraplaneError, ValueError) as exc:
        raise _fail(exc) from None
    console.print(f"wrote {written}")
