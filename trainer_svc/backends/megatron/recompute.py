"""Activation recomputation for the megatron backend: as many decoder layers as the batch needs, chosen by memory.

A recomputed layer keeps only its input for the backward (``torch.utils.checkpoint``, non-reentrant) and runs its
forward again when the backward reaches it. The LoRA hooks add deltas from the routing that is in force on the
running thread; the recomputation runs inside the backward (on autograd's thread, after the batch's routing
context has exited), so the routing of the original forward is captured and put back in force around it
(``context_fn``). Each adapter therefore gets exactly the gradient it gets without recomputation.

Why whole layers and not megatron's "selective" (core-attention) recomputation: with the fused attention of
:mod:`.attention` nothing of size s^2 is stored any more (the kernel already recomputes the scores in its backward),
so what remains per token and layer is the projections' and the MLP's activations (about ``6h + 2kv + 4ffn``
values; ``3ffn`` with the fused SwiGLU); only whole-layer recomputation removes those. ``plan()`` picks the smallest
number of layers to recompute (the first ``k``, like megatron's ``block`` method) so that the estimate fits the free
device memory, so a batch that fits runs without any recomputation.

``selective`` (MoE models): every layer's attention half is recomputed and its MLP half kept. An MoE layer's experts
(:class:`.moe._ExpertMLP`) keep only fc1's output and the LoRA mids (about ``k·2F`` values per token) and would
otherwise rerun the dispatch, both grouped GEMMs and the expert LoRA in the recomputation; the attention half is
the cheaper one to run twice.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils.checkpoint import checkpoint

from loraplane.models import packed

from .layout import LlamaShape

MODES = ("auto", "none", "full", "selective")


def linear_attention_values_per_token(shape: LlamaShape, tp: int, dtype_bytes: int, fla: bool) -> int:
    """What one token costs a Gated DeltaNet layer's mixer for the backward (:mod:`.gated_delta_net`), in units of
    ``dtype_bytes``. Both ways keep the norm's input and output, the in_proj outputs (q|k|v, z, b, a), the conv's
    output, and the gated norm's fp32 intermediates and the out_proj input over the value heads. fla's chunked
    kernel then keeps q, k, v, g, beta and its fp32 chunk-local (64 x 64 per value head) matrix, and recomputes the
    rest in its backward; the torch delta rule (BATCHED, and EXACT per datum) keeps fp32 copies of everything it
    computes: the normalized q / k / v, the per-value-head expansions, four fp32 chunk matrices and the state
    entering each chunk. (On Qwen3.5-9B at 8 x 2048 tokens the torch delta rule alone took the H200 out of memory
    with no layer recomputed.)"""
    lin = shape.linear
    conv = (2 * lin.key_dim + lin.value_dim) // tp
    value = lin.value_dim // tp
    heads = lin.num_v_heads // tp
    fp32 = 4 / dtype_bytes  # an fp32 value in units of dtype_bytes
    common = 4 * shape.hidden_size + 3 * conv + 2 * value + 2 * heads + int((2 + 3 * fp32) * value)
    if fla:
        return common + int(heads * 64 * fp32)
    head_dim = max(lin.head_k_dim, lin.head_v_dim)
    torch_rule = (4 * conv + 6 * heads * head_dim + 4 * 64 * heads
                  + 2 * heads * lin.head_k_dim * lin.head_v_dim // 64)
    return common + int(torch_rule * fp32)


def layer_bytes_per_token(shape: LlamaShape, tp: int, dtype_bytes: int, mlp_ffn_kept: int, top_k: int = 0,
                          ep: int = 1, virtual_experts: int = 0, fla: bool = False) -> tuple[int, int]:
    """Bytes one token costs a layer for the backward: (kept without recomputation, kept by a recomputed layer: its
    input), for the costliest layer. ``mlp_ffn_kept``: a dense MLP's kept values in units of its ffn size (3 with
    the fused SwiGLU, else 4); ``virtual_experts``: the dispatcher's experts (experts x adapter slots,
    :class:`.moe.SlotRouter`), under EP; ``fla``: Gated DeltaNet layers run fla's kernels (else the torch delta
    rule's fp32 intermediates count)."""
    s = shape
    kv = s.num_kv_heads * s.head_dim // tp
    q = s.num_heads * s.head_dim // tp
    attention = 4 * s.hidden_size + 2 * q + 2 * kv
    if s.linear_layers:
        attention = max(attention, linear_attention_values_per_token(s, tp, dtype_bytes, fla))
    per_token = attention + mlp_ffn_kept * s.ffn_hidden_size // tp if s.dense_layers else 0
    if s.moe_layers:
        # An MoE layer (the largest layer counts). Without EP (.moe.GroupedExperts.local_forward) its experts keep
        # the token rows (h), and per each of a token's k expert rows the fc1 output (2F) and two LoRA mids (2r,
        # r <= 64 assumed); the router its fp32 logits and softmax over the experts. Under EP megatron's dispatcher
        # also keeps each row's dispatched input (h) and fp32 maps over the virtual experts (experts x adapter
        # slots, .moe.SlotRouter).
        k, ffn = top_k, s.moe_ffn_hidden_size
        if ep > 1:
            moe = s.hidden_size + k * (s.hidden_size + 2 * ffn + 128) + 8 * virtual_experts // dtype_bytes
        else:
            moe = s.hidden_size + k * (2 * ffn + 128) + 8 * s.num_experts // dtype_bytes
        per_token = max(per_token, attention + moe)
    return per_token * dtype_bytes, s.hidden_size * dtype_bytes


