"""Qwen3-MoE LoRA training: loraplane's megatron trainer against the Hugging Face + PEFT loop, and under expert
parallelism (issue 22's measurements).

    python bench/trainer_moe.py                                   # one GPU: the truncated Qwen3-30B-A3B (24 layers)
    python bench/trainer_moe.py --contenders shared_outer:1,shared_outer:8 --no-peft --recompute auto  # 8 fused vs 1
    torchrun --standalone --nproc-per-node 4 bench/trainer_moe.py --mode ep --shape qwen3-30b-a3b --contenders per_expert:1
    python bench/trainer_moe.py --shape tiny-moe --device cpu ...  # CPU (tests)

``--mode single`` builds one random-weight HF Qwen3-MoE model of the shape on the device (transformers'
``experts_implementation="grouped_mm"``) and times, alternately in rotated rounds on the same data:

* ``peft``: the loop a user writes with transformers 5 + PEFT: ``get_peft_model`` with rank-r LoRA on q, k, v, o
  (``target_modules``) and on the experts' fused 3-D parameters (``target_parameters``: ``mlp.experts.gate_up_proj``
  and ``mlp.experts.down_proj``, PEFT's per-expert layout), gradient checkpointing, fused AdamW, a summed
  cross-entropy;
* ``megatron/<layout>/<n>t``: loraplane's megatron backend through the trainer's domain service
  (``TrainerService``: validation, the scheduler's worker, one fused batch of n tenants, each its own AdamW step),
  rank-r LoRA on the same targets in ``layout`` (``per_expert`` or ``shared_outer``). Its MoE layers share the HF
  model's expert and embedding tensors (load_hf_weights shares what it would copy unchanged), so the 30B weights
  exist once on the GPU.

``--mode ep`` (under torchrun) builds every rank's shard of the megatron model directly (random weights; the HF
model exists only on the meta device), experts spread over all ranks (EP = world size, TP 1), and times the backend
as the torchrun trainer's rank 0 drives it (``MegatronBackend`` over the ``Driver``), one contender per run.

One step = forward + backward + AdamW over ``datums x seq_len`` tokens (n tenants split them). Contenders of one
layout share its tenants: ``shared_outer:1,shared_outer:8`` creates 8 tenants, and the 1-tenant contender trains the
first of them on all 8 datums while the 8-tenant one trains each on one: the same tokens per step, 8 slots. Prints JSON and a
table: tokens/s (median, fastest), MFU counted on ACTIVE parameters (4 x N_active x tokens: embeddings, attention,
routers and top-k of the E experts per layer, against 989 TFLOP/s dense bf16 per H100), peak GPU memory, the
bytes of one tenant slot on the device (fp32 params, grads, two AdamW moments) and, under EP, how many such slots
would fit beside the measured peak.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import environment
from bench.harness import (
    PEAK_BF16_FLOPS,
    Contender,
    DirectDriver,
    bench_limits,
    profile_steps,
    random_data,
    time_rounds,
)
from trainer_svc.validation import DatumPayload

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
_QWEN3_30B_A3B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                  "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 40960}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # Issue 22's truncated shape: both the PEFT loop and the trainer fit on one 80 GB GPU.
    "qwen3-30b-a3b-24l": {**_QWEN3_30B_A3B, "num_hidden_layers": 24},
    "tiny-moe": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                 "max_position_embeddings": 2048},
}


def moe_config(shape: str):
    from transformers import Qwen3MoeConfig

    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: one of {sorted(SHAPES)}")
    return Qwen3MoeConfig(**SHAPES[shape])


def active_params(config) -> tuple[int, int]:
    """(all parameters, active parameters per token): embeddings, head, norms, attention and routers in full, top-k
    of the E experts of each MoE layer (the N of 4 x N_active x tokens)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention = h * q + 2 * h * kv + q * h + 2 * config.head_dim + 2 * h
    expert = 3 * h * config.moe_intermediate_size
    router = config.num_experts * h
    embed = config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + h
    total = embed + layers * (attention + router + config.num_experts * expert)
    active = embed + layers * (attention + router + config.num_experts_per_tok * expert)
    return total, active


