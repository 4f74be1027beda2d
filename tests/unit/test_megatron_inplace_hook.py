"""The hooks' in-place LoRA add (``_HookAddInPlace``: ``addmm_`` into each projection's columns of the base output)
against ``out + _HookDelta`` (whose math test_megatron_layout checks against PEFT): same output, same input and
base-output gradients, same A/B gradients, for every hook kind, one adapter and a mixed batch with an unrouted
range."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_megatron_layout import SHAPE, _random_adapter


def _run(fn_kind, hook, segments_of, x0, out0, weight):
    from trainer_svc.backends.megatron.lora import MegatronLora, _HookAddInPlace, _HookDelta

    lora = MegatronLora(None, SHAPE, torch.float64, tensor_parallel=(1, None))
    adapters = [_random_adapter(lora, 2, 0.5, 1), _random_adapter(lora, 3, 2.0, 2)]
    segments = segments_of(adapters)
    x = x0.clone().requires_grad_(True)
    base = out0.clone().requires_grad_(True)
    out = base * 1.0  # a non-leaf, like a linear layer's output
    with lora.route(segments, x.shape[0]) as routing:
        if fn_kind == "inplace":
            y = _HookAddInPlace.apply(x, out, routing.anchor, (routing, 1, hook))
        else:
            y = out + _HookDelta.apply(x, routing.anchor, (routing, 1, hook))
    (y * weight).sum().backward()
    routing.accumulate_grads()
    return y.detach(), x.grad, base.grad, [dict(a.grads) for a in adapters]


@pytest.mark.parametrize("hook", ["qkv", "o_proj", "fc1", "down_proj"])
@pytest.mark.parametrize("mixed", [False, True])
def test_in_place_add_equals_out_plus_delta(hook, mixed):
    from trainer_svc.backends.megatron.lora import HOOK_TARGETS, RowSegment

    def segments_of(adapters):
        if not mixed:
            return [RowSegment(0, 20, adapters[0])]
        return [RowSegment(0, 8, adapters[0]), RowSegment(8, 12, None), RowSegment(12, 20, adapters[1])]

    targets = HOOK_TARGETS[hook]
    width = SHAPE.in_features(targets[0])
    out_width = sum(SHAPE.out_features(t) for t in targets)
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(20, 1, width, generator=g, dtype=torch.float64)  # a packed row [T, 1, in]
    out0 = torch.randn(20, 1, out_width, generator=g, dtype=torch.float64)
    weight = torch.randn(20, 1, out_width, generator=g, dtype=torch.float64)
    got = _run("inplace", hook, segments_of, x0, out0, weight)
    want = _run("delta", hook, segments_of, x0, out0, weight)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b)
    assert float((got[0] - out0).abs().max()) > 0  # the adapters changed the output
    for grads_got, grads_want in zip(got[3], want[3]):
        for name in grads_want:
            torch.testing.assert_close(grads_got[name], grads_want[name])
