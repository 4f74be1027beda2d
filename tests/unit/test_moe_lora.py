"""LoRA on Qwen3-MoE routed experts (`tiny-moe`, CPU fp32): base numerics equal transformers', an exported adapter
of either expert layout gives HF PEFT 0.21's logits (target_parameters on the fused 3-D experts), the SGLang
per-expert layout converts losslessly both ways (and PEFT's own transformers-4 conversion of it agrees), blobs and
training states round-trip, and the sampler's row routing is batch-invariant for the experts."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from loraplane.adapter_format import (
    TrainingState,
    expand_shared_outer,
    fold_shared_outer,
    from_sglang,
    materialize_peft_dir,
    materialize_sglang_dir,
    parse_adapter,
    parse_training_state,
    serialize_adapter,
    serialize_training_state,
    to_sglang,
)
from loraplane.errors import InvalidArgument
from loraplane.lora import (
    AdapterTensors,
    LoraSpec,
    attach_multi_lora,
    grouped_mm,
    init_lora_params,
    lora_routing,
    lora_segments,
    peft_key,
)
from loraplane.models import load_base_model
from registry_svc.blob_check import BlobCheck

TOKENS = 24


@pytest.fixture(scope="module")
def moe():
    base = load_base_model("tiny-moe")
    pristine = copy.deepcopy(base.model)  # transformers' own experts, no hooks
    attach_multi_lora(base.model, tuple(base.module_dims))
    return base, pristine


def hf_model(pristine, implementation: str):
    model = copy.deepcopy(pristine)
    model.config._experts_implementation = implementation
    return model


def ids(seed: int = 0, length: int = TOKENS) -> torch.Tensor:
    return torch.randint(5, 250, (1, length), generator=torch.Generator().manual_seed(seed))


def trained(base, layout: str, rank: int = 4, targets=(), seed: int = 3):
    spec = LoraSpec.create(rank, 2.0 * rank, targets, seed, available=tuple(base.module_dims), expert_layout=layout)
    params = init_lora_params(base, spec)
    generator = torch.Generator().manual_seed(seed + 100)
    for key, tensor in params.items():
        if key.endswith("lora_B.weight"):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return spec, params


def our_logits(base, spec, params, tokens):
    adapter = AdapterTensors.from_params(params, spec)
    with torch.no_grad(), lora_segments(base.model, [(0, tokens.shape[1], adapter)]):
        return base.model(tokens).logits


def test_expert_keys_and_shapes_are_peft_target_parameters(moe):
    base, _ = moe
    spec, params = trained(base, "per_expert")
    assert spec.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
    prefix = "base_model.model.model.layers.1.mlp.experts"
    assert params[f"{prefix}.base_layer.lora_A.weight"].shape == (4 * 8, 64)  # gate_up: rank x experts rows
    assert params[f"{prefix}.base_layer.lora_B.weight"].shape == (64, 4 * 8)
    assert params[f"{prefix}.lora_A.weight"].shape == (4 * 8, 32)  # down_proj
    assert params[f"{prefix}.lora_B.weight"].shape == (64, 4 * 8)
    assert not any("layers.0.mlp" in k for k in params)  # layer 0 is dense: attention only
    _, shared = trained(base, "shared_outer")
    assert shared[f"{prefix}.base_layer.lora_A.weight"].shape == (4, 64)
    assert shared[f"{prefix}.lora_B.weight"].shape == (64, 4)


def test_base_numerics_are_transformers_eager_bit_for_bit(moe):
    base, pristine = moe
    tokens = ids(1)
    with torch.no_grad():
        eager = hf_model(pristine, "eager")(tokens).logits
        grouped = hf_model(pristine, "grouped_mm")(tokens).logits
        plain = base.model(tokens).logits
    assert torch.equal(plain, eager)
    assert torch.allclose(plain, grouped, atol=1e-5)
    for layout in ("per_expert", "shared_outer"):
        spec = LoraSpec.create(4, 8, (), 1, available=tuple(base.module_dims), expert_layout=layout)
        assert torch.equal(our_logits(base, spec, init_lora_params(base, spec), tokens), eager)  # B = 0


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_exported_adapter_gives_hf_peft_logits(moe, tmp_path, layout, implementation):
    from peft import PeftModel

    base, pristine = moe
    spec, params = trained(base, layout)
    tokens = ids(2)
    ours = our_logits(base, spec, params, tokens)
    directory = materialize_peft_dir(serialize_adapter(params, spec, base.name), tmp_path / "peft")
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(hf_model(pristine, implementation), directory).eval()
    with torch.no_grad():
        theirs = peft_model(tokens).logits
        plain = pristine(tokens).logits
    # PEFT folds scale * B A into each expert's weight; we add scale * (x A^T) B^T: the same math, other rounding.
    assert (ours - theirs).abs().max() < 2e-5
    assert (ours - plain).abs().max() > 0.5  # the adapter matters


def test_attention_only_adapter_on_a_moe_model_loads_in_peft(moe, tmp_path):
    from peft import PeftModel

    base, pristine = moe
    spec, params = trained(base, "per_expert", targets=["q_proj", "v_proj"])
    assert not spec.has_experts
    tokens = ids(3)
    directory = materialize_peft_dir(serialize_adapter(params, spec, base.name), tmp_path / "attn")
    assert "target_parameters" not in json.loads((directory / "adapter_config.json").read_text())
    peft_model = PeftModel.from_pretrained(hf_model(pristine, "eager"), directory).eval()
    with torch.no_grad():
        assert torch.allclose(our_logits(base, spec, params, tokens), peft_model(tokens).logits, atol=1e-5)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_sglang_layout_converts_losslessly_both_ways(moe, tmp_path, layout):
    from peft import PeftModel

    base, pristine = moe
    spec, params = trained(base, layout)
    tensors, config = to_sglang(params, spec)
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    layer1 = "base_model.model.model.layers.1.mlp.experts"
    assert tensors[f"{layer1}.7.gate_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{layer1}.7.up_proj.lora_B.weight"].shape == (32, 4)
    assert tensors[f"{layer1}.0.down_proj.lora_A.weight"].shape == (4, 32)
    assert len([k for k in tensors if ".experts." in k]) == 2 * 8 * 6
    back = from_sglang(tensors, spec)
    assert set(back) == set(params)
    assert all(torch.equal(back[k], params[k]) for k in params)
    # HF PEFT's own transformers-4 -> 5 conversion reads the per-expert directory as the same adapter.
    directory = materialize_sglang_dir(serialize_adapter(params, spec, base.name), tmp_path / "sglang")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(hf_model(pristine, "eager"), directory).eval()
    tokens = ids(4)
    with torch.no_grad():
        assert (our_logits(base, spec, params, tokens) - peft_model(tokens).logits).abs().max() < 2e-5


def test_sglang_adapter_with_separate_gate_and_up_a_is_refused(moe):
    base, _ = moe
    spec, params = trained(base, "per_expert")
    tensors, _ = to_sglang(params, spec)
    key = "base_model.model.model.layers.2.mlp.experts.3.up_proj.lora_A.weight"
    tensors[key] = tensors[key] + 1.0
    with pytest.raises(InvalidArgument, match="different lora_A"):
        from_sglang(tensors, spec)


def test_shared_outer_blob_of_format_1_is_per_expert_on_the_wire_and_folds_back(moe):
    """The blobs written before format "2" (tests/unit/test_adapter_compact.py has the compact ones)."""
    base, _ = moe
    spec, params = trained(base, "shared_outer")
    blob = serialize_adapter(params, spec, base.name, compact=False)
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    gate_up_a = peft_key(1, "experts.gate_up_proj", "A")
    assert header[gate_up_a]["shape"] == [4 * 8, 64]  # repeated per expert: what PEFT loads
    assert "loraplane_format" not in header["__metadata__"]
    assert json.loads(header["__metadata__"]["adapter_config"])["loraplane_expert_layout"] == "shared_outer"
    parsed, parsed_spec, _ = parse_adapter(blob)
    assert parsed_spec == spec
    assert all(torch.equal(parsed[k], params[k]) for k in params)
    check = BlobCheck(len(blob), training_state=False)
    check.feed(blob)
    check.finish()
    # A per-expert file claiming shared-outer (copies differ) is refused, not silently averaged.
    expanded = expand_shared_outer(params, spec)
    expanded[gate_up_a] = expanded[gate_up_a].clone()
    expanded[gate_up_a][-1, 0] += 1.0
    with pytest.raises(InvalidArgument, match="not shared-outer"):
        fold_shared_outer(expanded, spec)


def test_training_state_keeps_the_compact_layout(moe):
    base, _ = moe
    spec, params = trained(base, "shared_outer")
    state = TrainingState(params=params, exp_avg={k: v * 0.5 for k, v in params.items()},
                          exp_avg_sq={k: v * v for k, v in params.items()}, step=3, spec=spec,
                          base_model_name=base.name)
    blob = serialize_training_state(state)
    check = BlobCheck(len(blob), training_state=True)
    check.feed(blob)
    check.finish()
    loaded = parse_training_state(blob)
    assert loaded.spec == spec and loaded.step == 3
    assert all(torch.equal(loaded.params[k], params[k]) for k in params)
    assert loaded.params[peft_key(2, "experts.down_proj", "B")].shape == (64, 4)


def test_grouped_matmul_fallback_equals_the_kernel():
    generator = torch.Generator().manual_seed(5)
    experts = torch.tensor([0, 0, 2, 2, 2, 3], dtype=torch.long)
    offsets = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    x = torch.randn(6, 8, generator=generator)
    aligned = torch.randn(4, 8, 4, generator=generator)
    reference = torch.cat([x[0:2] @ aligned[0], x[2:5] @ aligned[2], x[5:6] @ aligned[3]])
    assert torch.equal(grouped_mm(x, aligned, offsets, experts), reference)  # torch._grouped_mm
    odd = torch.randn(4, 8, 3, generator=generator)  # rank 3: not 16-byte aligned, the gathered bmm runs
    expected = torch.cat([x[0:2] @ odd[0], x[2:5] @ odd[2], x[5:6] @ odd[3]])
    assert torch.allclose(grouped_mm(x, odd, offsets, experts), expected, atol=1e-6)


def test_row_routing_keeps_a_rows_experts_independent_of_the_batch(moe):
    """The sampler routes rows: a row's MoE output (and logits) must not change with what else is in the batch."""
    base, _ = moe
    spec_a, params_a = trained(base, "per_expert", seed=7)
    spec_b, params_b = trained(base, "shared_outer", rank=2, seed=8)
    a = AdapterTensors.from_params(params_a, spec_a)
    b = AdapterTensors.from_params(params_b, spec_b)
    rows = torch.cat([ids(10, 12), ids(11, 12), ids(10, 12)])  # row 2: row 0's tokens, base model
    with torch.no_grad():
        with lora_routing(base.model, [a]):
            alone = base.model(rows[:1]).logits
        with lora_routing(base.model, [a, b, None]):
            mixed = base.model(rows).logits
        with lora_routing(base.model, [b]):
            alone_b = base.model(rows[1:2]).logits
    assert torch.allclose(mixed[0], alone[0], atol=1e-5)
    assert torch.allclose(mixed[1], alone_b[0], atol=1e-5)
    assert not torch.allclose(mixed[0], mixed[2], atol=1e-3)
