"""tinker-cookbook 0.6.1 recipes, unmodified, against the gateway: `recipes.sl_loop` (supervised, NoRobots) and
`recipes.rl_loop` (GRPO-style RL on GSM8K, its default loss stable_reinforce) run at once, each as its own process,
and `recipes.math_rl` (env=arithmetic, default loss stable_reinforce) synchronously and in its async mode
(max_steps_off_policy=1); then every other RL recipe whose default needs no second model, external service or
uninstalled package (docs/tinker.md, "The cookbook's RL recipes"): guess_number, preference/shorter, math_rl's
dataset envs, forecasting and the rlhf pipeline; all configured only by command-line keys and environment
variables. The served model is a small random Llama with the Llama-3 vocabulary, offered
under the cookbook's smallest table name (meta-llama/Llama-3.2-1B); tokenizer and datasets come from a prepared
offline HF cache (cookbook_env.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker

from gateway_svc.store import Store
from loraplane import auth
from loraplane.v1 import common_pb2
from tests.gateway.conftest import start_cluster, stop_cluster
from tests.gateway.cookbook_env import COOKBOOK_MODEL, prepare, prophet_arena_csv

pytest.importorskip("tinker_cookbook")


@pytest.fixture(scope="module")
def cookbook(valkey, seaweed, background_loop, tmp_path_factory):
    env = prepare(tmp_path_factory.mktemp("cookbook-env"))
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory, base_model=env.pop("model_dir"),
                         model_names=COOKBOOK_MODEL)
    yield live, env
    stop_cluster(live)


def recipe(name: str, log_path: Path, base_url: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"tinker_cookbook.recipes.{name}", f"model_name={COOKBOOK_MODEL}",
         f"log_path={log_path}", "save_every=0", *args],
        env={**os.environ, **env, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": "tml-cookbook",
             "TINKER_TELEMETRY": "0"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stability_stats(cluster) -> dict[str, int]:
    """The default tenant's recorded-sampling records, read as the gateway reads them."""
    async def read():
        auth.set_caller(auth.OPEN)
        store = Store(cluster.gateway_settings.redis_url, cluster.gateway_settings.key_prefix)
        try:
            return await store.sequence_stats()
        finally:
            await store.close()
    return asyncio.run(read())


def checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line]


def test_sl_loop_and_rl_loop_train_side_by_side(cookbook, tmp_path):
    cluster, env = cookbook
    sl_log, rl_log = tmp_path / "sl", tmp_path / "rl"
    sl = recipe("sl_loop", sl_log, cluster.base_url, env, "batch_size=2", "max_steps=2")
    records_before = stability_stats(cluster)["records"]
    # rl_loop's default loss, stable_reinforce: sampling records, provenance spans, recorded logprobs.
    rl = recipe("rl_loop", rl_log, cluster.base_url, env, "batch_size=2", "group_size=2", "max_steps=2",
                "max_tokens=6")
    outputs = {}
    for name, proc in (("sl_loop", sl), ("rl_loop", rl)):
        outputs[name] = proc.communicate(timeout=240)[0]
        assert proc.returncode == 0, f"{name} failed:\n{outputs[name][-4000:]}"

    sl_metrics = [json.loads(line) for line in (sl_log / "metrics.jsonl").read_text().splitlines() if line]
    assert len(sl_metrics) == 2 and all("train_mean_nll" in m for m in sl_metrics)
    rl_metrics = [json.loads(line) for line in (rl_log / "metrics.jsonl").read_text().splitlines() if line]
    assert len(rl_metrics) == 2 and all(np.isfinite(m["reward/total"]) for m in rl_metrics)
    # It sampled with record_stability_info (its default loss asks for it): one record per sampled sequence,
    # 2 steps x 2 questions x 2 samples. (On a random model every GSM8K reward is 0, so rl_loop skips its training
    # steps; math_rl below trains on recorded sequences.)
    assert stability_stats(cluster)["records"] - records_before == 2 * 2 * 2

    # Each loop trained its own adapter: distinct training runs, each with its own final checkpoints.
    sl_final, rl_final = checkpoints(sl_log)[-1], checkpoints(rl_log)[-1]
    sl_run = sl_final["state_path"].split("/")[2]
    rl_run = rl_final["state_path"].split("/")[2]
    assert sl_run != rl_run
    rest = tinker.RestClient(base_url=cluster.base_url)
    for run, final in ((sl_run, sl_final), (rl_run, rl_final)):
        listed = {c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints}
        assert final["state_path"] in listed and final["sampler_path"] in listed
        assert rest.get_training_run(run).result().base_model == COOKBOOK_MODEL
    # Isolation in the registry: each adapter holds exactly its own loop's weights versions (sl_loop: the final
    # sampler save; rl_loop: one sampling snapshot per step plus the final save).
    for run, expected in ((sl_run, 1), (rl_run, 2 + 1)):
        adapter = cluster.gateway_settings.default_tenant + "/" + run.replace(":train:", "-train-")
        kinds = [v.kind for v in cluster.trainer.registry_versions(adapter)]
        assert kinds.count(common_pb2.VERSION_KIND_WEIGHTS) == expected, (run, kinds)


