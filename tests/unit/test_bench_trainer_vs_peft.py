"""bench/trainer_vs_peft.py on the tiny shape (CPU, seconds): every contender trains the same tokens, the first
losses agree (same model, same data, adapters that start as the base model), and the ratios are computed."""

from __future__ import annotations

import json

from bench import trainer_vs_peft


def test_trainer_vs_peft_runs_each_contender_on_the_same_data(tmp_path):
    out = tmp_path / "tvp.json"
    results = trainer_vs_peft.main(["--shape", "tiny", "--device", "cpu", "--backend", "torch", "--modes", "direct",
                                    "--tenants", "1,2", "--datums", "4", "--seq-len", "16", "--rounds", "2",
                                    "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    contenders = results["contenders"]
    assert list(contenders) == ["peft", "torch/direct/1t", "torch/direct/2t"]
    for label, entry in contenders.items():
        assert entry["error"] is None, label
        assert len(entry["times_ms"]) == 2 and entry["tokens_per_s_median"] > 0
        assert entry["tokens_per_s_fastest"] >= entry["tokens_per_s_median"]
    assert contenders["peft"]["vs_peft"] == 1.0
    assert contenders["torch/direct/2t"]["vs_1t"] > 0
    assert results["tokens_per_step"] == 64 and results["n_params"] > 0
    # fp32 on CPU: the trainer's summed cross-entropy equals PEFT's to rounding.
    assert results["first_loss_rel_spread"] <= 1e-5


def test_cpu_preset_is_issue_15s_setting():
    args = trainer_vs_peft.parse_args(["--cpu", "--rounds", "3"])
    assert (args.shape, args.backend, args.rank, args.datums, args.seq_len, args.device) == (
        "smollm2", "torch", 16, 8, 64, "cpu")
    assert args.modes == "direct,grpc" and args.rounds == 3
