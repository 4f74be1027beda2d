"""MXFP4 (gpt-oss's released expert weights) dequantized at load by our own reader: hand-computed values, agreement
with the cookbook's documented reference, and a small MXFP4 gpt-oss checkpoint of our own whose dequantized values
are known exactly loading into the trainer's model with exactly those values."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplane.models import load_base_model
from loraplane.models.mxfp4 import FP4_VALUES, dequantize
from tests.fixtures.models import build_checkpoint


def test_hand_computed_blocks():
    # Byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0); byte 0xF8: -0.0 then -6.0; byte 0x7E: -4.0, 6.0.
    blocks = torch.zeros((2, 16), dtype=torch.uint8)
    blocks[0, 0], blocks[0, 1], blocks[1, 15] = 0x21, 0xF8, 0x7E
    scales = torch.tensor([128, 125], dtype=torch.uint8)  # 2^1, 2^-2
    out = dequantize(blocks, scales, torch.float32)
    assert out.shape == (64,)
    assert out[:4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert out[62:].tolist() == [-1.0, 1.5]
    assert int(torch.count_nonzero(out)) == 5


def test_agrees_with_the_cookbooks_reference():
    cookbook = pytest.importorskip("tinker_cookbook.weights._mxfp4")
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 5, 2), generator=generator, dtype=torch.uint8)
    ours = dequantize(blocks, scales, torch.bfloat16)
    theirs = cookbook.dequantize_mxfp4(blocks, scales, (3, 5, 64))
    assert torch.equal(ours, theirs)


def _quantized(shape, generator):
    """(blocks, scales, exact values [*shape]) for a weight [..., out, in] of FP4 values times powers of two."""
    *lead, inner = shape
    groups = inner // 32
    nibbles = torch.randint(0, 16, (*lead, groups, 32), generator=generator)
    exponents = torch.randint(122, 130, (*lead, groups), generator=generator).to(torch.uint8)
    lut = torch.tensor(FP4_VALUES)
    values = lut[nibbles] * torch.pow(2.0, exponents.float() - 127.0).unsqueeze(-1)
    pairs = nibbles.reshape(*lead, groups, 16, 2).to(torch.uint8)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, exponents, values.reshape(shape)


def test_an_mxfp4_checkpoint_loads_with_its_exact_values(tmp_path):
    plain = build_checkpoint("gpt_oss", tmp_path / "plain")
    state = load_file(str(plain / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    expected = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        module_shape = state[key].shape  # [E, in, out] in transformers' module
        stored = (module_shape[0], module_shape[2], module_shape[1])  # [E, out, in] in the checkpoint
        blocks, scales, values = _quantized(stored, generator)
        del state[key]
        state[key + "_blocks"], state[key + "_scales"] = blocks, scales
        expected[key] = values.transpose(1, 2).contiguous()
    save_file(state, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    for item in plain.iterdir():
        if item.name != "model.safetensors":
            (quantized / item.name).write_bytes(item.read_bytes())
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))

    base = load_base_model(str(quantized))
    params = dict(base.model.named_parameters())
    for key, values in expected.items():
        assert params[key].dtype == torch.float32
        assert torch.equal(params[key], values), key
    # Everything else is the plain checkpoint's, bit for bit.
    plain_state = load_file(str(plain / "model.safetensors"))
    for key, tensor in plain_state.items():
        if key not in expected:
            assert torch.equal(params[key], tensor), key
    # And it computes: the same values written unquantized give the same logits.
    for key, values in expected.items():
        plain_state[key] = values
    save_file(plain_state, str(plain / "model.safetensors"), metadata={"format": "pt"})
    reference = load_base_model(str(plain))
    ids = torch.tensor([[5, 9, 33, 7, 81, 12, 40]])
    with torch.no_grad():
        assert torch.equal(base.model(input_ids=ids).logits, reference.model(input_ids=ids).logits)
    bf16 = load_base_model(str(quantized), dtype=torch.bfloat16)
    assert torch.equal(dict(bf16.model.named_parameters())[next(iter(expected))].float(), next(iter(expected.values())))
