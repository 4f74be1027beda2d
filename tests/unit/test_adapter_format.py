"""PEFT safetensors export/import and the training-state blob."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save as st_save

from loraplane.adapter_format import (
    TrainingState,
    adapter_header,
    materialize_peft_dir,
    parse_adapter,
    parse_training_state,
    serialize_adapter,
    serialize_training_state,
)
from loraplane.errors import DataLoss, InvalidArgument
from loraplane.lora import AdapterTensors, LoraSpec, attach_multi_lora, init_lora_params, lora_routing, peft_key
from loraplane.models import load_base_model


@pytest.fixture(scope="module")
def tiny():
    return load_base_model("tiny")


def trained_like(base, spec, seed):
    params = init_lora_params(base, spec)
    generator = torch.Generator().manual_seed(seed)
    for tensor in params.values():
        tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return params


def test_roundtrip_keeps_tensors_spec_and_base(tiny):
    spec = LoraSpec.create(4, 16, ["q_proj", "v_proj", "down_proj"], seed=9)
    params = trained_like(tiny, spec, 1)
    blob = serialize_adapter(params, spec, "tiny")
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    config = json.loads(header["__metadata__"]["adapter_config"])
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16
    assert config["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    assert config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    back, back_spec, base_name = parse_adapter(blob)
    assert base_name == "tiny" and back_spec == spec
    assert set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)


def test_parse_rejects_garbage_and_inconsistent_blobs(tiny):
    spec = LoraSpec.create(2, 0, ["q_proj"], seed=1)
    params = trained_like(tiny, spec, 2)
    with pytest.raises(DataLoss):
        parse_adapter(b"not a safetensors file at all")
    with pytest.raises(DataLoss):
        parse_adapter(serialize_adapter(params, spec, "tiny")[:-10])
    # No adapter_config metadata.
    with pytest.raises(DataLoss):
        parse_adapter(st_save(params))
    # Rank in the config disagrees with the tensors.
    config = {"peft_type": "LORA", "r": 3, "lora_alpha": 3, "target_modules": ["q_proj"]}
    with pytest.raises(InvalidArgument):
        parse_adapter(st_save(params, metadata={"adapter_config": json.dumps(config)}))
    # Missing a B.
    partial = {k: v for k, v in params.items() if k != peft_key(1, "q_proj", "B")}
    config["r"] = config["lora_alpha"] = 2
    with pytest.raises(InvalidArgument):
        parse_adapter(st_save(partial, metadata={"adapter_config": json.dumps(config)}))
    # A key that is not a PEFT LoRA key.
    odd = dict(params, **{"model.embed_tokens.weight": torch.zeros(2, 2)})
    with pytest.raises(InvalidArgument):
        parse_adapter(st_save(odd, metadata={"adapter_config": json.dumps(config)}))


def test_header_alone_gives_the_spec_and_checks_keys_and_shapes_as_parse_does(tiny):
    """adapter_header reads no values (the SGLang file path hands the bytes on): it must agree with parse_adapter
    on spec, base and every structural refusal. Tried: a truncated header, a non-object header, no config, a rank
    that disagrees, a missing B, a foreign key, a malformed entry."""
    spec = LoraSpec.create(2, 4, ["q_proj", "up_proj"], seed=3)
    params = trained_like(tiny, spec, 5)
    blob = serialize_adapter(params, spec, "tiny", "bfloat16")
    header_spec, base_name, dtypes = adapter_header(blob)
    _, parsed_spec, parsed_base = parse_adapter(blob)
    assert (header_spec, base_name) == (parsed_spec, parsed_base) == (spec, "tiny")
    assert set(dtypes) == set(params) and set(dtypes.values()) == {"BF16"}

    def blob_with(tensors, config):
        return st_save(tensors, metadata={"adapter_config": json.dumps(config)})

    config = {"peft_type": "LORA", "r": 3, "lora_alpha": 3, "target_modules": ["q_proj", "up_proj"]}
    partial = {k: v for k, v in params.items() if k != peft_key(0, "up_proj", "B")}
    odd = dict(params, **{"model.embed_tokens.weight": torch.zeros(2, 2)})
    refused = {
        "truncated": (blob[:20], DataLoss),
        "not an object": (len(b"[1]").to_bytes(8, "little") + b"[1]", DataLoss),
        "no config": (st_save(params), DataLoss),
        "rank disagrees": (blob_with(params, config), InvalidArgument),
        "missing B": (blob_with(partial, dict(config, r=2, lora_alpha=2)), InvalidArgument),
        "foreign key": (blob_with(odd, dict(config, r=2, lora_alpha=2)), InvalidArgument),
    }
    for bad, error in refused.values():
        with pytest.raises(error):
            adapter_header(bad)
        with pytest.raises(error):
            parse_adapter(bad)
    header = json.dumps({"__metadata__": {"adapter_config": json.dumps(config)},
                         "model.layers.0.self_attn.q_proj.lora_A.weight": {"dtype": "F32"}}).encode()
    with pytest.raises(DataLoss, match="malformed"):
        adapter_header(len(header).to_bytes(8, "little") + header)


def test_training_state_roundtrip_is_exact(tiny):
    spec = LoraSpec.create(4, 0, seed=3)
    params = trained_like(tiny, spec, 3)
    exp_avg = {k: torch.randn_like(v) for k, v in params.items()}
    exp_avg_sq = {k: torch.rand_like(v) for k, v in params.items()}
    blob = serialize_training_state(TrainingState(params, exp_avg, exp_avg_sq, 17, spec, "tiny"))
    state = parse_training_state(blob)
    assert state.step == 17 and state.spec == spec and state.base_model_name == "tiny"
    for key in params:
        assert torch.equal(state.params[key], params[key])
        assert torch.equal(state.exp_avg[key], exp_avg[key])
        assert torch.equal(state.exp_avg_sq[key], exp_avg_sq[key])
    # A weights blob is not a training state.
    with pytest.raises(InvalidArgument) as info:
        parse_training_state(serialize_adapter(params, spec, "tiny"))
    assert info.value.field == "source"


def test_exported_blob_loads_in_hf_peft_with_identical_logits(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    spec = LoraSpec.create(4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                           seed=5)
    params = trained_like(tiny, spec, 4)
    directory = materialize_peft_dir(serialize_adapter(params, spec, "tiny"), tmp_path / "adapter")
    assert (directory / "adapter_model.safetensors").is_file() and (directory / "adapter_config.json").is_file()
    tokens = torch.randint(0, tiny.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    attach_multi_lora(tiny.model)
    adapter = AdapterTensors.from_params(params, spec)
    with torch.no_grad(), lora_routing(tiny.model, [adapter, adapter]):
        ours = tiny.model(tokens).logits
    fresh = load_base_model("tiny").model
    peft_model = peft.PeftModel.from_pretrained(fresh, str(directory))
    peft_model.eval()
    with torch.no_grad():
        theirs = peft_model(tokens).logits
        base = load_base_model("tiny").model(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), float((ours - theirs).abs().max())
    assert not torch.allclose(ours, base, atol=1e-3)


def test_serialization_is_deterministic(tiny):
    # The registry is content-addressed: the same state must give the same bytes every time.
    spec = LoraSpec.create(4, 0, seed=2)
    params = trained_like(tiny, spec, 5)
    moments = {k: torch.zeros_like(v) for k, v in params.items()}
    state = TrainingState(params, moments, moments, 1, spec, "tiny")
    assert len({serialize_training_state(state) for _ in range(5)}) == 1
    assert len({serialize_adapter(params, spec, "tiny") for _ in range(5)}) == 1
    assert parse_training_state(serialize_training_state(state)).step == 1


def test_blob_is_plain_safetensors_from_any_layout_and_device_dtype(tiny):
    """The writer copies each tensor once from whatever it is given (here: transposed views and bfloat16 tensors);
    safetensors' own reader gets the same float32 values back."""
    from safetensors.torch import load as st_load

    spec = LoraSpec.create(3, 6, ["k_proj", "up_proj"], seed=4)
    params = trained_like(tiny, spec, 3)
    odd_layouts = {k: (v.t().contiguous().t() if "lora_B" in k else v.to(torch.bfloat16)) for k, v in params.items()}
    assert any(not v.is_contiguous() for v in odd_layouts.values())
    blob = serialize_adapter(odd_layouts, spec, "tiny")
    header_len = int.from_bytes(blob[:8], "little")
    assert (8 + header_len) % 8 == 0  # data starts aligned
    loaded = st_load(blob)
    assert set(loaded) == set(params)
    for k, v in odd_layouts.items():
        assert loaded[k].dtype == torch.float32 and torch.equal(loaded[k], v.float())


def test_non_finite_values_are_named_and_huge_finite_ones_pass(tiny):
    spec = LoraSpec.create(2, 0, ["q_proj", "o_proj"], seed=1)
    params = trained_like(tiny, spec, 5)
    bad_key = peft_key(1, "o_proj", "B")
    poisoned = {k: v.clone() for k, v in params.items()}
    poisoned[bad_key][0, 1] = float("nan")
    with pytest.raises(InvalidArgument, match=bad_key.replace(".", r"\.")):
        serialize_adapter(poisoned, spec, "tiny")
    infinite = {k: v.clone() for k, v in params.items()}
    infinite[bad_key][1, 0] = float("-inf")
    blob = serialize_adapter(params, spec, "tiny")
    config = json.loads(json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]["adapter_config"])
    with pytest.raises(InvalidArgument, match="non-finite"):
        parse_adapter(st_save(infinite, metadata={"adapter_config": json.dumps(config)}))
    # Values whose float32 norm may overflow are still finite: they must not be rejected.
    huge = {k: torch.full_like(v, 3e37) for k, v in params.items()}
    back, _, _ = parse_adapter(serialize_adapter(huge, spec, "tiny"))
    assert all(torch.equal(back[k], huge[k]) for k in huge)
