"""The trainer benchmarks' own harness: model shapes, contenders timed in rotated rounds, profiles, and the two ways
the benchmarks drive loraplane's trainer (bench/trainer_vs_peft.py, trainer_moe.py, trainer_multigpu.py and
trainer_fleet.py share it; none of them imports another benchmark).

    DirectDriver   a backend behind TrainerService in this process (the scheduler's worker runs the batches)
    GrpcDriver     the real trainer_svc over gRPC with a real registry, driven by loraplane's Python client

GrpcDriver uses only what an application uses (the servers' start functions and the client). DirectDriver, and
`build_backend` for a model that exists only in memory (random weights in a real shape: no checkpoint on disk for
the backend registry to load), reach into the trainer's internals; they are kept here, in one place, so that a
change of those internals is one edit for every benchmark. The trainer internals this module uses:
trainer_svc.backends.torch_backend / megatron.{backend, engine, model} (building a backend on an in-memory model),
trainer_svc.service (TrainerService, TrainerLimits), trainer_svc.journal.AdapterRecord, trainer_svc.optimizer.AdamHyper
and trainer_svc.validation.DatumPayload (an adapter created and stepped without a registry).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import hashlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

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
    # transformers' Qwen3.5 text configs default to these two models' shapes (9B: 32 layers, 3 Gated DeltaNet : 1
    # gated attention, hidden 4096; 35B-A3B: 40 layers, 256 experts top-8 beside a shared expert).
    "qwen3.5-9b": {"arch": "qwen3_5_text"},
    "qwen3.5-35b-a3b": {"arch": "qwen3_5_moe_text"},
    # gpt-oss-20b: 24 layers, 32 experts top-4 (the config's defaults are the 120b's).
    "gpt-oss-20b": {"arch": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32,
                    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072},
    # NVIDIA-Nemotron-3-Nano-30B-A3B(-BF16): its config.json's values (as copied in jax-llm-examples' nemotron3
    # test; Megatron-LM's modelopt conf and Megatron-Bridge's Nemotron3NanoProvider agree). 52 blocks: 23 Mamba-2
    # (M), 23 MoE (E: 128 relu^2 experts top-6 + a 3712-wide shared expert), 6 GQA attention without RoPE (*).
    # The pattern is given as the checkpoint gives it, hybrid_override_pattern: every transformers 5.x (5.17 on
    # the GPU machine, 5.24 here) turns it into layers_block_type, whose names changed between versions.
    "nemotron-3-nano": {"arch": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688, "num_hidden_layers": 52,
                        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                        "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
                        "conv_kernel": 4, "expand": 2, "chunk_size": 128, "intermediate_size": 1856,
                        "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
                        "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 3712,
                        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False},
}
# Families whose HF attention is eager only (gpt-oss's sinks: transformers refuses SDPA for them).
_EAGER_ARCHES = ("gpt_oss",)


def build_hf_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight HF causal LM of the shape, allocated and initialized on ``device`` (an 8B model never
    passes through host memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape in SHAPES:
        fields = dict(SHAPES[shape])
        arch = fields.pop("arch")
        fields.setdefault("max_position_embeddings", 8192)
        config = AutoConfig.for_model(arch, **fields)
    elif Path(shape).is_dir():
        config = AutoConfig.from_pretrained(shape, local_files_only=True)
    else:
        raise SystemExit(f"--shape {shape!r}: not one of {sorted(SHAPES)} and not a local HF directory")
    attention = "eager" if config.model_type in _EAGER_ARCHES else "sdpa"
    config._attn_implementation = attention
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    model.to(dtype)
    model.eval().requires_grad_(False)
    return model


def model_targets(hf) -> tuple[str, ...]:
    """Every LoRA target the model's family offers (for Qwen3.5 the linear-attention projections and the shared
    expert too; for MoE models the routed experts): what both contenders train."""
    from loraplane.models import families

    targets = families.lora_targets(hf.config)
    if getattr(hf.config, "model_type", "") == "nemotron_h":
        # PEFT refuses LoRA on a Mamba mixer's out_proj (transformers' fused training kernel reads out_proj.weight
        # and would skip the adapter), so neither contender trains it: both do the same work.
        targets = tuple(t for t in targets if t != "mixer.out_proj")
    return targets


def peft_targets(targets: tuple[str, ...]) -> dict[str, list[str]]:
    """The same targets as PEFT names them: projections by module name (Tinker's split in_proj_q/k/v of Qwen3.5's
    fused in_proj_qkv is one PEFT module), the routed experts' fused 3-D parameters by target_parameters."""
    from loraplane.models.families.base import ROUTED_EXPERT_TARGETS

    modules: list[str] = []
    for t in targets:
        if t in ROUTED_EXPERT_TARGETS:
            continue
        name = "in_proj_qkv" if t in ("in_proj_q", "in_proj_k", "in_proj_v") else t
        if name not in modules:
            modules.append(name)
    # Nemotron-H's experts already name their block (mixer.experts.*), the other families' sit under mlp.
    parameters = [t if t.startswith("mixer.") else f"mlp.{t}" for t in targets if t in ROUTED_EXPERT_TARGETS]
    return {"target_modules": modules, "target_parameters": parameters}


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


