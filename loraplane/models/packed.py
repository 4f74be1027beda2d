"""Packed-sequence attention: several datums laid end to end in one (1, N) row, each attending only to itself.

Why: on CPU neither GEMMs nor SDPA give bit-identical per-row results when the batch shape changes (MKL picks other
kernels for tiny M, and a longer padded key length changes SDPA's reduction order). Packing removes padding, so the
linear layers see the datum's tokens as rows of one (N, K) matrix, and attention runs per datum on exactly the
datum's own (1, H, T, D) tensors, whatever else shares the batch. Same HF model, same rotary (position_ids restart
at 0 for each datum), same SDPA call HF makes for an unpadded causal sequence.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PACKED_ATTENTION = "loraplane_packed"
_local = threading.local()
log = logging.getLogger(__name__)


def _packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    lengths = getattr(_local, "lengths", None)
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    runs = _runs(lengths)
    if len(runs) == 1 and runs[0][0] * runs[0][1] == query.shape[2]:
        # One run covers the whole pack: no slices (a full-range slice still costs a zero-filled gradient).
        length, count = runs[0]
        if count == 1:
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                          is_causal=True)
        out, _ = sdpa_attention_forward(module, _as_batch(query, count), _as_batch(key, count),
                                        _as_batch(value, count), None, dropout=dropout, scaling=scaling,
                                        is_causal=True)
        return out.reshape(1, length * count, *out.shape[2:]), None
    # One split per tensor, not a slice per run: a slice's backward zero-fills a gradient the size of the whole
    # pack, so R runs cost R full-size fills and adds (math_rl's 512 mixed-length datums: ~420 runs, 60% of the
    # fwd+bwd); a split's backward concatenates the pieces' gradients once. Same values, bit for bit.
    sizes = [length * count for length, count in runs]
    if sum(sizes) < query.shape[2]:
        sizes.append(query.shape[2] - sum(sizes))
    queries, keys, values = (torch.split(t, sizes, dim=2) for t in (query, key, value))
    outputs = []
    for (length, count), q, k, v in zip(runs, queries, keys, values):
        if count == 1:
            out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)
        else:
            # A run of equal-length datums attends as one (count, H, T, D) batch: each batch entry is computed
            # exactly as that datum alone (SDPA's CPU kernel works per (batch, head, query block); checked bit for
            # bit in tests/unit/test_lora.py), in one call instead of `count`.
            out, _ = sdpa_attention_forward(module, _as_batch(q, count), _as_batch(k, count), _as_batch(v, count),
                                            None, dropout=dropout, scaling=scaling, is_causal=True)
            out = out.reshape(1, length * count, *out.shape[2:])  # (count, T, H, D) -> (1, count*T, H, D)
        outputs.append(out)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(length, count) for each run of consecutive equal lengths."""
    runs: list[tuple[int, int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


def _as_batch(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """(1, H, count*T, D) -> (count, H, T, D), each datum its own batch entry."""
    _, heads, total, dim = tensor.shape
    return tensor.reshape(heads, count, total // count, dim).transpose(0, 1)


def _packed_mask(*args, **kwargs):
    if getattr(_local, "lengths", None) is not None:
        return None
    return sdpa_mask(*args, **kwargs)


ALL_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_mask)


def enable_packed_attention(model) -> None:
    """Switches this model instance to the packed-aware attention (plain SDPA when no packing is active)."""
    model.config._attn_implementation = PACKED_ATTENTION
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = PACKED_ATTENTION


@contextlib.contextmanager
def packed_sequences(lengths: Sequence[int]) -> Iterator[None]:
    """Within this scope, a forward of a (1, sum(lengths)) input treats each length as its own sequence."""
    previous = getattr(_local, "lengths", None), getattr(_local, "layouts", None)
    _local.lengths = [int(n) for n in lengths]
    _local.layouts = {}
    try:
        yield
    finally:
        _local.lengths, _local.layouts = previous


def packed_lengths() -> list[int] | None:
    """The datum lengths of the packed row being computed on this thread, or None outside packed_sequences."""
    return getattr(_local, "lengths", None)


def packed_position_ids(lengths: Sequence[int], device=None) -> torch.Tensor:
    return torch.cat([torch.arange(n, dtype=torch.long, device=device) for n in lengths]).unsqueeze(0)


# ------------------------------------------------------------------------------------------------ implementations
#
# How the families' per-datum pieces (Qwen3.5's Gated DeltaNet conv1d + delta rule, gpt-oss's sink attention,
# Nemotron-H's Mamba-2 conv1d + scan) run over a packed row:
#
# * EXACT: one datum at a time, on the datum's own tensors. On CPU this is what makes a fused batch bit-identical,
#   per tenant, to the tenant alone: the CPU kernels (oneDNN conv, MKL GEMMs of the chunked delta rule, vectorised
#   transcendental ops) pick their blocking and tail handling by tensor shape, so the same datum rounds differently
#   inside a larger batch. The CPU contract is bit-exactness, so the CPU always runs EXACT.
# * BATCHED: all datums of the row in one call, as a (datums, longest, ...) batch with each datum zero-padded at
#   its end. Every one of these operators is causal (the conv1d looks back only, the delta rule / scan carry state
#   forward only, attention is causally masked), so trailing padding never reaches a datum's real positions. The
#   CUDA contract is bf16 bounds (tests/gpu/test_packed_fast_paths.py), and one call instead of one per datum and
#   layer is what keeps the GPU busy.
# * FLA: fla's varlen Triton kernels over the packed row itself (cu_seqlens), no padding: Gated DeltaNet only, where
#   fla is importable and usable on this device (:func:`fla_unusable`).
#
# LORAPLANE_PACKED_IMPL (exact | batched | fla | auto, default auto) or :func:`packed_implementation` choose another
# (tests run BATCHED on CPU against EXACT; the benchmark pins one).

EXACT, BATCHED, FLA = "exact", "batched", "fla"
IMPLEMENTATIONS = (EXACT, BATCHED, FLA)
IMPL_ENV = "LORAPLANE_PACKED_IMPL"


@contextlib.contextmanager
def packed_implementation(name: str | None) -> Iterator[None]:
    """Within this scope (this thread), the packed pieces run as `name` (None: as chosen by device)."""
    if name is not None and name not in IMPLEMENTATIONS:
        raise ValueError(f"packed implementation {name!r}: one of {IMPLEMENTATIONS}")
    previous = getattr(_local, "impl", None)
    _local.impl = name
    try:
        yield
    finally:
        _local.impl = previous


def packed_impl(device: torch.device, fla: bool = False) -> str:
    """The implementation the packed pieces run with on `device`; `fla`: the caller has an fla path (a family
    without one runs BATCHED where FLA is asked for)."""
    choice = getattr(_local, "impl", None) or os.environ.get(IMPL_ENV, "").strip().lower() or "auto"
    if choice == "auto":
        if device.type != "cuda":
            return EXACT
        if not fla:
            return BATCHED
        reason = fla_unusable(device)
        if reason is not None:
            _warn_no_fla(str(device), reason)
            return BATCHED
        return FLA
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"{IMPL_ENV}={choice!r}: one of {IMPLEMENTATIONS} or auto")
    if choice == FLA:
        if not fla:
            return BATCHED
        reason = fla_unusable(device)
        if reason is not None:
            raise RuntimeError(f"{IMPL_ENV}=fla, but fla cannot run here: {reason}")
    return choice


@functools.cache
def _warn_no_fla(device: str, reason: str) -> None:
    """Once per device: a Gated DeltaNet model on CUDA without fla runs about half as fast (H200, Qwen3.5-9B: 4,282
    against 9,062 tok/s on the megatron backend, docs/benchmarks.md), so say why and what would fix it."""
    log.warning("packed rows on %s: fla cannot run (%s); Gated DeltaNet layers run the padded torch delta rule, about "
                "half as fast. Install fla-core 0.6 with Triton >= 3.7.1 (scripts/gpu/fla-wheels.txt) for its "
                "kernels.", device, reason)


@functools.cache
def fla_unusable(device: torch.device) -> str | None:
    """None when fla's Gated DeltaNet and causal conv1d kernels can run on `device`; else why not. fla-core 0.6
    imports under any Triton but its gated backward is wrong on Hopper with Triton >= 3.4, < 3.7.1 (it raises
    there unless tilelang is installed): that case is refused here, before a step."""
    if device.type != "cuda":
        return "not a CUDA device"
    try:
        import fla.utils as fla_utils
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable
        return f"fla is not importable ({type(exc).__name__}: {str(exc)[:200]})"
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    broken = (getattr(fla_utils, "TRITON_ABOVE_3_4_0", False)
              and not getattr(fla_utils, "TRITON_ABOVE_3_7_1", True))
    if hopper and broken:
        import importlib.util

        if importlib.util.find_spec("tilelang") is None:
            import triton

            return f"Triton {triton.__version__} on Hopper (fla needs >= 3.7.1 or tilelang for its gated backward)"
    log.info("packed rows: fla kernels usable on %s", device)
    return None


class PackedLayout:
    """Index helpers for one packed row's datums on one device, built once per packed scope and device."""

    def __init__(self, lengths: Sequence[int], device: torch.device):
        self.lengths = [int(n) for n in lengths]
        self.count = len(self.lengths)
        self.longest = max(self.lengths)
        self.equal = all(n == self.longest for n in self.lengths)
        self._device = device
        self._mask: torch.Tensor | None = None
        self._cu: tuple[torch.Tensor, torch.Tensor] | None = None

    def mask(self) -> torch.Tensor:
        """(datums, longest) bool: True at a datum's real positions."""
        if self._mask is None:
            lengths = torch.tensor(self.lengths, device=self._device)
            self._mask = torch.arange(self.longest, device=self._device)[None, :] < lengths[:, None]
        return self._mask

    def cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device int32, host int64) cumulative lengths [0, n0, n0+n1, ...], one object per scope (fla caches
        its chunk indices by the tensor)."""
        if self._cu is None:
            host = torch.tensor([0] + self.lengths, dtype=torch.long).cumsum(0)
            self._cu = (host.to(self._device, torch.int32), host)
        return self._cu

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) packed -> (datums, longest, ...), each datum zero-padded at its end."""
        if self.equal:
            return x.reshape(self.count, self.longest, *x.shape[2:])
        pieces = x[0].split(self.lengths)
        return torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """(datums, longest, ...) -> (1, N, ...), the real positions in packed order."""
        if self.equal:
            return y.reshape(1, self.count * self.longest, *y.shape[2:])
        return y[self.mask()].unsqueeze(0)


def fla_gated_delta_rule(layout: PackedLayout, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor,
                         conv_bias: torch.Tensor | None, activation: str, split: Callable, g: torch.Tensor,
                         beta: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's causal conv1d and chunked gated delta rule over a packed row by fla's varlen kernels, each
    restarting at the row's datum boundaries (cu_seqlens), no padding: ``mixed_qkv[1, N, conv]`` (the fused q|k|v
    projection), ``conv_weight[conv, kernel]``, ``split`` (the conv's output ``[1, N, conv]`` -> q, k ``[1, N,
    k_heads, dk]``, v ``[1, N, v_heads, dv]``), ``g`` (log decay, fp32) and ``beta`` ``[1, N, v_heads]`` ->
    ``[1, N, v_heads, dv]``. fla maps grouped value heads itself (value head i reads key head i // (v_heads /
    k_heads), the layout transformers' repeat_interleave gives), and normalizes q and k (transformers'
    ``use_qk_l2norm_in_kernel``). One implementation for both trainer backends."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu, cu_host = layout.cu_seqlens()
    x, _ = causal_conv1d(mixed_qkv.contiguous(), weight=conv_weight, bias=conv_bias, activation=activation,
                         cu_seqlens=cu, cu_seqlens_cpu=cu_host)
    query, key, value = split(x)
    out, _ = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_host)
    return out


def packed_layout(device: torch.device) -> PackedLayout | None:
    """The layout of the packed row being computed on this thread (None outside packed_sequences)."""
    lengths = getattr(_local, "lengths", None)
    if lengths is None:
        return None
    layouts = getattr(_local, "layouts", None)
    if layouts is None:
        layouts = _local.layouts = {}
    key = str(device)
    if key not in layouts:
        layouts[key] = PackedLayout(lengths, device)
    return layouts[key]


def packed_state() -> Callable[[], contextlib.AbstractContextManager]:
    """What this thread's packed scope is (lengths, implementation), as a context-manager factory that puts it in
    force on another thread: activation recomputation reruns a layer's forward inside the backward, on autograd's
    thread, after the scope has exited."""
    lengths = getattr(_local, "lengths", None)
    impl = getattr(_local, "impl", None)

    @contextlib.contextmanager
    def restore() -> Iterator[None]:
        with packed_implementation(impl):
            if lengths is None:
                yield
            else:
                with packed_sequences(lengths):
                    yield

    return restore
