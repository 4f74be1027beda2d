"""Activation recomputation in the torch backend (trainer_svc.backends.torch_backend.LayerRecompute) is exact: a step
with every decoder layer recomputed gives every adapter the same gradients, bit for bit on CPU, as one without; also
when the backward runs on another thread than the forward (as autograd's device threads do on CUDA), which needs
the LoRA routing and the packed-row scope put back in force around the recomputation. And the plan: which layers
`auto` picks for a memory budget, what a layer keeps per token, and an adapter slot's bytes."""

from __future__ import annotations

import threading

import pytest
import torch

from loraplane.lora import AdapterTensors, LoraSpec, lora_segments
from loraplane.models import packed
from loraplane.models.packed import packed_implementation, packed_position_ids, packed_sequences
from tests.fixtures.family_checks import trained_like
from tests.fixtures.models import build_checkpoint
from trainer_svc.backends.base import BatchItem, DatumInput
from trainer_svc.backends.torch_backend import LayerRecompute, TorchBackend, choose_layers
from trainer_svc.pool import AdapterState


@pytest.fixture(scope="module", params=["qwen3_5_moe", "gpt_oss", "nemotron_h"])
def backend(request, tmp_path_factory):
    return TorchBackend(str(build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))),
                        recompute="none")


def states(backend, count):
    base = backend.base
    spec = LoraSpec.create(4, 8, [], seed=3, available=tuple(base.module_dims))
    out = []
    for i in range(count):
        params = {k: v.requires_grad_() for k, v in trained_like(base, spec, 20 + i).items()}
        out.append(AdapterState(name=f"t{i}", spec=spec, base_model=base.name, params=params,
                                exp_avg={k: torch.zeros_like(v) for k, v in params.items()},
                                exp_avg_sq={k: torch.zeros_like(v) for k, v in params.items()}))
    return out


def items(tenants):
    generator = torch.Generator().manual_seed(1)
    out = []
    for state, lengths in zip(tenants, ([7, 11], [9])):
        data = [DatumInput(torch.randint(5, 250, (n,), generator=generator),
                           torch.randint(5, 250, (n,), generator=generator)) for n in lengths]
        out.append(BatchItem(state, data, "cross_entropy", {}))
    return out


def grads_of(tenants):
    out = []
    for state in tenants:
        out.append({k: p.grad.clone() for k, p in state.params.items()})
        for p in state.params.values():
            p.grad = None
    return out


def test_a_recomputed_step_equals_one_without_bit_for_bit(backend):
    tenants = states(backend, 2)
    reruns = []
    probe = backend.base.model.model.layers[0]
    # A module inside the layer: its __call__ runs again when the layer is recomputed (the layer's own does not).
    # A pre-hook: the recomputation stops as soon as it has what the backward needs, maybe inside the module.
    inner = next(m for name, m in probe.named_children() if name in ("mlp", "mixer", "linear_attn", "self_attn"))
    handle = inner.register_forward_pre_hook(lambda *_: reruns.append(1))
    try:
        backend.recompute.mode = "none"
        plain = backend.run(items(tenants), backward=True)
        plain_grads = grads_of(tenants)
        calls_plain = len(reruns)
        backend.recompute.mode = "full"
        recomputed = backend.run(items(tenants), backward=True)
        recomputed_grads = grads_of(tenants)
        assert len(reruns) - calls_plain == 2 * calls_plain  # the layer ran again in the backward
    finally:
        handle.remove()
        backend.recompute.mode = "none"
    assert [r.metrics for r in plain] == [r.metrics for r in recomputed]
    for mine, theirs in zip(plain_grads, recomputed_grads):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    assert any(float(g.abs().max()) > 0 for g in plain_grads[0].values())


@pytest.mark.parametrize("impl", [packed.EXACT, packed.BATCHED])
def test_the_recomputation_on_another_thread_has_the_forwards_routing_and_packing(backend, impl):
    """The forward inside the step's scopes; the backward on a fresh thread after they exited (CUDA's autograd
    runs it on a device thread): with every layer recomputed, the same gradients as without recomputation."""
    model = backend.base.model
    tenants = states(backend, 2)
    lengths = [7, 11, 9]
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 250, (1, sum(lengths)), generator=generator)
    adapters = [AdapterTensors.from_params(s.params, s.spec) for s in tenants]
    segments = [(0, 7, adapters[0]), (7, 18, adapters[1]), (18, 27, adapters[0])]

    def run(mode):
        backend.recompute.mode = mode
        backend.recompute.plan(sum(lengths), True, torch.device("cpu"))
        with packed_implementation(impl), packed_sequences(lengths), lora_segments(model, segments):
            hidden = model.model(input_ids=ids, position_ids=packed_position_ids(lengths), use_cache=False)
            loss = model.lm_head(hidden.last_hidden_state[0]).logsumexp(-1).sum()
        errors = []

        def backward():
            try:
                loss.backward()
            except Exception as exc:  # noqa: BLE001 - re-raised on the test's thread
                errors.append(exc)

        worker = threading.Thread(target=backward)
        worker.start()
        worker.join()
        if errors:
            raise errors[0]
        return grads_of(tenants)

    try:
        plain, recomputed = run("none"), run("full")
    finally:
        backend.recompute.mode = "none"
    for mine, theirs in zip(plain, recomputed):
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key


