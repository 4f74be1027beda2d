"""Benchmark of the megatron trainer backend on one GPU (prints JSON and a table; writes bench/results/).

    PYTHONPATH=.:<site> python bench/trainer_megatron.py [--base-model smollm2-135m-instruct] [--rank 32]

Measures
  * pinned host→device bandwidth for a buffer the size of one adapter slot (the reference for spilled activation);
  * activation of a resident adapter (host time; no copy) and of a spilled one (one H2D copy of params, grads and
    AdamW moments, synchronized) and its bandwidth as a fraction of the pinned reference; activation of a spilled
    adapter whose prefetch was issued one forward earlier;
  * training tokens/s (forward + backward + AdamW): 1 tenant vs 8 tenants fused in one batch (same tokens per
    batch) vs 8 tenants round-robin in separate batches, measured alternately so drift hits all three alike;
  * LoRA vs no-LoRA training tokens/s (no-LoRA: the same forward + backward through every layer, driven by a leaf at
    the embedding output, with no adapter);
  * PublishWeights latency for a rank-32 adapter: device→host export of the full PEFT tensors + the safetensors blob
    (the registry upload is the registry's benchmark).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch


def sync():
    torch.cuda.synchronize()


def median_time(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns, repeat: int, warmup: int = 2) -> list[float]:
    """Median time of each function, measured round by round (A B C A B C ...)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, bucket in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            sync()
            bucket.append(time.perf_counter() - t0)
    return [statistics.median(bucket) for bucket in times]


