"""The production shape end to end, as one command (issue 12, item 4).

A local cluster (Valkey + SeaweedFS + registry, started by `loraplane_cli.local_cluster.start_cluster` exactly as
`loraplane up` starts them, supervised) with the megatron trainer under torchrun and sampler_svc on SGLang (GPU) or
the torch engine (CPU) in place of the default services; then the two-tenant GRPO loop of examples/rl_loop.py with
`importance_sampling`, checked at every iteration:

- every Sample is served by the version it asked for (`served_version`);
- the sampler's logprobs of the sampled tokens equal the trainer's `Forward` logprobs of the same version (Forward
  runs after sampling and before the iteration's optim step, so the trainer holds exactly the published weights);
- the sampler's loaded versions stay within retention (keep_versions x tenants; the loop pins nothing), and so do
  the SGLang server's own LoRA names (`/v1/models`), which must also be names the sampler has loaded;
- with `--require-reward-rise` (the SmolLM2 GPU run), both tenants' mean reward rises from the first to the last
  iterations.

It records per iteration and tenant: publish time, publish -> loaded on the sampler (polling ListLoadedAdapters),
sampling time, the Forward check's time, training time (forward_backward + optim_step), mean reward, accuracy and
the logprob differences; writes a JSON report, prints a table, and exits 1 when a check fails.

    # GPU (scripts/gpu/e2e.sh installs the wheels and runs this): SGLang, SmolLM2, bf16, 16 iterations
    python -m tests.production_e2e --require-reward-rise --out e2e.json
    # CPU (megatron-core on gloo in float32, the torch sampler engine; tests/e2e/test_production_shape_cpu.py):
    python -m tests.production_e2e --engine torch --device cpu --model tiny --iterations 3

With `--moe` (issue 22) the model is a small Qwen3-MoE with random weights (SMALL_MOE: 3 layers, every layer
MoE, 16 experts top-4, hidden 512; built on the GPU, saved in bf16 under the data dir), the trainer is the torch
backend (`python -m trainer_svc`, fp32 on the same GPU; `--trainer-backend megatron` for megatron-core under
torchrun) with LoRA on q,k,v,o and the experts (per expert), and SGLang serves it in bf16. A random model knows no
arithmetic, so the reward is one it can learn from scratch: the fraction of sampled tokens that fall in a fixed
set of 16 token ids (4 of 64 at random: 6%), prompts random token ids. Logprob agreement is checked against the
MoE bounds (mean and 90th percentile, no bound on the maximum: a routing flip between the two implementations can
reach it; derived in tests/gpu/test_sglang_moe.py).

    # GPU: scripts/gpu/moe_serve.sh e2e (SGLang installed by scripts/gpu/e2e.sh install-sglang)
    python -m tests.production_e2e --moe --require-reward-rise --out e2e_moe.json
    # CPU (the torch trainer and sampler in fp32; slow on 2 cores):
    python -m tests.production_e2e --moe --engine torch --device cpu --iterations 4 --problems 4

It runs from the source tree: the loop is examples/rl_loop.py's (loaded from its file) and the CPU trainer needs
tests/fixtures/megatron_cpu.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import ModuleType

from loraplane.client import ServiceClient
from loraplane.config import Settings
from loraplane.rpc import sync_channel
from loraplane.v1 import sampler_pb2, sampler_pb2_grpc
from loraplane_cli.local_cluster import start_cluster, stop_cluster
from sampler_svc.engines import ENGINE_NAMES, ENGINES

REPO = Path(__file__).resolve().parents[1]
# megatron-core asks CUDA for the RoPE device and forks a CUDA RNG tracker; on CPU the shims redirect both (the same
# entry scripts/gpu/launch_check.py and tests/e2e/test_megatron_cpu.py use).
CPU_TRAINER_ENTRY = "import tests.fixtures.megatron_cpu; from trainer_svc.torchrun import main; main()"

# Logprob agreement, sampler vs trainer Forward, per sampled token.
# float32 (CPU): the design's promise, 1e-4 absolute; both sides compute the same function in fp32 and differ only
# in summation order (measured on CPU: megatron vs the torch backend <= 1e-5, docs/megatron.md).
FP32_MAX_ABS = 1e-4
# bfloat16 (GPU, SGLang vs megatron): bf16 keeps 8 significant bits, so every rounding is off by up to 2^-9 = 0.2%
# relative. SmolLM2's residual stream (30 layers, about 4 bf16 roundings each: attention out, MLP out, two adds)
# accumulates them like a random walk, to about 2^-9 * sqrt(120) = 2% of the final hidden state; a logit of magnitude
# 10-20 then moves by 0.2-0.4 in the worst tokens, and the log-sum-exp, carried by the top logits, moves with them
# only partly. Attention adds an error that grows with the context (each softmax-weighted sum over T positions
# rounds about sqrt(T) times more), small at these lengths: chat prompts of about 50 tokens plus at most --max-tokens
# sampled ones, under 64 in all. Measured at those lengths (5-64 tokens, SmolLM2, tests/gpu/test_megatron.py on the
# H100, docs/gpu-runs/h100-run{1,3,4,5,6,10}-gpu*tests.log): megatron in bf16 is 0.069-0.074 from the fp32 reference
# on average and 0.35-0.38 at worst per token, the torch backend in bf16 0.071-0.073 and 0.25. Two independent bf16
# implementations (here SGLang's kernels and megatron's) differ by at most the sum of their errors: about 0.15 on
# average and 0.77 at worst; the bounds below are those, with room for the worst token of a longer run. Both sides
# compute the LoRA in bf16 too (the trainer's --lora-dtype follows --dtype). A version mix-up is caught by
# served_version, not by these bounds (one optim step moves logprobs by less).
BF16_MAX_ABS = 1.0
BF16_MEAN_ABS = 0.15
# The --moe run (the small random Qwen3-MoE, SGLang in bf16 against the trainer): per-token mean and 90th
# percentile, as derived in tests/gpu/test_sglang_moe.py (bf16 rounding of each layer, plus routing flips: a token
# whose 4th and 5th router scores are closer than the rounding error takes another expert on one side, so the
# maximum is not bounded). The torch trainer runs fp32 there, so only one side rounds: the same bounds have room.
MOE_BF16_MEAN_ABS = 0.1
MOE_BF16_P90_ABS = 0.3
# SGLang's --mem-fraction-static: beside the trainer on one GPU it leaves the trainer the rest (SmolLM2's megatron
# trainer takes a few GB; 0.4 of an H100 is 32 GB for SGLang, far more KV cache than 2 x 128 short samples need);
# alone on its GPU (the disaggregated shape) it takes what SGLang's own default would on a large GPU.
COLOCATED_MEM_FRACTION = 0.4
DISAGGREGATED_MEM_FRACTION = 0.8
# The --moe reward: the share of sampled tokens in this set (a random model's policy can learn it from scratch).
MOE_REWARD_TOKENS = frozenset(range(100, 116))


# ---- Qwen3-MoE models with random weights (the MoE production shape, tests/gpu/test_sglang_moe.py, bench) --------

# Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts top-8 (renormalised), expert FFN 768, GQA 32/4 of head_dim 128.
QWEN3_30B_A3B = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "intermediate_size": 6144, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0}
# A small MoE for one GPU with room for trainer and SGLang: every layer MoE (as in Qwen3-30B-A3B: SGLang's LoRA pool
# gives a MoE model's gate_up/down buffers to the experts only, so a dense MLP layer would have none), kernel-friendly
# sizes (multiples of 64, head_dim 64), 16 experts top-4.
SMALL_MOE = {"hidden_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
             "intermediate_size": 1024, "max_position_embeddings": 2048, "rope_theta": 10000.0}
MOE_SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "small-moe": SMALL_MOE}


def qwen3_moe_config(shape: str | dict, *, layers: int = 0, vocab_size: int = 0, dtype: str = "bfloat16"):
    """A transformers Qwen3MoeConfig of a named shape (MOE_SHAPES) or explicit dims; `layers` truncates it,
    `vocab_size` replaces the vocabulary (a small tokenizer's). No shared experts, no sliding window, no aux loss."""
    from transformers import Qwen3MoeConfig

    dims = dict(MOE_SHAPES[shape] if isinstance(shape, str) else shape)
    if layers:
        dims["num_hidden_layers"] = layers
    if vocab_size:
        dims["vocab_size"] = vocab_size
    dims.setdefault("vocab_size", 261)
    return Qwen3MoeConfig(**dims, mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True,
                          rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                          use_sliding_window=False, router_aux_loss_coef=0.0, output_router_logits=False,
                          bos_token_id=1, eos_token_id=4, pad_token_id=0, torch_dtype=dtype,
                          architectures=["Qwen3MoeForCausalLM"])


def write_random_moe_dir(directory: Path, config, *, seed: int = 0, device: str = "") -> Path:
    """A Qwen3-MoE with seeded random weights built on `device` (default: CUDA when there is one) in the config's
    dtype, saved as a Hugging Face directory with the byte-level tokenizer of `tiny` (ids, not text, matter here).
    Weights as `tiny-moe` draws them: uniform with std 1/sqrt(fan_in) (embeddings std 1), norms around 1, the router
    4x larger so that top-k routing is decisive (near-ties would flip between two bf16 implementations). Kept when
    the directory already has a config."""
    import math

    import torch
    from transformers import Qwen3MoeForCausalLM

    from loraplane.models.tiny import build_tiny_tokenizer

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "bfloat16")
                               ).removeprefix("torch."))
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * (torch.rand(param.shape, generator=generator, device=device) - 0.5))
                continue
            bound = math.sqrt(3.0) * (1.0 if "embed_tokens" in name else 1.0 / math.sqrt(param.shape[-1]))
            if name.endswith("mlp.gate.weight"):
                bound *= 4.0
            param.copy_((torch.rand(param.shape, generator=generator, device=device) * 2.0 - 1.0) * bound)
    model = model.to(dtype)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the memory goes to the SGLang server and the trainer started next
    return directory


