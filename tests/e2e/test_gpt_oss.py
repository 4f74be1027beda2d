"""gpt-oss through the services on CPU fp32 (a tiny random checkpoint directory as the base model): the trainer
trains LoRA on attention and the experts (loss decreases), publishes, the torch-engine sampler serves exactly that
version, and both its prompt scoring and its generated tokens' logprobs (decoded past the sliding window, through
the sinks) equal the trainer's Forward within 1e-4."""

from __future__ import annotations

import pytest

from tests.fixtures.family_flow import retrying_service, train_publish_sample
from tests.fixtures.models import build_checkpoint
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss")))


@pytest.fixture
def gpt_oss_trainer(registry, background_loop, checkpoint):
    live = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=5.0,
                              base_model=checkpoint)
    yield live
    live.close()


@pytest.fixture
def gpt_oss_sampler(registry, background_loop, checkpoint):
    live = start_live_sampler(registry.settings, background_loop, registry.address, base_model=checkpoint)
    yield live
    live.close()


def test_train_publish_sample_through_the_client(registry, checkpoint, gpt_oss_trainer, gpt_oss_sampler):
    service = retrying_service(gpt_oss_trainer.address, gpt_oss_sampler.address, registry.address)
    try:
        # The generated tokens' logprobs are decoded with the cache, 14 positions: past the 4-token window.
        train_publish_sample(service, checkpoint, "oss/rl", "oss", [
            "q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"])
    finally:
        service.close()
