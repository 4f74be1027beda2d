"""Pure-tensor layout of the megatron backend (no megatron-core needed): the fused qkv GQA interleave and gate|up
placement of per-projection PEFT LoRA outputs, tensor-parallel shards, and the HF → mcore weight mapping."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer_svc.backends.megatron.layout import (
    ALL_TARGETS,
    LlamaShape,
    chunk_for_rank,
    hf_to_mcore_state_dict,
    interleave_qkv,
    lora_shard,
    lora_unshard,
    mcore_to_hf_state_dict,
    place_gate_up_delta,
    place_qkv_delta,
    projection_delta,
    split_qkv,
)

SHAPE = LlamaShape(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8, ffn_hidden_size=40,
                   vocab_size=64)


def hf_state_dict(shape: LlamaShape, seed: int = 0, tied: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g)

    sd = {"model.embed_tokens.weight": r(shape.vocab_size, shape.hidden_size), "model.norm.weight": r(shape.hidden_size)}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if tied else r(shape.vocab_size, shape.hidden_size)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = r(shape.hidden_size)
        sd[p + "post_attention_layernorm.weight"] = r(shape.hidden_size)
        for t in ALL_TARGETS:
            owner = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            sd[f"{p}{owner}.{t}.weight"] = r(shape.out_features(t), shape.in_features(t))
    return sd


def test_qkv_interleave_groups_query_heads_with_their_kv_head():
    g, hpg, hd = SHAPE.num_kv_heads, SHAPE.heads_per_group, SHAPE.head_dim
    # Row labels: q head h -> 100+h, k head j -> 200+j, v head j -> 300+j (one value per row).
    q = torch.arange(100, 100 + g * hpg).repeat_interleave(hd).float().unsqueeze(1)
    k = torch.arange(200, 200 + g).repeat_interleave(hd).float().unsqueeze(1)
    v = torch.arange(300, 300 + g).repeat_interleave(hd).float().unsqueeze(1)
    fused = interleave_qkv(q, k, v, g, hd, dim=0)[:, 0]
    heads = fused.reshape(-1, hd)[:, 0].tolist()
    # Group j: its hpg query heads (HF repeat_kv assigns q heads j*hpg..(j+1)*hpg-1 to kv head j), then k_j, v_j.
    expected = []
    for j in range(g):
        expected += [100 + j * hpg + h for h in range(hpg)] + [200 + j, 300 + j]
    assert heads == expected
    q2, k2, v2 = split_qkv(interleave_qkv(q, k, v, g, hd), g, hpg, hd)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_lora_delta_equals_per_projection_peft(tp):
    """Per rank: the fused delta the hooks add == that rank's rows of [W_qkv + ΔW] x and [gate|up] computed the
    PEFT way (scale * B (A x) per projection), with the base weights fused by the same layout."""
    g = torch.Generator().manual_seed(1)
    r, scale = 4, 2.5
    x = torch.randn(5, 3, SHAPE.hidden_size, generator=g)  # [s, b, hidden], megatron's layout
    lora = {t: (torch.randn(r, SHAPE.in_features(t), generator=g), torch.randn(SHAPE.out_features(t), r, generator=g))
            for t in ALL_TARGETS}
    hf = hf_state_dict(SHAPE, seed=2)
    full_peft = {t: x @ hf[f"model.layers.0.{'self_attn' if t[0] in 'qkv' else 'mlp'}.{t}.weight"].t()
                 + projection_delta(x, *lora[t], scale) for t in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    for rank in range(tp):
        mc = hf_to_mcore_state_dict(hf, SHAPE, tp=tp, rank=rank)
        groups_local = SHAPE.num_kv_heads // tp
        base_qkv = x @ mc["decoder.layers.0.self_attention.linear_qkv.weight"].t()
        deltas = {t: projection_delta(x, *lora_shard(t, *lora[t], tp, rank), scale) for t in ("q_proj", "k_proj", "v_proj")}
        fused = base_qkv + place_qkv_delta(deltas["q_proj"], deltas["k_proj"], deltas["v_proj"], groups_local,
                                           SHAPE.heads_per_group, SHAPE.head_dim, base_qkv)
        q, k, v = split_qkv(fused, groups_local, SHAPE.heads_per_group, SHAPE.head_dim, dim=-1)
        torch.testing.assert_close(q, chunk_for_rank(full_peft["q_proj"], tp, rank, -1))
        torch.testing.assert_close(k, chunk_for_rank(full_peft["k_proj"], tp, rank, -1))
        torch.testing.assert_close(v, chunk_for_rank(full_peft["v_proj"], tp, rank, -1))

        base_fc1 = x @ mc["decoder.layers.0.mlp.linear_fc1.weight"].t()
        ffn_local = SHAPE.ffn_hidden_size // tp
        dg = projection_delta(x, *lora_shard("gate_proj", *lora["gate_proj"], tp, rank), scale)
        du = projection_delta(x, *lora_shard("up_proj", *lora["up_proj"], tp, rank), scale)
        fc1 = base_fc1 + place_gate_up_delta(dg, du, ffn_local, base_fc1)
        gate, up = torch.chunk(fc1, 2, dim=-1)  # megatron's MLP.glu: act(first half) * second half
        torch.testing.assert_close(gate, chunk_for_rank(full_peft["gate_proj"], tp, rank, -1))
        torch.testing.assert_close(up, chunk_for_rank(full_peft["up_proj"], tp, rank, -1))


@pytest.mark.parametrize("tp", [1, 2])
def test_row_parallel_lora_sums_to_peft(tp):
    """o_proj / down_proj: Σ_ranks (A_local x_local) then B equals PEFT's B (A x) on the full input."""
    g = torch.Generator().manual_seed(3)
    for t in ("o_proj", "down_proj"):
        a = torch.randn(4, SHAPE.in_features(t), generator=g)
        b = torch.randn(SHAPE.out_features(t), 4, generator=g)
        x = torch.randn(7, SHAPE.in_features(t), generator=g)
        mid = sum(chunk_for_rank(x, tp, rank, -1) @ lora_shard(t, a, b, tp, rank)[0].t() for rank in range(tp))
        torch.testing.assert_close(mid @ lora_shard(t, a, b, tp, 0)[1].t() * 2.0, projection_delta(x, a, b, 2.0))


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_shards_round_trip(tp):
    g = torch.Generator().manual_seed(4)
    for t in ALL_TARGETS:
        a = torch.randn(4, SHAPE.in_features(t), generator=g)
        b = torch.randn(SHAPE.out_features(t), 4, generator=g)
        a2, b2 = lora_unshard(t, [lora_shard(t, a, b, tp, r) for r in range(tp)])
        assert torch.equal(a2, a) and torch.equal(b2, b)


