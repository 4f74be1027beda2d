"""Qwen3-MoE expert LoRA served by a real SGLang 0.5.17 on an NVIDIA GPU (marked gpu; skipped without CUDA or
sglang): a small random Qwen3-MoE (3 layers, every layer MoE, 16 experts top-4, hidden 512, GQA 8/2 of head_dim
64; built on the GPU, saved in bf16 with `tiny`'s byte tokenizer) served by one SGLang server that SGLangEngine
launches (module fixture; `--lora-target-modules all`, which SGLang resolves on a MoE model to q/k/v/o plus the
experts' gate_up/down; no --experts-shared-outer-loras: every version reaches SGLang in the per-expert layout,
`adapter_format.to_sglang`, shared-outer ones as their lossless expansion). Adapters of both expert layouts are
trained by a real trainer (torch backend, bf16 on the same GPU) or published as random blobs through a real
registry (Valkey + SeaweedFS), and served by sampler_svc's SGLang engine.

    bash scripts/gpu/moe_serve.sh tests        # on the GPU machine, after scripts/gpu/e2e.sh install-sglang

Logprob bound, sampler vs the trainer's Forward of the same version (derived, stated): both sides run the model in
bf16 (8 significant bits: each rounding is off by at most 2^-9 relative). A token's hidden state passes about 20
rounded results on its way to the logits here (per layer: attention output, o_proj, the LoRA deltas, the expert
combine, two residual adds; then the final norm and lm_head); independent roundings add like a random walk, about
sqrt(20) * 2^-9 = 0.9% of the state per side, 1.2% between two independent implementations. The logits of this
model have a standard deviation of about 1 (unit-RMS final norm, lm_head std 1/sqrt(hidden)), so a logit moves by
about 0.01-0.02 and a token logprob (logit minus log-sum-exp, which moves with it in part) typically by as much.
Routing flips: a token whose 4th and 5th router scores are closer than that error (router scores have std ~4
here, their neighbouring order statistics are ~0.8 apart, the error ~0.05) can take a different 4th expert on the
two sides: a few percent of tokens per layer. The 4th expert carries a small share of the renormalised top-4
weight, so such a token's logprobs move by ~0.05-0.3, and later tokens see it through attention. Measured on the
H100 for the torch backend alone (tests/gpu/test_megatron_moe.py, a small Qwen3-MoE in bf16 against fp32,
docs/gpu-runs/h100-moe4-gpu_tests_moe.log): mean 0.010-0.045 per token, worst token 0.03-0.81 (a flip). Two
independent bf16 implementations add their errors. Hence no bound on the maximum (one flip can reach it); bounds
on the mean (MEAN_BOUND = 0.1: twice the worst measured one-sided mean, about 5x the flip-free estimate) and the
90th percentile (P90_BOUND = 0.3: flipped tokens are fewer than 10% and within it). A version mix-up moves
logprobs by far more (0.7-1.9 per token for the adapters measured there): the test asserts that the base model
differs from the adapter by more than 2 x MEAN_BOUND on the same tokens, so the check can fail.

Batches (b, e): SGLang's bf16 kernels pick tile shapes by batch size, so a request batched with others is not
bit-identical to it alone. "Gives its single-request output" is asserted as: the greedy tokens are the same up to
the first difference; over that common prefix the logprobs agree within BATCH_TOL mean; at a difference (if any)
the batched token is a near tie of the single request's greedy choice (its logprob under the request's own
adapter, from ComputeLogprobs, within TIE_TOL of the greedy token's). A request served with another adapter or
with none fails at once (its greedy tokens diverge with a large gap).

Results (stats of every check) are written to $OUT/sglang_moe_results.json when OUT is set.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import pickle
import statistics
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from loraplane.client import AdamParams, ModelInput, RetryConfig, SamplingParams, ServiceClient, datum_from_sequence
from loraplane.rpc import BackgroundLoop
from loraplane.v1 import common_pb2, sampler_pb2, trainer_pb2
from tests.e2e.test_sampler_e2e import sample
from tests.fixtures.sampler import adapter_blob, start_live_sampler
from tests.fixtures.trainer import start_live_trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang"),
]

MEAN_BOUND = 0.1
P90_BOUND = 0.3
BATCH_TOL = 0.05
TIE_TOL = 0.15
RANK = 8
MAX_RANK = 16
SLOTS = 3  # --max-loras-per-batch (SGLang counts the base model as one of them)
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]


def recorder(filename: str):
    """record(name, value): the checks' stats, kept in $OUT/`filename` (when OUT is set) as they come."""
    results: dict = {}

    def record(name: str, value) -> None:
        results[name] = value
        out = os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / filename).write_text(json.dumps(results, indent=2, default=str))

    return record