def build_hf_model(shape: str, device: torch.device, dtype: torch.dtype, experts_implementation: str, seed: int = 0):
    """A random-weight HF Qwen3-MoE model, allocated and initialized on ``device`` (N(0, 0.02), norms 1)."""
    from transformers import AutoModelForCausalLM

    config = moe_config(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                 experts_implementation=experts_implementation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.eval().requires_grad_(False)
    return model


def parse_contenders(text: str) -> list[tuple[str, int]]:
    out = []
    for item in [t for t in text.split(",") if t]:
        layout, _, n = item.partition(":")
        if layout not in ("per_expert", "shared_outer") or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--contenders {item!r}: LAYOUT:TENANTS with LAYOUT per_expert or shared_outer")
        out.append((layout, int(n)))
    return out


# -- the HF + PEFT loop -----------------------------------------------------------------------------------------------


def peft_contender(hf, ids, targets, rank: int, checkpointing: bool, lr: float, loss_dtype: str):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                          target_modules=list(ATTENTION),
                                          target_parameters=[f"mlp.{t}" for t in EXPERTS]))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing applies in training mode only; every dropout of the config is 0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                            fused=ids.device.type == "cuda")

    def step() -> float:
        logits = model(input_ids=ids).logits
        if loss_dtype == "fp32":
            logits = logits.float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                                 reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, sum(p.numel() for p in params)


# -- the megatron backend through the trainer's domain service ------------------------------------------------------


class ExpertDirectDriver(DirectDriver):
    """trainer_vs_peft's in-process driver, creating adapters with expert targets in a layout."""

    def __init__(self, backend, limits: dict, layout: str, available):
        super().__init__(backend, "megatron", limits)
        self.layout = layout
        self.available = available

    def create(self, name: str, rank: int, seed: int) -> None:
        from loraplane.lora import LoraSpec

        self.adopt(name, LoraSpec.create(rank, 2.0 * rank, [*ATTENTION, *EXPERTS], seed,
                                         max_rank=self.service.limits.max_lora_rank, expert_layout=self.layout,
                                         available=self.available))


def slot_bytes(engine, name: str) -> int:
    """Device bytes of one tenant slot on this rank: the flat fp32 buffer of params, grads and two moments."""
    s = engine.slots[name]
    return s.host.numel() * s.host.element_size()


