"""Configuration from environment variables (prefix LORAPLANE_) and keyword overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

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
    # The registry may answer a download with a presigned S3 URL of the blob (a minute long) instead of streaming it
    # through itself: several times faster for large adapters. Clients that cannot reach S3 fall back to the stream.
    s3_direct_downloads: bool = True
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
    # The torch backend's base weights (python -m trainer_svc --dtype, so also `loraplane up`'s trainer): float32
    # (the CPU's bit-exact reference) or bfloat16 (a GPU's); LoRA masters, gradients and moments stay float32.
    trainer_dtype: Literal["float32", "bfloat16"] = "float32"
    # What `python -m sampler_svc` (so also `loraplane up`) samples with: a name of the engine registry
    # (sampler_svc/engines/__init__.py, ENGINES; checked there at start-up, since this library may not import the
    # sampler): the in-process torch engine, or SGLang (servers the sampler launches, one per GPU, unless
    # --sglang-url names running ones); and extra arguments for launched SGLang servers, space-separated (e.g.
    # "--mem-fraction-static=0.3" beside a trainer on the same GPU).
    sampler_engine: str = "torch"
    sampler_sglang_args: str = ""

    # Durable training: with a Redis configured, the trainer journals every sequenced request there and
    # checkpoints to the registry, and a restart recovers every adapter. Trainers sharing one Redis need distinct
    # ids; a trainer restarted under the same id takes over its adapters.
    trainer_id: str = "trainer"
    trainer_journal: bool = True
    # A trainer fleet (docs/architecture.md, "Trainer fleet"): trainers with the same fleet name share one journal
    # and serve one base model, each adapter on one of them; trainer_id then names the member (distinct per
    # trainer). Needs redis_url. A member whose heartbeat is older than the TTL is presumed dead: its adapters move.
    trainer_fleet: str = ""
    trainer_heartbeat_ttl_s: float = 10.0
    # The address clients reach this trainer at, when it is not the one it listens on (containers, NAT).
    trainer_advertise_address: str = ""
    # A sampler fleet (docs/architecture.md, "Sampler fleet"): samplers with the same fleet name serve one base model
    # and clients spread adapters over them by affinity with bounded load; sampler_id names the replica (and its
    # persisted watch state: keep it across restarts). Needs redis_url. The TTL only bounds how long a dead replica
    # stays listed: clients route around it at its first failed call.
    sampler_fleet: str = ""
    sampler_id: str = "sampler-0"
    sampler_heartbeat_ttl_s: float = 3.0
    # In a sampler fleet, a newly published version is loaded ahead of requests by the first this-many replicas of its
    # adapter's routing order (where its requests go); the others load it on demand. 0 = every replica preloads.
    sampler_fleet_preload: int = 2
    # When a trainer that pushes its versions to the sampler fleet answers PublishWeights: "pushed" = once the
    # registry has reserved the version and the samplers hold its bytes, its S3 upload going on beside from a copy on
    # the trainer's disk (data_dir/trainer-uploads/<trainer_id>; a restarted trainer finishes it); "stored" = only
    # after the upload (docs/architecture.md, "Which path a version took").
    publish_ack: Literal["pushed", "stored"] = "pushed"
    # The address clients reach this sampler at, when it is not the one it listens on (containers, NAT).
    sampler_advertise_address: str = ""
    # Intra-op (and inter-op) torch threads of a trainer or sampler process. 0 = torch's default, every core: right
    # for a service alone on its host. `loraplane up` sets each service's share of the cores (loraplane/threads.py).
    torch_threads: int = 0
    checkpoint_every_steps: int = 50
    checkpoint_every_s: float = 300.0

    # Authentication (docs/security.md). Off = the open mode (tests, the embedded demo), logged loudly by every
    # service. On = every RPC needs an API key (keys live in the Redis at redis_url, under key_prefix).
    auth: bool = False
    # The key this process sends: a user's key for the SDK and CLI, the service key for trainer and sampler.
    api_key: str = ""
    # TLS of every gRPC server (PEM files); with tls_client_ca set, servers also demand client certificates (mTLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # TLS of every gRPC client: clients use TLS when tls_ca is set (the CA that signed the servers' certificates)
    # or tls is on (system roots); tls_client_cert/key are their certificate for mTLS.
    tls: bool = False
    tls_ca: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""
    # Overrides the name checked against the server certificate (when addresses are IPs the cert does not list).
    tls_server_name: str = ""

    # Prometheus metrics over HTTP on this port (0 = a free port, -1 = off); `loraplane up` gives each service one.
    metrics_port: int = -1
    # OpenTelemetry traces go to this OTLP/gRPC endpoint (e.g. http://otel-collector:4317); empty = no tracing.
    otlp_endpoint: str = ""


def load_settings(**overrides) -> Settings:
    return Settings(**overrides)