@pytest.mark.parametrize("tp,tied", [(1, True), (2, True), (2, False)])
def test_hf_mcore_weight_mapping_round_trip(tp, tied):
    hf = hf_state_dict(SHAPE, seed=5, tied=tied)
    ranks = [hf_to_mcore_state_dict(hf, SHAPE, tp=tp, rank=r) for r in range(tp)]
    assert ("output_layer.weight" in ranks[0]) == (not tied)
    assert ranks[0]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        (SHAPE.num_heads + 2 * SHAPE.num_kv_heads) * SHAPE.head_dim // tp, SHAPE.hidden_size)
    assert ranks[0]["decoder.layers.0.mlp.linear_fc2.weight"].shape == (SHAPE.hidden_size, SHAPE.ffn_hidden_size // tp)
    back = mcore_to_hf_state_dict(ranks, SHAPE, tied=tied)
    assert set(back) == set(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_tensor_parallel_limits_are_named():
    smollm2 = LlamaShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                         ffn_hidden_size=1536, vocab_size=49152)
    smollm2.check_tensor_parallel(1)
    smollm2.check_tensor_parallel(3)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        smollm2.check_tensor_parallel(2)


def test_flat_layout_puts_tensor_parallel_shards_first_with_local_shapes():
    from trainer_svc.backends.megatron.engine import flat_layout

    rank = 4
    one, two = flat_layout(SHAPE, rank, 1), flat_layout(SHAPE, rank, 2)
    per_layer = sum(rank * (SHAPE.in_features(t) + SHAPE.out_features(t)) for t in ALL_TARGETS)
    assert one.sharded_numel == 0 and one.numel == SHAPE.num_layers * per_layer
    assert {e.key for e in one.entries} == {e.key for e in two.entries} and len(one.entries) == 2 * 7 * SHAPE.num_layers
    flags = [c.sharded for c, _ in two.classes]
    assert flags == sorted(flags, reverse=True) and any(flags)  # sharded block first
    for e in two.entries:
        column = e.target not in ("o_proj", "down_proj")
        assert e.sharded == ((column and e.which == "B") or (not column and e.which == "A"))
        full = SHAPE.out_features(e.target) if e.which == "B" else SHAPE.in_features(e.target)
        # A is stored [r, in]; B transposed, [r, out]; the sharded feature dimension is split over the 2 ranks.
        assert e.shape == (rank, full // 2 if e.sharded else full)
    spans = sorted((e.offset, e.offset + e.numel) for e in two.entries)
    assert spans[0][0] == 0 and spans[-1][1] == two.numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # no gaps, no overlaps
    assert two.sharded_numel == sum(e.numel for e in two.entries if e.sharded)
    # The A's of projections that share an input sit side by side per layer (one matmul per hook).
    q, k, v = (next(e for e in one.entries if e.key.endswith(f"layers.1.self_attn.{t}.lora_A.weight"))
               for t in ("q_proj", "k_proj", "v_proj"))
    assert k.offset == q.offset + q.numel and v.offset == k.offset + k.numel


def _random_adapter(lora, rank: int, scale: float, seed: int):
    from trainer_svc.backends.megatron.lora import AdapterTensors

    g = torch.Generator().manual_seed(seed)
    params, grads = {}, {}
    for c in lora.classes:
        shape = (SHAPE.num_layers, len(c.targets), rank, c.dim)
        params[c.name] = torch.randn(*shape, generator=g, dtype=torch.float64)
        grads[c.name] = torch.zeros(*shape, dtype=torch.float64)
    return AdapterTensors(params, grads, rank, scale)


@pytest.mark.parametrize("hook", ["qkv", "o_proj", "fc1", "down_proj"])
def test_fused_hook_gives_each_row_its_own_adapter_and_exact_gradients(hook):
    """Two adapters of different ranks and an unrouted range in one batch: every row's delta, the input gradient
    and each adapter's A/B gradients equal those of plain PEFT autograd on that adapter's rows alone."""
    from trainer_svc.backends.megatron.lora import (
        HOOK_TARGETS,
        MegatronLora,
        RowSegment,
        _HookDelta,
        a_class_name,
        b_class_name,
    )

    lora = MegatronLora(None, SHAPE, torch.float64, tensor_parallel=(1, None))
    adapters = [_random_adapter(lora, 2, 0.5, 1), _random_adapter(lora, 3, 2.0, 2)]
    segments = [RowSegment(0, 8, adapters[0]), RowSegment(8, 12, None), RowSegment(12, 20, adapters[1])]
    layer, targets = 1, HOOK_TARGETS[hook]
    width = SHAPE.in_features(targets[0])
    g = torch.Generator().manual_seed(7)
    x = torch.randn(20, 1, width, generator=g, dtype=torch.float64, requires_grad=True)  # a packed row [T, 1, in]
    with lora.route(segments, 20) as routing:
        delta = _HookDelta.apply(x, routing.anchor, (routing, layer, hook))
    weight = torch.randn(delta.shape, generator=g, dtype=torch.float64)
    (delta * weight).sum().backward()
    routing.accumulate_grads()

    x_ref = x.detach().clone().requires_grad_(True)
    expected = torch.zeros_like(delta)
    leaves = []
    for seg in segments:
        if seg.adapter is None:
            continue
        ad = seg.adapter
        a = ad.params[a_class_name(hook)][layer].clone().requires_grad_(True)  # [G, r, in]
        bts = [ad.params[b_class_name(t)][layer, 0].clone().requires_grad_(True) for t in targets]  # B^T [r, out]
        rows = x_ref[seg.start : seg.end]
        deltas = [projection_delta(rows, a[i], bt.t(), ad.scale) for i, bt in enumerate(bts)]
        expected[seg.start : seg.end] = lora.place(hook, deltas)
        leaves.append((ad, a, bts))
    (expected * weight).sum().backward()

    torch.testing.assert_close(delta, expected.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)
    for ad, a, bts in leaves:
        torch.testing.assert_close(ad.grads[a_class_name(hook)][layer], a.grad)
        for t, bt in zip(targets, bts):
            torch.testing.assert_close(ad.grads[b_class_name(t)][layer, 0], bt.grad)
        # Nothing else of the adapter received a gradient.
        assert float(ad.grads[a_class_name(hook)][0].abs().sum()) == 0.0
        touched = {a_class_name(hook), *(b_class_name(t) for t in targets)}
        assert all(float(v.abs().sum()) == 0.0 for k, v in ad.grads.items() if k not in touched)


def test_one_adapter_over_the_whole_batch_uses_its_own_buffers_as_gradient_sinks():
    from trainer_svc.backends.megatron.lora import MegatronLora, RowSegment, _HookDelta, a_class_name

    lora = MegatronLora(None, SHAPE, torch.float64, tensor_parallel=(1, None))
    ad = _random_adapter(lora, 3, 1.5, 3)
    x = torch.randn(6, 1, SHAPE.hidden_size, dtype=torch.float64)
    with lora.route([RowSegment(0, 6, ad)], 6) as routing:
        delta = _HookDelta.apply(x, routing.anchor, (routing, 0, "qkv"))
    assert routing.scale == 1.5 and routing.grads[a_class_name("qkv")] is ad.grads[a_class_name("qkv")]
    delta.sum().backward()
    assert float(ad.grads[a_class_name("qkv")][0].abs().sum()) > 0
