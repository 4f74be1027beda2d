"""Qwen3.5 dense and MoE (tiny random vision-language checkpoints made by transformers' own classes) on the torch
backend's building blocks: loaded text-only from the VL checkpoint, LoRA on every projection of both layer kinds
(Tinker's split in_proj_q/k/v on the fused in_proj_qkv), datums of a packed row kept apart in the linear-attention
layers, the HF PEFT export giving the trainer's logits, and megatron refusing it before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch

from loraplane.adapter_format import parse_adapter, serialize_adapter
from loraplane.lora import AdapterTensors, LoraSpec
from loraplane.models import families, load_base_model
from loraplane.models.packed import packed_position_ids, packed_sequences
from tests.fixtures.family_checks import assert_hf_peft_gives_ours, peft_export, trained_like
from tests.fixtures.family_checks import packed_logits as shared_packed_logits
from tests.fixtures.models import build_checkpoint
from trainer_svc.backends.torch_backend import TorchBackend

FAMILY_TYPES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=FAMILY_TYPES)
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def backend(checkpoint):
    return TorchBackend(str(checkpoint))


def packed_logits(backend, rows, adapter, others=(), other=None):
    """Logits of datums laid end to end in one packed row (the trainer's layout), each datum's own; `others`: more
    datums after them, of adapter `other` (another tenant sharing the batch)."""
    adapters = [adapter] * len(rows) + [other] * len(others)
    return shared_packed_logits(backend, [*rows, *others], adapters)[:len(rows)]


def test_loaded_text_only_from_the_vision_language_checkpoint(checkpoint, backend):
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    base = backend.base
    assert base.family.checkpoint_prefix == "model.language_model."
    assert not any("visual" in n for n, _ in base.model.named_parameters())
    kinds = families.mixer_kinds(base.config)
    assert kinds == ["linear_attention", "linear_attention", "attention"] * 2
    assert base.layer_targets(0)[:7] == families.LINEAR_ATTENTION_TARGETS
    assert base.layer_targets(2)[:4] == families.ATTENTION_TARGETS
    # Tinker's split in_proj_q/k/v: their widths are the Q, K and V rows of the fused in_proj_qkv (unequal).
    assert base.module_dims["in_proj_q"] == (64, 16) and base.module_dims["in_proj_v"] == (64, 64)
    assert base.module_dims["q_proj"] == (64, 128)  # query and output gate
    if base.family.moe:
        assert base.layer_targets(0)[-5:] == families.SHARED_EXPERT_TARGETS + families.EXPERT_TARGETS


def test_a_checkpoint_tied_at_its_top_level_loads_with_the_full_models_logits(checkpoint, tmp_path):
    # Qwen3.5-4B's config.json: tie_word_embeddings true at the top, not in text_config, no lm_head.weight saved.
    # Loaded text-only without the top-level tie, lm_head would be newly initialised random weights.
    from transformers import AutoModelForImageTextToText

    model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
    tied = build_checkpoint(model_type, tmp_path / "tied", tie_word_embeddings=True)
    saved = json.loads((tied / "config.json").read_text())
    assert saved["tie_word_embeddings"] is True and not saved["text_config"].get("tie_word_embeddings")
    base = load_base_model(str(tied))
    full = AutoModelForImageTextToText.from_pretrained(str(tied), dtype=torch.float32).eval()
    row = torch.tensor([[5, 17, 99, 3, 42, 250, 8, 61]])
    with torch.no_grad():
        ours = base.model(input_ids=row).logits
        theirs = full(input_ids=row).logits
    assert base.model.lm_head.weight.data_ptr() == base.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(ours, theirs)


def test_every_target_moves_the_logits_and_a_datum_is_the_same_packed_or_alone(backend):
    base = backend.base
    spec = LoraSpec.create(4, 8, [], seed=3, available=tuple(base.module_dims))
    assert set(spec.target_modules) == set(base.module_dims)
    params = trained_like(base, spec, 1)
    adapter = AdapterTensors.from_params(params, spec)
    rng = torch.Generator().manual_seed(0)
    rows = [torch.randint(5, 250, (n,), generator=rng).tolist() for n in (19, 7, 12)]
    # A tenant's datums give the same logits, bit for bit, whether or not another tenant's datums follow them in
    # the packed row (what makes interleaved training equal training alone).
    alone = packed_logits(backend, rows, adapter)
    other = AdapterTensors.from_params(trained_like(base, spec, 9), spec)
    fused = packed_logits(backend, rows, adapter, [[11] * 9, [13] * 14], other)
    for mine, theirs in zip(alone, fused):
        # (Qwen3.5-MoE: only with the shared expert's sigmoid gate taken per datum, enable_packing.)
        assert torch.equal(mine, theirs)
    # And it is what transformers computes for the datum alone (no packing, no adapter leak across datums).
    with torch.no_grad():
        plain = packed_logits(backend, [rows[1]], None)[0]
        reference = base.model(input_ids=torch.tensor([rows[1]])).logits[0]
    assert torch.allclose(plain, reference, atol=1e-4, rtol=0)
    # Each target on its own changes the logits: its hook finds its module (and its rows of a fused one).
    for target in spec.target_modules:
        only = {k: v for k, v in params.items() if f".{families.TARGETS[target].key_path}.lora_" in k}
        one = AdapterTensors.from_params(only, spec)
        moved = packed_logits(backend, [rows[0]], one)[0]
        assert not torch.allclose(moved, packed_logits(backend, [rows[0]], None)[0], atol=1e-6), target


def test_the_packed_row_resets_the_linear_attention_state_at_each_datum(backend):
    # Without the reset, the second datum would continue the first one's conv1d and delta-rule state.
    rows = [[7] * 10, [9] * 10]
    model = backend.base.model
    ids = torch.tensor([rows[0] + rows[1]])
    lengths = [10, 10]
    from loraplane.models.families.qwen3_5 import _packed_forward

    gdn = model.model.layers[0].linear_attn
    assert gdn.forward.__func__ is _packed_forward
    with torch.no_grad(), packed_sequences(lengths):
        packed = model.model(input_ids=ids, position_ids=packed_position_ids(lengths),
                             use_cache=False).last_hidden_state[0, 10:]
    with torch.no_grad():
        alone = model.model(input_ids=torch.tensor([rows[1]])).last_hidden_state[0]
        leaked = model.model(input_ids=ids).last_hidden_state[0, 10:]  # no packing scope: one sequence
    assert torch.allclose(packed, alone, atol=1e-4)
    assert not torch.allclose(leaked, alone, atol=1e-2)


def test_the_peft_export_loads_in_hf_peft_with_the_trainers_logits(checkpoint, backend, tmp_path):
    pytest.importorskip("peft")
    spec, params, directory, config = peft_export(backend, checkpoint, tmp_path)
    assert "in_proj_qkv" in config["target_modules"] and "in_proj_q" not in config["target_modules"]
    assert config["rank_pattern"] == {"in_proj_qkv": 12}
    rng = torch.Generator().manual_seed(1)
    row = torch.randint(5, 250, (21,), generator=rng).tolist()
    ours = packed_logits(backend, [row], AdapterTensors.from_params(params, spec))[0]
    assert_hf_peft_gives_ours(checkpoint, directory, row, ours, packed_logits(backend, [row], None)[0])


def test_both_backends_accept_the_checkpoint_users_download(checkpoint):
    # The megatron side of the family runs in tests/e2e/test_megatron_qwen3_5_cpu.py; here only the family check,
    # which reads config.json alone (the vision-language config with its text sub-config).
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    for backend_name in ("torch", "megatron"):
        assert families.unsupported_features(config, backend_name) == []
        assert families.check_supported(config, backend_name).model_type in ("qwen3_5", "qwen3_5_moe")


def blob_check(blob: bytes) -> None:
    from registry_svc.blob_check import BlobCheck

    checker = BlobCheck(len(blob), training_state=False)
    checker.feed(blob)
    checker.finish()


@pytest.mark.parametrize("targets", [["q_proj"], ["in_proj_q"], ["q_proj", "down_proj"], ["out_proj", "v_proj"]])
def test_an_adapter_on_some_targets_passes_the_registrys_check(backend, targets):
    # Each layer holds what its mixer and MLP kind offer of the adapter's targets: q_proj only in the
    # full-attention layers, in_proj_q only in the linear-attention ones.
    base = backend.base
    if "down_proj" in targets and base.family.moe:
        targets = ["q_proj", "shared_expert.down_proj", "experts.down_proj"]
    spec = LoraSpec.create(4, 8, targets, seed=3, available=tuple(base.module_dims))
    params = trained_like(base, spec, 4)
    blob = serialize_adapter(params, spec, "qwen")
    blob_check(blob)
    parsed, parsed_spec, _ = parse_adapter(blob)
    assert parsed_spec == spec and set(parsed) == set(params)
    if targets == ["q_proj"]:
        assert sorted({int(k.split(".layers.")[1].split(".")[0]) for k in params}) == [2, 5]


def test_a_malformed_hybrid_adapter_is_still_refused(backend):
    from loraplane import errors
    from loraplane.adapter_format import ADAPTER_CONFIG_KEY, _save, peft_adapter_config

    base = backend.base
    dense = [t for t in base.module_dims if t not in families.EXPERT_TARGETS]
    everything = LoraSpec.create(4, 8, dense, seed=3, available=tuple(base.module_dims))
    full = trained_like(base, everything, 5)
    qk = LoraSpec.create(4, 8, ["q_proj", "k_proj", "in_proj_z"], seed=3, available=tuple(base.module_dims))
    some = trained_like(base, qk, 6)
    cases = {
        # a linear-attention layer without one of its targets
        "layer 0 in_proj_z lacks": ({k: v for k, v in full.items() if ".layers.0.linear_attn.in_proj_z." not in k},
                                   everything),
        # a full-attention layer holding only part of its targets
        "layer 5 k_proj lacks": ({k: v for k, v in some.items() if ".layers.5.self_attn.k_proj." not in k}, qk),
        # a layer without any mixer target of an adapter on both kinds'
        "layers [0, 1, 3, 4, 5] are not 0..4": ({k: v for k, v in some.items() if ".layers.2.self_attn." not in k}, qk),
        # a layer holding both kinds' targets
        "layer 1 holds both": ({**some, **{k.replace(".layers.2.", ".layers.1."): v for k, v in some.items()
                                   if ".layers.2." in k}}, qk),
        # a target no layer holds
        "layers [2, 5] are not 0..1": ({k: v for k, v in some.items() if "in_proj_z" not in k},
                            LoraSpec.create(4, 8, ["q_proj", "k_proj", "in_proj_z"], seed=3)),
    }
    for expected, (params, spec) in cases.items():
        blob = _save(params, {ADAPTER_CONFIG_KEY: json.dumps(peft_adapter_config(spec, "qwen"))})
        with pytest.raises(errors.InvalidArgument) as caught:
            blob_check(blob)
        assert expected in caught.value.message, caught.value.message


def test_an_adapter_missing_a_layer_the_registry_cannot_tell_is_refused_by_the_sampler(checkpoint, backend):
    # q_proj only, without layer 5's: well formed for the registry (which has no base model: the layer could be a
    # linear-attention one), but this model's layer 5 is a full-attention layer offering q_proj.
    from loraplane import errors
    from loraplane.adapter_format import ADAPTER_CONFIG_KEY, _save, peft_adapter_config
    from sampler_svc.engines.torch_engine import TorchEngine

    base = backend.base
    spec = LoraSpec.create(4, 8, ["q_proj"], seed=3, available=tuple(base.module_dims))
    params = {k: v for k, v in trained_like(base, spec, 7).items() if ".layers.5." not in k}
    blob = _save(params, {ADAPTER_CONFIG_KEY: json.dumps(peft_adapter_config(spec, str(checkpoint)))})
    blob_check(blob)
    engine = TorchEngine(str(checkpoint))
    with pytest.raises(errors.FailedPrecondition) as caught:
        engine._prepare_adapter(base, "tenant/q@v1", blob)
    assert "2 tensors" in caught.value.message and "layers.5.self_attn.q_proj.lora_A" in caught.value.message
    whole = serialize_adapter(trained_like(base, spec, 7), spec, str(checkpoint))
    assert engine._prepare_adapter(base, "tenant/q@v2", whole).name == "tenant/q@v2"


def test_the_sampler_hands_transformers_its_cache_by_the_name_its_forward_takes(backend):
    # transformers 5.24 takes `cache` (past_key_values deprecated); a release before the rename takes
    # past_key_values and would swallow `cache=` into **kwargs, decoding each token without its history.
    from sampler_svc.engines.torch_engine import _cache_kwarg

    class OlderForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    assert _cache_kwarg(backend.base.model) == "cache"
    assert _cache_kwarg(OlderForward()) == "past_key_values"


def test_megatron_refuses_a_qwen3_5_config_with_attention_biases_which_it_has_not_been_checked_on():
    config = families.FAMILIES["qwen3_5"].tiny(64).text_config
    config.attention_bias = True
    assert any("bias" in p and "megatron" in p for p in families.unsupported_features(config, "megatron"))
    assert families.unsupported_features(config, "torch") == []
