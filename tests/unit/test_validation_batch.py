"""validate_data's whole-batch conversion (one array per field over all datums) gives exactly the tensors of the
per-datum conversion, and a batch it does not take (an error anywhere, soft targets, a sequence mask) still gets the
per-datum path's answer, the offending field named."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from loraplane.errors import InvalidArgument
from trainer_svc import validation
from trainer_svc.validation import DatumPayload, validate_data

LIMITS = {"vocab_size": 1000, "max_context_length": 64, "max_batch_datums": 1024, "max_request_tokens": 65536}


def _float(rng: random.Random) -> float:
    """Doubles of every kind the wire carries: not representable in float32, tiny (subnormal there), -0.0, huge."""
    return rng.choice([rng.gauss(0, 1), rng.uniform(-1e-40, 1e-40), -0.0, rng.uniform(-3e38, 3e38),
                       struct.unpack("f", struct.pack("I", rng.getrandbits(30)))[0] * rng.gauss(0, 1)])


def _payloads(rng: random.Random, count: int, with_weights: bool) -> list[DatumPayload]:
    data = []
    for _ in range(count):
        n = rng.randint(1, 40)
        weights = [_float(rng) for _ in range(n)] if with_weights and rng.random() < 0.5 else ()
        data.append(DatumPayload([rng.randrange(1000) for _ in range(n)], [rng.randrange(1000) for _ in range(n)],
                                 weights, [_float(rng) for _ in range(n)], [_float(rng) for _ in range(n)]))
    return data


def _per_datum(data, loss):
    """The reference: the per-datum path alone."""
    original = validation._whole_batch
    validation._whole_batch = lambda *args, **kwargs: None
    try:
        return validate_data(data, loss, {}, **LIMITS)[0]
    finally:
        validation._whole_batch = original


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.is_floating_point()
                                                                     else a, b.view(torch.uint8)
                                                                     if b.is_floating_point() else b)


@pytest.mark.parametrize("loss", ["importance_sampling", "cross_entropy", "ppo"])
def test_whole_batch_conversion_equals_the_per_datum_one_bit_for_bit(loss):
    rng = random.Random(loss)
    for _ in range(10):
        data = _payloads(rng, rng.randint(1, 80), with_weights=loss == "cross_entropy")
        assert validation._whole_batch(data, loss, vocab_size=1000, max_context_length=64,
                                       max_request_tokens=65536) is not None
        fast = validate_data(data, loss, {}, **LIMITS)[0]
        reference = _per_datum(data, loss)
        assert len(fast) == len(reference) == len(data)
        for got, want in zip(fast, reference):
            for field in ("input_tokens", "target_tokens", "weights", "logprobs", "advantages"):
                assert _same(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize("spoil, field", [
    (lambda d: d[3].logprobs.__setitem__(2, float("nan")), "data[3].logprobs"),
    (lambda d: d[5].input_tokens.__setitem__(0, 1000), "data[5].input_tokens"),
    (lambda d: d[4].target_tokens.__setitem__(1, -1), "data[4].target_tokens"),
    (lambda d: d[2].advantages.clear(), "data[2].advantages"),
    (lambda d: d[6].logprobs.pop(), "data[6].logprobs"),
    (lambda d: d[1].target_tokens.append(3), "data[1].target_tokens"),
    (lambda d: d[7].input_tokens.extend([1] * 64), "data[7].input_tokens"),
])
def test_a_bad_datum_is_named_as_the_per_datum_path_names_it(spoil, field):
    rng = random.Random(1)
    data = []
    for _ in range(9):
        n = rng.randint(3, 20)
        data.append(DatumPayload([rng.randrange(1000) for _ in range(n)], [rng.randrange(1000) for _ in range(n)],
                                 (), [-rng.random() for _ in range(n)], [rng.gauss(0, 1) for _ in range(n)]))
    spoil(data)
    with pytest.raises(InvalidArgument) as error:
        validate_data(data, "importance_sampling", {}, **LIMITS)
    assert error.value.field == field


def test_soft_targets_and_sequence_masks_take_the_per_datum_path():
    soft = [DatumPayload([1, 2], [3, 4, 5, 6], [0.5, 0.5, 1.0, 0.0], targets_per_position=2)]
    assert validation._whole_batch(soft, "cross_entropy", vocab_size=1000, max_context_length=64,
                                   max_request_tokens=65536) is None
    assert validate_data(soft, "cross_entropy", {}, **LIMITS)[0][0].target_tokens.shape == (2, 2)
    masked = [DatumPayload([1, 2], [3, 4], (), [-0.1, -0.2], [1.0, 1.0], sequence_ratio_mask=[1.0, 1.0])]
    assert validation._whole_batch(masked, "gspo", vocab_size=1000, max_context_length=64,
                                   max_request_tokens=65536) is None
    assert validate_data(masked, "gspo", {}, **LIMITS)[0][0].weights.tolist() == [1.0, 1.0]
