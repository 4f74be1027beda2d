"""Packed batches and the grouped LoRA GEMM in the megatron engine (megatron-core on CPU: gloo, fp32, the CPU shims
of tests/fixtures/megatron_cpu.py), run in a child process (``python tests/e2e/test_megatron_packing_cpu.py`` prints one
JSON line) because it initializes torch.distributed.

Checked:
  * a batch of datums of different lengths, packed into one row, gives every datum the logprobs it gets alone
    (its positions restart at 0 and it attends only within itself);
  * three adapters (different scales, 1, 2 and 3 datums of different lengths) fused in one packed batch take the
    grouped GEMM and give each adapter the gradient it gets trained alone, and the gradient of the 0/1-mask path
    (forced by making the grouped-GEMM probe answer no, which is what a device or dtype without the kernel does);
  * under TP = 2 (torchrun, 2 ranks) the grouped path gives the full gradients and logprobs of one rank;
  * a backward batch cut into micro-batches (what the engine does on a GPU when one pass would have to recompute
    layers) gives the logprobs and the summed gradients of one pass.

Tolerances (fp32): packing changes which rows share a GEMM and where a datum's rows sit, so only the summation
order of a few reductions differs: 1e-5 on logprobs (about 10 ulps of the ~1-10 magnitudes here) and 1e-5 relative
on gradients, as the other megatron CPU checks allow.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.e2e.test_megatron_cpu import run, torchrun

LENGTHS = (17, 5, 30, 11, 1, 23)  # one adapter's datums (packing check)
# The fused check: per adapter (name, alpha, datum lengths): 1, 2 and 3 datums, different scales.
TENANTS = (("a", 8.0, (19,)), ("b", 2.0, (7, 26)), ("c", 5.0, (12, 3, 21)))
RANK = 4


def main(tp: int = 1, out: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    import tests.fixtures.megatron_cpu  # noqa: F401  (before the backend is used)
    from loraplane.lora import LoraSpec, init_lora_params
    from loraplane.models.base import _wrap
    from loraplane.models.tiny import build_tiny_tokenizer, build_tp_divisible_llama
    from trainer_svc.backends.megatron import lora as lora_mod
    from trainer_svc.backends.megatron.engine import DatumWork, Engine
    from trainer_svc.backends.megatron.model import init_parallel

    init_parallel(tp)
    base = _wrap("packing-check", build_tp_divisible_llama(7), build_tiny_tokenizer(), torch.device("cpu"),
                 torch.float32)
    engine = Engine(base, device_slots=4, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)

    def datum(adapter, n):
        tokens = torch.randint(0, base.vocab_size, (n + 1,), generator=g)
        return DatumWork(adapter, tokens[:-1].tolist(), tokens[1:].tolist())

    def add_adapter(name, alpha, seed):
        spec = LoraSpec.create(RANK, alpha, [], seed=seed)
        # Random full A and B (the same on any TP layout), so that the adapter changes the logits and both get
        # gradients.
        params = init_lora_params(base, spec)
        gen = torch.Generator().manual_seed(seed)
        for key in sorted(params):
            params[key] = 0.05 * torch.randn(params[key].shape, generator=gen)
        engine.load_state(name, params, None, None, 0, spec)

    def grads(name):
        return engine.slot(name).device[1].clone()

    def full_grads(name):  # the full PEFT gradients, assembled over TP ranks (every rank calls; rank 0 gets them)
        (full,) = engine.gather_full(name, rows=(1,)) or (None,)
        return None if full is None else torch.cat([full[k].reshape(-1) for k in sorted(full)])

    def zero_grads():
        for s in engine.slots.values():
            for buffer in (s.host, s.device):
                if buffer is not None:
                    buffer[1].zero_()

    report = {}
    # -- packing: each datum as alone -------------------------------------------------------------------------------
    add_adapter("p", 8.0, 1)
    data = [datum("p", n) for n in LENGTHS]
    packed = engine.run_batch(data, "cross_entropy", {}, backward=False).logprobs
    alone = [engine.run_batch([d], "cross_entropy", {}, backward=False).logprobs[0] for d in data]
    report["packed_vs_alone_logprob_max_abs"] = max(abs(a - b) for x, y in zip(packed, alone) for a, b in zip(x, y))
    report["packed_lengths"] = [len(x) for x in packed]
    report["logprob_scale"] = max(abs(a) for x in alone for a in x)

    # -- fused tenants: grouped vs alone vs mask ------------------------------------------------------------------
    for k, (name, alpha, _) in enumerate(TENANTS):
        add_adapter(name, alpha, 10 + k)
    fused_data = [datum(name, n) for name, _, lengths in TENANTS for n in lengths]
    # Interleaved in the request, as the scheduler may hand them over; the engine groups them per adapter.
    fused_data = fused_data[::2] + fused_data[1::2]

    def fused(force_mask: bool):
        zero_grads()
        before = dict(engine.stats)
        saved = lora_mod.grouped_mm_supported
        if force_mask:
            lora_mod.grouped_mm_supported = lambda device, dtype: False
        try:
            result = engine.run_batch(fused_data, "cross_entropy", {}, backward=True)
        finally:
            lora_mod.grouped_mm_supported = saved
        mode = [m for m in ("grouped", "mask", "single") if engine.stats.get(f"lora_{m}", 0) > before.get(f"lora_{m}", 0)]
        return result.logprobs, {name: grads(name) for name, _, _ in TENANTS}, mode

    grouped_lp, grouped_grads, grouped_mode = fused(False)
    full = {name: full_grads(name) for name, _, _ in TENANTS}
    mask_lp, mask_grads, mask_mode = fused(True)
    alone_grads, alone_lp = {}, {}
    for name, _, _ in TENANTS:
        zero_grads()
        mine = [d for d in fused_data if d.adapter == name]
        alone_lp[name] = engine.run_batch(mine, "cross_entropy", {}, backward=True).logprobs
        alone_grads[name] = grads(name)
    report["grouped_mode"], report["mask_mode"] = grouped_mode, mask_mode
    report["probe_cpu_fp32"] = lora_mod.grouped_mm_supported(torch.device("cpu"), torch.float32)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    report["grad_norms"] = {name: float(alone_grads[name].norm()) for name in alone_grads}
    report["grouped_vs_alone_grad_rel"] = max(rel(grouped_grads[n], alone_grads[n]) for n in alone_grads)
    report["grouped_vs_mask_grad_rel"] = max(rel(grouped_grads[n], mask_grads[n]) for n in alone_grads)
    fused_alone_lp = []
    for d in fused_data:
        fused_alone_lp.append(alone_lp[d.adapter].pop(0))
    report["grouped_vs_alone_logprob_max_abs"] = max(
        abs(a - b) for x, y in zip(grouped_lp, fused_alone_lp) for a, b in zip(x, y))
    report["grouped_vs_mask_logprob_max_abs"] = max(
        abs(a - b) for x, y in zip(grouped_lp, mask_lp) for a, b in zip(x, y))

    # -- micro-batches: the fused batch in passes of at most 30 tokens per rank --------------------------------------
    zero_grads()
    passes_before = engine.stats.get("micro_batches", 0)
    engine.micro_batch_tokens = 30
    try:
        micro_lp = engine.run_batch(fused_data, "cross_entropy", {}, backward=True).logprobs
    finally:
        engine.micro_batch_tokens = None
    micro_grads = {name: grads(name) for name, _, _ in TENANTS}
    report["micro_batches"] = engine.stats.get("micro_batches", 0) - passes_before
    report["micro_vs_one_pass_grad_rel"] = max(rel(micro_grads[n], grouped_grads[n]) for n in alone_grads)
    report["micro_vs_one_pass_logprob_max_abs"] = max(
        abs(a - b) for x, y in zip(micro_lp, grouped_lp) for a, b in zip(x, y))
    if not dist.is_initialized() or dist.get_rank() == 0:
        if out:
            torch.save({"grouped_full_grads": full, "grouped_logprobs": grouped_lp}, out)
        print(json.dumps(report))
    if dist.is_initialized():
        # A rank that exits while gloo's threads still run aborts ("terminate called without an active exception"),
        # which failed a finished run under load.
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("packing") / "tp1.pt"
    stdout = run([sys.executable, str(Path(__file__).resolve()), "--out", str(out)], timeout=240)
    return {**json.loads(stdout.strip().splitlines()[-1]), "out": out}


def test_packed_datums_get_the_logprobs_they_get_alone(measured):
    assert measured["packed_lengths"] == list(LENGTHS)
    assert measured["packed_vs_alone_logprob_max_abs"] <= 1e-5, measured


def test_fused_tenants_take_the_grouped_gemm_and_get_their_own_gradients(measured):
    assert measured["probe_cpu_fp32"] is True
    assert measured["grouped_mode"] == ["grouped"] and measured["mask_mode"] == ["mask"], measured
    assert all(n > 0 for n in measured["grad_norms"].values())
    assert measured["grouped_vs_alone_grad_rel"] <= 1e-5, measured
    assert measured["grouped_vs_mask_grad_rel"] <= 1e-5, measured
    assert measured["grouped_vs_alone_logprob_max_abs"] <= 1e-5, measured
    assert measured["grouped_vs_mask_logprob_max_abs"] <= 1e-5, measured


def test_micro_batches_sum_to_one_pass(measured):
    """88 tokens of three tenants in passes of <= 30 tokens: every datum's logprobs and each tenant's gradient equal
    the single pass (the gradients add up across passes before any optimizer step)."""
    assert measured["micro_batches"] >= 3, measured
    assert measured["micro_vs_one_pass_grad_rel"] <= 1e-5, measured
    assert measured["micro_vs_one_pass_logprob_max_abs"] <= 1e-5, measured


def test_grouped_gemm_under_tensor_parallel_equals_one_rank(measured, tmp_path):
    """TP=2 (gloo, 2 ranks): the grouped path with its TP all-reduces (of ``A x`` for o/down in the forward, of the
    gradient of ``A x`` for q, k, v, gate, up in the backward) gives the full gradients and logprobs of one rank."""
    import torch

    out = tmp_path / "tp2.pt"
    stdout = run(torchrun(2, str(Path(__file__).resolve()), "--tp", "2", "--out", str(out)), timeout=280)
    tp2 = json.loads(stdout.strip().splitlines()[-1])
    assert tp2["grouped_mode"] == ["grouped"] and tp2["mask_mode"] == ["mask"], tp2
    one, two = torch.load(measured["out"]), torch.load(out)
    for name, want in one["grouped_full_grads"].items():
        got = two["grouped_full_grads"][name]
        assert float((got - want).norm() / want.norm()) <= 1e-5, name
    worst = max(abs(a - b) for x, y in zip(one["grouped_logprobs"], two["grouped_logprobs"]) for a, b in zip(x, y))
    assert worst <= 1e-5


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    main(args.tp, args.out)
