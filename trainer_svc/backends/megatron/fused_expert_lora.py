"""A fused expert GEMM with its LoRA (issue 35 item 1, forward; behind ``LORAPLANE_MOE_FUSED_LORA=1``, CUDA and bf16
only): for the rows of each tenant x expert segment ``v`` (virtual expert ``v = e * slots + j``, rows sorted by
``v`` as :class:`.moe.ExpertRoute` has them)

    mid[i] = x[tok[i]] A_v^T                                    (rounded once to the compute dtype)
    out[i] = p[i] * (x[tok[i]] W_e^T + mid[i] B_v^T)            (fp32 accumulation, rounded once)

in one Triton kernel: the token gather ``x[tok[i]]`` in the prologue of the grouped GEMM (no ``[rows, K]`` gathered
copy is written), the LoRA A product beside the base product in the same K loop (the same loaded ``x`` tile), and
the LoRA B product and the router-probability scale in the epilogue (no separate delta, no read-modify-write of
``out``). The unfused path (:meth:`.expert_lora.ExpertBatch.forward` after :func:`.kernels.segment_mm`) writes the
gathered rows, the base output, the mid and then adds the delta into the output: three more passes over
``[rows, out]``-sized memory per GEMM.

:func:`reference_forward` is the same math in plain torch (fp32 products of the bf16 operands, the same one
rounding of ``mid``), what the kernel must match within bf16 bounds (tests/gpu/test_megatron_expert_kernels.py).
The CPU path never runs this module: it stays the bit-exact unfused one.
"""

from __future__ import annotations

import os

import torch

FLAG = "LORAPLANE_MOE_FUSED_LORA"
_TRITON: list = []  # [module] once imported, [None] where it cannot be


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernel runs for ``x``: the flag is on, ``x`` is bf16 on CUDA and Triton imports."""
    if os.environ.get(FLAG, "0") != "1" or x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return _kernel() is not None


def fused_forward_or_none(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`fused_forward`, or None (and never again in this process, with one warning) if the kernel fails to
    compile or launch here: the caller runs the unfused path, which computes the same."""
    try:
        return fused_forward(*args, **kwargs)
    except Exception:  # a compiler or driver refusal: the unfused path computes the same
        import logging

        logging.getLogger(__name__).warning("the fused expert-LoRA kernel failed; using the unfused path",
                                            exc_info=True)
        _TRITON[:] = [None]
        return None


