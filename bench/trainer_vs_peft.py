"""loraplane's trainer against the plain Hugging Face + PEFT loop a user would write instead, side by side.

    python bench/trainer_vs_peft.py --cpu                      # torch backend on CPU: SmolLM2 shape, rank 16, 8 x 64
    python bench/trainer_vs_peft.py --shape llama1b --backend megatron --datums 16 --seq-len 512 --tenants 1,8
    python bench/trainer_vs_peft.py --shape llama8b --backend megatron --datums 4 --seq-len 512
    python bench/trainer_vs_peft.py --shape /path/to/hf-dir ...  # any local HF Llama/Qwen directory

Builds one random-weight HF model of the named shape (``smollm2``, ``llama1b`` = Llama-3.2-1B, ``llama8b`` =
Llama-3-8B, ``qwen3-8b``, ``tiny``; or a local HF directory: its config, random weights) directly on the target
device, then times these contenders on the same data, alternately in rotated rounds (A B C, B C A, ...) so drift hits
all alike:

* ``peft``: what a user writes today: ``get_peft_model`` (rank-r LoRA on all seven projections, fp32 adapter
  weights, PEFT's default), SDPA attention, ``torch.optim.AdamW`` (fused on CUDA), a summed cross-entropy, and
  gradient checkpointing for 8B-class models (``--peft-checkpointing auto``) as PEFT users do there;
* ``<backend>/direct/<n>t``: loraplane's backend driven in-process through the trainer's domain service
  (``TrainerService``: validation, the scheduler's worker, fused batches of n tenants, each its own AdamW step);
* ``<backend>/grpc/<n>t``: the same through the real gRPC trainer_svc (with a real registry: Valkey + SeaweedFS)
  and the python client (``ServiceClient`` / ``TrainingClient``), as an application calls it.

One step = forward + backward + AdamW over ``datums x seq_len`` tokens (n tenants split the datums between them, so
every contender trains the same tokens per step). Prints tokens/s (median and fastest round), MFU on CUDA
(4 * N_params * tokens FLOPs: LoRA training has no weight gradients, against 989 TFLOP/s dense bf16 on an H100),
peak GPU memory of each contender's step and the ratios against ``peft``; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import environment
from bench.harness import (
    PEAK_BF16_FLOPS,
    SHAPES,
    Contender,
    DirectDriver,
    GrpcDriver,
    bench_limits,
    build_backend,
    build_hf_model,
    count_params,
    model_targets,
    peft_targets,
    profile_steps,
    random_data,
    time_rounds,
)
from loraplane.errors import ResourceExhausted
from trainer_svc.validation import DatumPayload

CPU_PRESET = {"shape": "smollm2", "device": "cpu", "backend": "torch", "rank": 16, "datums": 8, "seq_len": 64,
              "tenants": "1,8", "modes": "direct,grpc", "dtype": "float32"}


# -- the plain HF + PEFT loop ----------------------------------------------------------------------------------------


def peft_contender(hf, ids: torch.Tensor, targets: torch.Tensor, rank: int, checkpointing: bool, lr: float,
                   loss_dtype: str = "fp32"):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                          **peft_targets(model_targets(hf))))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # HF applies gradient checkpointing in training mode only; every dropout of these configs is 0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                            fused=ids.device.type == "cuda")

    def step() -> float:
        logits = model(input_ids=ids).logits
        if loss_dtype == "fp32":  # what HF's own loss does (labels=...): upcast the logits
            logits = logits.float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                                 reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # a user logs the loss: one sync per step, as the trainer's reply has

    return step, model


def torch_backend_facts(backend, hf, rank: int, tokens: int, device: torch.device) -> dict[str, Any]:
    """What the torch backend ran with: the packed rows' implementation, fla's state, the recomputation of the last
    step and the memory plan of one adapter slot at this step's tokens (empty for another backend)."""
    from trainer_svc.backends.torch_backend import TorchBackend

    if not isinstance(backend, TorchBackend):
        return {}
    from importlib import metadata

    from loraplane.lora import LoraSpec
    from loraplane.models import packed

    unusable = packed.fla_unusable(device) if device.type == "cuda" else "not a CUDA device"
    try:
        fla = f"fla-core {metadata.version('fla-core')}, triton {metadata.version('triton')}"
    except metadata.PackageNotFoundError:
        fla = "fla not installed"
    spec = LoraSpec.create(rank, 2.0 * rank, list(model_targets(hf)), 0, max_rank=max(rank, 256))
    return {"packed_impl": packed.packed_impl(device, fla=True), "fla": fla if unusable is None else
            f"{fla}; not used: {unusable}", "recompute": backend.recompute.mode,
            "recomputed_layers": len(backend.recompute.selected), "layers": len(backend.recompute.layers),
            "memory_plan": {k: round(v, 2) for k, v in backend.memory_plan(spec, tokens).items()}}


