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
import asyncio
import copy
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import environment
from trainer_svc.validation import DatumPayload

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak (SXM)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Real models' shapes (random weights: throughput does not depend on the values).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"arch": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5},
    "smollm2": {"arch": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5},
    # Llama-3.2-1B (its llama3 rope scaling left out: it changes no FLOPs and the megatron backend refuses it).
    "llama1b": {"arch": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "llama8b": {"arch": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "qwen3-8b": {"arch": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}
CPU_PRESET = {"shape": "smollm2", "device": "cpu", "backend": "torch", "rank": 16, "datums": 8, "seq_len": 64,
              "tenants": "1,8", "modes": "direct,grpc", "dtype": "float32"}


def build_hf_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight HF causal LM of the shape, allocated and initialized on ``device`` (an 8B model never
    passes through host memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if shape in SHAPES:
        fields = dict(SHAPES[shape])
        arch = fields.pop("arch")
        config = (LlamaConfig if arch == "llama" else Qwen3Config)(max_position_embeddings=8192, **fields)
    elif Path(shape).is_dir():
        config = AutoConfig.from_pretrained(shape, local_files_only=True)
    else:
        raise SystemExit(f"--shape {shape!r}: not one of {sorted(SHAPES)} and not a local HF directory")
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to(dtype)
    model.eval().requires_grad_(False)
    return model


def count_params(model) -> int:
    """Unique parameters (tied embeddings once), the N of 4 * N * tokens."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Contender:
    label: str
    step: Any  # () -> loss of the step (float)
    close: Any = None
    first_loss: float | None = None
    times: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    error: str | None = None


# -- the plain HF + PEFT loop ----------------------------------------------------------------------------------------


def peft_contender(hf, ids: torch.Tensor, targets: torch.Tensor, rank: int, checkpointing: bool, lr: float,
                   loss_dtype: str = "fp32"):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                          target_modules=list(TARGETS)))
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


# -- loraplane's backend through the domain service -------------------------------------------------------------------


def build_backend(kind: str, hf, name: str, device: torch.device, dtype: torch.dtype, lora_dtype, slots: int,
                  megatron_options: dict | None = None):
    from loraplane.models.base import from_hf_model
    from loraplane.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    if kind == "torch":
        from trainer_svc.backends.torch_backend import TorchBackend

        # Its own copy: PEFT injects its layers into the model it wraps.
        return TorchBackend(from_hf_model(name, copy.deepcopy(hf), tokenizer, device=str(device), dtype=dtype))
    if kind == "megatron":
        from trainer_svc.backends.megatron.backend import MegatronBackend
        from trainer_svc.backends.megatron.engine import Engine
        from trainer_svc.backends.megatron.model import init_parallel

        init_parallel(1)
        base = from_hf_model(name, hf, tokenizer, device=str(device), dtype=dtype)  # same tensors, no copy
        return MegatronBackend(engine=Engine(base, device_slots=slots, dtype=dtype, lora_compute_dtype=lora_dtype,
                                             **(megatron_options or {})))
    raise SystemExit(f"unknown backend {kind!r}")


def service_class_for(kind: str):
    if kind == "megatron":
        from trainer_svc.service import TrainerService as MegatronTrainerService

        return MegatronTrainerService
    from trainer_svc.service import TrainerService

    return TrainerService


def bench_limits(n_tokens: int, tenants: int, rank: int) -> dict:
    big = max(n_tokens, 16384)
    return {"max_fused_tokens": big, "max_request_tokens": max(big, 65536), "device_slots": max(8, tenants),
            "max_fused_adapters": max(8, tenants), "max_lora_rank": max(128, rank)}


class DirectDriver:
    """The backend behind ``TrainerService`` in this process: the scheduler's worker thread runs the batches."""

    def __init__(self, backend, kind: str, limits: dict):
        from trainer_svc.service import TrainerLimits

        self.loop = asyncio.new_event_loop()
        self.service = service_class_for(kind)(backend, None, TrainerLimits(**limits))  # no registry: no publish
        self.seq: dict[str, int] = {}

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def create(self, name: str, rank: int, seed: int) -> None:
        """What CreateAdapter does on the trainer, minus the registry record (nothing is published here)."""
        from loraplane.lora import LoraSpec
        from trainer_svc.journal import AdapterRecord

        svc = self.service
        spec = LoraSpec.create(rank, 2.0 * rank, list(TARGETS), seed, max_rank=svc.limits.max_lora_rank)
        record = AdapterRecord(name=name, rank=spec.rank, alpha=spec.alpha, target_modules=list(spec.target_modules),
                               seed=spec.seed, base_model=svc.base_model, uid=uuid.uuid4().hex)

        async def go():
            svc._loop = asyncio.get_running_loop()
            await svc._on_worker(lambda: svc._new_state(record, spec))
            svc._adopt(record)
            svc.scheduler.open_lane(name)

        self.run(go())
        self.seq[name] = 0

    def step_fn(self, shares: dict[str, list[DatumPayload]], lr: float):
        from trainer_svc.optimizer import AdamHyper

        svc = self.service
        hyper = AdamHyper(learning_rate=lr)

        def next_seq(name: str) -> int:
            self.seq[name] += 1
            return self.seq[name]

        async def go() -> float:
            # Held while the n requests queue, so they run as one fused batch (what the batch window gives
            # concurrent clients, without its wait).
            svc.scheduler.hold()
            try:
                tasks = [asyncio.ensure_future(svc.forward_backward(
                    name, next_seq(name), data, "cross_entropy", {},
                    payload_hash=hashlib.sha256(f"{name}:{self.seq[name]}".encode()).digest()))
                    for name, data in shares.items()]
                await asyncio.sleep(0)
            finally:
                svc.scheduler.release()
            results = await asyncio.gather(*tasks)
            await asyncio.gather(*[svc.optim_step(name, next_seq(name), hyper,
                                                  hashlib.sha256(f"{name}:{self.seq[name]}".encode()).digest())
                                   for name in shares])
            return sum(r.metrics["loss:sum"] for r in results)

        return lambda: self.run(go())

    def close(self) -> None:
        self.run(self.service.close())
        self.loop.close()


class GrpcDriver:
    """The real trainer_svc over gRPC, with a real registry (Valkey + SeaweedFS), driven by the python client."""

    def __init__(self, backend, kind: str, limits: dict, work: Path):
        from loraplane.config import Settings
        from loraplane.local.processes import seaweed_s3_server, valkey_server
        from loraplane.rpc import BackgroundLoop
        from registry_svc.server import start_registry_server
        from trainer_svc.server import start_trainer_server

        self.valkey = valkey_server(work / "valkey")
        self.seaweed = seaweed_s3_server(work / "seaweed")
        self.valkey.start()
        self.seaweed.start()
        self.loop = BackgroundLoop("bench-trainer-vs-peft")
        settings = Settings(redis_url=self.valkey.url, s3_endpoint=self.seaweed.endpoint,
                            s3_access_key=self.seaweed.access_key, s3_secret_key=self.seaweed.secret_key,
                            s3_bucket="bench-vs-peft", key_prefix="bench:")
        self.registry = self.loop.run(start_registry_server(settings), timeout=60)
        # A short batch window lets the n tenants' concurrent requests fuse, as they do for concurrent clients.
        self.trainer = self.loop.run(start_trainer_server(
            settings, registry_address=self.registry.address, backend=backend,
            service_class=service_class_for(kind), batch_window_s=0.002, **limits), timeout=300)
        from loraplane.client import ServiceClient

        self.client = ServiceClient(trainer=self.trainer.address, registry=self.registry.address)
        self.training: dict[str, Any] = {}

    def create(self, name: str, rank: int, seed: int) -> None:
        self.training[name] = self.client.create_lora_training_client(rank=rank, alpha=2.0 * rank, seed=seed,
                                                                      name=name)

    def step_fn(self, shares: dict[str, list[DatumPayload]], lr: float):
        from loraplane.client import AdamParams, Datum, ModelInput

        payloads = {name: [Datum(model_input=ModelInput.from_ints(d.input_tokens),
                                 loss_fn_inputs={"target_tokens": d.target_tokens}) for d in data]
                    for name, data in shares.items()}

        def step() -> float:
            # Pipelined as the client allows: every forward_backward, then every optim_step, then the results.
            fbs = [self.training[name].forward_backward(data, "cross_entropy") for name, data in payloads.items()]
            steps = [self.training[name].optim_step(AdamParams(learning_rate=lr)) for name in payloads]
            loss = sum(f.result().loss for f in fbs)
            for s in steps:
                s.result()
            return loss

        return step

    def close(self) -> None:
        self.client.close()
        self.loop.run(self.trainer.stop(), timeout=120)
        self.loop.run(self.registry.stop(), timeout=60)
        self.loop.close()
        self.seaweed.stop()
        self.valkey.stop()


# -- the run ---------------------------------------------------------------------------------------------------------


def random_data(vocab: int, datums: int, seq_len: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, vocab, (datums, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def time_rounds(contenders: list[Contender], rounds: int, warmup: int, device: torch.device) -> None:
    cuda = device.type == "cuda"
    for c in contenders:
        try:
            for i in range(warmup):
                loss = c.step()
                if i == 0:
                    c.first_loss = loss
            sync(device)
        except torch.cuda.OutOfMemoryError as exc:
            c.error = f"out of memory: {str(exc).splitlines()[0][:200]}"
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    live = [c for c in contenders if c.error is None]
    for r in range(rounds):
        k = r % max(1, len(live))
        for c in live[k:] + live[:k]:  # rotated: each contender leads in turn
            if c.error is not None:
                continue
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            try:
                c.step()
                sync(device)
            except torch.cuda.OutOfMemoryError as exc:
                c.error = f"out of memory: {str(exc).splitlines()[0][:200]}"
                gc.collect()
                torch.cuda.empty_cache()
                continue
            c.times.append(time.perf_counter() - t0)
            if cuda:
                c.peak_bytes = max(c.peak_bytes, torch.cuda.max_memory_allocated(device))


def profile_steps(contenders: list[Contender], out_dir: Path, device: torch.device, case: str) -> None:
    """One profiled step per contender: the top ops by device (or CPU) time, as text, named by `case` (so the
    profiles of several shapes written to one folder stay apart)."""
    from torch.profiler import ProfilerActivity, profile

    out_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for c in contenders:
        with profile(activities=activities) as prof:
            began = time.perf_counter()
            c.step()
            sync(device)
            wall = time.perf_counter() - began
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = prof.key_averages()
        text = events.table(sort_by=key, row_limit=30) + "\n" + events.table(sort_by="self_cpu_time_total",
                                                                             row_limit=15)
        if device.type == "cuda":
            text = kernel_breakdown(events, wall) + "\n\n" + text
        (out_dir / f"profile_{case}_{c.label.replace('/', '_')}.txt").write_text(text)


# Kernel families by name, first match wins (cuBLAS/cuBLASLt GEMMs are nvjet/cutlass/xmma kernels on H100; NCCL's
# collectives first, since "ncclDevKernel_AllReduce..." would otherwise count as a reduction).
KERNEL_FAMILIES = (("nccl", ("nccl",)),
                   ("attention", ("flash", "fmha", "sdpa", "attn")),
                   ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "grouped_mm", "splitk")),
                   ("reduction", ("triton_red", "reduce", "norm", "softmax", "logsumexp")),
                   ("elementwise", ("triton_poi", "elementwise")),
                   ("copy / fill", ("memcpy", "memset", "copy", "catarray", "fill")))


def kernel_breakdown(events, wall_s: float) -> str:
    """Device time of one profiled step by kernel family, and how much of the step's wall time the device was busy:
    the split that says whether a step is GEMM-bound, elementwise-bound or waiting on the host."""
    from torch.autograd import DeviceType

    totals: dict[str, float] = {}
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue  # an operator can carry its kernels' time as its own too: count the kernels alone
        spent = getattr(event, "self_device_time_total", None)
        if spent is None:
            spent = event.self_cuda_time_total
        if spent <= 0:
            continue
        name = event.key.lower()
        if name.startswith("nccl:"):
            continue  # the profiler's GPU-side annotation of a collective spans its kernel: counting both doubles it
        family = next((f for f, marks in KERNEL_FAMILIES if any(m in name for m in marks)), "other")
        totals[family] = totals.get(family, 0.0) + spent / 1e6
    busy = sum(totals.values())
    lines = [(f"step wall {wall_s * 1e3:.1f} ms (profiled), device busy {busy * 1e3:.1f} ms "
              f"({100 * busy / wall_s:.0f}% of the wall)")]
    lines += [f"  {family:<12} {spent * 1e3:9.1f} ms  {100 * spent / busy:5.1f}%"
              for family, spent in sorted(totals.items(), key=lambda item: -item[1])]
    return "\n".join(lines)


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
                    help="megatron's activation recomputation (default: the backend's)")
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
            # A device slot for every adapter of every contender: they alternate, and a deployment with n tenants
            # on n slots never spills (spills are bench/trainer_megatron.py's subject).
            slots = max(8, sum(tenant_counts) * len(modes))
            backend = build_backend(backend_kind, hf, f"{shape_name}-random", device, dtype, lora_dtype,
                                    slots=slots, megatron_options=options)
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
                for t in range(n):
                    name = f"{mode}-{n}t-{t}"
                    driver.create(name, args.rank, seed=100 + t)
                    shares[name] = rows_data[t * per : (t + 1) * per]
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
    print(f"first-step losses agree within {results.get('first_loss_rel_spread')} (relative); JSON: {out}")
    return results


if __name__ == "__main__":
    main()
