"""The registry's check of an uploaded blob while it streams, before a version is committed."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from loraplane.adapter_format import (
    ADAPTER_CONFIG_KEY,
    COMPACT_FORMAT,
    EXP_AVG,
    EXP_AVG_SQ,
    TRAINING_STATE_KEY,
    blob_format,
    check_shapes,
    spec_from_peft_config,
)
from loraplane.errors import InvalidArgument, LoraplaneError, clip
from loraplane.expert_layout import SHARED_FACTORS, CopiesCheck, shared_copies
from loraplane.lora import PER_EXPERT, LoraSpec, parse_peft_key

# The largest safetensors header accepted (the safetensors library's own limit).
MAX_HEADER_BYTES = 100 * 1024 * 1024
# dtype -> (item size, unsigned view, exponent mask): a value is NaN or infinite exactly when all its exponent bits
# are set, so one integer AND per element checks finiteness of any float width without decoding it.
_FLOAT_LAYOUT = {
    "F64": (8, np.uint64, 0x7FF0000000000000),
    "F32": (4, np.uint32, 0x7F800000),
    "F16": (2, np.uint16, 0x7C00),
    "BF16": (2, np.uint16, 0x7F80),
}


@dataclass
class _Extent:
    key: str
    begin: int
    end: int
    itemsize: int
    view: type
    mask: int
    # A shared-outer adapter's shared factor: every expert's copy must be the same.
    copies: CopiesCheck | None = None


class BlobCheck:
    """Checks an uploaded blob while it streams, before the registry commits it: a weights blob must be a PEFT
    safetensors LoRA adapter (header, adapter_config, tensor names and shapes consistent with it and with its format
    version, `loraplane.adapter_format`: a compact shared-outer adapter's shared factors of one expert's shape;
    finite values; and in a format-"1" shared-outer adapter every expert's copy of a shared factor the same: the
    rule the samplers load by, `loraplane.expert_layout`), a training-state blob what `parse_training_state` accepts. Memory stays at one
    chunk plus the header (and one expert's copy of a shared factor).

    Every failure is InvalidArgument naming `field` (the upload's bytes), since the caller sent them. `feed` only
    records the first failure (and stops looking); `finish` raises it. So an uploader can let the transport's own
    checks (length, digest) speak first: a truncated stream is reported as truncated, not as a malformed adapter."""

    def __init__(self, size: int, *, training_state: bool, field: str = "chunk"):
        self.size = size
        self.training_state = training_state
        self.field = field
        self.spec: LoraSpec | None = None
        self.base_model = ""
        self.format = ""  # a weights blob's format version ("1" or "2"), once its header is read
        self._head = bytearray()
        self._data_start: int | None = None
        self._extents: list[_Extent] = []
        self._received = 0
        self._index = 0
        self._carry = b""
        self.error: InvalidArgument | None = None

    def feed(self, chunk: bytes) -> None:
        if self.error is None:
            try:
                self._feed(chunk)
            except InvalidArgument as exc:
                self.error = exc

    @property
    def received(self) -> int:
        return self._received

    def shared_factor_key(self) -> str:
        """The first tensor (in file order) that a shared-outer adapter shares among experts (gate_up lora_A, down
        lora_B), "" when the header has none: what a layout mismatch is reported by."""
        for extent in self._extents:
            try:
                _, module, which = parse_peft_key(extent.key)
            except InvalidArgument:
                continue
            if (module, which) in SHARED_FACTORS:
                return extent.key
        return ""

    def _fail(self, message: str) -> InvalidArgument:
        kind = "training-state" if self.training_state else "weights"
        return InvalidArgument(f"{self.field}: the {kind} blob is not {self._what()}: {clip(message, 512)}",
                               field=self.field)

    def _what(self) -> str:
        return "a loraplane training state" if self.training_state else "a PEFT safetensors LoRA adapter"

    def _feed(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        if self._data_start is None:
            need = 8 if len(self._head) < 8 else 8 + self._header_len()
            take = min(len(view), need - len(self._head))
            self._head += view[:take]
            self._received += take
            view = view[take:]
            if len(self._head) == 8:
                self._header_len()
                if view:
                    return self._feed(bytes(view))
                return None
            if len(self._head) == need and need > 8:
                self._parse_header(bytes(self._head[8:]))
                self._data_start = need
                self._head = bytearray()
            if not view:
                return None
        self._scan(view)
        return None

    def _header_len(self) -> int:
        length = int.from_bytes(bytes(self._head[:8]), "little")
        if length < 2 or length > MAX_HEADER_BYTES or 8 + length > self.size:
            raise self._fail(f"safetensors header length {length} does not fit a {self.size}-byte blob")
        return length

    def _parse_header(self, raw: bytes) -> None:
        try:
            header = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self._fail(f"the safetensors header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._fail("the safetensors header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._fail("safetensors __metadata__ is not a string map")
        shapes: dict[str, tuple[int, ...]] = {}
        for key, entry in header.items():
            self._extents.append(self._extent(key, entry))
            shapes[key] = tuple(entry["shape"])
        self._extents.sort(key=lambda e: e.begin)
        position = 0
        for extent in self._extents:
            if extent.begin != position:
                raise self._fail(f"tensor {clip(extent.key)} starts at byte {extent.begin}, expected {position}")
            position = extent.end
        if 8 + len(raw) + position != self.size:
            raise self._fail(f"header and tensors take {8 + len(raw) + position} bytes, the blob has {self.size}")
        try:
            if self.training_state:
                self._check_training_state(metadata, shapes)
            else:
                self._check_weights(metadata, shapes)
        except LoraplaneError as exc:
            raise self._fail(exc.message) from None

    def _extent(self, key: str, entry: object) -> _Extent:
        if not isinstance(entry, dict) or entry.get("dtype") not in _FLOAT_LAYOUT:
            raise self._fail(f"tensor {clip(key)} is not a float tensor of dtype {sorted(_FLOAT_LAYOUT)}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets)):
            raise self._fail(f"tensor {clip(key)} has a malformed shape or data_offsets")
        itemsize, view, mask = _FLOAT_LAYOUT[entry["dtype"]]
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
            raise self._fail(f"tensor {clip(key)}: data_offsets {offsets} do not hold shape {shape}")
        return _Extent(key, offsets[0], offsets[1], itemsize, view, mask)

    def _check_weights(self, metadata: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> None:
        raw = metadata.get(ADAPTER_CONFIG_KEY)
        if raw is None:
            raise InvalidArgument("no adapter_config in the safetensors metadata")
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise InvalidArgument(f"adapter_config is not JSON ({exc})") from None
        if not isinstance(config, dict):
            raise InvalidArgument("adapter_config is not a JSON object")
        self.spec = spec_from_peft_config(config)
        self.base_model = str(config.get("base_model_name_or_path") or "")
        # Format "2" stores a shared-outer adapter's shared factors once (compact shapes, nothing to compare);
        # "1" (no version) once per expert, every copy checked equal as it streams in.
        self.format = blob_format(metadata, field="tensors", error=InvalidArgument)
        compact = self.format == COMPACT_FORMAT
        check_shapes(shapes, self.spec, field="tensors", compact=compact)
        if compact:
            return
        for extent in self._extents:
            copies = shared_copies(extent.key, shapes[extent.key], self.spec)
            if copies is not None and copies.experts > 1:
                extent.copies = CopiesCheck(copies, "tensors")

    def _check_training_state(self, metadata: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> None:
        raw = metadata.get(TRAINING_STATE_KEY)
        if raw is None:
            raise InvalidArgument("no loraplane_training_state in the safetensors metadata")
        try:
            info = json.loads(raw)
            self.spec = LoraSpec.create(int(info["rank"]), float(info["alpha"]), info["target_modules"],
                                        int(info["seed"]), max_rank=1 << 20, field_prefix="training_state",
                                        expert_layout=str(info.get("expert_layout") or PER_EXPERT))
            step = int(info["step"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"loraplane_training_state is malformed ({exc})") from None
        if step < 0:
            raise InvalidArgument(f"training-state step {step} is negative")
        self.base_model = str(info.get("base_model", ""))
        params = {k: v for k, v in shapes.items() if not k.startswith("optimizer.")}
        check_shapes(params, self.spec, field="tensors", compact=True)
        for key, shape in params.items():
            if shapes.get(EXP_AVG + key) != shape or shapes.get(EXP_AVG_SQ + key) != shape:
                raise InvalidArgument(f"no AdamW moments of shape {shape} for {key}")
        if len(shapes) != 3 * len(params):
            extra = sorted(set(shapes) - set(params) - {EXP_AVG + k for k in params} - {EXP_AVG_SQ + k for k in params})
            raise InvalidArgument(f"unexpected tensors {[clip(k) for k in extra[:3]]}")

    def _scan(self, view: memoryview) -> None:
        """Checks the tensor bytes in `view` (which follow the header) for non-finite values."""
        position = self._received - self._data_start
        self._received += len(view)
        if self._received > self.size:
            raise self._fail(f"more than the announced {self.size} bytes")
        while view:
            extent = self._extents[self._index]
            take = min(len(view), extent.end - position)
            segment = self._carry + bytes(view[:take]) if self._carry else view[:take]
            whole = len(segment) - len(segment) % extent.itemsize
            values = np.frombuffer(segment[:whole], dtype=extent.view)
            if values.size and bool(((values & extent.view(extent.mask)) == extent.view(extent.mask)).any()):
                raise self._fail(f"tensor {clip(extent.key)} has non-finite values")
            if extent.copies is not None and values.size:
                try:
                    extent.copies.feed(values)
                except InvalidArgument as exc:
                    raise self._fail(exc.message) from None
            self._carry = bytes(segment[whole:])
            position += take
            view = view[take:]
            if position == extent.end:
                self._index += 1

    def finish(self) -> None:
        """Call after the last chunk: raises the first failure, or if the blob was incomplete."""
        if self.error is not None:
            raise self.error
        if self._data_start is None:
            raise self._fail(f"its {self._received} bytes end inside the safetensors header")
        if self._received != self.size:
            raise self._fail(f"it ended after {self._received} of {self.size} bytes")
