"""gpt-oss (``gpt_oss``: attention sinks, alternating sliding-window / full attention, q/k/v/o biases, YaRN RoPE,
a biased top-k router, biased experts with interleaved gate/up and the clamped SwiGLU) in the megatron backend on
CPU (fp32, gloo), against transformers (eager attention, as the torch backend runs it) and the torch backend.

The family's tiny checkpoint (tests/fixtures/models.py: window 4 then full attention, GQA 4/2, 4 experts top-2,
YaRN as released, scaled down). One child process per launch (``python this_file.py --out F``, or under torchrun
with ``--tp`` / ``--ep``) writes one JSON file: rank 0 drives the backend, the other ranks follow. Checked:
  * logits of each datum alone equal transformers' (datums longer than the window, so the window and the sinks
    both matter), and each datum's logits in a packed row of several equal its logits alone, bit for bit;
  * LoRA on every target (q/k/v/o and the experts' gate_up_proj / down_proj): logprobs and gradients equal the
    torch backend's, and after one AdamW step the exported adapter has the torch backend's tensor names and shapes;
  * a tenant fused with another equals itself alone;
  * TP=2 and EP=2 (two ranks) give what one rank gives.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from loraplane.models import families

LOGITS_ATOL = 2e-5
LOGPROB_ATOL = 2e-5
GRAD_RTOL = 1e-5
RANKS_LOGPROB_ATOL = 2e-5
RANKS_GRAD_RTOL = 1e-5

LENGTHS = (19, 7, 12)  # each longer than the sliding window (4)


def checkpoint(directory: Path) -> Path:
    """The family's tiny checkpoint (as tests/fixtures/models.py builds it) with one more vocabulary entry, so two
    tensor-parallel ranks split the vocabulary."""
    from transformers import AutoModelForCausalLM

    from loraplane.models.tiny import build_tiny_tokenizer
    from tests.fixtures.models import seeded_

    tokenizer = build_tiny_tokenizer()
    model = AutoModelForCausalLM.from_config(families.FAMILIES["gpt_oss"].tiny_config(len(tokenizer) + 1))
    seeded_(model.float())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def child(tp: int, out: Path, full: bool, ep: int = 1) -> None:
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
        directory = checkpoint(Path(tmp) / "gpt_oss")
        init_parallel(tp, expert_parallel_size=ep)
        base = load_base_model(str(directory), device="cpu", dtype=torch.float32, backend="megatron")
        engine = Engine(base, device_slots=2, dtype=torch.float32)
        driver = Driver(engine)
        if dist.get_rank() != 0:
            driver.follow()
            return
        backend = MegatronBackend(engine=engine, driver=driver)
        report: dict = {}
        data = datums(base.vocab_size - 1, LENGTHS, seed=11)

        if full:
            reference = load_base_model(str(directory), device="cpu", dtype=torch.float32)
            worst = scale = 0.0
            alone = []
            with torch.no_grad():
                for d in data:
                    got = forward_logits(engine.model, d.input_tokens.unsqueeze(0)).float()
                    want = reference.model(input_ids=d.input_tokens.unsqueeze(0)).logits.float()
                    worst = max(worst, (got - want).abs().max().item())
                    scale = max(scale, want.abs().max().item())
                    alone.append(got[0])
                row = torch.cat([d.input_tokens for d in data])
                packed = forward_logits(engine.model, row, [len(d.input_tokens) for d in data])[0].float()
            report["logits_max_abs"], report["logits_scale"] = worst, scale
            report["packed_max_abs"] = (packed - torch.cat(alone)).abs().max().item()
            # The attention alone (sinks, windows, per datum): the same row through the model with every datum
            # run alone vs packed, layer 0's attention output.
            report["packed_attention_equal"] = _packed_attention_equal(engine.model, data)
            # The sinks and the window matter here: without them transformers' logits move.
            with torch.no_grad():
                d = data[0].input_tokens.unsqueeze(0)
                want = reference.model(input_ids=d).logits.float()
                for layer in reference.model.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)
                report["sink_effect"] = (reference.model(input_ids=d).logits.float() - want).abs().max().item()

            report["attention_bias_max_abs"] = _attention_bias_families()

        every = LoraSpec.create(4, 8.0, [], seed=3, available=lora_targets(base.config))
        some = LoraSpec.create(2, 4.0, ["q_proj", "o_proj", "experts.down_proj"], seed=4,
                               available=lora_targets(base.config))
        other = datums(base.vocab_size - 1, (13, 6), seed=12)
        report.update(lora_report(backend, driver, base, directory, every, some, data, other, full))
        out.write_text(json.dumps(report))
        driver.shutdown()


def _attention_bias_families() -> float:
    """Llama and Qwen3 with attention_bias=True (q/k/v and o biased, the o bias made large): the megatron model's
    logits against transformers', the largest difference."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.models import seeded_
    from trainer_svc.backends.megatron.model import build_from_hf, forward_logits

    worst = 0.0
    for model_type in ("llama", "qwen3"):
        config = families.FAMILIES[model_type].tiny_config(262)
        config.attention_bias = True
        hf = AutoModelForCausalLM.from_config(config).float()
        seeded_(hf)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("o_proj.bias"):
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
            model, spec = build_from_hf(hf, torch.float32, torch.device("cpu"))
            assert spec.o_bias and spec.qkv_bias
            ids = torch.randint(0, 262, (2, 9), generator=torch.Generator().manual_seed(2))
            worst = max(worst, (forward_logits(model, ids) - hf(input_ids=ids).logits).abs().max().item())
    return worst


