"""Llama-3.x, Qwen2.5 and Qwen3 checkpoints in the megatron backend (megatron-core on CPU: gloo, fp32) and the torch
backend, against transformers and HF PEFT.

Each family is a small random checkpoint written with ``save_pretrained`` (GQA everywhere; Llama with ``llama3`` RoPE
scaling and tied embeddings, Qwen2 with q/k/v biases and tied embeddings, Qwen3 with q/k norms, an explicit head_dim
other than hidden/heads and an untied head) and loaded from its directory the way a user's base model is. Checked per
family: the RoPE frequencies equal transformers' own; logits equal transformers'; one LoRA step on every projection,
then the exported PEFT adapter applied to the HF model with ``peft`` gives the backend's logprobs; the torch backend
gives the megatron backend's logprobs and LoRA gradients. Unsupported configs are refused with FAILED_PRECONDITION
naming the feature.

Tolerances (fp32, one CPU). Both sides compute the same function in fp32 and may differ only in operation order (one
fused qkv GEMM vs three, torch RMSNorm vs HF's, megatron's rotary vs HF's, LoRA hooks vs PEFT layers), i.e. a few
ulps per op. Logits and logprobs here are at most ~10-15 in size, where one fp32 ulp is ~1e-6: we allow 2e-5 (about
20 ulps) on logits and logprobs, and 1e-5 relative on LoRA gradients. Measured on the 2-core dev box: logits
bit-identical, logprobs ≤ 4.8e-6, gradients ≤ 7.4e-7 relative. A mapping mistake moves them by far more: unscaled
llama3 RoPE 9.6 on logits, Qwen3 without q/k norms 1.2, Qwen2's k and v biases swapped 35.

The megatron checks run in a child process (``python tests/e2e/test_megatron_families_cpu.py`` prints one JSON line):
it initializes torch.distributed and the CPU shims of tests/fixtures/megatron_cpu.py, as tests/e2e/test_megatron_cpu.py's
checks do. tests/gpu/test_megatron_families.py runs the same measurements in bf16 on CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from tests.e2e.test_megatron_cpu import run
from tests.unit.test_megatron_layout import SHAPE, hf_state_dict
from trainer_svc.backends.megatron.layout import (
    hf_to_mcore_state_dict,
    interleave_qkv,
    mcore_to_hf_state_dict,
    split_qkv,
)

FAMILIES = ("llama3", "qwen2", "qwen3")
LOGITS_ATOL = 2e-5
LOGPROB_ATOL = 2e-5
GRAD_RTOL = 1e-5
# Ragged (packed back to back in one row); both longer than 16 tokens, the wavelength below which the llama3
# settings below (original context 64, high_freq_factor 4) keep a frequency unscaled.
SEQUENCE_LENGTHS = (29, 18)

# Small but with every feature a real checkpoint of the family has.
_COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "bos_token_id": 1,
           "eos_token_id": 4, "pad_token_id": 0}


def family_config(family: str, vocab_size: int):
    """The transformers config of a tiny checkpoint of ``family`` (or of an unsupported variant, for refusals)."""
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config

    common = {**_COMMON, "vocab_size": vocab_size}
    if family == "llama3":
        # As Llama-3.1/3.2 config.json files write it (rope_theta next to a rope_scaling dict); the original
        # context is scaled down so that 29 tokens span the three frequency bands of the rescaling.
        return LlamaConfig(**common, head_dim=16, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "qwen2":
        # Qwen2.5 configs carry a sliding_window that use_sliding_window=False switches off.
        return Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False,
                           sliding_window=32768, max_window_layers=2)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=24, tie_word_embeddings=False, attention_bias=False,
                           rope_theta=1000000.0)
    if family == "refuse:moe":
        # Qwen3-MoE runs (tests/e2e/test_megatron_moe_cpu.py); other families' experts do not.
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if family == "refuse:sliding_window":
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if family == "refuse:mlp_bias":
        return LlamaConfig(**common, mlp_bias=True)
    if family == "refuse:rope_yarn":
        return LlamaConfig(**common, rope_theta=10000.0, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    if family == "refuse:model_type":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(family)


# What each refused config must be refused for: a phrase of the error message.
REFUSALS = {
    "refuse:moe": "model_type 'mixtral'",
    "refuse:sliding_window": "sliding-window attention",
    "refuse:mlp_bias": "MLP biases",
    "refuse:rope_yarn": "rope_scaling type 'yarn'",
    "refuse:model_type": "model_type 'mistral'",
}


def write_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A random checkpoint of ``family`` in ``directory`` (weights and the tiny byte tokenizer), as a user's local
    HF directory would be."""
    from transformers import AutoModelForCausalLM

    from loraplane.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = AutoModelForCausalLM.from_config(family_config(family, len(tokenizer)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                # Around 1 but varying along the axis, so a norm over the wrong axis or a missing norm shows.
                param.copy_(1.0 + 0.4 * (torch.rand(param.shape, generator=generator) - 0.5))
            elif name.endswith("bias"):
                # HF initializes biases to zero, which would hide a bias placed in the wrong rows.
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            else:
                # Activations O(1) and logits far from uniform (|logit| up to ~10 with the tied head too), so
                # position and adapter changes move them.
                scale = 0.3 if "embed_tokens" in name else 1.0 / math.sqrt(param.shape[-1])
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def target_logprobs(model, data, device) -> list[torch.Tensor]:
    """Per-datum log p(target) of an HF (or PEFT) causal LM, each datum alone, in fp32."""
    out = []
    with torch.no_grad():
        for d in data:
            logits = model(input_ids=d.input_tokens.unsqueeze(0).to(device)).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, d.target_tokens.to(device).unsqueeze(-1)).squeeze(-1)
            out.append(lp.cpu())
    return out


def max_and_mean_abs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.float() - b.float()).abs()
    return diff.max().item(), diff.mean().item()


