"""The megatron engine with fused SDPA attention and with full activation recomputation against megatron's unfused
attention without recomputation (fp32, CPU or GPU): per-token logprobs and every adapter's gradient on a fused batch
of two adapters with ragged (right-padded) datums. Prints one JSON line.

    PYTHONPATH=. python scripts/gpu/attention_recompute_check.py [--cpu-dev]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-dev", action="store_true", help="megatron-core on CPU (gloo) through tests/fixtures/megatron_cpu")
    args = ap.parse_args()
    if args.cpu_dev:
        import tests.fixtures.megatron_cpu  # noqa: F401

    from loraplane.models import load_base_model
    from trainer_svc.backends.megatron.engine import DatumWork, Engine
    from trainer_svc.backends.megatron.model import init_parallel

    init_parallel(1)
    base = load_base_model("tiny", device="cpu", dtype=torch.float32)
    from bench.harness import fresh_adapter_state

    results = {}
    for attention, recompute in (("unfused", "none"), ("sdpa", "none"), ("sdpa", "full")):
        engine = Engine(base, device_slots=4, dtype=torch.float32, attention=attention, recompute=recompute)
        for i in range(2):
            state = fresh_adapter_state(base, f"a{i}", rank=4)
            engine.create(state.name, state.spec)
            # Random B (and A) so that the adapters change the logits and both get gradients.
            engine.slot(state.name).host[0].normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
        g = torch.Generator().manual_seed(1)
        datums = []
        for i in range(4):
            tokens = torch.randint(0, base.vocab_size, (13 - i,), generator=g)
            datums.append(DatumWork(f"a{i % 2}", tokens[:-1].tolist(), tokens[1:].tolist()))
        out = engine.run_batch(datums, "cross_entropy", {}, backward=True)
        grads = torch.cat([engine.slot(f"a{i}").device[1].cpu() for i in range(2)])
        results[(attention, recompute)] = (out.logprobs, grads, engine.stats.get("recomputed_layers"))
    ref_lp, ref_grads, _ = results[("unfused", "none")]
    report = {}
    for (attention, recompute), (lp, grads, layers) in results.items():
        report[f"{attention}/{recompute}"] = {
            "logprob_max_abs": max(abs(a - b) for x, y in zip(lp, ref_lp) for a, b in zip(x, y)),
            "grad_rel": float((grads - ref_grads).norm() / ref_grads.norm()),
            "grad_norm": float(grads.norm()), "recomputed_layers": layers}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