def run_single(args, device: torch.device, dtype: torch.dtype) -> dict:
    from loraplane.models import families
    from loraplane.models.base import from_hf_model
    from loraplane.models.tiny import build_tiny_tokenizer
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.backends.megatron.model import init_parallel

    contenders_spec = parse_contenders(args.contenders)
    tokens = args.datums * args.seq_len
    for _, n in contenders_spec:
        if args.datums % n:
            raise SystemExit(f"--datums {args.datums} must split evenly between {n} tenants")
    t0 = time.perf_counter()
    hf = build_hf_model(args.shape, device, dtype, args.hf_experts)
    build_s = time.perf_counter() - t0
    n_params, n_active = active_params(hf.config)
    ids, tgt = random_data(hf.config.vocab_size, args.datums, args.seq_len)
    contenders: list[Contender] = []
    notes: list[str] = []
    closers = []
    slots: dict[str, str] = {}
    backend = None
    if contenders_spec:
        init_parallel(1)
        base = from_hf_model(f"{args.shape}-random", hf, build_tiny_tokenizer(), device=str(device), dtype=dtype)
        max_tenants = max(n for _, n in contenders_spec)
        tenants_of = {layout: max(n for lay, n in contenders_spec if lay == layout) for layout, _ in contenders_spec}
        options = {k: v for k, v in (("attention", args.attention), ("recompute", args.recompute)) if v}
        engine = Engine(base, device_slots=sum(tenants_of.values()), dtype=dtype,
                        lora_compute_dtype=None if args.lora_dtype == "auto" else getattr(torch, args.lora_dtype),
                        expert_lora_slots=args.expert_slots or max_tenants, **options)
        backend = MegatronBackend(engine=engine)
        limits = bench_limits(tokens, max_tenants, args.rank)
        limits["device_slots"] = max(limits["device_slots"], sum(tenants_of.values()))
        rows = [DatumPayload(ids[i].tolist(), tgt[i].tolist()) for i in range(args.datums)]
        available = families.lora_targets(hf.config)
        # One set of tenants per layout, as many as its largest contender fuses; a contender of n tenants trains the
        # first n of them on the same rows (8 tenants x 1 datum against 1 tenant x 8 datums: the same tokens per
        # step), so the comparison needs 8 slots on the device, not 9.
        drivers: dict[str, ExpertDirectDriver] = {}
        for layout, n in contenders_spec:
            if layout not in drivers:
                driver = drivers[layout] = ExpertDirectDriver(backend, limits, layout, available)
                closers.append(driver.close)
                for t in range(tenants_of[layout]):
                    driver.create(f"{layout}-{t}", args.rank, seed=100 + t)
            driver = drivers[layout]
            per = args.datums // n
            shares = {f"{layout}-{t}": rows[t * per : (t + 1) * per] for t in range(n)}
            label = f"megatron/{layout}/{n}t"
            contenders.append(Contender(label, driver.step_fn(shares, args.lr)))
            slots[label] = next(iter(shares))  # its first tenant: the slot's bytes once installed (first step)
    peft_params = None
    if not args.no_peft:
        step, peft_params = peft_contender(hf, ids.to(device), tgt.to(device), args.rank, args.peft_checkpointing,
                                           args.lr, args.peft_loss)
        contenders.insert(0, Contender("peft", step))
    try:
        time_rounds(contenders, args.rounds, args.warmup, device)
        if args.profile:
            profile_steps(contenders, Path(args.profile), device, args.shape)
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - the numbers are taken; report and go on
                notes.append(f"close: {type(exc).__name__}: {exc}")
    results = summarize(args, device, dtype, contenders, n_params, n_active, tokens, world=1)
    results.update({"mode": "single", "model_build_s": round(build_s, 2), "peft_lora_params": peft_params,
                    "hf_experts_implementation": args.hf_experts, "notes": notes,
                    "megatron_stats": dict(getattr(getattr(backend, "engine", None), "stats", {}) or {})})
    for label, tenant in slots.items():
        if tenant in backend.engine.slots:
            size = slot_bytes(backend.engine, tenant)
            results["contenders"][label].update({"slot_bytes": size, "slot_gib": round(size / 2**30, 3)})
    return results


# -- expert parallelism under torchrun --------------------------------------------------------------------------------


def meta_base(shape: str, device: torch.device, dtype: torch.dtype):
    """The BaseModel the engine is handed under EP: the HF model on the meta device (config, names, LoRA target
    dims), no memory; the shards are filled by :func:`random_shards`."""
    from transformers import AutoModelForCausalLM

    from loraplane.models import families
    from loraplane.models.base import BaseModel
    from loraplane.models.tiny import build_tiny_tokenizer

    config = moe_config(shape)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    h, f = config.hidden_size, config.moe_intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "experts.gate_up_proj": (h, 2 * f), "experts.down_proj": (f, h)}
    return BaseModel(name=shape, model=hf, tokenizer=build_tiny_tokenizer(), config=config,
                     vocab_size=config.vocab_size, max_context_length=config.max_position_embeddings,
                     eos_token_ids=[0], device=device, dtype=dtype, num_layers=config.num_hidden_layers,
                     hidden_size=h, module_dims=dims, layer_kinds=tuple(families.layer_kinds(config)),
                     num_experts=config.num_experts)


