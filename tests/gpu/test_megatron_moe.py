"""Qwen3-MoE in the megatron backend in bf16 on CUDA (the grouped expert GEMMs and the tenant x expert LoRA GEMMs
as torch._grouped_mm kernels), against fp32 references (tests/e2e/test_megatron_moe_cpu.py checks fp32 on CPU).

    python -m pytest tests/gpu/test_megatron_moe.py -m gpu -o addopts="" --noconftest -v

The bound, with the routing fixed. A bf16 rounding near a tie between a token's k-th and (k+1)-th expert flips that
token's choice, and a flipped token moves by as much as one expert's whole output: on the H100 (run moe4) one flip
gave megatron a max logprob error of 0.68 where transformers in bf16 made 0.03 (its own roundings flipped other
tokens, or none). Such a max says nothing about our kernels, and a bound wide enough for it would pass a wrong
expert too. So every comparison runs with the fp32 reference's routing: a hook records the top-k experts the fp32
model (transformers, or the torch backend's) chose at every MoE layer, and the bf16 sides (megatron through
``SlotRouter.force``, transformers / the torch backend through a hook on ``mlp.gate``) route each token to those
experts, with routing probabilities from their own bf16 logits. What remains is rounding alone, in the same
sequence of operations on the same operands (GEMMs accumulating in fp32, fp32 router softmax, norms), so our error
against fp32 is of the order of transformers' own in bf16 on the same routing: we allow twice theirs, plus 0.01 on
the mean and 0.05 on the max (about one bf16 ulp of a logprob of magnitude 8-16, for a yardstick that happens to be
small). A wrong expert, slot or LoRA segment moves the logprobs by the adapter's effect (asserted > 0.1, measured
0.7-1.9) and fails. The fraction of (token, layer) choices that bf16 flips left to itself is reported and must stay
small (<= 10%): far more would mean our router computes something else.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
megatron = pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.e2e.test_megatron_moe_cpu import SEQUENCE_LENGTHS, _hf_packed_logits, _ids, write_moe_checkpoint
from tests.gpu.test_megatron import datums, flat, logprobs_of, make_state, parallel, random_adapter  # noqa: F401

FLIP_FRACTION = 0.10


def within(measured: float, yardstick: float, slack: float) -> bool:
    return measured <= 2 * yardstick + slack


def errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float().cpu() - b.float().cpu()).abs()
    return d.mean().item(), d.max().item()


class HFRouting:
    """Records (``force`` None) or forces the top-k experts of every transformers MoE router (``mlp.gate``) of a
    model: one ``[rows, k]`` per call, per router in layer order."""

    def __init__(self, model):
        self.routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]
        assert self.routers, "no MoE router found"
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.force: list[list[torch.Tensor]] | None = None
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.routers)]

    def _hook(self, i: int):
        def run(module, inputs, output):
            logits, _scores, top = output
            if self.force is None:
                self.calls[i].append(top.detach().clone())
                return None
            top = self.force[i].pop(0).to(top.device)
            probs = torch.softmax(logits.float(), dim=-1).gather(1, top)
            if module.norm_topk_prob:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(logits.dtype), top

        return run

    def forcing(self, calls: list[list[torch.Tensor]]) -> HFRouting:
        self.force = [list(c) for c in calls]
        return self

    def consumed(self) -> bool:
        return self.force is not None and all(not f for f in self.force)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def megatron_routers(backend) -> list:
    return [layer.mlp.router for layer in backend.engine.model.decoder.layers if hasattr(layer.mlp, "router")]


def flipped(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The fraction of (token, layer) top-k sets that differ (rows of ``ref``; ours may have trailing padding)."""
    differ = total = 0
    for a, b in zip(ours, ref):
        a = a[: b.shape[0]].sort(dim=1).values.cpu()
        differ += int((a != b.sort(dim=1).values.cpu()).any(dim=1).sum())
        total += b.shape[0]
    return differ / max(1, total)


