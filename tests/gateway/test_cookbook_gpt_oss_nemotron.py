"""tinker-cookbook 0.6.1's rl_loop (GSM8K, stable_reinforce) unmodified, given the cookbook's own model name for
each family with model_name=: `openai/gpt-oss-20b` (renderer gpt_oss_no_sysprompt, Harmony) and
`nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16` (renderer nemotron3), each served by its own gateway cluster over a
tiny random checkpoint of the family (tests/gateway/cookbook_families.py), both recipes running at once."""

from __future__ import annotations

import numpy as np
import pytest
import tinker

from tests.gateway.conftest import start_cluster, stop_cluster
from tests.gateway.cookbook_families import GPT_OSS_MODEL, NEMOTRON3_MODEL, prepare_families
from tests.gateway.test_cookbook_qwen3_5 import finish, metrics, recipe, training_run_of

pytest.importorskip("tinker_cookbook")


@pytest.fixture(scope="module")
def family_clusters(valkey, seaweed, background_loop, tmp_path_factory):
    env = prepare_families(tmp_path_factory.mktemp("cookbook-families"))
    oss = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model=env.pop("gpt_oss_dir"),
                        model_names=GPT_OSS_MODEL)
    try:
        nemotron = start_cluster(valkey, seaweed, background_loop, tmp_path_factory,
                                 base_model=env.pop("nemotron_dir"), model_names=NEMOTRON3_MODEL)
    except BaseException:
        stop_cluster(oss)
        raise
    yield {GPT_OSS_MODEL: oss, NEMOTRON3_MODEL: nemotron}, env
    stop_cluster(nemotron)
    stop_cluster(oss)


def test_rl_loop_runs_on_gpt_oss_and_nemotron3_by_their_cookbook_names(family_clusters, tmp_path):
    clusters, env = family_clusters
    logs = {model: tmp_path / model.split("/")[0] for model in clusters}
    finish({model: recipe("rl_loop", logs[model], cluster.base_url, env, f"model_name={model}", "save_every=0",
                          "batch_size=2", "group_size=2", "max_steps=2", "max_tokens=6", "lora_rank=4")
            for model, cluster in clusters.items()}, timeout=420)
    for model, cluster in clusters.items():
        rows = metrics(logs[model])
        assert len(rows) == 2 and all(np.isfinite(m["reward/total"]) for m in rows), (model, rows)
        rest = tinker.RestClient(base_url=cluster.base_url)
        assert rest.get_training_run(training_run_of(logs[model])).result().base_model == model
