"""Llama-3.x, Qwen2.5 and Qwen3 checkpoints in the megatron backend in bf16 on CUDA, against transformers and HF PEFT
(the measurements of tests/e2e/test_megatron_families_cpu.py, which checks them in fp32 on CPU).

    python -m pytest tests/gpu/test_megatron_families.py -m gpu -o addopts="" --noconftest -v

Tolerance. bf16 keeps 8 significant bits (rounding error 2^-9 ≈ 2e-3 relative per op), and the two implementations
round at different points (one fused qkv GEMM, megatron's bf16 cos/sin and torch RMSNorm vs HF's fp32-internal
RMSNorm), so their errors are of the same size but not the same values. As in tests/gpu/test_megatron.py, megatron in
bf16 is compared with the fp32 transformers (PEFT) reference and must stay within twice the error transformers (PEFT)
itself makes in bf16 against that reference, plus 0.01 on the mean and 0.05 on the max for when that error happens to
be tiny. A mapping mistake is far outside that (≥ 0.3 on logprobs in the fp32 test's mutations).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.e2e.test_megatron_families_cpu import FAMILIES, family_measurements
from tests.gpu.test_megatron import parallel  # noqa: F401  (one-rank process group, TF32 off)


def within_bf16_error(measured: float, yardstick: float, slack: float) -> bool:
    return measured <= 2 * yardstick + slack


@pytest.mark.parametrize("family", FAMILIES)
def test_family_in_bf16_matches_transformers_and_peft(family, tmp_path):
    m = family_measurements(family, tmp_path, torch.bfloat16, with_torch_backend=False)
    print(json.dumps({family: m}))
    assert m["rope_inv_freq_max_abs"] == 0.0
    assert within_bf16_error(m["logits_mean_abs"], m["hf_dtype_logits_mean_abs"], 0.01)
    assert within_bf16_error(m["logits_max_abs"], m["hf_dtype_logits_max_abs"], 0.05)
    assert m["update_norm"] > 0 and m["adapter_effect_max_abs"] > 0.1
    assert within_bf16_error(m["peft_mean_abs"], m["peft_dtype_mean_abs"], 0.01)
    assert within_bf16_error(m["peft_max_abs"], m["peft_dtype_max_abs"], 0.05)