def math_rl(log_path: Path, base_url: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={COOKBOOK_MODEL}",
         f"log_path={log_path}", "behavior_if_log_dir_exists=delete", "group_size=4", "groups_per_batch=2",
         "max_tokens=4", "eval_every=0", "save_every=0", "lora_rank=4", "learning_rate=1e-3", *args],
        env={**os.environ, **env, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": "tml-cookbook",
             "TINKER_TELEMETRY": "0"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_math_rl_arithmetic_sync_and_async_with_the_default_loss(cookbook, tmp_path):
    """math_rl's default loss is stable_reinforce: every step samples with record_stability_info, names each trained
    token's sequence and trains on the recorded logprobs. The async run samples up to one step ahead of training
    (off-policy data, the case stable_reinforce exists for)."""
    cluster, env = cookbook
    hits_before = stability_stats(cluster)["hits"]
    runs = {"sync": (tmp_path / "sync", ("max_steps=3",)),
            "async": (tmp_path / "async", ("max_steps=3", "max_steps_off_policy=1"))}
    procs = {name: math_rl(log, cluster.base_url, env, *args) for name, (log, args) in runs.items()}
    for name, proc in procs.items():
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, f"math_rl {name} failed:\n{output[-4000:]}"
    for name, (log, _args) in runs.items():
        metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line]
        trained = [m for m in metrics if "env/all/reward/total" in m]
        assert len(trained) == 3, (name, metrics)
        for m in trained:
            assert np.isfinite(m["env/all/reward/total"]) and np.isfinite(m["optim/entropy"]), m
            assert m["tokens/trained"] > 0, m
        if name == "async":  # it really trained on samples of older weights
            assert max(m.get("async/staleness_max", 0) for m in trained) >= 1, trained
    assert stability_stats(cluster)["hits"] > hits_before


def run_recipe(module: str, log_path: Path, base_url: str, env: dict[str, str], *args: str,
               cwd: str | None = None) -> subprocess.Popen:
    """Any cookbook RL recipe by module, configured only by its own command-line keys."""
    return subprocess.Popen(
        [sys.executable, "-m", f"tinker_cookbook.recipes.{module}", f"model_name={COOKBOOK_MODEL}",
         f"log_path={log_path}", *args],
        env={**os.environ, **env, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": "tml-cookbook",
             "TINKER_TELEMETRY": "0"},
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def trained_steps(log_path: Path) -> list[dict]:
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line]
    return [m for m in metrics if "env/all/reward/total" in m]


def wait_all(procs: dict[str, subprocess.Popen], timeout: float) -> None:
    try:
        for name, proc in procs.items():
            output = proc.communicate(timeout=timeout)[0]
            assert proc.returncode == 0, f"{name} failed:\n{output[-4000:]}"
    finally:  # one failure must not leave the others running past the cluster
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def assert_trained(logs: dict, count: int) -> None:
    """Each recipe's metrics.jsonl records `count` trained steps, each with a finite reward and trained tokens."""
    for name, log in logs.items():
        steps = trained_steps(log)
        assert len(steps) == count, (name, steps)
        for m in steps:
            assert np.isfinite(m["env/all/reward/total"]) and m["tokens/trained"] > 0, (name, m)


def test_data_free_rl_recipes_train_with_their_default_losses(cookbook, tmp_path):
    """The RL recipes whose defaults need no second model and no download beyond the GSM8K rows cookbook_env
    caches, each a few steps with its default loss: the multi-turn guess_number game and preference/shorter
    (pairwise self-play judged by a length rule, post-KL computed) with importance_sampling (rl/train.py's Config
    default; their train.py set none), math_rl env=gsm8k (graded by sympy) with stable_reinforce. Recipes whose default renderer is a
    Qwen one get the table's renderer for the served Llama name (configuration, not code)."""
    cluster, env = cookbook
    hits_before = stability_stats(cluster)["hits"]
    runs = {
        "multiplayer_rl.guess_number.train": (
            "renderer_name=role_colon", "batch_size=1", "group_size=2", "max_tokens=4", "eval_every=0",
            "save_every=0", "max_steps=2"),
        "preference.shorter.train": (
            "renderer_name=role_colon", "batch_size=1", "group_size=2", "max_tokens=4", "eval_every=0",
            "max_steps=2"),
        "math_rl.train": (
            "env=gsm8k", "group_size=2", "groups_per_batch=2", "max_tokens=4", "eval_every=0", "save_every=0",
            "lora_rank=4", "max_steps=2"),
    }
    logs = {name: tmp_path / name.split(".")[0] for name in runs}
    wait_all({name: run_recipe(name, logs[name], cluster.base_url, env, *args) for name, args in runs.items()},
             timeout=300)
    assert_trained(logs, 2)
    # shorter computes the KL to the sampling policy after each step (compute_post_kl=True, train.py:70).
    assert all(np.isfinite(m["kl_pre_post_v2"]) for m in trained_steps(logs["preference.shorter.train"]))
    # guess_number is multi-turn: a random policy never parses, so every episode runs all its turns.
    assert all(m["env/all/turns_per_episode"] > 1 for m in trained_steps(logs["multiplayer_rl.guess_number.train"]))
    assert stability_stats(cluster)["hits"] > hits_before  # math_rl trained on recorded sequences


