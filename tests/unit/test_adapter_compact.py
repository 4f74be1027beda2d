"""Compact expert adapters (issue 34 item 2): a shared-outer adapter's weights blob holds its shared factors once
(format "2"), every reader takes it and the blobs written before it (format "1"), the registry's check refuses a
compact blob of the wrong shapes naming the tensor, and the exports give each consumer its layout: HF PEFT (per
expert, the trainer's logits) and Tinker's (3-D experts, shared side once), which tinker-cookbook's own merge
turns into a model with the trainer's logits and which imports back as the same adapter. CPU fp32, `tiny-moe`."""

from __future__ import annotations

import copy
import json
import warnings
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from loraplane.adapter_format import (
    COMPACT_FORMAT,
    FORMAT_VERSION_KEY,
    SafetensorsWriter,
    adapter_header,
    adapter_tensor_views,
    blob_metadata,
    expand_shared_outer,
    from_tinker,
    materialize_peft_dir,
    materialize_sglang_dir,
    materialize_tinker_dir,
    parse_adapter,
    read_tinker_dir,
    serialize_adapter,
    sglang_packing,
    tinker_adapter_config,
    tinker_expert_key,
    to_tinker,
)
from loraplane.errors import DataLoss, InvalidArgument
from loraplane.lora import LoraSpec, attach_multi_lora, expected_shapes, peft_key
from loraplane.models import load_base_model
from registry_svc.blob_check import BlobCheck
from tests.unit.test_moe_lora import hf_model, ids, our_logits, trained

GATE_UP_A = peft_key(1, "experts.gate_up_proj", "A")
DOWN_B = peft_key(2, "experts.down_proj", "B")


@pytest.fixture(scope="module")
def moe():
    base = load_base_model("tiny-moe")
    pristine = copy.deepcopy(base.model)
    attach_multi_lora(base.model, tuple(base.module_dims))
    return base, pristine


def header_of(blob: bytes) -> dict:
    return json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])


def checked(blob: bytes) -> BlobCheck:
    check = BlobCheck(len(blob), training_state=False)
    for start in range(0, len(blob), 97):  # a shared factor split across chunks
        check.feed(blob[start:start + 97])
    check.finish()
    return check


class _Qwen3_30B_A3B:
    """The LoRA-relevant shape of Qwen3-30B-A3B (its config.json): 48 layers, every one MoE, hidden 2048, 32 query
    and 4 KV heads of 128, 128 routed experts of FFN 768."""

    num_layers = 48
    num_experts = 128
    module_dims: ClassVar = {"q_proj": (2048, 4096), "k_proj": (2048, 512), "v_proj": (2048, 512), "o_proj": (4096, 2048),
                   "experts.gate_up_proj": (2048, 2 * 768), "experts.down_proj": (768, 2048)}

    def layer_targets(self, layer: int):
        return tuple(self.module_dims)


def test_compact_blob_of_qwen3_30b_a3b_rank_32_is_a_third_of_the_expanded_one():
    """The blob sizes from the writer's own header over meta tensors (no data): rank 32 on attention and the routed
    experts, bf16. Expanded (format "1", and a per-expert adapter) 2.57 GB; compact 0.97 GB."""
    base = _Qwen3_30B_A3B()
    spec = LoraSpec.create(32, 32, [], 0, available=tuple(base.module_dims), expert_layout="shared_outer")
    compact = {k: torch.empty(s, device="meta") for k, s in expected_shapes(base, spec).items()}
    expanded = expand_shared_outer(compact, spec)
    metadata = {"adapter_config": "{}"}
    compact_size = SafetensorsWriter(compact, metadata, torch.bfloat16).size
    expanded_size = SafetensorsWriter(expanded, metadata, torch.bfloat16).size
    # The same arithmetic by hand: per layer, attention r (in + out) per projection, the experts r E (in + out)
    # expanded; compact, the shared gate_up A and down B once (r 2048 each) and the experts' own gate_up B
    # (1536 r E) and down A (768 r E).
    r, e, layers = 32, 128, 48
    attention = r * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))
    per_expert_params = layers * (attention + r * e * (2048 + 1536 + 768 + 2048))
    compact_params = layers * (attention + r * 2048 * 2 + r * e * (1536 + 768))
    # Two bytes a bf16 value; the rest is the header.
    assert 0 < expanded_size - 2 * per_expert_params < 200_000
    assert 0 < compact_size - 2 * compact_params < 200_000
    assert per_expert_params == 1_285_029_888 and compact_params == 486_014_976
    assert round(expanded_size / 1e9, 2) == 2.57
    assert round(compact_size / 1e9, 2) == 0.97
    assert compact_size / expanded_size == pytest.approx(0.378, abs=0.001)


