"""Nemotron-H / Nemotron-3 (a tiny random checkpoint made by transformers' own classes, saved as transformers and
NVIDIA write it, weights under ``backbone.*``: a Mamba-2 block, a MoE block with a shared expert, an attention
block, a relu^2 MLP block) on the torch backend's building blocks: LoRA on each block kind's projections and the routed experts, datums of
a packed row kept apart in the Mamba-2 conv and scan (each equals transformers alone), the HF PEFT export giving the
trainer's logits, and megatron / unsupported variants refused from config.json before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from loraplane.adapter_format import materialize_peft_dir, serialize_adapter
from loraplane.errors import FailedPrecondition, InvalidArgument
from loraplane.lora import AdapterTensors, LoraSpec
from loraplane.models import families, load_base_model
from loraplane.models.families.base import (
    BLOCK_ATTENTION_TARGETS,
    BLOCK_MLP_TARGETS,
    BLOCK_SHARED_EXPERT_TARGETS,
    MAMBA_TARGETS,
    NONGATED_EXPERT_TARGETS,
)
from tests.fixtures.family_checks import (
    assert_every_target_moves_and_a_tenant_is_the_same_packed_or_alone,
    assert_hf_peft_gives_ours,
    assert_round_trips,
    backend_fixtures,
    broken_copy,
    megatron_refusal,
    packed_logits,
    rows_of,
    trained_like,
)

checkpoint, backend = backend_fixtures("nemotron_h")


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def test_loaded_from_backbone_weights_with_each_block_kinds_targets(checkpoint, backend):
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
    assert all(k.startswith("backbone.") or k == "lm_head.weight" for k in keys), keys[:4]
    base = backend.base
    assert base.family is families.FAMILIES["nemotron_h"]
    assert [base.layer_targets(i) for i in range(4)] == [
        MAMBA_TARGETS, BLOCK_SHARED_EXPERT_TARGETS + NONGATED_EXPERT_TARGETS, BLOCK_ATTENTION_TARGETS,
        BLOCK_MLP_TARGETS]
    assert base.module_dims["mixer.in_proj"] == (64, 2 * 64 + 2 * 2 * 16 + 4)  # gate | x B C | dt
    # The routed experts: non-gated, (in, out) of one expert; 4 experts of the one MoE block.
    assert base.module_dims["mixer.experts.up_proj"] == (64, 32)
    assert base.module_dims["mixer.experts.down_proj"] == (32, 64)
    assert base.num_experts == 4
    # Each block's MLP kind, as the family reads layers_block_type (a mixer-only block has none).
    assert base.layer_kinds == ("none", "moe", "none", "dense")


def test_a_packed_datum_equals_transformers_alone_and_the_mamba_state_stays_in_it(backend, reference):
    rows = rows_of(3, [11, 6, 21])
    packed = packed_logits(backend, rows, [None, None, None])
    for row, ours in zip(rows, packed):
        with torch.no_grad():
            theirs = reference(input_ids=torch.tensor([row]), use_cache=False).logits[0]
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), float((ours - theirs).abs().max())
    # Without the per-datum conv and scan the state of one datum flows into the next.
    mixer = backend.base.model.model.layers[0].mixer
    patched = mixer.forward
    mixer.forward = mixer._loraplane_forward
    try:
        leaking = packed_logits(backend, rows, [None, None, None])
    finally:
        mixer.forward = patched
    assert torch.allclose(leaking[0], packed[0], atol=1e-4) and not torch.allclose(leaking[1], packed[1], atol=1e-3)


def test_every_target_moves_the_logits_and_a_tenant_is_the_same_packed_or_alone(backend):
    assert_every_target_moves_and_a_tenant_is_the_same_packed_or_alone(backend)


def test_an_adapter_of_some_block_kinds_round_trips(backend, checkpoint):
    base = backend.base
    spec = LoraSpec.create(4, 8, list(BLOCK_ATTENTION_TARGETS), seed=3, available=tuple(base.module_dims))
    params = trained_like(base, spec, 4)
    assert {int(k.split(".")[4]) for k in params} == {2}  # only the attention block holds tensors
    assert_round_trips(params, spec, checkpoint)


def test_the_peft_export_loads_in_hf_peft_with_the_trainers_logits(checkpoint, backend, tmp_path):
    pytest.importorskip("peft")
    base = backend.base
    # HF PEFT 0.21 refuses LoRA on a Mamba mixer's out_proj (its fused training kernel bypasses the module); every
    # other target loads.
    targets = [t for t in base.module_dims if t != "mixer.out_proj"]
    spec = LoraSpec.create(4, 8, targets, seed=5, available=tuple(base.module_dims))
    params = trained_like(base, spec, 2)
    directory = materialize_peft_dir(serialize_adapter(params, spec, str(checkpoint)), tmp_path / "peft")
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["target_modules"] == [t for t in targets if t not in NONGATED_EXPERT_TARGETS]
    assert config["target_parameters"] == list(NONGATED_EXPERT_TARGETS)
    row = rows_of(1, [15])[0]
    ours = packed_logits(backend, [row], [AdapterTensors.from_params(params, spec)])[0]
    assert_hf_peft_gives_ours(checkpoint, directory, row, ours, packed_logits(backend, [row], [None])[0],
                              call_kwargs={"use_cache": False})


def test_sglang_gets_every_target_but_the_routed_experts_and_the_mamba_in_proj(backend):
    from loraplane.adapter_format import sglang_modules, to_sglang

    base = backend.base
    family = base.family
    assert set(family.sglang) == set(base.module_dims) - set(NONGATED_EXPERT_TARGETS) - {"mixer.in_proj"}
    spec = LoraSpec.create(4, 8, list(BLOCK_ATTENTION_TARGETS) + ["mixer.out_proj"], seed=1,
                           available=tuple(base.module_dims))
    assert sglang_modules(spec, family)["mixer.out_proj"] == "out_proj"
    tensors, _ = to_sglang(trained_like(base, spec, 1), spec)
    assert any(".mixer.out_proj." in k for k in tensors)
    # SGLang 0.5.17 gives LoRA to in_proj's z and x parts only; our pair spans all of it: refused before sending.
    in_proj = LoraSpec.create(4, 8, ["mixer.in_proj"], seed=1, available=tuple(base.module_dims))
    with pytest.raises(FailedPrecondition) as refused:
        sglang_modules(in_proj, family)
    assert "mixer.in_proj" in refused.value.message
    routed = LoraSpec.create(4, 8, list(NONGATED_EXPERT_TARGETS), seed=1, available=tuple(base.module_dims))
    with pytest.raises(InvalidArgument) as info:
        to_sglang(trained_like(base, routed, 1), routed)
    assert "routed experts" in info.value.message


def test_megatron_refuses_nemotron_h_before_reading_a_weight(checkpoint):
    refusal = megatron_refusal(checkpoint)
    assert refusal.field == "base_model"
    for piece in ("Mamba-2 layers", "mamba_ssm", "causal_conv1d", "relu^2 experts"):
        assert piece in refusal.message, piece


def test_an_unsupported_nemotron_h_variant_is_refused_naming_every_feature(checkpoint):
    def edit(config):
        config["mlp_bias"] = True
        config["attention_bias"] = True

    broken = broken_copy(checkpoint, "variant", edit)
    with pytest.raises(FailedPrecondition) as info:
        load_base_model(str(broken))
    message = info.value.message
    for piece in ("MLP biases",
                  "attention biases including o_proj (attention_bias=True) (not part of the nemotron_h family)"):
        assert piece in message, piece


def test_loaded_without_reaching_for_hub_kernels(checkpoint, backend):
    # As released, config.json asks for the Mamba kernels; transformers would fetch them from the Hub at construction
    # wherever the `kernels` package is installed (the GPU image's SGLang wheels bring it), which fails offline.
    assert json.loads((checkpoint / "config.json").read_text()).get("use_mamba_kernels", True) is True
    assert backend.base.model.config.use_mamba_kernels is False
    # The SGLang engine's facts of the same checkpoint (its module tree built on the meta device) likewise.
    from sampler_svc.engines.sglang_engine import _base_model_facts

    assert _base_model_facts(str(checkpoint)).model.config.use_mamba_kernels is False
