"""`loraplane up --trainers 3` and `loraplane trainers ls | drain | undrain` as an operator runs them: real
processes (external Valkey and SeaweedFS from the test session, to save their start-up), keys on."""

from __future__ import annotations

import grpc

from loraplane.client.addresses import client_security
from loraplane.local.state import read_cluster_state
from loraplane.rpc import sync_channel
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.e2e.test_cli_cluster import _cli, _cli_here, _wait_for


def test_up_runs_a_fleet_of_three_trainers_that_ls_lists_and_drain_empties(tmp_path, valkey, seaweed):
    data_dir = tmp_path / "cluster"
    env = {"LORAPLANE_REDIS_URL": valkey.url, "LORAPLANE_S3_ENDPOINT": seaweed.endpoint,
           "LORAPLANE_S3_ACCESS_KEY": seaweed.access_key, "LORAPLANE_S3_SECRET_KEY": seaweed.secret_key,
           "LORAPLANE_S3_BUCKET": "lp-cli-fleet", "LORAPLANE_KEY_PREFIX": "lpfleetcli:",
           "LORAPLANE_TRAINER_HEARTBEAT_TTL_S": "3"}
    up = _cli("up", "--data-dir", str(data_dir), "--services", "registry,trainer", "--trainers", "3", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        trainers = state.trainer_components()
        assert [c.name for c in trainers] == ["trainer", "trainer-1", "trainer-2"]
        assert all(c.env.get("LORAPLANE_TRAINER_ID") == c.name for c in trainers)
        ls = _cli_here("trainers", "ls", "--data-dir", str(data_dir), env=env)
        assert ls.returncode == 0, ls.stdout + ls.stderr
        for component in trainers:
            assert component.endpoint in ls.stdout
        assert ls.stdout.count("live") == 3, ls.stdout

        # Three adapters created through the first trainer land one per trainer (keys on: the admin key).
        security = client_security(data_dir)
        with sync_channel(trainers[0].endpoint, security) as channel:
            seed = trainer_pb2_grpc.TrainerServiceStub(channel)
            for i in range(3):
                name = f"ops/a{i}"
                request = trainer_pb2.TrainerServiceCreateAdapterRequest(
                    name=name, lora_config=common_pb2.LoraConfig(rank=2, seed=i))
                try:
                    seed.CreateAdapter(request, timeout=30)
                except grpc.RpcError:  # ADAPTER_MOVED: create it where the fleet placed it
                    where = seed.ResolveAdapter(trainer_pb2.ResolveAdapterRequest(name=name), timeout=10).address
                    with sync_channel(where, security) as other:
                        trainer_pb2_grpc.TrainerServiceStub(other).CreateAdapter(request, timeout=30)
            owners = {seed.ResolveAdapter(trainer_pb2.ResolveAdapterRequest(name=f"ops/a{i}"), timeout=10).trainer_id
                      for i in range(3)}
        assert owners == {"trainer", "trainer-1", "trainer-2"}
        status = _cli_here("status", "--data-dir", str(data_dir), env=env)
        assert status.stdout.count("healthy") == 4 and status.stdout.count("ops/a") == 3, status.stdout

        drain = _cli_here("trainers", "drain", "1", "--data-dir", str(data_dir), "--timeout", "60", env=env)
        assert drain.returncode == 0 and "trainer-1 is drained" in drain.stdout, drain.stdout + drain.stderr
        ls = _cli_here("trainers", "ls", "--data-dir", str(data_dir), env=env)
        assert "draining" in ls.stdout, ls.stdout
        with sync_channel(trainers[0].endpoint, security) as channel:
            seed = trainer_pb2_grpc.TrainerServiceStub(channel)
            owners = [seed.ResolveAdapter(trainer_pb2.ResolveAdapterRequest(name=f"ops/a{i}"), timeout=10).trainer_id
                      for i in range(3)]
        assert len(owners) == 3 and set(owners) <= {"trainer", "trainer-2"}
        with sync_channel(trainers[1].endpoint, security) as channel:
            _wait_for(lambda: not trainer_pb2_grpc.TrainerServiceStub(channel).ListAdapters(
                trainer_pb2.TrainerServiceListAdaptersRequest(this_trainer_only=True), timeout=10).adapters, 20,
                "trainer-1 to let go")
        undrain = _cli_here("trainers", "undrain", "trainer-1", "--data-dir", str(data_dir), env=env)
        assert undrain.returncode == 0 and "takes new adapters again" in undrain.stdout
        unknown = _cli_here("trainers", "drain", "7", "--data-dir", str(data_dir), env=env)
        assert unknown.returncode != 0 and "trainer-2" in unknown.stdout + unknown.stderr
    finally:
        down = _cli("down", "--data-dir", str(data_dir), env=env)
    assert down.returncode == 0 and "trainer-2" in down.stdout, down.stdout + down.stderr