class LayerRecompute:
    def __init__(self, model, lora, shape: LlamaShape, tp: int, dtype: torch.dtype, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"recompute {mode!r}: one of {MODES}")
        self.mode = mode
        self.lora = lora
        self.shape = shape
        self.tp = tp
        self.bytes = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
        self.layers = list(model.decoder.layers)
        # MLP activations kept per token, in units of ffn: the fc1 output (2), and unfused also silu(a) and the
        # (b + 0) copy that silu(a) * b keeps, against the fused SwiGLU's one saved input (.fusion).
        self.mlp_ffn_kept = 3 if getattr(model.config, "bias_activation_fusion", False) else 4
        self.model_config = model.config
        self.count = 0  # layers [0, count) are recomputed in the next forward
        for i, layer in enumerate(self.layers):
            if mode == "selective":
                # Only the attention half of every layer (its norm, projections, attention): its activations are
                # recomputed, the MLP's / experts' kept (an MoE layer's experts keep fc1's output and the LoRA mids;
                # recomputing them would rerun the grouped GEMMs, dispatch and LoRA).
                layer._forward_attention = self._wrap(i, layer._forward_attention)
            else:
                layer.forward = self._wrap(i, layer.forward)

    def _wrap(self, index: int, forward):
        def run(*args, **kwargs):
            if index >= self.count or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            routing = self.lora.current()

            def contexts():
                return contextlib.nullcontext(), self.lora.using(routing)

            return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=False,
                              **kwargs)

        return run

    # -- the plan ---------------------------------------------------------------------------------------------------

    def layer_bytes(self, tokens: int, device: torch.device) -> tuple[int, int]:
        """(kept for the backward by one layer without recomputation, by one recomputed layer) for ``tokens``."""
        config = self.model_config
        fla = bool(self.shape.linear_layers) and packed.packed_impl(device, fla=True) == packed.FLA
        full, kept = layer_bytes_per_token(
            self.shape, self.tp, self.bytes, self.mlp_ffn_kept, getattr(config, "moe_router_topk", 0) or 0,
            getattr(config, "expert_model_parallel_size", 1) or 1, getattr(config, "num_moe_experts", 0) or 0,
            fla=fla)
        return tokens * full, tokens * kept

    def plan(self, tokens: int, backward: bool, device: torch.device) -> int:
        """Sets (and returns) how many layers the next forward recomputes."""
        n = len(self.layers)
        if not backward or self.mode == "none":
            self.count = 0
        elif self.mode in ("full", "selective"):
            self.count = n
        elif device.type != "cuda":
            self.count = 0
        else:
            budget = self._budget(tokens, device)
            full, kept = self._layer_cost(tokens, device)
            need = n * full + full  # every layer's activations + one layer's working set
            if need <= budget:
                self.count = 0
            else:
                self.count = min(n, math.ceil((need - budget) / max(1, full - kept)))
        return self.count

    def _free(self, device: torch.device) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device)
        # What the allocator holds but does not use is free to this batch too.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free, total

    def _logits_bytes(self, tokens: int) -> int:
        # Logits, their transposed copy and their gradient.
        return 3 * tokens * (self.shape.vocab_size // self.tp) * self.bytes

    def _budget(self, tokens: int, device: torch.device) -> float:
        """Device bytes the layers' activations may take: what is free, less the logits and a safety share of the
        device for the rest (the fp32 LoRA sinks, allocator fragmentation, kernel workspaces)."""
        free, total = self._free(device)
        return free - self._logits_bytes(tokens) - 0.06 * total

    def _layer_cost(self, tokens: int, device: torch.device) -> tuple[int, int]:
        full, kept = self.layer_bytes(tokens, device)
        return int(full * 1.25), kept

    def max_tokens_without_recompute(self, backward: bool, device: torch.device) -> int:
        """The most tokens per rank a backward pass can hold without recomputing a layer (0: no limit applies:
        no backward, not CUDA, or recompute is not ``auto``)."""
        if not backward or self.mode != "auto" or device.type != "cuda":
            return 0
        n = len(self.layers)
        free, total = self._free(device)
        per_token = (n + 1) * self._layer_cost(1, device)[0] + self._logits_bytes(1)
        return max(1, int((free - 0.06 * total) // per_token))