def _packed_attention_equal(model, data) -> bool:
    """On every layer (sliding window and full), each datum's core-attention output (sinks, window, RoPE) in the
    packed row equals the output of its own queries, keys and values run alone, bit for bit."""
    from trainer_svc.backends.megatron.attention import packed_rows
    from trainer_svc.backends.megatron.model import forward_logits

    calls: list = []

    def keep(module, args, kwargs, output):
        calls.append((module, args[:3], kwargs["packed_seq_params"], output.detach()))

    hooks = [layer.self_attention.core_attention.register_forward_hook(keep, with_kwargs=True)
             for layer in model.decoder.layers]
    try:
        with torch.no_grad():
            forward_logits(model, torch.cat([d.input_tokens for d in data]), [len(d.input_tokens) for d in data])
    finally:
        for h in hooks:
            h.remove()
    equal = len(calls) == len(model.decoder.layers)
    with torch.no_grad():
        for module, (q, k, v), packed, out in calls:
            for start, end in packed.bounds:
                alone = packed_rows([end - start], q.device)
                alone.rope_angles, alone.rope_scale = packed.rope_angles[start:end], packed.rope_scale
                got = module(q[start:end], k[start:end], v[start:end], None, packed_seq_params=alone)
                equal = equal and torch.equal(got, out[start:end])
    return equal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--full", action="store_true", help="also compare with transformers and the torch backend")
    args = ap.parse_args()
    child(args.tp, Path(args.out), args.full, args.ep)


# ------------------------------------------------------------------------------------------------------------------


def _launch(tmp: Path, nproc: int = 1, tp: int = 1, full: bool = False, ep: int = 1) -> dict:
    from tests.e2e.test_megatron_cpu import run, torchrun

    out = tmp / f"{nproc}-{tp}-{ep}.json"
    args = [str(Path(__file__).resolve()), "--tp", str(tp), "--ep", str(ep), "--out", str(out)]
    if full:
        args.append("--full")
    run(torchrun(nproc, *args) if nproc > 1 else [sys.executable, *args], timeout=280)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    return _launch(tmp_path_factory.mktemp("gpt_oss"), full=True)


