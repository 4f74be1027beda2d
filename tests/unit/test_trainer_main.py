"""`python -m trainer_svc --backend megatron` hands over to the megatron launcher with every other option."""

from __future__ import annotations

import subprocess
import sys

from trainer_svc.__main__ import _without_backend_flag


def test_backend_flag_is_removed_in_both_spellings_and_nothing_else():
    assert _without_backend_flag(["--backend", "megatron", "--port", "5", "--base-model", "tiny"]) == [
        "--port", "5", "--base-model", "tiny"]
    assert _without_backend_flag(["--port", "5", "--backend=megatron"]) == ["--port", "5"]
    assert _without_backend_flag(["--port", "5"]) == ["--port", "5"]


def test_megatron_backend_is_served_by_its_launcher():
    megatron = subprocess.run([sys.executable, "-m", "trainer_svc", "--backend", "megatron", "--help"],
                              capture_output=True, text=True, timeout=120, check=False)
    assert megatron.returncode == 0, megatron.stderr
    assert "--tensor-parallel-size" in megatron.stdout
    torch_help = subprocess.run([sys.executable, "-m", "trainer_svc", "--help"],
                                capture_output=True, text=True, timeout=120, check=False)
    assert torch_help.returncode == 0 and "--tensor-parallel-size" not in torch_help.stdout