def write_moe_config_dir(directory: Path, config) -> Path:
    """config.json + the tokenizer only, for SGLang's `--load-format dummy` (random weights made on the GPU; the
    61 GB of a full Qwen3-30B-A3B never touch the disk). The sampler reads its vocabulary, context and EOS from
    this directory too (on the meta device)."""
    from loraplane.models.tiny import build_tiny_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory


def load_rl_example() -> ModuleType:
    """examples/rl_loop.py, imported from its file (examples/ is not a package)."""
    path = REPO / "examples" / "rl_loop.py"
    spec = importlib.util.spec_from_file_location("examples_rl_loop", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.production_e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINE_NAMES, default="sglang")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="the trainer's: cuda (NCCL) or cpu (gloo, megatron-core through tests/fixtures/megatron_cpu.py)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="",
                   help="base weights of trainer and SGLang (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--nproc", type=int, default=1, help="trainer ranks under torchrun")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--keep-versions", type=int, default=2, help="the sampler's retention per adapter")
    p.add_argument("--trainer-gpus", default="",
                   help="GPUs of the trainer's torchrun job (its CUDA_VISIBLE_DEVICES, as `loraplane up "
                        "--trainer-gpus`), e.g. 0; default: what this process sees")
    p.add_argument("--sampler-gpus", default="",
                   help="GPUs of the sampler and its SGLang server, e.g. 1 for the disaggregated shape (trainer on "
                        "0, sampler on 1) or 0 beside --trainer-gpus 0 for the colocated one")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help=f"SGLang's share of its GPU (weights + KV cache): default {COLOCATED_MEM_FRACTION} when it "
                        f"shares the GPU with the trainer (the trainer uses the rest), {DISAGGREGATED_MEM_FRACTION} "
                        "when --trainer-gpus and --sampler-gpus name different GPUs")
    p.add_argument("--warmup-iterations", type=int, default=2,
                   help="iterations left out of the steady-state timings (first CUDA graphs, kernels compiled on "
                        "first use, the allocator growing)")
    p.add_argument("--sglang-eager", action="store_true",
                   help="turn SGLang's CUDA graphs off (--disable-cuda-graph). They are on by default: decode "
                        "batches of two tenants mix adapters, whose graph replay had a csgmv bug upstream "
                        "(sgl-project/sglang#28371); 0.5.17 carries the fix, and tests/gpu/test_sglang_engine.py "
                        "checks graphs against eager decoding on mixed-adapter batches (passed on the H100)")
    p.add_argument("--require-reward-rise", action="store_true",
                   help="fail unless every tenant's mean reward over the last --window iterations exceeds that of "
                        "the first ones (a real model over >= 10 iterations; a random one does not learn)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="cluster data and logs (default: a temporary directory, removed after a passing run)")
    p.add_argument("--out", type=Path, default=Path("production_e2e.json"))
    # examples/rl_loop.py's options, same names: its functions read them from this namespace. The defaults are the
    # GPU run's. 16 x 8 samples per tenant and iteration: with rl_loop's 4 x 8 (CPU) single iterations were too noisy
    # to compare, and a larger batch costs the GPU little.
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--problems", type=int, default=16, help="problems per iteration (B)")
    p.add_argument("--group-size", type=int, default=8, help="completions per problem (G)")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--ops", default="+,+", help="one operation per tenant, comma-separated (+ - *)")
    p.add_argument("--window", type=int, default=4, help="iterations averaged for first/last reward")
    p.add_argument("--moe", action="store_true",
                   help="the MoE production shape: a small random Qwen3-MoE (built here), the token-set reward, "
                        "MoE logprob bounds; --model, if given, names an existing Qwen3-MoE directory instead")
    p.add_argument("--trainer-backend", choices=["megatron", "torch"], default="",
                   help="default: megatron (torchrun), torch with --moe (python -m trainer_svc, fp32)")
    p.add_argument("--compare", nargs="+", metavar="LABEL=REPORT", default=None,
                   help="no run: compare the steady-state timings of earlier reports (e.g. colocated=a.json "
                        "disaggregated=b.json) side by side, print the table and write it to --out")
    args = p.parse_args(argv)
    if args.moe:
        # The MoE run's own defaults where the flag was not given: a quick run (a few minutes on one GPU).
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
        for flag, value in (("--model", ""), ("--iterations", 12), ("--problems", 8), ("--max-tokens", 8),
                            ("--learning-rate", 2e-2), ("--window", 3)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    if args.compare:
        return args
    args.trainer_backend = args.trainer_backend or ("torch" if args.moe else "megatron")
    args.shape_name = placement_shape(args.trainer_gpus, args.sampler_gpus)
    if args.mem_fraction_static is None:
        args.mem_fraction_static = (DISAGGREGATED_MEM_FRACTION if args.shape_name == "disaggregated"
                                    else COLOCATED_MEM_FRACTION)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


# ---- the cluster ------------------------------------------------------------------------------------------------


def placement_shape(trainer_gpus: str, sampler_gpus: str) -> str:
    """disaggregated: trainer and sampler pinned to different GPUs; colocated: pinned with a GPU in common;
    unpinned: either one sees every GPU (on a one-GPU machine, the colocated shape)."""
    if not trainer_gpus or not sampler_gpus:
        return "unpinned"
    trainer = {g.strip() for g in trainer_gpus.split(",")}
    sampler = {g.strip() for g in sampler_gpus.split(",")}
    return "colocated" if trainer & sampler else "disaggregated"


def cluster_gpus(args: argparse.Namespace) -> dict[str, str]:
    """start_cluster's `gpus`: what `loraplane up --trainer-gpus / --sampler-gpus` passes."""
    return {service: gpus for service, gpus in (("trainer", args.trainer_gpus), ("sampler", args.sampler_gpus))
            if gpus}


def service_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The trainer under torchrun and the sampler on the chosen engine, in place of `python -m <service>`."""
    if args.trainer_backend == "torch":
        # The torch backend (fp32 master weights and compute on the chosen device): the reference side.
        trainer = [sys.executable, "-m", "trainer_svc", "--backend", "torch", "--device", args.device,
                   "--base-model", args.model, "--max-lora-rank", str(args.rank)]
    else:
        trainer = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(args.nproc)]
        trainer += (["--no-python", sys.executable, "-c", CPU_TRAINER_ENTRY] if args.device == "cpu"
                    else ["-m", "trainer_svc.torchrun"])
        trainer += ["--base-model", args.model, "--dtype", args.dtype, "--tensor-parallel-size",
                    str(args.tensor_parallel_size), "--max-lora-rank", str(args.rank)]
    sampler = [sys.executable, "-m", "sampler_svc", "--base-model", args.model, "--engine", args.engine,
               "--keep-versions", str(args.keep_versions)]
    if args.engine == "sglang":
        sampler += ["--sglang-launch", "1", "--sglang-max-lora-rank", str(args.rank),
                    f"--sglang-arg=--mem-fraction-static={args.mem_fraction_static}",
                    # The checkpoint SmolLM2 is served from is fp32 (dequantized GGUF); serve what the trainer trains.
                    f"--sglang-arg=--dtype={args.dtype}"]
        if args.sglang_eager:
            sampler.append("--sglang-arg=--disable-cuda-graph")
    return {"trainer": trainer, "sampler": sampler}


class SamplerProbe:
    """What is loaded where: the sampler's ListLoadedAdapters and each SGLang server's LoRA names."""

    def __init__(self, address: str, security):
        self.channel = sync_channel(address, security)
        self.stub = sampler_pb2_grpc.SamplerServiceStub(self.channel)
        self.sglang_urls: list[str] = []

    def loaded(self, adapter: str = "") -> set[str]:
        names, token = set(), ""
        while True:
            reply = self.stub.ListLoadedAdapters(
                sampler_pb2.ListLoadedAdaptersRequest(adapter=adapter, page_token=token), timeout=30)
            names.update(f"{a.adapter}@v{a.version}" for a in reply.adapters)
            token = reply.next_page_token
            if not token:
                return names

    def sglang_loaded(self) -> set[str] | None:
        if not self.sglang_urls:
            return None
        names = set()
        for url in self.sglang_urls:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
                names.update(m["id"] for m in json.loads(reply.read())["data"] if m.get("parent"))
        return names

    def wait_loaded(self, adapter: str, version: int, timeout: float = 600.0) -> None:
        key, deadline = f"{adapter}@v{version}", time.monotonic() + timeout
        while key not in self.loaded(adapter):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key} not loaded by the sampler {timeout:.0f}s after its publish")
            time.sleep(0.005)

    def settled(self, expected: set[str] | None = None, timeout: float = 10.0) -> dict:
        """A snapshot once the engine has caught up with the sampler: SGLang's names all known to the sampler (an
        unload in flight may lag for a moment), and the sampler's set equal to `expected` when given. Returns the
        last snapshot either way; `ok` says whether it settled."""
        deadline = time.monotonic() + timeout
        while True:
            before = self.loaded()
            engine = self.sglang_loaded()
            after = self.loaded()
            stray = sorted(engine - (before | after)) if engine is not None else []
            ok = not stray and (expected is None or before == after == expected)
            if ok or time.monotonic() > deadline:
                return {"ok": ok, "sampler": sorted(after), "sglang": sorted(engine) if engine is not None else None,
                        "stray_in_sglang": stray}
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()


# ---- the loop ---------------------------------------------------------------------------------------------------


def logprob_differences(rl: ModuleType, training, batch) -> tuple[list[float], int]:
    """|sampler logprob - trainer Forward logprob| of every sampled token, and how many sequences came without
    logprobs. Forward runs before the iteration's optim step, on the weights the sampler's version was published
    from."""
    pairs = [(prompt, seq) for prompt, reply in zip(batch.prompts, batch.replies, strict=True)
             for seq in reply.sequences if seq.tokens]
    missing = sum(1 for _, seq in pairs if not seq.logprobs or len(seq.logprobs) != len(seq.tokens))
    pairs = [(prompt, seq) for prompt, seq in pairs if seq.logprobs and len(seq.logprobs) == len(seq.tokens)]
    if not pairs:
        return [], missing
    data = [rl.rl_datum(prompt, seq.tokens, seq.logprobs, 0.0) for prompt, seq in pairs]
    output = training.forward(data, "importance_sampling").result()
    diffs = []
    for (prompt, seq), out in zip(pairs, output.loss_fn_outputs, strict=True):
        learner = out["logprobs"].tolist()[len(prompt) - 1:]
        diffs.extend(abs(a - b) for a, b in zip(learner, seq.logprobs, strict=True))
    return diffs, missing


def moe_rollout(rl: ModuleType, sampler, rng: random.Random, params, args):
    """The --moe rollout: B prompts of random token ids, G samples each; reward = the share of a sample's tokens in
    MOE_REWARD_TOKENS ("correct": at least half of them); GRPO advantages per group as examples/rl_loop.py's."""
    import dataclasses

    from loraplane.client import ModelInput

    prompts = [[rng.randrange(5, 261) for _ in range(8)] for _ in range(args.problems)]
    futures = [sampler.sample(ModelInput.from_ints(prompt), args.group_size,
                              dataclasses.replace(params, seed=rng.getrandbits(31))) for prompt in prompts]
    batch = rl.Rollout(prompts, [], [], [], [])
    for prompt, future in zip(prompts, futures):
        reply = future.result()
        batch.replies.append(reply)
        group = [sum(t in MOE_REWARD_TOKENS for t in s.tokens) / max(1, len(s.tokens)) for s in reply.sequences]
        batch.rewards.extend(group)
        batch.correct.extend(r >= 0.5 for r in group)
        advantages = rl.group_advantages(group)
        if advantages is None:
            continue
        for sequence, advantage in zip(reply.sequences, advantages):
            if sequence.tokens:
                batch.data.append(rl.rl_datum(prompt, list(sequence.tokens), list(sequence.logprobs or []),
                                              advantage))
    return batch


def tenant_loop(rl: ModuleType, service, tokenizer, run, args, probe: SamplerProbe, bound: int,
                print_lock: threading.Lock, t0: float | None = None) -> None:
    """examples/rl_loop.py's iteration (publish, rollout, train_on) with a measurement or a check between steps."""
    rng = random.Random(run.seed)
    t0 = time.monotonic() if t0 is None else t0  # the loop's start, common to the tenants: their windows overlap
    training, params, adam = rl.tenant_clients(service, tokenizer, run, args)
    for iteration in range(1, args.iterations + 1):
        started = time.monotonic()
        sampler = training.save_weights_for_sampler(f"iter-{iteration}").result()
        published = time.monotonic()
        probe.wait_loaded(run.name, sampler.version)
        loaded = time.monotonic()
        batch = (moe_rollout(rl, sampler, rng, params, args) if args.moe
                 else rl.rollout(sampler, tokenizer, rng, run.op, params, args))
        sampled = time.monotonic()
        diffs, missing = logprob_differences(rl, training, batch)
        checked = time.monotonic()
        loss = rl.train_on(training, batch.data, adam)
        trained = time.monotonic()
        snapshot = probe.settled()
        row = {
            "iteration": iteration, "version": sampler.version,
            "mean_reward": batch.mean_reward, "accuracy": batch.accuracy, "datums": len(batch.data), "loss": loss,
            "publish_s": published - started, "publish_to_loaded_s": loaded - started,
            "sampling_s": sampled - loaded, "forward_check_s": checked - sampled, "training_s": trained - checked,
            "seconds": trained - started,
            "samples": sum(len(r.sequences) for r in batch.replies),
            "sampled_tokens": sum(len(seq.tokens) for r in batch.replies for seq in r.sequences),
            # Seconds since the loop began: both tenants sample at once, so aggregate tokens/s is over the union.
            "sampling_window": [loaded - t0, sampled - t0], "iteration_window": [started - t0, trained - t0],
            "served_versions": sorted({r.served_version for r in batch.replies}),
            "served_mismatches": sum(1 for r in batch.replies if r.served_version != sampler.version),
            "tokens_compared": len(diffs), "sequences_without_logprobs": missing,
            "logprob_max_abs": max(diffs, default=math.nan),
            "logprob_mean_abs": statistics.fmean(diffs) if diffs else math.nan,
            "sampler_loaded": len(snapshot["sampler"]), "retention_bound": bound,
            "sglang_loaded": None if snapshot["sglang"] is None else len(snapshot["sglang"]),
            "stray_in_sglang": snapshot["stray_in_sglang"],
        }
        if args.moe:  # the MoE bounds are on a quantile: keep every difference
            row["logprob_diffs"] = [round(d, 5) for d in diffs]
        run.history.append(row)
        with print_lock:
            print(f"{run.name:<18} iter {iteration:>3} v{sampler.version:<3} reward {row['mean_reward']:.3f}  "
                  f"pub->loaded {row['publish_to_loaded_s']:.2f}s  sample {row['sampling_s']:.2f}s  "
                  f"train {row['training_s']:.2f}s  max|dlp| {row['logprob_max_abs']:.2e}  "
                  f"loaded {row['sampler_loaded']}/{bound}", flush=True)


# ---- checks and report ------------------------------------------------------------------------------------------


def check(passed: bool, detail: str, required: bool = True) -> dict:
    return {"passed": bool(passed), "required": required, "detail": detail}


def evaluate(runs, args, final: dict, bound: int) -> dict[str, dict]:
    rows = [row for run in runs for row in run.history]
    checks = {"tenants_completed": check(
        all(not run.error and len(run.history) == args.iterations for run in runs),
        "; ".join(f"{run.name}: {len(run.history)}/{args.iterations} iterations {run.error}".strip()
                  for run in runs))}
    mismatches = sum(r["served_mismatches"] for r in rows)
    checks["served_version_exact"] = check(
        rows and mismatches == 0 and all(r["served_versions"] == [r["version"]] for r in rows),
        f"{sum(r['samples'] for r in rows)} samples, {mismatches} requests served by another version")
    compared = sum(r["tokens_compared"] for r in rows)
    worst = max((r["logprob_max_abs"] for r in rows if r["tokens_compared"]), default=math.nan)
    mean = (sum(r["logprob_mean_abs"] * r["tokens_compared"] for r in rows if r["tokens_compared"]) / compared
            if compared else math.nan)
    missing = sum(r["sequences_without_logprobs"] for r in rows)
    if args.dtype == "float32":
        agree, bounds = worst <= FP32_MAX_ABS, f"max <= {FP32_MAX_ABS:g}"
    elif args.moe:
        every = sorted(d for r in rows for d in r.get("logprob_diffs", []))
        p90 = every[int(0.9 * (len(every) - 1))] if every else math.nan
        agree = mean <= MOE_BF16_MEAN_ABS and p90 <= MOE_BF16_P90_ABS
        bounds = f"mean <= {MOE_BF16_MEAN_ABS:g}, p90 {p90:.3g} <= {MOE_BF16_P90_ABS:g}, max not bounded"
    else:
        agree, bounds = worst <= BF16_MAX_ABS and mean <= BF16_MEAN_ABS, \
            f"max <= {BF16_MAX_ABS:g}, mean <= {BF16_MEAN_ABS:g}"
    checks["logprobs_match_forward"] = check(
        compared > 0 and missing == 0 and agree,
        f"{compared} tokens ({args.dtype}): max |diff| {worst:.3g}, mean {mean:.3g} ({bounds}); "
        f"{missing} sequences without logprobs")
    over = [r for r in rows if r["sampler_loaded"] > bound or (r["sglang_loaded"] or 0) > bound
            or r["stray_in_sglang"]]
    engine = [r["sglang_loaded"] for r in rows if r["sglang_loaded"] is not None]
    checks["retention"] = check(
        rows and not over and final["ok"],
        f"bound {bound} (keep_versions {args.keep_versions} x {len(runs)} tenants, no pins): most loaded on the "
        f"sampler {max((r['sampler_loaded'] for r in rows), default=0)}, on SGLang "
        f"{max(engine) if engine else '-'}; {len(over)} iterations over it or with SGLang names the sampler does "
        f"not have; at the end sampler {final['sampler']} (expected {final['expected']}), SGLang {final['sglang']}")
    checks["rewards_recorded"] = check(
        all(len(run.history) == args.iterations and all(math.isfinite(r["mean_reward"]) for r in run.history)
            for run in runs),
        "a finite mean reward for every tenant and iteration")
    summary = final["summary"]
    rise = {name: (s["first_mean_reward"], s["last_mean_reward"]) for name, s in summary.items()}
    checks["rewards_rise"] = check(
        all(first is not None and last is not None and last > first for first, last in rise.values()),
        ", ".join(f"{name}: {first} -> {last}" for name, (first, last) in rise.items()),
        required=args.require_reward_rise)
    return checks


TIMING_FIELDS = ("publish_s", "publish_to_loaded_s", "sampling_s", "forward_check_s", "training_s", "seconds")


def timing_summary(runs) -> dict:
    out = {}
    for run in runs:
        out[run.name] = {f"median_{f}": statistics.median(r[f] for r in run.history) for f in TIMING_FIELDS
                         if run.history}
    return out


def union_seconds(windows) -> float:
    """The time covered by any of these [start, end] intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(windows):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def steady_state(history: dict[str, list[dict]], warmup: int) -> dict:
    """Both tenants' iterations after the first `warmup` (all of them when there are no more): medians of each
    phase, and sampling throughput as sampled tokens over the time in which any tenant was sampling (they sample at
    once, so per-tenant rates do not add up), and end to end over the span of those iterations."""
    every = [r for rows in history.values() for r in rows]
    rows = [r for r in every if r["iteration"] > warmup] or every
    if not rows:
        return {}
    out: dict = {"rows": len(rows), "warmup_iterations": warmup if len(rows) < len(every) else 0}
    out.update({f"median_{f}": statistics.median(r[f] for r in rows) for f in TIMING_FIELDS})
    tokens = sum(r["sampled_tokens"] for r in rows)
    sampling = union_seconds(r["sampling_window"] for r in rows)
    span = max(r["iteration_window"][1] for r in rows) - min(r["iteration_window"][0] for r in rows)
    out.update(sampled_tokens=tokens, sampling_busy_s=sampling, span_s=span,
               sampling_tokens_per_s=tokens / sampling if sampling > 0 else math.nan,
               median_tenant_sampling_tokens_per_s=statistics.median(
                   r["sampled_tokens"] / r["sampling_s"] for r in rows if r["sampling_s"] > 0),
               end_to_end_tokens_per_s=tokens / span if span > 0 else math.nan,
               tenant_iterations_per_s=len(rows) / span if span > 0 else math.nan)
    return out


def gpu_processes(state) -> dict | None:
    """Which GPUs each service's processes (and their children: torchrun's ranks, SGLang's server and scheduler)
    hold a context on, from nvidia-smi; None without nvidia-smi. In a container whose PID namespace hides the
    processes from nvidia-smi the lists come back empty."""
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None

    def query(*fields: str) -> list[list[str]]:
        try:
            reply = subprocess.run(["nvidia-smi", *fields, "--format=csv,noheader,nounits"], capture_output=True,
                                   text=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return []
        return [[c.strip() for c in line.split(",")] for line in reply.stdout.splitlines() if line.strip()]

    index = {row[1]: row[0] for row in query("--query-gpu=index,uuid") if len(row) == 2}
    used = {row[0]: float(row[1]) for row in query("--query-gpu=index,memory.used")
            if len(row) == 2 and row[1].replace(".", "", 1).isdigit()}
    apps = [(int(row[0]), index.get(row[1], row[1])) for row in query("--query-compute-apps=pid,gpu_uuid")
            if len(row) == 2 and row[0].isdigit()]
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out = {"memory_used_mib": used, "services": {}}
    for component in state.components:
        if component.kind != "service" or component.pid is None:
            continue
        tree, grew = {component.pid}, True
        while grew:
            found = {pid for pid, parent in parents.items() if parent in tree} - tree
            tree |= found
            grew = bool(found)
        out["services"][component.name] = sorted({gpu for pid, gpu in apps if pid in tree})
    return out


def placement_check(args: argparse.Namespace, gpus: dict | None) -> dict:
    """Not required: nvidia-smi may not see the processes. Passes when every pinned service was seen on its GPUs
    and on no other."""
    if gpus is None:
        return check(False, "no nvidia-smi", required=False)
    wrong = []
    for service, pinned in cluster_gpus(args).items():
        seen = set(gpus["services"].get(service, []))
        allowed = {g.strip() for g in pinned.split(",")}
        if not seen or not seen <= allowed:
            wrong.append(f"{service} on {sorted(seen) or 'no GPU nvidia-smi shows'}, pinned to {sorted(allowed)}")
    return check(not wrong,
                 f"{args.shape_name}: " + ("; ".join(wrong) if wrong else json.dumps(gpus["services"])),
                 required=False)


def print_table(runs, checks: dict) -> None:
    header = (f"{'tenant':<18} {'it':>3} {'ver':>4} {'reward':>7} {'pub s':>6} {'pub->ld s':>9} {'sample s':>8} "
              f"{'train s':>7} {'max|dlp|':>9} {'loaded':>6} {'sglang':>6}")
    print(header)
    print("-" * len(header))
    for run in runs:
        for r in run.history:
            sglang = "-" if r["sglang_loaded"] is None else str(r["sglang_loaded"])
            print(f"{run.name:<18} {r['iteration']:>3} {r['version']:>4} {r['mean_reward']:>7.3f} "
                  f"{r['publish_s']:>6.2f} {r['publish_to_loaded_s']:>9.2f} {r['sampling_s']:>8.2f} "
                  f"{r['training_s']:>7.2f} {r['logprob_max_abs']:>9.2e} {r['sampler_loaded']:>6} {sglang:>6}")
    for name, c in checks.items():
        verdict = "PASS" if c["passed"] else ("FAIL" if c["required"] else "fail (not required)")
        print(f"{verdict:<4} {name}: {c['detail']}")


# The side-by-side table of --compare: (row label, steady_state key or report key, format).
COMPARED = (("iteration wall s (median)", "median_seconds", ".3f"),
            ("publish s", "median_publish_s", ".3f"),
            ("publish -> loaded s", "median_publish_to_loaded_s", ".3f"),
            ("sampling s", "median_sampling_s", ".3f"),
            ("forward check s", "median_forward_check_s", ".3f"),
            ("training s", "median_training_s", ".3f"),
            ("sampling tok/s (both tenants)", "sampling_tokens_per_s", ".0f"),
            ("sampling tok/s (per tenant, median)", "median_tenant_sampling_tokens_per_s", ".0f"),
            ("end-to-end tok/s", "end_to_end_tokens_per_s", ".0f"),
            ("tenant iterations/s", "tenant_iterations_per_s", ".3f"),
            ("iterations counted (both tenants)", "rows", "d"),
            ("cluster start s", "startup_s", ".0f"),
            ("  trainer start s", "trainer_start_s", ".0f"),
            ("  sampler + SGLang start s", "sampler_start_s", ".0f"),
            ("loop s (all iterations)", "loop_s", ".1f"))


def compare_reports(labelled: list[tuple[str, dict]]) -> dict:
    """The steady-state timings of several runs side by side, with each run's ratio to the first."""
    shapes = {}
    for label, report in labelled:
        values = dict(report.get("steady_state") or {})
        values.update({k: report[k] for k in ("startup_s", "loop_s") if k in report})
        values.update({f"{k}_start_s": v for k, v in (report.get("startup_phases") or {}).items()
                       if k in ("trainer", "sampler")})
        shapes[label] = {"passed": report.get("passed", False), "placement": report.get("placement"),
                         "gpus": report.get("gpus"), "values": values,
                         "failed_checks": [n for n, c in report.get("checks", {}).items()
                                           if c["required"] and not c["passed"]]}
    base = labelled[0][0]
    ratios = {}
    for label in shapes:
        ratios[label] = {}
        for _, key, _ in COMPARED:
            a, b = shapes[base]["values"].get(key), shapes[label]["values"].get(key)
            ratios[label][key] = (b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
                                  and math.isfinite(a) and math.isfinite(b) else None)
    return {"baseline": base, "shapes": shapes, "ratio_to_baseline": ratios}


def print_comparison(comparison: dict) -> None:
    labels = list(comparison["shapes"])
    width = max(14, *(len(label) + 2 for label in labels))
    ratio_width = max(12, *(len(label) + len(comparison["baseline"]) + 3 for label in labels))
    header = f"{'':<38}" + "".join(f"{label:>{width}}" for label in labels) + "".join(
        f"{label + '/' + comparison['baseline']:>{ratio_width}}" for label in labels[1:])
    print(header)
    print("-" * len(header))
    for name, key, fmt in COMPARED:
        cells = []
        for label in labels:
            value = comparison["shapes"][label]["values"].get(key)
            ok = isinstance(value, (int, float)) and (not isinstance(value, float) or math.isfinite(value))
            cells.append(f"{format(value, fmt) if ok else '-':>{width}}")
        for label in labels[1:]:
            ratio = comparison["ratio_to_baseline"][label][key]
            cells.append(f"{'-' if ratio is None else format(ratio, '.2f') + 'x':>{ratio_width}}")
        print(f"{name:<38}" + "".join(cells))
    for label, shape in comparison["shapes"].items():
        placement = shape["placement"] or {}
        seen = (shape["gpus"] or {}).get("services")
        memory = (shape["gpus"] or {}).get("memory_used_mib")
        verdict = "passed" if shape["passed"] else f"FAILED {shape['failed_checks']}"
        print(f"{label}: {placement.get('shape')}, trainer GPUs {placement.get('trainer_gpus') or 'all'}, sampler "
              f"GPUs {placement.get('sampler_gpus') or 'all'}, SGLang mem fraction "
              f"{placement.get('mem_fraction_static')}; nvidia-smi saw {seen}, MiB used per GPU {memory}; "
              f"checks {verdict}")


def compare_main(args: argparse.Namespace) -> int:
    labelled = []
    for item in args.compare:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            print(f"--compare takes LABEL=REPORT, not {item!r}")
            return 2
        try:
            labelled.append((label, json.loads(Path(path).read_text())))
        except (OSError, ValueError) as exc:
            print(f"--compare: {label}: cannot read {path}: {exc}")
            labelled.append((label, {}))
    comparison = compare_reports(labelled)
    print_comparison(comparison)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(comparison, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0 if all(shape["values"] for shape in comparison["shapes"].values()) else 1


def prepare_moe_model(args: argparse.Namespace, data_dir: Path) -> None:
    """--moe without --model: the small random Qwen3-MoE, built on the GPU (CPU with --device cpu) in the run's
    dtype and saved under the data dir; trainer and sampler load it from there."""
    if args.model:
        return
    from loraplane.models.tiny import build_tiny_tokenizer

    config = qwen3_moe_config("small-moe", vocab_size=len(build_tiny_tokenizer()), dtype=args.dtype)
    args.model = str(write_random_moe_dir(data_dir / "moe-model", config, seed=22, device=args.device).resolve())


def run_e2e(args: argparse.Namespace) -> dict:
    rl = load_rl_example()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="loraplane-e2e-"))
    if args.moe:
        prepare_moe_model(args, data_dir)
    settings = Settings(data_dir=data_dir)
    env = {"LORAPLANE_DEVICE": args.device,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    report: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "placement": {"shape": args.shape_name, "trainer_gpus": args.trainer_gpus,
                                  "sampler_gpus": args.sampler_gpus,
                                  "mem_fraction_static": args.mem_fraction_static},
                    "data_dir": str(data_dir), "logs": str(data_dir / "logs")}
    state, runs = None, []
    started = time.monotonic()
    try:
        steps: list[tuple[str, float]] = []

        def progress(message: str) -> None:
            steps.append((message, time.monotonic() - started))
            print(f"[cluster +{steps[-1][1]:.0f}s] {message}", flush=True)

        print(f"[cluster] {args.shape_name}: trainer GPUs {args.trainer_gpus or 'all'}, sampler GPUs "
              f"{args.sampler_gpus or 'all'}, SGLang --mem-fraction-static {args.mem_fraction_static}", flush=True)
        state, _ = start_cluster(settings, extra_env=env, commands=service_commands(args), gpus=cluster_gpus(args),
                                 on_progress=progress)
        report["startup_s"] = time.monotonic() - started
        steps.append(("ready", report["startup_s"]))
        # Each component's start, to its health check (the next one starts only then): the trainer's and SGLang's
        # dominate the run's fixed cost.
        report["startup_phases"] = {name.removeprefix("starting "): round(steps[i + 1][1] - at, 2)
                                    for i, (name, at) in enumerate(steps[:-1])}
        addresses = state.addresses()
        service = ServiceClient(trainer=addresses["trainer"], sampler=addresses["sampler"],
                                registry=addresses["registry"], data_dir=data_dir)
        info = service.get_server_capabilities()
        probe = SamplerProbe(addresses["sampler"], service.security)
        status = probe.stub.GetStatus(sampler_pb2.GetStatusRequest(), timeout=30)
        # The driver holds the cluster's admin key, so the sampler names the SGLang servers it launched.
        probe.sglang_urls = list(status.engine_servers)
        if ENGINES[args.engine].uses_servers and not probe.sglang_urls:
            raise RuntimeError("the sampler reports no SGLang server (GetStatus.engine_servers is empty)")
        report["sglang_urls"] = probe.sglang_urls
        shape = {"trainer_backend": info.backend, "trainer_base_model": info.base_model,
                 "sampler_engine": status.engine, "sampler_base_model": status.base_model}
        report["shape"] = shape
        tokenizer = service.get_tokenizer()
        runs = rl.tenant_runs(args.ops)
        bound = args.keep_versions * len(runs)
        lock = threading.Lock()
        t0 = time.monotonic()
        report["loop_s"] = rl.run_tenants(
            runs, lambda run: tenant_loop(rl, service, tokenizer, run, args, probe, bound, lock, t0))
        try:
            report["gpus"] = gpu_processes(state)
        except Exception as exc:  # noqa: BLE001 - where the processes ran is informative; it must not fail the run
            report["gpus"] = {"error": f"{type(exc).__name__}: {exc}", "services": {}}
        expected = {f"{run.name}@v{row['version']}" for run in runs
                    for row in run.history[-args.keep_versions:]}
        final = probe.settled(expected, timeout=30.0)
        final.update(expected=sorted(expected), summary=rl.summarize(runs, args.window))
        probe.close()
        checks = {"production_shape": check(
            shape == {"trainer_backend": args.trainer_backend, "trainer_base_model": args.model,
                      "sampler_engine": args.engine, "sampler_base_model": args.model}, json.dumps(shape)),
                  **evaluate(runs, args, final, bound), "placement": placement_check(args, report["gpus"])}
        history = {run.name: run.history for run in runs}
        report.update(history=history, summary=final.pop("summary"), final_loaded=final,
                      timings=timing_summary(runs), steady_state=steady_state(history, args.warmup_iterations),
                      checks=checks)
        print_table(runs, checks)
    except Exception as exc:  # noqa: BLE001 - a start or loop failure is the report's verdict
        report["checks"] = {"ran": check(False, f"{type(exc).__name__}: {exc}")}
        if any(run.history for run in runs):  # a run stopped by its time limit still reports what it measured
            history = {run.name: list(run.history) for run in runs}
            report.update(history=history, steady_state=steady_state(history, args.warmup_iterations))
        print(f"FAIL ran: {type(exc).__name__}: {exc}", flush=True)
    finally:
        if state is not None:
            # Nothing of the run is needed after the report: a short grace, since `weed server` alone takes the full
            # 15 s default before its SIGKILL.
            stop_cluster(state, timeout=5.0)
    report["passed"] = all(c["passed"] for c in report["checks"].values() if c["required"])
    report["seconds"] = time.monotonic() - started
    if not report["passed"]:
        for log in [*sorted((data_dir / "logs").glob("*.log")), *sorted((data_dir / "sglang").glob("server-*.log"))]:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {log}\n" + "\n".join(tail))
    elif args.data_dir is None:
        shutil.rmtree(data_dir, ignore_errors=True)
        report["logs"] = "(removed with the temporary data dir after a passing run)"
    return report


class Terminated(Exception):
    """SIGTERM (a `timeout` around the run): the run stops, the cluster is stopped and the report still written."""


def _terminate(signum, _frame) -> None:
    raise Terminated(f"signal {signum} after {time.monotonic() - _STARTED:.0f}s")


_STARTED = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        return compare_main(args)
    signal.signal(signal.SIGTERM, _terminate)
    report = run_e2e(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{'PASSED' if report['passed'] else 'FAILED'}; wrote {args.out} ({report['seconds']:.0f}s)")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
