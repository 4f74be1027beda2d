"""LoRA math: deterministic PEFT-standard init, per-row multi-adapter routing (plain and batch-invariant row
windows), gradient isolation."""

from __future__ import annotations

import math

import pytest
import torch

from loraplane.errors import InvalidArgument
from loraplane.lora import (
    TARGET_MODULES,
    AdapterTensors,
    LoraSpec,
    attach_multi_lora,
    expected_shapes,
    init_lora_params,
    lora_delta,
    lora_routing,
    lora_row_windows,
    lora_segments,
    peft_key,
)
from loraplane.models import load_base_model
from loraplane.models.packed import enable_packed_attention, packed_position_ids, packed_sequences


@pytest.fixture(scope="module")
def tiny():
    base = load_base_model("tiny")
    attach_multi_lora(base.model)
    return base


def random_adapter(base, spec: LoraSpec, seed: int, requires_grad: bool = False) -> dict[str, torch.Tensor]:
    """Init params plus a non-zero B so the adapter changes the output."""
    params = init_lora_params(base, spec)
    generator = torch.Generator().manual_seed(seed)
    for key, tensor in params.items():
        if key.endswith("lora_B.weight"):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
        tensor.requires_grad_(requires_grad)
    return params


def test_spec_validation_names_the_field():
    assert LoraSpec.create(8, 0).effective_alpha == 8.0
    assert LoraSpec.create(8, 16).scale == 2.0
    assert LoraSpec.create(4, 0, ["v_proj", "q_proj"]).target_modules == ("q_proj", "v_proj")
    assert LoraSpec.create(4).target_modules == TARGET_MODULES
    for kwargs, field in [
        ({"rank": 0}, "lora_config.rank"),
        ({"rank": 999, "max_rank": 64}, "lora_config.rank"),
        ({"rank": 4, "alpha": float("nan")}, "lora_config.alpha"),
        ({"rank": 4, "alpha": -1.0}, "lora_config.alpha"),
        ({"rank": 4, "target_modules": ["lm_head"]}, "lora_config.target_modules"),
        ({"rank": 4, "target_modules": ["q_proj", "q_proj"]}, "lora_config.target_modules"),
        ({"rank": 4, "seed": -1}, "lora_config.seed"),
    ]:
        with pytest.raises(InvalidArgument) as info:
            LoraSpec.create(**kwargs)
        assert info.value.field == field


def test_init_is_peft_standard_and_deterministic(tiny):
    spec = LoraSpec.create(4, 8, seed=123)
    first = init_lora_params(tiny, spec)
    # Global RNG state must not matter.
    torch.manual_seed(999)
    torch.rand(10)
    second = init_lora_params(tiny, spec)
    assert list(first) == list(expected_shapes(tiny, spec))
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = init_lora_params(tiny, LoraSpec.create(4, 8, seed=124))
    key_a = peft_key(0, "q_proj", "A")
    assert key_a == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert not torch.equal(first[key_a], other[key_a])
    assert first[key_a].shape == (4, 64)
    assert first[peft_key(1, "down_proj", "B")].shape == (64, 4)
    # kaiming_uniform(a=sqrt(5)) on fan_in=in: bound = 1/sqrt(in)
    bound = 1.0 / math.sqrt(64)
    assert float(first[key_a].abs().max()) <= bound
    assert float(first[key_a].abs().max()) > 0.8 * bound
    assert all(float(t.abs().max()) == 0.0 for k, t in first.items() if k.endswith("lora_B.weight"))


def test_init_matches_a_pinned_fingerprint(tiny):
    # Pinned values: the same seed must give the same adapter on every machine and every release.
    params = init_lora_params(tiny, LoraSpec.create(2, 0, ["q_proj"], seed=7))
    a = params[peft_key(0, "q_proj", "A")]
    generator = torch.Generator().manual_seed(7)
    expected = torch.empty(2, 64)
    torch.nn.init.kaiming_uniform_(expected, a=math.sqrt(5), generator=generator)
    assert torch.equal(a, expected)


