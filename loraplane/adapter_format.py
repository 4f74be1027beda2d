"""Adapter blobs: the PEFT safetensors weights file and the trainer's training-state file.

Weights blob: one safetensors file holding the PEFT LoRA tensors under PEFT key names, with the PEFT
`adapter_config.json` content in its header metadata (key "adapter_config"), so HF PEFT / vLLM / SGLang can load an
exported version after `materialize_peft_dir` splits it into adapter_model.safetensors + adapter_config.json. Its
tensors are float32, or bfloat16 for an adapter whose LoraConfig.weights_dtype asks for it (readers upcast).

Format versions (metadata "loraplane_format"; docs/architecture.md, "Weights blob format versions"):
- absent ("1"): every tensor in PEFT's shapes; a shared-outer adapter's shared factors (gate_up lora_A, down
  lora_B) repeated once per expert (2.57 GB for Qwen3-30B-A3B rank 32, as much as per-expert).
- "2": a shared-outer adapter's shared factors stored once (gate_up A [r, in], down B [out, r]: the trainer's own
  tensors, as Tinker keeps them), everything else as in "1". Only shared-outer adapters are written so; per-expert
  and dense blobs stay "1", byte for byte. Every reader takes both; the expansion to per-expert shapes happens
  where a consumer needs it (`materialize_peft_dir`, SGLang's packing on the sampler).
A version this code does not know is refused (DATA_LOSS naming the key), never misread.

Training-state blob: also safetensors (never pickle): params under their PEFT keys, AdamW moments under
`optimizer.exp_avg.<key>` / `optimizer.exp_avg_sq.<key>`, metadata "loraplane_training_state" = JSON with the
step, the LoRA spec and the base model name.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from loraplane.errors import DataLoss, FailedPrecondition, InvalidArgument, clip
from loraplane.expert_layout import fold_copies, shared_copies
from loraplane.lora import (
    PEFT_PREFIX,
    PER_EXPERT,
    SHARED_OUTER,
    TARGET_MODULES,
    LoraSpec,
    parse_peft_key,
    peft_key,
)
from loraplane.models.families import FAMILIES, TARGETS
from loraplane.models.families.base import BLOCK_TARGETS, NONGATED_EXPERT_TARGETS, ROUTED_EXPERT_TARGETS

ADAPTER_CONFIG_KEY = "adapter_config"
FORMAT_VERSION_KEY = "loraplane_format"
COMPACT_FORMAT = "2"
KNOWN_FORMATS = ("1", COMPACT_FORMAT)
TRAINING_STATE_KEY = "loraplane_training_state"
FORMAT_KEY = "format"
EXP_AVG = "optimizer.exp_avg."
EXP_AVG_SQ = "optimizer.exp_avg_sq."


# PEFT target_parameters names of the expert targets (transformers' fused 3-D expert parameters).
PEFT_TARGET_PARAMETERS = {"experts.gate_up_proj": "mlp.experts.gate_up_proj", "experts.down_proj": "mlp.experts.down_proj"}
PEFT_TARGET_PARAMETERS.update({"mixer.experts.up_proj": "mixer.experts.up_proj",
                               "mixer.experts.down_proj": "mixer.experts.down_proj"})  # Nemotron-H
EXPERT_LAYOUT_KEY = "loraplane_expert_layout"
# The base model's family (its model_type): what a consumer that renames or splits the adapter's tensors needs of
# it (Tinker's layout: the order of gate and up in the fused experts, the attention's name). HF PEFT applies the
# tensors to the model's own modules as they are and ignores it. Absent: a family with the defaults (Llama-like).
MODEL_TYPE_KEY = "loraplane_model_type"


def peft_adapter_config(spec: LoraSpec, base_model_name: str, model_type: str = "") -> dict:
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": spec.rank,
        "lora_alpha": spec.effective_alpha,
        "lora_dropout": 0.0,
        "target_modules": [t for t in spec.target_modules if t not in ROUTED_EXPERT_TARGETS],
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
    if spec.has_experts:
        # HF PEFT's LoRA on transformers' fused 3-D experts; the per-expert tensors are in the file whatever the
        # layout (shared factors repeated per expert), the layout is recorded so a reader can fold them back.
        config["target_parameters"] = [PEFT_TARGET_PARAMETERS[t] for t in spec.target_modules if t in ROUTED_EXPERT_TARGETS]
        config[EXPERT_LAYOUT_KEY] = spec.expert_layout
    if model_type:
        config[MODEL_TYPE_KEY] = model_type
    return config


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


def writes_compact(spec: LoraSpec) -> bool:
    """Whether a weights blob of `spec` is written in the compact format "2" (a shared-outer expert adapter)."""
    return spec.has_experts and spec.expert_layout == SHARED_OUTER


def adapter_writer(params: Mapping[str, torch.Tensor], spec: LoraSpec, base_model_name: str,
                   dtype: str = "float32", *, compact: bool = True, model_type: str = ""
                   ) -> SafetensorsWriter:
    """The weights file of `params` in `dtype` (a WEIGHTS_DTYPES name), after checking the params. A shared-outer
    adapter's shared factors are written once (format "2"); `compact=False` writes them once per expert (PEFT's
    per-expert shapes, format "1", what every blob was before "2": kept to write such blobs for tests and for a
    reader that predates "2"). `params`: the trainer's own (compact) tensors."""
    _check_params(params, spec, field="params", compact=True)
    metadata = {
        FORMAT_KEY: "pt",
        ADAPTER_CONFIG_KEY: json.dumps(peft_adapter_config(spec, base_model_name, model_type), sort_keys=True),
    }
    if compact and writes_compact(spec):
        metadata[FORMAT_VERSION_KEY] = COMPACT_FORMAT
    else:
        params = expand_shared_outer(params, spec)
    return SafetensorsWriter(params, metadata, weights_dtype(dtype))


def serialize_adapter(params: Mapping[str, torch.Tensor], spec: LoraSpec, base_model_name: str,
                      dtype: str = "float32", *, compact: bool = True, model_type: str = "") -> bytes:
    return adapter_writer(params, spec, base_model_name, dtype, compact=compact, model_type=model_type).to_bytes()


def blob_format(metadata: Mapping[str, str], field: str = "blob", error=None) -> str:
    """The format version of a weights blob from its metadata ("1" when absent); an unknown version raises
    `error` (DataLoss by default: a stored blob this reader cannot read) naming the key."""
    version = metadata.get(FORMAT_VERSION_KEY, "1")
    if version not in KNOWN_FORMATS:
        raise (error or DataLoss)(f"{field}: {FORMAT_VERSION_KEY} {clip(str(version))!r} is not a weights format "
                                  f"this reader knows ({', '.join(KNOWN_FORMATS)})", field=field)
    return version


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


