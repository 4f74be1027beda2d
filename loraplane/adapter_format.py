"""Adapter blobs: the PEFT safetensors weights file and the trainer's training-state file.

Weights blob: one safetensors file holding the PEFT LoRA tensors under PEFT key names, with the PEFT
`adapter_config.json` content in its header metadata (key "adapter_config"), so HF PEFT / vLLM / SGLang can load an
exported version after `materialize_peft_dir` splits it into adapter_model.safetensors + adapter_config.json. Its
tensors are float32, or bfloat16 for an adapter whose LoraConfig.weights_dtype asks for it (readers upcast).

Training-state blob: also safetensors (never pickle): params under their PEFT keys, AdamW moments under
`optimizer.exp_avg.<key>` / `optimizer.exp_avg_sq.<key>`, metadata "loraplane_training_state" = JSON with the
step, the LoRA spec and the base model name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from loraplane.errors import DataLoss, InvalidArgument, LoraplaneError, clip
from loraplane.lora import TARGET_MODULES, LoraSpec, parse_peft_key

ADAPTER_CONFIG_KEY = "adapter_config"
TRAINING_STATE_KEY = "loraplane_training_state"
FORMAT_KEY = "format"
EXP_AVG = "optimizer.exp_avg."
EXP_AVG_SQ = "optimizer.exp_avg_sq."


def peft_adapter_config(spec: LoraSpec, base_model_name: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": spec.rank,
        "lora_alpha": spec.effective_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "revision": None,
        "loraplane_seed": spec.seed,
    }


# The dtypes an adapter's weights blob may be written in, under the names LoraConfig.weights_dtype uses, with the
# safetensors dtype code of each.
WEIGHTS_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


class SafetensorsWriter:
    """A safetensors file of float tensors in one dtype: tensors in sorted name order, metadata sorted, so the same
    tensors always give the same bytes (the registry is content-addressed).

    The header depends only on names, shapes and the dtype, so `size` is known before any tensor byte exists and
    `chunks` can produce the file piece by piece (a publish sends each piece while the next is made). Each tensor
    is read once, from any device, dtype or stride: cast to the file's dtype where it lives (on a GPU, half the
    bytes of a bf16 file cross to the host), and a host tensor already in the file's dtype is not copied until its
    bytes go into an output chunk. safetensors' own writer copies the data three times, and filling one
    preallocated buffer first touches (and zeroes) every page of it: for a 336 MB adapter either costs more than
    producing the chunks."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
                 dtype: torch.dtype = torch.float32):
        self._tensors = tensors
        self._names = sorted(tensors)
        self._dtype = dtype
        code, itemsize = _SAFETENSORS_DTYPES[dtype], torch.empty((), dtype=dtype).element_size()
        header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
        offset = 0
        for name in self._names:
            nbytes = tensors[name].numel() * itemsize
            header[name] = {"dtype": code, "shape": list(tensors[name].shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._header = len(text).to_bytes(8, "little") + text
        self.size = len(self._header) + offset

    def _pieces(self) -> Iterator[memoryview]:
        yield memoryview(self._header)
        for name in self._names:
            tensor = self._tensors[name].detach()
            if tensor.dtype != self._dtype:
                tensor = tensor.to(self._dtype)
            tensor = tensor.to("cpu").contiguous()
            if tensor.numel():
                yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy())

    def to_bytes(self) -> bytes:
        return b"".join(self._pieces())

    def chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        """The file as consecutive pieces of exactly `chunk_bytes` (the last one shorter), made as they are taken."""
        pending: list[memoryview] = []
        filled = 0
        for piece in self._pieces():
            while piece:
                take = min(len(piece), chunk_bytes - filled)
                pending.append(piece[:take])
                filled += take
                piece = piece[take:]
                if filled == chunk_bytes:
                    yield b"".join(pending)
                    pending, filled = [], 0
        if pending:
            yield b"".join(pending)


def _save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A float32 safetensors file of `tensors` (see SafetensorsWriter)."""
    return SafetensorsWriter(tensors, metadata).to_bytes()


def weights_dtype(name: str, field: str = "weights_dtype") -> torch.dtype:
    """The torch dtype of a LoraConfig.weights_dtype name ("" = float32); InvalidArgument naming `field` for any
    other name."""
    dtype = WEIGHTS_DTYPES.get(name or "float32")
    if dtype is None:
        raise InvalidArgument(f"{field}: {clip(name)!r} is not a WeightsDtype; use one of {', '.join(WEIGHTS_DTYPES)}",
                              field=field)
    return dtype


def adapter_writer(params: Mapping[str, torch.Tensor], spec: LoraSpec, base_model_name: str,
                   dtype: str = "float32") -> SafetensorsWriter:
    """The PEFT weights file of `params` in `dtype` (a WEIGHTS_DTYPES name), after checking the params."""
    _check_params(params, spec, field="params")
    metadata = {
        FORMAT_KEY: "pt",
        ADAPTER_CONFIG_KEY: json.dumps(peft_adapter_config(spec, base_model_name), sort_keys=True),
    }
    return SafetensorsWriter(params, metadata, weights_dtype(dtype))


def serialize_adapter(params: Mapping[str, torch.Tensor], spec: LoraSpec, base_model_name: str,
                      dtype: str = "float32") -> bytes:
    return adapter_writer(params, spec, base_model_name, dtype).to_bytes()


def _header(blob: bytes, what: str) -> dict:
    if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) < 8:
        raise DataLoss(f"{what} is not a safetensors file (too short)", field="blob")
    header_len = int.from_bytes(bytes(blob[:8]), "little")
    if header_len <= 0 or 8 + header_len > len(blob):
        raise DataLoss(f"{what} is not a safetensors file (bad header length)", field="blob")
    try:
        header = json.loads(bytes(blob[8:8 + header_len]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataLoss(f"{what} is not a valid safetensors file: {exc}", field="blob") from exc
    if not isinstance(header, dict):
        raise DataLoss(f"{what} is not a valid safetensors file: its header is not a JSON object", field="blob")
    return header


def _read(blob: bytes, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    header = _header(blob, what)
    try:
        tensors = st_load(bytes(blob))
    except (SafetensorError, ValueError, UnicodeDecodeError) as exc:
        raise DataLoss(f"{what} is not a valid safetensors file: {exc}", field="blob") from exc
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise DataLoss(f"{what}: safetensors metadata is not a string map", field="blob")
    return tensors, metadata


def _spec_from_peft_config(config: dict) -> LoraSpec:
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"adapter peft_type {config.get('peft_type')!r} is not LORA", field="adapter_config")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(flag):
            raise InvalidArgument(f"adapter_config.{flag} is not supported", field=f"adapter_config.{flag}")
    if config.get("bias", "none") != "none":
        raise InvalidArgument("adapter_config.bias must be 'none'", field="adapter_config.bias")
    targets = config.get("target_modules") or list(TARGET_MODULES)
    if isinstance(targets, str):
        raise InvalidArgument("adapter_config.target_modules must be a list", field="adapter_config.target_modules")
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"adapter_config lacks a valid r / lora_alpha: {exc}", field="adapter_config.r") from exc
    return LoraSpec.create(rank, alpha, targets, int(config.get("loraplane_seed", 0) or 0),
                           max_rank=1 << 20, field_prefix="adapter_config")


def parse_adapter(blob: bytes) -> tuple[dict[str, torch.Tensor], LoraSpec, str]:
    """Reads a weights blob -> (params, spec, base model name). Shapes and keys are checked against the config."""
    tensors, metadata = _read(blob, "adapter blob")
    spec, base_name = _adapter_config(metadata)
    params = {k: v.to(torch.float32) for k, v in tensors.items()}
    _check_params(params, spec, field="blob")
    return params, spec, base_name


def adapter_header(blob: bytes) -> tuple[LoraSpec, str, dict[str, str]]:
    """(spec, base model name, tensor name -> safetensors dtype) of a weights blob, from its header alone: keys and
    shapes are checked against the config, the values are not read (for a consumer that hands the bytes on as they
    are, such as a PEFT file for SGLang, of a blob whose digest it has checked: the registry checked its values)."""
    header = _header(blob, "adapter blob")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise DataLoss("adapter blob: safetensors metadata is not a string map", field="blob")
    spec, base_name = _adapter_config(metadata)
    try:
        shapes = {name: tuple(int(n) for n in entry["shape"]) for name, entry in header.items()}
        dtypes = {name: str(entry["dtype"]) for name, entry in header.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLoss(f"adapter blob: malformed safetensors header entry: {exc}", field="blob") from None
    _check_shapes(shapes, spec, field="blob")
    return spec, base_name, dtypes


def _adapter_config(metadata: Mapping[str, str]) -> tuple[LoraSpec, str]:
    raw = metadata.get(ADAPTER_CONFIG_KEY)
    if raw is None:
        raise DataLoss("adapter blob has no adapter_config in its safetensors metadata", field="blob")
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise DataLoss(f"adapter_config metadata is not JSON: {exc}", field="blob") from exc
    return _spec_from_peft_config(config), str(config.get("base_model_name_or_path") or "")


def _non_finite_key(params: Mapping[str, torch.Tensor]) -> str | None:
    """The first tensor holding a NaN or an infinity, or None. A finite norm proves a tensor finite; the norms of
    all tensors come from one foreach call (an isfinite pass per tensor took ~28 ms of a 39 MB publish). Only when a
    norm is not finite (a bad value, or a norm that overflows) is each tensor scanned."""
    tensors = [t.detach() for t in params.values()]
    if bool(torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(tensors)])).all()):
        return None
    return next((k for k, t in zip(params, tensors) if not bool(torch.isfinite(t).all())), None)


def _check_params(params: Mapping[str, torch.Tensor], spec: LoraSpec, *, field: str) -> None:
    """Keys must form complete A/B pairs of the spec's target modules over layers 0..L-1 with rank-consistent
    shapes and finite values."""
    _check_shapes({key: tuple(tensor.shape) for key, tensor in params.items()}, spec, field=field)
    bad = _non_finite_key(params)
    if bad is not None:
        raise InvalidArgument(f"{field}: {bad} has non-finite values", field=field)


def _check_shapes(shapes: dict[str, tuple[int, ...]], spec: LoraSpec, *, field: str) -> None:
    layers: set[int] = set()
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        try:
            layer, module, which = parse_peft_key(key)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{field}: {exc.message}", field=field) from None
        if module not in spec.target_modules:
            raise InvalidArgument(f"{field}: {key} targets {module}, not in target_modules", field=field)
        if len(shape) != 2 or min(shape) < 1:
            raise InvalidArgument(f"{field}: {key} must be 2-D and non-empty, got shape {shape}", field=field)
        layers.add(layer)
        pairs.setdefault((layer, module), {})[which] = shape
    if not shapes:
        raise InvalidArgument(f"{field}: no LoRA tensors", field=field)
    if layers != set(range(len(layers))):
        raise InvalidArgument(f"{field}: layers {sorted(layers)} are not 0..{len(layers) - 1}", field=field)
    for layer in layers:
        for module in spec.target_modules:
            shapes = pairs.get((layer, module), {})
            if "A" not in shapes or "B" not in shapes:
                raise InvalidArgument(f"{field}: layer {layer} {module} lacks lora_A or lora_B", field=field)
            if shapes["A"][0] != spec.rank or shapes["B"][1] != spec.rank:
                raise InvalidArgument(
                    f"{field}: layer {layer} {module} shapes {shapes['A']}/{shapes['B']} disagree with rank "
                    f"{spec.rank}", field=field)


def materialize_peft_dir(blob: bytes, directory: str | Path) -> Path:
    """Writes adapter_model.safetensors + adapter_config.json so HF PEFT / SGLang / vLLM can load the adapter."""
    params, spec, base_name = parse_adapter(blob)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = peft_adapter_config(spec, base_name)
    config.pop("loraplane_seed", None)
    tmp_weights = directory / ".adapter_model.safetensors.tmp"
    tmp_weights.write_bytes(_save(params, {FORMAT_KEY: "pt"}))
    tmp_weights.replace(directory / "adapter_model.safetensors")
    tmp_config = directory / ".adapter_config.json.tmp"
    tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True))
    tmp_config.replace(directory / "adapter_config.json")
    return directory


@dataclass
class TrainingState:
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int
    spec: LoraSpec
    base_model_name: str


def serialize_training_state(state: TrainingState) -> bytes:
    _check_params(state.params, state.spec, field="params")
    tensors = dict(state.params)
    for key in state.params:
        tensors[EXP_AVG + key] = state.exp_avg[key]
        tensors[EXP_AVG_SQ + key] = state.exp_avg_sq[key]
    info = {
        "step": int(state.step),
        "rank": state.spec.rank,
        "alpha": state.spec.effective_alpha,
        "target_modules": list(state.spec.target_modules),
        "seed": state.spec.seed,
        "base_model": state.base_model_name,
    }
    metadata = {
        FORMAT_KEY: "pt",
        TRAINING_STATE_KEY: json.dumps(info, sort_keys=True),
        ADAPTER_CONFIG_KEY: json.dumps(peft_adapter_config(state.spec, state.base_model_name), sort_keys=True),
    }
    return _save(tensors, metadata)


def parse_training_state(blob: bytes) -> TrainingState:
    tensors, metadata = _read(blob, "training-state blob")
    raw = metadata.get(TRAINING_STATE_KEY)
    if raw is None:
        raise InvalidArgument("blob is not a training state (no loraplane_training_state metadata); "
                              "LoadState needs a SaveState version", field="source")
    try:
        info = json.loads(raw)
        spec = LoraSpec.create(int(info["rank"]), float(info["alpha"]), info["target_modules"], int(info["seed"]),
                               max_rank=1 << 20, field_prefix="training_state")
        step = int(info["step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLoss(f"training-state metadata is malformed: {exc}", field="blob") from exc
    if step < 0 or not math.isfinite(step):
        raise DataLoss("training-state step is negative", field="blob")
    params = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    _check_params(params, spec, field="blob")
    exp_avg, exp_avg_sq = {}, {}
    for key, tensor in params.items():
        m = tensors.get(EXP_AVG + key)
        v = tensors.get(EXP_AVG_SQ + key)
        if m is None or v is None or m.shape != tensor.shape or v.shape != tensor.shape:
            raise DataLoss(f"training-state blob lacks matching AdamW moments for {key}", field="blob")
        exp_avg[key] = m
        exp_avg_sq[key] = v
    extra = set(tensors) - set(params) - {EXP_AVG + k for k in params} - {EXP_AVG_SQ + k for k in params}
    if extra:
        raise DataLoss(f"training-state blob has unexpected tensors: {sorted(extra)[:3]}", field="blob")
    return TrainingState(params=params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step, spec=spec,
                         base_model_name=str(info.get("base_model", "")))


# ------------------------------------------------------------------------------------------------ upload checks

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


class BlobCheck:
    """Checks an uploaded blob while it streams, before the registry commits it: a weights blob must be a PEFT
    safetensors LoRA adapter (header, adapter_config, tensor names and shapes consistent with it, finite values),
    a training-state blob what `parse_training_state` accepts. Memory stays at one chunk plus the header.

    Every failure is InvalidArgument naming `field` (the upload's bytes), since the caller sent them. `feed` only
    records the first failure (and stops looking); `finish` raises it. So an uploader can let the transport's own
    checks (length, digest) speak first: a truncated stream is reported as truncated, not as a malformed adapter."""

    def __init__(self, size: int, *, training_state: bool, field: str = "chunk"):
        self.size = size
        self.training_state = training_state
        self.field = field
        self.spec: LoraSpec | None = None
        self.base_model = ""
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
        self.spec = _spec_from_peft_config(config)
        self.base_model = str(config.get("base_model_name_or_path") or "")
        _check_shapes(shapes, self.spec, field="tensors")

    def _check_training_state(self, metadata: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> None:
        raw = metadata.get(TRAINING_STATE_KEY)
        if raw is None:
            raise InvalidArgument("no loraplane_training_state in the safetensors metadata")
        try:
            info = json.loads(raw)
            self.spec = LoraSpec.create(int(info["rank"]), float(info["alpha"]), info["target_modules"],
                                        int(info["seed"]), max_rank=1 << 20, field_prefix="training_state")
            step = int(info["step"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"loraplane_training_state is malformed ({exc})") from None
        if step < 0:
            raise InvalidArgument(f"training-state step {step} is negative")
        self.base_model = str(info.get("base_model", ""))
        params = {k: v for k, v in shapes.items() if not k.startswith("optimizer.")}
        _check_shapes(params, self.spec, field="tensors")
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