def run_ep(args, device: torch.device, dtype: torch.dtype) -> dict | None:
    import torch.distributed as dist

    from loraplane.lora import LoraSpec, init_lora_params
    from loraplane.models import families
    from trainer_svc.backends.base import BatchItem, DatumInput
    from trainer_svc.backends.megatron import model as megatron_model
    from trainer_svc.backends.megatron.backend import Driver, MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.optimizer import AdamHyper
    from trainer_svc.pool import AdapterState

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep = args.ep or world
    if args.stack_dump_s:
        # A rank that hangs (a build that never finishes, a collective one rank never joins) shows where it is.
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)
    megatron_model.init_parallel(1, expert_parallel_size=ep)
    from bench.trainer_multigpu import random_shards

    megatron_model.load_hf_weights = random_shards  # build_from_hf looks it up at call time
    (layout, tenants), = parse_contenders(args.contenders)[:1]
    base = meta_base(args.shape, device, dtype)
    n_params, n_active = active_params(base.config)
    t0 = time.perf_counter()
    engine = Engine(base, device_slots=max(8, tenants), dtype=dtype, expert_lora_slots=args.expert_slots or tenants,
                    recompute=args.recompute or "auto")
    build_s = time.perf_counter() - t0
    print(f"rank {os.environ.get('RANK', '0')}: model built in {build_s:.1f} s", flush=True)
    driver = Driver(engine)
    datums = args.datums * world  # --datums per rank: every data-parallel rank packs its own
    result = None
    if dist.get_rank() != 0:
        driver.follow()
    else:
        backend = MegatronBackend(engine=engine, driver=driver)
        available = families.lora_targets(base.config)
        states = {}
        for i in range(tenants):
            spec = LoraSpec.create(args.rank, 2.0 * args.rank, [*ATTENTION, *EXPERTS], seed=i,
                                   max_rank=max(128, args.rank), expert_layout=layout, available=available)
            params = init_lora_params(base, spec)
            states[f"t{i}"] = AdapterState(f"t{i}", spec, args.shape, params,
                                           {k: torch.zeros_like(v) for k, v in params.items()},
                                           {k: torch.zeros_like(v) for k, v in params.items()})
        ids, tgt = random_data(base.config.vocab_size, datums, args.seq_len)
        data = [DatumInput(ids[i].clone(), tgt[i].clone()) for i in range(datums)]
        share = datums // tenants
        hyper = AdamHyper(learning_rate=args.lr)

        def step() -> float:
            items = [BatchItem(state, data[i * share : (i + 1) * share], "cross_entropy", {})
                     for i, state in enumerate(states.values())]
            out = backend.run(items, backward=True)
            for state in states.values():
                backend.optim_step(state, hyper)
            return sum(r.metrics["loss:sum"] for r in out)

        contender = Contender(f"megatron/ep{ep}/{layout}/{tenants}t", step)
        time_rounds([contender], args.rounds, args.warmup, device)
        tokens = share * tenants * args.seq_len
        result = summarize(args, device, dtype, [contender], n_params, n_active, tokens, world=world)
        result.update({"mode": "ep", "ep": ep, "world": world, "model_build_s": round(build_s, 2),
                       "recompute_layers": int(getattr(engine.recompute, "count", 0)),
                       "megatron_stats": dict(engine.stats)})
        backend.close()  # releases the followers
    # Every rank's peak memory and slot bytes (per-expert factors are split over the EP ranks).
    cuda = device.type == "cuda"
    if result is not None:
        print(f"tok/s before the memory report: {json.dumps({k: v.get('tokens_per_s_median') for k, v in result['contenders'].items()})}",
              flush=True)
    if cuda:
        # NCCL's own small allocations come from outside torch's cache: a card the step filled has none left
        # (run s23: "Failed to CUDA calloc async 72 bytes" at the barrier after a per-expert 48-layer step).
        torch.cuda.empty_cache()
    mine = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                         slot_bytes(engine, "t0") / 2**30 if "t0" in engine.slots else 0.0,
                         torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else 0.0])
    gathered = [torch.zeros(3) for _ in range(world)]
    if driver.group is not None:
        dist.all_gather(gathered, mine, group=driver.group)
    else:
        gathered[0] = mine
    if result is not None:
        peaks = [round(float(g[0]), 2) for g in gathered]
        slot = max(float(g[1]) for g in gathered)
        total = min(float(g[2]) for g in gathered)
        entry = next(iter(result["contenders"].values()))
        entry.update({"peak_gib_per_rank": peaks, "slot_gib_per_rank": round(slot, 3),
                      "slot_bytes_per_rank": int(slot * 2**30)})
        if cuda and slot > 0:
            # Slots beyond the measured ones that the most loaded rank could still hold (10% of the card kept free).
            entry["more_slots_fit"] = int(max(0.0, 0.9 * total - max(peaks)) // slot)
    dist.barrier()
    dist.destroy_process_group()
    return result


# -- report -----------------------------------------------------------------------------------------------------------


def summarize(args, device, dtype, contenders, n_params: int, n_active: int, tokens: int, world: int) -> dict:
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None) if cuda else None
    results: dict[str, Any] = {
        "shape": args.shape, "device": name, "dtype": str(dtype).removeprefix("torch."), "rank": args.rank,
        "datums": args.datums, "seq_len": args.seq_len, "tokens_per_step": tokens, "n_params": n_params,
        "n_active_params": n_active, "rounds": args.rounds, "warmup": args.warmup, "peak_flops": peak,
        "recompute": args.recompute, "peft_gradient_checkpointing": args.peft_checkpointing,
        "peft_loss": args.peft_loss, "torch": torch.__version__, "environment": environment(), "contenders": {},
    }
    for c in contenders:
        entry: dict[str, Any] = {"error": c.error, "first_loss": c.first_loss}
        if c.times:
            med, best = statistics.median(c.times), min(c.times)
            entry.update({
                "step_ms_median": round(med * 1e3, 2), "step_ms_min": round(best * 1e3, 2),
                "tokens_per_s_median": round(tokens / med, 1), "tokens_per_s_fastest": round(tokens / best, 1),
                "tokens_per_s_per_gpu": round(tokens / med / world, 1),
                "mfu_active_median": round(4 * n_active * tokens / med / (peak * world), 4) if peak else None,
                "peak_mem_gib": round(c.peak_bytes / 2**30, 2) if cuda else None,
                "times_ms": [round(t * 1e3, 2) for t in c.times],
            })
        results["contenders"][c.label] = entry
    ref = results["contenders"].get("peft", {}).get("tokens_per_s_median")
    for label, entry in results["contenders"].items():
        if ref and entry.get("tokens_per_s_median"):
            entry["vs_peft"] = round(entry["tokens_per_s_median"] / ref, 3)
        one = results["contenders"].get(label.rsplit("/", 1)[0] + "/1t", {}).get("tokens_per_s_median")
        if "/" in label and one and entry.get("tokens_per_s_median"):
            entry["vs_1t"] = round(entry["tokens_per_s_median"] / one, 3)
    # Same model, same data, adapters that start as the base model (B = 0): every first loss must agree.
    losses = [e["first_loss"] for e in results["contenders"].values() if e.get("first_loss") is not None]
    if losses:
        results["first_loss_rel_spread"] = round(
            (max(losses) - min(losses)) / max(abs(statistics.median(losses)), 1e-9), 6)
    return results