def test_logits_equal_transformers_and_packed_equals_alone(measured):
    m = measured
    assert m["logits_scale"] > 1.0
    assert m["sink_effect"] > 1e-3  # the sinks move transformers' logits: matching them is not vacuous
    assert m["logits_max_abs"] <= LOGITS_ATOL
    assert m["packed_attention_equal"] is True
    assert m["attention_bias_max_abs"] <= LOGITS_ATOL
    # The row's GEMMs run over more rows than a datum's alone (blocked sums round differently): within an ulp-ish.
    assert m["packed_max_abs"] <= 1e-5


def test_lora_matches_the_torch_backend_and_exports_its_names(measured):
    m = measured
    assert m["adapter_effect"] > 1e-2  # the adapter moves the logprobs: the comparisons are not vacuous
    assert m["torch_lp_max_abs"] <= LOGPROB_ATOL
    assert m["torch_grad_rel"] <= GRAD_RTOL
    assert m["keys"]["a1"] == m["torch_keys"]
    assert any(".self_attn.o_proj." in k for k in m["torch_keys"])
    assert any(".mlp.experts." in k for k in m["torch_keys"])
    assert m["torch_shapes_equal"]
    assert m["torch_trained_max_abs"] <= 1e-4


def test_fused_tenants_equal_alone(measured):
    m = measured
    assert m["grad_norm_a"] > 0
    assert m["fused_lp_diff"] <= 1e-5
    assert m["fused_grad_rel"] <= 1e-5


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_two_ranks_equal_one_rank(measured, tmp_path, tp, ep):
    one = measured
    other = _launch(tmp_path, 2, tp, ep=ep)
    assert other["keys"] == one["keys"]
    for field in ("base_logprobs", "logprobs"):
        diff = (torch.tensor(one[field]) - torch.tensor(other[field])).abs()
        assert diff.max().item() <= RANKS_LOGPROB_ATOL, (field, diff.max().item())
    g1, g2 = torch.tensor(one["grads"]), torch.tensor(other["grads"])
    assert ((g1 - g2).norm() / g1.norm()).item() <= RANKS_GRAD_RTOL


@pytest.mark.parametrize("sinks,window,lengths", [(True, 4, (9, 1, 17, 4)), (True, 0, (9, 1, 17, 4)),
                                                   (False, 3, (9, 1, 17, 4)), (True, 128, (300, 129, 5))],
                         ids=["sinks+window", "sinks", "window", "gpt-oss-window"])
def test_fused_sink_attention_equals_the_eager_one(sinks, window, lengths):
    """The CUDA path (the sink as an extra key of a masked SDPA call, padded features and keys; a sliding-window
    layer in bands of the window's width, datums of one, several and a part of a block) against transformers'
    eager math, run here on CPU: outputs and q/k/v gradients, GQA 4/2."""
    from trainer_svc.backends.megatron.attention import sink_window_eager, sink_window_sdpa

    g = torch.Generator().manual_seed(0)
    bounds = tuple((sum(lengths[:i]), sum(lengths[: i + 1])) for i in range(len(lengths)))
    t, d = sum(lengths), 12
    q, k, v = (torch.randn(t, h, d, generator=g, requires_grad=True) for h in (4, 2, 2))
    sink = torch.randn(4, generator=g) * 2 if sinks else None
    grad = torch.randn(t, 4, d, generator=g)
    got = sink_window_sdpa(q, k, v, bounds, d ** -0.5, sink, window)
    g_got = torch.autograd.grad(got, (q, k, v), grad)
    want = sink_window_eager(q, k, v, bounds, d ** -0.5, sink, window)
    g_want = torch.autograd.grad(want, (q, k, v), grad)
    assert (got - want).abs().max().item() <= 1e-6
    for a, b in zip(g_got, g_want):
        assert (a - b).abs().max().item() <= 1e-5
    # The window and the sinks change the output: the comparison is not vacuous.
    plain = sink_window_eager(q, k, v, bounds, d ** -0.5, None, 0)
    assert (plain - want).abs().max().item() > 1e-2


if __name__ == "__main__":
    main()