def spec_from_peft_config(config: dict) -> LoraSpec:
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"adapter peft_type {config.get('peft_type')!r} is not LORA", field="adapter_config")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(flag):
            raise InvalidArgument(f"adapter_config.{flag} is not supported", field=f"adapter_config.{flag}")
    if config.get("bias", "none") != "none":
        raise InvalidArgument("adapter_config.bias must be 'none'", field="adapter_config.bias")
    targets = config.get("target_modules")
    parameters = config.get("target_parameters") or []
    if isinstance(targets, str) or isinstance(parameters, str):
        raise InvalidArgument("adapter_config.target_modules must be a list", field="adapter_config.target_modules")
    by_parameter = {v: k for k, v in PEFT_TARGET_PARAMETERS.items()}
    unknown = [p for p in parameters if p not in by_parameter]
    if unknown:
        raise InvalidArgument(f"adapter_config.target_parameters: unknown {unknown[:3]}; allowed "
                              f"{list(by_parameter)}", field="adapter_config.target_parameters")
    targets = list(targets or ([] if parameters else TARGET_MODULES)) + [by_parameter[p] for p in parameters]
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"adapter_config lacks a valid r / lora_alpha: {exc}", field="adapter_config.r") from exc
    return LoraSpec.create(rank, alpha, targets, int(config.get("loraplane_seed", 0) or 0),
                           max_rank=1 << 20, field_prefix="adapter_config",
                           expert_layout=str(config.get(EXPERT_LAYOUT_KEY) or PER_EXPERT))


def parse_adapter(blob: bytes) -> tuple[dict[str, torch.Tensor], LoraSpec, str]:
    """Reads a weights blob -> (params, spec, base model name). Shapes and keys are checked against the config."""
    tensors, metadata = _read(blob, "adapter blob")
    spec, base_name = _adapter_config(metadata)
    compact = blob_format(metadata) == COMPACT_FORMAT
    params = {k: v.to(torch.float32) for k, v in tensors.items()}
    _check_params(params, spec, field="blob", compact=compact)
    return (params if compact else fold_shared_outer(params, spec)), spec, base_name


def _pop_metadata(header: dict) -> dict[str, str]:
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise DataLoss("adapter blob: safetensors metadata is not a string map", field="blob")
    return metadata


def blob_metadata(blob: bytes) -> dict[str, str]:
    """The safetensors metadata of a blob (its adapter_config.json among it), from the header alone."""
    return _pop_metadata(_header(blob, "adapter blob"))


def adapter_header(blob: bytes) -> tuple[LoraSpec, str, dict[str, str]]:
    """(spec, base model name, tensor name -> safetensors dtype) of a weights blob, from its header alone: keys and
    shapes are checked against the config, the values are not read (for a consumer that hands the bytes on as they
    are, such as a PEFT file for SGLang, of a blob whose digest it has checked: the registry checked its values)."""
    header = _header(blob, "adapter blob")
    metadata = _pop_metadata(header)
    spec, base_name = _adapter_config(metadata)
    try:
        shapes = {name: tuple(int(n) for n in entry["shape"]) for name, entry in header.items()}
        dtypes = {name: str(entry["dtype"]) for name, entry in header.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLoss(f"adapter blob: malformed safetensors header entry: {exc}", field="blob") from None
    check_shapes(shapes, spec, field="blob", compact=blob_format(metadata) == COMPACT_FORMAT)
    return spec, base_name, dtypes


_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def adapter_tensor_views(blob: bytes) -> tuple[dict[str, torch.Tensor], LoraSpec, str]:
    """(tensors, spec, base model name) of a weights blob whose digest was checked (the registry checked its
    values): each tensor a read-only view of the blob's bytes in its stored dtype, nothing copied or upcast (a
    Qwen3-30B-A3B expert adapter is 2.6 GB of bf16: parse_adapter's float32 copy is 5.1 GB more and seconds of
    work). Keys and shapes checked as :func:`adapter_header` checks them; shared-outer factors as the blob stores
    them (once in format "2", once per expert in "1": `expand_shared_outer` and `sglang_packing` take either).
    The views keep `blob` alive."""
    import warnings

    header = _header(blob, "adapter blob")
    metadata = _pop_metadata(header)
    spec, base_name = _adapter_config(metadata)
    compact = blob_format(metadata) == COMPACT_FORMAT
    start = 8 + int.from_bytes(bytes(blob[:8]), "little")
    tensors: dict[str, torch.Tensor] = {}
    try:
        entries = {name: (_TORCH_DTYPES[entry["dtype"]], tuple(int(n) for n in entry["shape"]),
                          [int(o) for o in entry["data_offsets"]]) for name, entry in header.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLoss(f"adapter blob: malformed safetensors header entry: {exc}", field="blob") from None
    check_shapes({name: shape for name, (_, shape, _) in entries.items()}, spec, field="blob", compact=compact)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a bytes blob is not writable; the views are only read
        for name, (dtype, shape, (begin, end)) in entries.items():
            count = math.prod(shape)
            if end - begin != count * _ITEMSIZE[dtype] or start + end > len(blob):
                raise DataLoss(f"adapter blob: {name} data_offsets do not hold shape {list(shape)}", field="blob")
            tensors[name] = torch.frombuffer(blob, dtype=dtype, count=count, offset=start + begin).view(shape)
    return tensors, spec, base_name


_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _TORCH_DTYPES.values()}


def _adapter_config(metadata: Mapping[str, str]) -> tuple[LoraSpec, str]:
    raw = metadata.get(ADAPTER_CONFIG_KEY)
    if raw is None:
        raise DataLoss("adapter blob has no adapter_config in its safetensors metadata", field="blob")
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise DataLoss(f"adapter_config metadata is not JSON: {exc}", field="blob") from exc
    return spec_from_peft_config(config), str(config.get("base_model_name_or_path") or "")


def _non_finite_key(params: Mapping[str, torch.Tensor]) -> str | None:
    """The first tensor holding a NaN or an infinity, or None. A finite norm proves a tensor finite; the norms of
    all tensors come from one foreach call (an isfinite pass per tensor took ~28 ms of a 39 MB publish). Only when a
    norm is not finite (a bad value, or a norm that overflows) is each tensor scanned."""
    tensors = [t.detach() for t in params.values()]
    if bool(torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(tensors)])).all()):
        return None
    return next((k for k, t in zip(params, tensors) if not bool(torch.isfinite(t).all())), None)


def _check_params(params: Mapping[str, torch.Tensor], spec: LoraSpec, *, field: str, compact: bool = False) -> None:
    """Keys must form complete A/B pairs of the spec's target modules over layers 0..L-1 with rank-consistent
    shapes and finite values."""
    check_shapes({key: tuple(tensor.shape) for key, tensor in params.items()}, spec, field=field, compact=compact)
    bad = _non_finite_key(params)
    if bad is not None:
        raise InvalidArgument(f"{field}: {bad} has non-finite values", field=field)


