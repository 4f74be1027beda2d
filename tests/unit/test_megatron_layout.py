"""Pure-tensor layout of the megatron backend (no megatron-core needed): the fused qkv GQA interleave and gate|up
placement of per-projection PEFT LoRA outputs, tensor-parallel shards, and the HF → mcore weight mapping."""

from __future__ import annotations

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
    from loraplane.lora import LoraSpec, peft_key
    from trainer_svc.backends.megatron.engine import flat_layout

    spec = LoraSpec.create(4, 8.0, ["q_proj", "o_proj", "up_proj"], seed=0)
    full = {}
    for layer in range(SHAPE.num_layers):
        for t in spec.target_modules:
            full[peft_key(layer, t, "A")] = (4, SHAPE.in_features(t))
            full[peft_key(layer, t, "B")] = (SHAPE.out_features(t), 4)
    one, two = flat_layout(spec, full, 1), flat_layout(spec, full, 2)
    assert one.sharded_numel == 0 and one.numel == sum(r * c for r, c in full.values())
    flags = [e.sharded for e in two.entries]
    assert flags == sorted(flags, reverse=True) and any(flags)  # sharded block first
    for e in two.entries:
        rows, cols = full[e.key]
        column = e.target in ("q_proj", "up_proj")
        assert e.sharded == ((column and e.which == "B") or (not column and e.which == "A"))
        assert e.shape == ((rows // 2, cols) if column and e.which == "B" else
                           (rows, cols // 2) if not column and e.which == "A" else (rows, cols))
    offsets = [e.offset for e in two.entries]
    assert offsets == sorted(offsets) and two.entries[-1].offset + two.entries[-1].numel == two.numel
    assert two.sharded_numel == sum(e.numel for e in two.entries if e.sharded)


def test_multi_adapter_mask_keeps_each_rows_own_rank_block():
    from trainer_svc.backends.megatron.lora import LocalAdapter, RowSegment, _Routing

    g = torch.Generator().manual_seed(6)
    adapters = [LocalAdapter({(0, "q_proj"): (torch.randn(r, 8, generator=g), torch.randn(12, r, generator=g))}, s)
                for r, s in ((2, 0.5), (3, 2.0))]
    segments = [RowSegment(0, 2, adapters[0]), RowSegment(2, 3, None), RowSegment(3, 5, adapters[1])]
    routing = _Routing(segments)
    members = [(seg, seg.adapter.modules[(0, "q_proj")]) for seg in routing.with_adapter]
    x = torch.randn(4, 5, 8, generator=g)  # [s, b, in]
    a_cat = torch.cat([a for _, (a, _) in members], 0)
    b_cat = torch.cat([b for _, (_, b) in members], 1)
    fused = ((x @ a_cat.t()) * routing.mask(members, 5, torch.float32, "cpu")) @ b_cat.t()
    for seg in segments:
        rows = x[:, seg.start : seg.end]
        if seg.adapter is None:
            expected = torch.zeros(4, seg.end - seg.start, 12)
        else:
            a, b = seg.adapter.modules[(0, "q_proj")]
            expected = projection_delta(rows, a, b, seg.adapter.scale)
        torch.testing.assert_close(fused[:, seg.start : seg.end], expected)