def test_a_shared_outer_blob_is_written_compact_and_every_reader_takes_both_formats(moe):
    base, _ = moe
    spec, params = trained(base, "shared_outer")
    new = serialize_adapter(params, spec, base.name)
    old = serialize_adapter(params, spec, base.name, compact=False)
    header, old_header = header_of(new), header_of(old)
    assert header["__metadata__"][FORMAT_VERSION_KEY] == COMPACT_FORMAT
    assert FORMAT_VERSION_KEY not in old_header["__metadata__"]
    assert header[GATE_UP_A]["shape"] == [4, 64] and old_header[GATE_UP_A]["shape"] == [4 * 8, 64]
    assert header[DOWN_B]["shape"] == [64, 4] and old_header[DOWN_B]["shape"] == [64, 4 * 8]
    # The shared factors' repeats are all the difference (4 B per fp32 value).
    repeats = sum(old_header[k]["data_offsets"][1] - old_header[k]["data_offsets"][0]
                  - (header[k]["data_offsets"][1] - header[k]["data_offsets"][0]) for k in header if k in params)
    assert repeats == 2 * 7 * (4 * 64) * 4 * 2  # 2 MoE layers x 7 repeats x (A [4, 64] + B [64, 4]) fp32
    header_bytes = [int.from_bytes(b[:8], "little") for b in (old, new)]
    assert len(old) - len(new) == repeats + header_bytes[0] - header_bytes[1]
    for blob in (new, old):
        parsed, parsed_spec, _ = parse_adapter(blob)
        assert parsed_spec == spec and set(parsed) == set(params)
        assert all(torch.equal(parsed[k], params[k]) for k in params)
        assert adapter_header(blob)[0] == spec
        views, _, _ = adapter_tensor_views(blob)
        expanded = expand_shared_outer(views, spec)
        assert all(torch.equal(expanded[k], v) for k, v in expand_shared_outer(params, spec).items())
        for form in ("per_expert", "stacked"):  # the SGLang engine's packing expands on the sampler
            whole, _, _ = sglang_packing(views, spec, form=form)
            reference, _, _ = sglang_packing(params, spec, form=form)
            assert all(torch.equal(whole[k], reference[k]) for k in reference)
            # From the compact blob the shared factor is every expert's as a broadcast view, not 8 copies.
            stacked_a = whole["base_model.model.model.layers.1.mlp.experts.gate_up_proj.lora_A.weight"]
            assert stacked_a.shape == (8, 4, 64) and stacked_a.stride(0) == (0 if blob is new else 4 * 64)
        assert checked(blob).spec == spec
    assert checked(new).format == "2" and checked(old).format == "1"


def test_per_expert_and_dense_blobs_are_unchanged(moe):
    base, _ = moe
    for layout, targets in (("per_expert", ()), ("shared_outer", ("q_proj", "v_proj"))):
        spec, params = trained(base, layout, targets=targets)
        blob = serialize_adapter(params, spec, base.name)
        assert blob == serialize_adapter(params, spec, base.name, compact=False)
        assert FORMAT_VERSION_KEY not in blob_metadata(blob)


