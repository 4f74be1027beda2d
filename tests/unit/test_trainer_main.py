"""The trainer's backends as one registry and its one command line: `python -m trainer_svc` and
`torchrun ... -m trainer_svc.torchrun` offer the registry's backends, add the chosen one's own options, take their
defaults from one place, and hand the process to the entry's launcher; nothing under backends/ imports the layers
above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from loraplane import errors
from trainer_svc.__main__ import parse_args
from trainer_svc.backends import BACKEND_NAMES, PROCESS, TORCHRUN, BackendConfig, backend_entry, build_backend
from trainer_svc.service import TrainerLimits
from trainer_svc.torchrun import parse_args as torchrun_args

BACKENDS_DIR = Path(__file__).resolve().parents[2] / "trainer_svc" / "backends"
# The trainer's modules above its backends: a backend is handed what it needs from them, it never imports them.
ABOVE_BACKENDS = ("trainer_svc.server", "trainer_svc.service", "trainer_svc.servicer", "trainer_svc.__main__",
                  "trainer_svc.torchrun", "trainer_svc.fleet", "trainer_svc.scheduler", "trainer_svc.journal",
                  "trainer_svc.durability")


def test_the_registry_names_every_backend_with_its_launcher_and_refuses_an_unknown_one():
    assert BACKEND_NAMES == ("torch", "megatron")
    assert backend_entry("torch").launcher == PROCESS and backend_entry("megatron").launcher == TORCHRUN
    assert backend_entry("megatron").needs and all(backend_entry(n).lacks for n in BACKEND_NAMES)
    with pytest.raises(errors.InvalidArgument, match="'torch' or 'megatron'") as caught:
        build_backend("jax", "tiny")
    assert caught.value.field == "backend"


def test_both_entry_points_share_the_options_and_the_defaults():
    limits = TrainerLimits()
    plain, megatron, torchrun = parse_args([]), parse_args(["--backend", "megatron"]), torchrun_args([])
    assert plain.backend == "torch" and plain.backend_options == ("dtype",) and plain.dtype == "float32"
    assert megatron.backend == torchrun.backend == "megatron"
    assert vars(megatron) == vars(torchrun)
    assert "tensor_parallel_size" in torchrun.backend_options and "dtype" in torchrun.backend_options
    for args in (plain, torchrun):
        assert (args.device_slots, args.max_lora_rank, args.max_fused_adapters, args.gap_timeout_s) == (
            limits.device_slots, limits.max_lora_rank, limits.max_fused_adapters, limits.gap_timeout_s)
    assert torchrun_args(["--tensor-parallel-size", "2", "--port", "5"]).tensor_parallel_size == 2


def test_the_torch_entry_builds_its_backend_and_hands_it_to_serve():
    from trainer_svc.backends.torch_backend import TorchBackend

    served = []

    async def serve(backend):
        served.append(backend)

    backend_entry("torch").launch(BackendConfig("tiny"), serve)
    assert len(served) == 1 and isinstance(served[0], TorchBackend) and served[0].base.name == "tiny"


def test_the_torch_backend_loads_its_base_in_the_dtype_asked_and_keeps_lora_in_float32():
    import torch

    from loraplane.lora import LoraSpec

    args = parse_args(["--dtype", "bfloat16"])
    backend = build_backend("torch", "tiny", options={name: getattr(args, name) for name in args.backend_options})
    assert {p.dtype for p in backend.base.model.parameters()} == {torch.bfloat16}
    params = backend.init_params(LoraSpec.create(4, 8, ["q_proj"], seed=1,
                                                 available=tuple(backend.base.module_dims)))
    assert params and {p.dtype for p in params.values()} == {torch.float32}
    assert {p.dtype for p in build_backend("torch", "tiny").base.model.parameters()} == {torch.float32}
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "float16"])


def test_the_torch_dtype_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv("LORAPLANE_TRAINER_DTYPE", "bfloat16")  # how `loraplane up` hands it to its trainer
    assert parse_args([]).dtype == "bfloat16"
    assert parse_args(["--dtype", "float32"]).dtype == "float32"


def test_nothing_under_backends_imports_the_trainer_above_it():
    offenders = []
    for path in sorted(BACKENDS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(BACKENDS_DIR)}: {name}" for name in names
                          if name.startswith(ABOVE_BACKENDS)]
    assert offenders == []


def test_megatron_options_are_offered_only_with_the_megatron_backend():
    # Both at once: each is mostly the trainer's imports.
    megatron, torch_help = [subprocess.Popen([sys.executable, "-m", "trainer_svc", *args, "--help"],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                            for args in (["--backend", "megatron"], [])]
    megatron_out, megatron_err = megatron.communicate(timeout=120)
    torch_out, _ = torch_help.communicate(timeout=120)
    assert megatron.returncode == 0, megatron_err
    assert "--tensor-parallel-size" in megatron_out
    assert torch_help.returncode == 0 and "--tensor-parallel-size" not in torch_out
