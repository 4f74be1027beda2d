"""Packed-sequence attention: several datums laid end to end in one (1, N) row, each attending only to itself.

Why: on CPU neither GEMMs nor SDPA give bit-identical per-row results when the batch shape changes (MKL picks other
kernels for tiny M, and a longer padded key length changes SDPA's reduction order). Packing removes padding, so the
linear layers see the datum's tokens as rows of one (N, K) matrix, and attention runs per datum on exactly the
datum's own (1, H, T, D) tensors, whatever else shares the batch. Same HF model, same rotary (position_ids restart
at 0 for each datum), same SDPA call HF makes for an unpadded causal sequence.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PACKED_ATTENTION = "loraplane_packed"
_local = threading.local()


def _packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    lengths = getattr(_local, "lengths", None)
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    runs = _runs(lengths)
    if len(runs) == 1 and runs[0][0] * runs[0][1] == query.shape[2]:
        # One run covers the whole pack: no slices (a full-range slice still costs a zero-filled gradient).
        length, count = runs[0]
        if count == 1:
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                          is_causal=True)
        out, _ = sdpa_attention_forward(module, _as_batch(query, count), _as_batch(key, count),
                                        _as_batch(value, count), None, dropout=dropout, scaling=scaling,
                                        is_causal=True)
        return out.reshape(1, length * count, *out.shape[2:]), None
    outputs = []
    start = 0
    for length, count in runs:
        end = start + length * count
        if count == 1:
            out, _ = sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end],
                                            value[:, :, start:end], None, dropout=dropout, scaling=scaling,
                                            is_causal=True)
        else:
            # A run of equal-length datums attends as one (count, H, T, D) batch: each batch entry is computed
            # exactly as that datum alone (SDPA's CPU kernel works per (batch, head, query block); checked bit for
            # bit in tests/unit/test_lora.py), in one call instead of `count`.
            out, _ = sdpa_attention_forward(module, _as_batch(query[:, :, start:end], count),
                                            _as_batch(key[:, :, start:end], count),
                                            _as_batch(value[:, :, start:end], count), None, dropout=dropout,
                                            scaling=scaling, is_causal=True)
            out = out.reshape(1, end - start, *out.shape[2:])  # (count, T, H, D) -> (1, count*T, H, D)
        outputs.append(out)
        start = end
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(length, count) for each run of consecutive equal lengths."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def _as_batch(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """(1, H, count*T, D) -> (count, H, T, D), each datum its own batch entry."""
    _, heads, total, dim = tensor.shape
    return tensor.reshape(heads, count, total // count, dim).transpose(0, 1)


def _packed_mask(*args, **kwargs):
    if getattr(_local, "lengths", None) is not None:
        return None
    return sdpa_mask(*args, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_mask)


def enable_packed_attention(model) -> None:
    """Switches this model instance to the packed-aware attention (plain SDPA when no packing is active)."""
    model.config._attn_implementation = PACKED_ATTENTION
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = PACKED_ATTENTION


@contextlib.contextmanager
def packed_sequences(lengths: Sequence[int]) -> Iterator[None]:
    """Within this scope, a forward of a (1, sum(lengths)) input treats each length as its own sequence."""
    previous = getattr(_local, "lengths", None)
    _local.lengths = [int(n) for n in lengths]
    try:
        yield
    finally:
        _local.lengths = previous


def packed_lengths() -> list[int] | None:
    """The datum lengths of the packed row being computed on this thread, or None outside packed_sequences."""
    return getattr(_local, "lengths", None)


def packed_position_ids(lengths: Sequence[int], device=None) -> torch.Tensor:
    return torch.cat([torch.arange(n, dtype=torch.long, device=device) for n in lengths]).unsqueeze(0)