def family_measurements(family: str, root: Path, dtype: torch.dtype, with_torch_backend: bool) -> dict:
    """Everything the family tests assert on, as numbers. The megatron backend runs in ``dtype`` on its device (CUDA
    when there is one); transformers and PEFT give fp32 references on the same device and, when ``dtype`` is not
    fp32, their own ``dtype`` error as the yardstick for the megatron one."""
    from peft import PeftModel

    from loraplane.adapter_format import materialize_peft_dir, serialize_adapter
    from loraplane.lora import LoraSpec
    from loraplane.models import load_base_model
    from tests.gpu.test_megatron import datums, flat, logprobs_of, make_state, random_adapter
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.model import forward_logits, rope_inv_freq
    from trainer_svc.optimizer import AdamHyper

    directory = write_checkpoint(family, root / family)
    backend = MegatronBackend(str(directory), dtype=dtype, device_slots=2)
    device = backend.device
    reference = load_base_model(str(directory), device=str(device), dtype=torch.float32)
    report: dict = {"spec": {"qkv_bias": backend.engine.spec.qkv_bias,
                             "qk_layernorm": backend.engine.spec.qk_layernorm,
                             "rope_scaling": backend.engine.spec.rope_scaling is not None,
                             "tied": backend.engine.spec.tie_word_embeddings,
                             "head_dim": backend.engine.spec.shape.head_dim}}

    hf_inv_freq = reference.model.model.rotary_emb.inv_freq.float().cpu()
    report["rope_inv_freq_max_abs"] = (rope_inv_freq(backend.engine.spec) - hf_inv_freq).abs().max().item()
    default_inv_freq = rope_inv_freq(dataclasses.replace(backend.engine.spec, rope_scaling=None))
    report["rope_rescaled_bands"] = int((default_inv_freq != hf_inv_freq).sum())

    ids = torch.randint(0, reference.vocab_size, (2, max(SEQUENCE_LENGTHS)), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        megatron_logits = forward_logits(backend.engine.model, ids.to(device)).float()
        hf_logits = reference.model(input_ids=ids.to(device)).logits.float()
        hf_dtype = reference.model if dtype == torch.float32 else load_base_model(
            str(directory), device=str(device), dtype=dtype).model
        hf_dtype_logits = hf_dtype(input_ids=ids.to(device)).logits.float()
    report["logits_max_abs"], report["logits_mean_abs"] = max_and_mean_abs(megatron_logits, hf_logits)
    report["hf_dtype_logits_max_abs"], report["hf_dtype_logits_mean_abs"] = max_and_mean_abs(hf_dtype_logits,
                                                                                             hf_logits)
    report["logits_scale"] = hf_logits.abs().max().item()

    # One LoRA step on all seven projections, from an adapter whose B is not zero (so A gets gradients too).
    spec = LoraSpec.create(4, 8.0, [], seed=3)
    params = random_adapter(reference, spec, seed=5)
    data = datums(reference.vocab_size, SEQUENCE_LENGTHS, seed=11)
    state = make_state("a", spec, params, "cpu")
    megatron_lp, _ = logprobs_of(backend, state, data, backward=True)
    (megatron_grads,) = backend.driver.call("gather", {"name": "a", "rows": [1]})
    backend.optim_step(state, AdamHyper(learning_rate=1e-2))
    trained = backend.export_params(state)
    trained_lp, _ = logprobs_of(backend, state, data)
    report["update_norm"] = flat(trained[k] - params[k] for k in params).norm().item()

    peft_dir = materialize_peft_dir(serialize_adapter(trained, spec, str(directory)), root / f"{family}-adapter")
    base_lp = target_logprobs(reference.model, data, device)
    peft_lp = target_logprobs(PeftModel.from_pretrained(reference.model, str(peft_dir)).eval(), data, device)
    report["peft_max_abs"], report["peft_mean_abs"] = max_and_mean_abs(flat(trained_lp), flat(peft_lp))
    report["adapter_effect_max_abs"] = max_and_mean_abs(flat(peft_lp), flat(base_lp))[0]
    if dtype != torch.float32:
        peft_dtype_lp = target_logprobs(PeftModel.from_pretrained(hf_dtype, str(peft_dir)).eval(), data, device)
        report["peft_dtype_max_abs"], report["peft_dtype_mean_abs"] = max_and_mean_abs(flat(peft_dtype_lp),
                                                                                       flat(peft_lp))

    if with_torch_backend:
        from trainer_svc.backends.torch_backend import TorchBackend

        torch_backend = TorchBackend(str(directory), device=str(device), dtype=torch.float32)
        torch_state = make_state("a", spec, params, str(device))
        torch_lp, _ = logprobs_of(torch_backend, torch_state, data, backward=True)
        keys = list(params)
        torch_grads = flat(torch_state.params[k].grad.cpu() for k in keys)
        report["torch_backend_lp_max_abs"] = max_and_mean_abs(flat(torch_lp), flat(megatron_lp))[0]
        report["torch_backend_grad_rel"] = ((flat(megatron_grads[k] for k in keys) - torch_grads).norm()
                                            / torch_grads.norm()).item()
    return report


def refusal(case: str, root: Path) -> dict:
    """What the megatron backend does with an unsupported checkpoint: the domain error it raises, and the gRPC
    status the trainer's one error mapping (loraplane.rpc.to_rpc_status, what every servicer method aborts with)
    turns it into."""
    from loraplane.errors import LoraplaneError
    from loraplane.rpc import to_rpc_status
    from trainer_svc.backends.megatron.backend import MegatronBackend

    directory = write_checkpoint(case, root / case.replace(":", "-"))
    try:
        MegatronBackend(str(directory), dtype=torch.float32, device_slots=2)
    except Exception as exc:  # noqa: BLE001 - the test asserts on its type and status
        status = to_rpc_status(exc) if isinstance(exc, LoraplaneError) else None
        return {"error": type(exc).__name__, "code": status.code.name if status else None,
                "message": status.details if status else str(exc)}
    return {"error": None}


def main() -> None:
    """The child process: every family's measurements and every refusal, as one JSON line."""
    if not torch.cuda.is_available():
        import tests.fixtures.megatron_cpu  # noqa: F401  (before the backend is used)
    from trainer_svc.backends.megatron.model import init_parallel

    init_parallel(1)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in (*FAMILIES, *REFUSALS):
            try:
                out[name] = (family_measurements(name, Path(tmp), torch.float32, with_torch_backend=True)
                             if name in FAMILIES else refusal(name, Path(tmp)))
            except Exception:  # noqa: BLE001 - reported per family so one failure does not hide the others
                out[name] = {"failed": traceback.format_exc()}
    print(json.dumps(out))


# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured() -> dict:
    stdout = run([sys.executable, str(Path(__file__).resolve())], timeout=280)
    return json.loads(stdout.strip().splitlines()[-1])


EXPECTED_SPECS = {
    "llama3": {"qkv_bias": False, "qk_layernorm": False, "rope_scaling": True, "tied": True, "head_dim": 16},
    "qwen2": {"qkv_bias": True, "qk_layernorm": False, "rope_scaling": False, "tied": True, "head_dim": 16},
    "qwen3": {"qkv_bias": False, "qk_layernorm": True, "rope_scaling": False, "tied": False, "head_dim": 24},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads_with_the_logits_of_transformers(measured, family):
    m = measured[family]
    assert "failed" not in m, m.get("failed")
    print(json.dumps({family: m}))
    assert m["spec"] == EXPECTED_SPECS[family]
    assert m["rope_inv_freq_max_abs"] == 0.0  # transformers' own formula, bit for bit
    if family == "llama3":
        assert m["rope_rescaled_bands"] >= 2  # the rescaling is in force, not just a no-op of the same function
    assert m["logits_scale"] > 1.0
    assert m["logits_max_abs"] <= LOGITS_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_adapter_exports_to_peft_with_the_backends_logprobs(measured, family):
    m = measured[family]
    assert "failed" not in m, m.get("failed")
    assert m["update_norm"] > 0
    assert m["adapter_effect_max_abs"] > 1e-2  # the adapter moves the logprobs: the comparison is not vacuous
    assert m["peft_max_abs"] <= LOGPROB_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_backend_matches_the_megatron_backend(measured, family):
    m = measured[family]
    assert "failed" not in m, m.get("failed")
    assert m["torch_backend_lp_max_abs"] <= LOGPROB_ATOL
    assert m["torch_backend_grad_rel"] <= GRAD_RTOL


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_checkpoint_is_a_failed_precondition_naming_the_feature(measured, case):
    m = measured[case]
    assert "failed" not in m, m.get("failed")
    assert m["error"] == "FailedPrecondition" and m["code"] == "FAILED_PRECONDITION", m
    assert REFUSALS[case] in m["message"], m["message"]


# Architecture fields of the published config.json files (weights not needed: the spec is the config's).
PUBLISHED_CONFIGS = {
    "Llama-3.2-1B": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "Qwen2.5-0.5B": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "max_position_embeddings": 32768, "max_window_layers": 24,
        "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False},
    "Qwen3-0.6B": {
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
        "max_position_embeddings": 40960, "max_window_layers": 28, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "use_sliding_window": False},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_configs_map_to_the_megatron_model(name):
    """Real configs are accepted with their features mapped (Qwen2.5's switched-off sliding_window must not refuse
    it; Qwen3-0.6B's head_dim is twice hidden/heads)."""
    from transformers import AutoConfig

    from trainer_svc.backends.megatron.model import Llama3RopeScaling, spec_from_hf_config

    fields = dict(PUBLISHED_CONFIGS[name])
    spec = spec_from_hf_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    expected = {
        "Llama-3.2-1B": (False, False, Llama3RopeScaling(32.0, 1.0, 4.0, 8192), 500000.0, 64),
        "Qwen2.5-0.5B": (True, False, None, 1000000.0, 64),
        "Qwen3-0.6B": (False, True, None, 1000000.0, 128),
    }[name]
    assert (spec.qkv_bias, spec.qk_layernorm, spec.rope_scaling, spec.rope_theta, spec.shape.head_dim) == expected
    assert spec.tie_word_embeddings


def with_family_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``sd`` plus Qwen2's q/k/v biases and Qwen3's q/k norm weights on every layer."""
    g = torch.Generator().manual_seed(seed)
    out = dict(sd)
    for i in range(SHAPE.num_layers):
        p = f"model.layers.{i}.self_attn."
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[f"{p}{proj}.bias"] = torch.randn(SHAPE.out_features(proj), generator=g)
        out[p + "q_norm.weight"] = torch.randn(SHAPE.head_dim, generator=g)
        out[p + "k_norm.weight"] = torch.randn(SHAPE.head_dim, generator=g)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_bias_and_qk_norms_map_like_the_weights(tp):
    """Per rank, the fused linear_qkv with its bias gives that rank's q, k, v heads of the HF projections (bias
    included) in megatron's GQA interleave; the norms are replicated; the mapping round-trips."""
    hf = with_family_weights(hf_state_dict(SHAPE, seed=6), seed=7)
    x = torch.randn(5, SHAPE.hidden_size, generator=torch.Generator().manual_seed(8))
    groups_local = SHAPE.num_kv_heads // tp
    ranks = [hf_to_mcore_state_dict(hf, SHAPE, tp=tp, rank=r) for r in range(tp)]
    for rank, mc in enumerate(ranks):
        fused = x @ mc["decoder.layers.1.self_attention.linear_qkv.weight"].t()
        fused = fused + mc["decoder.layers.1.self_attention.linear_qkv.bias"]
        per_projection = [torch.chunk(x @ hf[f"model.layers.1.self_attn.{p}_proj.weight"].t()
                                      + hf[f"model.layers.1.self_attn.{p}_proj.bias"], tp, dim=-1)[rank]
                          for p in "qkv"]
        torch.testing.assert_close(fused, interleave_qkv(*per_projection, groups_local, SHAPE.head_dim, dim=-1))
        for got, want in zip(split_qkv(fused, groups_local, SHAPE.heads_per_group, SHAPE.head_dim, dim=-1),
                             per_projection):
            torch.testing.assert_close(got, want)
        assert torch.equal(mc["decoder.layers.1.self_attention.q_layernorm.weight"],
                           hf["model.layers.1.self_attn.q_norm.weight"])
    back = mcore_to_hf_state_dict(ranks, SHAPE, tied=True)
    assert set(back) == set(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_a_weight_without_a_megatron_counterpart_is_refused():
    """An o_proj bias (Llama/Qwen3 attention_bias) has no place in the megatron model: converting without it would
    silently compute another model."""
    hf = hf_state_dict(SHAPE, seed=9)
    hf["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(SHAPE.hidden_size)
    with pytest.raises(ValueError, match=r"self_attn\.o_proj\.bias"):
        hf_to_mcore_state_dict(hf, SHAPE)


if __name__ == "__main__":
    main()


def test_torch_backend_refuses_sliding_window_checkpoints(tmp_path):
    """The torch backend's packed attention and the torch engine's KV-cache decode attend to the whole causal
    prefix, so a checkpoint that slides its window is refused at load (not trained on logits transformers would
    not compute); Qwen2.5's switched-off window loads."""
    from loraplane.errors import FailedPrecondition
    from loraplane.models.base import load_base_model

    with pytest.raises(FailedPrecondition) as refused:
        load_base_model(str(write_checkpoint("refuse:sliding_window", tmp_path / "sliding")))
    assert "sliding-window attention" in str(refused.value) and refused.value.field == "base_model"
    assert load_base_model(str(write_checkpoint("qwen2", tmp_path / "qwen"))).num_layers == 2
