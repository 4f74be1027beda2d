"""The megatron backend's fast paths on CUDA: fused SDPA attention and full activation recomputation (whose
recomputation runs on autograd's device thread) against the unfused model, the compiled chunked logprob kernels
in bf16 against ``log_softmax`` on fp32-upcast logits, and the compiled RoPE against its eager chain. Run by
``scripts/gpu/`` with ``-m gpu --noconftest``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

REPO = Path(__file__).resolve().parents[2]


def test_sdpa_and_recompute_on_cuda_match_the_unfused_model():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "scripts/gpu/attention_recompute_check.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["sdpa/full"]["recomputed_layers"] == 2
    for key in ("sdpa/none", "sdpa/full"):  # fp32 on the H100: 9.5e-7 / 4.9e-7 measured
        assert report[key]["logprob_max_abs"] <= 1e-4, (key, report[key])
        assert report[key]["grad_rel"] <= 1e-4, (key, report[key])


def test_compiled_logprob_kernels_match_log_softmax_in_bf16():
    from trainer_svc.backends.megatron import model

    g = torch.Generator(device="cuda").manual_seed(5)
    b, s, vocab = 4, 300, 32000
    logits = (torch.randn(b, s, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, vocab, (b, s), device="cuda", generator=g)
    weights = torch.randn(b, s, device="cuda", generator=g)
    ref_in = logits.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(ref_in.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()
    out = model._TargetLogprob.apply(logits, targets)
    (out * weights).sum().backward()
    assert torch.allclose(out, ref, atol=1e-4, rtol=0)
    # Both gradients are fp32 math rounded once to bf16.
    assert torch.allclose(logits.grad.float(), ref_in.grad.float(), atol=1e-2, rtol=1e-2)
    assert (logits.grad.float() - ref_in.grad.float()).abs().mean() < 1e-5


def test_compiled_rope_matches_the_eager_chain_in_bf16():
    """The RoPE the packed core attention applies on CUDA compiles (no silent eager fallback) and equals the
    op-by-op chain up to the bf16 roundings it skips, forward and backward."""
    from trainer_svc.backends.megatron import fusion

    assert fusion.compiles("rope", torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(11)
    for t in (300, 517):  # a second length: the dynamic kernel serves it without another compile failing
        x = torch.randn(t, 8, 128, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        angles = torch.rand(t, 1, 128, device="cuda", generator=g) * 100
        cos, sin = torch.cos(angles).to(torch.bfloat16), torch.sin(angles).to(torch.bfloat16)
        weights = torch.randn(t, 8, 128, device="cuda", generator=g)
        out = fusion.apply_rope(x, cos, sin)
        ref = fusion.rotate(x_ref, cos, sin)
        (out.float() * weights).sum().backward()
        (ref.float() * weights).sum().backward()
        assert not fusion._ROTATE_COMPILED.failed
        assert torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=1e-2)
        assert torch.allclose(x.grad.float(), x_ref.grad.float(), atol=2e-2, rtol=1e-2)


def test_varlen_attention_matches_per_datum_sdpa():
    """The packed row's CUDA kernel (``varlen_attn``, one call per layer) against the per-datum fused SDPA loop it
    falls back to, both in bf16 against the same loop in fp32: forward and the q, k, v gradients (GQA)."""
    import math

    from trainer_svc.backends.megatron import attention

    if attention._varlen_call() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    lengths = [37, 1, 128, 64, 300, 9]
    total, heads, groups, dim = sum(lengths), 16, 4, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q32 = torch.randn(total, heads, dim, device="cuda", generator=g)
    k32 = torch.randn(total, groups, dim, device="cuda", generator=g)
    v32 = torch.randn(total, groups, dim, device="cuda", generator=g)
    weight = torch.randn(total, heads, dim, device="cuda", generator=g)
    packed = attention.packed_rows(lengths, torch.device("cuda"))
    scale = 1.0 / math.sqrt(dim)

    def run(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q32, k32, v32)]
        out = fn(*leaves)
        (out.float() * weight).sum().backward()
        return [out.float()] + [x.grad.float() for x in leaves]

    ref = run(lambda q, k, v: attention._per_datum(q, k, v, packed.bounds, scale), torch.float32)
    looped = run(lambda q, k, v: attention._per_datum(q, k, v, packed.bounds, scale), torch.bfloat16)

    def varlen(q, k, v):
        out = attention._varlen(q, k, v, packed, scale)
        assert out is not None, "varlen_attn refused the packed row"
        return out

    got = run(varlen, torch.bfloat16)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, looped, ref):
        err, loop_err = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 2 * loop_err + 1e-2, (name, err, loop_err)
        assert (a - b).abs().mean().item() <= 2e-3 * r.abs().mean().item() + 1e-4, name


def test_grouped_lora_gemm_matches_the_mask_path_in_bf16(monkeypatch):
    """Three adapters (one rank, different scales and token counts, an unowned tail) through each hook kind with the
    grouped GEMM and with the 0/1 mask (forced by making the probe answer no, as a device without the kernel does),
    both in bf16 against the fp32 mask path: output, input gradient and every A/B gradient."""
    from trainer_svc.backends.megatron import lora as lora_mod
    from trainer_svc.backends.megatron.layout import LlamaShape
    from trainer_svc.backends.megatron.lora import HOOK_TARGETS, AdapterTensors, MegatronLora, RowSegment

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the grouped LoRA GEMM is taken on sm90 only")
    assert lora_mod.grouped_mm_supported(torch.device("cuda"), torch.bfloat16)
    shape = LlamaShape(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32, ffn_hidden_size=512,
                       vocab_size=128)
    spans, rows, rank = ((0, 300), (300, 310), (310, 700)), 704, 16

    def adapters(lora):
        out = []
        for i, scale in enumerate((0.5, 2.0, 1.0)):
            gen = torch.Generator().manual_seed(i)
            params = {c.name: (0.05 * torch.randn(shape.num_layers, len(c.targets), rank, c.dim, generator=gen)).cuda()
                      for c in lora.classes}
            out.append(AdapterTensors(params, {k: torch.zeros_like(v) for k, v in params.items()}, rank, scale))
        return out

    def run(hook, dtype, grouped):
        lora = MegatronLora(None, shape, dtype, tensor_parallel=(1, None))
        ads = adapters(lora)
        segments = [RowSegment(a, b, ad) for (a, b), ad in zip(spans, ads)] + [RowSegment(700, rows, None)]
        targets = HOOK_TARGETS[hook]
        gen = torch.Generator().manual_seed(9)
        x = torch.randn(rows, 1, shape.in_features(targets[0]), generator=gen).cuda().to(dtype).requires_grad_(True)
        width = sum(shape.out_features(t) for t in targets)
        base = torch.randn(rows, 1, width, generator=gen).cuda().to(dtype)
        weight = torch.randn(rows, 1, width, generator=gen).cuda()
        with monkeypatch.context() as m:
            if not grouped:
                m.setattr(lora_mod, "grouped_mm_supported", lambda device, dtype: False)
            with lora.route(segments, rows) as routing:
                y = lora_mod._HookAddInPlace.apply(x, base.clone(), routing.anchor, (routing, 1, hook))
            assert routing.grouped is grouped
        (y.float() * weight).sum().backward()
        routing.accumulate_grads()
        return [y.float(), x.grad.float()] + [ad.grads[n] for ad in ads for n in sorted(ad.grads)]

    for hook in HOOK_TARGETS:
        ref = run(hook, torch.float32, False)
        got, masked = run(hook, torch.bfloat16, True), run(hook, torch.bfloat16, False)
        for i, (a, b, r) in enumerate(zip(got, masked, ref)):
            err, mask_err = (a - r).abs().max().item(), (b - r).abs().max().item()
            assert err <= 2 * mask_err + 1e-3 * (r.abs().max().item() + 1e-6), (hook, i, err, mask_err)