@pytest.mark.parametrize("name", ["moe_mixed", "moe_all"])
def test_moe_in_bf16_matches_fp32_references(name, tmp_path):
    from loraplane.lora import LoraSpec
    from loraplane.models import families, load_base_model
    from trainer_svc.backends.megatron.backend import MegatronBackend
    from trainer_svc.backends.megatron.model import forward_logits
    from trainer_svc.backends.torch_backend import TorchBackend

    directory = write_moe_checkpoint(name, tmp_path / name)
    backend = MegatronBackend(str(directory), dtype=torch.bfloat16, device_slots=4)
    routers = megatron_routers(backend)
    hf32 = load_base_model(str(directory), device="cuda", dtype=torch.float32)
    hf16 = load_base_model(str(directory), device="cuda", dtype=torch.bfloat16)
    ids = _ids(hf32.vocab_size, SEQUENCE_LENGTHS, seed=7).cuda()
    m: dict = {}

    # The fp32 reference's routing: one call per datum and router; megatron packs the datums into one call.
    rec32 = HFRouting(hf32.model)
    ref = _hf_packed_logits(hf32.model, ids, SEQUENCE_LENGTHS)
    ref_routes = [torch.cat(c) for c in rec32.calls]
    for r in routers:
        r.record = []
    with torch.no_grad():
        free = forward_logits(backend.engine.model, ids, list(SEQUENCE_LENGTHS))[0]
    m["logits_free_routing"] = errors(free, ref)
    m["flip_fraction"] = flipped([r.record[0] for r in routers], ref_routes)
    for r, route in zip(routers, ref_routes):
        r.record, r.force = None, [route]
    with torch.no_grad():
        ours = forward_logits(backend.engine.model, ids, list(SEQUENCE_LENGTHS))[0]
    assert all(not r.force for r in routers)
    m["logits"] = errors(ours, ref)
    hf16_routing = HFRouting(hf16.model).forcing(rec32.calls)
    m["hf_bf16_logits"] = errors(_hf_packed_logits(hf16.model, ids, SEQUENCE_LENGTHS), ref)
    assert hf16_routing.consumed()

    data = datums(hf32.vocab_size, SEQUENCE_LENGTHS, seed=11)
    available = families.lora_targets(hf32.model.config)
    torch32 = TorchBackend(str(directory), device="cuda", dtype=torch.float32)
    torch16 = TorchBackend(str(directory), device="cuda", dtype=torch.bfloat16)
    t32, t16 = HFRouting(torch32.base.model), HFRouting(torch16.base.model)
    for layout in ("per_expert", "shared_outer"):
        # Rank 16: every LoRA operand 16-byte aligned in bf16, so the grouped kernel runs the expert LoRA.
        spec = LoraSpec.create(16, 32.0, [], seed=3, expert_layout=layout, available=available)
        params = random_adapter(hf32, spec, seed=5)
        t32.force, t32.calls = None, [[] for _ in t32.routers]
        lp32, _ = logprobs_of(torch32, make_state(layout, spec, params, "cuda"), data, backward=True)
        calls = [list(c) for c in t32.calls]  # one packed call per router
        t16.forcing(calls)
        lp16, _ = logprobs_of(torch16, make_state(layout, spec, params, "cuda"), data, backward=True)
        assert t16.consumed()
        for r, c in zip(routers, calls):
            r.force = list(c)
        lp, _ = logprobs_of(backend, make_state(layout, spec, params, "cpu"), data, backward=True)
        assert all(not r.force for r in routers)
        m[layout] = errors(flat(lp), flat(lp32))
        m[f"{layout}_torch_bf16"] = errors(flat(lp16), flat(lp32))
        t32.force = None
        m[f"{layout}_effect"] = errors(flat(lp32), flat(logprobs_of(torch32, make_state(
            "zero", LoraSpec.create(16, 32.0, [], seed=3, expert_layout=layout, available=available),
            {k: torch.zeros_like(v) for k, v in params.items()}, "cuda"), data)[0]))[1]
    m["stats"] = dict(backend.engine.stats)
    print("measured", json.dumps({name: m}))
    # The expert LoRA ran on the grouped kernel (bf16, sm90, aligned rank 16), never the loop over segments.
    assert m["stats"]["expert_lora_grouped"] > 0 and m["stats"]["expert_lora_loop"] == 0
    assert m["flip_fraction"] <= FLIP_FRACTION
    assert within(m["logits"][0], m["hf_bf16_logits"][0], 0.01)
    assert within(m["logits"][1], m["hf_bf16_logits"][1], 0.05)
    for layout in ("per_expert", "shared_outer"):
        assert m[f"{layout}_effect"] > 0.1  # the adapter moves the logprobs: the comparison is not vacuous
        assert within(m[layout][0], m[f"{layout}_torch_bf16"][0], 0.01)
        assert within(m[layout][1], m[f"{layout}_torch_bf16"][1], 0.05)
