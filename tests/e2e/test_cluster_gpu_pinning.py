"""`loraplane up --trainer-gpus / --sampler-gpus` (issue 23, the disaggregated shape): each service process starts
with only its GPUs visible. Real processes on CPU (external Valkey and SeaweedFS from the test session): the GPU
indices need not exist, since what is checked is the environment each child process actually runs with
(/proc/<pid>/environ), and the recorded one the supervisor restarts it with."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from loraplane.local.state import pid_alive, read_cluster_state
from loraplane_cli.local_cluster import gpu_assignment
from tests.e2e.test_cli_cluster import _cli, _cli_here

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/environ")


def _process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def _cluster_env(valkey, seaweed, name: str, monkeypatch) -> dict[str, str]:
    # What the test shell itself may have set must not pass for the pin.
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LORAPLANE_TRAINER_GPUS", "LORAPLANE_SAMPLER_GPUS"):
        monkeypatch.delenv(key, raising=False)
    return {"LORAPLANE_REDIS_URL": valkey.url, "LORAPLANE_S3_ENDPOINT": seaweed.endpoint,
           "LORAPLANE_S3_ACCESS_KEY": seaweed.access_key, "LORAPLANE_S3_SECRET_KEY": seaweed.secret_key,
           "LORAPLANE_S3_BUCKET": f"lp-{name}", "LORAPLANE_KEY_PREFIX": f"{name}:"}


def test_up_pins_the_trainer_and_each_sampler_replica_to_their_gpus(tmp_path, valkey, seaweed, monkeypatch):
    data_dir = tmp_path / "cluster"
    env = _cluster_env(valkey, seaweed, "lpgpus", monkeypatch)
    # The sampler's GPUs come from the environment setting, the trainer's from the option.
    up = _cli("up", "--data-dir", str(data_dir), "--no-gateway", "--samplers", "2", "--trainer-gpus", "3",
              env={**env, "LORAPLANE_SAMPLER_GPUS": "5,7"})
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        expected = {"trainer": "3", "sampler": "5", "sampler-1": "7"}
        for name, gpus in expected.items():
            component = state.component(name)
            running = _process_env(component.pid)
            assert (running.get("CUDA_VISIBLE_DEVICES"), running.get("CUDA_DEVICE_ORDER")) == (gpus, "PCI_BUS_ID"), \
                name
            # Recorded for the supervisor's restart of it.
            assert component.env.get("CUDA_VISIBLE_DEVICES") == gpus, name
        # Nothing else is pinned: the registry (and Valkey/S3, external here) see what the shell sees.
        assert "CUDA_VISIBLE_DEVICES" not in _process_env(state.component("registry").pid)

        # A restart by the supervisor keeps the pin.
        sampler = state.component("sampler-1")
        os.killpg(sampler.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            restarted = read_cluster_state(data_dir).component("sampler-1")
            if restarted.pid != sampler.pid and pid_alive(restarted.pid):
                break
            assert time.monotonic() < deadline, "the supervisor did not restart sampler-1"
            time.sleep(0.2)
        assert _process_env(restarted.pid).get("CUDA_VISIBLE_DEVICES") == "7"
    finally:
        down = _cli("down", "--data-dir", str(data_dir), env=env)
    assert down.returncode == 0, down.stdout + down.stderr


def test_up_refuses_a_gpu_list_that_does_not_fit_before_starting_anything(tmp_path, valkey, seaweed, monkeypatch):
    env = _cluster_env(valkey, seaweed, "lpgpusbad", monkeypatch)
    for args, option in ((("--samplers", "2", "--sampler-gpus", "0,1,2"), "--sampler-gpus"),
                         (("--trainer-gpus", "0,,1"), "--trainer-gpus"),
                         (("--trainer-gpus", "1,1"), "--trainer-gpus")):
        result = _cli_here("up", "--data-dir", str(tmp_path / "c"), *args, env=env)
        assert result.returncode != 0, args
        assert option in result.stdout + result.stderr, result.stdout + result.stderr
        assert read_cluster_state(tmp_path / "c") is None


def test_gpu_assignment_splits_a_list_over_a_fleet():
    assert gpu_assignment("1", 1) == ["1"]
    assert gpu_assignment("0", 3) == ["0", "0", "0"]  # one GPU shared by every member
    assert gpu_assignment("0,1,2,3", 2) == ["0,1", "2,3"]
    assert gpu_assignment(" 2 , 3 ", 2) == ["2", "3"]
    assert gpu_assignment("GPU-a1b2,GPU-c3d4", 1) == ["GPU-a1b2,GPU-c3d4"]
    for bad in ("", "0,,1", "0 1", "1,1"):
        with pytest.raises(ValueError):
            gpu_assignment(bad, 1)
    with pytest.raises(ValueError, match="do not split evenly"):
        gpu_assignment("0,1,2", 2)
