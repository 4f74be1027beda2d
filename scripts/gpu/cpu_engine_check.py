"""The megatron engine on CPU (megatron-core with gloo, fp32) against the torch backend on `tiny`.

    python scripts/gpu/cpu_engine_check.py      # prints one JSON line; tests/e2e/test_megatron_cpu.py asserts on it

Checks: per-token logprobs and LoRA gradients of one forward+backward, one AdamW step, tenant isolation with fused
batches and spills (tests/gpu/test_megatron.py's test, which asserts itself), and a training-state round trip.
Runs in its own process: it initializes a process group and the CPU shims of tests/fixtures/megatron_cpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import tests.fixtures.megatron_cpu  # noqa: F401  (before the backend is used)
from loraplane.lora import LoraSpec
from loraplane.models import load_base_model
from trainer_svc.backends.megatron.model import init_parallel
from trainer_svc.backends.torch_backend import TorchBackend
from trainer_svc.optimizer import AdamHyper


def gpu_test_module():
    """tests/gpu/test_megatron.py's helpers (its CUDA skip marks do not apply to direct calls)."""
    spec = importlib.util.spec_from_file_location("megatron_gpu_tests", REPO / "tests" / "gpu" / "test_megatron.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    init_parallel(1)
    tm = gpu_test_module()
    base = load_base_model("tiny", device="cpu", dtype=torch.float32)
    spec = LoraSpec.create(8, 16.0, [], seed=5)
    params = tm.random_adapter(base, spec, seed=12)
    data = tm.datums(base.vocab_size, [48, 31], seed=4, with_weights=True)
    hyper = AdamHyper(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)

    mg = tm.engine_for(base, torch.float32)
    mg_state = tm.make_state("a", spec, params, "cpu")
    lp_mg, _ = tm.logprobs_of(mg, mg_state, data, backward=True)
    (mg_grads,) = mg.driver.call("gather", {"name": "a", "rows": [1]})
    mg_out = mg.optim_step(mg_state, hyper)
    mg_after = mg.export_params(mg_state)

    tc = TorchBackend(load_base_model("tiny", device="cpu", dtype=torch.float32))
    tc_state = tm.make_state("a", spec, params, "cpu")
    lp_tc, _ = tm.logprobs_of(tc, tc_state, data, backward=True)
    tc_grads = {k: v.grad.detach().clone() for k, v in tc_state.params.items()}
    tc_out = tc.optim_step(tc_state, hyper)
    tc_after = {k: v.detach() for k, v in tc_state.params.items()}

    keys = list(params)
    g_mg, g_tc = tm.flat(mg_grads[k] for k in keys), tm.flat(tc_grads[k] for k in keys)
    d_mg = tm.flat(mg_after[k] - params[k] for k in keys)
    d_tc = tm.flat(tc_after[k] - params[k] for k in keys)
    tm.test_isolation_interleaved_equals_alone()  # asserts; prints each tenant's relative difference

    p, m, v, step = mg.export_training_state(mg_state)
    copy = tm.make_state("b", spec, params, "cpu")
    mg.load_training_state(copy, p, m, v, step)
    p2, m2, v2, step2 = mg.export_training_state(copy)
    print(json.dumps({
        "logprob_max_abs": float((tm.flat(lp_mg) - tm.flat(lp_tc)).abs().max()),
        "grad_rel": float((g_mg - g_tc).norm() / g_tc.norm()),
        "grad_norm": [mg_out.grad_norm, tc_out.grad_norm],
        "update_rel": float((d_mg - d_tc).norm() / d_tc.norm()),
        "update_norm": float(d_tc.norm()),
        "state_round_trip": all(torch.equal(p[k], p2[k]) and torch.equal(m[k], m2[k]) and torch.equal(v[k], v2[k])
                                for k in p) and step == step2 == 1,
    }))


if __name__ == "__main__":
    main()