def test_a_compact_blob_of_the_wrong_shapes_or_an_unknown_format_is_refused_naming_it(moe):
    base, _ = moe
    spec, params = trained(base, "shared_outer")
    good = serialize_adapter(params, spec, base.name)
    metadata = blob_metadata(good)
    tensors = st_load(good)
    tensors[GATE_UP_A] = tensors[GATE_UP_A].repeat(2, 1)  # [2r, in]: neither one copy nor one per expert
    bad = st_save(tensors, metadata)
    with pytest.raises(InvalidArgument) as caught:
        checked(bad)
    assert GATE_UP_A in caught.value.message and caught.value.field == "chunk"
    with pytest.raises(InvalidArgument, match=GATE_UP_A.replace(".", r"\.")):
        parse_adapter(bad)
    # The expanded tensors under the compact format's label: refused, not folded.
    expanded = st_save({k: v.contiguous() for k, v in expand_shared_outer(params, spec).items()}, metadata)
    with pytest.raises(InvalidArgument, match="compact shared_outer"):
        checked(expanded)
    future = st_save(st_load(good), {**metadata, FORMAT_VERSION_KEY: "3"})
    with pytest.raises(InvalidArgument, match="loraplane_format '3'"):
        checked(future)
    with pytest.raises(DataLoss, match="loraplane_format '3'"):
        parse_adapter(future)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_hf_peft_and_sglang_exports_of_a_compact_blob_are_the_expanded_ones(moe, tmp_path, layout):
    from peft import PeftModel

    base, pristine = moe
    spec, params = trained(base, layout)
    blob = serialize_adapter(params, spec, base.name)
    old = serialize_adapter(params, spec, base.name, compact=False)
    for write in (materialize_peft_dir, materialize_sglang_dir):
        new_dir, old_dir = write(blob, tmp_path / "new" / write.__name__), write(old, tmp_path / "old" / write.__name__)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (new_dir / name).read_bytes() == (old_dir / name).read_bytes()
    directory = tmp_path / "new" / "materialize_peft_dir"
    assert json.loads((directory / "adapter_config.json").read_text())["target_parameters"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(hf_model(pristine, "eager"), directory).eval()
    tokens = ids(5)
    with torch.no_grad():
        assert (our_logits(base, spec, params, tokens) - peft_model(tokens).logits).abs().max() < 1e-4


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_tinker_export_is_what_the_cookbook_merges_and_imports_back(moe, tmp_path, layout):
    """Tinker's layout: w1/w3/w2 3-D expert factors, the shared side of shape[0] 1; tinker-cookbook's own
    build_hf_model merges it into a model whose logits are the trainer's; from_tinker reads it back exactly.
    (build_hf_model's merge_strategy="full" gets gate_up wrong here, for either expert layout, on this
    transformers' in-memory fused experts; its default shard merge works on the checkpoint's tensors.)"""
    from tinker_cookbook.weights import build_hf_model
    from transformers import AutoModelForCausalLM

    base, pristine = moe
    spec, params = trained(base, layout)
    blob = serialize_adapter(params, spec, base.name)
    directory = materialize_tinker_dir(blob, tmp_path / "tinker")
    tensors = st_load((directory / "adapter_model.safetensors").read_bytes())
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    shared = 1 if layout == "shared_outer" else 8
    assert tensors[tinker_expert_key(1, "w1", "A")].shape == (shared, 4, 64)
    assert tensors[tinker_expert_key(1, "w3", "A")].shape == (shared, 4, 64)
    assert tensors[tinker_expert_key(1, "w1", "B")].shape == (8, 32, 4)
    assert tensors[tinker_expert_key(1, "w2", "A")].shape == (8, 4, 32)
    assert tensors[tinker_expert_key(1, "w2", "B")].shape == (shared, 64, 4)
    assert not any(".experts.base_layer." in k or k.endswith("experts.lora_A.weight") for k in tensors)
    back, back_spec, _ = read_tinker_dir(directory)
    assert back_spec == spec and set(back) == set(params)
    assert all(torch.equal(back[k], params[k]) for k in params)

    pristine.save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_hf_model(base_model=str(tmp_path / "base"), adapter_path=str(directory),
                       output_path=str(tmp_path / "merged"))  # its default, shard-by-shard merge
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tokens = ids(6)
    with torch.no_grad():
        ours = our_logits(base, spec, params, tokens)
        assert (merged(tokens).logits - ours).abs().max() < 1e-4
        assert (pristine(tokens).logits - ours).abs().max() > 0.5  # the adapter matters


def test_a_tinker_adapter_loraplane_cannot_train_is_refused_naming_the_key(moe):
    base, _ = moe
    spec, params = trained(base, "shared_outer")
    tensors = to_tinker(params, spec)
    config = tinker_adapter_config(spec, base.name)

    def refused(changed: dict, named: str) -> None:
        with pytest.raises(InvalidArgument) as caught:
            from_tinker(changed, config)
        assert named in caught.value.message, caught.value.message

    unembed = "base_model.model.model.unembed_tokens.lora_A.weight"
    refused({**tensors, unembed: torch.zeros(4, 64)}, unembed)
    w3a = tinker_expert_key(2, "w3", "A")
    refused({**tensors, w3a: tensors[w3a] + 1.0}, w3a)  # gate and up with different A
    w2b = tinker_expert_key(1, "w2", "B")
    refused({**tensors, w2b: tensors[w2b].expand(8, -1, -1).contiguous()}, w2b)  # half shared-outer
    w1b = tinker_expert_key(1, "w1", "B")
    refused({k: v for k, v in tensors.items() if k != w1b}, w1b)
    refused({**tensors, w1b: torch.zeros(8, 32, 2)}, w1b)  # rank 2 in a rank-4 adapter
    peft_style = {**expand_shared_outer(params, spec)}
    refused(peft_style, "experts")  # HF PEFT's 2-D target_parameters keys are not Tinker's


def test_a_bfloat16_version_exports_to_tinker_in_bfloat16(moe, tmp_path):
    base, _ = moe
    spec, params = trained(base, "shared_outer")
    blob = serialize_adapter(params, spec, base.name, "bfloat16")
    directory = materialize_tinker_dir(blob, tmp_path / "bf16")
    tensors = st_load((directory / "adapter_model.safetensors").read_bytes())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    back, back_spec, _ = read_tinker_dir(directory)
    rounded, _, _ = parse_adapter(blob)
    assert back_spec == spec and all(torch.equal(back[k], rounded[k]) for k in rounded)
