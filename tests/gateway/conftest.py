"""A live gateway (uvicorn in a thread, the real ASGI app) in front of a real registry, trainer and sampler on the
`tiny` model, all on the session's Valkey and SeaweedFS. One cluster per test module keeps the gateway suite fast;
tests isolate themselves by using their own Tinker sessions (and so their own adapters)."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest
import uvicorn

from gateway_svc.app import create_app
from gateway_svc.config import GatewaySettings
from loraplane.config import Settings
from tests.fixtures.registry import start_live_registry
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TINKER_API_KEY", "tml-loraplane-test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveGateway:
    """The gateway app served by uvicorn on a thread of its own (its own event loop, as in production)."""

    def __init__(self, settings: GatewaySettings, cluster: Settings | None = None):
        self.settings, self.cluster = settings, cluster
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def start(self) -> LiveGateway:
        config = uvicorn.Config(create_app(self.settings, self.cluster), host="127.0.0.1", port=self.settings.port,
                                log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"gateway-{self.settings.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(timeout=30)
            self.server = None


class Cluster:
    def __init__(self, registry, trainer, sampler, gateway_settings: GatewaySettings):
        self.registry, self.trainer, self.sampler = registry, trainer, sampler
        self.gateway_settings = gateway_settings
        self.gateway = LiveGateway(gateway_settings).start()

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def another_gateway(self, **settings) -> LiveGateway:
        """A second replica on the same Redis and services (optionally with other settings)."""
        return LiveGateway(self.gateway_settings.model_copy(update={"port": free_port(), **settings})).start()


def start_cluster(valkey, seaweed, background_loop, tmp_path_factory, *, base_model: str = "tiny",
                  model_names: str = "") -> Cluster:
    suffix = uuid.uuid4().hex[:10]
    settings = Settings(redis_url=valkey.url, s3_endpoint=seaweed.endpoint, s3_access_key=seaweed.access_key,
                        s3_secret_key=seaweed.secret_key, s3_bucket=f"lp-gw-{suffix}", key_prefix=f"lpgw{suffix}:",
                        base_model=base_model)
    registry = start_live_registry(settings, background_loop)
    trainer = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=5.0,
                                 base_model=base_model)
    sampler = start_live_sampler(registry.settings, background_loop, registry.address, base_model=base_model)
    gateway_settings = GatewaySettings(
        port=free_port(), trainer_address=trainer.address, registry_address=registry.address,
        sampler_address=sampler.address, redis_url=valkey.url, key_prefix=f"lpgw{suffix}:gw:",
        tokenizer_dir=str(tmp_path_factory.mktemp("gateway-tokenizers")), long_poll_s=5.0, future_lease_s=3.0,
        model_names=model_names)
    return Cluster(registry, trainer, sampler, gateway_settings)


def stop_cluster(live: Cluster) -> None:
    live.gateway.stop()
    live.sampler.close()
    live.trainer.close()
    live.registry.close()


@pytest.fixture(scope="module")
def cluster(valkey, seaweed, background_loop, tmp_path_factory):
    live = start_cluster(valkey, seaweed, background_loop, tmp_path_factory)
    yield live
    stop_cluster(live)
