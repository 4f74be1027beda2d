"""gpt-oss through the services on CPU fp32 (a tiny random checkpoint directory as the base model): the trainer
trains LoRA on attention and the experts (loss decreases), publishes, the torch-engine sampler serves exactly that
version, and both its prompt scoring and its generated tokens' logprobs (decoded past the sliding window, through
the sinks) equal the trainer's Forward within 1e-4."""

from __future__ import annotations

from tests.fixtures.family_flow import live_fixtures, retrying_service, train_publish_sample

checkpoint, family_trainer, family_sampler = live_fixtures("gpt_oss")


def test_train_publish_sample_through_the_client(registry, checkpoint, family_trainer, family_sampler):
    service = retrying_service(family_trainer.address, family_sampler.address, registry.address)
    try:
        # The generated tokens' logprobs are decoded with the cache, 14 positions: past the 4-token window.
        train_publish_sample(service, checkpoint, "oss/rl", "oss", [
            "q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"])
    finally:
        service.close()