def check_shapes(shapes: dict[str, tuple[int, ...]], spec: LoraSpec, *, field: str, compact: bool = False) -> None:
    """Dense targets: an A/B pair in every layer 0..L-1. Expert targets: an A/B pair in the layers that have them
    (a MoE model's dense layers do not), PEFT's per-expert shapes A [r E, in] / B [out, r E] with one E for the
    whole adapter; `compact`: a shared-outer adapter's own tensors (gate_up A [r, in], down B [out, r]), as the
    trainer and its training state keep them."""
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
        if module not in ROUTED_EXPERT_TARGETS:
            layers.add(layer)
        pairs.setdefault((layer, module), {})[which] = shape
    if not shapes:
        raise InvalidArgument(f"{field}: no LoRA tensors", field=field)
    dense = [m for m in spec.target_modules if m not in ROUTED_EXPERT_TARGETS]
    if (layers != set(range(len(layers))) and not BLOCK_TARGETS.intersection(spec.target_modules)
            and not _one_mixer_kind(dense)):
        # (Nemotron-H's blocks each hold one kind's targets: a block kind left out holds none. A hybrid model's
        # layers of the other token mixer hold none of an adapter on one mixer kind's targets: Qwen3.5's
        # linear-attention layers have no q_proj.)
        raise InvalidArgument(f"{field}: layers {sorted(layers)} are not 0..{len(layers) - 1}", field=field)
    for layer in layers:
        for module in _layer_targets(dense, pairs, layer, field):
            got = pairs.get((layer, module), {})
            if "A" not in got or "B" not in got:
                raise InvalidArgument(f"{field}: layer {layer} {module} lacks lora_A or lora_B", field=field)
            if got["A"][0] != spec.rank or got["B"][1] != spec.rank:
                bad = peft_key(layer, module, "A" if got["A"][0] != spec.rank else "B")
                raise InvalidArgument(
                    f"{field}: tensor {bad}: layer {layer} {module} shapes {got['A']}/{got['B']} disagree with rank "
                    f"{spec.rank}", field=field)
    experts_seen: set[int] = set()
    for (layer, module), got in pairs.items():
        if module not in ROUTED_EXPERT_TARGETS:
            continue
        if "A" not in got or "B" not in got:
            raise InvalidArgument(f"{field}: layer {layer} {module} lacks lora_A or lora_B", field=field)
        rows, cols = got["A"][0], got["B"][1]
        shared_a = compact and spec.expert_layout == SHARED_OUTER and module == "experts.gate_up_proj"
        shared_b = compact and spec.expert_layout == SHARED_OUTER and module == "experts.down_proj"
        counts = {rows // spec.rank if not shared_a else None, cols // spec.rank if not shared_b else None} - {None}
        if ((shared_a and rows != spec.rank) or (shared_b and cols != spec.rank) or rows % spec.rank
                or cols % spec.rank or len(counts) != 1):
            # Named by the factor at fault (the A unless the A's shape is consistent on its own).
            a_wrong = (shared_a and rows != spec.rank) or (not shared_a and rows % spec.rank)
            bad = peft_key(layer, module, "A" if a_wrong else "B")
            raise InvalidArgument(
                f"{field}: tensor {bad}: layer {layer} {module} shapes {got['A']}/{got['B']} are not rank-{spec.rank} "
                f"{'compact ' if compact else ''}{spec.expert_layout} expert factors", field=field)
        experts_seen |= counts
    if len(experts_seen) > 1:
        raise InvalidArgument(f"{field}: expert factors disagree on the number of experts {sorted(experts_seen)}",
                              field=field)
    if spec.has_experts and not any(m in ROUTED_EXPERT_TARGETS for _, m in pairs):
        raise InvalidArgument(f"{field}: expert targets {[m for m in spec.target_modules if m in ROUTED_EXPERT_TARGETS]} "
                              "have no tensors", field=field)


def _layer_targets(dense: list[str], pairs: Mapping[tuple[int, str], object], layer: int, field: str) -> list[str]:
    """The spec's non-expert targets layer `layer` must hold. A model with one token mixer has every one in every
    layer; a hybrid one (Qwen3.5) has its attention targets in the full-attention layers and its linear-attention
    targets in the others: a layer holds all of one mixer's targets or none, and each target is somewhere."""
    groups: dict[str, list[str]] = {}
    for module in dense:
        groups.setdefault(TARGETS[module].group, []).append(module)
    if BLOCK_TARGETS.intersection(dense):
        # One mixer per block (Nemotron-H): a layer holds every target of its block's kind and no other kind's.
        held = sorted({TARGETS[m].group for m in dense if (layer, m) in pairs})
        if len(held) != 1:
            raise InvalidArgument(f"{field}: layer {layer} holds targets of {held or 'no'} block kinds, one "
                                  "expected", field=field)
        for module in dense:
            if not any(m == module for _, m in pairs):
                raise InvalidArgument(f"{field}: {module} is in target_modules but no layer has it", field=field)
        return [m for m in dense if TARGETS[m].group == held[0]]
    mixers = [g for g in _MIXER_GROUPS if g in groups]
    held = [g for g in mixers if any((layer, m) in pairs for m in groups[g])]
    # A layer holds all of its token mixer's targets and none of the other mixer's. An adapter on both kinds'
    # targets has one kind in every layer; one on a single kind's targets (q_proj only) has them in the layers of
    # that kind, and a hybrid model's layers of the other kind (Qwen3.5's linear attention) hold none of them.
    if len(held) > 1 or (not held and len(mixers) > 1):
        raise InvalidArgument(f"{field}: layer {layer} holds {'both' if held else 'neither'} of the attention and "
                              f"linear-attention targets {[m for g in mixers for m in groups[g]]}", field=field)
    for module in dense:
        if TARGETS[module].group in mixers and not any(m == module for _, m in pairs):
            raise InvalidArgument(f"{field}: {module} is in target_modules but no layer has it", field=field)
    return [m for m in dense if TARGETS[m].group not in mixers or TARGETS[m].group in held]


_MIXER_GROUPS = ("attention", "linear_attention")


def _one_mixer_kind(dense: list[str]) -> bool:
    """Whether every non-expert target of an adapter is of one token-mixer kind (attention or linear attention):
    then a hybrid model's layers of the other kind hold none of its tensors."""
    kinds = {TARGETS[m].group for m in dense}
    return len(kinds) == 1 and kinds <= set(_MIXER_GROUPS)


def _shared_keys(params: Mapping[str, torch.Tensor], spec: LoraSpec) -> Iterator[tuple[str, str]]:
    """(key, "A" | "B") of each shared-outer factor: every gate_up lora_A and every down lora_B."""
    if spec.expert_layout != SHARED_OUTER:
        return
    for key in params:
        _, module, which = parse_peft_key(key)
        if (module, which) in (("experts.gate_up_proj", "A"), ("experts.down_proj", "B")):
            yield key, which


def _experts_of(params: Mapping[str, torch.Tensor], spec: LoraSpec) -> int:
    for key, tensor in params.items():
        _, module, which = parse_peft_key(key)
        if (module, which) == ("experts.gate_up_proj", "B"):
            return tensor.shape[1] // spec.rank
        if (module, which) == ("experts.down_proj", "A"):
            return tensor.shape[0] // spec.rank
    return 0


def expand_shared_outer(params: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A shared-outer adapter's tensors in PEFT's per-expert shapes: the shared gate_up A [r, in] repeated as every
    expert's rows ([r E, in]), the shared down B [out, r] as every expert's columns ([out, r E], column j*E + e).
    The same function of the params, so HF PEFT computes exactly the shared-outer adapter. Other adapters: as
    they are."""
    shared = dict(_shared_keys(params, spec))
    if not shared:
        return dict(params)
    experts = _experts_of(params, spec)
    out = dict(params)
    for key, which in shared.items():
        tensor = params[key].detach()
        if which == "A" and tensor.shape[0] == spec.rank:
            out[key] = tensor.repeat(experts, 1)
        elif which == "B" and tensor.shape[1] == spec.rank:
            out[key] = tensor.repeat_interleave(experts, dim=1)
    return out


def fold_shared_outer(params: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The inverse of expand_shared_outer: every expert's copy of a shared factor must be the same, bit for bit
    (`loraplane.expert_layout`, the rule the registry applies before it commits a version), else InvalidArgument
    (such a file is a per-expert adapter, not shared-outer)."""
    out = dict(params)
    for key, tensor in params.items():
        copies = shared_copies(key, tuple(tensor.shape), spec)
        if copies is not None and copies.experts > 1:
            out[key] = fold_copies(tensor, copies).contiguous()
    return out


# ------------------------------------------------------------------------------------------------ SGLang layout

_SGLANG_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
# The 3-D ("stacked") expert keys: one tensor per layer and projection with the expert dimension first.
_SGLANG_STACKED_PROJ = ("gate_up_proj", "down_proj")
# "shared_outer": stacked, a shared-outer adapter's shared factors once (expert dimension 1), for servers launched
# with --experts-shared-outer-loras.
SGLANG_SHARED_OUTER = "shared_outer"
SGLANG_EXPERT_FORMS = ("per_expert", "stacked", SGLANG_SHARED_OUTER)


# The module SGLang 0.5.17 applies each LoRA target to, for the families of the Llama layout (their ``sglang`` map
# is empty): it stacks q/k/v into qkv_proj and gate/up into gate_up_proj itself from PEFT's names.
_SGLANG_LLAMA_LAYOUT = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
                        "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
                        "experts.gate_up_proj": "experts", "experts.down_proj": "experts"}


def sglang_modules(spec: LoraSpec, family) -> dict[str, str]:
    """Each target of `spec` -> the module SGLang 0.5.17 applies it to on a model of `family` (a
    ``loraplane.models.families.ModelFamily``: its ``sglang`` map). An adapter with a target SGLang cannot serve
    there would load with that target silently dropped, or not at all: FailedPrecondition naming every such target
    and the ones it can serve, before the adapter reaches SGLang (Qwen3.5: in_proj_b/a, on SGLang's in_proj_ba
    which takes no LoRA; and in_proj_q/k/v/z unless all four are there, which SGLang stacks into in_proj_qkvz)."""
    table = family.sglang or _SGLANG_LLAMA_LAYOUT
    modules = {target: table.get(target) for target in spec.target_modules}
    refused = [target for target, module in modules.items() if not module]
    if refused:
        servable = [t for t in TARGETS if table.get(t)]
        raise FailedPrecondition(
            f"adapter targets {refused} cannot be served by SGLang on a {family.model_type} model (SGLang 0.5.17 "
            f"applies LoRA to {sorted(set(filter(None, table.values())))} there); sample it with the torch engine, "
            f"or train with target_modules among {servable}", field="adapter")
    for group in family.sglang_together:
        present = [t for t in spec.target_modules if t in group]
        if present and len(present) < len(group):
            missing = [t for t in TARGETS if t in group and t not in present]
            raise FailedPrecondition(
                f"adapter targets {present} are served by SGLang on a {family.model_type} model only together with "
                f"{missing} (SGLang 0.5.17 stacks {sorted(group)} into one fused module's LoRA and drops a part "
                f"alone); sample it with the torch engine, or train with all of them", field="adapter")
    return modules


# SGLang 0.5.17 checks an adapter config's target_modules against its LoRA buffers after mapping each name's last
# part through this table (sglang/srt/lora/utils.py, get_normalized_target_modules); other names stay as they are.
_SGLANG_NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                      "up_proj": "gate_up_proj"}


