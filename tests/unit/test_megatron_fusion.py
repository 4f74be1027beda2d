"""The megatron backend's compiled-chain switch and its RoPE: which parts compile where, and the rotation the packed
core attention applies equals megatron's own RoPE path bit for bit (the CPU runs the eager chain)."""

from __future__ import annotations

import pytest
import torch

from trainer_svc.backends.megatron import fusion

pytest.importorskip("megatron.core", reason="megatron-core is not installed")


@pytest.mark.parametrize(("value", "expected"), [
    (None, {"logprob", "swiglu", "rope"}),
    ("1", {"logprob", "swiglu", "rope"}),
    ("all", {"logprob", "swiglu", "rope"}),
    ("0", set()),
    ("none", set()),
    ("logprob", {"logprob"}),
    ("rope, swiglu", {"rope", "swiglu"}),
])
def test_parts_compile_on_cuda_as_the_variable_says(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("LORAPLANE_MEGATRON_COMPILE", raising=False)
    else:
        monkeypatch.setenv("LORAPLANE_MEGATRON_COMPILE", value)
    assert {p for p in fusion.PARTS if fusion.compiles(p, torch.device("cuda"))} == expected
    assert not any(fusion.compiles(p, torch.device("cpu")) for p in fusion.PARTS)


def test_an_unknown_part_is_refused_by_name():
    with pytest.raises(ValueError, match="'gelu'"):
        fusion.compiles("gelu", torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_megatrons_rope_path(dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(7)
    t, heads, d = 37, 4, 16
    x = torch.randn(t, 1, heads, d, generator=g).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32) % 11, inv_freq)  # positions restarting per datum
    angles = torch.cat((freqs, freqs), -1)[:, None, None, :]
    expected = _apply_rotary_pos_emb_bshd(x, angles)
    cos, sin = torch.cos(angles[:, 0]).to(dtype), torch.sin(angles[:, 0]).to(dtype)
    got = fusion.apply_rope(x[:, 0], cos, sin)
    assert torch.equal(got, expected[:, 0])
