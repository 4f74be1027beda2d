"""Splitting a large forward_backward batch into requests, and merging the per-chunk results back.

Each chunk is its own sequenced request; the trainer accumulates every chunk's gradient into the adapter's slot, so
N chunks followed by one optim_step train exactly like one big request would (the losses are sums, not means).
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplane.v1 import trainer_pb2

# Tinker's client defaults (fwdbwd_max_chunk_len, fwdbwd_max_chunk_bytes_count).
DEFAULT_MAX_CHUNK_DATUMS = 1024
DEFAULT_MAX_CHUNK_BYTES = 5_000_000


def split_into_chunks(data: Sequence[trainer_pb2.Datum], max_datums: int = DEFAULT_MAX_CHUNK_DATUMS,
                      max_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> list[list[trainer_pb2.Datum]]:
    """Consecutive runs of datums, each at most `max_datums` long and at most `max_bytes` of serialized datums
    (a single datum larger than `max_bytes` travels alone: splitting a sequence would change its loss)."""
    if max_datums < 1:
        raise ValueError(f"max_datums must be >= 1, got {max_datums}")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    chunks: list[list[trainer_pb2.Datum]] = []
    current: list[trainer_pb2.Datum] = []
    current_bytes = 0
    for datum in data:
        size = datum.ByteSize() + 5  # field tag + length prefix inside the request
        if current and (len(current) >= max_datums or current_bytes + size > max_bytes):
            chunks.append(current)
            current, current_bytes = [], 0
        current.append(datum)
        current_bytes += size
    if current:
        chunks.append(current)
    return chunks


def merge_metrics(per_chunk: Sequence[dict[str, float]], weights: Sequence[float] | None = None) -> dict[str, float]:
    """Merges chunk metrics by their "name:reduction" suffix: sum adds, mean is weighted by `weights` (the number of
    datums of each chunk), max/min take the extreme; any other reduction keeps the first chunk's value."""
    if not per_chunk:
        return {}
    if len(per_chunk) == 1:
        return dict(per_chunk[0])
    weights = list(weights) if weights is not None else [1.0] * len(per_chunk)
    if len(weights) != len(per_chunk):
        raise ValueError("one weight per chunk is required")
    merged: dict[str, float] = {}
    keys: list[str] = []
    for metrics in per_chunk:
        keys.extend(k for k in metrics if k not in keys)
    for key in keys:
        present = [(m[key], w) for m, w in zip(per_chunk, weights) if key in m]
        values = [v for v, _ in present]
        reduction = key.rsplit(":", 1)[1] if ":" in key else ""
        if reduction == "sum":
            merged[key] = float(sum(values))
        elif reduction == "mean":
            total = sum(w for _, w in present)
            merged[key] = float(sum(v * w for v, w in present) / total) if total else float(sum(values) / len(values))
        elif reduction == "max":
            merged[key] = float(max(values))
        elif reduction == "min":
            merged[key] = float(min(values))
        else:
            merged[key] = float(values[0])
    return merged
