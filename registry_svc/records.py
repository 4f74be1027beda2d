"""What the registry keeps: its limits, the adapter and version records, and the rules they share."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from loraplane import fields
from loraplane.lora import LoraSpec

KIND_WEIGHTS = 1
KIND_TRAINING_STATE = 2
KINDS = (KIND_WEIGHTS, KIND_TRAINING_STATE)

# LoraConfig.weights_dtype: unspecified (= float32), float32, bfloat16.
WEIGHTS_DTYPES = (0, 1, 2)


@dataclass(frozen=True)
class RegistryLimits:
    """Bounds on what a caller may store. Defaults can be overridden with LORAPLANE_REGISTRY_* variables."""

    max_blob_bytes: int = 4 * 1024**3
    # A chunk is at most 1 MiB; the slack admits senders that frame 1 MiB of payload plus a little.
    max_chunk_bytes: int = 1024 * 1024 + 64 * 1024
    max_download_chunk_bytes: int = 4 * 1024 * 1024
    max_metadata_entries: int = 64
    max_metadata_key_chars: int = 128
    max_metadata_value_chars: int = 4096
    max_aliases_per_publish: int = 16
    max_idempotency_key_chars: int = 256
    max_base_model_chars: int = 512
    max_lora_rank: int = 65536
    max_prefix_chars: int = 128
    # Events kept in the stream (approximate: XADD MAXLEN ~).
    max_events: int = 1_000_000
    # CollectGarbage aborts multipart uploads older than this (left behind by a registry that crashed mid-publish).
    stale_upload_seconds: int = 24 * 3600
    # Bytes of publishes whose sha256 comes in the trailer held in memory at once (see `publish`); one such blob
    # may be at most this large.
    max_buffered_publish_bytes: int = 2 * 1024**3

    @classmethod
    def from_env(cls) -> RegistryLimits:
        overrides = {}
        for name in cls.__dataclass_fields__:
            raw = os.environ.get(f"LORAPLANE_REGISTRY_{name.upper()}")
            if raw:
                overrides[name] = int(raw)
        return cls(**overrides)


@dataclass
class AdapterRecord:
    name: str
    # As the trainer gave it, not canonicalized: rank, alpha (0 = rank), target_modules (empty = unstated), seed,
    # expert_layout ("" = unspecified, which trainers read as per-expert).
    lora: LoraSpec
    base_model: str
    keep_last: int
    metadata: dict[str, str]
    aliases: dict[str, int]
    latest_version: int
    create_time_ms: int
    # One of WEIGHTS_DTYPES: how trainers write the adapter's weights versions (the registry accepts any float blob).
    weights_dtype: int = 0


@dataclass
class VersionRecord:
    adapter: str
    version: int
    kind: int
    sha256: str
    size_bytes: int
    training_step: int
    metadata: dict[str, str]
    aliases: list[str]
    create_time_ms: int
    # Reserved by a trainer whose upload of the bytes has not landed yet (PublishHeader.upload_later).
    pending: bool = False


def now_ms() -> int:
    return int(time.time() * 1000)


def validate_metadata(metadata: Mapping[str, str], limits: RegistryLimits, field_name: str) -> dict[str, str]:
    return fields.validate_metadata(metadata, field_name, max_entries=limits.max_metadata_entries,
                                    max_key_chars=limits.max_metadata_key_chars,
                                    max_value_chars=limits.max_metadata_value_chars)
