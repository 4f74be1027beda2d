"""`loraplane up --samplers 2` as an operator runs it: real processes (external Valkey and SeaweedFS from the test
session, to save their start-up), keys on; the SDK routes over both replicas and rides over a SIGKILL of one."""

from __future__ import annotations

import os
import signal
import time

from loraplane.client._runtime import Endpoint
from loraplane.client.addresses import client_security
from loraplane.client.sampler_routing import router_for
from loraplane.client.sampling_client import SamplingClient
from loraplane.client.types import SamplingParams
from loraplane.local.state import read_cluster_state
from loraplane.routing import HashRing
from loraplane.rpc import sync_channel
from loraplane.v1 import sampler_pb2, sampler_pb2_grpc
from tests.e2e.test_cli_cluster import _cli, _cli_here


def test_up_runs_two_samplers_as_a_fleet_that_survives_a_sigkill(tmp_path, valkey, seaweed):
    data_dir = tmp_path / "cluster"
    env = {"LORAPLANE_REDIS_URL": valkey.url, "LORAPLANE_S3_ENDPOINT": seaweed.endpoint,
           "LORAPLANE_S3_ACCESS_KEY": seaweed.access_key, "LORAPLANE_S3_SECRET_KEY": seaweed.secret_key,
           "LORAPLANE_S3_BUCKET": "lp-cli-samplers", "LORAPLANE_KEY_PREFIX": "lpsamplerscli:",
           "LORAPLANE_SAMPLER_HEARTBEAT_TTL_S": "1"}
    up = _cli("up", "--data-dir", str(data_dir), "--services", "registry,sampler", "--samplers", "2", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        samplers = state.sampler_components()
        assert [c.name for c in samplers] == ["sampler", "sampler-1"]
        assert all(c.env.get("LORAPLANE_SAMPLER_ID") == c.name and c.env.get("LORAPLANE_SAMPLER_FLEET") == "sampler"
                   for c in samplers)
        status = _cli_here("status", "--data-dir", str(data_dir), env=env)
        assert status.returncode == 0 and status.stdout.count("healthy") == 3, status.stdout
        assert "sampler-1" in status.stdout and status.stdout.count("torch engine") == 2, status.stdout

        security = client_security(data_dir)
        with sync_channel(samplers[0].endpoint, security) as channel:
            stub = sampler_pb2_grpc.SamplerServiceStub(channel)
            deadline = time.monotonic() + 10
            while len(listed := stub.ListReplicas(sampler_pb2.ListReplicasRequest(), timeout=10).replicas) < 2:
                assert time.monotonic() < deadline, listed
                time.sleep(0.1)
        assert {(r.replica_id, r.address) for r in listed} == {(c.name, c.endpoint) for c in samplers}

        seed = Endpoint(samplers[0].endpoint, security)
        client = SamplingClient(seed)  # the base model: its key is the empty name
        params = SamplingParams(max_tokens=4, seed=1)
        assert len(client.sample([5, 6, 7], 1, params).result(timeout=60).sequences[0].tokens) == 4
        assert set(router_for(seed).replicas) == {"sampler", "sampler-1"}

        home = state.component(HashRing(["sampler", "sampler-1"]).order("")[0])
        os.killpg(home.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert len(client.sample([5, 6, 7], 1, params).result(timeout=30).sequences[0].tokens) == 4
        assert time.monotonic() - killed_at < 1.0
    finally:
        down = _cli("down", "--data-dir", str(data_dir), env=env)
    # The killed replica is stopped too if the supervisor restarted it by now (else it is simply not running).
    assert down.returncode == 0 and "sampler" in down.stdout, down.stdout + down.stderr
    assert read_cluster_state(data_dir) is None