record = recorder("sglang_moe_results.json")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from loraplane.models.tiny import build_tiny_tokenizer
    from tests.production_e2e import qwen3_moe_config, write_random_moe_dir

    config = qwen3_moe_config("small-moe", vocab_size=len(build_tiny_tokenizer()), dtype="bfloat16")
    directory = write_random_moe_dir(tmp_path_factory.mktemp("moe") / "small-moe", config, seed=7, device="cuda")
    # transformers saves its fused 3-D experts under the per-expert checkpoint names SGLang's qwen3_moe loads.
    from safetensors import safe_open

    names = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            names.update(handle.keys())
    assert "model.layers.0.mlp.experts.15.down_proj.weight" in names, sorted(names)[:20]
    return directory


@pytest.fixture(scope="module")
def moe_base(moe_dir):
    """The model on CPU in fp32: only its shapes and name are used (random adapter blobs)."""
    from loraplane.models import load_base_model

    return load_base_model(str(moe_dir))


@contextlib.contextmanager
def launched_sglang(model_dir: Path, work_dir: Path, name: str, start_timeout_s: float, log_lines: int = 60,
                    **engine_options):
    """One SGLang server launched by sampler_svc's SGLangEngine for `model_dir` on a loop of its own: its URL, the
    server stopped afterwards. A failed start prints the tail of the server's log first."""
    from sampler_svc.engines.sglang_engine import SGLangEngine

    loop = BackgroundLoop(name)
    engine = SGLangEngine(str(model_dir), launch_servers=1, work_dir=work_dir, **engine_options)
    try:
        try:
            loop.run(engine.start(), timeout=start_timeout_s)
        except BaseException:
            log = engine.work_dir / "server-0.log"
            if log.is_file():
                print("\n".join(log.read_text(errors="replace").splitlines()[-log_lines:]))
            raise
        yield engine.servers[0].url
    finally:
        loop.run(engine.stop(), timeout=120)
        loop.close()


@pytest.fixture(scope="module")
def moe_url(moe_dir, tmp_path_factory):
    with launched_sglang(moe_dir, tmp_path_factory.mktemp("sglang-moe"), "sglang-moe-launcher", 480,
                         max_lora_rank=MAX_RANK, max_loras_per_batch=SLOTS, max_loaded_loras=12,
                         startup_timeout_s=420,
                         extra_server_args=["--mem-fraction-static", "0.3", "--disable-cuda-graph"]) as url:
        yield url


def moe_sampler(registry, background_loop, url, moe_dir, tmp_path, **kwargs):
    settings = registry.settings.model_copy(update={"data_dir": tmp_path})
    kwargs.setdefault("max_loaded", 8)
    return start_live_sampler(settings, background_loop, registry.address, engine="sglang", sglang_urls=[url],
                              base_model=str(moe_dir), sglang_options={"max_lora_rank": MAX_RANK}, **kwargs)


def served_names(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
        return {m["id"] for m in json.loads(reply.read())["data"] if m.get("parent")}


def moe_blob(base, seed: int, *, layout: str = "per_expert", rank: int = RANK, scale: float = 0.3) -> bytes:
    """A PEFT target_parameters blob (the registry's canonical layout) with random non-zero B on attention and
    experts, so every version visibly changes the model."""
    return adapter_blob(seed, rank=rank, alpha=2 * rank, base=base, scale=scale, targets=MOE_TARGETS,
                        expert_layout=layout)


def create_moe_adapter(live, name: str, *, rank: int = RANK, layout=common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT,
                       base_model: str) -> None:
    config = common_pb2.LoraConfig(rank=rank, alpha=2 * rank, target_modules=MOE_TARGETS, expert_layout=layout)
    live.registry_call(lambda client: client.create_adapter(name, base_model=base_model, lora_config=config))


def prompts(count: int, length: int = 8, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 261, (length,), generator=generator).tolist() for _ in range(count)]


