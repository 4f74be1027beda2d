"""tinker-cookbook 0.6.1 recipes with their OWN default model names, unmodified (no `model_name=` key): the
cookbook defaults almost every recipe to the Qwen3.5 family, so the gateway serves a tiny random Qwen3.5
(`qwen3_5`, Gated DeltaNet + gated attention, saved as the vision-language checkpoint users download) under the
three names the recipes below ask for, with a fixture Qwen3.5 tokenizer in an offline HF cache
(cookbook_env.qwen3_5_tokenizer: what it is and what it is not).

- math_rl (its default `Qwen/Qwen3.5-9B`, renderer qwen3_5 with the thinking prefill, loss stable_reinforce);
- rl_loop (`Qwen/Qwen3.5-9B-Base`, role_colon renderer, GSM8K, stable_reinforce);
- sl_loop (`Qwen/Qwen3.5-9B-Base`, supervised on NoRobots): no SL recipe of 0.6.1 defaults to Qwen3.5-4B, so
- guess_number (`Qwen/Qwen3.5-4B`, qwen3_5_disable_thinking, multi-turn RL) covers that name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker

from tests.gateway.conftest import start_cluster, stop_cluster
from tests.gateway.cookbook_env import QWEN3_5_MODELS, prepare_qwen3_5

pytest.importorskip("tinker_cookbook")


@pytest.fixture(scope="module")
def qwen_cookbook(valkey, seaweed, background_loop, tmp_path_factory):
    env = prepare_qwen3_5(tmp_path_factory.mktemp("cookbook-qwen3_5"))
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model=env.pop("model_dir"),
                         model_names=",".join(QWEN3_5_MODELS))
    yield live, env
    stop_cluster(live)


def recipe(module: str, log_path: Path, base_url: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    """A recipe by module with its own default model_name (no override), configured by its own keys."""
    return subprocess.Popen(
        [sys.executable, "-m", f"tinker_cookbook.recipes.{module}", f"log_path={log_path}", *args],
        env={**os.environ, **env, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": "tml-cookbook",
             "TINKER_TELEMETRY": "0"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line]


def finish(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    try:
        for name, proc in procs.items():
            output = proc.communicate(timeout=timeout)[0]
            assert proc.returncode == 0, f"{name} failed:\n{output[-4000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def training_run_of(log_path: Path) -> str:
    final = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line][-1]
    return final["state_path"].split("/")[2]


def test_recipes_run_with_their_default_qwen3_5_models(qwen_cookbook, tmp_path):
    cluster, env = qwen_cookbook
    logs = {name: tmp_path / name for name in ("math_rl", "rl_loop", "sl_loop", "guess_number")}
    finish({
        "math_rl": recipe("math_rl.train", logs["math_rl"], cluster.base_url, env, "env=arithmetic",
                          "group_size=2", "groups_per_batch=2", "max_tokens=4", "eval_every=0", "save_every=0",
                          "lora_rank=4", "max_steps=2"),
        "rl_loop": recipe("rl_loop", logs["rl_loop"], cluster.base_url, env, "save_every=0", "batch_size=2",
                          "group_size=2", "max_steps=2", "max_tokens=6"),
        "sl_loop": recipe("sl_loop", logs["sl_loop"], cluster.base_url, env, "save_every=0", "batch_size=2",
                          "max_steps=2"),
        "guess_number": recipe("multiplayer_rl.guess_number.train", logs["guess_number"], cluster.base_url, env,
                               "batch_size=1", "group_size=2", "max_tokens=4", "eval_every=0", "save_every=0",
                               "max_steps=2"),
    }, timeout=420)

    for name in ("math_rl", "guess_number"):
        trained = [m for m in metrics(logs[name]) if "env/all/reward/total" in m]
        assert len(trained) == 2, (name, trained)
        assert all(np.isfinite(m["env/all/reward/total"]) and m["tokens/trained"] > 0 for m in trained), trained
    rl = metrics(logs["rl_loop"])
    assert len(rl) == 2 and all(np.isfinite(m["reward/total"]) for m in rl), rl
    sl = metrics(logs["sl_loop"])
    assert len(sl) == 2 and all(np.isfinite(m["train_mean_nll"]) for m in sl), sl

    # Each ran on the model its recipe names by default, and the gateway recorded that name for its run.
    rest = tinker.RestClient(base_url=cluster.base_url)
    expected = {"math_rl": "Qwen/Qwen3.5-9B", "rl_loop": "Qwen/Qwen3.5-9B-Base", "sl_loop": "Qwen/Qwen3.5-9B-Base"}
    for name, model in expected.items():
        assert rest.get_training_run(training_run_of(logs[name])).result().base_model == model, name
