"""Qwen3.5 dense (``qwen3_5``) and MoE (``qwen3_5_moe``) through the services on CPU fp32, each a tiny random
vision-language checkpoint directory (text weights under ``model.language_model.*``, as users download it) served
by one module-scoped cluster (registry, trainer, torch-engine sampler, gateway):

* the gRPC client trains LoRA on every target the family offers (both layer kinds, the dense MLP or the routed
  experts and the shared expert; loss decreases), publishes, and the sampler serves exactly that version: its
  prompt scoring and its generated tokens' logprobs (decoded through transformers' cache: the linear-attention
  layers' conv and recurrent states beside the KV cache) equal the trainer's Forward within 1e-4;
* through the gateway, the official ``tinker`` SDK trains and samples the same way and the ``openai`` client
  samples the new version by name, differently from the base model;
* an adapter on q_proj only (held by the full-attention layers alone) publishes and is served."""

from __future__ import annotations

import random

import numpy as np
import openai
import pytest
import tinker
from tinker import types

from loraplane.client import AdamParams, ModelInput, RetryConfig, SamplingParams, ServiceClient, datum_from_sequence
from loraplane.models import families
from tests.fixtures.models import build_checkpoint
from tests.gateway.conftest import start_cluster, stop_cluster
from tests.gateway.test_tinker_sdk import batch, datum, target_logprobs


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def qwen_cluster(request, valkey, seaweed, background_loop, tmp_path_factory):
    checkpoint = str(build_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model=checkpoint)
    yield request.param, checkpoint, live
    stop_cluster(live)


def learned_logprobs(training, tokens: list[int]) -> list[float]:
    return [lp for o in training.forward([datum_from_sequence(tokens)]).result(60).loss_fn_outputs
            for lp in o["logprobs"].tolist()]


def test_train_publish_sample_through_the_grpc_client(qwen_cluster):
    model_type, checkpoint, cluster = qwen_cluster
    retry = RetryConfig(max_attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=60,
                        attempt_timeout_s=60)
    service = ServiceClient(trainer=cluster.trainer.address, sampler=cluster.sampler.address,
                            registry=cluster.registry.address, retry=retry)
    try:
        training = service.create_lora_training_client(checkpoint, rank=4, seed=5, name=f"{model_type}/grpc")
        family = families.FAMILIES[model_type]
        offered = family.lora_targets(family.tiny_config().text_config)
        assert list(training.info.target_modules) == list(offered)
        assert "in_proj_q" in offered and "q_proj" in offered
        rng = random.Random(0)
        data = [datum_from_sequence([rng.randrange(5, 200) for _ in range(n)]) for n in (13, 9, 17)]
        losses = []
        for _ in range(4):
            backward = training.forward_backward(data, "cross_entropy")
            assert not training.optim_step(AdamParams(learning_rate=5e-2)).result(60).skipped
            losses.append(backward.result(60).loss)
        assert losses[-1] < losses[0] * 0.9, losses

        sampling = training.save_weights_for_sampler(f"{model_type}-grpc").result(60)
        prompt = data[0].model_input.tokens[:6]
        reply = sampling.sample(ModelInput.from_ints(prompt), 2,
                                SamplingParams(max_tokens=8, temperature=1.0, seed=3)).result(60)
        assert reply.served_version == sampling.version
        for sequence in reply.sequences:
            assert len(sequence.tokens) == 8
            learned = learned_logprobs(training, prompt + list(sequence.tokens))
            assert list(sequence.logprobs) == pytest.approx(learned[len(prompt) - 1:], abs=1e-4)
        tokens = data[0].model_input.tokens + [data[0].loss_fn_inputs["target_tokens"][-1]]
        sampled = sampling.compute_logprobs(tokens).result(60)
        learned = learned_logprobs(training, tokens)
        assert sampled[1:] == pytest.approx(learned, abs=1e-4)
        base = service.create_sampling_client().compute_logprobs(tokens).result(60)
        assert base[1:] != pytest.approx(sampled[1:], abs=1e-3)
    finally:
        service.close()


def test_tinker_sdk_and_openai_client_through_the_gateway(qwen_cluster):
    _, checkpoint, cluster = qwen_cluster
    service = tinker.ServiceClient(base_url=cluster.base_url)
    training = service.create_lora_training_client(base_model=checkpoint, rank=4, seed=3).result()
    assert training.get_info().model_data.model_name == checkpoint
    seqs = batch(5)
    data = [datum(s) for s in seqs]
    losses = []
    for _ in range(4):
        backward = training.forward_backward(data, "cross_entropy")
        # Tinker's LoRA scale (alpha 32 / rank 4 = 8).
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(backward.result().metrics["loss:sum"])
    assert losses[-1] < losses[0] * 0.9, losses

    learned = target_logprobs(training, seqs[:1])[0]
    sampling = training.save_weights_and_get_sampling_client().result()
    sampled = sampling.compute_logprobs(types.ModelInput.from_ints(seqs[0])).result()
    assert sampled[0] is None
    np.testing.assert_allclose(sampled[1:], learned, atol=1e-4)
    reply = sampling.sample(types.ModelInput.from_ints(seqs[0][:6]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)).result()
    assert [len(s.tokens) for s in reply.sequences] == [5, 5]
    for sequence in reply.sequences:
        full = target_logprobs(training, [seqs[0][:6] + list(sequence.tokens)])[0]
        np.testing.assert_allclose(sequence.logprobs, full[5:], atol=1e-4)

    oai = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0)
    # The gRPC test's version is listed too (one registry per cluster).
    versions = [m.id for m in oai.models.list().data if m.id.startswith("tinker/") and "@v" in m.id]
    assert len(versions) == 1, versions
    prompt = seqs[0][:6]
    tuned = oai.completions.create(model=versions[0], prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    base = oai.completions.create(model=checkpoint, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    assert len(tuned.choices[0].logprobs.token_logprobs) == 4
    assert tuned.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
    service.close("success")


def test_an_adapter_on_the_full_attention_layers_only_publishes_and_samples(qwen_cluster):
    # q_proj lives in the full-attention layers only (2 and 5 of 6): the registry checks each layer against its
    # own mixer kind, so the version publishes and the sampler serves it.
    model_type, checkpoint, cluster = qwen_cluster
    service = ServiceClient(trainer=cluster.trainer.address, sampler=cluster.sampler.address,
                            registry=cluster.registry.address)
    try:
        training = service.create_lora_training_client(checkpoint, rank=4, seed=2, target_modules=["q_proj"],
                                                       name=f"{model_type}/q-only")
        data = [datum_from_sequence(list(range(10, 30)))]
        backward = training.forward_backward(data, "cross_entropy")
        training.optim_step(AdamParams(learning_rate=5e-2)).result(60)
        backward.result(60)
        sampling = training.save_weights_for_sampler(f"{model_type}-q-only").result(60)
        tokens = list(range(10, 30))
        sampled = sampling.compute_logprobs(tokens).result(60)
        assert sampled[1:] == pytest.approx(learned_logprobs(training, tokens), abs=1e-4)
    finally:
        service.close()
