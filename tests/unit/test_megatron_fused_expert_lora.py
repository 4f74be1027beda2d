"""The CPU side of the fused expert-LoRA kernel (trainer_svc/backends/megatron/fused_expert_lora.py): its pure-torch
reference is the unfused path's math (the gather, the base grouped GEMM, the LoRA A and B grouped GEMMs, the routing
weight), its tile table covers every row of every segment once, and the CPU never takes it (the CPU path stays the
bit-exact unfused one, with or without the flag). The kernel against the reference on CUDA:
tests/gpu/test_megatron_expert_kernels.py."""

from __future__ import annotations

import torch

from trainer_svc.backends.megatron import fused_expert_lora
from trainer_svc.backends.megatron.kernels import segment_mm


def _case(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    experts, slots, rank, k, n_out, tokens = 4, 3, 5, 24, 16, 30
    counts = torch.tensor([4, 0, 7, 0, 0, 3, 9, 1, 2, 5, 0, 6])
    rows = int(counts.sum())
    case = {"x": torch.randn(tokens, k, generator=g, dtype=dtype),
            "w": torch.randn(experts, n_out, k, generator=g, dtype=dtype),
            "a": torch.randn(experts * slots, rank, k, generator=g, dtype=dtype),
            "b": torch.randn(experts * slots, rank, n_out, generator=g, dtype=dtype),
            "offs": counts.cumsum(0).to(torch.int32), "slots": slots,
            "tok": torch.randint(0, tokens, (rows,), generator=g), "probs": torch.rand(rows, generator=g, dtype=dtype)}
    return case, counts


def test_the_reference_is_the_unfused_expert_gemm_with_its_lora():
    c, counts = _case()
    out, mid = fused_expert_lora.reference_forward(**c)
    xs = c["x"].index_select(0, c["tok"])
    per_expert = counts.view(-1, c["slots"]).sum(1)
    # float64: the host-count form of the grouped products (torch's grouped kernel takes no float64).
    seg = counts.tolist()
    base = segment_mm(xs, c["w"].transpose(1, 2), per_expert.cumsum(0).to(torch.int32), per_expert.tolist())
    want_mid = segment_mm(xs, c["a"].transpose(1, 2), c["offs"], seg)
    want = (base + segment_mm(want_mid, c["b"], c["offs"], seg)) * c["probs"][:, None]
    assert torch.allclose(mid, want_mid, atol=1e-12) and torch.allclose(out, want, atol=1e-12)
    # Without a gather or a routing weight: the rows themselves, weight 1.
    rows = {**c, "x": xs, "tok": None, "probs": None}
    out_rows, _ = fused_expert_lora.reference_forward(**rows)
    assert torch.allclose(out_rows, base + segment_mm(want_mid, c["b"], c["offs"], seg), atol=1e-12)


def test_the_tile_table_covers_every_row_of_every_segment_once():
    _, counts = _case()
    offs = counts.cumsum(0).to(torch.int32)
    for block in (1, 2, 4, 16):
        seg, row, n_tiles, max_tiles = fused_expert_lora._tiles(offs, int(counts.sum()), block)
        n = int(n_tiles.item())
        assert n <= max_tiles and n == sum(-(-int(c) // block) for c in counts)
        covered = []
        for t in range(n):
            v, start = int(seg[t]), int(row[t])
            end = int(offs[v])
            assert end - int(counts[v]) <= start < end
            covered += [(v, r) for r in range(start, min(start + block, end))]
        ends = offs.tolist()
        want = [(v, r) for v, e in enumerate(ends) for r in range(e - int(counts[v]), e)]
        assert sorted(covered) == want


def test_the_cpu_never_takes_the_fused_kernel(monkeypatch):
    x = torch.zeros(2, 2, dtype=torch.bfloat16)
    assert not fused_expert_lora.enabled(x)
    monkeypatch.setenv(fused_expert_lora.FLAG, "1")
    assert not fused_expert_lora.enabled(x)  # the CPU keeps the bit-exact unfused path


def test_a_kernel_that_fails_here_hands_over_to_the_unfused_path_for_good(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise RuntimeError("no such PTX target")

    monkeypatch.setattr(fused_expert_lora, "fused_forward", refuse)
    monkeypatch.setattr(fused_expert_lora, "_TRITON", [object()])  # as if Triton had built the kernel
    assert fused_expert_lora._kernel() is not None
    assert fused_expert_lora.fused_forward_or_none() is None
    assert fused_expert_lora._kernel() is None  # so enabled() says no from now on
