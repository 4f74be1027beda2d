"""Micro-benchmark of the fused expert-LoRA forward kernel (trainer_svc/backends/megatron/fused_expert_lora.py)
against the unfused path it replaces, at Qwen3-30B-A3B's expert shapes: 8 x 2048 tokens, top-8 (131,072 expert
rows), 128 experts, one tenant's rank-32 per-expert LoRA (slots: the tenant and the no-adapter slot), bf16.

Unfused = what moe._ExpertMLP runs without the flag: the token gather (index_select), the base grouped GEMM
(kernels.segment_mm), the LoRA A grouped GEMM, the LoRA B grouped GEMM added into the output. Prints one JSON line
per GEMM (fc1 with the gather, fc2 on the rows) and a summary line: milliseconds per call (CUDA events, median of
--iters after --warmup), the speedup, and the worst |fused - reference| over its bf16 bound.

    python scripts/gpu/expert_kernels_bench.py [--tokens 16384] [--rank 32] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

# Tile shapes for --sweep: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the first is fused_forward's default.
SWEEP = ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 64, 64, 4, 3), (64, 128, 32, 4, 4),
         (128, 256, 64, 8, 3), (64, 256, 64, 8, 3))


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from trainer_svc.backends.megatron.fused_expert_lora import fused_forward, reference_forward
    from trainer_svc.backends.megatron.kernels import segment_mm

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the kernel's other tile shapes (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)")
    args = ap.parse_args()
    torch.set_float32_matmul_precision("highest")
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    slots = 2
    t, e, k = args.tokens, args.experts, args.top_k
    logits = torch.randn(t, e, generator=g, device=dev)
    top = torch.topk(logits, k, dim=-1).indices
    virtual = (top * slots).reshape(-1)  # every token in the tenant's slot 0
    order = torch.argsort(virtual, stable=True)
    tok = torch.div(order, k, rounding_mode="floor")
    counts = torch.bincount(virtual, minlength=e * slots)
    slot_offs = counts.cumsum(0).to(torch.int32)
    offs = counts.view(e, slots).sum(1).cumsum(0).to(torch.int32)
    rows = tok.shape[0]

    def measure(name: str, k_in: int, n_out: int, gather: bool) -> dict:
        x = (torch.randn(t if gather else rows, k_in, generator=g, device=dev)).to(bf)
        w = (torch.randn(e, n_out, k_in, generator=g, device=dev) * k_in**-0.5).to(bf)
        a = (torch.randn(e * slots, args.rank, k_in, generator=g, device=dev) * k_in**-0.5).to(bf)
        b = (torch.randn(e * slots, args.rank, n_out, generator=g, device=dev) * 0.5).to(bf)
        a[1::slots].zero_()  # the no-adapter slot
        b[1::slots].zero_()
        gather_index = tok if gather else None

        def unfused():
            xs = x.index_select(0, tok) if gather else x
            out = segment_mm(xs, w.transpose(1, 2), offs, None)
            mid = segment_mm(xs, a.transpose(1, 2), slot_offs, None)
            segment_mm(mid, b, slot_offs, None, acc=out)
            return out, mid

        def fused():
            return fused_forward(x, w, a, b, slot_offs, slots, gather_index)

        ref_out, _ = reference_forward(x, w, a, b, slot_offs, slots, gather_index)
        out, _ = fused()
        err = (out.float() - ref_out.float()).abs()
        scale = ref_out.float().abs().max().item()
        unfused_ms, fused_ms = timed(unfused, args.warmup, args.iters), timed(fused, args.warmup, args.iters)
        tiles = {}
        for bm, bn, bk, warps, stages in (SWEEP if args.sweep else ()):
            def shaped(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages):
                return fused_forward(x, w, a, b, slot_offs, slots, gather_index, block_m=bm, block_n=bn,
                                     block_k=bk, num_warps=warps, num_stages=stages)

            try:
                tiles[f"{bm}x{bn}x{bk}/w{warps}/s{stages}"] = round(timed(shaped, args.warmup, args.iters), 3)
            except Exception as failure:  # noqa: BLE001 - a shape this GPU cannot run: reported, not fatal
                tiles[f"{bm}x{bn}x{bk}/w{warps}/s{stages}"] = f"failed: {type(failure).__name__}"
        flops = 2 * rows * k_in * n_out + 2 * rows * args.rank * (k_in + n_out)
        row = {"gemm": name, "rows": rows, "in": k_in, "out": n_out, "rank": args.rank, "gather": gather,
               "unfused_ms": round(unfused_ms, 3), "fused_ms": round(fused_ms, 3),
               "speedup": round(unfused_ms / fused_ms, 3), "fused_tflops": round(flops / fused_ms / 1e9, 1),
               "unfused_tflops": round(flops / unfused_ms / 1e9, 1),
               "max_abs_err_over_scale": err.max().item() / scale, **({"tiles_ms": tiles} if tiles else {})}
        print(json.dumps(row), flush=True)
        return row

    results = [measure("fc1", args.hidden, 2 * args.ffn, True), measure("fc2", args.ffn, args.hidden, False)]
    print(json.dumps({"summary": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "unfused_ms": round(sum(r["unfused_ms"] for r in results), 3),
                      "fused_ms": round(sum(r["fused_ms"] for r in results), 3),
                      "speedup": round(sum(r["unfused_ms"] for r in results) / sum(r["fused_ms"] for r in results),
                                       3)}), flush=True)


if __name__ == "__main__":
    main()
