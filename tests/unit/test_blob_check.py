"""BlobCheck (the registry's streamed upload check) and the clipping of echoed values in statuses."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from loraplane import errors
from loraplane.adapter_format import (
    ADAPTER_CONFIG_KEY,
    TrainingState,
    _save,
    parse_adapter,
    peft_adapter_config,
    serialize_adapter,
    serialize_training_state,
)
from loraplane.lora import LoraSpec, peft_key
from loraplane.rpc import to_rpc_status
from registry_svc.blob_check import BlobCheck

SPEC = LoraSpec.create(2, 4.0, ["q_proj", "v_proj"], 1)


def params(width: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for module in SPEC.target_modules:
            out[peft_key(layer, module, "A")] = torch.randn(SPEC.rank, width, generator=generator)
            out[peft_key(layer, module, "B")] = torch.randn(width, SPEC.rank, generator=generator)
    return out


def check(blob: bytes, *, training_state: bool = False, chunk: int = 7) -> BlobCheck:
    checker = BlobCheck(len(blob), training_state=training_state)
    for start in range(0, len(blob), chunk):
        checker.feed(blob[start:start + chunk])
    checker.finish()
    return checker


def rejection(blob: bytes, **kwargs) -> str:
    with pytest.raises(errors.InvalidArgument) as caught:
        check(blob, **kwargs)
    assert caught.value.field == "chunk"
    return caught.value.message


@pytest.mark.parametrize("chunk", [1, 3, 8, 13, 4096, 1 << 20])
def test_a_real_adapter_passes_whatever_the_chunking(chunk):
    blob = serialize_adapter(params(), SPEC, "tiny")
    checker = check(blob, chunk=chunk)
    assert checker.spec == SPEC and checker.base_model == "tiny"
    parse_adapter(blob)  # the same bytes the full parser accepts


def test_a_real_training_state_passes_and_is_not_weights():
    p = params()
    moments = {k: torch.rand(v.shape) for k, v in p.items()}
    blob = serialize_training_state(TrainingState(p, moments, dict(moments), 3, SPEC, "tiny"))
    assert check(blob, training_state=True).spec == SPEC
    assert "not a PEFT safetensors LoRA adapter" in rejection(blob)
    assert "training state" in rejection(serialize_adapter(p, SPEC, "tiny"), training_state=True)


@pytest.mark.parametrize("dtype,bad", [
    (torch.float32, float("nan")), (torch.float32, float("inf")), (torch.float16, float("-inf")),
    (torch.bfloat16, float("nan")), (torch.float64, float("inf")),
])
def test_a_non_finite_value_of_any_float_width_is_found(dtype, bad):
    p = params()
    key = max(p)
    tensors = {k: v.to(dtype) for k, v in p.items()}
    tensors[key] = tensors[key].clone()
    tensors[key][-1, -1] = bad
    metadata = {ADAPTER_CONFIG_KEY: json.dumps(peft_adapter_config(SPEC, "tiny"))}
    from safetensors.torch import save

    blob = save(tensors, metadata)
    assert key in rejection(blob) and "non-finite" in rejection(blob)
    tensors[key][-1, -1] = 1.0
    check(save(tensors, metadata))  # and the same blob with a finite value passes


def test_inconsistent_or_malformed_blobs_are_rejected_with_the_reason():
    p = params()
    good = serialize_adapter(p, SPEC, "tiny")
    assert "header length" in rejection(b"x" * 4096)
    assert "header" in rejection(good[:20])
    assert "take" in rejection(good[:-4])
    wrong_rank = dict(p)
    wrong_rank[min(p)] = torch.ones(3, 16)
    metadata = {ADAPTER_CONFIG_KEY: json.dumps(peft_adapter_config(SPEC, "tiny"))}
    assert "rank" in rejection(_save(wrong_rank, metadata))
    missing = {k: v for k, v in p.items() if "layers.1." not in k or "lora_B" not in k}
    assert "lacks" in rejection(_save(missing, metadata))
    stranger = dict(p, **{"base_model.model.lm_head.weight": torch.ones(2, 2)})
    assert "not a PEFT LoRA key" in rejection(_save(stranger, metadata))
    assert "no adapter_config" in rejection(_save(p, {"format": "pt"}))
    assert "not JSON" in rejection(_save(p, {ADAPTER_CONFIG_KEY: "{nope"}))


def test_feed_records_only_the_first_failure_and_finish_raises_it():
    checker = BlobCheck(4096, training_state=False)
    checker.feed(b"\xff" * 8)
    first = checker.error
    assert first is not None
    checker.feed(b"more bytes that are never looked at")
    with pytest.raises(errors.InvalidArgument) as caught:
        checker.finish()
    assert caught.value is first


def test_clip_keeps_short_text_and_cuts_long_or_non_ascii_text():
    assert errors.clip("short ≥ text") == "short ≥ text"
    long = errors.clip("n" * 10_000)
    assert long.startswith("n" * 128) and long.endswith("...(10000 chars)") and len(long) < 160
    wide = errors.clip("é" * 1000)
    assert wide.isascii() and len(wide) < 160
    assert errors.shown("x" * 500).startswith("'xxx") and len(errors.shown("x" * 500)) < 160


def test_statuses_are_small_whatever_the_message_and_field():
    exc = errors.InvalidArgument("name " + "é" * 20_000, field="loss_fn_config." + "k" * 20_000)
    status = to_rpc_status(exc)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(status.details.encode()) < 1200
    trailer = dict(status.trailing_metadata)["grpc-status-details-bin"]
    assert len(trailer) < 2048
