"""Configuration from environment variables (prefix LORAPLANE_) and keyword overrides."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLANE_", extra="ignore")

    # Where `loraplane up` keeps server data, logs and its state file.
    data_dir: Path = Path(".loraplane")

    # External Redis / S3. Empty = `loraplane up` starts embedded Valkey / SeaweedFS.
    redis_url: str = ""
    s3_endpoint: str = ""
    s3_access_key: str = "loraplane"
    s3_secret_key: str = "loraplane-secret"
    s3_bucket: str = "loraplane"
    s3_secure: bool = False
    s3_region: str = ""
    # Every Redis key of the registry starts with this; lets several registries share one Redis.
    key_prefix: str = "lp:"

    host: str = "127.0.0.1"
    registry_port: int = 0
    trainer_port: int = 0
    sampler_port: int = 0
    # The HTTP gateway (gateway_svc: Tinker wire API, OpenAI / Anthropic sampling) that `loraplane up` starts.
    gateway_port: int = 0
    # Addresses of running services (host:port), used by clients and by services that call each other.
    registry_address: str = ""
    trainer_address: str = ""
    sampler_address: str = ""

    # A real model by default (its weights ship with the install), so a newcomer's first sample is text; the
    # tests choose the random `tiny` model explicitly (tests/conftest.py).
    base_model: str = "smollm2-135m-instruct"
    device: str = "cpu"

    # Durable training: with a Redis configured, the trainer journals every sequenced request there and
    # checkpoints to the registry, and a restart recovers every adapter. Trainers sharing one Redis need distinct
    # ids; a trainer restarted under the same id takes over its adapters.
    trainer_id: str = "trainer"
    trainer_journal: bool = True
    checkpoint_every_steps: int = 50
    checkpoint_every_s: float = 300.0


def load_settings(**overrides) -> Settings:
    return Settings(**overrides)
