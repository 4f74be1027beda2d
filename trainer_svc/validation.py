"""Request validation: every check names the offending field and the limit. Runs before anything is queued, so a
bad request changes no params, moments or step (its seq_id is still consumed: the seq_id rule in trainer.proto)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplane.adapter_format import weights_dtype
from loraplane.errors import InvalidArgument
from loraplane.fields import validate_alias, validate_metadata, validate_name  # noqa: F401 - re-exported
from trainer_svc.backends.base import DatumInput
from trainer_svc.losses import LOSSES, resolve_loss

# The registry's per-publish limit (registry_svc.store.RegistryLimits.max_aliases_per_publish).
MAX_ALIASES = 16

def validate_adapter_name(name: str, field: str = "name") -> str:
    return validate_name(name, field)


def validate_weights_dtype(name: str, field: str = "lora_config.weights_dtype") -> str:
    """A LoraConfig.weights_dtype name ("" = float32), canonical."""
    weights_dtype(name, field)
    return name or "float32"


def validate_aliases(aliases: Sequence[str], field: str = "aliases") -> list[str]:
    if len(aliases) > MAX_ALIASES:
        raise InvalidArgument(f"{field} has {len(aliases)} entries, at most {MAX_ALIASES}", field=field)
    return [validate_alias(alias, f"{field}[{i}]") for i, alias in enumerate(aliases)]


def _floats(values: Sequence[float], field: str, n: int) -> torch.Tensor | None:
    if len(values) == 0:
        return None
    if len(values) != n:
        raise InvalidArgument(f"{field} has {len(values)} entries but input_tokens has {n}", field=field)
    array = np.asarray(values, dtype=np.float32)
    if not np.isfinite(array).all():
        index = int(np.flatnonzero(~np.isfinite(array))[0])
        raise InvalidArgument(f"{field}[{index}] is not finite ({array[index]})", field=field)
    return torch.from_numpy(array)


def _tokens(values: Sequence[int], field: str, vocab_size: int) -> torch.Tensor:
    array = np.asarray(values, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= vocab_size):
        bad = int(array[(array < 0) | (array >= vocab_size)][0])
        raise InvalidArgument(f"{field} contains token id {bad}, outside the vocabulary [0, {vocab_size})",
                              field=field)
    return torch.from_numpy(array)


@dataclass(frozen=True)
class DatumPayload:
    """A datum as the caller sent it, not yet checked: position-aligned sequences (the servicer hands over the
    wire's repeated fields as they are, without copying them into lists). `validate_data` turns it into a
    `DatumInput` of tensors or names the offending field."""

    input_tokens: Sequence[int]
    target_tokens: Sequence[int]
    weights: Sequence[float] = ()
    logprobs: Sequence[float] = ()
    advantages: Sequence[float] = ()
    sequence_ratio_mask: Sequence[float] = ()
    # K targets per position (0 = 1): target_tokens and weights then hold N * K values, row-major [N, K].
    targets_per_position: int = 0


def _sequence_mask(values: Sequence[float], loss: str, field: str, n: int) -> torch.Tensor | None:
    """gspo: nonzero marks the tokens of the sequence ratio. stable_reinforce: 0 outside the sampled tokens, k >= 1
    on the tokens of the datum's k-th sampled sequence."""
    mask = _floats(values, field, n)
    if mask is None or loss != "stable_reinforce":
        return mask
    bad = (mask < 0) | (mask != torch.round(mask)) | (mask > 2**24)
    if bool(bad.any()):
        index = int(torch.nonzero(bad)[0, 0])
        raise InvalidArgument(
            f"{field}[{index}] is {float(mask[index])}: stable_reinforce wants 0 (not a sampled token) or the "
            f"number k >= 1 of the sampled sequence the token belongs to", field=field)
    return mask


def _targets_per_position(k: int, loss: str, field: str, limit: int, backend: str) -> int:
    k = k or 1
    if k > 1 and loss != "cross_entropy":
        raise InvalidArgument(f"{field}: {k} targets per position (soft targets) are only read by cross_entropy, "
                              f"not {loss}", field=field)
    if k > limit:
        where = f"the {backend} backend" if backend else "this trainer"
        raise InvalidArgument(f"{field}: {k} targets per position, {where} takes at most {limit}", field=field)
    return k


def validate_data(data: Sequence[DatumPayload], loss_fn: str, loss_config: Mapping[str, float], *, vocab_size: int,
                  max_context_length: int, max_batch_datums: int, max_request_tokens: int,
                  max_targets_per_position: int = 64, backend: str = ""
                  ) -> tuple[list[DatumInput], str, dict[str, float]]:
    name, config = resolve_loss(loss_fn, dict(loss_config))
    if len(data) == 0:
        raise InvalidArgument("data is empty: send at least one datum", field="data")
    if len(data) > max_batch_datums:
        raise InvalidArgument(f"data has {len(data)} datums, more than the limit {max_batch_datums}", field="data")
    required = LOSSES[name].requires
    fast = _whole_batch(data, name, vocab_size=vocab_size, max_context_length=max_context_length,
                        max_request_tokens=max_request_tokens) if max_targets_per_position >= 1 else None
    if fast is not None:
        return fast, name, config
    out: list[DatumInput] = []
    total = 0
    for i, datum in enumerate(data):
        prefix = f"data[{i}]"
        n = len(datum.input_tokens)
        if n == 0:
            raise InvalidArgument(f"{prefix}.input_tokens is empty", field=f"{prefix}.input_tokens")
        if n > max_context_length:
            raise InvalidArgument(
                f"{prefix}.input_tokens has {n} tokens, over the context limit {max_context_length}",
                field=f"{prefix}.input_tokens")
        k = _targets_per_position(datum.targets_per_position, name, f"{prefix}.target_tokens",
                                  max_targets_per_position, backend)
        if len(datum.target_tokens) != n * k:
            per = "" if k == 1 else f" x {k} targets per position"
            raise InvalidArgument(
                f"{prefix}.target_tokens has {len(datum.target_tokens)} entries but input_tokens has {n}{per}",
                field=f"{prefix}.target_tokens")
        total += n
        if total > max_request_tokens:
            raise InvalidArgument(f"data holds more than {max_request_tokens} tokens in total", field="data")
        inputs = _tokens(datum.input_tokens, f"{prefix}.input_tokens", vocab_size)
        targets = _tokens(datum.target_tokens, f"{prefix}.target_tokens", vocab_size)
        if k == 1:
            weights = _floats(datum.weights, f"{prefix}.weights", n)
        else:
            if len(datum.weights) not in (0, n * k):
                raise InvalidArgument(f"{prefix}.weights has {len(datum.weights)} entries but target_tokens has "
                                      f"{n} x {k}", field=f"{prefix}.weights")
            weights = _floats(datum.weights, f"{prefix}.weights", n * k)
            targets = targets.view(n, k)
            weights = None if weights is None else weights.view(n, k)
        logprobs = _floats(datum.logprobs, f"{prefix}.logprobs", n)
        advantages = _floats(datum.advantages, f"{prefix}.advantages", n)
        if LOSSES[name].uses_sequence_mask:
            # These losses take no weights; DatumInput.weights carries the mask to them (see losses.py).
            weights = _sequence_mask(datum.sequence_ratio_mask, name, f"{prefix}.sequence_ratio_mask", n)
        elif len(datum.sequence_ratio_mask):
            raise InvalidArgument(f"{prefix}.sequence_ratio_mask is only read by gspo and stable_reinforce, not {name}",
                                  field=f"{prefix}.sequence_ratio_mask")
        for field_name, value in (("logprobs", logprobs), ("advantages", advantages)):
            if field_name in required and value is None:
                raise InvalidArgument(f"{prefix}.{field_name} is required by loss_fn {name} ({n} values)",
                                      field=f"{prefix}.{field_name}")
        out.append(DatumInput(inputs, targets, weights, logprobs, advantages))
    return out, name, config


def _flat(data: Sequence[DatumPayload], field: str, dtype, count: int) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(getattr(d, field) for d in data), dtype, count)


