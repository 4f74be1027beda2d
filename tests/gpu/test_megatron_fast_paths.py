"""The megatron backend's fast paths on CUDA: fused SDPA attention and full activation recomputation (whose
recomputation runs on autograd's device thread) against the unfused model, and the compiled chunked logprob kernels
in bf16 against ``log_softmax`` on fp32-upcast logits. Run by ``scripts/gpu/`` with ``-m gpu --noconftest``."""

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
