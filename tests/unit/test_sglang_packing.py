"""The SGLang side of an adapter, per model family, without SGLang: which of our LoRA targets SGLang 0.5.17 serves
on each family and on which of its modules (the family's ``sglang`` map), the names and shapes of the tensors it is
sent, and an adapter with a target SGLang cannot serve refused FAILED_PRECONDITION by the sampler's transport
before anything reaches a server.

Qwen3.5 (SGLang's Qwen3_5ForCausalLM.supported_lora_modules: qkv_proj, o_proj, out_proj, in_proj_qkvz,
gate_up_proj, down_proj, lm_head): q/k/v stack into qkv_proj and gate/up into gate_up_proj; Tinker's in_proj_q/k/v
(three pairs on the fused in_proj_qkv) and in_proj_z stack into the fused in_proj_qkvz (Q | K | V | Z, a LoRA pair per
slice), all four or none: SGLang stacks them only when all four are there and drops a lone in_proj_z pair
(sglang/srt/lora/lora.py, _normalize_in_proj_qkvz); in_proj_b/a (SGLang's in_proj_ba takes no LoRA) are not served.
"""

from __future__ import annotations

import asyncio

import pytest

from loraplane import errors
from loraplane.adapter_format import sglang_modules, to_sglang
from loraplane.lora import LoraSpec, init_lora_params
from loraplane.models import families, load_base_model
from sampler_svc.engines.sglang_servers import SGLangHTTP, SGLangServer
from sampler_svc.engines.sglang_transport import AdapterTransport
from tests.fixtures.models import build_checkpoint
from tests.fixtures.sampler import adapter_blob

QWEN3_5_SERVED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
    "in_proj_q": "in_proj_qkvz", "in_proj_k": "in_proj_qkvz", "in_proj_v": "in_proj_qkvz",
    "in_proj_z": "in_proj_qkvz", "out_proj": "out_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
}
QWEN3_5_REFUSED = ["in_proj_b", "in_proj_a"]
GDN_SLICES = ["in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z"]


def offered(family) -> tuple[str, ...]:
    return family.lora_targets(families.text_config(family.tiny_config()))


def test_qwen3_5_targets_map_to_the_modules_sglang_serves():
    dense, moe = families.FAMILIES["qwen3_5"], families.FAMILIES["qwen3_5_moe"]
    servable = [t for t in offered(dense) if t not in QWEN3_5_REFUSED]
    assert sglang_modules(LoraSpec.create(4, 8, servable, 1), dense) == QWEN3_5_SERVED
    moe_servable = [t for t in offered(moe) if t not in QWEN3_5_REFUSED]
    assert sglang_modules(LoraSpec.create(4, 8, moe_servable, 1), moe) == {
        **{t: m for t, m in QWEN3_5_SERVED.items() if t not in families.DENSE_MLP_TARGETS},
        "shared_expert.gate_proj": "gate_up_proj", "shared_expert.up_proj": "gate_up_proj",
        "shared_expert.down_proj": "down_proj", "experts.gate_up_proj": "experts", "experts.down_proj": "experts"}
    for family in (dense, moe):
        # Every target the family offers (Tinker's default for it): refused, naming exactly the unservable ones.
        with pytest.raises(errors.FailedPrecondition) as caught:
            sglang_modules(LoraSpec.create(4, 8, offered(family), 1), family)
        message = caught.value.message
        assert f"adapter targets {QWEN3_5_REFUSED} cannot be served by SGLang on a {family.model_type}" in message
        assert "in_proj_qkvz" in message and "in_proj_z" in message.split("among")[1]
        assert caught.value.field == "adapter"


