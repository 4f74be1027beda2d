"""Session-wide real servers: one Valkey (AOF on) and one SeaweedFS S3 gateway on free loopback ports.

Each test gets its own Redis key prefix and S3 bucket (`isolated_settings`), so tests never see each other's data.
Tests that crash or restart a server start their own private instances instead of touching these.
Under pytest-xdist (`make test`) each worker is a session of its own: its own servers on its own free ports, its own
tmp_path root, so nothing here is shared between workers.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from loraplane.config import Settings
from loraplane.local.processes import SeaweedS3Server, ValkeyServer, seaweed_s3_server, valkey_server
from loraplane.rpc import BackgroundLoop

# The product defaults to SmolLM2; every test (and every process a test starts, which inherits this) uses the
# small random `tiny` model unless it names another.
os.environ.setdefault("LORAPLANE_BASE_MODEL", "tiny")

# Each service's live-server fixtures live in their own module (owned by that service's code).
pytest_plugins = ["tests.fixtures.registry", "tests.fixtures.trainer", "tests.fixtures.sampler"]


# The suite's longest files (a cluster of processes each, or torchrun launches), in decreasing time as measured.
# `make test` hands whole files to xdist workers in collection order (--no-loadscope-reorder), so these go first:
# started last, one of them would run alone at the end while the other workers sit idle.
LONGEST_FIRST = (
    "tests/gateway/test_cookbook.py",
    "tests/e2e/test_cli_cluster.py",
    "tests/e2e/test_megatron_cpu.py",
    "tests/e2e/test_megatron_qwen3_5_cpu.py",
    "tests/e2e/test_megatron_moe_cpu.py",
    "tests/gateway/test_tinker_cli.py",
    "tests/e2e/test_multinode_cpu.py",
    "tests/e2e/test_cluster_gpu_pinning.py",
    "tests/e2e/test_tls_cluster.py",
    "tests/e2e/test_sampler_fleet_cli.py",
    "tests/e2e/test_megatron_packing_cpu.py",
    "tests/unit/test_compose.py",
    "tests/unit/test_trainer_main.py",
    "tests/e2e/test_trainer_fleet_cli.py",
    "tests/e2e/test_megatron_soft_targets_cpu.py",
    "tests/unit/test_losses.py",
    "tests/unit/test_packed_fast_paths.py",
    "tests/security/test_gateway_isolation.py",
    "tests/e2e/test_sampler_restart.py",
    "tests/e2e/test_trainer_durability.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def server_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def valkey(server_root) -> ValkeyServer:
    server = valkey_server(server_root / "valkey")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed(server_root) -> SeaweedS3Server:
    server = seaweed_s3_server(server_root / "seaweed")
    server.start()
    yield server
    # Not `stop()`: `weed server` sits out the whole 10 s grace after SIGTERM (stuck in its filer's graceful gRPC
    # stop), and the tests' data is thrown away anyway.
    server.kill()


def unique_suffix() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def isolated_settings(valkey, seaweed, tmp_path) -> Settings:
    """Settings pointing at the shared servers under a fresh key prefix and bucket, and a fresh data dir."""
    suffix = unique_suffix()
    return Settings(
        data_dir=tmp_path / "data",
        redis_url=valkey.url,
        s3_endpoint=seaweed.endpoint,
        s3_access_key=seaweed.access_key,
        s3_secret_key=seaweed.secret_key,
        s3_bucket=f"lp-test-{suffix}",
        key_prefix=f"lptest:{suffix}:",
    )


@pytest.fixture(scope="session")
def background_loop() -> BackgroundLoop:
    loop = BackgroundLoop("test-servers")
    yield loop
    loop.close()