def sglang_target_modules(target_modules, family) -> list[str]:
    """An adapter config's ``target_modules`` as SGLang must read them on a model of `family`: a target that is part
    of a fused module SGLang names otherwise (Qwen3.5's in_proj_z, in SGLang's in_proj_qkvz) goes by that module's
    name, or SGLang refuses the adapter as not fitting its LoRA buffers; every other name as given (the weights
    themselves load by their PEFT keys whatever the config lists)."""
    table = family.sglang or _SGLANG_LLAMA_LAYOUT
    names: dict[str, None] = {}  # in the given order: a config with nothing to rename stays as it was
    for target in target_modules:
        module = table.get(target)
        leaf = target.split(".")[-1]
        renamed = (module and module != "experts"
                   and _SGLANG_NORMALIZED.get(leaf, leaf) != _SGLANG_NORMALIZED.get(module, module))
        names[module if renamed else target] = None
    return list(names)


def sglang_expert_key(layer: int, expert: int, proj: str, which: str) -> str:
    return f"{PEFT_PREFIX}.{layer}.mlp.experts.{expert}.{proj}.lora_{which}.weight"


def sglang_stacked_key(layer: int, proj: str, which: str) -> str:
    return f"{PEFT_PREFIX}.{layer}.mlp.experts.{proj}.lora_{which}.weight"


# A per-expert key as a slice of its layer's stacked tensor [E, rows, cols]: (key, expert, first row, end row).
ExpertPart = tuple[str, int, int, int]


