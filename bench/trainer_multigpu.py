"""The megatron trainer on several GPUs against one GPU: tokens/s, MFU and memory of a training step under torchrun.

    torchrun --standalone --nproc-per-node 2 bench/trainer_multigpu.py --shape llama8b --tp 1 --out dp2.json
    torchrun --standalone --nproc-per-node 2 bench/trainer_multigpu.py --shape llama8b --tp 2 --out tp2.json
    torchrun --standalone --nproc-per-node 4 bench/trainer_multigpu.py --shape llama70b --tp 4 --datums 8
    torchrun ... --nproc-per-node 2 bench/trainer_multigpu.py --cpu-dev --shape tiny    # CPU / gloo smoke run

Every rank builds its shard of the megatron GPTModel of a real model's shape with random weights directly on its
GPU (a 70B model never exists whole anywhere: the HF model the backend is handed lives on the meta device, and the
bench fills the shards instead of converting HF weights). Rank 0 drives the backend exactly as the torchrun
trainer's rank 0 does (``MegatronBackend`` over the ``Driver``; the other ranks follow), so a step is what a
ForwardBackward + OptimStep of the gRPC trainer runs: ``datums x seq_len`` tokens (split between data-parallel
ranks, and between ``--tenants`` adapters fused into one batch), rank-r LoRA on all seven projections, AdamW.

scripts/gpu/multi_gpu.sh runs the cases of docs/benchmarks.md back to back (one GPU, DP=2 and TP=2, one GPU again).
Prints one JSON line per run (``RESULT {...}``) and writes it to ``--out``: median / best tokens/s over the timed
rounds, the per-round step times (latency), MFU (4 x N x tokens over the GPUs' dense bf16 peak) and each rank's
peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from bench.harness import PEAK_BF16_FLOPS, SHAPES, TARGETS

SHAPES = {
    **SHAPES,
    "llama70b": {"arch": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                 "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    # A tiny shape whose heads and vocabulary split over 4 ranks (CPU smoke runs).
    "tiny-tp": {"arch": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
                "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-5},
}


def meta_hf_model(shape: str):
    """The HF model of the shape on the meta device: its config and parameter names, no memory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    fields = dict(SHAPES[shape])
    arch = fields.pop("arch")
    config = (LlamaConfig if arch == "llama" else Qwen3Config)(max_position_embeddings=8192, **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def count_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.no_grad()
def random_shards(model, _hf_state_dict, _spec) -> None:
    """Stands in for ``load_hf_weights``: each rank fills its own shards (norm weights 1, the rest N(0, 0.02));
    data-parallel replicas draw the same values (the seed follows the tensor- and expert-parallel ranks)."""
    from megatron.core import parallel_state as ps

    seed = 1234 + ps.get_tensor_model_parallel_rank() + 1000 * ps.get_expert_model_parallel_rank()
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
        p.requires_grad_(False)


def base_model(shape: str, device: torch.device, dtype: torch.dtype):
    from loraplane.models.base import BaseModel
    from loraplane.models.tiny import build_tiny_tokenizer

    hf = meta_hf_model(shape)
    cfg = hf.config
    block = hf.model.layers[0]
    dims = {name: (m.in_features, m.out_features) for name in TARGETS
            for m in [getattr(block.self_attn, name, None) or getattr(block.mlp, name)]}
    return BaseModel(name=shape, model=hf, tokenizer=build_tiny_tokenizer(), config=cfg, vocab_size=cfg.vocab_size,
                     max_context_length=cfg.max_position_embeddings, eos_token_ids=[0], device=device, dtype=dtype,
                     num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                     module_dims=dims), count_params(hf)


def recomputed(engine) -> int:
    """Decoder layers the last step recomputed (recompute=auto picks as many as the batch needs to fit)."""
    return int(getattr(engine.recompute, "count", 0))


def profile_step(step, path: Path, cuda: bool) -> None:
    """One step under the profiler: where its device time goes (kernel families, the device's busy share of the
    wall) and the top kernels, the evidence for a missed MFU target."""
    from torch.profiler import ProfilerActivity, profile

    from bench.harness import kernel_breakdown

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        began = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - began
    events = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    text = (kernel_breakdown(events, wall) if cuda else f"step wall {wall * 1e3:.1f} ms (profiled)") + "\n\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + events.table(sort_by=key, row_limit=40, max_name_column_width=90))
    print(text.strip(), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama8b", help=f"one of {sorted(SHAPES)}")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (data-parallel = world / tp)")
    ap.add_argument("--datums", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--tenants", type=int, default=1)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--recompute", default="auto", choices=["auto", "none", "full"])
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="the engine's micro-batch limit per rank (default: what fits without recomputation; 0: off)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None,
                    help="after the timed rounds, profile one more step on rank 0 and write its kernel families and "
                         "top kernels to this file (TP ranks run the same kernels; NCCL time includes waiting)")
    ap.add_argument("--cpu-dev", action="store_true", help="CPU ranks over gloo (tests/fixtures/megatron_cpu.py)")
    return ap.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.cpu_dev:
        import tests.fixtures.megatron_cpu  # noqa: F401
    from loraplane.lora import LoraSpec, init_lora_params
    from trainer_svc.backends.base import BatchItem, DatumInput
    from trainer_svc.backends.megatron import model as megatron_model
    from trainer_svc.backends.megatron.backend import Driver, MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.optimizer import AdamHyper
    from trainer_svc.pool import AdapterState

    megatron_model.init_parallel(args.tp)
    megatron_model.load_hf_weights = random_shards  # build_from_hf looks it up at call time
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    base, n_params = base_model(args.shape, device, dtype)
    t0 = time.perf_counter()
    engine = Engine(base, device_slots=max(8, args.tenants), dtype=dtype, recompute=args.recompute,
                    micro_batch_tokens=args.micro_batch_tokens)
    build_s = time.perf_counter() - t0
    driver = Driver(engine)
    world = dist.get_world_size()
    if dist.get_rank() != 0:
        driver.follow()
        result = None
    else:
        backend = MegatronBackend(engine=engine, driver=driver)
        names = [f"t{i}" for i in range(args.tenants)]
        states = {}
        for i, name in enumerate(names):
            spec = LoraSpec.create(args.rank, 2.0 * args.rank, list(TARGETS), seed=i, max_rank=max(128, args.rank))
            params = init_lora_params(base, spec)
            states[name] = AdapterState(name, spec, args.shape, params,
                                        {k: torch.zeros_like(v) for k, v in params.items()},
                                        {k: torch.zeros_like(v) for k, v in params.items()})
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(5, SHAPES[args.shape]["vocab_size"], (args.datums, args.seq_len + 1), generator=g)
        data = [DatumInput(tokens[i, :-1].clone(), tokens[i, 1:].clone()) for i in range(args.datums)]
        share = args.datums // args.tenants
        hyper = AdamHyper(learning_rate=1e-5)

        def step() -> float:
            items = [BatchItem(states[n], data[i * share:(i + 1) * share], "cross_entropy", {})
                     for i, n in enumerate(names)]
            results = backend.run(items, backward=True)
            for n in names:
                backend.optim_step(states[n], hyper)
            return sum(r.metrics["loss:sum"] for r in results)

        times, losses = [], []
        for i in range(args.warmup + args.rounds):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            losses.append(step())
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        n_tokens = share * args.tenants * args.seq_len
        med = statistics.median(times)
        peak = PEAK_BF16_FLOPS["H100"]
        name = torch.cuda.get_device_name() if cuda else "cpu"
        for key, value in PEAK_BF16_FLOPS.items():
            if key in name:
                peak = value
        result = {
            "label": args.label or f"{args.shape}_n{world}_tp{args.tp}", "shape": args.shape, "world": world,
            "tp": args.tp, "dp": world // args.tp, "datums": args.datums, "seq_len": args.seq_len,
            "tenants": args.tenants, "rank": args.rank, "device": name, "n_params": n_params,
            "tokens_per_step": n_tokens, "step_s": times, "step_s_median": med,
            "tokens_per_s": n_tokens / med, "tokens_per_s_best": n_tokens / min(times),
            "tokens_per_s_per_gpu": n_tokens / med / world,
            "mfu": (4 * n_params * n_tokens / med) / (peak * world) if cuda else None,
            "losses": losses, "build_s": build_s, "recompute_layers": recomputed(engine),
            "micro_batches_per_step": engine.stats.get("micro_batches", 0) / (args.warmup + args.rounds),
        }
        if args.profile:  # after the result, so the step counts above stay the timed ones
            profile_step(step, Path(args.profile), cuda)
        backend.close()  # releases the followers
    peak_gib = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0])
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, peak_gib, group=driver.group) if driver.group is not None else gathered.__setitem__(
        0, peak_gib)
    if result is not None:
        result["peak_gib_per_rank"] = [round(float(x), 2) for x in gathered]
        line = json.dumps(result)
        print("RESULT " + line, flush=True)
        print(f"{result['label']}: {result['tokens_per_s']:.0f} tok/s ({result['tokens_per_s_per_gpu']:.0f}/GPU), "
              f"step {med:.3f} s, MFU {result['mfu'] if result['mfu'] is None else round(100 * result['mfu'], 1)}%, "
              f"peak {result['peak_gib_per_rank']} GiB", flush=True)
        if args.out:
            Path(args.out).write_text(line + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return result



if __name__ == "__main__":
    main()
