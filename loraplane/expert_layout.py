"""How a PEFT weights file holds a shared-outer expert adapter, as one rule for every reader.

A shared-outer adapter shares one gate_up lora_A and one down lora_B among a layer's experts; its PEFT file repeats
each shared factor once per expert (`loraplane.lora.expert_shapes`: A [r E, in] with expert e's rows at
[e r, (e+1) r), B [out, r E] with expert e's column j at j E + e). Such a file is shared-outer only if every
expert's copy is the same, bit for bit. The sampler checks that when it folds a file back (`fold_copies`), the
registry while a publish streams in (`CopiesCheck`): one rule, so the registry never commits a version its samplers
refuse.

Both see a factor's values flat, in row-major order, as [outer, experts, inner]: gate_up A is [1, E, r in] (whole
copies one after another), down B [out r, E, 1] (each value repeated E times in a row).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplane.errors import InvalidArgument, clip
from loraplane.lora import SHARED_OUTER, LoraSpec, parse_peft_key

# (module, factor) of the factors a shared-outer adapter shares among a layer's experts.
SHARED_FACTORS = (("experts.gate_up_proj", "A"), ("experts.down_proj", "B"))

# Integer views of the float dtypes a factor may be stored in: copies are compared as bits (so -0.0 is not 0.0).
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float64: torch.int64}


@dataclass(frozen=True)
class SharedCopies:
    """A shared factor's tensor in a PEFT file, seen flat as [outer, experts, inner]."""

    key: str
    shape: tuple[int, int]
    factor: str  # "A" (gate_up) or "B" (down)
    outer: int
    experts: int
    inner: int

    @property
    def compact_shape(self) -> tuple[int, int]:
        """The one shared factor: gate_up A [r, in], down B [out, r]."""
        rows, cols = self.shape
        return (rows // self.experts, cols) if self.factor == "A" else (rows, cols // self.experts)

    def differs(self, field: str) -> InvalidArgument:
        return InvalidArgument(f"{field}: {clip(self.key)} differs between experts, so the adapter is not "
                               "shared-outer", field=field)


def shared_copies(key: str, shape: tuple[int, ...], spec: LoraSpec) -> SharedCopies | None:
    """How `key` (of `shape`, already checked against `spec` as PEFT's per-expert shape) repeats a shared factor,
    or None when it is not one (a per-expert adapter, a dense target, an expert's own factor)."""
    if spec.expert_layout != SHARED_OUTER or len(shape) != 2:
        return None
    _, module, which = parse_peft_key(key)
    rows, cols = shape
    if (module, which) == SHARED_FACTORS[0] and rows % spec.rank == 0:
        return SharedCopies(key, (rows, cols), "A", 1, rows // spec.rank, spec.rank * cols)
    if (module, which) == SHARED_FACTORS[1] and cols % spec.rank == 0:
        return SharedCopies(key, (rows, cols), "B", rows * spec.rank, cols // spec.rank, 1)
    return None


class CopiesCheck:
    """Checks a shared factor's values as they arrive (any number of whole elements at a time, flat order, as the
    integers of their bits), holding only one copy's worth of one group. `feed` raises `copies.differs(field)` at
    the first element that differs from expert 0's."""

    def __init__(self, copies: SharedCopies, field: str):
        self.copies = copies
        self.field = field
        self._position = 0
        self._first: np.ndarray | None = None

    def feed(self, values: np.ndarray) -> None:
        experts, inner = self.copies.experts, self.copies.inner
        group = experts * inner
        values = values.reshape(-1)
        i = 0
        while i < values.size:
            offset = self._position % group
            if offset == 0 and values.size - i >= group:
                # Whole groups at once (down B's groups are E values: no Python loop per value).
                count = (values.size - i) // group
                block = values[i:i + count * group].reshape(count, experts, inner)
                if not bool((block == block[:, :1, :]).all()):
                    raise self.copies.differs(self.field)
                i += count * group
                self._position += count * group
                continue
            expert, at = divmod(offset, inner)
            take = min(values.size - i, inner - at)
            segment = values[i:i + take]
            if expert == 0:
                if self._first is None or self._first.dtype != values.dtype:
                    self._first = np.empty(inner, dtype=values.dtype)
                self._first[at:at + take] = segment
            elif not np.array_equal(segment, self._first[at:at + take]):
                raise self.copies.differs(self.field)
            i += take
            self._position += take


def fold_copies(tensor: torch.Tensor, copies: SharedCopies, field: str = "blob") -> torch.Tensor:
    """The one shared factor of `tensor` (expert 0's copy), after checking every expert's copy is the same."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    bits = _BITS.get(flat.dtype)
    if bits is None:
        raise InvalidArgument(f"{field}: {clip(copies.key)} has dtype {flat.dtype}, not a float dtype", field=field)
    CopiesCheck(copies, field).feed(flat.view(bits).numpy())
    return tensor.reshape(copies.outer, copies.experts, copies.inner)[:, 0, :].reshape(copies.compact_shape)