def sglang_packing(params: Mapping[str, torch.Tensor], spec: LoraSpec, *, form: str = "per_expert"
                   ) -> tuple[dict[str, torch.Tensor], dict[str, list[ExpertPart]], dict]:
    """The adapter in a layout SGLang 0.5.17 serves, as whole tensors plus how to name their parts: dense keys as
    they are, each layer's expert LoRA as 3-D tensors with the expert dimension first,
    ``...layers.{i}.mlp.experts.gate_up_proj.lora_A.weight`` [E, r, in] (SGLang repeats a gate_up A for gate and
    up), ``...gate_up_proj.lora_B.weight`` [E, 2 ffn, r] (gate rows first), ``...down_proj.lora_{A,B}.weight``
    [E, r, ffn] / [E, hidden, r]. `form`:
    - "stacked": SGLang gets those 3-D tensors (4 per layer; the config names gate_up_proj/down_proj);
    - "shared_outer": as "stacked", with a shared-outer adapter's shared factors (gate_up A, down B) once, expert
      dimension 1 ([1, r, in], [1, hidden, r]): what SGLang serves with --experts-shared-outer-loras, a third of the
      bytes for Qwen3-30B-A3B; a per-expert adapter cannot take this form (FailedPrecondition);
    - "per_expert": SGLang gets per-expert keys ``...layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}
      .lora_{A,B}.weight`` (PEFT's transformers-4 names, the config naming gate_proj/up_proj/down_proj): each a
      slice ``[e, first:end]`` of its stacked tensor, listed in the returned parts (gate and up name the same A
      slice; B is split at its gate|up rows). A consumer that lays a stacked tensor out contiguously has every part
      of it contiguous too: one copy per layer tensor instead of one per expert (37k for Qwen3-30B-A3B).
    Lossless either way; a shared-outer factor is every expert's. The tensors are VIEWS of `params` (A as it is,
    B permuted, not contiguous; a compact shared factor broadcast over the experts): nothing is copied here.
    `params`: the trainer's tensors (either layout, compact or expanded) or a blob's (either format)."""
    if form not in SGLANG_EXPERT_FORMS:
        raise InvalidArgument(f"form must be one of {SGLANG_EXPERT_FORMS}, not {form!r}", field="form")
    once = form == SGLANG_SHARED_OUTER
    if once and spec.has_experts and spec.expert_layout != SHARED_OUTER:
        raise FailedPrecondition(
            "adapter: its expert LoRA is per-expert; these SGLang servers serve shared-outer expert LoRA only "
            "(launched with --experts-shared-outer-loras): sample it on servers without that mode, or train the "
            "adapter with expert_layout shared_outer", field="adapter")
    # SGLang serves expert LoRA per expert only: a compact shared factor becomes every expert's here, on the
    # sampler, as a broadcast view (stride 0 over experts), so nothing is copied until the consumer lays it out.
    shared = dict(_shared_keys(params, spec))
    total_experts = _experts_of(params, spec)
    whole: dict[str, torch.Tensor] = {}
    parts: dict[str, list[ExpertPart]] = {}
    for key, tensor in params.items():
        layer, module, which = parse_peft_key(key)
        if module not in ROUTED_EXPERT_TARGETS:
            whole[key] = tensor
            continue
        if module in NONGATED_EXPERT_TARGETS:
            # SGLang 0.5.17 serves no LoRA on Nemotron-H's non-gated routed experts.
            raise InvalidArgument(f"{module}: SGLang does not serve LoRA on Nemotron-H's routed experts",
                                  field="lora_config.target_modules")
        experts = tensor.shape[0] // spec.rank if which == "A" else tensor.shape[1] // spec.rank
        if key in shared and experts == 1 < total_experts:  # compact: [r, in] or [out, r], every expert's
            stacked = tensor.unsqueeze(0) if once else tensor.unsqueeze(0).expand(total_experts, -1, -1)
            experts = 1 if once else total_experts
        elif which == "A":
            stacked = tensor.view(experts, spec.rank, tensor.shape[1])  # expert e's rows [e r, (e+1) r)
        else:
            stacked = tensor.view(tensor.shape[0], spec.rank, experts).permute(2, 0, 1)  # column j*E + e
        if once and key in shared:
            stacked = stacked[:1]  # an expanded shared factor: every expert's copy is the same (the layout's rule)
        proj = "down_proj" if module == "experts.down_proj" else "gate_up_proj"
        stacked_key = sglang_stacked_key(layer, proj, which)
        whole[stacked_key] = stacked
        if form == "per_expert":
            parts[stacked_key] = list(_expert_parts(layer, proj, which, experts, stacked.shape[1]))
    config = {k: v for k, v in peft_adapter_config(spec, "").items() if k != "target_parameters"}
    targets = [t for t in spec.target_modules if t not in ROUTED_EXPERT_TARGETS]
    if spec.has_experts:
        names = _SGLANG_EXPERT_PROJ if form == "per_expert" else _SGLANG_STACKED_PROJ
        targets += [p for p in names if p not in targets]
    config["target_modules"] = targets
    return whole, parts, config


def _expert_parts(layer: int, proj: str, which: str, experts: int, rows: int):
    for e in range(experts):
        if proj == "down_proj":
            yield sglang_expert_key(layer, e, "down_proj", which), e, 0, rows
        elif which == "A":
            yield sglang_expert_key(layer, e, "gate_proj", "A"), e, 0, rows
            yield sglang_expert_key(layer, e, "up_proj", "A"), e, 0, rows
        else:
            yield sglang_expert_key(layer, e, "gate_proj", "B"), e, 0, rows // 2
            yield sglang_expert_key(layer, e, "up_proj", "B"), e, rows // 2, rows


def to_sglang(params: Mapping[str, torch.Tensor], spec: LoraSpec, *, form: str = "per_expert"
              ) -> tuple[dict[str, torch.Tensor], dict]:
    """:func:`sglang_packing` as named tensors (views of `params`; the per-expert parts as views of their stacked
    tensors, one object for a slice two keys name, such as gate's and up's A) and the PEFT config."""
    whole, parts, config = sglang_packing(params, spec, form=form)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in whole.items():
        if key not in parts:
            out[key] = tensor
            continue
        views: dict[tuple[int, int, int], torch.Tensor] = {}
        for name, e, first, end in parts[key]:
            view = views.get((e, first, end))
            if view is None:
                view = views[(e, first, end)] = tensor[e, first:end]
            out[name] = view
    return out, config


