"""The trainer servicer's wire -> domain conversion: what the service sees of CreateAdapter's LoraConfig and
LoadState's AdapterRef (the service itself takes no protobuf; tests/unit/test_layers.py enforces that)."""

from __future__ import annotations

from loraplane.v1 import common_pb2
from trainer_svc.service import LoraConfig, SourceRef
from trainer_svc.servicer import lora_config, source_ref


def test_lora_config_carries_every_field_unvalidated():
    message = common_pb2.LoraConfig(rank=8, alpha=16.5, target_modules=["v_proj", "q_proj"], seed=2**63)
    assert lora_config(message) == LoraConfig(rank=8, alpha=16.5, target_modules=("v_proj", "q_proj"), seed=2**63)
    # An unset message is rank 0: the service's LoraSpec.create rejects it naming lora_config.rank.
    assert lora_config(common_pb2.LoraConfig()) == LoraConfig(rank=0)


def test_source_ref_keeps_which_selector_was_set():
    assert source_ref(common_pb2.AdapterRef(name="a")) == SourceRef("a", 0, None)
    assert source_ref(common_pb2.AdapterRef(name="a", version=7)) == SourceRef("a", 7, None)
    assert source_ref(common_pb2.AdapterRef(name="a", alias="prod")) == SourceRef("a", 0, "prod")
    # An alias set to "" is an (invalid) alias, not "the newest state": the service rejects it as source.alias.
    assert source_ref(common_pb2.AdapterRef(name="a", alias="")) == SourceRef("a", 0, "")
