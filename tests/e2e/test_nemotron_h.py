"""Nemotron-H through the services on CPU fp32 (a tiny random checkpoint directory, ``backbone.*`` weights, as the
base model): the trainer trains LoRA on every block kind (Mamba-2 in/out_proj, attention, relu^2 MLP, shared expert,
routed experts; loss decreases), publishes, the torch-engine sampler serves exactly that version, and both its
prompt scoring and its generated tokens' logprobs (decoded through transformers' hybrid Mamba/attention cache) equal
the trainer's Forward within 1e-4."""

from __future__ import annotations

from tests.fixtures.family_flow import live_fixtures, retrying_service, train_publish_sample

checkpoint, family_trainer, family_sampler = live_fixtures("nemotron_h")


def test_train_publish_sample_through_the_client(registry, checkpoint, family_trainer, family_sampler):
    service = retrying_service(family_trainer.address, family_sampler.address, registry.address)
    try:
        # The generated tokens' logprobs are decoded with the conv / SSM states and the KV cache.
        train_publish_sample(service, checkpoint, "nemo/rl", "nemo", [
            "mixer.in_proj", "mixer.out_proj", "mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj",
            "mixer.up_proj", "mixer.down_proj", "mixer.shared_experts.up_proj", "mixer.shared_experts.down_proj",
            "mixer.experts.up_proj", "mixer.experts.down_proj"])
    finally:
        service.close()
