"""`python -m tests.production_e2e --moe` on CPU: the small random Qwen3-MoE built here, the torch trainer
and the torch sampler in fp32, the token-set reward, two tenants (the GPU run, SGLang in bf16, is
tests/gpu/test_production_shape.py::test_moe_production_shape_on_one_gpu). And the MoE verdict: bf16 logprobs are
bounded in mean and 90th percentile, not in the maximum (a routing flip can reach any value)."""

from __future__ import annotations

import pytest

from tests import production_e2e
from tests.e2e.test_production_shape_cpu import _row, run_driver


def _moe_verdict(diffs_per_row: list[list[float]]) -> bool:
    rl = production_e2e.load_rl_example()
    args = production_e2e.parse_args(["--moe", "--iterations", str(len(diffs_per_row)), "--window", "1"])
    assert args.dtype == "bfloat16" and args.trainer_backend == "torch"
    runs = rl.tenant_runs("+,+")
    for run in runs:
        run.history = [_row(v + 1, logprob_diffs=d, tokens_compared=len(d), logprob_max_abs=max(d),
                            logprob_mean_abs=sum(d) / len(d)) for v, d in enumerate(diffs_per_row)]
    final = {"ok": True, "sampler": [], "expected": [], "sglang": None, "summary": rl.summarize(runs, 1)}
    return production_e2e.evaluate(runs, args, final, bound=4)["logprobs_match_forward"]["passed"]


def test_moe_bounds_are_on_the_mean_and_the_90th_percentile():
    calm = [0.01] * 95
    assert _moe_verdict([calm + [0.9] * 5, calm + [0.02] * 5])  # a few routing flips: any maximum passes
    assert not _moe_verdict([[0.2] * 100, [0.2] * 100])  # mean 0.2 > 0.1
    assert not _moe_verdict([[0.0] * 85 + [0.4] * 15, [0.0] * 85 + [0.4] * 15])  # mean 0.06, but p90 0.4 > 0.3


def test_moe_defaults_and_trainer_command():
    args = production_e2e.parse_args(["--moe", "--iterations", "5"])
    assert (args.iterations, args.problems, args.max_tokens, args.window) == (5, 8, 8, 3)
    assert args.learning_rate == pytest.approx(2e-2) and args.model == ""
    args.model = "/models/moe"
    trainer = production_e2e.service_commands(args)["trainer"]
    assert trainer[1:5] == ["-m", "trainer_svc", "--backend", "torch"] and "/models/moe" in trainer
    assert production_e2e.parse_args([]).trainer_backend == "megatron"


def test_moe_config_of_the_real_shape():
    config = production_e2e.qwen3_moe_config("qwen3-30b-a3b")
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.vocab_size) == (48, 2048, 128, 8, 768, 32, 4, 128, 151936)
    assert config.mlp_only_layers == [] and config.norm_topk_prob
    assert production_e2e.qwen3_moe_config("qwen3-30b-a3b", layers=2, vocab_size=261).num_hidden_layers == 2


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_moe_loop_on_cpu(tmp_path):
    report = run_driver(tmp_path, "--moe", "--engine", "torch", "--device", "cpu", "--iterations", "3",
                        "--problems", "2", "--group-size", "4", timeout=600)
    model = report["config"]["model"]
    assert model.endswith("moe-model")
    assert report["shape"] == {"trainer_backend": "torch", "trainer_base_model": model, "sampler_engine": "torch",
                               "sampler_base_model": model}
    for rows in report["history"].values():
        assert [r["version"] for r in rows] == [1, 2, 3]
        for r in rows:
            assert r["served_mismatches"] == 0 and r["tokens_compared"] > 0
            assert r["logprob_max_abs"] <= production_e2e.FP32_MAX_ABS  # fp32 on CPU: the design's 1e-4
            assert 0.0 <= r["mean_reward"] <= 1.0
    assert report["checks"]["rewards_rise"]["required"] is False