def reference_forward(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                      slots: int, tok: torch.Tensor | None = None,
                      probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [rows, Nout], mid [rows, R])`` of the module docstring's formulas. ``x [T, K]`` the token rows (or the
    rows themselves without ``tok``), ``tok [rows]`` the token of each row, ``w [E, Nout, K]`` the base experts,
    ``a [V, R, K]`` and ``b [V, R, Nout]`` each virtual expert's A and scale-carrying B^T (V = E * slots),
    ``offs [V]`` the cumulative row ends of the virtual experts, ``probs [rows]`` the row weights (None: 1)."""
    rows = x if tok is None else x.index_select(0, tok)
    n = rows.shape[0]
    out = rows.new_empty(n, w.shape[1])
    mid = rows.new_empty(n, a.shape[1])
    wide = torch.promote_types(x.dtype, torch.float32)  # fp32 products of bf16 operands are exact
    start = 0
    for v, end in enumerate(offs.tolist()):
        if end > start:
            xs = rows[start:end].to(wide)
            m = (xs @ a[v].to(wide).t()).to(x.dtype)
            acc = xs @ w[v // slots].to(wide).t() + m.to(wide) @ b[v].to(wide)
            if probs is not None:
                acc = acc * probs[start:end, None].to(wide)
            out[start:end] = acc.to(x.dtype)
            mid[start:end] = m
        start = end
    return out, mid


def fused_forward(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                  slots: int, tok: torch.Tensor | None = None, probs: torch.Tensor | None = None, *,
                  block_m: int = 64, block_n: int = 128, block_k: int = 64, num_warps: int = 4,
                  num_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_forward` as one Triton kernel launch (no host sync: the tile table is built on the device
    from ``offs``)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the fused expert-LoRA kernel needs Triton")
    x, w, a, b = x.contiguous(), w.contiguous(), a.contiguous(), b.contiguous()
    n = tok.shape[0] if tok is not None else x.shape[0]
    k, n_out, r = x.shape[1], w.shape[1], a.shape[1]
    out = x.new_empty(n, n_out)
    mid = x.new_empty(n, r)
    if n == 0:
        return out, mid
    tile_seg, tile_row, n_tiles, max_tiles = _tiles(offs, n, block_m)
    block_r = max(16, 1 << (r - 1).bit_length())
    grid = (max_tiles, -(-n_out // block_n))
    kernel[grid](
        x, tok if tok is not None else x, w, a, b, probs if probs is not None else x, out, mid,
        tile_seg, tile_row, offs, n_tiles,
        k, n_out, r, slots,
        x.stride(0), w.stride(0), w.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), mid.stride(0),
        HAS_TOK=tok is not None, HAS_P=probs is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r,
        num_warps=num_warps, num_stages=num_stages)
    return out, mid


def _tiles(offs: torch.Tensor, rows: int, block_m: int):
    """The row tiles of the segments, on the device: tile ``t`` covers rows ``[tile_row[t], +block_m)`` of segment
    ``tile_seg[t]``; ``n_tiles`` (a 1-element tensor) of the ``max_tiles`` launched programs have work (an upper
    bound known on the host: every segment wastes at most one partial tile)."""
    offs = offs.to(torch.int64)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    tiles = (offs - starts + block_m - 1) // block_m
    cum = tiles.cumsum(0)
    max_tiles = -(-rows // block_m) + offs.shape[0]
    t = torch.arange(max_tiles, device=offs.device)
    seg = torch.searchsorted(cum, t, right=True).clamp_(max=offs.shape[0] - 1)
    row = starts[seg] + (t - (cum[seg] - tiles[seg])) * block_m
    return seg.to(torch.int32), row.to(torch.int32), cum[-1:].to(torch.int32), max_tiles


def _kernel():
    if not _TRITON:
        try:
            _TRITON.append(_build())
        except ImportError:
            _TRITON.append(None)
    return _TRITON[0]


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def fused_expert_lora_kernel(
            x_ptr, tok_ptr, w_ptr, a_ptr, b_ptr, p_ptr, out_ptr, mid_ptr,
            tile_seg_ptr, tile_row_ptr, seg_end_ptr, n_tiles_ptr,
            K, NOUT, R, slots,
            stride_x, stride_we, stride_wn, stride_av, stride_ar, stride_bv, stride_br, stride_out, stride_mid,
            HAS_TOK: tl.constexpr, HAS_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        if t >= tl.load(n_tiles_ptr):
            return
        v = tl.load(tile_seg_ptr + t)
        row0 = tl.load(tile_row_ptr + t)
        end = tl.load(seg_end_ptr + v)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        # Prologue: the token of each row (the gather happens in the K loop's loads).
        if HAS_TOK:
            src = tl.load(tok_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        expert = (v // slots).to(tl.int64)
        v64 = v.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < NOUT
        rr = tl.arange(0, BLOCK_R)
        r_ok = rr < R
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        mid = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for kb in range(tl.cdiv(K, BLOCK_K)):
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xt = tl.load(x_ptr + src[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                         other=0.0)
            wt = tl.load(w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(xt, wt, acc)
            at = tl.load(a_ptr + v64 * stride_av + rr[None, :] * stride_ar + ks[:, None],
                         mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            mid = tl.dot(xt, at, mid)
        # Epilogue: the LoRA B product on the rounded mid, the routing weight, one rounding of the output.
        mid_c = mid.to(x_ptr.dtype.element_ty)
        bt = tl.load(b_ptr + v64 * stride_bv + rr[:, None] * stride_br + cols[None, :],
                     mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(mid_c, bt, acc)
        if HAS_P:
            p = tl.load(p_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * p[:, None]
        rows64 = rows.to(tl.int64)
        tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
        if pid_n == 0:
            tl.store(mid_ptr + rows64[:, None] * stride_mid + rr[None, :], mid_c, mask=row_ok[:, None] & r_ok[None, :])

    return fused_expert_lora_kernel