def assert_single_request_output(stub, name: str, version: int, prompt: list[int], alone, batched) -> dict:
    """See the module docstring ("Batches"): equal greedy tokens up to a near tie, close logprobs before it."""
    a, b = list(alone.tokens), list(batched.tokens)
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    prefix = [abs(x - y) for x, y in zip(list(alone.logprobs)[:n], list(batched.logprobs)[:n])]
    assert not prefix or statistics.fmean(prefix) <= BATCH_TOL, (name, prefix)
    gap = 0.0
    if n < min(len(a), len(b)):
        ref = common_pb2.AdapterRef(name=name)
        if name:
            ref.version = version
        scored = stub.ComputeLogprobs(sampler_pb2.ComputeLogprobsRequest(adapter=ref, tokens=prompt + b[:n + 1]),
                                      timeout=60)
        gap = float(alone.logprobs[n]) - float(scored.logprobs[len(prompt) + n])
        assert gap <= TIE_TOL, f"{name or 'base'}: batched token {b[n]} at {n} is {gap:.3f} below the greedy {a[n]}"
    else:
        assert len(a) == len(b), (name, a, b)
    return {"adapter": name or "(base)", "same_tokens": a == b, "diverged_at": None if a == b else n,
            "tie_gap": gap, "prefix_mean_abs": statistics.fmean(prefix) if prefix else 0.0}


# ---------------------------------------------------------------------------------------------------------------- a


def test_sampler_logprobs_equal_the_trainers_forward_within_the_bf16_bound(registry, background_loop, moe_url,
                                                                          moe_dir, tmp_path):
    """(a) and (b): a per-expert and a shared-outer adapter trained by the torch backend (bf16, this GPU) on a few
    fixed sequences, published, loaded into SGLang by the sampler; sampled logprobs against the trainer's Forward of
    the same version; then both versions and the base model in one batch."""
    from loraplane.models import load_base_model
    from trainer_svc.backends.torch_backend import TorchBackend

    backend = TorchBackend(load_base_model(str(moe_dir), "cuda", torch.bfloat16))
    trainer = start_live_trainer(registry.settings, background_loop, registry.address, base_model=str(moe_dir),
                                 backend=backend, gap_timeout_s=10.0, max_lora_rank=MAX_RANK)
    live = moe_sampler(registry, background_loop, moe_url, moe_dir, tmp_path)
    retry = RetryConfig(max_attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=300,
                        attempt_timeout_s=300)
    service = ServiceClient(trainer=trainer.address, sampler=live.address, registry=registry.address, retry=retry)
    try:
        versions, stats = {}, {}
        # Each adapter learns its own sequences (two adapters taught the same ones would decode alike).
        for name, layout, seed in (("moe/pe", common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT, 11),
                                   ("moe/so", common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER, 12)):
            sequences = prompts(4, length=24, seed=seed)
            data = [datum_from_sequence(s) for s in sequences]
            trainer.stub().CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
                name=name, lora_config=common_pb2.LoraConfig(rank=RANK, alpha=2 * RANK, seed=5,
                                                             target_modules=MOE_TARGETS, expert_layout=layout)))
            training = service.get_training_client(name)
            losses = []
            for _ in range(8):
                backward = training.forward_backward(data, "cross_entropy")
                assert not training.optim_step(AdamParams(learning_rate=5e-3)).result(300).skipped
                losses.append(backward.result(300).loss)
            assert losses[-1] < losses[0] * 0.9, (name, losses)
            sampling = training.save_weights_for_sampler("gpu").result(300)
            versions[name] = sampling.version
            diffs, base_diffs = [], []
            base_client = service.create_sampling_client()
            # Fresh prompts: on its own sequences the adapter is nearly certain (logprobs ~0 on both sides), which
            # would make the comparison easy; elsewhere its distribution is broad and its change of the model large.
            for seed, prompt in enumerate(prompts(8, seed=99)):
                for repeat in range(2):
                    reply = sampling.sample(ModelInput.from_ints(prompt), 1, SamplingParams(
                        max_tokens=16, temperature=1.0, seed=100 * seed + repeat)).result(300)
                    assert reply.served_version == sampling.version
                    seq = reply.sequences[0]
                    full = prompt + list(seq.tokens)
                    out = training.forward([datum_from_sequence(full)]).result(300).loss_fn_outputs[0]
                    learner = out["logprobs"].tolist()[len(prompt) - 1:]
                    diffs.extend(abs(x - y) for x, y in zip(learner, seq.logprobs, strict=True))
                    base = base_client.compute_logprobs(ModelInput.from_ints(full)).result(300)[len(prompt):]
                    base_diffs.extend(abs(x - y) for x, y in zip(learner, base, strict=True))
            ordered = sorted(diffs)
            stats[name] = {"tokens": len(diffs), "mean": statistics.fmean(diffs),
                           "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1],
                           "base_vs_adapter_mean": statistics.fmean(base_diffs), "losses": losses}
        record("a_logprobs_vs_forward", stats)
        for name, s in stats.items():
            assert s["mean"] <= MEAN_BOUND and s["p90"] <= P90_BOUND, (name, s)
            assert s["base_vs_adapter_mean"] > 2 * MEAN_BOUND, (name, s)

        # (b) both versions and the base model in one batch: each as it is alone.
        stub = live.stub()
        calls = [("moe/pe", versions["moe/pe"]), ("moe/so", versions["moe/so"]), ("", 0)]
        prompt = prompts(1, length=24, seed=11)[0][:8]  # a prompt moe/pe learned to continue
        alone = [sample(stub, n, version=v, prompt=prompt, temperature=0.0, max_tokens=16).sequences[0]
                 for n, v in calls]
        with concurrent.futures.ThreadPoolExecutor(len(calls) * 2) as pool:
            together = list(pool.map(lambda c: sample(stub, c[0], version=c[1], prompt=prompt, temperature=0.0,
                                                      max_tokens=16).sequences[0], calls * 2))
        checks = [assert_single_request_output(stub, n, v, prompt, single, batched)
                  for (n, v), single, batched in zip(calls * 2, alone * 2, together)]
        record("b_mixed_batch", checks)
        assert len({tuple(s.tokens) for s in alone}) == 3, "the two versions and the base must differ"
    finally:
        live.close()
        trainer.close()