def test_rl_recipes_on_locally_cached_data(cookbook, tmp_path):
    """The recipes whose only outside need is a Hugging Face dataset, on a few rows of our own in each dataset's
    columns (cookbook_env.py): math_rl env=math (Hendrycks MATH less MATH-500), env=polaris and env=deepmath, with
    the default loss stable_reinforce."""
    cluster, env = cookbook
    hits_before = stability_stats(cluster)["hits"]
    math_args = ("group_size=2", "groups_per_batch=2", "max_tokens=4", "eval_every=0", "save_every=0",
                 "lora_rank=4", "max_steps=2", "behavior_if_log_dir_exists=delete")
    runs = {f"math_rl.train env={name}": ("math_rl.train", f"env={name}", *math_args)
            for name in ("math", "polaris", "deepmath")}
    logs = {name: tmp_path / name.replace(" ", "_").replace("=", "_") for name in runs}
    wait_all({name: run_recipe(args[0], logs[name], cluster.base_url, env, *args[1:]) for name, args in runs.items()},
             timeout=300)
    assert_trained(logs, 2)
    assert stability_stats(cluster)["hits"] > hits_before


def test_forecasting_on_a_local_prophet_arena_csv(cookbook, tmp_path):
    """forecasting (Brier reward on resolved markets, default loss importance_sampling) on a CSV of our own in
    the Prophet Arena columns, passed by its data_path key: it trains, evaluates the validation markets at
    step 0 (eval_every) and again from the final saved sampler checkpoint."""
    cluster, env = cookbook
    log = tmp_path / "forecasting"
    wait_all({"forecasting": run_recipe(
        "forecasting.train", log, cluster.base_url, env, f"data_path={prophet_arena_csv(tmp_path / 'pa.csv')}",
        "renderer_name=role_colon", "group_size=2", "groups_per_batch=2", "validation_group_size=1",
        "max_tokens=8", "lora_rank=4", "max_steps=2")}, timeout=300)
    steps = trained_steps(log)
    assert len(steps) == 2, steps
    for m in steps:
        assert np.isfinite(m["env/all/reward/total"]) and m["tokens/trained"] > 0, m
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line]
    evaluated = [m["step"] for m in metrics if "test/env/all/brier_reward" in m]
    assert evaluated == [0, 2], evaluated


def test_rlhf_pipeline_sft_reward_model_and_rl_against_it(cookbook, tmp_path):
    """preference/rlhf: SFT on NoRobots, a reward model trained on hh-rlhf comparisons (a second LoRA of the same
    base), then RL from the SFT state against that reward model (default loss importance_sampling), all three
    stages in one unmodified run, on our cached rows; its logs go under TINKER_COOKBOOK_RUNS_DIR."""
    cluster, env = cookbook
    runs_dir = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinker_cookbook.recipes.preference.rlhf.rlhf_pipeline",
         f"base_model={COOKBOOK_MODEL}", "short_name=tiny", "batch_size=2", "lora_rank=4", "max_length=256",
         "rl_group_size=2", "rl_max_tokens=4", "eval_every=0", "save_every=0", "max_steps=2",
         "num_groups_to_log=1"],
        env={**os.environ, **env, "TINKER_BASE_URL": cluster.base_url, "TINKER_API_KEY": "tml-cookbook",
             "TINKER_TELEMETRY": "0", "TINKER_COOKBOOK_RUNS_DIR": str(runs_dir)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_all({"rlhf": proc}, timeout=300)
    root = runs_dir / "rlhf-tiny"
    for stage in ("sft", "rm"):
        metrics = [json.loads(line) for line in (root / stage / "metrics.jsonl").read_text().splitlines() if line]
        assert len([m for m in metrics if "train_mean_nll" in m]) == 2, (stage, metrics)
    steps = trained_steps(root / "rl")
    assert len(steps) == 2, steps
    for m in steps:
        assert np.isfinite(m["env/all/reward/total"]) and m["tokens/trained"] > 0, m
    # The RL stage started from the SFT stage's saved state, and each step's pairwise matchups were scored by
    # sampling the RM stage's saved sampler weights (the recipe's own logtree of the step).
    config = json.loads((root / "rl" / "config.json").read_text())
    assert config["load_checkpoint_path"] == checkpoints(root / "sft")[-1]["state_path"]
    assert checkpoints(root / "rm")[-1]["sampler_path"] in (root / "rl" / "config.json").read_text()
    for step in (0, 1):
        assert "Matchup 0: (0 vs 1)" in (root / "rl" / f"iteration_{step:06d}" / "train.html").read_text()
