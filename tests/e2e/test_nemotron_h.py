"""Nemotron-H through the services on CPU fp32 (a tiny random checkpoint directory, ``backbone.*`` weights, as the
base model): the trainer trains LoRA on every block kind (Mamba-2 in/out_proj, attention, relu^2 MLP, shared expert,
routed experts; loss decreases), publishes, the torch-engine sampler serves exactly that version, and both its
prompt scoring and its generated tokens' logprobs (decoded through transformers' hybrid Mamba/attention cache) equal
the trainer's Forward within 1e-4."""

from __future__ import annotations

import random

import pytest

from loraplane.client import AdamParams, ModelInput, RetryConfig, SamplingParams, ServiceClient, datum_from_sequence
from tests.fixtures.models import build_checkpoint
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron_h")))


@pytest.fixture
def nemotron_trainer(registry, background_loop, checkpoint):
    live = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=5.0,
                              base_model=checkpoint)
    yield live
    live.close()


@pytest.fixture
def nemotron_sampler(registry, background_loop, checkpoint):
    live = start_live_sampler(registry.settings, background_loop, registry.address, base_model=checkpoint)
    yield live
    live.close()


def test_train_publish_sample_through_the_client(registry, checkpoint, nemotron_trainer, nemotron_sampler):
    retry = RetryConfig(max_attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=60,
                        attempt_timeout_s=60)
    service = ServiceClient(trainer=nemotron_trainer.address, sampler=nemotron_sampler.address,
                            registry=registry.address, retry=retry)
    try:
        training = service.create_lora_training_client(checkpoint, rank=4, seed=5, name="nemo/rl")
        assert list(training.info.target_modules) == [
            "mixer.in_proj", "mixer.out_proj", "mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj",
            "mixer.up_proj", "mixer.down_proj", "mixer.shared_experts.up_proj", "mixer.shared_experts.down_proj",
            "mixer.experts.up_proj", "mixer.experts.down_proj"]
        rng = random.Random(0)
        data = [datum_from_sequence([rng.randrange(5, 200) for _ in range(n)]) for n in (13, 9, 17)]
        losses = []
        for _ in range(4):
            backward = training.forward_backward(data, "cross_entropy")
            assert not training.optim_step(AdamParams(learning_rate=5e-2)).result(60).skipped
            losses.append(backward.result(60).loss)
        assert losses[-1] < losses[0] * 0.9, losses

        sampling = training.save_weights_for_sampler("nemo").result(60)
        prompt = data[0].model_input.tokens[:6]
        reply = sampling.sample(ModelInput.from_ints(prompt), 2,
                                SamplingParams(max_tokens=8, temperature=1.0, seed=3)).result(60)
        assert reply.served_version == sampling.version
        for sequence in reply.sequences:
            assert len(sequence.tokens) == 8
            # The generated tokens' logprobs (decoded with the conv / SSM states and the KV cache) equal the
            # trainer's Forward over prompt + generation.
            full = prompt + list(sequence.tokens)
            learned = [lp for o in training.forward([datum_from_sequence(full)]).result(60).loss_fn_outputs
                       for lp in o["logprobs"].tolist()]
            assert list(sequence.logprobs) == pytest.approx(learned[len(prompt) - 1:], abs=1e-4)
        tokens = data[0].model_input.tokens + [data[0].loss_fn_inputs["target_tokens"][-1]]
        sampled = sampling.compute_logprobs(tokens).result(60)
        learned = [lp for o in training.forward([data[0]]).result(60).loss_fn_outputs
                   for lp in o["logprobs"].tolist()]
        assert sampled[1:] == pytest.approx(learned, abs=1e-4)
        base = service.create_sampling_client().compute_logprobs(tokens).result(60)
        assert base[1:] != pytest.approx(sampled[1:], abs=1e-3)
    finally:
        service.close()