def test_tiny_model_is_seeded_and_gqa():
    first = load_base_model("tiny")
    torch.manual_seed(5)
    second = load_base_model("tiny")
    assert first.config.num_key_value_heads < first.config.num_attention_heads
    for (name, p), (_, q) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(p, q), name
        assert not p.requires_grad
    # A pinned fingerprint of the weights: identical on every machine.
    total = sum(float(p.double().sum()) for p in first.model.parameters())
    assert first.vocab_size == len(first.tokenizer) == 261
    assert abs(total - TINY_WEIGHT_SUM) < 1e-6, total


# Pinned from the first build; a change means the tiny model changed for everyone (sampler tests, benches).
TINY_WEIGHT_SUM = 268.54234505989666


def test_routing_equals_per_row_reference(tiny):
    spec_a = LoraSpec.create(4, 8, seed=1)
    spec_b = LoraSpec.create(2, 0, ["q_proj", "down_proj"], seed=2)
    a = AdapterTensors.from_params(random_adapter(tiny, spec_a, 11), spec_a)
    b = AdapterTensors.from_params(random_adapter(tiny, spec_b, 12), spec_b)
    tokens = torch.randint(0, tiny.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    rows = [a, None, b, a]
    with torch.no_grad(), lora_routing(tiny.model, rows):
        fused = tiny.model(tokens).logits
    for i, adapter in enumerate(rows):
        with torch.no_grad(), lora_routing(tiny.model, [adapter]):
            alone = tiny.model(tokens[i:i + 1]).logits
        assert torch.allclose(fused[i], alone[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        base = tiny.model(tokens).logits
    assert torch.allclose(fused[1], base[1], atol=1e-5, rtol=0)
    assert not torch.allclose(fused[0], base[0], atol=1e-3)
    # Outside any routing the hooks are inert.
    with torch.no_grad():
        assert torch.equal(tiny.model(tokens).logits, base)


def test_row_windows_give_a_row_the_same_bits_in_any_batch(tiny):
    # The sampler's decode routing: an adapter's rows are one contiguous slice of a padded batch.
    spec_a = LoraSpec.create(4, 8, seed=1)
    spec_b = LoraSpec.create(2, 0, ["q_proj", "down_proj"], seed=2)
    a = AdapterTensors.from_params(random_adapter(tiny, spec_a, 11), spec_a)
    b = AdapterTensors.from_params(random_adapter(tiny, spec_b, 12), spec_b)
    pool = torch.randint(0, tiny.vocab_size, (8,), generator=torch.Generator().manual_seed(4)).tolist()

    def run(tokens, slices):
        ids = torch.zeros((8, 1), dtype=torch.long)
        ids[: len(tokens), 0] = torch.tensor(tokens)
        with torch.no_grad(), lora_row_windows(tiny.model, slices, 8, 2):
            return tiny.model(ids).logits[:, 0]

    # Row "a on pool[1]" sits at row 1 among five routed rows, then at row 0 of a two-row batch.
    crowded = run([pool[0], pool[1], pool[2], pool[3], pool[4]], [(a, 1, 4), (b, 4, 5)])
    sparse = run([pool[1], pool[4]], [(a, 0, 1), (b, 1, 2)])
    assert torch.equal(crowded[1], sparse[0])
    assert torch.equal(crowded[4], sparse[1])
    for row, (token, adapter) in enumerate([(pool[0], None), (pool[1], a), (pool[2], a), (pool[4], b)]):
        index = row if row < 3 else 4
        with torch.no_grad(), lora_routing(tiny.model, [adapter]):
            alone = tiny.model(torch.tensor([[token]])).logits[0, 0]
        assert torch.allclose(crowded[index], alone, atol=1e-5, rtol=0)
    with torch.no_grad():
        base = tiny.model(torch.tensor([[pool[1]]])).logits[0, 0]
    assert not torch.allclose(crowded[1], base, atol=1e-3)
    with pytest.raises(InvalidArgument):
        lora_row_windows(tiny.model, [(a, 2, 4), (b, 1, 2)], 8, 2)
    with pytest.raises(InvalidArgument):
        lora_row_windows(tiny.model, [(a, 0, 9)], 8, 2)


def test_routing_matches_manual_lora_math(tiny):
    # One layer-0 q_proj delta checked against the pure reference on the hook's own input.
    spec = LoraSpec.create(4, 12, ["q_proj"], seed=3)
    params = random_adapter(tiny, spec, 13)
    adapter = AdapterTensors.from_params(params, spec)
    q_proj = tiny.layer_module(0, "q_proj")
    captured = {}
    handle = q_proj.register_forward_hook(lambda m, i, o: captured.setdefault("x", i[0]))
    tokens = torch.randint(0, tiny.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            tiny.model(tokens)
    finally:
        handle.remove()
    x = captured["x"]
    got = {}
    handle = q_proj.register_forward_hook(lambda m, i, o: got.setdefault("y", o))
    try:
        with torch.no_grad(), lora_routing(tiny.model, [adapter]):
            tiny.model(tokens)
    finally:
        handle.remove()
    a, b = params[peft_key(0, "q_proj", "A")], params[peft_key(0, "q_proj", "B")]
    expected = q_proj(x) + lora_delta(x, a, b, 3.0)
    assert torch.allclose(got["y"], expected, atol=1e-6)
    assert torch.allclose(lora_delta(x, a, b, 3.0), 3.0 * (x @ a.T @ b.T), atol=1e-6)


def test_gradients_flow_only_into_each_rows_adapter(tiny):
    spec = LoraSpec.create(4, 8, seed=1)
    pa = random_adapter(tiny, spec, 21, requires_grad=True)
    pb = random_adapter(tiny, spec, 22, requires_grad=True)
    a = AdapterTensors.from_params(pa, spec)
    b = AdapterTensors.from_params(pb, spec)
    tokens = torch.randint(0, tiny.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    with lora_routing(tiny.model, [a, b, None]):
        logits = tiny.model(tokens).logits
    # Loss only on row 0 (adapter a): b gets no gradient at all, a gets a non-zero one.
    logits[0].logsumexp(-1).sum().backward()
    assert all(t.grad is not None and float(t.grad.abs().sum()) > 0 for t in pa.values())
    assert all(t.grad is None or float(t.grad.abs().sum()) == 0 for t in pb.values())
    # The fused gradient of a equals the gradient with a alone on that row.
    fused_grads = {k: t.grad.clone() for k, t in pa.items()}
    for t in pa.values():
        t.grad = None
    with lora_routing(tiny.model, [a]):
        tiny.model(tokens[:1]).logits[0].logsumexp(-1).sum().backward()
    for key, grad in fused_grads.items():
        assert torch.allclose(grad, pa[key].grad, atol=1e-5, rtol=1e-4), key


def test_kv_cached_decoding_with_routing(tiny):
    spec = LoraSpec.create(4, 8, seed=5)
    a = AdapterTensors.from_params(random_adapter(tiny, spec, 31), spec)
    tokens = torch.randint(0, tiny.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    rows = [a, None]
    with torch.no_grad(), lora_routing(tiny.model, rows):
        full = tiny.model(tokens).logits
        prefix = tiny.model(tokens[:, :5], use_cache=True)
        cache = prefix.past_key_values
        steps = []
        for t in range(5, 8):
            out = tiny.model(tokens[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, 0])
    for i, t in enumerate(range(5, 8)):
        assert torch.allclose(steps[i], full[:, t], atol=1e-5)


def test_packed_segments_are_bit_identical_to_each_datum_alone():
    base = load_base_model("tiny")
    enable_packed_attention(base.model)
    attach_multi_lora(base.model)
    spec = LoraSpec.create(4, 8, seed=1)
    a = AdapterTensors.from_params(random_adapter(base, spec, 41), spec)
    b = AdapterTensors.from_params(random_adapter(base, spec, 42), spec)
    generator = torch.Generator().manual_seed(4)
    # Lengths >= 16 rows per call: tiny-M GEMMs are not row-invariant on CPU (see loraplane/models/packed.py).
    seqs = [torch.randint(0, base.vocab_size, (n,), generator=generator) for n in (20, 33, 17)]
    adapters = [a, b, None]
    lengths = [len(s) for s in seqs]
    segments, start = [], 0
    for n, adapter in zip(lengths, adapters):
        segments.append((start, start + n, adapter))
        start += n
    with torch.no_grad(), packed_sequences(lengths), lora_segments(base.model, segments):
        packed = base.model(torch.cat(seqs)[None], position_ids=packed_position_ids(lengths)).logits[0]
    for piece, seq, adapter in zip(packed.split(lengths), seqs, adapters):
        with torch.no_grad(), packed_sequences([len(seq)]), lora_segments(base.model, [(0, len(seq), adapter)]):
            alone = base.model(seq[None], position_ids=packed_position_ids([len(seq)])).logits[0]
        assert torch.equal(piece, alone)
    # And the packed path computes what plain HF computes for the unpadded sequence.
    with torch.no_grad(), lora_routing(base.model, [a]):
        plain = base.model(seqs[0][None]).logits[0]
    assert torch.allclose(packed[:20], plain, atol=1e-5)


def _packed_pass(base, seqs, adapters, params_of):
    """Logits and LoRA gradients of one packed forward/backward over `seqs` (loss: sum of logits x fixed weights)."""
    lengths = [len(s) for s in seqs]
    segments, start = [], 0
    for n, adapter in zip(lengths, adapters):
        segments.append((start, start + n, adapter))
        start += n
    for params in params_of:
        for tensor in params.values():
            tensor.grad = None
    with packed_sequences(lengths), lora_segments(base.model, segments):
        logits = base.model(torch.cat(seqs)[None], position_ids=packed_position_ids(lengths)).logits[0]
    weights = torch.linspace(-1, 1, logits.shape[-1])
    (logits * weights).sum().backward()
    return logits.detach(), [{k: None if v.grad is None else v.grad.clone() for k, v in params.items()}
                             for params in params_of]


def test_equal_length_runs_attend_as_one_batch_yet_match_each_datum_alone():
    """Three 20-token datums of two adapters packed side by side (one batched SDPA call per layer, several
    adapters' LoRA ranges in one projection) give each datum the logits and each adapter the gradients it gets
    when trained alone, bit for bit."""
    base = load_base_model("tiny")
    enable_packed_attention(base.model)
    attach_multi_lora(base.model)
    spec = LoraSpec.create(4, 8, seed=1)
    params_a = random_adapter(base, spec, 51, requires_grad=True)
    params_b = random_adapter(base, spec, 52, requires_grad=True)
    a = AdapterTensors.from_params(params_a, spec)
    b = AdapterTensors.from_params(params_b, spec)
    generator = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, base.vocab_size, (20,), generator=generator) for _ in range(3)]
    packed, (grads_a, grads_b) = _packed_pass(base, seqs, [a, a, b], [params_a, params_b])
    alone_ab, (alone_a, _) = _packed_pass(base, seqs[:2], [a, a], [params_a, params_b])
    alone_b, (_, alone_grads_b) = _packed_pass(base, seqs[2:], [b], [params_a, params_b])
    assert torch.equal(packed[:40], alone_ab) and torch.equal(packed[40:], alone_b)
    for key in params_a:
        assert torch.equal(grads_a[key], alone_a[key]), key
        assert torch.equal(grads_b[key], alone_grads_b[key]), key
    assert any(float(g.abs().sum()) > 0 for g in grads_b.values())
