"""bench/trainer_moe.py's CPU-side parts on the tiny MoE shape (seconds): the PEFT loop and the megatron contenders
train the same tokens from the same start (first losses agree), the ratios and slot sizes are reported, the EP mode
runs under torchrun over gloo, and the active-parameter count behind the MFU is the real models'.

The runs are child processes: the megatron backend initializes torch.distributed."""

from __future__ import annotations

import json
import sys

import torch

from bench import trainer_moe
from tests.e2e.test_megatron_cpu import run, torchrun


def test_single_gpu_mode_alternates_peft_and_the_trainer_on_the_same_data(tmp_path):
    out = tmp_path / "moe.json"
    run([sys.executable, "bench/trainer_moe.py", "--shape", "tiny-moe", "--device", "cpu", "--datums", "4",
         "--seq-len", "16", "--rounds", "2", "--warmup", "1", "--rank", "4",
         "--contenders", "per_expert:1,shared_outer:1,shared_outer:2", "--out", str(out)], timeout=240)
    results = json.loads(out.read_text())
    contenders = results["contenders"]
    assert list(contenders) == ["peft", "megatron/per_expert/1t", "megatron/shared_outer/1t",
                                "megatron/shared_outer/2t"]
    for label, entry in contenders.items():
        assert entry["error"] is None, label
        assert len(entry["times_ms"]) == 2 and entry["tokens_per_s_median"] > 0
    assert results["tokens_per_step"] == 64 and results["n_active_params"] < results["n_params"]
    # Same random model, same tokens, adapters that start as the base model: fp32 on CPU, summation order only.
    assert results["first_loss_rel_spread"] <= 1e-5
    assert contenders["megatron/shared_outer/2t"]["vs_1t"] > 0 and contenders["peft"]["vs_peft"] == 1.0
    # A shared-outer slot holds fewer values than a per-expert one (one gate_up A and one down B per layer).
    assert 0 < contenders["megatron/shared_outer/1t"]["slot_bytes"] < contenders["megatron/per_expert/1t"]["slot_bytes"]


def test_expert_parallel_mode_under_torchrun(tmp_path):
    out = tmp_path / "ep.json"
    run(torchrun(2, "bench/trainer_moe.py", "--mode", "ep", "--cpu-dev", "--shape", "tiny-moe", "--datums", "2",
                 "--seq-len", "16", "--rounds", "2", "--warmup", "1", "--rank", "4", "--contenders",
                 "shared_outer:2", "--out", str(out)), timeout=240)
    results = json.loads(out.read_text())
    (label, entry), = results["contenders"].items()
    assert label == "megatron/ep2/shared_outer/2t" and entry["error"] is None
    assert results["ep"] == 2 and results["world"] == 2 and results["tokens_per_step"] == 2 * 2 * 16
    assert abs(entry["tokens_per_s_per_gpu"] * 2 - entry["tokens_per_s_median"]) <= 0.2
    assert entry["slot_bytes_per_rank"] > 0 and len(entry["peak_gib_per_rank"]) == 2


def test_active_parameters_are_qwen3_30b_a3b_s():
    total, active = trainer_moe.active_params(trainer_moe.moe_config("qwen3-30b-a3b"))
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 1) == 3.4  # published: 30.5B, 3.3B activated
    # The formula counts exactly the HF model's parameters.
    config = trainer_moe.moe_config("tiny-moe")
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    assert trainer_moe.active_params(config)[0] == sum(p.numel() for p in model.parameters())
    assert trainer_moe.parse_contenders("per_expert:1,shared_outer:8") == [("per_expert", 1), ("shared_outer", 8)]
