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

import pytest

from loraplane.client import AdamParams, ServiceClient, datum_from_sequence
from loraplane.models import families
from tests.fixtures.family_flow import (
    learned_logprobs,
    publish_and_sample,
    random_data,
    retrying_service,
    tinker_and_openai_through_the_gateway,
    train_until_loss_drops,
)
from tests.fixtures.models import build_checkpoint
from tests.gateway.conftest import start_cluster, stop_cluster


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def qwen_cluster(request, valkey, seaweed, background_loop, tmp_path_factory):
    checkpoint = str(build_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model=checkpoint)
    yield request.param, checkpoint, live
    stop_cluster(live)


def test_train_publish_sample_through_the_grpc_client(qwen_cluster):
    model_type, checkpoint, cluster = qwen_cluster
    service = retrying_service(cluster.trainer.address, cluster.sampler.address, cluster.registry.address)
    try:
        training = service.create_lora_training_client(checkpoint, rank=4, seed=5, name=f"{model_type}/grpc")
        family = families.FAMILIES[model_type]
        offered = family.lora_targets(family.tiny_config().text_config)
        assert list(training.info.target_modules) == list(offered)
        assert "in_proj_q" in offered and "q_proj" in offered
        data = random_data()
        train_until_loss_drops(training, data)
        publish_and_sample(service, training, data, f"{model_type}-grpc")
    finally:
        service.close()


def test_tinker_sdk_and_openai_client_through_the_gateway(qwen_cluster):
    _, checkpoint, cluster = qwen_cluster
    # The gRPC test's version is listed too (one registry per cluster): the SDK's own is the one named tinker/.
    tinker_and_openai_through_the_gateway(cluster, checkpoint, version_prefix="tinker/")


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
