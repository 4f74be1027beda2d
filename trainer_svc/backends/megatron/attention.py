"""Core attention for the megatron backend's layer spec: causal attention through ``torch.nn.functional.
scaled_dot_product_attention`` (flash / memory-efficient kernels on CUDA), in place of megatron's unfused
``DotProductAttention``, which materializes the ``[b, heads, s, s]`` score matrix (and an fp32 copy for the softmax)
and keeps it for the backward: 8.6 GB per layer for an 8B model at 16 x 2048 tokens.

The fused kernels keep the softmax statistics in fp32 in registers and recompute the scores in the backward, so
nothing of size ``s^2`` is stored. GQA runs without expanding K/V where the kernel supports it (``enable_gqa``).

The mask: the trainer's batches are causal LM batches (right-padded rows; padding comes after a datum's tokens, so
causal attention keeps it from touching real positions), and this module always applies the causal mask. The
``attention_mask`` megatron hands down is the explicit causal one and is not read.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

_GQA_FUSED_OK: dict[str, bool] = {}  # per device type: did a fused kernel accept enable_gqa


class SDPACoreAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` (same constructor and forward signature); causal only."""

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
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_ignored):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention: packed sequences and attention bias are not supported")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d] (views; the kernels take strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)
        # [b, heads, s, d] -> [s, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _sdpa(self, q, k, v):
        if self.heads == self.groups:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        dev = q.device.type
        if _GQA_FUSED_OK.get(dev, True):
            if dev != "cuda":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                      enable_gqa=True)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            try:
                # Only the fused kernels: a silent fallback to the math kernel would bring the s^2 scores back.
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                  SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                          enable_gqa=True)
            except RuntimeError:
                _GQA_FUSED_OK[dev] = False
        rep = self.heads // self.groups
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                              is_causal=True, scale=self.softmax_scale)
