"""`tinker checkpoint download` of a loraplane checkpoint hands out what Tinker would (issue 34 item 2): Tinker's
adapter layout (routed experts as 3-D w1/w3/w2 tensors), which tinker-cookbook's own `weights.build_hf_model`
merges into a Hugging Face model whose logprobs are the trainer's. The SDK's CLI as a subprocess against a live
gateway on `tiny-moe` (CPU)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import tinker
import torch
from safetensors import safe_open
from tinker import types

from loraplane.models import load_base_model
from tests.gateway.conftest import start_cluster, stop_cluster
from tests.gateway.test_tinker_cli import cli
from tests.gateway.test_tinker_sdk import batch, datum, target_logprobs


@pytest.fixture(scope="module")
def moe_cluster(valkey, seaweed, background_loop, tmp_path_factory):
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model="tiny-moe")
    yield live
    stop_cluster(live)


def test_downloaded_checkpoint_is_tinkers_layout_and_the_cookbook_merges_it(moe_cluster, tmp_path):
    from tinker_cookbook.weights import build_hf_model
    from transformers import AutoModelForCausalLM

    service = tinker.ServiceClient(base_url=moe_cluster.base_url)
    try:
        training = service.create_lora_training_client(base_model="tiny-moe", rank=4, seed=5).result()
        seqs = batch(11)
        for _ in range(2):
            training.forward_backward([datum(s) for s in seqs], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        learned = target_logprobs(training, seqs[:1])[0]
        state = training.save_state("moe-state").result().path
        # A training client made from that state has its layout and its logprobs.
        resumed = service.create_training_client_from_state(state).result()
        np.testing.assert_allclose(target_logprobs(resumed, seqs[:1])[0], learned, atol=1e-6)
    finally:
        service.close("success")

    cli(moe_cluster, "checkpoint", "download", state, "--output", str(tmp_path / "dl"))
    files = {p.name: p for p in (tmp_path / "dl").rglob("*") if p.is_file()}
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}, files
    config = json.loads(files["adapter_config.json"].read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 32)
    with safe_open(str(files["adapter_model.safetensors"]), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
    experts = "base_model.model.model.layers.1.mlp.experts"
    # Tinker's MoE adapters are shared-outer: the hidden side's factor (w1/w3 A, w2 B) once per layer.
    assert shapes[f"{experts}.w1.lora_A.weight"] == (1, 4, 64)
    assert shapes[f"{experts}.w3.lora_B.weight"] == (8, 32, 4)
    assert shapes[f"{experts}.w2.lora_A.weight"] == (8, 4, 32)
    assert shapes[f"{experts}.w2.lora_B.weight"] == (1, 64, 4)
    assert not any("base_layer" in k for k in shapes)  # no HF PEFT target_parameters keys

    load_base_model("tiny-moe").model.save_pretrained(tmp_path / "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_hf_model(base_model=str(tmp_path / "base"), adapter_path=str(files["adapter_config.json"].parent),
                       output_path=str(tmp_path / "merged"))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tokens = torch.tensor([seqs[0]])
    with torch.no_grad():
        logprobs = torch.log_softmax(merged(tokens[:, :-1]).logits[0], dim=-1)
    theirs = logprobs.gather(1, tokens[0, 1:, None])[:, 0].numpy()
    np.testing.assert_allclose(theirs, learned, atol=1e-4)
