"""The megatron backend's one-call-per-layer packed paths for Qwen3.5 against its per-datum path, on CPU (fp32).

On CUDA the Gated DeltaNet layers run a packed row's datums in one call per layer (fla's varlen kernels where fla
runs, else BATCHED: a zero-padded (datums, longest) batch through the same torch conv1d and chunked delta rule), and
a Qwen3.5-MoE shared expert takes its sigmoid gate over the whole row; the CPU runs EXACT (per datum, bit-exact
fused == alone). BATCHED is device-independent torch, so it is checked here against EXACT on the tiny dense and MoE
checkpoints, datums of unequal lengths (one past the delta rule's 64-token chunk, so the padding spans chunks):
logprobs, every LoRA gradient, and that the batched path actually ran (a counter on the layer's batched method).
fla's path is checked against these on the GPU (tests/gpu/test_megatron_packed_gdn.py).

Also the recomputation plan's memory estimate (:func:`trainer_svc.backends.megatron.recompute.layer_bytes_per_token`)
against what the step really keeps for its backward (every tensor autograd saves, parameters excluded): the torch
delta rule's fp32 intermediates must be counted, or the plan recomputes nothing and the GPU runs out of memory (as
Qwen3.5-9B at 8 x 2048 did on an H200 before they were).

One child process (``python this_file.py --out F``) writes one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Same ops on padded instead of per-datum tensors: only the summation blocking of the GEMMs over the batch can
# differ, and the delta rule amplifies that (tests/e2e/test_megatron_qwen3_5_cpu.py's RANKS_* explain by how much).
LOGPROB_ATOL = 3e-4
GRAD_RTOL = 2e-3
LENGTHS = (70, 23, 9)
CONFIGS = ("tiny", "moe")
# The memory check's datums: whole 64-token chunks of equal length, so no padding (which a 2048-token datum makes
# negligible) is counted.
MEMORY_LENGTHS = (128, 128)


def saved_bytes(engine, backend, state, data) -> int:
    """Bytes of every tensor autograd saves for the backward of one step (parameters excluded)."""
    from tests.gpu.test_megatron import logprobs_of

    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logprobs_of(backend, state, data, backward=True)
    return sum(saved.values())


def estimated_bytes(engine, shape, tokens: int) -> int:
    """What the recomputation plan (fp32, the torch delta rule) counts for a step of ``tokens`` without
    recomputation: every layer's activations, and the logits, their transposed copy and their gradient."""
    from trainer_svc.backends.megatron.recompute import layer_bytes_per_token

    config = engine.model.config
    full, _ = layer_bytes_per_token(shape, 1, 4, engine.recompute.mlp_ffn_kept,
                                    getattr(config, "moe_router_topk", 0) or 0, 1,
                                    getattr(config, "num_moe_experts", 0) or 0, fla=False)
    return tokens * (shape.num_layers * full + 3 * shape.vocab_size * 4)


def child(out: Path) -> None:
    from dataclasses import replace

    import tests.fixtures.megatron_cpu  # noqa: F401  (before the backend is used)
    from loraplane.lora import LoraSpec
    from loraplane.models import load_base_model
    from loraplane.models.families import lora_targets
    from loraplane.models.packed import IMPL_ENV
    from tests.e2e.test_megatron_qwen3_5_cpu import checkpoint
    from tests.gpu.test_megatron import datums, flat, logprobs_of, make_state, random_adapter
    from trainer_svc.backends.megatron.backend import Driver, MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.backends.megatron.gated_delta_net import GatedDeltaNet
    from trainer_svc.backends.megatron.model import init_parallel

    calls = {"batched": 0}
    batched_row = GatedDeltaNet._batched_row

    def counted(self, *args, **kwargs):
        calls["batched"] += 1
        return batched_row(self, *args, **kwargs)

    GatedDeltaNet._batched_row = counted
    report = {}
    init_parallel(1)
    with tempfile.TemporaryDirectory() as tmp:
        for config in CONFIGS:
            directory = checkpoint(config, Path(tmp) / config)
            base = load_base_model(str(directory), device="cpu", dtype=torch.float32, backend="megatron")
            engine = Engine(base, device_slots=2, dtype=torch.float32)
            driver = Driver(engine)
            backend = MegatronBackend(engine=engine, driver=driver)
            spec = LoraSpec.create(4, 8.0, [], seed=3, available=lora_targets(base.config))
            params = random_adapter(base, spec, seed=5)
            data = datums(base.vocab_size - 1, LENGTHS, seed=11)
            measured = {}
            for impl in ("exact", "batched"):
                os.environ[IMPL_ENV] = impl
                before = calls["batched"]
                state = make_state(impl, spec, params, "cpu")
                lp, _ = logprobs_of(backend, state, data, backward=True)
                grads = driver.call("gather", {"name": impl, "rows": [1]})[0]
                keys = sorted(grads)
                measured[impl] = (flat(lp), flat(grads[k] for k in keys), calls["batched"] - before)
            (lp_e, g_e, n_e), (lp_b, g_b, n_b) = measured["exact"], measured["batched"]
            kept = saved_bytes(engine, backend, make_state("kept", spec, params, "cpu"),
                               datums(base.vocab_size - 1, MEMORY_LENGTHS, seed=13))
            tokens = sum(MEMORY_LENGTHS)
            os.environ.pop(IMPL_ENV)
            report[config] = {
                "lp_max_abs": (lp_e - lp_b).abs().max().item(),
                "grad_rel": ((g_e - g_b).norm() / g_e.norm()).item(),
                "grad_norm": g_e.norm().item(),
                "batched_calls_exact": n_e,
                "batched_calls_batched": n_b,
                "linear_layers": len(engine.shape.linear_layers),
                "saved_bytes": kept,
                "estimated_bytes": estimated_bytes(engine, engine.shape, tokens),
                "estimated_bytes_without_linear": estimated_bytes(engine, replace(engine.shape, linear_layers=()),
                                                                  tokens),
            }
            driver.shutdown()
    out.write_text(json.dumps(report))


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    from tests.e2e.test_megatron_cpu import run

    out = tmp_path_factory.mktemp("packed-impl") / "report.json"
    run([sys.executable, str(Path(__file__).resolve()), "--out", str(out)], timeout=280)
    return json.loads(out.read_text())


@pytest.mark.parametrize("config", CONFIGS)
def test_batched_rows_equal_per_datum(measured, config):
    m = measured[config]
    # EXACT never takes the batched path; BATCHED takes it in every DeltaNet layer (forward, at least).
    assert m["batched_calls_exact"] == 0
    assert m["batched_calls_batched"] >= m["linear_layers"] > 0
    assert m["lp_max_abs"] <= LOGPROB_ATOL, m
    assert m["grad_norm"] > 0 and m["grad_rel"] <= GRAD_RTOL, m


@pytest.mark.parametrize("config", CONFIGS)
def test_the_recomputation_plan_counts_what_the_delta_rule_keeps(measured, config):
    m = measured[config]
    # An upper bound (it counts the costliest layer for every layer), and not a wild one.
    assert m["saved_bytes"] <= m["estimated_bytes"] <= 1.6 * m["saved_bytes"], m
    # Counted as an attention layer, a Gated DeltaNet layer would be far under what it keeps.
    assert m["estimated_bytes_without_linear"] < 0.5 * m["saved_bytes"], m


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    child(Path(ap.parse_args().out))
