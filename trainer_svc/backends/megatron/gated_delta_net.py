"""Qwen3.5's Gated DeltaNet linear-attention layer as a megatron module (the token mixer of a decoder layer, where
megatron's layer spec puts ``self_attention``), computing what transformers' ``Qwen3_5GatedDeltaNet`` computes.

Why our own: megatron-core 0.16's ``ssm/gated_delta_net.py`` needs the ``fla`` and ``causal_conv1d`` kernels
unconditionally, which the GPU image does not ship (and fla refuses its Triton), and it has no per-datum path for
the CPU's bit-exact contract. Here the projections are megatron's tensor-parallel linears (so the LoRA hooks of
:mod:`.lora` attach to them as to attention's); the conv1d and the chunked gated delta rule are plain torch, or
fla's varlen Triton kernels where fla can run (the same call the torch backend makes,
:func:`loraplane.models.packed.fla_gated_delta_rule`).

Tensor parallel: by heads. A rank holds its chunk of the q/k heads and of the value heads they serve (each q/k head
serves ``num_v_heads / num_k_heads`` consecutive value heads, so contiguous chunks agree): ``in_proj_qkv`` is a
column-parallel linear whose rows on a rank are that rank's ``Q | K | V`` (:func:`.layout.hf_linear_attention_to_mcore`),
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` column-parallel over the value heads, the conv1d channels, ``A_log``
and ``dt_bias`` likewise, ``out_proj`` row-parallel (its all-reduce sums the heads). The recurrence never crosses
heads, so no other communication is needed.

Packed rows (:class:`.attention.PackedRows`), each datum from a zero state, three ways as
:mod:`loraplane.models.packed` chooses them (``LORAPLANE_PACKED_IMPL``): EXACT (the CPU) runs the conv1d, the delta
rule and the gated norm per datum on contiguous tensors of the datum's own, so a datum's values are computed the same
way whatever else shares its row (a tenant's logits alone equal its logits fused with others', bit for bit); on CUDA
the whole row goes in one call per layer, FLA over the row itself (cu_seqlens), else BATCHED as a zero-padded
(datums, longest) batch (every piece is causal, so padding at a datum's end never reaches its real positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from loraplane.models import packed

from .layout import LinearAttentionShape

CHUNK = 64  # the delta rule's chunk length (transformers' default)


class GatedDeltaNet(MegatronModule):
    """Drop-in for the ``self_attention`` of a megatron ``TransformerLayer``: ``forward(x[T, 1, h], ...,
    packed_seq_params)`` → ``(out[T, 1, h], None)``."""

    def __init__(self, config, layer_number: int, linear: LinearAttentionShape, eps: float, **_ignored):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__(config=config)
        self.layer_number = layer_number
        tp = config.tensor_model_parallel_size
        self.shape = linear
        self.eps = eps
        self.num_k_heads = linear.num_k_heads // tp
        self.num_v_heads = linear.num_v_heads // tp
        self.key_dim = self.num_k_heads * linear.head_k_dim
        self.value_dim = self.num_v_heads * linear.head_v_dim
        h = config.hidden_size
        dtype = config.params_dtype

        def column(out_features: int):
            return ColumnParallelLinear(h, out_features, config=config, init_method=config.init_method,
                                        gather_output=False, bias=False, skip_bias_add=False, is_expert=False)

        self.in_proj_qkv = column(2 * linear.key_dim + linear.value_dim)
        self.in_proj_z = column(linear.value_dim)
        self.in_proj_b = column(linear.num_v_heads)
        self.in_proj_a = column(linear.num_v_heads)
        self.out_proj = RowParallelLinear(linear.value_dim, h, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, is_expert=False)
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d_weight = torch.nn.Parameter(torch.empty(conv_dim, 1, linear.conv_kernel, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype))
        self.norm_weight = torch.nn.Parameter(torch.empty(linear.head_v_dim, dtype=dtype))

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **_ignored):
        bounds = getattr(packed_seq_params, "bounds", None)
        if not bounds:
            raise TypeError("GatedDeltaNet runs packed rows only (model.forward_logits builds them)")
        if bounds[-1][1] != hidden_states.shape[0]:
            raise ValueError(f"packed bounds cover {bounds[-1][1]} tokens, the row has {hidden_states.shape[0]}")
        mixed, _ = self.in_proj_qkv(hidden_states)  # [T, 1, conv]
        z, _ = self.in_proj_z(hidden_states)
        b, _ = self.in_proj_b(hidden_states)
        a, _ = self.in_proj_a(hidden_states)
        mixed, z, b, a = (t.reshape(t.shape[0], t.shape[-1]) for t in (mixed, z, b, a))
        impl = packed.packed_impl(hidden_states.device, fla=True)
        if impl == packed.EXACT:
            outs = [self._datum(mixed[s:e], z[s:e], b[s:e], a[s:e]) for s, e in bounds]
            core = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        else:
            layout = packed_seq_params.layout(hidden_states.device)
            run = self._fla_row if impl == packed.FLA else self._batched_row
            out = run(layout, mixed.unsqueeze(0), b.unsqueeze(0), a.unsqueeze(0))  # [1, T, v_heads, head_v]
            head_v = self.shape.head_v_dim
            core = gated_rms_norm(out.reshape(-1, head_v), z.reshape(-1, head_v), self.norm_weight,
                                  self.eps).reshape(hidden_states.shape[0], -1)
        out, bias = self.out_proj(core.unsqueeze(1))
        return out, bias

    def _gate_beta(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decay (log space, fp32) and beta, as transformers computes them."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return g, b.sigmoid()

    def _split(self, x: torch.Tensor):
        """``x[batch, n, conv]`` after the conv -> q, k ``[batch, n, k_heads, dk]`` and v ``[batch, n, v_heads,
        dv]``."""
        batch, n, _ = x.shape
        q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lin = self.shape
        return (q.reshape(batch, n, self.num_k_heads, lin.head_k_dim),
                k.reshape(batch, n, self.num_k_heads, lin.head_k_dim),
                v.reshape(batch, n, self.num_v_heads, lin.head_v_dim))

    def _fla_row(self, layout: packed.PackedLayout, mixed, b, a) -> torch.Tensor:
        g, beta = self._gate_beta(b, a)
        return packed.fla_gated_delta_rule(layout, mixed, self.conv1d_weight.squeeze(1), None, "silu", self._split,
                                           g, beta)

    def _batched_row(self, layout: packed.PackedLayout, mixed, b, a) -> torch.Tensor:
        x = layout.pad(mixed).transpose(1, 2)  # [datums, conv, longest]
        weight = self.conv1d_weight
        n = x.shape[-1]
        x = F.conv1d(x.to(weight.dtype), weight, None, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :n]
        q, k, v = self._split(F.silu(x).to(mixed.dtype).transpose(1, 2))
        g, beta = self._gate_beta(layout.pad(b), layout.pad(a))
        return layout.unpad(chunk_gated_delta_rule(q, k, v, g, beta))

    def _datum(self, mixed, z, b, a) -> torch.Tensor:
        """One datum of ``n`` tokens: ``mixed[n, conv]``, ``z[n, value]``, ``b, a[n, v_heads]`` → ``[n, value]``
        (before out_proj), as transformers' forward computes it without a cache."""
        n = mixed.shape[0]
        head_v = self.shape.head_v_dim
        weight = self.conv1d_weight
        x = mixed.t().unsqueeze(0).contiguous()  # [1, conv, n]
        x = F.conv1d(x.to(weight.dtype), weight, None, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :n]
        q, k, v = self._split(F.silu(x).to(mixed.dtype).transpose(1, 2))
        g, beta = self._gate_beta(b.contiguous().unsqueeze(0), a.contiguous().unsqueeze(0))
        out = chunk_gated_delta_rule(q, k, v, g, beta)  # [1, n, v_heads, head_v]
        return gated_rms_norm(out.reshape(-1, head_v), z.reshape(-1, head_v).contiguous(),
                              self.norm_weight, self.eps).reshape(n, -1)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` over the last dim (transformers' ``Qwen3_5RMSNormGated``: normalized
    in fp32, scaled in the input's dtype, gated in fp32)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule from a zero state, in chunks of ``chunk`` tokens (the math of transformers'
    ``torch_chunk_gated_delta_rule`` with ``use_qk_l2norm_in_kernel``, in fp32, differentiable).

    ``q, k[b, n, k_heads, dk]``, ``v[b, n, v_heads, dv]``, ``g`` (log decay, <= 0) and ``beta[b, n, v_heads]`` →
    ``[b, n, v_heads, dv]`` in q's dtype. Each q/k head serves ``v_heads / k_heads`` consecutive value heads."""
    dtype = q.dtype
    n = q.shape[1]
    heads = v.shape[2]
    if q.shape[2] != heads:
        q = q.repeat_interleave(heads // q.shape[2], dim=2)
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(t.shape[0], t.shape[1], -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    b_, h_, dk, dv = q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]
    state = torch.zeros(b_, h_, dk, dv, dtype=values.dtype, device=values.device)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(q.shape[2]):
        v_new = values[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(b_, h_, -1, dv)[:, :, :n]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
