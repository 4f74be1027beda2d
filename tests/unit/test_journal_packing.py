"""The journal's packed form of a forward/forward_backward request and of its outcome (one flat tensor per field
instead of per-datum tensors) reads back exactly what the per-datum form did, and journals written in the per-datum
form still replay."""

from __future__ import annotations

import dataclasses
import random

import torch

from trainer_svc.backends.base import DatumInput, DatumResult, ItemResult
from trainer_svc.journal import (
    decode,
    encode,
    outcome_from_plain,
    outcome_to_plain,
    payload_from_plain,
    payload_to_plain,
)


def _random_datums(rng: random.Random, count: int) -> list[DatumInput]:
    """Datums as validate_data makes them: 1-D int64 tokens, (N, K) soft targets for some, float32 fields either
    absent or of the target's shape (weights) or of N values."""
    datums = []
    for _ in range(count):
        n = rng.randint(1, 40)
        k = rng.choice([1, 1, 1, 3])
        targets = torch.randint(0, 1000, (n,) if k == 1 else (n, k), dtype=torch.int64)
        maybe = lambda shape: torch.randn(shape, dtype=torch.float32) if rng.random() < 0.6 else None
        datums.append(DatumInput(torch.randint(0, 1000, (n,), dtype=torch.int64), targets, maybe(targets.shape),
                                 maybe((n,)), maybe((n,))))
    return datums


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _reference_plain(datums, loss_fn, config) -> dict:
    """The per-datum form the journal wrote before packing."""
    return {"datums": [{f.name: getattr(d, f.name) for f in dataclasses.fields(d)} for d in datums],
            "loss_fn": loss_fn, "loss_config": dict(config)}


def test_packed_request_reads_back_the_same_datums_as_the_per_datum_form():
    rng = random.Random(3)
    for trial in range(20):
        datums = _random_datums(rng, rng.randint(1, 60))
        config = {"beta": rng.random()}
        plain = payload_to_plain("forward_backward", (datums, "dro", config))
        assert "packed_datums" in plain
        packed = payload_from_plain("forward_backward", decode(encode(plain)))
        reference = payload_from_plain("forward_backward", decode(encode(_reference_plain(datums, "dro", config))))
        assert packed[1:] == reference[1:] == ("dro", config)
        assert len(packed[0]) == len(reference[0]) == len(datums)
        for got, want, sent in zip(packed[0], reference[0], datums):
            for field in ("input_tokens", "target_tokens", "weights", "logprobs", "advantages"):
                assert _same(getattr(got, field), getattr(want, field)), (trial, field)
                assert _same(getattr(got, field), getattr(sent, field)), (trial, field)


def test_a_journal_written_per_datum_still_replays():
    datums = _random_datums(random.Random(5), 7)
    old = decode(encode(_reference_plain(datums, "cross_entropy", {})))
    replayed, loss_fn, _config = payload_from_plain("forward", old)
    assert loss_fn == "cross_entropy"
    assert all(_same(a.target_tokens, b.target_tokens) and _same(a.weights, b.weights)
               for a, b in zip(replayed, datums))


def test_mixed_dtypes_keep_the_per_datum_form_rather_than_converting():
    datums = [DatumInput(torch.tensor([1, 2]), torch.tensor([2, 3]), logprobs=torch.tensor([0.5, 0.25])),
              DatumInput(torch.tensor([4]), torch.tensor([5]), logprobs=torch.tensor([0.1], dtype=torch.float64))]
    plain = payload_to_plain("forward_backward", (datums, "cross_entropy", {}))
    assert "datums" in plain and "packed_datums" not in plain
    back = payload_from_plain("forward_backward", decode(encode(plain)))[0]
    assert back[1].logprobs.dtype == torch.float64 and _same(back[1].logprobs, datums[1].logprobs)


def test_packed_outcome_reads_back_the_same_floats_as_the_per_datum_form():
    rng = random.Random(11)
    outputs = []
    for _ in range(50):
        n, k = rng.randint(1, 30), rng.choice([1, 1, 4])
        outputs.append(DatumResult([rng.uniform(-30, 0) for _ in range(n * k)], [rng.gauss(0, 3) for _ in range(n)],
                                   k))
    result = ItemResult(outputs, {"loss:sum": rng.random(), "num_tokens:sum": 99.0})
    back = outcome_from_plain(decode(encode(outcome_to_plain(result))))
    reference = outcome_from_plain(decode(encode({
        "outputs": [{"logprobs": torch.tensor(o.logprobs, dtype=torch.float64),
                     "elementwise_loss": torch.tensor(o.elementwise_loss, dtype=torch.float64),
                     "targets_per_position": o.targets_per_position} for o in outputs],
        "metrics": dict(result.metrics)})))
    assert back == reference == result
