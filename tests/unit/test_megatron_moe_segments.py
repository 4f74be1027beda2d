"""The expert GEMMs over more groups than one torch._grouped_mm call takes (128 experts x 9 adapter slots of fused
tenants = 1,152 virtual experts; the kernel refuses more than 1,024 groups): cut into calls of at most MAX_GROUPS
groups, they must equal the per-group products, empty groups and chunk boundaries included."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.backends.megatron import kernels, moe


@pytest.mark.parametrize("max_groups", [3, 4, 1024])
def test_grouped_products_over_chunks_of_groups(monkeypatch, max_groups):
    monkeypatch.setattr(kernels, "MAX_GROUPS", max_groups)
    torch.manual_seed(0)
    counts = [3, 0, 2, 5, 1, 0, 4, 2, 0, 6]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w, g = torch.randn(sum(counts), 8), torch.randn(len(counts), 8, 16), torch.randn(sum(counts), 16)
    want = torch.cat([part @ w[i] for i, part in enumerate(x.split(counts))])
    assert torch.allclose(kernels.segment_mm(x, w, offs, None), want, atol=1e-5)
    want_outer = torch.stack([a.t() @ b for a, b in zip(x.split(counts), g.split(counts))])
    got_outer = kernels.segment_outer(x, g, offs, None)
    assert got_outer.shape == (len(counts), 8, 16)
    assert torch.allclose(got_outer, want_outer, atol=1e-5)


def test_segment_mm_adds_into_an_accumulator_chunk_by_chunk(monkeypatch):
    """``acc=``: each chunk's product added in place (no concatenation), the host-count loop likewise."""
    monkeypatch.setattr(kernels, "MAX_GROUPS", 3)
    torch.manual_seed(1)
    counts = [3, 0, 2, 5, 1, 0, 4]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w = torch.randn(sum(counts), 8), torch.randn(len(counts), 8, 16)
    base = torch.randn(sum(counts), 16)
    want = base + torch.cat([part @ w[i] for i, part in enumerate(x.split(counts))])
    for host_counts in (None, counts):
        acc = base.clone()
        assert kernels.segment_mm(x, w, offs, host_counts, acc=acc) is acc
        assert torch.allclose(acc, want, atol=1e-5)


def _experts(num_experts: int, hidden: int, ffn: int, slots: int = 1):
    from types import SimpleNamespace

    config = SimpleNamespace(moe_ffn_hidden_size=ffn, hidden_size=hidden, params_dtype=torch.float64,
                             loraplane_expert_slots=slots)
    experts = moe.GroupedExperts(num_experts * slots, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        experts.weight1.copy_(torch.randn(experts.weight1.shape, generator=g, dtype=torch.float64) / hidden**0.5)
        experts.weight2.copy_(torch.randn(experts.weight2.shape, generator=g, dtype=torch.float64) / ffn**0.5)
    return experts


def _reference(experts, x, probs, top):
    """Token by token: ``sum_j p_j down_e(silu(gate_e x) * up_e x)``, autograd through plain products."""
    ffn = experts.weight2.shape[2]
    out = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(top.shape[1]):
            e = int(top[t, j])
            h = experts.weight1[e] @ x[t]
            acc = acc + probs[t, j] * (experts.weight2[e] @ (torch.nn.functional.silu(h[:ffn]) * h[ffn:]))
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("slots", [1, 3])
def test_local_experts_equal_the_per_token_formula_with_their_gradients(slots):
    """The local path (one sort, gathers, the experts as one autograd node, the routing weight on the SwiGLU output,
    hand-written backward) against the per-token formula in float64: output, input and probability gradients, for
    tokens spread over adapter slots (virtual experts) and experts without rows."""
    torch.manual_seed(5)
    tokens, hidden, ffn, num_experts, k = 13, 8, 6, 5, 2
    experts = _experts(num_experts, hidden, ffn, slots)
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(tokens, num_experts - 1, dtype=torch.float64)  # expert 4 never chosen: an empty group
    scores, top = logits.topk(k, dim=1)
    probs = torch.softmax(scores, dim=-1).requires_grad_(True)
    slot = torch.randint(0, slots, (tokens,)) if slots > 1 else None
    g = torch.randn(tokens, hidden, dtype=torch.float64)
    got = experts.local_forward(x, probs, top, slot)
    gx, gp = torch.autograd.grad(got, (x, probs), g)
    want = _reference(experts, x, probs, top)
    wx, wp = torch.autograd.grad(want, (x, probs), g)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.allclose(gx, wx, rtol=0, atol=1e-12)
    assert torch.allclose(gp, wp, rtol=0, atol=1e-12)


def test_rows_mode_equals_the_local_path():
    """megatron's dispatcher path (rows sorted by expert, their probabilities) gives the rows the local path sums."""
    torch.manual_seed(6)
    tokens, hidden, ffn, num_experts, k = 11, 8, 6, 4, 2
    experts = _experts(num_experts, hidden, ffn)
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    probs, top = torch.softmax(torch.randn(tokens, num_experts, dtype=torch.float64), -1).topk(k, dim=1)
    order = torch.argsort(top.reshape(-1), stable=True)
    rows = experts(x[order // k], torch.bincount(top.reshape(-1), minlength=num_experts), probs.reshape(-1)[order])[0]
    summed = torch.zeros(tokens, hidden, dtype=torch.float64).index_add_(0, order // k, rows)
    assert torch.allclose(summed, experts.local_forward(x, probs, top, None), atol=1e-12)


def test_the_fused_swiglu_math_equals_the_eager_kernels():
    """What torch.compile fuses on CUDA (:class:`moe._Fused`) is the same function as the eager kernels the CPU runs:
    forward and backward (input and routing-weight gradients), float64."""
    torch.manual_seed(7)
    h, p, g = torch.randn(9, 12, dtype=torch.float64), torch.rand(9, 1, dtype=torch.float64), torch.randn(9, 6,
                                                                                                      dtype=torch.float64)
    assert torch.allclose(moe._swiglu_weighted_math(h, p), moe._swiglu_weighted_eager(h, p), atol=1e-12)
    for got, want in zip(moe._swiglu_weighted_backward_math(g, h, p), moe._swiglu_weighted_backward_eager(g, h, p)):
        assert torch.allclose(got.to(want.dtype), want, atol=1e-12)
    hh, pp = h.clone().requires_grad_(True), p.clone().requires_grad_(True)
    gh, gp = torch.autograd.grad(moe._swiglu_weighted_math(hh, pp), (hh, pp), g)
    got_h, got_p = moe._swiglu_weighted_backward_eager(g, h, p)
    assert torch.allclose(got_h, gh, rtol=0, atol=1e-12) and torch.allclose(got_p, gp.view(-1), rtol=0, atol=1e-12)
