"""A gpt-oss adapter in Tinker's layout: gpt-oss orders its fused gate_up interleaved ([g0, u0, g1, ...]), so the
gate_up lora_B rows the trainer holds split into Tinker's w1 (gate) / w3 (up) by that order, and Tinker names its
attention ``.attn``. The blob records the family (adapter_format.MODEL_TYPE_KEY), the export follows it,
tinker-cookbook's own build_hf_model (its gpt-oss profile) gives the trainer's logits, and the import puts every
tensor back where it was, also from an adapter that does not record the family (Tinker's own)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load as st_load

from loraplane.adapter_format import (
    MODEL_TYPE_KEY,
    blob_metadata,
    materialize_tinker_dir,
    read_tinker_dir,
    serialize_adapter,
    tinker_expert_key,
)
from loraplane.lora import AdapterTensors, LoraSpec, peft_key
from tests.fixtures.family_checks import backend_fixtures, packed_logits, trained_like

checkpoint, backend = backend_fixtures("gpt_oss")


def test_gpt_oss_experts_export_to_tinker_by_their_interleaved_order_and_the_cookbook_merges_them(
        checkpoint, backend, tmp_path):
    pytest.importorskip("tinker_cookbook")
    from tinker_cookbook.weights import build_hf_model
    from transformers import AutoModelForCausalLM

    base = backend.base
    assert base.family.expert_gate_up == "interleaved"
    spec = LoraSpec.create(4, 8, [], seed=5, available=tuple(base.module_dims))
    params = trained_like(base, spec, 3)
    blob = serialize_adapter(params, spec, str(checkpoint), model_type="gpt_oss")
    assert json.loads(blob_metadata(blob)["adapter_config"])[MODEL_TYPE_KEY] == "gpt_oss"
    directory = materialize_tinker_dir(blob, tmp_path / "tinker")
    tensors = st_load((directory / "adapter_model.safetensors").read_bytes())
    assert "base_model.model.model.layers.0.attn.q_proj.lora_A.weight" in tensors
    assert not any(".self_attn." in key for key in tensors)
    key = peft_key(0, "experts.gate_up_proj", "B")
    gate_up_b = params[key]  # [2 ffn, r E], expert e's column j at j E + e
    experts = base.num_experts
    stacked = gate_up_b.reshape(gate_up_b.shape[0], spec.rank, experts).permute(2, 0, 1)
    assert torch.equal(tensors[tinker_expert_key(0, "w1", "B")], stacked[:, 0::2])
    assert torch.equal(tensors[tinker_expert_key(0, "w3", "B")], stacked[:, 1::2])
    back, back_spec, _ = read_tinker_dir(directory)
    assert back_spec == spec and set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)
    # Tinker's own adapter_config.json does not name the family: its ".attn" keys do.
    config_path = directory / "adapter_config.json"
    config_path.write_text(json.dumps({k: v for k, v in json.loads(config_path.read_text()).items()
                                       if k != MODEL_TYPE_KEY}))
    back, _, _ = read_tinker_dir(directory)
    assert set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)

    row = list(range(5, 17))
    ours = packed_logits(backend, [row], [AdapterTensors.from_params(params, spec)])[0]

    def merged_logits(adapter_dir, name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_hf_model(base_model=str(checkpoint), adapter_path=str(adapter_dir), output_path=str(tmp_path / name))
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        with torch.no_grad():
            return merged(input_ids=torch.tensor([row])).logits[0]

    assert (merged_logits(directory, "merged") - ours).abs().max() < 1e-4
    # Split the other way (a blob that does not say the order) the cookbook merges another model.
    unordered = materialize_tinker_dir(serialize_adapter(params, spec, str(checkpoint)), tmp_path / "unordered")
    assert (merged_logits(unordered, "merged-unordered") - ours).abs().max() > 1e-3
    without = packed_logits(backend, [row], [None])[0]
    assert (without - ours).abs().max() > 1e-2  # the adapter matters


def test_a_gpt_oss_trainer_publishes_the_order_in_its_blobs(checkpoint, registry, background_loop):
    from loraplane.v1 import common_pb2, trainer_pb2
    from tests.fixtures.trainer import start_live_trainer

    live = start_live_trainer(registry.settings, background_loop, registry.address, base_model=str(checkpoint))
    try:
        stub = live.stub()
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="oss", lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=1)))
        version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="oss", seq_id=1)).version
        config = json.loads(blob_metadata(live.download("oss", version.version))["adapter_config"])
        assert config[MODEL_TYPE_KEY] == "gpt_oss" and "mlp.experts.gate_up_proj" in config["target_parameters"]
    finally:
        live.close()