# ---------------------------------------------------------------------------------------------------------------- c


def test_peft_target_parameters_layout_never_reaches_sglang(registry, background_loop, moe_url, moe_dir, moe_base,
                                                            tmp_path):
    """(c) The registry's blob is PEFT's target_parameters layout; what SGLang gets, as a file or as tensors, is
    the per-expert layout, and both serve the same outputs. A version SGLang cannot serve (rank above the servers'
    --max-lora-rank) is refused by the engine and never named to SGLang, which keeps serving."""
    from loraplane.adapter_format import adapter_header, parse_adapter
    from sampler_svc.engines.base import GenerationRequest, SamplingOptions
    from sampler_svc.engines.sglang_engine import SGLangEngine

    blob = moe_blob(moe_base, 31, layout="shared_outer")
    spec, _, dtypes = adapter_header(blob)
    assert any(".mlp.experts.base_layer.lora_A" in k for k in dtypes)  # the raw PEFT layout is what was published

    engine = SGLangEngine(str(moe_dir), urls=[moe_url], work_dir=tmp_path / "engine", max_lora_rank=MAX_RANK)
    background_loop.run(engine.start(), timeout=300)
    try:
        # What the tensor transport sends: per-expert keys only (decoded from the request body the engine builds).
        params, spec, base_name = parse_adapter(blob)
        body = json.loads(engine.transport.tensor_body("probe@v1", params, spec, base_name, engine.servers[0],
                                                       shared=False)[0])
        sent = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
        expert_keys = [k for k in sent if ".mlp.experts." in k]
        assert expert_keys and all(k.split(".mlp.experts.")[1].split(".")[0].isdigit() for k in expert_keys)
        assert not any("base_layer" in k for k in sent)
        assert set(body["config_dict"]["target_modules"]) >= {"gate_proj", "up_proj", "down_proj"}
        assert "target_parameters" not in body["config_dict"]

        outputs = {}
        for transport in ("file", "tensors"):
            engine.adapter_transport = transport
            key = f"layout@{transport}"
            background_loop.run(engine.load_adapter(key, blob), timeout=300)
            if transport == "file":
                from safetensors import safe_open

                with safe_open(str(engine.transport.adapter_dir(key) / "adapter_model.safetensors"), "pt") as handle:
                    names = list(handle.keys())
                assert not any("base_layer" in k for k in names)
                assert any(".mlp.experts.0.gate_proj.lora_A" in k for k in names)

            async def greedy(key=key):
                request = GenerationRequest(prompt_tokens=tuple(prompts(1, seed=3)[0]), adapter_key=key,
                                            options=SamplingOptions(max_tokens=16, temperature=0.0))
                updates = [u async for u in engine.generate(request)]
                return [t for u in updates for t in u.tokens], [x for u in updates for x in u.logprobs]

            outputs[transport] = background_loop.run(greedy(), timeout=120)
        assert engine.servers[0].tensor_loads is True
        worst = max(abs(x - y) for x, y in zip(outputs["file"][1], outputs["tensors"][1]))
        record("c_file_vs_tensors", {"tokens_equal": outputs["file"][0] == outputs["tensors"][0], "max": worst})
        assert outputs["file"][0] == outputs["tensors"][0] and worst <= 1e-3

        # A version SGLang cannot serve: refused by the engine, never named to SGLang.
        too_big = moe_blob(moe_base, 32, rank=2 * MAX_RANK)
        with pytest.raises(Exception) as refused:
            background_loop.run(engine.load_adapter("toobig@v1", too_big), timeout=120)
        assert "rank" in str(refused.value)
        assert "toobig@v1" not in served_names(moe_url)
        assert background_loop.run(greedy("layout@file"), timeout=120)[0] == outputs["file"][0]
    finally:
        background_loop.run(engine.stop(), timeout=120)

    # Through the sampler: the same refusal reaches the client as FAILED_PRECONDITION, and SGLang never sees it.
    live = moe_sampler(registry, background_loop, moe_url, moe_dir, tmp_path / "sampler")
    try:
        create_moe_adapter(live, "big", rank=2 * MAX_RANK, base_model=str(moe_dir))
        live.publish("big", moe_blob(moe_base, 33, rank=2 * MAX_RANK))
        with pytest.raises(grpc.RpcError) as error:
            sample(live.stub(), "big", version=1, max_tokens=4)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION, error.value
        assert not any(n.startswith("big@") for n in served_names(moe_url))
        assert sample(live.stub(), "", max_tokens=4).sequences[0].tokens
    finally:
        live.close()


