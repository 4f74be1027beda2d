"""A Qwen3-MoE base model (`tiny-moe`: a dense layer and MoE layers of 8 experts, top-2, GQA, q/k norms) through the
gateway's entry points on CPU: the Tinker SDK trains a LoRA on attention and the routed experts (the family's
default targets), its sampling client serves exactly the version just trained (logprobs equal the trainer's
forward), and the OpenAI client samples that version by name, differently from the base model."""

from __future__ import annotations

import pytest

from tests.fixtures.family_flow import tinker_and_openai_through_the_gateway
from tests.gateway.conftest import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def moe_cluster(valkey, seaweed, background_loop, tmp_path_factory):
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model="tiny-moe")
    yield live
    stop_cluster(live)


def test_tinker_sdk_and_openai_client_on_a_moe_base(moe_cluster):
    tinker_and_openai_through_the_gateway(moe_cluster, "tiny-moe", atol=1e-3, check_generated=False)
