"""The expert GEMMs over more groups than one torch._grouped_mm call takes (128 experts x 9 adapter slots of fused
tenants = 1,152 virtual experts; the kernel refuses more than 1,024 groups): cut into calls of at most MAX_GROUPS
groups, they must equal the per-group products, empty groups and chunk boundaries included."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.backends.megatron import moe


@pytest.mark.parametrize("max_groups", [3, 4, 1024])
def test_grouped_products_over_chunks_of_groups(monkeypatch, max_groups):
    monkeypatch.setattr(moe, "MAX_GROUPS", max_groups)
    torch.manual_seed(0)
    counts = [3, 0, 2, 5, 1, 0, 4, 2, 0, 6]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x, w, g = torch.randn(sum(counts), 8), torch.randn(len(counts), 8, 16), torch.randn(sum(counts), 16)
    want = torch.cat([part @ w[i] for i, part in enumerate(x.split(counts))])
    assert torch.allclose(moe.segment_mm(x, w, offs, None), want, atol=1e-5)
    want_outer = torch.stack([a.t() @ b for a, b in zip(x.split(counts), g.split(counts))])
    got_outer = moe.segment_outer(x, g, offs, None)
    assert got_outer.shape == (len(counts), 8, 16)
    assert torch.allclose(got_outer, want_outer, atol=1e-5)
