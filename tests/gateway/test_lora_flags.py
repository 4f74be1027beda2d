"""Tinker's LoraConfig train_attn / train_mlp on a base model whose targets are not Llama's names: Nemotron-H's
token mixers (Mamba-2 and attention) and its MLPs (relu^2 and MoE experts) are all `mixer.*` modules."""

from __future__ import annotations

import pytest
import tinker

from loraplane.client import ServiceClient
from loraplane.models.families.base import (
    BLOCK_ATTENTION_TARGETS,
    BLOCK_MLP_TARGETS,
    BLOCK_SHARED_EXPERT_TARGETS,
    MAMBA_TARGETS,
    NONGATED_EXPERT_TARGETS,
)
from tests.fixtures.models import build_checkpoint
from tests.gateway.conftest import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def nemotron_cluster(valkey, seaweed, background_loop, tmp_path_factory):
    base = build_checkpoint("nemotron_h", tmp_path_factory.mktemp("nemotron-h-tiny"))
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model=str(base))
    yield live, str(base)
    stop_cluster(live)


def test_train_attn_and_train_mlp_select_the_nemotron_h_mixers_and_mlps(nemotron_cluster):
    cluster, base = nemotron_cluster
    service = tinker.ServiceClient(base_url=cluster.base_url)
    attn = service.create_lora_training_client(base_model=base, rank=2, seed=1, train_mlp=False).result()
    mlp = service.create_lora_training_client(base_model=base, rank=2, seed=1, train_attn=False).result()
    trainer = ServiceClient(trainer=cluster.trainer.address, registry=cluster.registry.address)
    try:
        targets = {a.name: set(a.target_modules) for a in trainer.list_training_adapters()}
    finally:
        trainer.close()
    (attn_adapter,) = [n for n in targets if n.endswith(attn.model_id.replace(":train:", "-train-"))]
    (mlp_adapter,) = [n for n in targets if n.endswith(mlp.model_id.replace(":train:", "-train-"))]
    assert targets[attn_adapter] == set(MAMBA_TARGETS + BLOCK_ATTENTION_TARGETS)
    assert targets[mlp_adapter] == set(BLOCK_MLP_TARGETS + BLOCK_SHARED_EXPERT_TARGETS + NONGATED_EXPERT_TARGETS)
