"""`loraplane up | status | down` as a user runs them: real subprocesses, real servers, health-checked."""

from __future__ import annotations

import os
import subprocess
import sys

from loraplane.local.state import pid_alive, read_cluster_state


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from loraplane_cli import app; app()", *args],
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def test_up_starts_embedded_servers_and_every_service_then_down_stops_them(tmp_path):
    data_dir = tmp_path / "cluster"
    up = _cli("up", "--data-dir", str(data_dir))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        assert [c.name for c in state.components] == ["redis", "s3", "registry", "trainer", "sampler", "gateway"]
        assert f"TINKER_BASE_URL={state.component('gateway').endpoint}" in up.stdout
        assert [c.kind for c in state.components[:2]] == ["valkey", "seaweedfs"]
        for component in state.components:
            assert component.endpoint in up.stdout
        status = _cli("status", "--data-dir", str(data_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count("healthy") == 6, status.stdout
        assert "tiny on torch/cpu; adapters: none" in status.stdout
        assert "torch engine; queue depth 0" in status.stdout
        # A second `up` on the same data dir must refuse rather than start a second cluster over the same files.
        again = _cli("up", "--data-dir", str(data_dir))
        assert again.returncode == 1 and "already running" in again.stdout
    finally:
        down = _cli("down", "--data-dir", str(data_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped: gateway, sampler, trainer, registry, s3, redis" in down.stdout
    assert not any(pid_alive(c.pid) for c in state.components)
    assert read_cluster_state(data_dir) is None
    gone = _cli("status", "--data-dir", str(data_dir))
    assert gone.returncode == 1 and "no cluster is running" in gone.stdout


def test_up_uses_external_redis_and_s3_when_configured(tmp_path, valkey, seaweed):
    data_dir = tmp_path / "cluster"
    env = {"LORAPLANE_REDIS_URL": valkey.url, "LORAPLANE_S3_ENDPOINT": seaweed.endpoint,
           "LORAPLANE_S3_ACCESS_KEY": seaweed.access_key, "LORAPLANE_S3_SECRET_KEY": seaweed.secret_key,
           "LORAPLANE_S3_BUCKET": "lp-cli-external", "LORAPLANE_KEY_PREFIX": "lpcli:"}
    up = _cli("up", "--data-dir", str(data_dir), "--services", "registry", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        assert [(c.name, c.kind) for c in state.components] == [
            ("redis", "external"), ("s3", "external"), ("registry", "service")]
        assert not (data_dir / "valkey").exists() and not (data_dir / "seaweedfs").exists()
        status = _cli("status", "--data-dir", str(data_dir))
        assert status.stdout.count("external") >= 2 and "healthy" in status.stdout
    finally:
        _cli("down", "--data-dir", str(data_dir))


def test_up_rejects_an_unknown_service(tmp_path):
    result = _cli("up", "--data-dir", str(tmp_path / "c"), "--services", "registry,bogus")
    assert result.returncode != 0
    assert "bogus" in result.stdout + result.stderr and "--services" in result.stdout + result.stderr
    assert read_cluster_state(tmp_path / "c") is None
