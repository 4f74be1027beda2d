"""Qwen3-MoE checkpoints in the megatron backend (megatron-core's MoELayer on CPU: gloo, fp32), against transformers,
HF PEFT and the torch backend; expert parallelism (EP) with TP and DP, and replicas (DP without EP), under torchrun
against one rank.

Two tiny random checkpoints written with ``save_pretrained`` (GQA 4/2, q/k norms, head_dim 16):
  * ``moe_mixed``: layer 0 dense (``mlp_only_layers``), layer 1 routed: 8 experts, top-2, ``norm_topk_prob`` (the
    Qwen3-30B-A3B router: softmax over all experts, top-k, renormalized), untied head;
  * ``moe_all``: both layers routed (``decoder_sparse_step`` 1), 4 experts, top-2, no renormalization, tied head.
Checked in fp32: logits equal transformers' (≤ 2e-5, the bound of tests/e2e/test_megatron_families_cpu.py); one
attention-LoRA step through the backend gives the torch backend's logprobs and LoRA gradients and the exported
adapter in ``peft`` gives the backend's logprobs; the router and every expert weight stay frozen. Under torchrun
(2 ranks): EP=2 (the two data-parallel ranks hold 4 experts each, tokens exchanged all-to-all) and TP=2 x EP=2
give transformers' logits for different token counts per rank (uneven all-to-all splits) and the one-rank
logprobs and gradients for a batch fused over two adapters, including a batch with a single datum, where one rank
has no datum and still takes part in every exchange. Unsupported MoE and attention features are refused with
FAILED_PRECONDITION naming each one.

The megatron checks run in child processes (this file, run as a script, prints one JSON line per rank), as the
families test's do.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from tests.e2e.test_megatron_cpu import run, torchrun

LOGITS_ATOL = 2e-5
LOGPROB_ATOL = 2e-5
GRAD_RTOL = 1e-5
SEQUENCE_LENGTHS = (23, 14, 9)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

_COMMON = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "bos_token_id": 1, "eos_token_id": 4, "pad_token_id": 0}
CONFIGS = {
    "moe_mixed": {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [0],
                  "tie_word_embeddings": False},
    "moe_all": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1,
                "tie_word_embeddings": True},
}
EXPECTED = {
    "moe_mixed": {"moe_layers": [1], "num_experts": 8, "top_k": 2, "norm_topk_prob": True},
    "moe_all": {"moe_layers": [0, 1], "num_experts": 4, "top_k": 2, "norm_topk_prob": False},
}


def write_moe_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from loraplane.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    # Rounded up to a multiple of 8 so that TP=2 can split the vocabulary (the extra rows are never targets).
    config = Qwen3MoeConfig(**_COMMON, **CONFIGS[name], vocab_size=-(-len(tokenizer) // 8) * 8)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.4 * (torch.rand(param.shape, generator=generator) - 0.5))
            else:
                # O(1) activations; router logits O(1), so the top-k choice varies between tokens.
                scale = 0.3 if "embed_tokens" in pname else 1.0 / math.sqrt(param.shape[-1])
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _ids(vocab: int, lengths, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (sum(lengths),), generator=torch.Generator().manual_seed(seed))


def _hf_packed_logits(hf_model, ids: torch.Tensor, lengths) -> torch.Tensor:
    """transformers' logits of each datum alone, back to back."""
    out, start = [], 0
    with torch.no_grad():
        for n in lengths:
            out.append(hf_model(input_ids=ids[start : start + n][None]).logits[0].float())
            start += n
    return torch.cat(out)


