"""The fused expert-LoRA forward kernel (trainer_svc/backends/megatron/fused_expert_lora.py, issue 35 item 1) on CUDA
in bf16 against its pure-torch reference, within bounds derived from bf16's rounding, and the MoE layer with the
kernel switched on (LORAPLANE_MOE_FUSED_LORA=1) against the unfused path. Run by scripts/gpu/expert_kernels.sh
(``-m gpu --noconftest``).

Bounds. The kernel and the reference compute the same products of the same bf16 operands in fp32; they differ by
(1) the fp32 summation order, at most ``n u32`` times the sum of the products' magnitudes for a sum of n terms
(u32 = 2^-24); (2) a mid that rounds to the neighbouring bf16 value because of (1): one bf16 ulp (<= 2^-7 of its
magnitude) in each of the R mids, carried through B; (3) the one rounding of the output to bf16, one ulp (<= 2^-7 of
its magnitude). All of it times the row's routing weight."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
triton = pytest.importorskip("triton", reason="the fused kernel is a Triton kernel")

BF16_ULP = 2.0**-7
U32 = 2.0**-24


def _case(tokens, k, n_out, experts, slots, rank, seed, gather, probs):
    g = torch.Generator(device="cuda").manual_seed(seed)
    virtual = experts * slots
    counts = torch.randint(0, 3 * tokens // virtual + 1, (virtual,), generator=g, device="cuda")
    counts[::5] = 0  # empty tenant x expert segments
    rows = int(counts.sum())
    bf = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(bf)

    x = rand(tokens if gather else rows, k)
    case = {
        "x": x,
        "w": rand(experts, n_out, k, scale=k**-0.5),
        "a": rand(virtual, rank, k, scale=k**-0.5),
        "b": rand(virtual, rank, n_out, scale=0.5),
        "offs": counts.cumsum(0).to(torch.int32),
        "slots": slots,
        "tok": torch.randint(0, tokens, (rows,), generator=g, device="cuda") if gather else None,
        "probs": torch.rand(rows, generator=g, device="cuda") if probs else None,
    }
    return case


def _bounds(c, ref_out, ref_mid):
    """Per element: the allowed |kernel - reference| of the output and of the mid (see the module docstring)."""
    from trainer_svc.backends.megatron.fused_expert_lora import reference_forward

    absolute = {**c, "x": c["x"].abs(), "w": c["w"].abs(), "a": c["a"].abs(), "b": c["b"].abs(),
                "probs": None if c["probs"] is None else c["probs"].abs()}
    k, rank = c["x"].shape[1], c["a"].shape[1]
    # Sum of |x||W| + |mid||B| (fp32, via the reference on magnitudes, its mids rounded as the kernel's are).
    magnitude, mid_magnitude = reference_forward(**absolute)
    out_bound = (k + rank) * U32 * magnitude.float() + BF16_ULP * ref_out.float().abs()
    # The mid-flip term: one ulp of each mid through |B|, times |p|.
    flip = reference_forward(**{**absolute, "w": torch.zeros_like(c["w"])})[0].float()
    out_bound += BF16_ULP * flip + 1e-30
    mid_bound = k * U32 * mid_magnitude.float() + BF16_ULP * ref_mid.float().abs() + 1e-30
    return out_bound, mid_bound


@pytest.mark.parametrize(("k", "n_out"), [(2048, 1536), (768, 2048)])  # Qwen3-30B-A3B's fc1 and fc2
@pytest.mark.parametrize("rank", [32, 8])
@pytest.mark.parametrize(("gather", "probs"), [(True, False), (False, True), (True, True)])
def test_fused_kernel_equals_the_reference_within_bf16_bounds(k, n_out, rank, gather, probs):
    from trainer_svc.backends.megatron.fused_expert_lora import fused_forward, reference_forward

    torch.set_float32_matmul_precision("highest")  # the reference's fp32 products in fp32, not TF32
    c = _case(tokens=1024, k=k, n_out=n_out, experts=16, slots=3, rank=rank, seed=k + rank, gather=gather,
              probs=probs)
    ref_out, ref_mid = reference_forward(**c)
    out, mid = fused_forward(**c)
    torch.cuda.synchronize()
    out_bound, mid_bound = _bounds(c, ref_out, ref_mid)
    out_excess = ((out.float() - ref_out.float()).abs() / out_bound).max().item()
    mid_excess = ((mid.float() - ref_mid.float()).abs() / mid_bound).max().item()
    assert out_excess <= 1.0 and mid_excess <= 1.0, (out_excess, mid_excess)
    assert ref_out.float().abs().max() > 0


def test_the_moe_layer_with_the_fused_kernel_equals_the_unfused_path(monkeypatch):
    """GroupedExperts.local_forward with a per-expert adapter and one of another rank routed (the grouped path):
    the fused kernel runs (its counter moves), the layer's output matches the unfused path within a few bf16 ulps of
    its scale (the unfused path rounds each GEMM's output twice, base then base + delta), and the backward (the unfused code, given the kernel's h and mids) gives the same
    gradients up to what that difference carries."""
    from types import SimpleNamespace

    from trainer_svc.backends.megatron import moe, routing
    from trainer_svc.backends.megatron.expert_lora import ExpertLora
    from trainer_svc.backends.megatron.layout import LlamaShape
    from trainer_svc.backends.megatron.routing import AdapterTensors, RowSegment

    hidden, ffn, experts, top_k, tokens = 512, 256, 16, 4, 2048
    shape = LlamaShape(num_layers=1, hidden_size=hidden, num_heads=4, num_kv_heads=4, head_dim=128,
                       ffn_hidden_size=ffn, vocab_size=128, num_experts=experts, moe_ffn_hidden_size=ffn,
                       moe_layers=(0,))
    slots = 3  # two expert adapters and the no-adapter slot
    config = SimpleNamespace(moe_ffn_hidden_size=ffn, hidden_size=hidden, params_dtype=torch.bfloat16,
                             loraplane_expert_slots=slots)
    layer = moe.GroupedExperts(experts * slots, config).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        layer.weight1.copy_(torch.randn(layer.weight1.shape, generator=g, device="cuda") * hidden**-0.5)
        layer.weight2.copy_(torch.randn(layer.weight2.shape, generator=g, device="cuda") * ffn**-0.5)
    lora = ExpertLora(shape, torch.bfloat16, tp=1)
    lora.slots = slots - 1
    layer.lora, layer.layer_index = lora, 0

    def adapter(rank, scale):
        dims = {"experts.gate_up_proj.A": hidden, "experts.gate_up_proj.B": 2 * ffn,
                "experts.down_proj.A": ffn, "experts.down_proj.B": hidden}
        params = {n: torch.randn(1, experts, rank, d, generator=g, device="cuda") * d**-0.5 for n, d in dims.items()}
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        return AdapterTensors(params, grads, rank, scale, "per_expert")

    adapters = [adapter(16, 2.0), adapter(8, 0.5)]
    x0 = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    probs, top = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    slot = torch.full((tokens,), slots - 1, dtype=torch.int64, device="cuda")
    slot[: tokens // 3], slot[tokens // 3 : 2 * tokens // 3] = 0, 1

    def run(flag):
        monkeypatch.setenv("LORAPLANE_MOE_FUSED_LORA", flag)
        for a in adapters:
            for t in a.grads.values():
                t.zero_()
        segments = [RowSegment(0, tokens // 3, adapters[0]), RowSegment(tokens // 3, 2 * tokens // 3, adapters[1])]
        anchor = torch.zeros((), device="cuda", requires_grad=True)
        batch = lora.batch(segments, tokens, torch.device("cuda"), anchor)
        x = x0.clone().requires_grad_(True)
        with routing.using(SimpleNamespace(experts=batch, anchor=anchor, active=True)):
            y = layer.local_forward(x, probs, top, slot)
            y.float().square().sum().backward()
        return y.detach(), x.grad, [t.clone() for a in adapters for t in a.grads.values()]

    before = lora.gemms.get("expert_lora_fused", 0)
    y_fused, gx_fused, grads_fused = run("1")
    assert lora.gemms.get("expert_lora_fused", 0) == before + 2  # fc1 and fc2 went through the kernel
    y, gx, grads = run("0")
    scale = y.float().abs().max().item()
    assert (y_fused.float() - y.float()).abs().max().item() <= 4 * BF16_ULP * scale
    assert ((gx_fused.float() - gx.float()).norm() / gx.float().norm()).item() <= 2e-2
    for got, want in zip(grads_fused, grads, strict=True):
        assert ((got - want).norm() / want.norm()).item() <= 2e-2

