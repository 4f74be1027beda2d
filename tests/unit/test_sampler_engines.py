"""The sampler's engine registry (sampler_svc/engines/__init__.py): the one place an engine name is resolved."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loraplane import errors
from loraplane.config import Settings
from sampler_svc.engines import ENGINE_NAMES, ENGINES, EngineConfig, build_engine, engine_entry
from sampler_svc.server import build_engine as server_build_engine

ROOT = Path(__file__).resolve().parents[2]


def test_each_entry_builds_an_engine_of_its_own_name(tmp_path):
    assert ENGINE_NAMES == ("torch", "sglang")
    for name, entry in ENGINES.items():
        config = EngineConfig("tiny", data_dir=tmp_path, server_urls=("http://127.0.0.1:1",) if entry.uses_servers
                              else ())
        assert build_engine(name, config).name == entry.name == name


def test_the_server_builds_from_the_registry_with_its_settings(tmp_path):
    settings = Settings(data_dir=tmp_path, device="cpu")
    sglang = server_build_engine("sglang", "tiny", settings, sglang_urls=["http://127.0.0.1:1/"],
                                 sglang_options={"max_lora_rank": 8, "adapter_transport": "file"})
    assert (sglang.work_dir, sglang.max_lora_rank, sglang.adapter_transport) == (tmp_path / "sglang", 8, "file")
    torch_engine = server_build_engine("torch", "tiny", settings, max_batch_rows=3)
    assert (torch_engine.name, torch_engine.max_batch_rows) == ("torch", 3)


def test_an_unknown_engine_is_refused_naming_the_field_and_every_registered_engine():
    for lookup in (lambda: engine_entry("vllm"), lambda: server_build_engine("vllm", "tiny", Settings())):
        with pytest.raises(errors.InvalidArgument) as refused:
            lookup()
        assert refused.value.field == "engine"
        assert all(repr(name) in refused.value.message for name in ENGINE_NAMES)


def test_an_engine_that_drives_servers_without_any_is_refused_at_build():
    with pytest.raises(errors.InvalidArgument) as refused:
        build_engine("sglang", EngineConfig("tiny"))
    assert refused.value.field == "sglang_urls"


def test_reading_the_registry_imports_no_engine():
    probe = ("import sys, sampler_svc.engines as e; assert e.ENGINE_NAMES; "
             "print(sorted(m for m in ('torch', 'aiohttp', 'sglang', 'sampler_svc.engines.torch_engine', "
             "'sampler_svc.engines.sglang_engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
