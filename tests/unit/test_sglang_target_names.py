"""The target_modules an adapter's config lists when it goes to SGLang. SGLang 0.5.17 accepts an adapter only if
every listed name (its last part mapped through SGLang's own table: q/k/v_proj -> qkv_proj, gate/up_proj ->
gate_up_proj) is one of its LoRA buffers; Qwen3.5's in_proj_q/k/v/z have no buffers of their own but are the slices
of SGLang's in_proj_qkvz, and an adapter listing in_proj_z was refused on a real server ("incompatible with the
current LoRA memory pool configuration", H200 run s35). The config names that module; every other family's names
stay as PEFT's."""

from __future__ import annotations

import json

import pytest

from loraplane.adapter_format import parse_adapter, sglang_target_modules
from loraplane.models import families, load_base_model
from sampler_svc.engines.sglang_engine import SGLangEngine
from sampler_svc.engines.sglang_servers import SGLangServer
from sampler_svc.engines.sglang_transport import write_peft_dir
from tests.fixtures.models import build_checkpoint
from tests.fixtures.sampler import adapter_blob

QWEN3_5_TARGETS = ("q_proj", "o_proj", "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj", "gate_proj",
                   "down_proj")


@pytest.mark.parametrize("model_type, given, sent", [
    ("qwen3_5", ["q_proj", "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "out_proj", "gate_proj"],
     ["q_proj", "in_proj_qkvz", "out_proj", "gate_proj"]),
    ("qwen3_5_moe", ["in_proj_z", "shared_expert.up_proj", "experts.gate_up_proj"],
     ["in_proj_qkvz", "shared_expert.up_proj", "experts.gate_up_proj"]),
    ("llama", ["q_proj", "k_proj", "up_proj", "down_proj"], ["q_proj", "k_proj", "up_proj", "down_proj"]),
    ("qwen3_moe", ["q_proj", "experts.gate_up_proj", "experts.down_proj"],
     ["q_proj", "experts.gate_up_proj", "experts.down_proj"]),
])
def test_only_a_part_of_a_module_sglang_names_otherwise_is_renamed(model_type, given, sent):
    assert sglang_target_modules(given, families.FAMILIES[model_type]) == sent


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    directory = build_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    return directory, load_base_model(str(directory))


def test_a_peft_directory_for_sglang_names_in_proj_qkvz(qwen3_5, tmp_path):
    _, base = qwen3_5
    blob = adapter_blob(3, base=base, targets=QWEN3_5_TARGETS)
    plain = json.loads((write_peft_dir(blob, tmp_path / "plain") / "adapter_config.json").read_text())
    assert {"in_proj_q", "in_proj_z"} <= set(plain["target_modules"])  # a PEFT directory as PEFT names it
    served = write_peft_dir(blob, tmp_path / "served", family=base.family)
    config = json.loads((served / "adapter_config.json").read_text())
    assert "in_proj_qkvz" in config["target_modules"]
    assert not {"in_proj_q", "in_proj_z"} & set(config["target_modules"])
    assert (served / "adapter_model.safetensors").read_bytes() == blob  # the weights keep their PEFT keys


def test_tensors_for_sglang_name_in_proj_qkvz(qwen3_5, tmp_path):
    directory, base = qwen3_5
    engine = SGLangEngine(str(directory), urls=["http://127.0.0.1:1"], work_dir=tmp_path)
    engine.transport.family = base.family  # what start() reads from the checkpoint
    params, spec, base_name = parse_adapter(adapter_blob(4, base=base, targets=QWEN3_5_TARGETS))
    body, _ = engine.transport.tensor_body("q@v1", params, spec, base_name, SGLangServer("http://x"), False)
    head = json.loads(body.split(b', "serialized_named_tensors"')[0] + b"}")
    assert "in_proj_qkvz" in head["config_dict"]["target_modules"]
    assert "in_proj_z" not in head["config_dict"]["target_modules"]


def test_older_layer_kind_names_are_not_windows():
    """transformers 5.12 (SGLang 0.5.17's pin) exposes Nemotron-H's layers_block_type as layer_types in the older
    names (mamba / attention / moe / mlp), which SGLang's own config also requires; they are no sliding windows
    (the refusal a Nemotron-H checkpoint met in the GPU run), while a windowed layer kind still is one."""
    from types import SimpleNamespace

    from loraplane.models.families import sliding_window_in_use

    assert sliding_window_in_use(SimpleNamespace(layer_types=["mamba", "moe", "attention", "mlp"])) == ""
    assert "sliding_attention" in sliding_window_in_use(SimpleNamespace(layer_types=["sliding_attention",
                                                                                    "full_attention"]))
