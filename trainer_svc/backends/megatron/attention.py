"""Core attention for the megatron backend's layer spec, over packed rows: causal attention within each datum of a
batch that :mod:`.engine` runs as ONE row of ``T = Σ len_i`` tokens (no padding), in place of megatron's unfused
``DotProductAttention``, which materializes the ``[b, heads, s, s]`` score matrix (and an fp32 copy for the softmax)
and keeps it for the backward: 8.6 GB per layer for an 8B model at 16 x 2048 tokens.

The row's datum boundaries come as :class:`PackedRows` (megatron's ``PackedSeqParams`` with the boundaries on the
host too), handed through ``GPTModel.forward(packed_seq_params=...)``. Its ``qkv_format`` is ``sbhd``, not ``thd``:
megatron's thd path applies RoPE per call through a device-to-host copy of ``cu_seqlens`` and a split/cat per datum
(twice per layer), while :func:`.model.forward_logits` computes the angles of every token's position within its
datum once per batch and hands them over with the boundaries; this module rotates q and k with them before
attending (:func:`.fusion.apply_rope`: one fused kernel per tensor and direction on CUDA, megatron's op-by-op math
elsewhere), and megatron is handed no angles of its own.

gpt-oss's per-head sinks and sliding windows (:func:`sink_window_eager`: transformers' eager math, CPU, datum by
datum; :func:`sink_window_sdpa`: the sink as an extra key of a masked SDPA call, CUDA: full-attention layers datum by
datum, sliding-window layers in bands of the window's width, every datum's bands in one call).

Kernels. Nothing of size ``T^2`` is ever formed, and a datum never attends to another:
  * CUDA, bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over ``cu_seqlens``), one call
    per layer, when this torch has it (its signature differs between releases: read at first use);
  * otherwise (fp32, CPU, older torch, or a kernel that refuses): ``scaled_dot_product_attention(is_causal=True)``
    once per datum. On CUDA only the fused kernels are allowed (flash / memory-efficient / cuDNN) so the math
    kernel's s^2 scores never come back; GQA runs without expanding K/V where the kernel supports it.
The kernels keep the softmax statistics in fp32 and recompute the scores in the backward.

The ``attention_mask`` megatron hands down is not read (the module is causal per datum by construction).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from loraplane.models.packed import PackedLayout

from .fusion import apply_rope

_GQA_FUSED_OK: dict[str, bool] = {}  # per device type: did a fused kernel accept enable_gqa
_VARLEN_OK: dict[tuple[str, torch.dtype], bool] = {}  # per device type and dtype: did varlen_attn run


@dataclass
class PackedRows(PackedSeqParams):
    """The datums of one packed row: ``cu_seqlens_q`` / ``_kv`` (int32, on the device) for the varlen kernel and
    ``bounds`` ((start, end) per datum, on the host) for the per-datum loop, so neither reads the device; and the
    RoPE angles of each token's position within its datum (``rope_angles``, fp32 ``[T, 1, head_dim]``), which
    :class:`SDPACoreAttention` applies to q and k (none: the caller already rotated them)."""

    bounds: tuple[tuple[int, int], ...] = ()
    rope_angles: torch.Tensor | None = None
    rope_scale: float = 1.0  # YaRN's factor on cos and sin (1 otherwise)
    _rope_cos_sin: dict = field(default_factory=dict, init=False, repr=False)
    _layout: PackedLayout | None = field(default=None, init=False, repr=False)

    def layout(self, device: torch.device) -> PackedLayout:
        """The row's :class:`~loraplane.models.packed.PackedLayout` (padding indices, cu_seqlens), once per batch."""
        if self._layout is None:
            self._layout = PackedLayout([end - start for start, end in self.bounds], device)
        return self._layout

    def rope_cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles in ``dtype`` (as megatron casts them), once per batch, not once per layer."""
        if dtype not in self._rope_cos_sin:
            cos, sin = torch.cos(self.rope_angles), torch.sin(self.rope_angles)
            if self.rope_scale != 1.0:  # in fp32 before the cast, as transformers scales them
                cos, sin = cos * self.rope_scale, sin * self.rope_scale
            self._rope_cos_sin[dtype] = (cos.to(dtype), sin.to(dtype))
        return self._rope_cos_sin[dtype]


def packed_rows(lengths: list[int], device: torch.device) -> PackedRows:
    """The :class:`PackedRows` of datums of these (non-zero) lengths laid back to back."""
    ends = list(itertools.accumulate(lengths))
    starts = [0, *ends[:-1]]
    cu = torch.tensor([0, *ends], dtype=torch.int32).to(device, non_blocking=True)
    longest = max(lengths)
    return PackedRows(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                      max_seqlen_kv=longest, bounds=tuple(zip(starts, ends)))


class SDPACoreAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` (same constructor and forward signature); causal within each datum of
    a packed row (``packed_seq_params`` is required)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **_ignored):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0.0:
            raise ValueError("SDPACoreAttention runs without attention dropout (LoRA fine-tuning uses none)")
        if getattr(config, "apply_query_key_layer_scaling", False):
            raise ValueError("SDPACoreAttention does not support apply_query_key_layer_scaling")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        # gpt-oss: this layer's sliding window (0: full attention) and a learned sink logit per local head.
        windows = getattr(config, "loraplane_windows", ())
        self.window = windows[layer_number - 1] if windows else 0
        self.sinks = None
        if getattr(config, "loraplane_sinks", False):
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.sinks = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype), requires_grad=False)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_ignored):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention: attention bias is not supported")
        if not isinstance(packed_seq_params, PackedRows):
            raise TypeError("SDPACoreAttention runs packed rows only (model.forward_logits builds them)")
        # [T, 1, heads, d] (or thd's [T, heads, d]) -> [T, heads, d]: views
        t = query.shape[0]
        q, k, v = (x.reshape(t, x.shape[-2], x.shape[-1]) for x in (query, key, value))
        if packed_seq_params.rope_angles is not None:
            cos, sin = packed_seq_params.rope_cos_sin(q.dtype)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.sinks is not None or self.window:
            fn = sink_window_sdpa if q.device.type == "cuda" else sink_window_eager
            out = fn(q, k, v, packed_seq_params.bounds, self.softmax_scale, self.sinks, self.window)
            return out.reshape(t, 1, -1)
        return packed_attention(q, k, v, packed_seq_params, self.softmax_scale).reshape(t, 1, -1)


def sink_window_eager(q, k, v, bounds, scale: float, sinks, window: int):
    """gpt-oss's attention, datum by datum, as transformers' eager ``eager_attention_forward`` computes it: causal
    (keys within ``window`` of the query when it is non-zero) scores, the head's sink logit as one more softmax
    column (no value) dropped after the softmax; ``q[T, heads, d]``, ``k, v[T, groups, d]`` -> ``[T, heads, d]``."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for start, end in bounds:
        n = end - start
        qi = q[start:end].transpose(0, 1)  # [heads, n, d]
        ki, vi = (x[start:end].transpose(0, 1).repeat_interleave(rep, dim=0) for x in (k, v))
        scores = torch.matmul(qi, ki.transpose(1, 2)) * scale
        pos = torch.arange(n, device=q.device)
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible = visible & (pos[None, :] > pos[:, None] - window)
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        if sinks is not None:
            scores = torch.cat([scores, sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
        if sinks is not None:
            probs = probs[..., :-1]
        outs.append(torch.matmul(probs.to(vi.dtype), vi).transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


def sink_window_sdpa(q, k, v, bounds, scale: float, sinks, window: int):
    """:func:`sink_window_eager` through ``scaled_dot_product_attention`` per datum (CUDA: the fused kernels keep
    the scores out of memory). The sink is a softmax column with no value: one extra key whose score is the sink
    and whose value is zero. It becomes a real key through one extra feature: every query has 1 there, the sink key
    ``sinks[h] / scale`` (the kernel multiplies q . k by scale), every real key 0. Head dims are padded to a multiple
    of 8 and the keys to a multiple of 16 with masked zero keys (the memory-efficient kernel's alignment; every
    query still sees the sink, so no row is fully masked). The torch backend computes it the same way
    (``loraplane.models.families.gpt_oss._batched_sink_attention``)."""
    if window:
        return _sink_window_banded(q, k, v, bounds, scale, sinks, window)
    heads, dim = q.shape[1], q.shape[2]
    rep = heads // k.shape[1]
    extra = 1 if sinks is not None else 0
    width = -(-(dim + extra) // 8) * 8
    outs = []
    for start, end in bounds:
        n = end - start
        qi = q[start:end].transpose(0, 1)[None]  # [1, heads, n, d]
        ki, vi = (x[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)[None] for x in (k, v))
        pos = torch.arange(n, device=q.device)
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible = visible & (pos[None, :] > pos[:, None] - window)
        tail = -(n + extra) % 16
        parts_q = [qi, qi.new_ones(1, heads, n, extra), qi.new_zeros(1, heads, n, width - dim - extra)]
        parts_k = [torch.cat([ki, ki.new_zeros(1, heads, n, width - dim)], dim=-1), ki.new_zeros(1, heads, tail, width)]
        parts_v = [vi, vi.new_zeros(1, heads, tail, dim)]
        cols = [visible, visible.new_zeros(n, tail)]
        if sinks is not None:
            sink_key = ki.new_zeros(1, heads, 1, width)
            sink_key[0, :, 0, dim] = sinks.to(ki.dtype) / scale
            parts_k.insert(0, sink_key)
            parts_v.insert(0, vi.new_zeros(1, heads, 1, dim))
            cols.insert(0, visible.new_ones(n, 1))
        out = F.scaled_dot_product_attention(torch.cat(parts_q, -1), torch.cat(parts_k, 2), torch.cat(parts_v, 2),
                                             attn_mask=torch.cat(cols, 1), scale=scale)
        outs.append(out[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


def _sink_window_banded(q, k, v, bounds, scale: float, sinks, window: int):
    """A sliding-window layer of :func:`sink_window_sdpa` in bands: a datum's queries in blocks of ``window``, each
    block against the ``2 * window`` keys that can reach it (the block's own and the ``window`` before it; the
    datum's keys zero-padded in front by ``window`` and at the end to whole blocks, then cut into overlapping
    windows). Every block of every datum is one batch entry of one masked SDPA call, with the same relative mask
    (key ``j`` visible to query ``i`` iff ``i < j <= i + window``) and the front padding of each datum's first
    block masked. A 2,048-token datum with gpt-oss's 128-token window attends 16 blocks x 256 keys instead of 2,048
    x 2,048 masked scores (the fused kernels cannot skip masked blocks). The sink (and the kernel's alignment) as in
    :func:`sink_window_sdpa`; padded queries see the sink or padded keys, so no row is fully masked."""
    heads, dim = q.shape[1], q.shape[2]
    groups = k.shape[1]
    block, span = window, 2 * window
    extra = 1 if sinks is not None else 0
    width = -(-(dim + extra) // 8) * 8
    qs, ks, vs, firsts, blocks = [], [], [], [], []
    for start, end in bounds:
        n = end - start
        count = -(-n // block)
        blocks.append((n, count))
        qs.append(F.pad(q[start:end], (0, 0, 0, 0, 0, count * block - n)).reshape(count, block, heads, dim))
        for x, out in ((k, ks), (v, vs)):
            padded = F.pad(x[start:end], (0, 0, 0, 0, window, count * block - n))  # [window + count*block, g, d]
            out.append(padded.unfold(0, span, block).permute(0, 3, 1, 2))  # [count, span, g, d]
        first = torch.zeros(count, dtype=torch.bool, device=q.device)
        first[0] = True
        firsts.append(first)
    qb = torch.cat(qs).transpose(1, 2)  # [N, heads, block, d]
    kb, vb = (torch.cat(x).transpose(1, 2).repeat_interleave(heads // groups, dim=1) for x in (ks, vs))
    total = qb.shape[0]
    i = torch.arange(block, device=q.device)[:, None]
    j = torch.arange(span, device=q.device)[None, :]
    visible = ((j > i) & (j <= i + window))[None, None]  # [1, 1, block, span]
    front = torch.cat(firsts)[:, None, None, None] & (j < window)[None, None]  # [N, 1, 1, span]
    mask = visible & ~front  # [N, 1, block, span]
    tail = -(span + extra) % 16
    parts_q = [qb, qb.new_ones(total, heads, block, extra), qb.new_zeros(total, heads, block, width - dim - extra)]
    parts_k = [torch.cat([kb, kb.new_zeros(total, heads, span, width - dim)], dim=-1),
               kb.new_zeros(total, heads, tail, width)]
    parts_v = [vb, vb.new_zeros(total, heads, tail, dim)]
    cols = [mask, mask.new_zeros(total, 1, block, tail)]
    if sinks is not None:
        sink_key = kb.new_zeros(1, heads, 1, width)
        sink_key[0, :, 0, dim] = sinks.to(kb.dtype) / scale
        parts_k.insert(0, sink_key.expand(total, -1, -1, -1))
        parts_v.insert(0, vb.new_zeros(total, heads, 1, dim))
        cols.insert(0, mask.new_ones(total, 1, block, 1))
    out = F.scaled_dot_product_attention(torch.cat(parts_q, -1), torch.cat(parts_k, 2), torch.cat(parts_v, 2),
                                         attn_mask=torch.cat(cols, -1), scale=scale)  # [N, heads, block, d]
    out = out.transpose(1, 2)  # [N, block, heads, d]
    pieces, at = [], 0
    for n, count in blocks:
        pieces.append(out[at:at + count].reshape(count * block, heads, dim)[:n])
        at += count
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` values of each head, the rest passed through (partial rotary, as
    transformers and megatron split it)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


def packed_attention(q, k, v, packed: PackedRows, scale: float) -> torch.Tensor:
    """Causal attention within each datum of a packed row: ``q[T, heads, d]``, ``k, v[T, groups, d]`` ->
    ``[T, heads, d]``."""
    out = _varlen(q, k, v, packed, scale)
    return _per_datum(q, k, v, packed.bounds, scale) if out is None else out


def _varlen(q, k, v, packed: PackedRows, scale: float):
    key = (q.device.type, q.dtype)
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16) or not _VARLEN_OK.get(key, True):
        return None
    call = _varlen_call()
    if call is None or (not call.scale and not math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]))):
        _VARLEN_OK[key] = False
        return None
    heads, groups = q.shape[1], k.shape[1]
    kwargs = dict(call.causal)
    if call.scale:
        kwargs["scale"] = scale
    if heads != groups:
        if call.gqa:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
    try:
        return call.fn(q, k, v, packed.cu_seqlens_q, packed.cu_seqlens_kv, packed.max_seqlen_q, packed.max_seqlen_kv,
                       **kwargs)
    except (RuntimeError, ValueError, TypeError):
        _VARLEN_OK[key] = False
        return None


def _per_datum(q, k, v, bounds, scale: float):
    outs = []
    for start, end in bounds:
        # [len, heads, d] -> [1, heads, len, d] (views; the kernels take strided inputs)
        qi, ki, vi = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        outs.append(_sdpa(qi, ki, vi, scale)[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


def _sdpa(q, k, v, scale: float):
    heads, groups = q.shape[1], k.shape[1]
    if heads == groups:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    dev = q.device.type
    if _GQA_FUSED_OK.get(dev, True):
        if dev != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            # Only the fused kernels: a silent fallback to the math kernel would bring the s^2 scores back.
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                              SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        except RuntimeError:
            _GQA_FUSED_OK[dev] = False
    rep = heads // groups
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                          is_causal=True, scale=scale)


@dataclass(frozen=True)
class _VarlenCall:
    fn: object
    causal: dict  # the keyword that makes it causal in this torch: is_causal=True or window_size=(-1, 0)
    scale: bool  # takes scale=
    gqa: bool  # takes enable_gqa=


@functools.cache
def _varlen_call() -> _VarlenCall | None:
    """How this torch's ``varlen_attn`` is called: 2.9/2.10 take ``is_causal`` and no scale or GQA; later releases
    take ``window_size=(-1, 0)`` for causal, ``scale`` and ``enable_gqa``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return _VarlenCall(varlen_attn, causal, "scale" in params, "enable_gqa" in params)