def _whole_batch(data: Sequence[DatumPayload], loss: str, *, vocab_size: int, max_context_length: int,
                 max_request_tokens: int) -> list[DatumInput] | None:
    """The common batch (one target per position, no sequence mask) checked and converted a field at a time over
    all datums instead of datum by datum: 512 math_rl datums took 11-50 ms on the event loop per datum, ~3 ms so.
    Each datum's tensors are slices of one array per field, holding exactly the values the per-datum path makes
    (tests/unit/test_validation_batch.py). None when anything is off, or the batch is of another kind: the
    per-datum path then converts it, or names the offending field exactly as it always has."""
    definition = LOSSES[loss]
    if definition.uses_sequence_mask:
        return None
    lengths = [len(d.input_tokens) for d in data]
    total = sum(lengths)
    if (min(lengths) == 0 or max(lengths) > max_context_length or total > max_request_tokens
            or any(d.targets_per_position > 1 or len(d.target_tokens) != n or len(d.sequence_ratio_mask)
                   for d, n in zip(data, lengths))):
        return None
    tokens = {}
    for field in ("input_tokens", "target_tokens"):
        array = _flat(data, field, np.int64, total)
        if array.min() < 0 or array.max() >= vocab_size:
            return None
        tokens[field] = torch.from_numpy(array).split(lengths)
    floats = {}
    for field in ("weights", "logprobs", "advantages"):
        sent = [len(getattr(d, field)) for d in data]
        if not any(sent):
            if field in definition.requires:
                return None
            floats[field] = [None] * len(data)
            continue
        if any(m not in (0, n) for m, n in zip(sent, lengths)) or (field in definition.requires and not all(sent)):
            return None
        array = _flat(data, field, np.float32, sum(sent))
        if not np.isfinite(array).all():
            return None
        pieces = iter(torch.from_numpy(array).split([m for m in sent if m]))
        floats[field] = [next(pieces) if m else None for m in sent]
    return [DatumInput(*values) for values in zip(tokens["input_tokens"], tokens["target_tokens"], floats["weights"],
                                                   floats["logprobs"], floats["advantages"])]


def validate_page(page_size: int, default: int = 100, maximum: int = 1000) -> int:
    if page_size < 0:
        raise InvalidArgument(f"page_size must be >= 0, got {page_size}", field="page_size")
    return min(page_size or default, maximum)


def finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{field} must be finite", field=field)
    return value