def _max_abs(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def single_rank(name: str, root: Path) -> dict:
    """Everything the single-rank tests assert on, as numbers."""
    from peft import PeftModel

    from loraplane.adapter_format import materialize_peft_dir, serialize_adapter
    from loraplane.lora import LoraSpec
    from loraplane.models import families, load_base_model
    from tests.e2e.test_megatron_families_cpu import target_logprobs
    from tests.gpu.test_megatron import datums, flat, logprobs_of, make_state, random_adapter
    from trainer_svc.backends.base import BatchItem
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.model import forward_logits
    from trainer_svc.backends.torch_backend import TorchBackend
    from trainer_svc.optimizer import AdamHyper
    from trainer_svc.pool import AdapterState

    directory = write_moe_checkpoint(name, root / name)
    backend = MegatronBackend(str(directory), dtype=torch.float32, device_slots=4)
    engine = backend.engine
    reference = load_base_model(str(directory), device="cpu", dtype=torch.float32)
    shape = engine.spec.shape
    report: dict = {"spec": {"moe_layers": list(shape.moe_layers), "num_experts": shape.num_experts,
                             "top_k": engine.spec.moe_top_k, "norm_topk_prob": engine.spec.norm_topk_prob}}
    ids = _ids(reference.vocab_size, SEQUENCE_LENGTHS, seed=7)
    with torch.no_grad():
        logits = forward_logits(engine.model, ids, list(SEQUENCE_LENGTHS))[0].float()
    hf = _hf_packed_logits(reference.model, ids, SEQUENCE_LENGTHS)
    report["logits_max_abs"] = _max_abs(logits, hf)
    report["logits_scale"] = hf.abs().max().item()
    # The routing is not degenerate: the tokens' top-k choices cover every expert of every MoE layer.
    report["experts_used"] = _experts_used(reference.model, ids)

    spec = LoraSpec.create(4, 8.0, list(ATTENTION), seed=3)
    params = random_adapter(reference, spec, seed=5)
    data = datums(reference.vocab_size, SEQUENCE_LENGTHS, seed=11)
    state = make_state("a", spec, params, "cpu")
    megatron_lp, _ = logprobs_of(backend, state, data, backward=True)
    (megatron_grads,) = backend.driver.call("gather", {"name": "a", "rows": [1]})
    report["frozen"] = all(not p.requires_grad and p.grad is None for p in engine.model.parameters())
    torch_backend = TorchBackend(str(directory), device="cpu", dtype=torch.float32)
    torch_state = make_state("a", spec, params, "cpu")
    torch_lp, _ = logprobs_of(torch_backend, torch_state, data, backward=True)
    keys = list(params)
    torch_grads = flat(torch_state.params[k].grad for k in keys)
    report["exported_keys_equal"] = sorted(megatron_grads) == sorted(keys)
    report["torch_backend_lp_max_abs"] = _max_abs(flat(torch_lp), flat(megatron_lp))
    report["torch_backend_grad_rel"] = ((flat(megatron_grads[k] for k in keys) - torch_grads).norm()
                                        / torch_grads.norm()).item()
    backend.optim_step(state, AdamHyper(learning_rate=1e-2))
    trained = backend.export_params(state)
    trained_lp, _ = logprobs_of(backend, state, data)
    peft_dir = materialize_peft_dir(serialize_adapter(trained, spec, str(directory)), root / f"{name}-adapter")
    base_lp = target_logprobs(reference.model, data, "cpu")
    peft_lp = target_logprobs(PeftModel.from_pretrained(reference.model, str(peft_dir)).eval(), data, "cpu")
    report["peft_max_abs"] = _max_abs(flat(trained_lp), flat(peft_lp))
    report["adapter_effect_max_abs"] = _max_abs(flat(peft_lp), flat(base_lp))

    # LoRA on the routed experts too, in both layouts: the torch backend's logprobs and gradients, the export in
    # peft; then both fused in one batch with an attention-only adapter, each tenant as it is alone.
    available = families.lora_targets(reference.model.config)
    expert_specs = {layout: LoraSpec.create(4, 8.0, [], seed=3, expert_layout=layout, available=available)
                    for layout in ("per_expert", "shared_outer")}
    expert_specs["attention"] = LoraSpec.create(2, 4.0, list(ATTENTION), seed=4, available=available)
    alone = {}
    for i, (layout, xspec) in enumerate(expert_specs.items()):
        xparams = random_adapter(reference, xspec, seed=6 + i)
        xstate = make_state(layout, xspec, xparams, "cpu")
        lp, _ = logprobs_of(backend, xstate, data, backward=True)
        (grads,) = backend.driver.call("gather", {"name": layout, "rows": [1]})
        # For the fused batch at the end: the same parameters with fresh gradients.
        fresh = make_state(layout, xspec, xparams, "cpu")
        alone[layout] = (fresh, lp, grads)
        if layout == "attention":
            backend.load_training_state(fresh, {k: v.detach() for k, v in fresh.params.items()}, None, None, 0)
            continue
        tstate = make_state(layout, xspec, xparams, "cpu")
        tlp, _ = logprobs_of(torch_backend, tstate, data, backward=True)
        expert_keys = [k for k in xparams if "experts" in k]
        tg = flat(tstate.params[k].grad for k in xparams)
        report[f"{layout}_keys"] = sorted(grads) == sorted(xparams) and len(expert_keys) == 4 * len(
            engine.spec.shape.moe_layers)
        report[f"{layout}_lp_max_abs"] = _max_abs(flat(tlp), flat(lp))
        report[f"{layout}_grad_rel"] = ((flat(grads[k] for k in xparams) - tg).norm() / tg.norm()).item()
        report[f"{layout}_expert_grad_rel"] = max(
            ((grads[k] - tstate.params[k].grad).norm() / tstate.params[k].grad.norm()).item() for k in expert_keys)
        backend.optim_step(xstate, AdamHyper(learning_rate=1e-2))
        xtrained = backend.export_params(xstate)
        xlp, _ = logprobs_of(backend, xstate, data)
        xdir = materialize_peft_dir(serialize_adapter(xtrained, xspec, str(directory)), root / f"{name}-{layout}")
        # A fresh HF model: peft wraps the model it is given in place.
        fresh_hf = load_base_model(str(directory), device="cpu", dtype=torch.float32).model
        xpeft = target_logprobs(PeftModel.from_pretrained(fresh_hf, str(xdir)).eval(), data, "cpu")
        report[f"{layout}_peft_max_abs"] = _max_abs(flat(xlp), flat(xpeft))
        report[f"{layout}_expert_effect"] = _max_abs(flat(xlp), flat(base_lp))
        backend.load_training_state(fresh, {k: v.detach() for k, v in fresh.params.items()}, None, None, 0)
    items = [BatchItem(st, datums(reference.vocab_size, SEQUENCE_LENGTHS, seed=11), "cross_entropy", {})
             for st, _, _ in alone.values()]
    fused = backend.run(items, backward=True)
    report["fused_modes"] = dict(engine.stats)
    worst_lp = worst_grad = 0.0
    for (layout, (st, lp, grads)), result in zip(alone.items(), fused, strict=True):
        worst_lp = max(worst_lp, _max_abs(flat(torch.tensor(o.logprobs) for o in result.outputs), flat(lp)))
        (fgrads,) = backend.driver.call("gather", {"name": layout, "rows": [1]})
        want = flat(grads[k] for k in sorted(grads))
        worst_grad = max(worst_grad, ((flat(fgrads[k] for k in sorted(grads)) - want).norm() / want.norm()).item())
    report["fused_lp_max_abs"], report["fused_grad_rel"] = worst_lp, worst_grad

    # Two shared-outer tenants of different ranks fused: every expert adapter of the batch shares gate_up's A and
    # down's B, so those go on the token rows (BatchRouting.token_shared) rather than on each token's k expert rows;
    # each tenant still gets what it gets alone.
    shared = {f"so{r}": LoraSpec.create(r, 2.0 * r, [], seed=20 + r, expert_layout="shared_outer",
                                        available=available) for r in (4, 2)}
    alone_shared = {}
    for i, (n, sspec) in enumerate(shared.items()):
        sparams = random_adapter(reference, sspec, seed=30 + i)
        lp, _ = logprobs_of(backend, make_state(n, sspec, sparams, "cpu"), data, backward=True)
        (grads,) = backend.driver.call("gather", {"name": n, "rows": [1]})
        alone_shared[n] = (make_state(n, sspec, sparams, "cpu"), lp, grads)
    fused = backend.run([BatchItem(st, data, "cross_entropy", {}) for st, _, _ in alone_shared.values()],
                        backward=True)
    worst_lp = worst_grad = 0.0
    for (n, (st, lp, grads)), result in zip(alone_shared.items(), fused, strict=True):
        worst_lp = max(worst_lp, _max_abs(flat(torch.tensor(o.logprobs) for o in result.outputs), flat(lp)))
        (fgrads,) = backend.driver.call("gather", {"name": n, "rows": [1]})
        want = flat(grads[k] for k in sorted(grads))
        worst_grad = max(worst_grad, ((flat(fgrads[k] for k in sorted(grads)) - want).norm() / want.norm()).item())
    report["fused_shared_lp_max_abs"], report["fused_shared_grad_rel"] = worst_lp, worst_grad

    # A re-created adapter state that happens to reuse a dead one's id() is still a new adapter: installed afresh,
    # its gradients its own (keyed by id(), the backend skipped the install and added to the old slot's gradients,
    # which made the check above fail now and then, whenever CPython reused the address). Whether the allocator
    # hands the dead state's block to a new one is up to it: each attempt frees a trained state and allocates new
    # ones (their contents built beforehand) until one lands at its address.
    n, sspec = "reborn", shared["so4"]
    sparams = random_adapter(reference, sspec, seed=40)
    fields = {f: getattr(make_state(n, sspec, sparams, "cpu"), f)
              for f in ("name", "spec", "base_model", "params", "exp_avg", "exp_avg_sq")}
    report["reborn_reused_id"], report["reborn_grad_rel"] = False, None
    for _ in range(50):
        first = make_state(n, sspec, sparams, "cpu")
        logprobs_of(backend, first, data, backward=True)
        (want_grads,) = backend.driver.call("gather", {"name": n, "rows": [1]})
        dead = id(first)
        del first
        gc.collect()
        keep, reborn = [], AdapterState(**fields)
        while id(reborn) != dead and len(keep) < 1000:
            keep.append(reborn)
            reborn = AdapterState(**fields)
        del keep
        if id(reborn) == dead:
            logprobs_of(backend, reborn, data, backward=True)
            (got,) = backend.driver.call("gather", {"name": n, "rows": [1]})
            want = flat(want_grads[k] for k in sorted(want_grads))
            report["reborn_reused_id"] = True
            report["reborn_grad_rel"] = ((flat(got[k] for k in sorted(want_grads)) - want).norm() / want.norm()).item()
            break
        del reborn

    # Every layer recomputed in the backward (the router, dispatcher and expert LoRA run again inside it, with the
    # batch's tenant slots put back in force), or only every layer's attention half (selective): the same logprobs
    # and gradients.
    st, lp, grads = alone["per_expert"]
    want = flat(grads[k] for k in sorted(grads))
    for mode, key in (("full", "recompute"), ("selective", "selective")):
        recomputing = MegatronBackend(str(directory), dtype=torch.float32, device_slots=4, recompute=mode)
        rlp, _ = logprobs_of(recomputing, make_state("r", st.spec, {k: v.detach() for k, v in st.params.items()},
                                                     "cpu"), data, backward=True)
        (rgrads,) = recomputing.driver.call("gather", {"name": "r", "rows": [1]})
        report[f"{key}_layers"] = recomputing.engine.stats["recomputed_layers"]
        report[f"{key}_lp_max_abs"] = _max_abs(flat(rlp), flat(lp))
        report[f"{key}_grad_rel"] = ((flat(rgrads[k] for k in sorted(grads)) - want).norm() / want.norm()).item()
    return report


def _experts_used(hf_model, ids: torch.Tensor) -> list[int]:
    """Per MoE layer of the HF model, how many distinct experts the tokens' top-k choices reach."""
    used, hooks = [], []
    for layer in hf_model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda _m, _i, out: used.append(len(out[2].unique()))))
    with torch.no_grad():
        hf_model(input_ids=ids[None])
    for h in hooks:
        h.remove()
    return used


