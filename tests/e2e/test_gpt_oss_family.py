"""gpt-oss (a tiny random checkpoint made by transformers' own classes: a 4-token sliding-window layer then a full
one, sinks, q/k/v/o biases, YaRN, 4 biased experts top-2 with interleaved gate/up) on the torch backend's building
blocks: it loads with eager sink attention (transformers refuses SDPA for it), datums of a packed row are kept apart
with each one's own window and sinks and equal transformers' eager logits alone, LoRA on q/k/v/o and the experts
moves the logits, the HF PEFT export gives the trainer's logits, megatron accepts it, and unsupported variants are
refused from config.json before any weight is read."""

from __future__ import annotations

import pytest
import torch

from loraplane.errors import FailedPrecondition
from loraplane.lora import AdapterTensors, LoraSpec
from loraplane.models import families, load_base_model
from loraplane.models.families import gpt_oss
from tests.fixtures.family_checks import (
    assert_every_target_moves_and_a_tenant_is_the_same_packed_or_alone,
    assert_hf_peft_gives_ours,
    backend_fixtures,
    broken_copy,
    packed_logits,
    peft_export,
    rows_of,
    trained_like,
)

checkpoint, backend = backend_fixtures("gpt_oss")


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' own model of the checkpoint, as it runs gpt-oss (eager attention with sinks)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_loaded_with_sinks_windows_and_transposed_biased_experts(backend):
    base = backend.base
    assert base.family is families.FAMILIES["gpt_oss"]
    layers = base.model.model.layers
    assert layers[0].self_attn.sliding_window == 4 and layers[1].self_attn.sliding_window is None
    assert base.model.config._attn_implementation == gpt_oss.PACKED_SINK_ATTENTION
    assert base.layer_kinds == ("moe", "moe") and base.num_experts == 4
    # PEFT's in/out of gpt-oss's [E, in, out] experts: gate_up (hidden -> 2 ffn), down (ffn -> hidden).
    assert base.module_dims["experts.gate_up_proj"] == (64, 64)
    assert base.module_dims["experts.down_proj"] == (32, 64)
    assert tuple(base.module_dims) == families.ATTENTION_TARGETS + families.EXPERT_TARGETS


def test_a_packed_datum_equals_transformers_alone_with_its_own_window_and_sinks(backend, reference):
    # Lengths past the 4-token window; a datum of another tenant shares the row.
    rows = rows_of(3, [11, 6, 13])
    packed = packed_logits(backend, rows, [None, None, None])
    for row, ours in zip(rows, packed):
        with torch.no_grad():
            theirs = reference(input_ids=torch.tensor([row])).logits[0]
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), float((ours - theirs).abs().max())
    # The window and the sinks both matter here: dropping either changes transformers' own logits.
    with torch.no_grad():
        full = reference(input_ids=torch.tensor([rows[2]])).logits[0]
        window = reference.model.layers[0].self_attn.sliding_window
        reference.model.layers[0].self_attn.sliding_window = None
        reference.config.layer_types = ["full_attention", "full_attention"]
        try:
            unwindowed = reference(input_ids=torch.tensor([rows[2]])).logits[0]
        finally:
            reference.model.layers[0].self_attn.sliding_window = window
            reference.config.layer_types = ["sliding_attention", "full_attention"]
    assert not torch.allclose(full, unwindowed, atol=1e-3)
    sinks = [layer.self_attn.sinks for layer in backend.base.model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    try:
        with torch.no_grad():
            for s in sinks:
                s.fill_(-1e4)  # a sink that takes no probability mass is no sink
        sinkless = packed_logits(backend, [rows[2]], [None])[0]
    finally:
        with torch.no_grad():
            for s, value in zip(sinks, saved):
                s.copy_(value)
    assert not torch.allclose(sinkless, packed[2], atol=1e-3)


def test_every_target_moves_the_logits_and_a_tenant_is_the_same_packed_or_alone(backend):
    assert_every_target_moves_and_a_tenant_is_the_same_packed_or_alone(backend)


def test_the_peft_export_loads_in_hf_peft_with_the_trainers_logits(checkpoint, backend, tmp_path):
    pytest.importorskip("peft")
    spec, params, directory, config = peft_export(backend, checkpoint, tmp_path)
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    row = rows_of(1, [15])[0]
    ours = packed_logits(backend, [row], [AdapterTensors.from_params(params, spec)])[0]
    assert_hf_peft_gives_ours(checkpoint, directory, row, ours, packed_logits(backend, [row], [None])[0],
                              load_kwargs={"attn_implementation": "eager"})


def test_tinkers_attn_key_names_are_the_same_targets(backend):
    base = backend.base
    spec = LoraSpec.create(4, 8, [], seed=6, available=tuple(base.module_dims))
    params = trained_like(base, spec, 3)
    tinker = {k.replace(".self_attn.", ".attn."): v for k, v in params.items()}
    assert sum(".attn." in k for k in tinker) == 2 * 4 * base.num_layers
    row = rows_of(2, [10])[0]
    ours = packed_logits(backend, [row], [AdapterTensors.from_params(params, spec)])[0]
    theirs = packed_logits(backend, [row], [AdapterTensors.from_params(tinker, spec)])[0]
    assert torch.equal(ours, theirs)


def test_megatron_accepts_gpt_oss_from_its_config(checkpoint):
    """The megatron backend computes every gpt-oss feature (its numbers: tests/e2e/test_megatron_gpt_oss_cpu.py)."""
    from loraplane.models.base import check_checkpoint

    assert not families.FAMILIES["gpt_oss"].backend_lacks.get("megatron")
    assert families.unsupported_features(families.FAMILIES["gpt_oss"].tiny_config(300), "megatron") == []
    assert check_checkpoint(checkpoint, "megatron").model_type == "gpt_oss"


def test_an_unsupported_gpt_oss_variant_is_refused_naming_every_feature(checkpoint):
    def edit(config):
        config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                     "long_factor": [1.0] * 8, "original_max_position_embeddings": 128}
        config["hidden_act"] = "gelu"
        config["mlp_bias"] = True

    broken = broken_copy(checkpoint, "variant", edit)
    with pytest.raises(FailedPrecondition) as info:
        load_base_model(str(broken))
    message = info.value.message
    for piece in ("rope_scaling type 'longrope'", "hidden_act='gelu'", "MLP biases"):
        assert piece in message, piece
