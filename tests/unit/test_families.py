"""Model families as data: every supported family's stock config passes, every unsupported feature is named, and a
local checkpoint of an unsupported model is refused when it loads (start-up), not at the first request."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from loraplane.errors import FailedPrecondition
from loraplane.models import families
from loraplane.models.base import load_base_model
from loraplane.models.tiny import build_tiny_tokenizer


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_supported_families_pass_on_both_backends(model_type):
    config = AutoConfig.for_model(model_type)
    assert families.family_for(config).model_type == model_type
    assert families.unsupported_features(config, "torch") == []
    assert families.check_supported(config, "torch").model_type == model_type


@pytest.mark.parametrize(("model_type", "fields", "expected"), [
    ("qwen2_moe", {}, ["model_type 'qwen2_moe'", "shared experts"]),
    ("deepseek_v3", {}, ["shared experts", "router other than softmax top-k", "latent attention (MLA)"]),
    ("qwen3_next", {}, ["linear-attention layers", "partial rotary", "shared experts"]),
    ("mistral", {}, ["model_type 'mistral'", "sliding-window attention"]),
    ("qwen3_moe", {"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 0},
     ["sliding-window attention"]),
])
def test_unsupported_features_are_each_named(model_type, fields, expected):
    config = AutoConfig.for_model(model_type, **fields)
    problems = "; ".join(families.unsupported_features(config, "torch"))
    for phrase in expected:
        assert phrase in problems
    with pytest.raises(FailedPrecondition) as info:
        families.check_supported(config, "torch")
    assert info.value.field == "base_model"
    assert info.value.reason == "UNSUPPORTED_MODEL"


def test_attention_biases_run_on_both_backends():
    # megatron's numbers for them: tests/e2e/test_megatron_gpt_oss_cpu.py (Llama and Qwen3 with attention_bias).
    config = AutoConfig.for_model("qwen3", attention_bias=True)
    assert families.unsupported_features(config, "torch") == []
    assert families.unsupported_features(config, "megatron") == []


def test_layer_kinds_and_targets_follow_mlp_only_layers():
    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 2])
    assert families.layer_kinds(config) == ["dense", "moe", "dense", "moe"]
    # No dense-MLP targets on a MoE model: PEFT would read them as expert targets.
    assert families.lora_targets(config) == families.ATTENTION_TARGETS + families.EXPERT_TARGETS
    only_moe = AutoConfig.for_model("qwen3_moe", num_hidden_layers=2)
    assert families.lora_targets(only_moe) == families.ATTENTION_TARGETS + families.EXPERT_TARGETS
    assert families.lora_targets(AutoConfig.for_model("llama")) == (
        families.ATTENTION_TARGETS + families.DENSE_MLP_TARGETS)


def test_unsupported_checkpoint_is_refused_at_load(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    Qwen2MoeForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(FailedPrecondition) as info:
        load_base_model(str(tmp_path))
    assert "shared experts" in info.value.message and "qwen2_moe" in info.value.message


def test_tiny_moe_loads_as_a_qwen3_moe():
    base = load_base_model("tiny-moe")
    assert base.layer_kinds == ("dense", "moe", "moe") and base.num_experts == 8
    assert base.module_dims["experts.gate_up_proj"] == (64, 64)
    assert base.module_dims["experts.down_proj"] == (32, 64)
    assert base.layer_targets(1) == families.ATTENTION_TARGETS + families.EXPERT_TARGETS
    assert base.layer_targets(0) == families.ATTENTION_TARGETS
    assert "gate_proj" not in base.module_dims


def test_the_torch_free_expert_names_are_the_registrys_and_pick_tinkers_layout():
    from loraplane.client.targets import GATED_EXPERT_TARGETS, tinker_expert_layout

    assert GATED_EXPERT_TARGETS == families.EXPERT_TARGETS
    assert tinker_expert_layout(families.ATTENTION_TARGETS + families.EXPERT_TARGETS) == "shared_outer"
    assert tinker_expert_layout(families.ATTENTION_TARGETS + families.DENSE_MLP_TARGETS) == ""