def multi_rank(name: str, root: Path, tp: int, ep: int, memory: int | None = None, tokens: int | None = None) -> dict:
    """One rank of a torchrun job: transformers' logits for this rank's own datums (a different token count on
    every data-parallel rank), then (rank 0 driving) fused two-adapter batches' logprobs and gradients. ``ep`` 0:
    the backend chooses replicas or EP itself (.parallel_plan), for GPUs of ``memory`` bytes and backward passes of
    ``tokens`` tokens."""
    import torch.distributed as dist

    from loraplane.lora import LoraSpec
    from loraplane.models import families, load_base_model
    from tests.gpu.test_megatron import datums, make_state, random_adapter
    from trainer_svc.backends.base import BatchItem
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.model import forward_logits, init_parallel

    if ep:
        init_parallel(tp, expert_parallel_size=ep)
    else:
        dist.init_process_group("gloo")  # the backend plans EP, then sets up megatron's parallel state
    rank = dist.get_rank()
    directory = root / name
    if rank == 0:
        write_moe_checkpoint(name, directory)
    dist.barrier()
    base = load_base_model(str(directory), device="cpu", dtype=torch.float32)
    backend = MegatronBackend(base, dtype=torch.float32, device_slots=2, tensor_parallel_size=tp,
                              expert_parallel_size=ep or None, device_memory_bytes=memory, plan_tokens_per_gpu=tokens)
    engine = backend.engine
    report: dict = {"rank": rank, "ep": engine.ep, "dp": engine.dp, "tp": engine.tp,
                    "local_experts": engine.model.decoder.layers[1].mlp.experts.weight1.shape[0]}
    # Different lengths per data-parallel rank: the all-to-all splits are uneven.
    lengths = SEQUENCE_LENGTHS[: 1 + engine.dp_rank % len(SEQUENCE_LENGTHS)]
    ids = _ids(base.vocab_size, lengths, seed=20 + engine.dp_rank)
    with torch.no_grad():
        logits = forward_logits(engine.model, ids, list(lengths))[0].float()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=engine.tp_group)
        logits = torch.cat(parts, -1)
    report["logits_max_abs"] = _max_abs(logits, _hf_packed_logits(base.model, ids, lengths))
    report["tokens"] = int(ids.numel())

    driver = backend.driver
    if rank != 0:
        driver.follow()
        return report
    # A per-expert adapter on every target and a shared-outer one of another rank on the experts only: per-expert
    # factors are summed over the ranks holding the same experts, shared ones over every rank.
    available = families.lora_targets(base.model.config)
    specs = {"a": LoraSpec.create(4, 8.0, [], seed=1, available=available),
             "b": LoraSpec.create(2, 4.0, ["q_proj", *families.EXPERT_TARGETS], 2, expert_layout="shared_outer",
                                  available=available)}
    states = {n: make_state(n, s, random_adapter(base, s, seed=5 + i), "cpu") for i, (n, s) in enumerate(specs.items())}
    results = []
    for batch in ((("a", (11, 7, 5)), ("b", (9, 6))), (("a", (13,)),)):  # the second: one datum, a rank idle
        items = [BatchItem(states[n], datums(base.vocab_size, ls, seed=len(ls)), "cross_entropy", {})
                 for n, ls in batch]
        out = backend.run(items, backward=True)
        results.append([o.logprobs for r in out for o in r.outputs])
    report["logprobs"] = results
    report["grads"] = {}
    for n in states:
        (g,) = driver.call("gather", {"name": n, "rows": [1]})
        report["grads"][n] = {k: v.flatten().tolist() for k, v in sorted(g.items())}
    # A step, then the training state out (gathered from every EP rank) and back in (each rank takes its experts):
    # the same params, moments and step.
    from trainer_svc.optimizer import AdamHyper

    backend.optim_step(states["b"], AdamHyper(learning_rate=1e-2))
    params, exp_avg, exp_avg_sq, step = backend.export_training_state(states["b"])
    backend.load_training_state(states["b"], {k: torch.zeros_like(v) for k, v in params.items()}, None, None, 0)
    backend.load_training_state(states["b"], params, exp_avg, exp_avg_sq, step)
    again = backend.export_training_state(states["b"])
    report["state_round_trip"] = step == again[3] == 1 and all(
        torch.equal(a[k], b[k]) for a, b in zip((params, exp_avg, exp_avg_sq), again[:3]) for k in a)
    backend.close()
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=0)
    ap.add_argument("--ep", type=int, default=0)
    ap.add_argument("--plan-memory", type=int, default=0, help="with --ep 0: the backend chooses EP for GPUs this big")
    ap.add_argument("--plan-tokens", type=int, default=0)
    ap.add_argument("--root")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        import tests.fixtures.megatron_cpu  # noqa: F401  (before the backend is used)
    if args.ep or args.plan_memory:
        report = multi_rank("moe_mixed", Path(args.root), args.tp, args.ep, args.plan_memory or None,
                            args.plan_tokens or None)
        Path(f"{args.out}.{report['rank']}.json").write_text(json.dumps(report))
        import torch.distributed as dist

        if dist.is_initialized():
            # A rank that exits while gloo's threads still run aborts ("terminate called without an active
            # exception"): it failed a finished EP run once under load (as in test_megatron_packing_cpu.py).
            dist.barrier()
            dist.destroy_process_group()
        return
    from trainer_svc.backends.megatron.model import init_parallel

    init_parallel(1)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            try:
                out[name] = single_rank(name, Path(tmp))
            except Exception:  # noqa: BLE001 - reported per config so one failure does not hide the other
                out[name] = {"failed": traceback.format_exc()}
        if args.root:  # the one-rank reference of the torchrun jobs
            out["reference"] = multi_rank("moe_mixed", Path(args.root), 1, 1)
    print(json.dumps(out))


# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe-ref")
    stdout = run([sys.executable, str(Path(__file__).resolve()), "--root", str(root)], timeout=280)
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_checkpoint_loads_with_the_logits_of_transformers(measured, name):
    m = measured[name]
    assert "failed" not in m, m.get("failed")
    print(json.dumps({name: m}))
    assert m["spec"] == EXPECTED[name]
    assert all(n == CONFIGS[name]["num_experts"] for n in m["experts_used"]), m["experts_used"]
    assert m["logits_scale"] > 1.0
    assert m["logits_max_abs"] <= LOGITS_ATOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_attention_lora_on_moe_matches_torch_backend_and_peft(measured, name):
    m = measured[name]
    assert "failed" not in m, m.get("failed")
    assert m["frozen"] is True  # router and experts (like every base weight) get no gradient
    assert m["exported_keys_equal"] is True
    assert m["torch_backend_lp_max_abs"] <= LOGPROB_ATOL
    assert m["torch_backend_grad_rel"] <= GRAD_RTOL
    assert m["adapter_effect_max_abs"] > 1e-2
    assert m["peft_max_abs"] <= LOGPROB_ATOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_expert_lora_matches_torch_backend_and_peft(measured, name, layout):
    """LoRA on the routed experts (and attention) in either layout: the torch backend's logprobs and gradients
    (every expert factor), the canonical blob's keys, and the exported adapter in peft gives the trained logprobs."""
    m = measured[name]
    assert "failed" not in m, m.get("failed")
    assert m[f"{layout}_keys"] is True
    assert m[f"{layout}_lp_max_abs"] <= LOGPROB_ATOL
    assert m[f"{layout}_grad_rel"] <= GRAD_RTOL
    assert m[f"{layout}_expert_grad_rel"] <= GRAD_RTOL
    assert m[f"{layout}_expert_effect"] > 1e-2
    assert m[f"{layout}_peft_max_abs"] <= LOGPROB_ATOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_expert_tenants_each_get_what_they_get_alone(measured, name):
    """A per-expert, a shared-outer (different rank) and an attention-only adapter in one batch: the expert rows
    of each tenant x expert run as their own segment of the grouped GEMMs, so each tenant's logprobs and
    gradients are those of its batch alone."""
    m = measured[name]
    assert "failed" not in m, m.get("failed")
    assert m["fused_lp_max_abs"] <= 1e-5
    assert m["fused_grad_rel"] <= 1e-5
    # Two shared-outer tenants of ranks 4 and 2 (their shared factors applied on the token rows).
    assert m["fused_shared_lp_max_abs"] <= 1e-5
    assert m["fused_shared_grad_rel"] <= 1e-5
    # A new state at a dead state's address (forced) is installed afresh: one backward's gradients, not two.
    assert m["reborn_reused_id"] is True
    assert m["reborn_grad_rel"] <= 1e-5


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recomputed_moe_layers_give_the_same_gradients(measured, name):
    m = measured[name]
    assert "failed" not in m, m.get("failed")
    for key in ("recompute", "selective"):  # whole layers; attention halves only
        assert m[f"{key}_layers"] == 2
        assert m[f"{key}_lp_max_abs"] <= 1e-6
        assert m[f"{key}_grad_rel"] <= 1e-6


