"""The megatron LoRA hooks' grouped GEMM (``torch._grouped_mm`` over each adapter's row range of a packed batch)
against the 0/1-mask path and against PEFT autograd on each adapter's rows alone, in fp32 on CPU (torch's CPU
``_grouped_mm`` takes fp32; float64, which the other hook tests use, has no grouped kernel and takes the mask).

The mask path is forced by making the probe answer no (``grouped_mm_supported``): that is exactly what happens on a
device or dtype without a grouped kernel, so both paths run the same hook code from the same routing inputs."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_megatron_layout import SHAPE
from trainer_svc.backends.megatron import lora as lora_mod
from trainer_svc.backends.megatron.layout import projection_delta
from trainer_svc.backends.megatron.lora import (
    HOOK_TARGETS,
    AdapterTensors,
    MegatronLora,
    RowSegment,
    _HookAddInPlace,
    _HookDelta,
    a_class_name,
    b_class_name,
)

RANK = 4  # a multiple of 16 bytes of fp32, as the grouped kernel's strides need
SCALES = (0.5, 2.0, 1.25)
# Three adapters with different token counts, then a tail of rows that no adapter owns.
SEGMENTS = ((0, 5), (5, 13), (13, 20))
ROWS = 23


def _adapter(lora, rank, scale, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params, grads = {}, {}
    for c in lora.classes:
        shape = (SHAPE.num_layers, len(c.targets), rank, c.dim)
        # O(1) deltas, so that fp32's summation-order differences stay at a few ulps of 1
        params[c.name] = (0.3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
        grads[c.name] = torch.zeros(*shape, dtype=dtype)
    return AdapterTensors(params, grads, rank, scale)


def _run(hook, grouped, kind, monkeypatch):
    """(output, input grad, base-output grad, per-adapter grads) of one hook on the mixed packed batch."""
    lora = MegatronLora(None, SHAPE, torch.float32, tensor_parallel=(1, None))
    adapters = [_adapter(lora, RANK, s, i + 1) for i, s in enumerate(SCALES)]
    segments = [RowSegment(a, b, ad) for (a, b), ad in zip(SEGMENTS, adapters)] + [RowSegment(20, ROWS, None)]
    targets = HOOK_TARGETS[hook]
    width = SHAPE.in_features(targets[0])
    out_width = sum(SHAPE.out_features(t) for t in targets)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, 1, width, generator=g).requires_grad_(True)
    base = torch.randn(ROWS, 1, out_width, generator=g).requires_grad_(True)
    weight = torch.randn(ROWS, 1, out_width, generator=g)
    with monkeypatch.context() as m:
        if not grouped:
            m.setattr(lora_mod, "grouped_mm_supported", lambda device, dtype: False)
        with lora.route(segments, ROWS) as routing:
            out = base * 1.0
            if kind == "inplace":
                y = _HookAddInPlace.apply(x, out, routing.anchor, (routing, 1, hook))
            else:
                y = out + _HookDelta.apply(x, routing.anchor, (routing, 1, hook))
        assert routing.grouped is grouped
    (y * weight).sum().backward()
    routing.accumulate_grads()
    return y.detach(), x.grad, base.grad, [a.grads for a in adapters], (x, base, weight, adapters)


def _reference(hook, inputs):
    """PEFT autograd in float64, each adapter on its own rows alone."""
    x, base, weight, adapters = inputs
    lora = MegatronLora(None, SHAPE, torch.float64, tensor_parallel=(1, None))
    targets = HOOK_TARGETS[hook]
    x_ref = x.detach().double().requires_grad_(True)
    y = base.detach().double().clone()
    leaves = []
    for (start, end), ad in zip(SEGMENTS, adapters):
        a = ad.params[a_class_name(hook)][1].double().requires_grad_(True)
        bts = [ad.params[b_class_name(t)][1, 0].double().requires_grad_(True) for t in targets]
        deltas = [projection_delta(x_ref[start:end], a[i], bt.t(), ad.scale) for i, bt in enumerate(bts)]
        y[start:end] = y[start:end] + lora.place(hook, deltas)
        leaves.append((a, bts))
    (y * weight.double()).sum().backward()
    grads = [{a_class_name(hook): a.grad, **{b_class_name(t): bt.grad for t, bt in zip(targets, bts)}}
             for a, bts in leaves]
    return y.detach(), x_ref.grad, grads


@pytest.mark.parametrize("hook", ["qkv", "o_proj", "fc1", "down_proj"])
@pytest.mark.parametrize("kind", ["inplace", "delta"])
def test_grouped_gemm_equals_the_mask_path_and_peft(hook, kind, monkeypatch):
    assert lora_mod.grouped_mm_supported(torch.device("cpu"), torch.float32)
    got = _run(hook, True, kind, monkeypatch)
    masked = _run(hook, False, kind, monkeypatch)
    # The two paths sum the same products in different orders (the mask path also adds exact zeros): fp32 rounding.
    for a, b in zip(got[:3], masked[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for grads_got, grads_masked in zip(got[3], masked[3]):
        for name in grads_masked:
            torch.testing.assert_close(grads_got[name], grads_masked[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], got[4][2])  # the base output's gradient passes through

    want_y, want_gx, want_grads = _reference(hook, got[4])
    torch.testing.assert_close(got[0], want_y.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want_gx.float(), rtol=1e-5, atol=1e-5)
    assert float(got[1][20:].abs().max()) == 0.0  # the unowned tail rows get no LoRA gradient
    targets = HOOK_TARGETS[hook]
    touched = {a_class_name(hook), *(b_class_name(t) for t in targets)}
    for grads, want in zip(got[3], want_grads):
        for name in touched:
            mine = grads[name][1] if name.endswith(".A") else grads[name][1, 0]
            torch.testing.assert_close(mine, want[name].float(), rtol=1e-5, atol=1e-5)
        assert float(grads[a_class_name(hook)][0].abs().sum()) == 0.0  # layer 0 untouched
        assert all(float(v.abs().sum()) == 0.0 for k, v in grads.items() if k not in touched)


def test_grouped_path_is_taken_only_where_it_applies():
    cpu = torch.device("cpu")
    assert lora_mod.grouped_mm_supported(cpu, torch.float32) is True
    assert lora_mod.grouped_mm_supported(cpu, torch.float64) is False  # no float64 grouped kernel
    lora = MegatronLora(None, SHAPE, torch.float32, tensor_parallel=(1, None))
    a, b, c = (_adapter(lora, RANK, 1.0, i) for i in range(3))
    odd = _adapter(lora, 8, 1.0, 9)

    def grouped(segments, rows, lora=lora):
        with lora.route(segments, rows) as routing:
            return routing.grouped

    assert grouped([RowSegment(0, 4, a), RowSegment(4, 9, b), RowSegment(9, 12, c)], 12)
    assert grouped([RowSegment(0, 4, a), RowSegment(4, 9, b), RowSegment(9, 12, None)], 14)  # unowned tail
    assert not grouped([RowSegment(0, 12, a)], 12)  # one adapter: its own tensors, scalar scale
    assert not grouped([RowSegment(0, 4, a), RowSegment(4, 9, odd)], 9)  # ranks differ
    assert not grouped([RowSegment(0, 4, a), RowSegment(4, 6, None), RowSegment(6, 9, b)], 9)  # a gap
    assert not grouped([RowSegment(2, 4, a), RowSegment(4, 9, b)], 9)  # does not start at row 0
    lora64 = MegatronLora(None, SHAPE, torch.float64, tensor_parallel=(1, None))
    d, e = (_adapter(lora64, RANK, 1.0, i, torch.float64) for i in range(2))
    assert not grouped([RowSegment(0, 4, d), RowSegment(4, 9, e)], 9, lora64)
    # Unaligned for fp32 (rank 2: 8-byte column blocks): the mask path.
    f, h = (_adapter(lora, 2, 1.0, i) for i in range(2))
    assert not grouped([RowSegment(0, 4, f), RowSegment(4, 9, h)], 9)
