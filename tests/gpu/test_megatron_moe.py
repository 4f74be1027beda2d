"""Qwen3-MoE in the megatron backend in bf16 on CUDA (the grouped expert GEMMs and the tenant x expert LoRA GEMMs
as torch._grouped_mm kernels), against fp32 references (tests/e2e/test_megatron_moe_cpu.py checks fp32 on CPU).

    python -m pytest tests/gpu/test_megatron_moe.py -m gpu -o addopts="" --noconftest -v

Tolerance, as tests/gpu/test_megatron_families.py: megatron in bf16 against the fp32 transformers (torch backend)
reference must stay within twice the error transformers (the torch backend) itself makes in bf16 against it, plus
0.01 on the mean and 0.1 on the max (a bf16 rounding can flip a token's k-th expert choice near a tie on either
side, which moves that token by more than the rounding itself).
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

from tests.e2e.test_megatron_moe_cpu import SEQUENCE_LENGTHS, _hf_packed_logits, _ids, write_moe_checkpoint
from tests.gpu.test_megatron import datums, flat, logprobs_of, make_state, parallel, random_adapter  # noqa: F401


def within(measured: float, yardstick: float, slack: float) -> bool:
    return measured <= 2 * yardstick + slack


def errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float().cpu() - b.float().cpu()).abs()
    return d.mean().item(), d.max().item()


@pytest.mark.parametrize("name", ["moe_mixed", "moe_all"])
def test_moe_in_bf16_matches_fp32_references(name, tmp_path):
    from loraplane.lora import LoraSpec
    from loraplane.models import families, load_base_model
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.model import forward_logits
    from trainer_svc.backends.torch_backend import TorchBackend

    directory = write_moe_checkpoint(name, tmp_path / name)
    backend = MegatronBackend(str(directory), dtype=torch.bfloat16, device_slots=4)
    hf32 = load_base_model(str(directory), device="cuda", dtype=torch.float32)
    hf16 = load_base_model(str(directory), device="cuda", dtype=torch.bfloat16)
    ids = _ids(hf32.vocab_size, SEQUENCE_LENGTHS, seed=7).cuda()
    with torch.no_grad():
        ours = forward_logits(backend.engine.model, ids, list(SEQUENCE_LENGTHS))[0]
    ref = _hf_packed_logits(hf32.model, ids, SEQUENCE_LENGTHS)
    m: dict = {"logits": errors(ours, ref), "hf_bf16_logits": errors(_hf_packed_logits(hf16.model, ids,
                                                                                       SEQUENCE_LENGTHS), ref)}
    data = datums(hf32.vocab_size, SEQUENCE_LENGTHS, seed=11)
    available = families.lora_targets(hf32.model.config)
    torch32 = TorchBackend(str(directory), device="cuda", dtype=torch.float32)
    torch16 = TorchBackend(str(directory), device="cuda", dtype=torch.bfloat16)
    for layout in ("per_expert", "shared_outer"):
        # Rank 16: every LoRA operand 16-byte aligned in bf16, so the grouped kernel runs the expert LoRA.
        spec = LoraSpec.create(16, 32.0, [], seed=3, expert_layout=layout, available=available)
        params = random_adapter(hf32, spec, seed=5)
        lp, _ = logprobs_of(backend, make_state(layout, spec, params, "cpu"), data, backward=True)
        lp32, _ = logprobs_of(torch32, make_state(layout, spec, params, "cuda"), data, backward=True)
        lp16, _ = logprobs_of(torch16, make_state(layout, spec, params, "cuda"), data, backward=True)
        m[layout] = errors(flat(lp), flat(lp32))
        m[f"{layout}_torch_bf16"] = errors(flat(lp16), flat(lp32))
        m[f"{layout}_effect"] = errors(flat(lp32), flat(logprobs_of(torch32, make_state(
            "zero", LoraSpec.create(16, 32.0, [], seed=3, expert_layout=layout, available=available),
            {k: torch.zeros_like(v) for k, v in params.items()}, "cuda"), data)[0]))[1]
    m["stats"] = dict(backend.engine.stats)
    print("measured", json.dumps({name: m}))
    # The expert LoRA ran on the grouped kernel (bf16, sm90, aligned rank 16), never the loop over segments.
    assert m["stats"]["expert_lora_grouped"] > 0 and m["stats"]["expert_lora_loop"] == 0
    assert within(m["logits"][0], m["hf_bf16_logits"][0], 0.01)
    assert within(m["logits"][1], m["hf_bf16_logits"][1], 0.1)
    for layout in ("per_expert", "shared_outer"):
        assert m[f"{layout}_effect"] > 0.1  # the adapter moves the logprobs: the comparison is not vacuous
        assert within(m[layout][0], m[f"{layout}_torch_bf16"][0], 0.01)
        assert within(m[layout][1], m[f"{layout}_torch_bf16"][1], 0.1)
