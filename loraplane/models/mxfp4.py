"""MXFP4 checkpoints (gpt-oss's released experts), dequantized at load to the trainer's dtype.

The format (OCP Microscaling FP4, as gpt-oss ships it and tinker_cookbook's ``weights/_mxfp4.py`` documents it):

* a quantized weight ``W [*batch, out, in]`` is stored as ``<name>_blocks`` (uint8 ``[*batch, out, in/32, 16]``:
  each byte two FP4 E2M1 values, the low nibble first) and ``<name>_scales`` (uint8 ``[*batch, out, in/32]``: one
  E8M0 exponent per block of 32 values, ``scale = 2^(byte - 127)``);
* FP4 E2M1 nibble -> value: 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives;
* gpt-oss keeps ``[E, out, in]`` in the checkpoint and ``[E, in, out]`` in transformers' module (its experts are
  transposed), so a dequantized expert tensor is transposed once more before it is loaded.

Why our own: transformers' MXFP4 path wants the triton kernels (GPU) or quietly dequantizes inside from_pretrained;
we read the blocks and scales ourselves so a CPU trainer, a GPU trainer and the tests load the same values.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loraplane.errors import FailedPrecondition

BLOCK_SIZE = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS = "_blocks"
_SCALES = "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks`` uint8 [..., G, 16] and ``scales`` uint8 [..., G] -> [..., G * 32] in `dtype`. Every value is
    an FP4 value times a power of two, exact in fp32 (and in bf16 within its exponent range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).reshape(*blocks.shape[:-1], BLOCK_SIZE)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE).to(dtype)


def is_mxfp4_config(config) -> bool:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "mxfp4"


def dequantized_state_dict(directory: Path, dtype: torch.dtype, transpose: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `directory`, ``<name>_blocks`` + ``<name>_scales`` pairs replaced
    by ``<name>`` dequantized to `dtype` (``[E, in, out]`` when `transpose`, gpt-oss's module layout)."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FailedPrecondition(f"{directory} has no safetensors weights", field="base_model")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names = handle.keys()
            for key in names:
                raw[key] = handle.get_tensor(key)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        if key.endswith(_SCALES):
            if key[: -len(_SCALES)] + _BLOCKS not in raw:
                raise FailedPrecondition(f"MXFP4 checkpoint {directory}: {key} has no {_BLOCKS} tensor",
                                         field="base_model")
            continue
        if key.endswith(_BLOCKS):
            name = key[: -len(_BLOCKS)]
            scales = raw.get(name + _SCALES)
            if scales is None:
                raise FailedPrecondition(f"MXFP4 checkpoint {directory}: {key} has no {_SCALES} tensor",
                                         field="base_model")
            weight = dequantize(tensor, scales, dtype)
            state[name] = weight.transpose(-1, -2).contiguous() if transpose else weight
        else:
            state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def load_mxfp4_model(directory: Path, dtype: torch.dtype, attn_implementation: str):
    """The causal LM of an MXFP4 checkpoint with its quantized tensors dequantized to `dtype` (strict: every
    parameter of the model must be in the files)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    state = dequantized_state_dict(directory, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise FailedPrecondition(f"MXFP4 checkpoint {directory}: missing {missing[:8]}, unexpected "
                                 f"{unexpected[:8]}", field="base_model")
    if tied:
        model.tie_weights()
    return model


def quantization_method(directory: Path) -> str:
    """The checkpoint's quantization_config.quant_method from config.json ("" when none)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
