"""A gpt-oss expert adapter in Tinker's layout: gpt-oss orders its fused gate_up interleaved ([g0, u0, g1, ...]),
so the gate_up lora_B rows the trainer holds split into Tinker's w1 (gate) / w3 (up) by that order. The blob records
the order (adapter_format.GATE_UP_KEY, from the family), the export splits by it, tinker-cookbook's own
build_hf_model (its gpt-oss profile merges into the interleaved fused weight) gives the trainer's logits, and the
import puts the rows back where they were."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load as st_load

from loraplane.adapter_format import (
    GATE_UP_KEY,
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
    blob = serialize_adapter(params, spec, str(checkpoint), gate_up=base.family.expert_gate_up)
    assert json.loads(blob_metadata(blob)["adapter_config"])[GATE_UP_KEY] == "interleaved"
    directory = materialize_tinker_dir(blob, tmp_path / "tinker")
    tensors = st_load((directory / "adapter_model.safetensors").read_bytes())
    key = peft_key(0, "experts.gate_up_proj", "B")
    gate_up_b = params[key]  # [2 ffn, r E], expert e's column j at j E + e
    experts = base.num_experts
    stacked = gate_up_b.reshape(gate_up_b.shape[0], spec.rank, experts).permute(2, 0, 1)
    assert torch.equal(tensors[tinker_expert_key(0, "w1", "B")], stacked[:, 0::2])
    assert torch.equal(tensors[tinker_expert_key(0, "w3", "B")], stacked[:, 1::2])
    back, back_spec, _ = read_tinker_dir(directory)
    assert back_spec == spec and all(torch.equal(back[k], params[k]) for k in params)

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
        assert config[GATE_UP_KEY] == "interleaved" and "mlp.experts.gate_up_proj" in config["target_parameters"]
    finally:
        live.close()
