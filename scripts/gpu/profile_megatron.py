"""Where a training step of the megatron backend spends its time: 1 tenant vs 8 tenants fused (GPU).

    PYTHONPATH=.:<megatron-core> python scripts/gpu/profile_megatron.py [--shape smollm2] [--out DIR]

Builds a model in SmolLM2-135M's shape with random weights (throughput does not depend on the values, and no model
file has to travel), then for each mode prints the wall time of forward+backward and of the optimizer steps
(medians, synchronized), the host time spent issuing work, the summed CUDA kernel time from the profiler, the
number of dispatched ops, and the top ops by host time. This is the evidence behind docs/megatron.md's reading of
the fused-vs-single ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time
from pathlib import Path

import torch


def smollm2_shaped(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraplane.models.base import from_hf_model
    from loraplane.models.tiny import build_tiny_tokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
    model = LlamaForCausalLM(config)
    return from_hf_model("smollm2-shaped-random", model, build_tiny_tokenizer())


def median_ms(fn, repeat: int = 8, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def alternated_medians_ms(fns, rounds: int, warmup: int = 2) -> list[float]:
    """Median of each function's time, taken round by round (A B A B ...): that machine drifts by more than the
    difference being measured, so back-to-back blocks of A then B mislead."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, bucket in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            bucket.append(time.perf_counter() - t0)
    return [statistics.median(b) * 1e3 for b in times]


def profile(fn, label: str, out_dir: Path) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    (out_dir / f"profile_{label}.txt").write_text(table)
    (out_dir / f"profile_{label}_by_cuda.txt").write_text(events.table(sort_by="self_cuda_time_total", row_limit=25))
    # The table's own total: summing the events' device times would count each kernel under its op too.
    match = re.search(r"Self CUDA time total: ([0-9.]+)(ms|us|s)", table)
    kernel_ms = float(match.group(1)) * {"ms": 1.0, "us": 1e-3, "s": 1e3}[match.group(2)] if match else float("nan")
    return {"kernel_ms": kernel_ms, "aten_ops": ops, "top": table}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--datums", type=int, default=16)
    ap.add_argument("--out", default="bench/results/profile")
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=30, help="alternated 1-tenant / fused-8 steps for the ratio")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    from bench.harness import fresh_adapter_state, random_datums
    from trainer_svc.backends.base import BatchItem
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.backends.megatron.model import init_parallel
    from trainer_svc.optimizer import AdamHyper

    init_parallel(1)
    base = smollm2_shaped()
    lora_dtype = None if args.lora_dtype == "auto" else getattr(torch, args.lora_dtype)
    backend = MegatronBackend(engine=Engine(base, device_slots=8, dtype=torch.bfloat16,
                                            lora_compute_dtype=lora_dtype))
    hyper = AdamHyper(learning_rate=1e-4)
    g = torch.Generator().manual_seed(0)

    state = functools.partial(fresh_adapter_state, base, rank=args.rank)  # name -> a new adapter's state
    data = functools.partial(random_datums, base.vocab_size, seq_len=args.seq_len, generator=g)  # n -> datums

    tenants = [state(f"tenant{i}") for i in range(8)]
    for s in tenants:
        backend._ensure(s)
    one_batch = [BatchItem(tenants[0], data(args.datums), "cross_entropy", {})]
    per = max(1, args.datums // 8)
    fused_batch = [BatchItem(s, data(per), "cross_entropy", {}) for s in tenants]

    modes = {
        "one": (one_batch, tenants[:1]),
        "fused8": (fused_batch, tenants),
    }
    results: dict[str, dict] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for label, (batch, stepping) in modes.items():
        def fwd_bwd(batch=batch):
            backend.run(batch, backward=True)

        def steps(stepping=stepping):
            for s in stepping:
                backend.optim_step(s, hyper)

        def full(batch=batch, stepping=stepping):
            fwd_bwd(batch)
            steps(stepping)

        r = {"full_ms": median_ms(full), "fwd_bwd_ms": median_ms(fwd_bwd), "steps_ms": median_ms(steps),
             "fwd_ms": median_ms(lambda batch=batch: backend.run(batch, backward=False))}
        p = profile(full, label, out_dir)
        r.update({k: v for k, v in p.items() if k != "top"})
        results[label] = r
        print(f"== {label}\n{p['top']}", flush=True)
    from loraplane.adapter_format import serialize_adapter

    def publish():
        return serialize_adapter(backend.export_params(tenants[0]), tenants[0].spec, base.name)

    results["publish_export_serialize_ms"] = median_ms(publish, repeat=5, warmup=1)
    results["publish_blob_bytes"] = len(publish())
    one, fused = results["one"], results["fused8"]
    results["ratio_full"] = one["full_ms"] / fused["full_ms"]

    def step(batch, stepping):
        backend.run(batch, backward=True)
        for s in stepping:
            backend.optim_step(s, hyper)

    t_one, t_fused = alternated_medians_ms([lambda: step(one_batch, tenants[:1]), lambda: step(fused_batch, tenants)],
                                           rounds=args.rounds)
    results["alternated"] = {"one_ms": t_one, "fused8_ms": t_fused, "ratio": t_one / t_fused, "rounds": args.rounds}
    (out_dir / "profile.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"\n{'metric':24s} {'1 tenant':>10s} {'8 fused':>10s}")
    for key in ("full_ms", "fwd_bwd_ms", "fwd_ms", "steps_ms", "kernel_ms", "aten_ops"):
        print(f"{key:24s} {one[key]:10.1f} {fused[key]:10.1f}")
    print(f"tokens/s ratio fused8/one (same tokens), blocks: {results['ratio_full']:.3f}; alternated over "
          f"{args.rounds} rounds: {results['alternated']['one_ms']:.1f} vs {results['alternated']['fused8_ms']:.1f} ms "
          f"= {results['alternated']['ratio']:.3f}")
    print(f"PublishWeights export + serialize, {results['publish_blob_bytes'] / 1e6:.1f} MB: "
          f"{results['publish_export_serialize_ms']:.1f} ms")


if __name__ == "__main__":
    main()
