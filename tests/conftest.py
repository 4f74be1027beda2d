"""Session-wide real servers: one Valkey (AOF on) and one SeaweedFS S3 gateway on free loopback ports.

Each test gets its own Redis key prefix and S3 bucket (`isolated_settings`), so tests never see each other's data.
Tests that crash or restart a server start their own private instances instead of touching these.
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
    server.stop()


def unique_suffix() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def isolated_settings(valkey, seaweed) -> Settings:
    """Settings pointing at the shared servers under a fresh key prefix and bucket."""
    suffix = unique_suffix()
    return Settings(
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
