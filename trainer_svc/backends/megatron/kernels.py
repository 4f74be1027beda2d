"""The grouped-GEMM primitives of the megatron backend, at the bottom of its import graph (torch only).

Every LoRA and expert product of the backend is written in these: a grouped GEMM over row segments
(:func:`segment_mm`), its per-segment weight-gradient form (:func:`segment_outer`), the sum of each token's expert
rows (:func:`sum_copies`) and the check that ``torch._grouped_mm`` runs here as a real grouped kernel
(:func:`grouped_mm_supported`). The dense LoRA (:mod:`.lora`), the expert LoRA (:mod:`.expert_lora`) and the MoE
layer (:mod:`.moe`) sit on top; nothing here knows about adapters or experts.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

# torch._grouped_mm refuses 1,024 groups per call on the H100 ("Can't process more than 1024 groups"); 128 experts
# times 8 adapter slots (the virtual experts of fused tenants) is more.
MAX_GROUPS = 512


def _group_chunks(offs: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(first group, end group, first row, end row) of each run of at most MAX_GROUPS groups: one host sync per
    offsets tensor, only when there are more groups than one call takes (kept on the tensor: a layer's forward and
    backward GEMMs share one route's offsets)."""
    cached = getattr(offs, "_loraplane_chunks", None)
    if cached is not None and cached[0] == MAX_GROUPS:
        return cached[1]
    groups = offs.shape[0]
    ends = list(range(MAX_GROUPS, groups, MAX_GROUPS)) + [groups]
    rows = offs[[e - 1 for e in ends]].tolist()
    out, g0, r0 = [], 0, 0
    for g1, r1 in zip(ends, rows):
        out.append((g0, g1, r0, int(r1)))
        g0, r0 = g1, int(r1)
    offs._loraplane_chunks = (MAX_GROUPS, out)
    return out


def segment_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list[int] | None,
               acc: torch.Tensor | None = None) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for ``x[N, k]`` sorted by group, ``w[G, k, n]``: one grouped GEMM (one per
    MAX_GROUPS groups), or a loop over the groups' host ``counts`` where the kernel does not run. With ``acc``
    (``[N, n]``) the product is added into it in place, chunk by chunk (no concatenation of the chunks), and ``acc``
    is returned."""
    n = w.shape[2]
    if x.shape[0] == 0:
        return acc if acc is not None else x.new_zeros(0, n)
    if counts is None and offs.shape[0] <= MAX_GROUPS:
        parts = [(0, x.shape[0], torch._grouped_mm(x, w, offs=offs))]
    elif counts is None:
        parts = [(r0, r1, torch._grouped_mm(x[r0:r1], w[g0:g1], offs=offs[g0:g1] - r0))
                 for g0, g1, r0, r1 in _group_chunks(offs) if r1 > r0]
    else:
        ends = list(itertools.accumulate(counts))
        parts = [(e - c, e, x[e - c : e] @ w[g]) for g, (c, e) in enumerate(zip(counts, ends)) if c]
    if acc is None:
        if len(parts) == 1 and parts[0][1] - parts[0][0] == x.shape[0]:
            return parts[0][2]
        acc = x.new_zeros(x.shape[0], n)
    for r0, r1, part in parts:
        acc[r0:r1].add_(part if part.dtype == acc.dtype else part.to(acc.dtype))
    return acc


def segment_outer(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """``a[rows of g]^T @ b[rows of g]`` per group: ``[G, a_cols, b_cols]`` (the weight gradients of
    :func:`segment_mm`; a group without rows gets zeros)."""
    groups = offs.shape[0]
    if a.shape[0] == 0:
        return a.new_zeros(groups, a.shape[1], b.shape[1])
    if counts is None:
        if groups <= MAX_GROUPS:
            return torch._grouped_mm(a.t(), b, offs=offs)
        return torch.cat([torch._grouped_mm(a[r0:r1].t(), b[r0:r1], offs=offs[g0:g1] - r0) if r1 > r0
                          else a.new_zeros(g1 - g0, a.shape[1], b.shape[1])
                          for g0, g1, r0, r1 in _group_chunks(offs)])
    return torch.stack([pa.t() @ pb for pa, pb in zip(a.split(counts), b.split(counts))])


def sum_copies(rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j rows[where[t, j]]``: the sum of each token's k expert rows, ``[T, h]``. On CUDA one
    ``embedding_bag`` kernel (gathers and sums without writing the ``[T*k, h]`` gathered copy, fp32 accumulation);
    elsewhere the gather, then the sum over k."""
    if rows.device.type == "cuda" and rows.shape[0] > 0:
        return F.embedding_bag(where, rows, mode="sum")
    return rows.index_select(0, where.reshape(-1)).view(*where.shape, -1).sum(1)


def aligned(dims, dtype: torch.dtype) -> bool:
    """Whether every dim is a multiple of 16 bytes of ``dtype`` (the stride and column-offset alignment
    ``torch._grouped_mm`` requires of its operands)."""
    unit = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    return all(d % unit == 0 for d in dims)


_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here as a grouped kernel and computes what this backend relies on (checked
    once per device type and dtype with a tiny call against the plain products). On CUDA only bf16 on sm90: other
    dtypes and architectures either have no kernel or take torch's fallback, a loop over the groups that copies
    the offsets to the host (a sync per call). On CPU (tests) torch's loop is all there is, and fine."""
    key = (device.type, dtype)
    ok = _GROUPED_MM_OK.get(key)
    if ok is None:
        ok = _GROUPED_MM_OK[key] = _probe_grouped_mm(device, dtype)
    return ok


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm") or device.type not in ("cpu", "cuda"):
        return False
    if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] != 9):
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 64, generator=g).to(device, dtype)
    w = torch.randn(3, 32, 64, generator=g).to(device, dtype)  # stored [n, k, in]: used transposed, as A is
    y = torch.randn(200, 32, generator=g).to(device, dtype)
    # Ragged, unaligned group ends, as a batch's token counts are: a kernel that needed aligned offsets (for the
    # contraction split of the weight gradients) would fail the comparison here, not train wrong.
    ends = [37, 101, 200]
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    try:
        rows = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # [200, 32]
        per_group = torch._grouped_mm(x.t(), y, offs=offs)  # [3, 64, 32]
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    start = 0
    for k, end in enumerate(ends):
        if not (torch.allclose(rows[start:end].float(), (x[start:end] @ w[k].t()).float(), atol=tol, rtol=tol)
                and torch.allclose(per_group[k].float(), (x[start:end].t() @ y[start:end]).float(), atol=tol,
                                   rtol=tol)):
            return False
        start = end
    return True