def _planned_memory(ep: int) -> int:
    """A GPU size for which the trainer's own plan (.parallel_plan.trainer_plan, with the job's settings below) fits
    the tiny MoE model at expert parallelism ``ep`` (2) but not on one GPU; ``ep`` 1: ample memory."""
    if ep == 1:
        return 10**15
    from transformers import Qwen3MoeConfig

    from loraplane.models.tiny import build_tiny_tokenizer
    from trainer_svc.backends.megatron.parallel_plan import RESERVE_FRACTION, trainer_plan

    config = Qwen3MoeConfig(**_COMMON, **CONFIGS["moe_mixed"], vocab_size=-(-len(build_tiny_tokenizer()) // 8) * 8)

    def need(e):
        m = trainer_plan(config, 2, 1, dtype_bytes=4, device_memory_bytes=1, device_slots=2, expert_parallel=e,
                         tokens_per_gpu=PLAN_TOKENS).memory
        return m.total - m.reserve

    one, two = need(1), need(2)
    assert two < one, (one, two)  # the experts' and adapters' halves outweigh the all-to-all buffers at this size
    return int((one + two) / 2 / (1 - RESERVE_FRACTION))


PLAN_TOKENS = 16


@pytest.mark.parametrize(("nproc", "tp", "ep", "planned"),
                         [(2, 1, 2, True), (2, 1, 1, True), (2, 2, 2, False), (4, 2, 2, False)])
def test_expert_parallel_ranks_equal_one_rank(measured, tmp_path, nproc, tp, ep, planned):
    """EP=2 over the 2 data-parallel ranks (TP=1) and DP=2 over replicas (EP=1), each chosen by the trainer from the
    model and the GPU size it is told (.parallel_plan); TP=2 x EP=2 on the same 2 ranks and TP=2 x DP=2 x EP=2 on 4
    ranks (per-expert gradients summed over the 2 ranks holding the same experts) set by hand: each rank's logits
    are transformers', and the fused batches give the one-rank logprobs and gradients."""
    one = measured["reference"]
    out = tmp_path / "ep"
    how = ["--plan-memory", str(_planned_memory(ep)), "--plan-tokens", str(PLAN_TOKENS)] if planned else [
        "--ep", str(ep)]
    run(torchrun(nproc, str(Path(__file__).resolve()), "--tp", str(tp), *how, "--root", str(tmp_path),
                 "--out", str(out)), timeout=280)
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(nproc)]
    for r in ranks:
        assert (r["ep"], r["tp"], r["dp"], r["local_experts"]) == (ep, tp, nproc // tp, 8 // ep), r
        assert r["logits_max_abs"] <= LOGITS_ATOL, r
    if nproc // tp > 1:
        assert ranks[0]["tokens"] != ranks[-1]["tokens"]  # uneven all-to-all splits / different work per replica
    lead = ranks[0]
    assert lead["state_round_trip"] is True
    for got, want in zip(lead["logprobs"], one["logprobs"], strict=True):
        worst = max(abs(a - b) for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
        assert worst <= LOGPROB_ATOL, worst
    for n, grads in one["grads"].items():
        want = torch.tensor([v for k in sorted(grads) for v in grads[k]])
        got = torch.tensor([v for k in sorted(lead["grads"][n]) for v in lead["grads"][n][k]])
        assert want.norm() > 0
        assert ((got - want).norm() / want.norm()).item() <= GRAD_RTOL, n


# Architecture fields of the published config.json of Qwen3-30B-A3B (weights not needed: the spec is the config's).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 40960, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48, "router_aux_loss_coef": 0.001,
}


def test_qwen3_30b_a3b_config_maps_to_the_megatron_moe_model():
    from transformers import AutoConfig

    from trainer_svc.backends.megatron.model import spec_from_hf_config

    fields = dict(QWEN3_30B_A3B)
    spec = spec_from_hf_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    s = spec.shape
    assert (s.num_experts, s.moe_ffn_hidden_size, s.moe_layers) == (128, 768, tuple(range(48)))
    assert (spec.moe_top_k, spec.norm_topk_prob, spec.qk_layernorm, s.head_dim) == (8, True, True, 128)
    s.check_expert_parallel(4)
    with pytest.raises(ValueError, match="expert_parallel_size=3"):
        s.check_expert_parallel(3)


def _refused_configs():
    from transformers import (
        DeepseekV3Config,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 128}
    return {
        # case: (config, phrases the message must contain)
        "mixtral": (MixtralConfig(**small, num_local_experts=4, sliding_window=None),
                    ["model_type 'mixtral'"]),
        "qwen2_moe_shared_experts": (Qwen2MoeConfig(**small, num_experts=4, shared_expert_intermediate_size=32),
                                     ["model_type 'qwen2_moe'", "shared experts"]),
        "deepseek_v3": (DeepseekV3Config(**small, n_routed_experts=4, n_shared_experts=1, kv_lora_rank=16,
                                         q_lora_rank=16, n_group=2, topk_group=1, first_k_dense_replace=0),
                        ["shared experts", "multi-head latent attention (MLA)", "a router other than softmax top-k"]),
        "qwen3_next": (Qwen3NextConfig(**small, num_experts=4), ["linear-attention layers", "shared experts"]),
        "qwen3_moe_sliding": (Qwen3MoeConfig(**small, num_experts=4, use_sliding_window=True, sliding_window=8),
                              ["sliding-window attention"]),
    }


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe_shared_experts", "deepseek_v3", "qwen3_next",
                                  "qwen3_moe_sliding"])
def test_unsupported_moe_and_attention_features_are_named(case):
    """Every feature the megatron backend does not implement is named in the FAILED_PRECONDITION (the trainer maps
    loraplane.errors.FailedPrecondition to it: tests/e2e/test_megatron_families_cpu.py checks the status)."""
    from loraplane.errors import FailedPrecondition
    from trainer_svc.backends.megatron.model import spec_from_hf_config

    config, phrases = _refused_configs()[case]
    with pytest.raises(FailedPrecondition) as refused:
        spec_from_hf_config(config)
    assert refused.value.field == "base_model"
    for phrase in phrases:
        assert phrase in str(refused.value), (phrase, str(refused.value))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