def test_auto_recomputes_the_fewest_largest_layers_that_make_the_step_fit():
    layers = [10.0, 40.0, 10.0, 40.0]  # e.g. attention, linear attention, ...
    assert choose_layers(layers, 1.0, budget=200.0) == frozenset()  # 100 + 40 working set fits
    assert choose_layers(layers, 1.0, budget=120.0) == frozenset({1})  # 140 - 39 = 101
    assert choose_layers(layers, 1.0, budget=90.0) == frozenset({1, 3})  # 101 - 39 = 62
    assert choose_layers(layers, 1.0, budget=0.0) == frozenset(range(4))  # as small as it gets


def test_the_plan_measures_what_each_layer_keeps_and_stays_off_on_cpu_in_auto(backend):
    recompute = backend.recompute
    per_token = LayerRecompute.measure(recompute, torch.device("cpu"))
    assert len(per_token) == backend.base.num_layers
    # Every layer keeps at least its input (hidden_size fp32 values per token) for its backward.
    assert min(per_token) >= backend.base.hidden_size * 4
    recompute.mode = "auto"
    try:
        assert recompute.plan(4096, True, torch.device("cpu")) == frozenset()
        recompute.mode = "full"
        assert recompute.plan(4096, False, torch.device("cpu")) == frozenset()  # no backward, nothing to keep
        assert recompute.plan(4096, True, torch.device("cpu")) == frozenset(range(backend.base.num_layers))
    finally:
        recompute.mode = "none"
    with pytest.raises(Exception, match="recompute 'sometimes'"):
        LayerRecompute(backend.base.model, "sometimes")


def test_an_adapter_slot_is_what_its_training_state_measures(backend):
    base = backend.base
    spec = LoraSpec.create(8, 16, [], seed=1, available=tuple(base.module_dims))
    params = backend.init_params(spec)
    state = AdapterState(name="a", spec=spec, base_model=base.name, params=params,
                         exp_avg={k: torch.zeros_like(v) for k, v in params.items()},
                         exp_avg_sq={k: torch.zeros_like(v) for k, v in params.items()})
    assert backend.slot_bytes(spec) == state.device_bytes
    plan = backend.memory_plan(spec, tokens=64)
    assert plan["slot_gib"] * 2**30 == state.device_bytes and plan["base_gib"] > 0 and plan["logits_gib"] > 0


def test_an_adapter_that_cannot_fit_the_device_is_refused_at_creation_naming_the_numbers(backend, monkeypatch):
    from loraplane.errors import ResourceExhausted

    base = backend.base
    spec = LoraSpec.create(8, 16, [], seed=1, available=tuple(base.module_dims))
    slot = backend.slot_bytes(spec) / 2**30
    backend.check_slot_fits(spec)  # CPU: host memory is the operator's, no check
    monkeypatch.setattr(base, "device", torch.device("cuda"))  # the plan's numbers as a GPU would give them
    plan = {"base_gib": 10.0, "slot_gib": slot, "total_gib": 11.0 + slot, "reserve_gib": 0.5}
    monkeypatch.setattr(backend, "memory_plan", lambda spec, tokens=0: dict(plan))
    backend.check_slot_fits(spec)  # 0.5 GiB to spare
    plan["total_gib"] = 10.0 + slot  # 0.5 GiB short
    with pytest.raises(ResourceExhausted) as refused:
        backend.init_params(spec)
    message = str(refused.value)
    assert f"needs {slot:.1f} GiB" in message and "base model (10.0 GiB)" in message
    if any(t.startswith("experts.") or ".experts." in t for t in spec.target_modules):
        assert "expert_layout shared_outer needs" in message


def test_the_chunked_vocabulary_projection_gives_the_same_logprobs_and_gradients(backend, monkeypatch):
    """CUDA projects the vocabulary a chunk of tokens at a time, each chunk recomputed in the backward; forced here
    on CPU (chunks of 5 tokens, so the last is partial) against the one projection the CPU runs."""
    tenants = states(backend, 2)
    whole = backend.run(items(tenants), backward=True)
    whole_grads = grads_of(tenants)
    monkeypatch.setattr(backend, "logits_chunk_tokens", lambda tokens, device: 5)
    chunked = backend.run(items(tenants), backward=True)
    chunked_grads = grads_of(tenants)
    for a, b in zip(whole, chunked):
        for x, y in zip(a.outputs, b.outputs):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
            assert torch.allclose(torch.tensor(x.elementwise_loss), torch.tensor(y.elementwise_loss), atol=1e-5,
                                  rtol=0)
    for mine, theirs in zip(whole_grads, chunked_grads):
        for key in mine:
            scale = float(mine[key].abs().max())
            assert torch.allclose(mine[key], theirs[key], atol=1e-4 * scale, rtol=0), key