# ---------------------------------------------------------------------------------------------------------------- d


def test_retention_unloads_moe_versions_from_sglang(registry, background_loop, moe_url, moe_dir, moe_base,
                                                    tmp_path):
    """(d) keep_versions=2 over four MoE versions (both layouts): SGLang ends with exactly the last two; an older
    version asked for by number is loaded again through the sampler and served by that version."""
    live = moe_sampler(registry, background_loop, moe_url, moe_dir, tmp_path, keep_versions=2,
                       instance_id="moe-retention")
    try:
        create_moe_adapter(live, "mr", base_model=str(moe_dir))
        for seed in range(4):
            live.publish("mr", moe_blob(moe_base, 600 + seed, layout=("per_expert", "shared_outer")[seed % 2]))
        live.wait_loaded({"mr@v3", "mr@v4"}, exact=True, timeout=300)
        deadline = time.monotonic() + 60
        while {n for n in served_names(moe_url) if n.startswith("mr@")} != {"mr@v3", "mr@v4"}:
            assert time.monotonic() < deadline, served_names(moe_url)
            time.sleep(0.2)
        stub = live.stub()
        assert sample(stub, "mr", version=1, max_tokens=4).served_version == 1
        live.wait_loaded({"mr@v3", "mr@v4"}, exact=True, timeout=120)
        deadline = time.monotonic() + 60
        while "mr@v1" in served_names(moe_url):
            assert time.monotonic() < deadline, served_names(moe_url)
            time.sleep(0.2)
        record("d_retention", {"sglang": sorted(n for n in served_names(moe_url) if n.startswith("mr@"))})
    finally:
        live.close()


# ---------------------------------------------------------------------------------------------------------------- e


def test_more_moe_adapters_than_batch_slots_serve_as_alone(registry, background_loop, moe_url, moe_dir, moe_base,
                                                           tmp_path):
    """(e) Five MoE versions (both layouts) and the base model requested at once, twice each, on a server with
    --max-loras-per-batch 3: SGLang serves them in turns, swapping MoE LoRA buffers, and every request gives its
    single-request output."""
    live = moe_sampler(registry, background_loop, moe_url, moe_dir, tmp_path)
    try:
        names = [f"slot{i}" for i in range(5)]
        for index, name in enumerate(names):
            create_moe_adapter(live, name, base_model=str(moe_dir))
            live.publish(name, moe_blob(moe_base, 800 + index, layout=("per_expert", "shared_outer")[index % 2]))
        live.wait_loaded({f"{n}@v1" for n in names}, timeout=300)
        stub = live.stub()
        prompt = prompts(1, seed=5)[0]
        calls = [(n, 1) for n in names] + [("", 0)]
        alone = [sample(stub, n, version=v, prompt=prompt, temperature=0.0, max_tokens=16).sequences[0]
                 for n, v in calls]
        assert len({tuple(s.tokens) for s in alone}) == len(calls), "every adapter must change the output"
        with concurrent.futures.ThreadPoolExecutor(2 * len(calls)) as pool:
            together = list(pool.map(lambda c: sample(stub, c[0], version=c[1], prompt=prompt, temperature=0.0,
                                                      max_tokens=16).sequences[0], calls * 2))
        checks = [assert_single_request_output(stub, n, v, prompt, single, batched)
                  for (n, v), single, batched in zip(calls * 2, alone * 2, together)]
        record("e_more_adapters_than_slots", checks)
    finally:
        live.close()