def from_sglang(tensors: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_sglang` (either form): SGLang's expert keys back to PEFT's fused-expert tensors
    (folded to the compact shared-outer form when `spec` says so). gate and up must share their A in every expert
    (what PEFT's fused gate_up LoRA is); an adapter trained with separate gate and up A does not fit it:
    InvalidArgument."""
    dense: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    stacked: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        parts = key.split(".")
        if len(parts) == 11 and parts[5:7] == ["mlp", "experts"] and parts[7].isdigit():
            layer, expert, proj, which = int(parts[4]), int(parts[7]), parts[8], parts[9][-1]
            if proj not in _SGLANG_EXPERT_PROJ or parts[9] not in ("lora_A", "lora_B"):
                raise InvalidArgument(f"not an expert LoRA key: {key!r}", field="tensors")
            experts.setdefault((layer, proj, which), {})[expert] = tensor
        elif len(parts) == 10 and parts[5:7] == ["mlp", "experts"] and parts[7] in _SGLANG_STACKED_PROJ:
            if parts[8] not in ("lora_A", "lora_B") or tensor.dim() != 3 or not parts[4].isdigit():
                raise InvalidArgument(f"not a 3-D expert LoRA key: {key!r} {tuple(tensor.shape)}", field="tensors")
            stacked[(int(parts[4]), parts[7], parts[8][-1])] = tensor
        else:
            parse_peft_key(key)
            dense[key] = tensor
    out = dict(dense)

    def put_b(layer: int, module: str, b: torch.Tensor) -> None:  # [E, out, r] -> [out, r E], column j*E + e
        out[peft_key(layer, module, "B")] = b.permute(1, 2, 0).reshape(b.shape[1], -1)

    total = max((tensor.shape[0] for tensor in stacked.values()), default=0)
    for (layer, proj, which), tensor in stacked.items():
        module = "experts.down_proj" if proj == "down_proj" else "experts.gate_up_proj"
        if tensor.shape[0] == 1 < total:  # the "shared_outer" form's shared factor: every expert's
            tensor = tensor.expand(total, -1, -1)
        if which == "A":
            out[peft_key(layer, module, "A")] = tensor.reshape(-1, tensor.shape[2])
        else:
            put_b(layer, module, tensor)
    layers = sorted({layer for layer, _, _ in experts})
    for layer in layers:
        def stack(proj: str, which: str, layer: int = layer) -> list[torch.Tensor]:
            got = experts.get((layer, proj, which), {})
            if sorted(got) != list(range(len(got))) or not got:
                raise InvalidArgument(f"layer {layer} {proj}.lora_{which}: experts {sorted(got)[:4]}... are not "
                                      "0..E-1", field="tensors")
            return [got[e] for e in range(len(got))]

        if (layer, "gate_proj", "A") in experts:
            gate_a, up_a = stack("gate_proj", "A"), stack("up_proj", "A")
            if any(not torch.equal(g, u) for g, u in zip(gate_a, up_a)):
                raise InvalidArgument(f"layer {layer}: gate_proj and up_proj have different lora_A; PEFT's fused "
                                      "gate_up LoRA shares one A", field="tensors")
            gate_b, up_b = stack("gate_proj", "B"), stack("up_proj", "B")
            out[peft_key(layer, "experts.gate_up_proj", "A")] = torch.cat(gate_a)
            put_b(layer, "experts.gate_up_proj", torch.stack([torch.cat([g, u]) for g, u in zip(gate_b, up_b)]))
        if (layer, "down_proj", "A") in experts:
            out[peft_key(layer, "experts.down_proj", "A")] = torch.cat(stack("down_proj", "A"))
            put_b(layer, "experts.down_proj", torch.stack(stack("down_proj", "B")))
    out = {key: tensor.contiguous() for key, tensor in out.items()}
    _check_params(out, spec, field="tensors")
    return fold_shared_outer(out, spec)


def materialize_sglang_dir(blob: bytes, directory: str | Path) -> Path:
    """adapter_model.safetensors + adapter_config.json in the layout SGLang serves (see :func:`to_sglang`): for a
    dense adapter the PEFT directory itself."""
    params, spec, base_name = parse_adapter(blob)
    if not spec.has_experts:
        return materialize_peft_dir(blob, directory)
    tensors, config = to_sglang(params, spec)
    config["base_model_name_or_path"] = base_name
    for key in ("loraplane_seed", EXPERT_LAYOUT_KEY):
        config.pop(key, None)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp_weights = directory / ".adapter_model.safetensors.tmp"
    tmp_weights.write_bytes(_save(tensors, {FORMAT_KEY: "pt"}))
    tmp_weights.replace(directory / "adapter_model.safetensors")
    tmp_config = directory / ".adapter_config.json.tmp"
    tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True))
    tmp_config.replace(directory / "adapter_config.json")
    return directory


def materialize_peft_dir(blob: bytes, directory: str | Path) -> Path:
    """Writes adapter_model.safetensors + adapter_config.json so HF PEFT / SGLang / vLLM can load the adapter."""
    params, spec, base_name = parse_adapter(blob)
    params = expand_shared_outer(params, spec)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = peft_adapter_config(spec, base_name)
    config.pop("loraplane_seed", None)
    config.pop(EXPERT_LAYOUT_KEY, None)
    params, config = fuse_split_projections(params, spec, config)
    tmp_weights = directory / ".adapter_model.safetensors.tmp"
    tmp_weights.write_bytes(_save(params, {FORMAT_KEY: "pt"}))
    tmp_weights.replace(directory / "adapter_model.safetensors")
    tmp_config = directory / ".adapter_config.json.tmp"
    tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True))
    tmp_config.replace(directory / "adapter_config.json")
    return directory


# Tinker's separate LoRA pairs on the Q, K and V rows of a Qwen3.5 linear-attention layer's fused in_proj_qkv.
SPLIT_QKV = ("in_proj_q", "in_proj_k", "in_proj_v")
FUSED_QKV = "in_proj_qkv"


def fuse_split_projections(params: Mapping[str, torch.Tensor], spec: LoraSpec, config: dict
                           ) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter as HF PEFT loads it onto the model's own modules: the in_proj_q/k/v pairs of each layer become
    one pair on in_proj_qkv of rank 3r, A = [A_q; A_k; A_v] and B block-diagonal (B_q, B_k, B_v), with alpha 3
    alpha (rank_pattern / alpha_pattern) so the scale stays alpha / r: B A x is exactly [B_q A_q x; B_k A_k x;
    B_v A_v x], the three deltas on their own rows. Other adapters: as they are."""
    if not any(t in spec.target_modules for t in SPLIT_QKV):
        return dict(params), config
    if not all(t in spec.target_modules for t in SPLIT_QKV):
        raise InvalidArgument(f"an HF PEFT export of {[t for t in SPLIT_QKV if t in spec.target_modules]} needs "
                              f"all of {list(SPLIT_QKV)}: PEFT has one LoRA on the fused {FUSED_QKV}",
                              field="lora_config.target_modules")
    out = {k: v for k, v in params.items() if parse_peft_key(k)[1] not in SPLIT_QKV}
    layers = sorted({parse_peft_key(k)[0] for k in params if parse_peft_key(k)[1] in SPLIT_QKV})
    for layer in layers:
        a = [params[peft_key(layer, t, "A")] for t in SPLIT_QKV]
        b = [params[peft_key(layer, t, "B")] for t in SPLIT_QKV]
        prefix = peft_key(layer, "in_proj_q", "A").rsplit(".in_proj_q.", 1)[0]
        out[f"{prefix}.{FUSED_QKV}.lora_A.weight"] = torch.cat([t.detach() for t in a])
        out[f"{prefix}.{FUSED_QKV}.lora_B.weight"] = torch.block_diag(*[t.detach() for t in b])
    config = dict(config)
    config["target_modules"] = [t for t in config["target_modules"] if t not in SPLIT_QKV] + [FUSED_QKV]
    config["rank_pattern"] = {**(config.get("rank_pattern") or {}), FUSED_QKV: 3 * spec.rank}
    config["alpha_pattern"] = {**(config.get("alpha_pattern") or {}), FUSED_QKV: 3 * spec.effective_alpha}
    return out, config


# ------------------------------------------------------------------------------------------------ Tinker layout
#
# What Tinker hands out (`tinker checkpoint download`) and what tinker-cookbook's weights tools (build_hf_model,
# build_lora_adapter) read: adapter_model.safetensors + adapter_config.json ("r", "lora_alpha"), PEFT key names for
# the dense targets, and each MoE layer's routed experts as 3-D tensors under Tinker's own projection names,
# ``...layers.{i}.mlp.experts.w{1,3,2}.lora_{A,B}.weight`` (w1 gate, w3 up, w2 down): A [E, r, in], B [E, out, r],
# with a shared-outer adapter's shared side (the factor on the hidden size: w1/w3 A, w2 B) stored once, shape[0] 1.
# PEFT's fused gate_up LoRA shares one A between gate and up, so w1 and w3 carry the same A.

TINKER_EXPERT_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}
_TINKER_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.layers)\.(?P<layer>\d+)\.mlp\.experts\.(?P<proj>w[123])"
                                r"\.lora_(?P<which>[AB])\.weight\Z")


def tinker_expert_key(layer: int, proj: str, which: str) -> str:
    return f"{PEFT_PREFIX}.{layer}.mlp.experts.{proj}.lora_{which}.weight"


def is_tinker_layout(keys) -> bool:
    """Whether adapter tensor names are Tinker's (3-D routed-expert keys w1/w2/w3)."""
    return any(_TINKER_EXPERT_KEY.match(k) for k in keys)


def _tinker_naming(model_type: str) -> tuple[str, str]:
    """(gate/up order of the fused experts, the attention module's name in Tinker's keys) of a family."""
    family = FAMILIES.get(model_type)
    return (family.expert_gate_up, family.tinker_attention) if family is not None else ("concatenated", "self_attn")


def to_tinker(params: Mapping[str, torch.Tensor], spec: LoraSpec, model_type: str = ""
              ) -> dict[str, torch.Tensor]:
    """The adapter in Tinker's layout (see above): dense keys as they are but for the attention's name where the
    family's Tinker keys differ (gpt-oss: ``.attn``), expert factors as 3-D tensors, the shared side of a
    shared-outer adapter once (`params` compact or expanded), gate and up split by the family's order of the fused
    experts' rows. Contiguous copies (safetensors writes no views). Nemotron-H's non-gated experts have other Tinker
    names and are refused."""
    gate_up, attention = _tinker_naming(model_type)
    params = fold_shared_outer(params, spec)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in params.items():
        layer, module, which = parse_peft_key(key)
        tensor = tensor.detach()
        if module not in ROUTED_EXPERT_TARGETS:
            out[key.replace(".self_attn.", f".{attention}.")] = tensor.contiguous()
            continue
        if module in NONGATED_EXPERT_TARGETS:
            raise InvalidArgument(f"{key}: a Tinker-layout export of Nemotron-H's routed-expert LoRA is not "
                                  "supported (export it as HF PEFT)", field="format")
        if which == "A":  # [r E', in], expert e's rows [e r, (e+1) r)
            stacked = tensor.reshape(-1, spec.rank, tensor.shape[1])
        else:  # [out, r E'], expert e's column j at j E' + e
            experts = tensor.shape[1] // spec.rank
            stacked = tensor.reshape(tensor.shape[0], spec.rank, experts).permute(2, 0, 1)
        if module == "experts.down_proj":
            out[tinker_expert_key(layer, "w2", which)] = stacked.contiguous()
        elif which == "A":
            out[tinker_expert_key(layer, "w1", "A")] = stacked.contiguous()
            out[tinker_expert_key(layer, "w3", "A")] = stacked.contiguous().clone()
        else:
            gate, up = _split_gate_up(stacked, gate_up)
            out[tinker_expert_key(layer, "w1", "B")] = gate.contiguous()
            out[tinker_expert_key(layer, "w3", "B")] = up.contiguous()
    return out


def _split_gate_up(stacked: torch.Tensor, gate_up: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, 2 ffn, r] gate_up B -> (gate [E, ffn, r], up [E, ffn, r]) by the base model's row order."""
    if gate_up == "interleaved":
        return stacked[:, 0::2], stacked[:, 1::2]
    ffn = stacked.shape[1] // 2
    return stacked[:, :ffn], stacked[:, ffn:]


def _join_gate_up(gate: torch.Tensor, up: torch.Tensor, gate_up: str) -> torch.Tensor:
    """The inverse of :func:`_split_gate_up`."""
    if gate_up == "interleaved":
        return torch.stack([gate, up], dim=2).reshape(gate.shape[0], 2 * gate.shape[1], gate.shape[2])
    return torch.cat([gate, up], dim=1)


def tinker_adapter_config(spec: LoraSpec, base_model_name: str, model_type: str = "") -> dict:
    """Tinker's adapter_config.json: what the cookbook's tools read ("r", "lora_alpha"), plus PEFT's usual fields
    and the loraplane LoRA shape, so an import gives back the same adapter."""
    config = {k: v for k, v in peft_adapter_config(spec, base_model_name, model_type).items()
              if k != "target_parameters"}
    config["target_modules"] = [t for t in spec.target_modules if t not in ROUTED_EXPERT_TARGETS]
    if spec.has_experts:
        config["target_modules"] += list(TINKER_EXPERT_PROJ)
    return config


def from_tinker(tensors: Mapping[str, torch.Tensor], config: Mapping) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """A Tinker-layout adapter (tensors and adapter_config.json) -> (params in loraplane's compact form, spec).
    The expert layout is read from the shapes: every expert factor E experts (per-expert), or w1/w3 A and w2 B of
    one (shared-outer). Refused, InvalidArgument naming the key: a key that is neither a decoder projection's PEFT
    key nor a Tinker expert key (Tinker's unembed_tokens among them: loraplane has no LoRA on the LM head), w1 and
    w3 with different A (PEFT's fused gate_up LoRA has one), inconsistent ranks or expert counts."""
    # The family: ours records it; Tinker's own adapters do not, but only its gpt-oss ones name attention ".attn".
    model_type = str(config.get(MODEL_TYPE_KEY) or "")
    if not model_type and any(".attn." in key for key in tensors):
        model_type = "gpt_oss"
    if model_type and model_type not in FAMILIES:
        raise InvalidArgument(f"adapter_config.json {MODEL_TYPE_KEY} {model_type[:40]!r} is not a family loraplane "
                              f"knows ({', '.join(FAMILIES)})", field=f"adapter_config.{MODEL_TYPE_KEY}")
    gate_up, attention = _tinker_naming(model_type)
    if attention != "self_attn":
        tensors = {key.replace(f".{attention}.", ".self_attn."): value for key, value in tensors.items()}
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"adapter_config.json lacks a valid r / lora_alpha: {exc}", field="adapter_config.r"
                              ) from None
    dense: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, str], tuple[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TINKER_EXPERT_KEY.match(key)
        if match and match["prefix"] == PEFT_PREFIX:
            if tensor.dim() != 3:
                raise InvalidArgument(f"{key}: a Tinker expert factor is 3-D [experts, ...], got shape "
                                      f"{tuple(tensor.shape)}", field="tensors")
            experts[(int(match["layer"]), match["proj"], match["which"])] = (key, tensor)
            continue
        try:
            module = parse_peft_key(key)[1]
        except InvalidArgument:
            raise InvalidArgument(f"{key}: not a LoRA key loraplane can train (a decoder projection's "
                                  f"{PEFT_PREFIX}.<i>.<module>.lora_{{A,B}}.weight or a Tinker expert key "
                                  "...mlp.experts.w{1,2,3}.lora_{A,B}.weight)", field="tensors") from None
        if module in ROUTED_EXPERT_TARGETS:
            raise InvalidArgument(f"{key}: HF PEFT's 2-D target_parameters expert key, not Tinker's layout (3-D "
                                  "...mlp.experts.w{1,2,3}.lora_{A,B}.weight)", field="tensors")
        if tensor.dim() != 2:
            raise InvalidArgument(f"{key}: a dense LoRA factor is 2-D, got shape {tuple(tensor.shape)}",
                                  field="tensors")
        dense[key] = tensor
    params = {k: v.to(torch.float32).contiguous() for k, v in dense.items()}
    targets = {parse_peft_key(k)[1] for k in dense}
    shared_sides: set[bool] = set()
    for layer in sorted({layer for layer, _, _ in experts}):
        def get(proj: str, which: str, layer: int = layer) -> tuple[str, torch.Tensor]:
            found = experts.get((layer, proj, which))
            if found is None:
                raise InvalidArgument(f"{tinker_expert_key(layer, proj, which)} is missing (layer {layer} has "
                                      "other Tinker expert factors)", field="tensors")
            return found
        (w1a_key, w1a), (w3a_key, w3a) = get("w1", "A"), get("w3", "A")
        (w1b_key, w1b), (w3b_key, w3b) = get("w1", "B"), get("w3", "B")
        (w2a_key, w2a), (w2b_key, w2b) = get("w2", "A"), get("w2", "B")
        if w1a.shape != w3a.shape or not torch.equal(w1a, w3a):
            raise InvalidArgument(f"{w3a_key} differs from {w1a_key}: loraplane's gate_up LoRA (HF PEFT's fused "
                                  "experts.gate_up_proj) shares one lora_A between gate (w1) and up (w3)",
                                  field="tensors")
        count = max(w1b.shape[0], w2a.shape[0])
        shared = w1a.shape[0] == 1 and w2b.shape[0] == 1 and count > 1
        if count > 1 and (w1a.shape[0] == 1) != (w2b.shape[0] == 1):
            raise InvalidArgument(f"{w1a_key} has {w1a.shape[0]} experts and {w2b_key} {w2b.shape[0]}: shared-outer "
                                  "shares both (1 each), per-expert neither", field="tensors")
        for key, tensor, side in ((w1a_key, w1a, "shared"), (w1b_key, w1b, "own"), (w3b_key, w3b, "own"),
                                  (w2a_key, w2a, "own"), (w2b_key, w2b, "shared")):
            if tensor.shape[1 if key.endswith("lora_A.weight") else 2] != rank:
                raise InvalidArgument(f"{key}: shape {tuple(tensor.shape)} is not of rank {rank} (adapter_config.r)",
                                      field="tensors")
            want = 1 if shared and side == "shared" else count
            if tensor.shape[0] != want:
                raise InvalidArgument(f"{key}: {tensor.shape[0]} experts, expected {want} (per-expert: every "
                                      "factor E; shared-outer: w1/w3 lora_A and w2 lora_B 1, the others E)",
                                      field="tensors")
        if w1b.shape[2] != w1a.shape[1] or w3b.shape[1] != w1b.shape[1]:
            raise InvalidArgument(f"{w3b_key}: shape {tuple(w3b.shape)} does not pair with {w1a_key} "
                                  f"{tuple(w1a.shape)}", field="tensors")
        shared_sides.add(shared)
        gate_up_b = _join_gate_up(w1b, w3b, gate_up)  # [E, 2 ffn, r] in the base model's row order
        params[peft_key(layer, "experts.gate_up_proj", "A")] = w1a.reshape(-1, w1a.shape[2])
        params[peft_key(layer, "experts.gate_up_proj", "B")] = gate_up_b.permute(1, 2, 0).reshape(
            gate_up_b.shape[1], -1)
        params[peft_key(layer, "experts.down_proj", "A")] = w2a.reshape(-1, w2a.shape[2])
        params[peft_key(layer, "experts.down_proj", "B")] = w2b.permute(1, 2, 0).reshape(w2b.shape[1], -1)
        targets |= {"experts.gate_up_proj", "experts.down_proj"}
    if len(shared_sides) > 1:
        raise InvalidArgument("the Tinker adapter's MoE layers mix shared-outer and per-expert factors",
                              field="tensors")
    layout = SHARED_OUTER if shared_sides == {True} else PER_EXPERT
    spec = LoraSpec.create(rank, alpha, sorted(targets), int(config.get("loraplane_seed", 0) or 0),
                           max_rank=1 << 20, field_prefix="adapter_config", expert_layout=layout)
    params = {k: v.to(torch.float32).contiguous() for k, v in params.items()}
    _check_params(params, spec, field="tensors", compact=True)
    return params, spec


def tinker_files(blob: bytes) -> tuple[bytes, bytes]:
    """(adapter_model.safetensors, adapter_config.json) of a weights blob in Tinker's layout: what `tinker
    checkpoint download` hands out. A dense adapter's tensors are its blob's, re-encoded in the blob's dtype."""
    params, spec, base_name = parse_adapter(blob)
    stored = {_TORCH_DTYPES.get(code) for code in adapter_header(blob)[2].values()}
    dtype = stored.pop() if len(stored) == 1 else torch.float32
    model_type = str(json.loads(blob_metadata(blob)[ADAPTER_CONFIG_KEY]).get(MODEL_TYPE_KEY) or "")
    out = to_tinker(params, spec, model_type)
    weights = SafetensorsWriter(out, {FORMAT_KEY: "pt"}, dtype if dtype in _SAFETENSORS_DTYPES else torch.float32)
    config = json.dumps(tinker_adapter_config(spec, base_name, model_type), indent=2, sort_keys=True).encode()
    return weights.to_bytes(), config


def materialize_tinker_dir(blob: bytes, directory: str | Path) -> Path:
    """adapter_model.safetensors + adapter_config.json in Tinker's layout (see :func:`tinker_files`)."""
    weights, config = tinker_files(blob)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in (("adapter_model.safetensors", weights), ("adapter_config.json", config)):
        temporary = directory / f".{name}.tmp"
        temporary.write_bytes(data)
        temporary.replace(directory / name)
    return directory


def read_tinker_dir(directory: str | Path) -> tuple[dict[str, torch.Tensor], LoraSpec, str]:
    """(params, spec, base model name) of a Tinker-layout adapter directory (adapter_model.safetensors +
    adapter_config.json), as :func:`from_tinker` reads it."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
        blob = (directory / "adapter_model.safetensors").read_bytes()
    except FileNotFoundError as exc:
        raise InvalidArgument(f"{exc.filename}: missing (a Tinker adapter directory holds adapter_model.safetensors "
                              "and adapter_config.json)", field="path") from None
    except ValueError as exc:
        raise InvalidArgument(f"{directory / 'adapter_config.json'} is not JSON: {exc}", field="path") from None
    if not isinstance(config, dict):
        raise InvalidArgument("adapter_config.json is not a JSON object", field="path")
    tensors, _ = _read(blob, "adapter_model.safetensors")
    params, spec = from_tinker(tensors, config)
    return params, spec, str(config.get("base_model_name_or_path") or "")


@dataclass
class TrainingState:
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int
    spec: LoraSpec
    base_model_name: str


def serialize_training_state(state: TrainingState) -> bytes:
    # The trainer's own tensors: a shared-outer adapter's shared factors once per layer (compact).
    _check_params(state.params, state.spec, field="params", compact=True)
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
        "expert_layout": state.spec.expert_layout,
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
                               max_rank=1 << 20, field_prefix="training_state",
                               expert_layout=str(info.get("expert_layout") or PER_EXPERT))
        step = int(info["step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLoss(f"training-state metadata is malformed: {exc}", field="blob") from exc
    if step < 0 or not math.isfinite(step):
        raise DataLoss("training-state step is negative", field="blob")
    params = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    _check_params(params, spec, field="blob", compact=True)
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
