"""A Qwen3-MoE base model (`tiny-moe`: a dense layer and MoE layers of 8 experts, top-2, GQA, q/k norms) through the
gateway's entry points on CPU: the Tinker SDK trains a LoRA on attention and the routed experts (the family's
default targets), its sampling client serves exactly the version just trained (logprobs equal the trainer's
forward), and the OpenAI client samples that version by name, differently from the base model."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import tinker
from tinker import types

from tests.gateway.conftest import start_cluster, stop_cluster
from tests.gateway.test_tinker_sdk import batch, datum, target_logprobs


@pytest.fixture(scope="module")
def moe_cluster(valkey, seaweed, background_loop, tmp_path_factory):
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model="tiny-moe")
    yield live
    stop_cluster(live)


def test_tinker_sdk_and_openai_client_on_a_moe_base(moe_cluster):
    service = tinker.ServiceClient(base_url=moe_cluster.base_url)
    training = service.create_lora_training_client(base_model="tiny-moe", rank=4, seed=3).result()
    assert training.get_info().model_data.model_name == "tiny-moe"
    seqs = batch(5)
    data = [datum(s) for s in seqs]
    losses = []
    for _ in range(4):
        backward = training.forward_backward(data, "cross_entropy")
        # Tinker's LoRA scale (alpha 32 / rank 4 = 8): 5e-3 moves it about as 4e-2 did at scale 1.
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(backward.result().metrics["loss:sum"])
    assert losses[-1] < losses[0] * 0.9, losses

    learned = target_logprobs(training, seqs[:1])[0]
    sampling = training.save_weights_and_get_sampling_client().result()
    sampled = sampling.compute_logprobs(types.ModelInput.from_ints(seqs[0])).result()
    assert sampled[0] is None
    np.testing.assert_allclose(sampled[1:], learned, atol=1e-3)
    reply = sampling.sample(types.ModelInput.from_ints(seqs[0][:6]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)).result()
    assert [len(s.tokens) for s in reply.sequences] == [5, 5]

    oai = openai.OpenAI(base_url=moe_cluster.base_url + "/v1", api_key="unused", max_retries=0)
    versions = [m.id for m in oai.models.list().data if "@v" in m.id]
    assert len(versions) == 1, versions
    prompt = seqs[0][:6]
    tuned = oai.completions.create(model=versions[0], prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    base = oai.completions.create(model="tiny-moe", prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    assert len(tuned.choices[0].logprobs.token_logprobs) == 4
    assert tuned.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
    service.close("success")