def _facts_or_error(*args) -> dict[str, Any]:
    try:
        return torch_backend_facts(*args)
    except Exception as exc:  # noqa: BLE001 - the numbers are taken; say what went wrong
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


# -- the run ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help=f"the CPU preset: {CPU_PRESET}")
    ap.add_argument("--shape", default="llama1b", help=f"one of {sorted(SHAPES)} or a local HF directory")
    ap.add_argument("--backend", default=None, choices=["torch", "megatron"],
                    help="default: megatron on CUDA, torch on CPU")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="base weights (default bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="megatron's LoRA matmul dtype (auto = the backend's default)")
    ap.add_argument("--attention", default=None, choices=["sdpa", "unfused"],
                    help="megatron's core attention (default: the backend's)")
    ap.add_argument("--recompute", default=None, choices=["auto", "none", "full"],
                    help="the backend's activation recomputation (default: the backend's; torch: auto)")
    ap.add_argument("--packed-impl", default=None, choices=["auto", "exact", "batched", "fla"],
                    help="how the families' per-datum pieces of a packed row run, both backends (default auto: "
                         "fla where usable, else batched, on CUDA; exact per datum on CPU)")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--datums", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tenants", default="1,8", help="comma list of tenant counts for the backend contenders")
    ap.add_argument("--modes", default=None, help="comma list of direct,grpc (default: direct on CUDA, both on CPU)")
    ap.add_argument("--no-peft", action="store_true", help="leave the PEFT loop out")
    ap.add_argument("--peft-checkpointing", default="auto", choices=["auto", "on", "off"],
                    help="gradient checkpointing in the PEFT loop (auto: on from 6B parameters)")
    ap.add_argument("--peft-loss", default="fp32", choices=["fp32", "bf16"],
                    help="the PEFT loop's cross-entropy on fp32-upcast logits (HF's own loss does this) or on the "
                         "model-dtype logits (what a user does when the upcast runs out of memory)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--profile", default=None,
                    help="after timing, profile one step of peft and of the first backend contender into DIR")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/trainer_vs_peft_<shape>.json)")
    args = ap.parse_args(argv)
    if args.cpu:
        given = {a.split("=")[0].lstrip("-").replace("-", "_")
                 for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in CPU_PRESET.items():
            if key not in given:
                setattr(args, key, value)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    backend_kind = args.backend or ("megatron" if device.type == "cuda" else "torch")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    lora_dtype = None if args.lora_dtype == "auto" else getattr(torch, args.lora_dtype)
    modes = (args.modes or ("direct" if device.type == "cuda" else "direct,grpc")).split(",")
    tenant_counts = [int(t) for t in str(args.tenants).split(",") if t]
    for n in tenant_counts:
        if args.datums % n:
            raise SystemExit(f"--datums {args.datums} must split evenly between {n} tenants")
    if device.type == "cpu":
        torch.set_num_threads(torch.get_num_threads())
    shape_name = Path(args.shape).name if Path(args.shape).is_dir() else args.shape
    tokens = args.datums * args.seq_len

    t0 = time.perf_counter()
    hf = build_hf_model(args.shape, device, dtype)
    n_params = count_params(hf)
    build_s = time.perf_counter() - t0
    ids, tgt = random_data(hf.config.vocab_size, args.datums, args.seq_len)
    checkpointing = args.peft_checkpointing == "on" or (args.peft_checkpointing == "auto" and n_params >= 6e9)

    contenders: list[Contender] = []
    notes: list[str] = []
    closers = []
    backend = None
    if any(mode in ("direct", "grpc") for mode in modes) and tenant_counts:
        qk_norm = getattr(hf.config, "model_type", "") == "qwen3"
        if backend_kind == "megatron" and qk_norm:
            notes.append("megatron backend: Qwen3's q/k norms are not supported; its contenders were left out")
        else:
            options = {k: v for k, v in (("attention", args.attention), ("recompute", args.recompute)) if v}
            # Both backends read the packed implementation from the environment, the torch backend its
            # recomputation too (bench.harness builds it with defaults).
            from loraplane.models.packed import IMPL_ENV

            if args.packed_impl:
                os.environ[IMPL_ENV] = args.packed_impl
            if backend_kind == "torch" and args.recompute:
                from trainer_svc.backends.torch_backend import RECOMPUTE_ENV

                os.environ[RECOMPUTE_ENV] = args.recompute
            # A device slot for every adapter of every contender: they alternate, and a deployment with n tenants
            # on n slots never spills (spills are bench/trainer_megatron.py's subject).
            slots = max(8, sum(tenant_counts) * len(modes))
            backend = build_backend(backend_kind, hf, f"{shape_name}-random", device, dtype, lora_dtype,
                                    slots=slots, megatron_options=options, own_copy=not args.no_peft)
    if args.no_peft and backend_kind == "megatron" and device.type == "cuda" and backend is not None:
        # The engine holds its own converted copy; without PEFT the HF weights need not stay on the device (the
        # launcher loads them on the host), so the memory picture is the deployment's.
        hf.to("cpu")
        torch.cuda.empty_cache()
    rows_data = [DatumPayload(ids[i].tolist(), tgt[i].tolist()) for i in range(args.datums)]
    work = Path(tempfile.mkdtemp(prefix="bench-vs-peft-"))
    if backend is not None:
        limits = bench_limits(tokens, max(tenant_counts), args.rank)
        limits["device_slots"] = max(limits["device_slots"], sum(tenant_counts) * len(modes))
        for mode in modes:
            try:
                driver = DirectDriver(backend, backend_kind, limits) if mode == "direct" else (
                    GrpcDriver(backend, backend_kind, limits, work / "grpc"))
            except Exception as exc:  # noqa: BLE001 - e.g. no Valkey/SeaweedFS binaries on the GPU machine
                notes.append(f"{mode}: not run ({type(exc).__name__}: {exc})")
                continue
            closers.append(driver.close)
            for n in tenant_counts:
                per = args.datums // n
                shares = {}
                try:
                    for t in range(n):
                        name = f"{mode}-{n}t-{t}"
                        driver.create(name, args.rank, seed=100 + t, targets=model_targets(hf))
                        shares[name] = rows_data[t * per : (t + 1) * per]
                except ResourceExhausted as exc:  # the backend's memory plan refused the adapter before a step
                    notes.append(f"{backend_kind}/{mode}/{n}t: not run: {exc}")
                    continue
                contenders.append(Contender(f"{backend_kind}/{mode}/{n}t", driver.step_fn(shares, args.lr)))
    if not args.no_peft:
        ids_d, tgt_d = ids.to(device), tgt.to(device)
        step, _peft_model = peft_contender(hf, ids_d, tgt_d, args.rank, checkpointing, args.lr, args.peft_loss)
        contenders.insert(0, Contender("peft", step))

    try:
        time_rounds(contenders, args.rounds, args.warmup, device)
        if args.profile:
            case = Path(args.out).stem if args.out else f"{Path(args.shape).name}_{args.datums}x{args.seq_len}"
            profile_steps([c for c in contenders if c.error is None][:2], Path(args.profile), device, case)
    finally:
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - the numbers are taken; report and go on
                notes.append(f"close: {type(exc).__name__}: {exc}")

    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if device.type == "cuda"
                 and k in torch.cuda.get_device_name(device)), None)
    results: dict[str, Any] = {
        "shape": shape_name, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": backend_kind, "dtype": str(dtype).removeprefix("torch."), "lora_dtype": args.lora_dtype,
        "rank": args.rank, "datums": args.datums, "seq_len": args.seq_len, "tokens_per_step": tokens,
        "n_params": n_params, "peft_gradient_checkpointing": checkpointing, "peft_loss": args.peft_loss,
        "rounds": args.rounds,
        "warmup": args.warmup, "torch": torch.__version__, "model_build_s": round(build_s, 2),
        "peak_flops": peak, "attention": args.attention, "recompute": args.recompute,
        "megatron_compile": os.environ.get("LORAPLANE_MEGATRON_COMPILE", "1"),
        "megatron_stats": dict(getattr(getattr(backend, "engine", None), "stats", {}) or {}),
        "torch_backend": _facts_or_error(backend, hf, args.rank, tokens, device),
        "environment": environment(), "notes": notes, "contenders": {},
    }
    for c in contenders:
        entry: dict[str, Any] = {"error": c.error, "first_loss": c.first_loss}
        if c.times:
            med, best = statistics.median(c.times), min(c.times)
            entry.update({
                "step_ms_median": round(med * 1e3, 2), "step_ms_min": round(best * 1e3, 2),
                "tokens_per_s_median": round(tokens / med, 1), "tokens_per_s_fastest": round(tokens / best, 1),
                "mfu_median": round(4 * n_params * tokens / med / peak, 4) if peak else None,
                "peak_mem_gib": round(c.peak_bytes / 2**30, 2) if device.type == "cuda" else None,
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
        spread = (max(losses) - min(losses)) / max(abs(statistics.median(losses)), 1e-9)
        results["first_loss_rel_spread"] = round(spread, 6)

    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / (
        f"trainer_vs_peft_{shape_name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    rows = []
    for label, e in results["contenders"].items():
        if e.get("error"):
            rows.append((label, "-", "-", "-", "-", "-", "-"))
            notes.append(f"{label}: {e['error']}")
            continue
        rows.append((label, f"{e['tokens_per_s_median']:.0f}", f"{e['tokens_per_s_fastest']:.0f}",
                     f"{e['mfu_median']:.1%}" if e.get("mfu_median") is not None else "-",
                     f"{e['peak_mem_gib']:.1f}" if e.get("peak_mem_gib") is not None else "-",
                     f"{e['vs_peft']:.2f}x" if e.get("vs_peft") else "-",
                     f"{e['vs_1t']:.2f}x" if e.get("vs_1t") else "-"))
    title = (f"{shape_name} ({n_params / 1e9:.2f}B params), {args.datums} x {args.seq_len} tokens, rank {args.rank}, "
             f"{results['device']}, {results['dtype']}; peft: {args.peft_loss} loss, "
             f"gradient checkpointing {'on' if checkpointing else 'off'}")
    columns = ["contender", "tok/s median", "tok/s fastest", "MFU", "peak GiB", "vs peft", "vs 1t"]
    print(title)
    print(f"{columns[0]:<24}" + "".join(f"{c:>14}" for c in columns[1:]))
    for row in rows:
        print(f"{row[0]:<24}" + "".join(f"{c:>14}" for c in row[1:]))
    for note in notes:
        print("note:", note)
    facts = results["torch_backend"]
    if facts.get("error"):
        print(f"torch backend: {facts['error']}")
    elif facts:
        plan = facts.get("memory_plan", {})
        print(f"torch backend: packed rows {facts['packed_impl']} ({facts['fla']}), recompute {facts['recompute']}: "
              f"{facts['recomputed_layers']} of {facts['layers']} layers in the last step; memory GiB: "
              + ", ".join(f"{k.removesuffix('_gib')} {v:.1f}" for k, v in plan.items()))
    print(f"first-step losses agree within {results.get('first_loss_rel_spread')} (relative); JSON: {out}")
    return results


if __name__ == "__main__":
    main()
