"""The megatron backend's target-logprob function (chunked fp32 math, no full fp32 copy of the logits) against
``log_softmax(...).gather`` in float64: values and gradients, in many chunks, for [b, s, V] and [T, V] inputs."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.backends.megatron import model


@pytest.mark.parametrize("shape", [(3, 7, 50), (5, 50), (2, 1, 17)])
def test_target_logprob_matches_log_softmax(monkeypatch, shape):
    monkeypatch.setattr(model, "LOGPROB_CHUNK_ELEMENTS", 120)  # several chunks, a ragged last one
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, dtype=torch.float64, generator=g).mul_(3).requires_grad_(True)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    weights = torch.randn(shape[:-1], dtype=torch.float64, generator=g)
    ref = torch.log_softmax(x, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()

    xf = x.detach().float().requires_grad_(True)
    out = model._TargetLogprob.apply(xf, targets)
    (out * weights.float()).sum().backward()
    assert out.dtype == torch.float32 and out.shape == targets.shape
    assert torch.allclose(out.double(), ref, atol=2e-6)
    assert torch.allclose(xf.grad.double(), x.grad, atol=2e-7)


def test_fused_gradient_formula_equals_the_scatter_one():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 33, generator=g)
    lse = torch.logsumexp(x, -1)
    grad_out = torch.randn(4, 6, generator=g)
    targets = torch.randint(0, 33, (4, 6), generator=g)
    assert torch.equal(model._logprob_grad_fused(x, lse, grad_out, targets),
                       model._logprob_grad_eager(x, lse, grad_out, targets))


@pytest.mark.parametrize("batch", [1, 3], ids=["packed-row", "three-rows"])
def test_logit_gradient_reaches_the_output_layer_with_standard_strides(batch):
    """megatron hands over its [s, b, V] output as the [b, s, V] transpose. The gradient must come back to that
    [s, b, V] output with plain contiguous strides, even for b = 1 where the size-1 dimension's stride means
    nothing to the values: on an H100 a [T, 1, V] gradient with a T * V stride there made the output layer's matmul
    a batched GEMM of T single rows (1.2 s of a 1.3 s Llama-1B step)."""
    s, vocab = 6, 11
    output = torch.randn(s, batch, vocab, requires_grad=True)  # the output layer's result, [s, b, V]
    targets = torch.randint(0, vocab, (batch, s))
    seen = {}
    output.register_hook(lambda grad: seen.update(strides=grad.stride()))
    model._TargetLogprob.apply(output.transpose(0, 1), targets).sum().backward()
    assert seen["strides"] == (batch * vocab, vocab, 1)
