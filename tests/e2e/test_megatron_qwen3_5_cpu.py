"""Qwen3.5 (``qwen3_5``: Gated DeltaNet layers, gated full attention, partial RoPE, (1 + w) RMSNorms) in the megatron
backend on CPU (fp32, gloo), against transformers and the torch backend.

Two tiny random vision-language checkpoints as users download them: the family's tiny config (two DeltaNet layers
per attention layer, GQA 4/2, DeltaNet q/k heads 2 x 8 narrower than its value heads 4 x 16, untied head) and a
second one with another layer pattern (attention first), DeltaNet q/k heads wider than the value heads (2 x 16 vs
4 x 8), a 3-tap conv, a tied head and a vocabulary that two tensor-parallel ranks split.

One child process per launch (``python this_file.py --config C --out F``, or under torchrun with ``--tp``) prints
nothing the tests parse but writes one JSON file: rank 0 drives the backend (fused batches of several tenants on two
device slots, so adapters spill), the other ranks follow. Checked:
  * logits of each datum equal transformers' (the datum alone on both sides: bit for bit on this CPU; the tolerance
    is the other families' 2e-5);
  * LoRA on every target (q/k/v/o, in_proj_q/k/v/z/b/a, out_proj, the MLP): logprobs and gradients equal the torch
    backend's, and after one AdamW step the exported adapter has the torch backend's tensor names and shapes and
    (nearly) its values;
  * a tenant's logprobs and gradients fused with another tenant equal its own alone, bit for bit (dense: one rank
    and TP=2; the MoE within tolerance, as Qwen3-MoE's);
  * TP=2 and DP=2 (two ranks) give what one rank gives (tolerances at RANKS_LOGPROB_ATOL).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

LOGITS_ATOL = 2e-5
LOGPROB_ATOL = 2e-5
GRAD_RTOL = 1e-5
# Two ranks against one: their sums run in another order (row-parallel out_proj / o_proj / down_proj, the
# vocabulary-parallel log-softmax), and the chunked delta rule amplifies such rounding far more than attention does
# (its triangular solves and exp(cumulative decay) products): with the DeltaNet layers swapped for attention, TP=2 is
# within 3e-6 of one rank; with them, logprobs move by up to ~1e-4 (median ~2e-6) and gradients by ~5e-4 relative.
# (Both implementations run the same ops in the same order on one rank, which is why they agree bit for bit there.)
# A sharding mistake (a head's rows on the wrong rank, a channel block swapped) moves logprobs by O(1).
RANKS_LOGPROB_ATOL = 3e-4
RANKS_GRAD_RTOL = 2e-3
MOE_GRAD_RTOL = 1e-3  # measured 1.2e-4 to 5.8e-4 against the torch backend (the amplification above)
LENGTHS = (70, 23, 9)  # one datum longer than the delta rule's 64-token chunk


def checkpoint(name: str, directory: Path) -> Path:
    """``tiny``: the family's own tiny checkpoint (tests/fixtures/models.py); ``wide_qk``: the second config."""
    from tests.fixtures.models import build_checkpoint, seeded_

    if name == "tiny":
        return build_checkpoint("qwen3_5", directory)
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    from loraplane.models import families
    from loraplane.models.families.qwen3_5 import _TINY_VISION
    from loraplane.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    if name == "moe":  # the family's tiny MoE with a vocabulary that two tensor-parallel ranks split
        model = AutoModelForImageTextToText.from_config(families.FAMILIES["qwen3_5_moe"].tiny_config(len(tokenizer) + 1))
        seeded_(model.float())
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        return directory
    text = {"vocab_size": len(tokenizer) + 1, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_conv_kernel_dim": 3,
            "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            "bos_token_id": 1, "eos_token_id": 4, "pad_token_id": 0}
    config = Qwen3_5Config(text_config=text, vision_config=dict(_TINY_VISION), tie_word_embeddings=True)
    model = AutoModelForImageTextToText.from_config(config)
    seeded_(model.float(), seed=5)
    with torch.no_grad():  # the tied head's logits as large as the untied one's (|logit| ~5, not ~50)
        model.get_input_embeddings().weight.mul_(0.2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def ulp_sensitivity(model, data) -> float:
    """How far transformers' own logits move when its input embeddings move by about one fp32 ulp: the yardstick
    for a comparison in which some op (the MoE router's renormalization, an expert GEMM) rounds differently. The
    chunked delta rule amplifies such a difference ~30-fold per DeltaNet layer (its triangular solves and
    exp(cumulative decay) products), so two correct fp32 implementations that do not run the same ops in the same
    order differ by far more than the other families' 2e-5."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    with torch.no_grad():
        for d in data:
            embeds = model.get_input_embeddings()(d.input_tokens.unsqueeze(0))
            sign = torch.randint(0, 2, embeds.shape, generator=g).float() * 2 - 1
            moved = embeds * (1 + 2.0 ** -23 * sign)
            a = model(inputs_embeds=embeds).logits.float()
            b = model(inputs_embeds=moved).logits.float()
            worst = max(worst, (a - b).abs().max().item())
    return worst


def child(config: str, tp: int, out: Path, full: bool, ep: int = 1) -> None:
    if not torch.cuda.is_available():
        import tests.fixtures.megatron_cpu  # noqa: F401  (before the backend is used)
    import torch.distributed as dist

    from loraplane.lora import LoraSpec
    from loraplane.models import load_base_model
    from loraplane.models.families import lora_targets
    from tests.fixtures.megatron_lora_report import lora_report
    from tests.gpu.test_megatron import datums
    from trainer_svc.backends.megatron.backend import Driver, MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.backends.megatron.model import forward_logits, init_parallel

    with tempfile.TemporaryDirectory() as tmp:
        # Written before torch.distributed starts (transformers' save_pretrained then writes on every rank).
        directory = checkpoint(config, Path(tmp) / config)
        init_parallel(tp, expert_parallel_size=ep)
        base = load_base_model(str(directory), device="cpu", dtype=torch.float32, backend="megatron")
        engine = Engine(base, device_slots=2, dtype=torch.float32)
        driver = Driver(engine)
        if dist.get_rank() != 0:
            driver.follow()
            return
        backend = MegatronBackend(engine=engine, driver=driver)
        report: dict = {"config": config, "linear_layers": list(engine.shape.linear_layers)}
        data = datums(base.vocab_size - 1, LENGTHS, seed=11)

        if full:
            reference = load_base_model(str(directory), device="cpu", dtype=torch.float32)
            worst = scale = 0.0
            with torch.no_grad():
                for d in data:
                    got = forward_logits(engine.model, d.input_tokens.unsqueeze(0)).float()
                    want = reference.model(input_ids=d.input_tokens.unsqueeze(0)).logits.float()
                    worst = max(worst, (got - want).abs().max().item())
                    scale = max(scale, want.abs().max().item())
            report["logits_max_abs"], report["logits_scale"] = worst, scale
            report["hf_ulp_sensitivity"] = ulp_sensitivity(reference.model, data)

        every = LoraSpec.create(4, 8.0, [], seed=3, available=lora_targets(base.config))
        some = LoraSpec.create(2, 4.0, ["in_proj_q", "in_proj_v", "out_proj", "q_proj", "down_proj"], seed=4)
        other = datums(base.vocab_size - 1, (31, 12), seed=12)
        report.update(lora_report(backend, driver, base, directory, every, some, data, other, full))
        out.write_text(json.dumps(report))
        driver.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny", help="one config, or several (comma-separated) on one rank")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--full", action="store_true", help="also compare with transformers and the torch backend")
    args = ap.parse_args()
    for config in args.config.split(","):  # one process for several: each launch costs seconds of imports
        child(config, args.tp, Path(f"{args.out}.{config}"), args.full, args.ep)


# ------------------------------------------------------------------------------------------------------------------


def _launch(tmp: Path, configs: tuple[str, ...], nproc: int = 1, tp: int = 1, full: bool = False,
            ep: int = 1) -> dict:
    from tests.e2e.test_megatron_cpu import run, torchrun

    out = tmp / f"{nproc}-{tp}-{ep}"
    args = [str(Path(__file__).resolve()), "--config", ",".join(configs), "--tp", str(tp), "--ep", str(ep),
            "--out", str(out)]
    if full:
        args.append("--full")
    run(torchrun(nproc, *args) if nproc > 1 else [sys.executable, *args], timeout=280)
    return {c: json.loads(Path(f"{out}.{c}").read_text()) for c in configs}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return _launch(tmp_path_factory.mktemp("qwen3_5"), CONFIGS, full=True)


CONFIGS = ("tiny", "wide_qk", "moe")


def _tolerance(m: dict, atol: float) -> float:
    """The dense models run transformers' ops in transformers' order (bit for bit here), so the other families'
    bound holds; the MoE one rounds its router and experts differently (as tests/e2e/test_megatron_moe_cpu.py's
    Qwen3-MoE does, within 2e-5 there), which the DeltaNet layers amplify: it is held to transformers' own
    one-ulp sensitivity instead (:func:`ulp_sensitivity`)."""
    return atol if "moe" not in m["config"] else max(atol, m["hf_ulp_sensitivity"])


@pytest.mark.parametrize("config", CONFIGS)
def test_logits_equal_transformers(measured, config):
    m = measured[config]
    assert m["linear_layers"] == ([1, 2] if config == "wide_qk" else [0, 1, 3, 4])
    assert m["logits_scale"] > 1.0
    assert m["logits_max_abs"] <= _tolerance(m, LOGITS_ATOL)
    if config != "moe":
        assert m["logits_max_abs"] == 0.0  # same ops in the same order as transformers


@pytest.mark.parametrize("config", CONFIGS)
def test_lora_matches_the_torch_backend_and_exports_its_names(measured, config):
    m = measured[config]
    assert m["adapter_effect"] > 1e-2  # the adapter moves the logprobs: the comparisons are not vacuous
    assert m["torch_lp_max_abs"] <= _tolerance(m, LOGPROB_ATOL)
    assert m["torch_grad_rel"] <= (GRAD_RTOL if config != "moe" else MOE_GRAD_RTOL)
    assert m["keys"]["a1"] == m["torch_keys"]
    for module in (".linear_attn.in_proj_q.", ".linear_attn.in_proj_b.", ".linear_attn.out_proj.",
                   ".self_attn.q_proj."):
        assert any(module in k for k in m["torch_keys"]), module
    if config == "moe":
        assert any(".mlp.shared_expert.gate_proj." in k for k in m["torch_keys"])
        assert any(".mlp.experts.lora_A." in k for k in m["torch_keys"])
    assert m["torch_shapes_equal"]
    if config != "moe":  # (the MoE's near-zero expert gradients may take AdamW's first step either way)
        assert m["torch_trained_max_abs"] <= 1e-4


@pytest.mark.parametrize("config", CONFIGS)
def test_fused_tenants_equal_alone(measured, config):
    """Bit for bit on the dense models; the MoE's expert GEMMs group a tenant's rows with the other tenant's (as
    Qwen3-MoE's, held to 1e-5 in tests/e2e/test_megatron_moe_cpu.py), which the DeltaNet layers then amplify (see
    :func:`ulp_sensitivity`)."""
    m = measured[config]
    assert m["grad_norm_a"] > 0
    if config != "moe":
        assert m["fused_equals_alone"] is True
    else:
        assert m["fused_lp_diff"] <= _tolerance(m, 1e-5)
        assert m["fused_grad_rel"] <= 1e-5


@pytest.mark.parametrize("config,tp,ep", [("wide_qk", 2, 1), ("wide_qk", 1, 1), ("moe", 1, 2), ("moe", 2, 1)],
                         ids=["tp2", "dp2", "moe-ep2", "moe-tp2"])
def test_two_ranks_equal_one_rank(measured, tmp_path, config, tp, ep):
    one = measured[config]
    other = _launch(tmp_path, (config,), 2, tp, ep=ep)[config]
    # (Under DP a rank holds the gradients of its own datums until the step reduces them; the MoE: see above.)
    if tp > 1 and config != "moe":
        assert other["fused_equals_alone"] is True
    assert other["keys"] == one["keys"]
    # Another order of sums is a perturbation of about an ulp: held to transformers' own one-ulp sensitivity too.
    atol = max(RANKS_LOGPROB_ATOL, 2 * one["hf_ulp_sensitivity"])
    for field in ("base_logprobs", "logprobs"):
        diff = (torch.tensor(one[field]) - torch.tensor(other[field])).abs()
        assert diff.max().item() <= atol, (field, diff.max().item(), atol)
        assert diff.median().item() <= 1e-5, (field, diff.median().item())
    g1, g2 = torch.tensor(one["grads"]), torch.tensor(other["grads"])
    assert ((g1 - g2).norm() / g1.norm()).item() <= RANKS_GRAD_RTOL


if __name__ == "__main__":
    main()