def _pinned_bandwidth(nbytes: int) -> float:
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / median_time(lambda: buf.to("cuda", non_blocking=True), 5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--datums", type=int, default=16, help="datums per training batch")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="dtype of the LoRA matmuls (auto = --dtype)")
    ap.add_argument("--out", default="bench/results/trainer_megatron.json")
    args = ap.parse_args()

    from bench.harness import fresh_adapter_state, random_datums
    from loraplane.adapter_format import serialize_adapter
    from loraplane.models import load_base_model
    from trainer_svc.backends.base import BatchItem
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.backends.megatron.model import forward_logits, init_parallel, target_logprobs
    from trainer_svc.optimizer import AdamHyper

    init_parallel(1)
    dtype = getattr(torch, args.dtype)
    base = load_base_model(args.base_model, device="cpu", dtype=torch.float32)
    lora_dtype = None if args.lora_dtype == "auto" else getattr(torch, args.lora_dtype)
    backend = MegatronBackend(engine=Engine(base, device_slots=8, dtype=dtype, lora_compute_dtype=lora_dtype))
    engine = backend.engine
    hyper = AdamHyper(learning_rate=1e-4)
    g = torch.Generator().manual_seed(0)

    state = functools.partial(fresh_adapter_state, base, rank=args.rank)  # name -> a new adapter's state
    batch = functools.partial(random_datums, base.vocab_size, seq_len=args.seq_len, generator=g)  # n -> datums

    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "base_model": base.name, "rank": args.rank,
                                  "dtype": args.dtype, "lora_dtype": args.lora_dtype, "seq_len": args.seq_len, "datums_per_batch": args.datums,
                                  "torch": torch.__version__}

    # -- training throughput --------------------------------------------------------------------------------------
    tenants = [state(f"tenant{i}") for i in range(8)]
    for s in tenants:
        backend._ensure(s)
    tokens_per_batch = args.datums * args.seq_len
    one = tenants[0]
    data1 = batch(args.datums)

    def train_one():
        backend.run([BatchItem(one, data1, "cross_entropy", {})], backward=True)
        backend.optim_step(one, hyper)

    per_tenant = max(1, args.datums // 8)
    data8 = [batch(per_tenant) for _ in tenants]

    def train_fused8():
        backend.run([BatchItem(s, d, "cross_entropy", {}) for s, d in zip(tenants, data8)], backward=True)
        for s in tenants:
            backend.optim_step(s, hyper)

    rr_data = [batch(args.datums) for _ in tenants]

    def train_round_robin8():
        for s, d in zip(tenants, rr_data):
            backend.run([BatchItem(s, d, "cross_entropy", {})], backward=True)
            backend.optim_step(s, hyper)

    # Alternated, not one after the other: that machine's speed drifts by more than the effect being measured.
    t1, t8, trr = interleaved_medians([train_one, train_fused8, train_round_robin8], args.iters)
    results["tokens_per_s_1_tenant"] = tokens_per_batch / t1
    results["tokens_per_s_8_tenants_fused"] = per_tenant * 8 * args.seq_len / t8
    results["tokens_per_s_8_tenants_round_robin"] = 8 * tokens_per_batch / trr
    results["fused8_over_1"] = results["tokens_per_s_8_tenants_fused"] / results["tokens_per_s_1_tenant"]
    results["round_robin8_over_1"] = results["tokens_per_s_8_tenants_round_robin"] / results["tokens_per_s_1_tenant"]

    # -- LoRA vs no-LoRA --------------------------------------------------------------------------------------------
    ids = torch.stack([d.input_tokens for d in data1]).cuda()
    tgt = torch.stack([d.target_tokens for d in data1]).cuda()

    def leaf_at_embedding(_module, _inputs, output):
        return output.detach().requires_grad_(True)

    def no_lora_step():
        handle = engine.model.embedding.register_forward_hook(leaf_at_embedding)
        try:
            with torch.enable_grad():
                (-target_logprobs(forward_logits(engine.model, ids), tgt).sum()).backward()
        finally:
            handle.remove()

    t_nolora, t_lora_fb = interleaved_medians(
        [no_lora_step, lambda: backend.run([BatchItem(one, data1, "cross_entropy", {})], backward=True)], args.iters)
    results["tokens_per_s_no_lora_fwd_bwd"] = tokens_per_batch / t_nolora
    results["tokens_per_s_lora_fwd_bwd"] = tokens_per_batch / t_lora_fb
    results["tokens_per_s_lora_fwd_bwd_step"] = results["tokens_per_s_1_tenant"]
    results["lora_over_no_lora"] = results["tokens_per_s_lora_fwd_bwd"] / results["tokens_per_s_no_lora_fwd_bwd"]

    # -- activation ----------------------------------------------------------------------------------------------
    slot = engine.slot(one.name)
    slot_bytes = slot.host.numel() * slot.host.element_size()
    pinned = torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True)
    pinned_bw = slot_bytes / median_time(lambda: pinned.to("cuda", non_blocking=True), 20)
    pinned_bw_1g = _pinned_bandwidth(1 << 30)
    results["slot_bytes"] = slot_bytes
    results["pinned_h2d_GBps_slot_size"] = pinned_bw / 1e9
    results["pinned_h2d_GBps_1GiB"] = pinned_bw_1g / 1e9

    engine.activate([one.name])
    resident = []
    for _ in range(2000):
        t0 = time.perf_counter()
        engine.activate([one.name])
        resident.append(time.perf_counter() - t0)
    results["activation_resident_ms"] = statistics.median(resident) * 1e3

    # Spilled: two clean adapters alternate through one device slot (the evicted one is clean: no copy back).
    a, b = state("spill-a"), state("spill-b")
    backend._ensure(a)
    backend._ensure(b)
    engine.device_slots = 1
    for name in list(engine.resident):
        engine._spill(engine.slot(name))
    spilled = []
    for i in range(12):
        name = (a if i % 2 == 0 else b).name
        sync()
        spilled.append(engine.time_activation(name))
    t_spill = statistics.median(spilled[2:])
    results["activation_spilled_ms"] = t_spill * 1e3
    results["activation_spilled_GBps"] = slot_bytes / t_spill / 1e9
    results["activation_spilled_fraction_of_pinned"] = (slot_bytes / t_spill) / pinned_bw
    # The routing views into a freshly loaded buffer are built on its first forward (420 narrow+view for SmolLM2).
    t0 = time.perf_counter()
    engine.tensors(engine.slot(b.name))  # b was activated last
    results["first_use_views_ms"] = (time.perf_counter() - t0) * 1e3

    # Prefetch: start the copy of the next adapter, run a forward of the current one, then activate the next.
    engine.device_slots = 2
    fwd_data = batch(args.datums)
    waits = []
    for i in range(8):
        cur, nxt = (a, b) if i % 2 == 0 else (b, a)
        engine.activate([cur.name])
        for name in [n for n in list(engine.resident) if n != cur.name]:
            engine._spill(engine.slot(name))
        sync()
        backend.prefetch(nxt.name, protect=(cur.name,))
        backend.run([BatchItem(cur, fwd_data, "cross_entropy", {})], backward=False)
        sync()
        t0 = time.perf_counter()
        engine.activate([nxt.name])
        sync()
        waits.append(time.perf_counter() - t0)
    results["activation_after_prefetch_ms"] = statistics.median(waits[2:]) * 1e3
    engine.device_slots = 8

    # -- PublishWeights ------------------------------------------------------------------------------------------
    def publish():
        return serialize_adapter(backend.export_params(one), one.spec, base.name)

    blob = publish()
    results["publish_blob_bytes"] = len(blob)
    results["publish_export_serialize_ms"] = median_time(publish, 5) * 1e3

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    rows = [
        ("activation, resident (ms)", results["activation_resident_ms"], "<= 0.1"),
        ("activation, spilled (ms)", results["activation_spilled_ms"], ""),
        ("spilled activation GB/s", results["activation_spilled_GBps"], ""),
        ("pinned H2D GB/s (slot size)", results["pinned_h2d_GBps_slot_size"], ""),
        ("spilled / pinned bandwidth", results["activation_spilled_fraction_of_pinned"], ">= 0.8"),
        ("activation after prefetch (ms)", results["activation_after_prefetch_ms"], ""),
        ("first-use routing views (ms)", results["first_use_views_ms"], ""),
        ("tokens/s 1 tenant (fb+step)", results["tokens_per_s_1_tenant"], ""),
        ("tokens/s 8 tenants fused", results["tokens_per_s_8_tenants_fused"], ""),
        ("fused 8 / 1", results["fused8_over_1"], ">= 0.95"),
        ("round-robin 8 / 1", results["round_robin8_over_1"], ""),
        ("tokens/s LoRA fwd+bwd", results["tokens_per_s_lora_fwd_bwd"], ""),
        ("tokens/s no-LoRA fwd+bwd", results["tokens_per_s_no_lora_fwd_bwd"], ""),
        ("LoRA / no-LoRA", results["lora_over_no_lora"], ""),
        (f"PublishWeights export+serialize r{args.rank} (ms)", results["publish_export_serialize_ms"], ""),
    ]
    print(f"\n{'metric':45s} {'value':>12s}  target")
    for label, value, target in rows:
        print(f"{label:45s} {value:12.4g}  {target}")
    backend.close()


if __name__ == "__main__":
    main()