def print_table(results: dict) -> None:
    columns = ["contender", "tok/s median", "tok/s fastest", "tok/s/GPU", "MFU(active)", "peak GiB", "slot GiB",
               "vs peft", "vs 1t"]
    print(f"{results['shape']} ({results['n_params'] / 1e9:.2f}B params, {results['n_active_params'] / 1e9:.2f}B "
          f"active), {results['datums']} x {results['seq_len']} tokens, rank {results['rank']}, {results['device']}, "
          f"{results['dtype']}")
    print(f"{columns[0]:<32}" + "".join(f"{c:>14}" for c in columns[1:]))
    for label, e in results["contenders"].items():
        if e.get("error") or not e.get("times_ms"):
            print(f"{label:<32}  {e.get('error') or 'no timed rounds'}")
            continue
        cells = [f"{e['tokens_per_s_median']:.0f}", f"{e['tokens_per_s_fastest']:.0f}",
                 f"{e['tokens_per_s_per_gpu']:.0f}",
                 f"{e['mfu_active_median']:.1%}" if e.get("mfu_active_median") is not None else "-",
                 f"{e['peak_mem_gib']:.1f}" if e.get("peak_mem_gib") is not None else "-",
                 f"{e['slot_gib']:.2f}" if e.get("slot_gib") is not None else (
                     f"{e['slot_gib_per_rank']:.2f}" if e.get("slot_gib_per_rank") is not None else "-"),
                 f"{e['vs_peft']:.2f}x" if e.get("vs_peft") else "-", f"{e['vs_1t']:.2f}x" if e.get("vs_1t") else "-"]
        print(f"{label:<32}" + "".join(f"{c:>14}" for c in cells))
        if e.get("peak_gib_per_rank"):
            print(f"{'':<32}  peak GiB per rank {e['peak_gib_per_rank']}; more slots that fit: "
                  f"{e.get('more_slots_fit', '-')}")
    for note in results.get("notes", []):
        print("note:", note)
    print(f"first-step losses agree within {results.get('first_loss_rel_spread')} (relative)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="single", choices=["single", "ep"])
    ap.add_argument("--shape", default=None, help=f"one of {sorted(SHAPES)} (default: qwen3-30b-a3b-24l; ep: "
                                                  "qwen3-30b-a3b)")
    ap.add_argument("--contenders", default="per_expert:1,shared_outer:1",
                    help="comma list of LAYOUT:TENANTS backend contenders (ep: the first one)")
    ap.add_argument("--no-peft", action="store_true", help="leave the PEFT loop out")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on CUDA, else fp32")
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--hf-experts", default="grouped_mm", help="transformers' experts_implementation for PEFT")
    ap.add_argument("--attention", default=None, choices=["sdpa", "unfused"])
    ap.add_argument("--recompute", default="full", choices=["auto", "none", "full", "selective"],
                    help="megatron's activation recomputation (full: as the PEFT loop's gradient checkpointing; "
                         "selective: every layer's attention half, the experts' activations kept)")
    ap.add_argument("--peft-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peft-loss", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--expert-slots", type=int, default=0,
                    help="adapters with expert LoRA one batch may fuse (default: the largest tenant count)")
    ap.add_argument("--ep", type=int, default=0, help="ep mode: expert-parallel size (default: world size)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--datums", type=int, default=8, help="datums per step (ep: per rank)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--cpu-dev", action="store_true", help="ep mode on CPU ranks over gloo (tests/fixtures/megatron_cpu.py)")
    ap.add_argument("--profile", default=None,
                    help="single mode: a folder for one profiled step per contender (kernel families, top ops)")
    ap.add_argument("--stack-dump-s", type=float, default=0.0,
                    help="ep mode: every N seconds each rank prints its Python stacks to stderr (0: never)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    args.shape = args.shape or ("qwen3-30b-a3b" if args.mode == "ep" else "qwen3-30b-a3b-24l")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.cpu_dev or not torch.cuda.is_available():
        import tests.fixtures.megatron_cpu  # noqa: F401  (megatron-core on CPU)
    if args.mode == "ep" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    results = run_single(args, device, dtype) if args.mode == "single" else run_ep(args, device, dtype)
    if results is None:
        return None
    print_table(results)
    line = json.dumps(results)
    print("RESULT " + line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
