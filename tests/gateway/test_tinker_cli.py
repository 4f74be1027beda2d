"""The SDK's own `tinker` CLI (the console script in .venv/bin), run as a subprocess against a live gateway:
`tinker run list|info`, `tinker checkpoint list|info|download|set-ttl|delete`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from safetensors import safe_open

TINKER = str(Path(sys.executable).parent / "tinker")


def cli(cluster, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": cluster.base_url, "TINKER_API_KEY": "tml-cli-test",
           "TINKER_TELEMETRY": "0"}
    proc = subprocess.run([TINKER, "--format", "json", *args], check=False, env=env, capture_output=True, text=True,
                          timeout=180)
    if ok:
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


@pytest.fixture(scope="module")
def run(cluster):
    service = tinker.ServiceClient(base_url=cluster.base_url)
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    state = training.save_state("cli-state").result().path
    sampler = training.save_weights_for_sampler("cli-sampler").result().path
    yield training.model_id, state, sampler
    service.close("success")


def test_run_list_and_info(cluster, run):
    model_id, _state, _sampler = run
    listed = json.loads(cli(cluster, "run", "list").stdout)
    runs = {r["training_run_id"]: r for r in listed["runs"]}
    assert runs[model_id]["base_model"] == "tiny" and runs[model_id]["lora_rank"] == 4
    info = json.loads(cli(cluster, "run", "info", model_id).stdout)
    assert info["training_run_id"] == model_id


def test_checkpoint_list_info_download_delete(cluster, run, tmp_path):
    model_id, state, sampler = run
    listed = json.loads(cli(cluster, "checkpoint", "list", "--run-id", model_id).stdout)
    assert {c["tinker_path"] for c in listed["checkpoints"]} == {state, sampler}
    everyone = json.loads(cli(cluster, "checkpoint", "list").stdout)
    assert {state, sampler} <= {c["tinker_path"] for c in everyone["checkpoints"]}
    info = json.loads(cli(cluster, "checkpoint", "info", state).stdout)
    assert info["tinker_path"] == state and info["checkpoint_type"] == "training"

    # download: the CLI loads the state into a new run, exports it (save_weights_external), asks for signed URLs,
    # fetches them with plain urllib (no API key), then deletes the temporary export.
    cli(cluster, "checkpoint", "download", state, "--output", str(tmp_path / "dl"))
    files = {p.name: p for p in (tmp_path / "dl").rglob("*") if p.is_file()}
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}, files
    config = json.loads(files["adapter_config.json"].read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    with safe_open(str(files["adapter_model.safetensors"]), "np") as f:
        keys = list(f.keys())
    assert keys and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys), keys
    # The temporary export is gone; the downloaded state's own run still lists its checkpoints.
    exports = [c for c in json.loads(cli(cluster, "checkpoint", "list").stdout)["checkpoints"]
               if c["checkpoint_type"] == "external"]
    assert exports == [], exports

    # set-ttl sets, then removes, the state checkpoint's expiry.
    def expiry() -> str | None:
        rows = json.loads(cli(cluster, "checkpoint", "list", "--run-id", model_id).stdout)["checkpoints"]
        return {c["tinker_path"]: c for c in rows}[state].get("expires_at")
    cli(cluster, "checkpoint", "set-ttl", state, "--ttl", "7200")
    assert expiry() is not None
    cli(cluster, "checkpoint", "set-ttl", state, "--remove")
    assert expiry() is None

    cli(cluster, "checkpoint", "delete", sampler, "--yes")
    after = json.loads(cli(cluster, "checkpoint", "list", "--run-id", model_id).stdout)
    assert {c["tinker_path"] for c in after["checkpoints"]} == {state}
    missing = cli(cluster, "checkpoint", "info", sampler, ok=False)
    assert missing.returncode != 0 and "not found" in (missing.stdout + missing.stderr).lower()