@pytest.mark.parametrize("part", [["in_proj_z"], ["in_proj_q", "in_proj_k", "in_proj_v"], ["in_proj_k", "in_proj_z"]])
def test_qwen3_5_gated_deltanet_slices_are_served_all_four_or_refused(part):
    family = families.FAMILIES["qwen3_5"]
    with pytest.raises(errors.FailedPrecondition) as caught:
        sglang_modules(LoraSpec.create(4, 8, ["q_proj", *part], 1), family)
    missing = [t for t in GDN_SLICES if t not in part]
    assert f"adapter targets {[t for t in GDN_SLICES if t in part]} are served by SGLang" in caught.value.message
    assert f"only together with {missing}" in caught.value.message
    assert set(sglang_modules(LoraSpec.create(4, 8, ["q_proj", *GDN_SLICES], 1), family).values()) == {
        "qkv_proj", "in_proj_qkvz"}


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_every_family_says_which_of_its_targets_sglang_serves(model_type):
    family = families.FAMILIES[model_type]
    targets = offered(family)
    table = family.sglang or {}
    servable = [t for t in targets if not table or table.get(t)]
    refused = [t for t in targets if t not in servable]
    if servable:
        modules = sglang_modules(LoraSpec.create(4, 8, servable, 1), family)
        assert list(modules) == servable and all(modules.values())
    for target in refused:
        with pytest.raises(errors.FailedPrecondition, match=f"\\['{target}'\\]"):
            sglang_modules(LoraSpec.create(4, 8, [target], 1), family)
    if model_type in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        assert not refused  # the Llama layout: SGLang serves every target
    if model_type == "gpt_oss":  # interleaved gate/up experts: not handed to SGLang until checked on a GPU
        assert refused == ["experts.gate_up_proj", "experts.down_proj"]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def qwen_base(request, tmp_path_factory):
    return load_base_model(str(build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))))


def test_the_tensors_sglang_gets_for_a_qwen3_5_adapter(qwen_base):
    # Names: PEFT's (the HF module paths SGLang maps onto its stacked modules itself); expert LoRA per expert.
    family = qwen_base.family
    servable = [t for t in qwen_base.module_dims if t not in QWEN3_5_REFUSED]
    spec = LoraSpec.create(4, 8, servable, 1)
    sglang_modules(spec, family)
    tensors, config = to_sglang(init_lora_params(qwen_base, spec), spec)
    hidden, value_dim = 64, 64
    prefix = "base_model.model.model.layers"
    z_a, z_b = tensors[f"{prefix}.0.linear_attn.in_proj_z.lora_A.weight"], tensors[
        f"{prefix}.0.linear_attn.in_proj_z.lora_B.weight"]
    assert tuple(z_a.shape) == (4, hidden) and tuple(z_b.shape) == (value_dim, 4)
    assert tuple(tensors[f"{prefix}.0.linear_attn.out_proj.lora_A.weight"].shape) == (4, value_dim)
    assert tuple(tensors[f"{prefix}.2.self_attn.q_proj.lora_B.weight"].shape) == (128, 4)  # query | gate
    q_b = tensors[f"{prefix}.0.linear_attn.in_proj_q.lora_B.weight"]
    assert tuple(q_b.shape) == (2 * 8, 4)  # the Q part of in_proj_qkv: 2 key heads x 8
    assert not any("in_proj_qkv." in k or "in_proj_b" in k for k in tensors)
    # Each layer: its own mixer's targets only.
    assert f"{prefix}.0.self_attn.q_proj.lora_A.weight" not in tensors
    assert f"{prefix}.2.linear_attn.in_proj_z.lora_A.weight" not in tensors
    if family.moe:
        assert tuple(tensors[f"{prefix}.1.mlp.shared_expert.gate_proj.lora_A.weight"].shape) == (4, hidden)
        assert tuple(tensors[f"{prefix}.1.mlp.experts.7.gate_proj.lora_A.weight"].shape) == (4, hidden)
        assert tuple(tensors[f"{prefix}.1.mlp.experts.7.up_proj.lora_B.weight"].shape) == (32, 4)
        assert tuple(tensors[f"{prefix}.1.mlp.experts.7.down_proj.lora_B.weight"].shape) == (hidden, 4)
        assert {"gate_proj", "up_proj", "down_proj", *GDN_SLICES} <= set(config["target_modules"])
    else:
        assert tuple(tensors[f"{prefix}.1.mlp.gate_proj.lora_A.weight"].shape) == (4, hidden)


def test_the_transport_refuses_an_adapter_sglang_cannot_serve_before_calling_it(qwen_base, tmp_path):
    blob = adapter_blob(3, base=qwen_base, targets=("q_proj", "in_proj_a", "in_proj_b"))
    transport = AdapterTransport(SGLangHTTP(), qwen_base.name, tmp_path, family=qwen_base.family)
    # No server listens there: reaching it would fail otherwise (and the HTTP session is not even open).
    server = SGLangServer(url="http://127.0.0.1:9")
    with pytest.raises(errors.FailedPrecondition) as caught:
        asyncio.run(transport.load(server, "tenant/a@v1", blob))
    assert "['in_proj_b', 'in_proj_a'] cannot be served by SGLang" in caught.value.message
    assert not transport.adapter_dir("tenant/a@v1").exists()