def build_backend(kind: str, hf, name: str, device: torch.device, dtype: torch.dtype, lora_dtype, slots: int,
                  megatron_options: dict | None = None, own_copy: bool = True):
    from loraplane.models.base import from_hf_model
    from loraplane.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    if kind == "torch":
        from trainer_svc.backends.torch_backend import TorchBackend

        # Its own copy when PEFT runs beside it (PEFT injects its layers into the model it wraps); alone, the model.
        model = copy.deepcopy(hf) if own_copy else hf
        return TorchBackend(from_hf_model(name, model, tokenizer, device=str(device), dtype=dtype))
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
    """Every backend runs behind the one TrainerService."""
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

    def create(self, name: str, rank: int, seed: int, targets: tuple[str, ...] = TARGETS) -> None:
        """What CreateAdapter does on the trainer, minus the registry record (nothing is published here)."""
        from loraplane.lora import LoraSpec

        self.adopt(name, LoraSpec.create(rank, 2.0 * rank, list(targets), seed,
                                         max_rank=self.service.limits.max_lora_rank))

    def adopt(self, name: str, spec) -> None:
        """A new adapter of `spec` on the service, as CreateAdapter makes it (minus the registry record)."""
        from trainer_svc.journal import AdapterRecord

        svc = self.service
        record = AdapterRecord(name=name, rank=spec.rank, alpha=spec.alpha, target_modules=list(spec.target_modules),
                               seed=spec.seed, base_model=svc.base_model, uid=uuid.uuid4().hex,
                               expert_layout=spec.expert_layout)

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

    def create(self, name: str, rank: int, seed: int, targets: tuple[str, ...] = TARGETS) -> None:
        self.training[name] = self.client.create_lora_training_client(rank=rank, alpha=2.0 * rank, seed=seed,
                                                                      target_modules=list(targets), name=name)

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


# -- adapter states and datums for the benchmarks that drive a backend directly ------------------------------------


def fresh_adapter_state(base, name: str, rank: int):
    """A new adapter (alpha = 2 × rank, seed from the name) as the trainer's pool holds it."""
    from loraplane.lora import LoraSpec, init_lora_params
    from trainer_svc.pool import AdapterState

    spec = LoraSpec.create(rank, 2.0 * rank, [], seed=sum(name.encode()))
    return AdapterState(name=name, spec=spec, base_model=base.name, params=init_lora_params(base, spec),
                        exp_avg={}, exp_avg_sq={})


def random_datums(vocab_size: int, count: int, seq_len: int, generator) -> list:
    """``count`` next-token datums of ``seq_len`` random tokens."""
    import torch

    from trainer_svc.backends.base import DatumInput

    out = []
    for _ in range(count):
        toks = torch.randint(0, vocab_size, (seq_len + 1,), generator=generator)
        out.append(DatumInput(toks[:-1].clone(), toks[1:].clone()))
    return out
