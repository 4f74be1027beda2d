"""Nemotron-H through the services on CPU fp32 (a tiny random checkpoint directory, ``backbone.*`` weights, as the
base model): the trainer trains LoRA on every block kind (Mamba-2 in/out_proj, attention, relu^2 MLP, shared expert,
routed experts; loss decreases), publishes, the torch-engine sampler serves exactly that version, and both its
prompt scoring and its generated tokens' logprobs (decoded through transformers' hybrid Mamba/attention cache) equal
the trainer's Forward within 1e-4."""

from __future__ import annotations

import pytest

from tests.fixtures.family_flow import retrying_service, train_publish_sample
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
    service = retrying_service(nemotron_trainer.address, nemotron_sampler.address, registry.address)
    try:
        # The generated tokens' logprobs are decoded with the conv / SSM states and the KV cache.
        train_publish_sample(service, checkpoint, "nemo/rl", "nemo", [
            "mixer.in_proj", "mixer.out_proj", "mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj",
            "mixer.up_proj", "mixer.down_proj", "mixer.shared_experts.up_proj", "mixer.shared_experts.down_proj",
            "mixer.experts.up_proj", "mixer.experts.down_proj"])
    finally:
        service.close()
