"""The megatron backend's packed-row attention (``attention.packed_attention``): causal within each datum, never
across datums, against plain softmax attention on each datum alone (float64, CPU: the per-datum SDPA path; the
CUDA varlen kernel is checked against it in tests/gpu/test_megatron_fast_paths.py)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

LENGTHS = (5, 1, 9, 3)
HEADS, GROUPS, DIM = 6, 2, 8


def _reference(q, k, v, scale):
    """Softmax attention of one datum, causal, K/V expanded to the query heads."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_packed_attention_equals_each_datum_alone():
    from trainer_svc.backends.megatron.attention import packed_attention, packed_rows

    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, GROUPS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, GROUPS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(total, HEADS, DIM, generator=g, dtype=torch.float64)
    packed = packed_rows(list(LENGTHS), torch.device("cpu"))
    assert packed.bounds == ((0, 5), (5, 6), (6, 15), (15, 18))
    assert packed.cu_seqlens_q.tolist() == [0, 5, 6, 15, 18] and packed.max_seqlen_q == 9
    scale = 1.0 / math.sqrt(DIM)
    out = packed_attention(q, k, v, packed, scale)
    (out * weight).sum().backward()

    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    want = torch.cat([_reference(*(x[a:b] for x in leaves), scale) for a, b in packed.bounds])
    (want * weight).sum().backward()
    torch.testing.assert_close(out, want)
    for got, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad, ref.grad)
