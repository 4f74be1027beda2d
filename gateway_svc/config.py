"""Gateway settings: environment variables with the prefix LORAPLANE_GATEWAY_ (or keyword overrides)."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLANE_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8900
    # Prometheus /metrics on its own port, as the services serve theirs (-1 = none; 0 = any free port): the time of
    # each HTTP route and of each future's work (loraplane_rpc_seconds, service="gateway").
    metrics_port: int = -1
    # gRPC addresses (host:port) of the services the gateway translates onto.
    trainer_address: str = "127.0.0.1:50052"
    registry_address: str = "127.0.0.1:50051"
    sampler_address: str = "127.0.0.1:50053"
    # Every piece of gateway state (sessions, futures, sampling sessions, tinker:// checkpoints) lives here, so
    # replicas behind one load balancer share it and a restart loses nothing.
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "lpgw:"
    # Tinker callers carry no loraplane tenant yet: their adapters live in this registry namespace.
    default_tenant: str = "tinker"
    # Extra names under which the base model is offered to Tinker / OpenAI callers (comma-separated), e.g. the
    # cookbook's `meta-llama/Llama-3.2-1B` when the served model has the Llama-3 vocabulary.
    model_names: str = ""
    # Where get_info's tokenizer_id points: the base model's tokenizer is written here once, so an SDK on the same
    # host loads it offline. Empty = a directory under the system temp dir.
    tokenizer_dir: str = ""
    # retrieve_future holds a request this long before answering try_again (the SDK re-polls at once; its own
    # timeout is 45 s).
    long_poll_s: float = 25.0
    # A future that no replica drives any more (its owner died) is taken over after this many seconds.
    future_lease_s: float = 15.0
    future_ttl_s: int = 24 * 3600
    # What /client/config tells the SDK: datums per forward_backward chunk (the SDK splits bigger batches into
    # chunks sent in parallel, each its own seq_id) and whether to zstd-compress forward_backward bodies.
    fwdbwd_max_chunk_len: int = 1024
    compress_fwdbwd: bool = False
    # Recorded sampling (record_stability_info): a sequence's record lives this long after its last use (Tinker's
    # day), and a tenant's records take at most this many bytes of Redis (about 11 bytes per sampled token); past
    # it the least recently used are evicted.
    stability_ttl_s: int = 24 * 3600
    stability_max_bytes_per_tenant: int = 256 * 1024 * 1024
    # max_tokens when a Tinker sample request omits it.
    default_max_tokens: int = 16
    # Upper bound on one gRPC call made on behalf of a caller.
    upstream_timeout_s: float = 600.0
    # How long a call keeps being retried while its service is unreachable or busy (a restart, a full queue).
    upstream_retry_s: float = 60.0

    def extra_model_names(self) -> list[str]:
        return [n.strip() for n in self.model_names.split(",") if n.strip()]
