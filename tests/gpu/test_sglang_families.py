"""The families the cookbook and Tinker use now (Qwen3.5 dense and MoE, gpt-oss, Nemotron-H) served by a real SGLang
0.5.17 on an NVIDIA GPU (marked gpu; skipped without CUDA or sglang; issues 32 and 33, "Served").

Per family, one small random checkpoint in SGLang-sized shapes (head_dim 64; Gated DeltaNet / Mamba-2 heads its
kernels take), built with the family's own transformers classes on the GPU and saved in bf16 with `tiny`'s byte
tokenizer; one SGLang server launched by sampler_svc's SGLangEngine for it (`--lora-target-modules all`, CUDA graphs
off; the family's own server arguments, gpt-oss's triton MoE runner, added by the engine; the text-only Qwen3.5
classes with LoRA hooks from sampler_svc/engines/sglang_models, which the launcher hands SGLang), stopped before the
next family's. gpt-oss's config.json names swiglu_limit and Nemotron-H's asks for the Mamba kernels, as released.
A real trainer (torch backend, bf16 on the same GPU) trains one adapter on the targets SGLang serves for the family
(its `sglang` map: Qwen3.5's four Gated DeltaNet slices together; Nemotron-H's Mamba in_proj is not among them) and
publishes it through a real registry (Valkey + SeaweedFS); sampler_svc serves it on SGLang. Asserted per family:
- sampled logprobs equal the trainer's Forward of the same version within the bounds of tests/gpu/test_sglang_moe.py
  (derived there: two independent bf16 implementations, ~20 roundings per token, routing flips on MoE layers): mean
  <= MEAN_BOUND, 90th percentile <= P90_BOUND; and the base model differs from the adapter by more than
  2 x MEAN_BOUND on the same tokens, so the check can fail;
- version exactness: after a second version is published, a sample asked for v1 is served by v1 (the same greedy
  tokens as before) and v2 by v2 (its logprobs are v2's Forward's);
- a version with a target SGLang cannot serve (Qwen3.5's in_proj_b) is refused FAILED_PRECONDITION by the sampler,
  naming it, before it reaches SGLang.
Results (per family: stats, server arguments) go to $OUT/sglang_families_results.json when OUT is set.

    bash scripts/gpu/moe_serve.sh families [PYTEST -k EXPR]     # after scripts/gpu/e2e.sh install-sglang
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import grpc
import pytest
import torch

from loraplane.client import (
    AdamParams,
    APIError,
    ModelInput,
    RetryConfig,
    SamplingParams,
    ServiceClient,
    datum_from_sequence,
)
from loraplane.v1 import common_pb2, trainer_pb2
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer
from tests.gpu.test_sglang_moe import MEAN_BOUND, P90_BOUND, launched_sglang, prompts, recorder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang"),
]

RANK = 8
SERVER_ARGS = ["--mem-fraction-static", "0.25", "--disable-cuda-graph"]
record = recorder("sglang_families_results.json")


def _qwen3_5_text(vocab_size: int, **extra) -> dict:
    # 4 layers (three Gated DeltaNet, one gated full attention), GQA 8/2 of head_dim 64, GDN 4 key heads / 8 value
    # heads of 64, partial RoPE as released. SGLang reads the layer kinds from full_attention_interval, not
    # layer_types (sglang/srt/configs/qwen3_next.py layers_block_type), and transformers does not write it: set both.
    return dict(vocab_size=vocab_size, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                full_attention_interval=4, bos_token_id=1, eos_token_id=4, pad_token_id=0, **extra)


def qwen3_5_config(vocab_size: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_qwen3_5_text(vocab_size))


def qwen3_5_moe_config(vocab_size: int):
    from transformers import Qwen3_5MoeTextConfig

    text = _qwen3_5_text(vocab_size, moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=8,
                         num_experts_per_tok=2, router_aux_loss_coef=0.0)
    text.pop("intermediate_size")
    return Qwen3_5MoeTextConfig(**text)


def gpt_oss_config(vocab_size: int):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 512, "rope_theta": 150000.0},
        router_aux_loss_coef=0.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=4, pad_token_id=0)


def nemotron_h_config(vocab_size: int):
    # n_groups 8: SGLang's mixer reads mamba_n_groups (default 8) and its state cache n_groups
    # (sglang/srt/configs/nemotron_h.py, models/nemotron_h.py): equal whichever name a transformers version writes.
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=vocab_size, hidden_size=512, layers_block_type=["mamba", "moe", "attention", "mlp"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024, mamba_num_heads=8,
        mamba_head_dim=64, ssm_state_size=64, n_groups=8, conv_kernel=4, chunk_size=128, expand=1,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
        n_group=1, topk_group=1, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=4, pad_token_id=0, use_mamba_kernels=False)  # built here without the Hub's kernels


# family -> (config builder, model_type the family registry knows it by)
CONFIGS = {"qwen3_5": (qwen3_5_config, "qwen3_5"), "qwen3_5_moe": (qwen3_5_moe_config, "qwen3_5_moe"),
           "gpt_oss": (gpt_oss_config, "gpt_oss"), "nemotron_h": (nemotron_h_config, "nemotron_h")}


def write_checkpoint(family: str, directory: Path, device: str = "cuda", dtype=torch.bfloat16) -> Path:
    """A random checkpoint of `family` in these shapes, saved as transformers saves it, with the byte tokenizer."""
    from transformers import AutoModelForCausalLM

    from loraplane.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = CONFIGS[family][0](len(tokenizer))
    torch.manual_seed(1234)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    del model
    if family == "nemotron_h":
        sglang_nemotron_config(directory / "config.json")
    if family == "gpt_oss":
        released_gpt_oss_config(directory / "config.json")
    return directory


def released_gpt_oss_config(path: Path) -> None:
    """The released config.json names the clamped SwiGLU's limit (swiglu_limit 7.0), which SGLang 0.5.17 reads; the
    transformers it carries (5.12) hard-codes the limit and does not write it."""
    config = json.loads(path.read_text())
    config.setdefault("swiglu_limit", 7.0)
    path.write_text(json.dumps(config, indent=2))


def sglang_nemotron_config(path: Path) -> None:
    """SGLang 0.5.17's NemotronHConfig accepts layer kinds mamba/attention/moe/mlp only (newer transformers write
    linear_attention/full_attention) and reads mamba_n_groups; transformers reads both forms back the same."""
    config = json.loads(path.read_text())
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layers_block_type"] = [names.get(kind, kind) for kind in config["layers_block_type"]]
    config.pop("mtp_layers_block_type", None)  # unused without MTP layers; SGLang validates it in its own names
    config["mamba_n_groups"] = config["n_groups"]
    # As released: the trainer's loader must not let transformers fetch the Mamba kernels from the Hub for it.
    config["use_mamba_kernels"] = True
    path.write_text(json.dumps(config, indent=2))


def sglang_targets(model_type: str, config) -> list[str]:
    """The LoRA targets this checkpoint offers that SGLang serves for its family (its `sglang` map's keys)."""
    from loraplane.models.families import FAMILIES

    family = FAMILIES[model_type]
    return sorted(set(family.sglang) & set(family.lora_targets(config)))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def served(request, tmp_path_factory):
    """(family, checkpoint dir, SGLang server URL): one server per family, stopped after its tests."""
    family = request.param
    directory = write_checkpoint(family, tmp_path_factory.mktemp(family) / "model")
    started = False
    try:
        with launched_sglang(directory, tmp_path_factory.mktemp(f"sglang-{family}"), f"sglang-{family}", 360,
                             log_lines=80, max_lora_rank=16, max_loras_per_batch=3, max_loaded_loras=8,
                             startup_timeout_s=300, extra_server_args=list(SERVER_ARGS)) as url:
            started = True
            yield family, directory, url
    except BaseException:
        if not started:
            record(f"{family}_server_start", "failed")
        raise


def test_sampler_serves_each_family_as_the_trainer_computes_it(served, registry, background_loop, tmp_path):
    from loraplane.models import load_base_model
    from trainer_svc.backends.torch_backend import TorchBackend

    family, directory, url = served
    model_type = CONFIGS[family][1]
    base = load_base_model(str(directory), "cuda", torch.bfloat16)
    targets = sglang_targets(model_type, base.model.config)
    backend = TorchBackend(base)
    trainer = start_live_trainer(registry.settings, background_loop, registry.address, base_model=str(directory),
                                 backend=backend, gap_timeout_s=10.0, max_lora_rank=16)
    live = start_live_sampler(registry.settings.model_copy(update={"data_dir": tmp_path}), background_loop,
                              registry.address, engine="sglang", sglang_urls=[url], base_model=str(directory),
                              sglang_options={"max_lora_rank": 16}, max_loaded=8)
    retry = RetryConfig(max_attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=300,
                        attempt_timeout_s=300)
    service = ServiceClient(trainer=trainer.address, sampler=live.address, registry=registry.address, retry=retry)
    name = f"fam/{family.replace('_', '-')}"
    try:
        trainer.stub().CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=name, lora_config=common_pb2.LoraConfig(rank=RANK, alpha=2 * RANK, seed=5, target_modules=targets)))
        training = service.get_training_client(name)
        data = [datum_from_sequence(s) for s in prompts(4, length=24, seed=3)]

        def train(steps: int) -> list[float]:
            losses = []
            for _ in range(steps):
                backward = training.forward_backward(data, "cross_entropy")
                assert not training.optim_step(AdamParams(learning_rate=5e-3)).result(300).skipped
                losses.append(backward.result(300).loss)
            return losses

        losses = train(6)
        assert losses[-1] < losses[0], (family, losses)
        v1 = training.save_weights_for_sampler("v1").result(300)
        base_client = service.create_sampling_client()
        diffs, base_diffs = [], []
        for seed, prompt in enumerate(prompts(6, seed=99)):
            reply = v1.sample(ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=16, temperature=1.0,
                                                                              seed=seed)).result(300)
            assert reply.served_version == v1.version
            full = prompt + list(reply.sequences[0].tokens)
            learner = training.forward([datum_from_sequence(full)]).result(300).loss_fn_outputs[0]["logprobs"]
            learner = learner.tolist()[len(prompt) - 1:]
            diffs.extend(abs(a - b) for a, b in zip(learner, reply.sequences[0].logprobs, strict=True))
            base = base_client.compute_logprobs(ModelInput.from_ints(full)).result(300)[len(prompt):]
            base_diffs.extend(abs(a - b) for a, b in zip(learner, base, strict=True))
        ordered = sorted(diffs)
        stats = {"targets": targets, "server_args": SERVER_ARGS, "tokens": len(diffs), "losses": losses,
                 "mean": statistics.fmean(diffs), "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1],
                 "base_vs_adapter_mean": statistics.fmean(base_diffs)}

        # Version exactness: v1's greedy output stays v1's once v2 exists; v2 is served as v2.
        probe = prompts(1, length=24, seed=3)[0][:8]
        greedy = SamplingParams(max_tokens=12, temperature=0.0)
        before = v1.sample(ModelInput.from_ints(probe), 1, greedy).result(300).sequences[0]
        train(3)
        v2 = training.save_weights_for_sampler("v2").result(300)
        after = v1.sample(ModelInput.from_ints(probe), 1, greedy).result(300)
        assert after.served_version == v1.version and list(after.sequences[0].tokens) == list(before.tokens)
        newer = v2.sample(ModelInput.from_ints(probe), 1, greedy).result(300)
        assert newer.served_version == v2.version
        full = probe + list(newer.sequences[0].tokens)
        learner = training.forward([datum_from_sequence(full)]).result(300).loss_fn_outputs[0]["logprobs"]
        v2_diff = statistics.fmean(abs(a - b) for a, b in zip(learner.tolist()[len(probe) - 1:],
                                                              newer.sequences[0].logprobs, strict=True))
        stats["v2_mean"] = v2_diff
        record(family, stats)
        assert stats["mean"] <= MEAN_BOUND and stats["p90"] <= P90_BOUND, (family, stats)
        assert stats["base_vs_adapter_mean"] > 2 * MEAN_BOUND, (family, stats)
        assert v2_diff <= P90_BOUND, (family, v2_diff)

        if model_type == "qwen3_5":
            # Tinker's in_proj_b has no LoRA in SGLang: refused by the sampler before SGLang sees it.
            trainer.stub().CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
                name="fam/unservable", lora_config=common_pb2.LoraConfig(rank=RANK, alpha=2 * RANK,
                                                                         target_modules=["in_proj_b", "o_proj"])))
            refused = service.get_training_client("fam/unservable").save_weights_for_sampler("x").result(300)
            with pytest.raises(APIError) as caught:
                refused.sample(ModelInput.from_ints(probe), 1, greedy).result(300)
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION, caught.value
            assert "in_proj_b" in str(caught.value), caught.value
    finally:
        service.close()
        live.close()
        trainer.close()
