"""The megatron backend's Gated DeltaNet (Qwen3.5) packed rows on CUDA: BATCHED and fla's varlen kernels against the
per-datum path (EXACT, the CPU's bit-exact path, run here on the GPU), on the family's tiny dense and MoE checkpoints
(tests/e2e/test_megatron_packed_impl_cpu.py checks BATCHED against EXACT on CPU).

    python3 -m pytest -q -m gpu --noconftest -o addopts="" tests/gpu/test_megatron_packed_gdn.py

The bounds are tests/gpu/test_packed_fast_paths.py's, for the same reasons: fp32 (TF32 off) BATCHED within 1e-4 of
the largest logprob and 1e-3 of the gradients' norm; in bf16 fla (and BATCHED) held to EXACT in bf16 on the same
GPU, both against the fp32 EXACT reference: at most twice EXACT's error plus 1% of the largest logprob (max), 0.2%
(mean) and 5% of the gradients' norm, with the gated norms' epsilon raised to 1e-2 (these tiny random models are
ill-conditioned in bf16 where a head's delta-rule output cancels to near zero).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.gpu.test_megatron import datums, flat, logprobs_of, make_state, parallel, random_adapter  # noqa: F401

LENGTHS = (37, 64, 5, 130, 64)
NORM_EPS = 1e-2


@pytest.fixture(scope="module", params=["tiny", "moe"])
def checkpoint(request, tmp_path_factory):
    from tests.e2e.test_megatron_qwen3_5_cpu import checkpoint as build

    return build(request.param, tmp_path_factory.mktemp(request.param))


class Run:
    """A megatron engine of the checkpoint in `dtype` on the GPU, one adapter, and a step per packed impl."""

    def __init__(self, checkpoint, dtype):
        from loraplane.lora import LoraSpec
        from loraplane.models import load_base_model
        from loraplane.models.families import lora_targets
        from trainer_svc.backends.megatron.backend import Driver, MegatronBackend
        from trainer_svc.backends.megatron.engine import Engine
        from trainer_svc.backends.megatron.gated_delta_net import GatedDeltaNet

        base = load_base_model(str(checkpoint), device="cpu", dtype=torch.float32, backend="megatron")
        self.engine = Engine(base, device_slots=2, dtype=dtype)
        for module in self.engine.model.modules():
            if isinstance(module, GatedDeltaNet):
                module.eps = NORM_EPS
        self.driver = Driver(self.engine)
        self.backend = MegatronBackend(engine=self.engine, driver=self.driver)
        self.spec = LoraSpec.create(4, 8.0, [], seed=3, available=lora_targets(base.config))
        self.params = random_adapter(base, self.spec, seed=5)
        self.data = datums(base.vocab_size - 1, LENGTHS, seed=11)
        self.count = 0

    def step(self, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        from loraplane.models.packed import IMPL_ENV

        self.count += 1
        name = f"{impl}{self.count}"
        os.environ[IMPL_ENV] = impl
        try:
            lp, _ = logprobs_of(self.backend, make_state(name, self.spec, self.params, "cpu"), self.data,
                                backward=True)
            grads = self.driver.call("gather", {"name": name, "rows": [1]})[0]
        finally:
            os.environ.pop(IMPL_ENV, None)
        return flat(lp).float(), flat(grads[k] for k in sorted(grads)).float()


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Run(checkpoint, torch.float32).step("exact")


def errors(ours, ref) -> dict[str, float]:
    (lp, grads), (lp_ref, grads_ref) = ours, ref
    diff = (lp - lp_ref).abs()
    scale = lp_ref.abs().max().item()
    return {"max": diff.max().item() / scale, "mean": diff.mean().item() / scale,
            "grad": ((grads - grads_ref).norm() / grads_ref.norm()).item()}


def test_batched_in_fp32_equals_per_datum(checkpoint, reference):
    found = errors(Run(checkpoint, torch.float32).step("batched"), reference)
    print("fp32 batched", found)
    assert found["max"] <= 1e-4 and found["grad"] <= 1e-3, found


@pytest.mark.parametrize("impl", ["batched", "fla"])
def test_bf16_one_call_per_layer_is_no_worse_than_per_datum(checkpoint, reference, impl):
    from loraplane.models import packed

    if impl == "fla":
        reason = packed.fla_unusable(torch.device("cuda", torch.cuda.current_device()))
        if reason is not None:
            pytest.skip(f"fla cannot run: {reason}")
    run = Run(checkpoint, torch.bfloat16)
    exact = errors(run.step("exact"), reference)
    found = errors(run.step(impl), reference)
    print("bf16", impl, found, "exact", exact)
    assert found["max"] <= 2 * exact["max"] + 0.01, (found, exact)
    assert found["mean"] <= 2 * exact["mean"] + 0.002, (found, exact)
    assert found["grad"] <= 2 * exact["grad"] + 0.05, (found, exact)
