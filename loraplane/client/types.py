"""Data types of the client SDK. Names and defaults mirror Tinker's where they mean the same thing.

Per-token inputs accept Python lists, numpy arrays, torch tensors or `TensorData`; they are converted once, when a
call is made, into the packed `repeated int32` / `repeated float` fields of the protos.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from loraplane.registry_client import StoredVersion, VersionKind, expert_layout_name, stored_version, weights_dtype_name
from loraplane.v1 import common_pb2, sampler_pb2, trainer_pb2

# loss_fn_inputs keys and the Datum field each one fills.
LOSS_FN_INPUT_FIELDS = {
    "target_tokens": "target_tokens",
    "weights": "weights",
    "logprobs": "logprobs",
    "advantages": "advantages",
}
_INT_INPUTS = {"target_tokens"}
# The Tinker cookbook keeps a client-side "mask" next to the real inputs and strips it before sending; do the same
# so cookbook-style code works unchanged.
_CLIENT_ONLY_INPUTS = {"mask"}


def _is_torch(value: Any) -> bool:
    return type(value).__module__.split(".")[0] == "torch"


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, TensorData):
        # The values as given (not cast to the declared dtype: whole-number checks see what the caller sent).
        array = np.asarray(value.data)
        return array.reshape(value.shape) if value.shape else array
    if _is_torch(value):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def to_flat_list(value: Any, *, dtype: Literal["int", "float"], name: str, rows: bool = False) -> list:
    """A 1-D list of Python ints or floats from a list, tuple, numpy array, torch tensor or TensorData; with
    `rows`, a 2-D (N, K) one too, flattened row-major."""
    array = _as_array(value)
    if rows and array.ndim == 2:
        array = array.reshape(-1)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one entry per position), got shape {tuple(array.shape)}")
    if dtype == "int":
        whole = np.issubdtype(array.dtype, np.integer) or (
            np.issubdtype(array.dtype, np.floating) and bool(np.all(np.mod(array, 1) == 0)))
        if array.size and not whole:
            raise ValueError(f"{name} must hold integer token ids, got dtype {array.dtype}")
        return [int(x) for x in array.tolist()]
    if array.size and not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{name} must hold numbers, got dtype {array.dtype}")
    return [float(x) for x in array.tolist()]


@dataclass
class TensorData:
    """A flat tensor: `data` plus its dtype ("int64" | "float32") and shape, like Tinker's TensorData."""

    data: list
    dtype: str = "float32"
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        return cls(data=array.reshape(-1).tolist(), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=np.int64 if self.dtype == "int64" else np.float32)
        return array.reshape(self.shape) if self.shape else array

    def to_torch(self):
        import torch

        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        return list(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        return iter(self.data)

    def __getitem__(self, index):
        return self.data[index]


@dataclass
class ModelInput:
    """The tokens a model reads. Tinker's ModelInput holds chunks; only encoded text exists here, so it is one
    token list."""

    tokens: list[int] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Any) -> ModelInput:
        return cls(tokens=to_flat_list(tokens, dtype="int", name="model_input"))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls()

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def append_int(self, token: int) -> ModelInput:
        return ModelInput(tokens=[*self.tokens, int(token)])

    def append(self, tokens: Iterable[int]) -> ModelInput:
        return ModelInput(tokens=[*self.tokens, *(int(t) for t in tokens)])

    def __len__(self) -> int:
        return len(self.tokens)


def as_model_input(value: Any) -> ModelInput:
    return value if isinstance(value, ModelInput) else ModelInput.from_ints(value)


@dataclass
class Datum:
    """One position-aligned training example: position i of `model_input` predicts `target_tokens[i]`.

    `loss_fn_inputs` keys: target_tokens (required), weights (cross_entropy), logprobs + advantages (RL losses).
    cross_entropy also takes soft targets: (N, K) target_tokens with (N, K) weights (or none), K candidate tokens
    per position (a teacher's top-K for distillation); its logprobs output is then (N, K).
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.model_input = as_model_input(self.model_input)

    def to_proto(self) -> trainer_pb2.Datum:
        unknown = set(self.loss_fn_inputs) - set(LOSS_FN_INPUT_FIELDS) - _CLIENT_ONLY_INPUTS
        if unknown:
            raise ValueError(f"unknown loss_fn_inputs keys {sorted(unknown)}; allowed: {sorted(LOSS_FN_INPUT_FIELDS)}")
        if "target_tokens" not in self.loss_fn_inputs:
            raise ValueError("loss_fn_inputs must contain target_tokens")
        length = self.model_input.length
        proto = trainer_pb2.Datum(input_tokens=self.model_input.tokens)
        shape = _as_array(self.loss_fn_inputs["target_tokens"]).shape
        if len(shape) == 2:
            proto.targets_per_position = shape[1]
        for key, proto_field in LOSS_FN_INPUT_FIELDS.items():
            if key not in self.loss_fn_inputs or self.loss_fn_inputs[key] is None:
                continue
            soft = len(shape) == 2 and key in ("target_tokens", "weights")
            if soft and (got := _as_array(self.loss_fn_inputs[key]).shape) != shape:
                raise ValueError(f"loss_fn_inputs[{key!r}] has shape {got} "
                                 f"but target_tokens has {shape}; (N, K) weights go with (N, K) target_tokens")
            values = to_flat_list(self.loss_fn_inputs[key], dtype="int" if key in _INT_INPUTS else "float",
                                  name=f"loss_fn_inputs[{key!r}]", rows=soft)
            expected = length * (shape[1] if soft else 1)
            if len(values) != expected:
                raise ValueError(f"loss_fn_inputs[{key!r}] has {len(values)} entries but model_input has {length} "
                                 f"tokens; every per-token input must have one entry per position")
            getattr(proto, proto_field).extend(values)
        return proto


def datum_from_sequence(tokens: Sequence[int], weights: Sequence[float] | None = None, **extra: Any) -> Datum:
    """Shifts a full token sequence into Tinker alignment: input = seq[:-1], targets = seq[1:], weights = w[1:]."""
    tokens = to_flat_list(tokens, dtype="int", name="tokens")
    if len(tokens) < 2:
        raise ValueError("a training sequence needs at least 2 tokens")
    inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
    if weights is not None:
        inputs["weights"] = to_flat_list(weights, dtype="float", name="weights")[1:]
    for key, value in extra.items():
        inputs[key] = to_flat_list(value, dtype="float", name=key)[1:]
    return Datum(model_input=ModelInput(tokens[:-1]), loss_fn_inputs=inputs)


def as_datum(value: Any) -> Datum:
    if isinstance(value, Datum):
        return value
    if isinstance(value, Mapping):
        return Datum(model_input=value["model_input"], loss_fn_inputs=dict(value.get("loss_fn_inputs", {})))
    raise TypeError(f"expected a Datum, got {type(value).__name__}")


@dataclass
class AdamParams:
    """torch.optim.AdamW hyper-parameters plus global-norm clipping (0 = off). Tinker's defaults."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def to_proto(self) -> trainer_pb2.AdamParams:
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"AdamParams.{name} must be finite, got {getattr(self, name)}")
        return trainer_pb2.AdamParams(learning_rate=self.learning_rate, beta1=self.beta1, beta2=self.beta2,
                                      eps=self.eps, weight_decay=self.weight_decay,
                                      grad_clip_norm=self.grad_clip_norm)


@dataclass
class SamplingParams:
    """`stop` may be a string, a list of strings or a list of token ids (Tinker's union)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | Sequence[str] | Sequence[int] | None = None
    seed: int | None = None

    def to_proto(self) -> common_pb2.SamplingParams:
        proto = common_pb2.SamplingParams(max_tokens=self.max_tokens or 0, temperature=self.temperature,
                                          top_p=self.top_p, top_k=self.top_k)
        if self.seed is not None:
            proto.seed = self.seed
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for stop in stops:
            if isinstance(stop, str):
                proto.stop_strings.append(stop)
            else:
                proto.stop_token_ids.append(int(stop))
        return proto


StopReason = Literal["length", "stop"]
_STOP_REASONS: dict[int, StopReason] = {sampler_pb2.FINISH_REASON_LENGTH: "length",
                                        sampler_pb2.FINISH_REASON_STOP: "stop"}


@dataclass
class ForwardBackwardOutput:
    """Per-datum outputs (`loss_fn_outputs[i]["logprobs"]`, `["elementwise_loss"]`) and merged metrics."""

    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]
    loss_fn_output_type: str = ""

    @property
    def loss(self) -> float:
        return self.metrics.get("loss:sum", float("nan"))


def outputs_from_proto(outputs: Iterable[trainer_pb2.DatumOutput],
                       sent: Sequence[trainer_pb2.Datum] | None = None) -> list[dict[str, TensorData]]:
    """`sent`: the datums of the request, so (N, K) target_tokens get (N, K) logprobs back even for K = 1."""
    out = []
    for i, o in enumerate(outputs):
        n = len(o.elementwise_loss)
        k = sent[i].targets_per_position if sent is not None else (
            o.targets_per_position if o.targets_per_position > 1 else 0)
        out.append({"logprobs": TensorData(list(o.logprobs), "float32", [n, k] if k else [len(o.logprobs)]),
                    "elementwise_loss": TensorData(list(o.elementwise_loss), "float32", [n])})
    return out


@dataclass
class OptimStepResponse:
    step: int
    grad_norm: float
    skipped: bool
    metrics: dict[str, float]


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: StopReason

    @classmethod
    def from_proto(cls, proto: sampler_pb2.SampledSequence) -> SampledSequence:
        return cls(tokens=list(proto.tokens), logprobs=list(proto.logprobs) if proto.logprobs else None,
                   stop_reason=_STOP_REASONS.get(proto.finish_reason, "length"))


def _prompt_logprobs(values: Iterable[float]) -> list[float | None]:
    # The protocol sends NaN where there is no context (entry 0); Tinker's SDK exposes that as None.
    return [None if math.isnan(v) else float(v) for v in values]


# An empty top-k cell (position 0, positions not scored), as the Tinker SDK writes it.
TOPK_EMPTY_LOGPROB = -99999.0


@dataclass(frozen=True)
class TopkLogprobs:
    """The k most likely tokens at each prompt position, as Tinker's SDK returns them: two dense (length, k)
    matrices, most likely first; empty cells are token 0 with logprob -99999."""

    token_ids: np.ndarray  # int32 (length, k)
    logprobs: np.ndarray  # float32 (length, k)

    def to_lists(self) -> list[list[tuple[int, float]] | None]:
        """Per position, its (token_id, logprob) pairs without the empty cells; None for an empty row."""
        rows: list[list[tuple[int, float]] | None] = []
        for ids, values in zip(self.token_ids.tolist(), self.logprobs.tolist()):
            pairs = [(int(t), float(v)) for t, v in zip(ids, values) if not (t == 0 and v == TOPK_EMPTY_LOGPROB)]
            rows.append(pairs or None)
        return rows


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
    # The adapter version that served the request; 0 = the base model.
    served_version: int = 0
    # Set when the request asked for topk_prompt_logprobs.
    topk_prompt_logprobs_np: TopkLogprobs | None = None

    @property
    def topk_prompt_logprobs(self) -> list[list[tuple[int, float]] | None] | None:
        return None if self.topk_prompt_logprobs_np is None else self.topk_prompt_logprobs_np.to_lists()

    @classmethod
    def from_proto(cls, proto: sampler_pb2.SampleResponse) -> SampleResponse:
        topk = None
        if proto.topk_prompt_k:
            k = proto.topk_prompt_k
            topk = TopkLogprobs(np.asarray(proto.topk_prompt_token_ids, dtype=np.int32).reshape(-1, k),
                                np.asarray(proto.topk_prompt_logprobs, dtype=np.float32).reshape(-1, k))
        return cls(sequences=[SampledSequence.from_proto(s) for s in proto.sequences],
                   prompt_logprobs=_prompt_logprobs(proto.prompt_logprobs) if len(proto.prompt_logprobs) else None,
                   served_version=proto.served_version, topk_prompt_logprobs_np=topk)


@dataclass
class VersionInfo:
    """A published version of an adapter (weights or training state)."""

    adapter: str
    version: int
    kind: Literal["weights", "training_state", "unspecified"]
    sha256: str
    size_bytes: int
    training_step: int
    metadata: dict[str, str]
    aliases: list[str]
    create_time: float | None

    @property
    def path(self) -> str:
        return format_path(self.adapter, self.version)

    @classmethod
    def from_stored(cls, stored: StoredVersion) -> VersionInfo:
        kinds = {VersionKind.WEIGHTS: "weights", VersionKind.TRAINING_STATE: "training_state"}
        return cls(adapter=stored.adapter, version=stored.version, kind=kinds.get(stored.kind, "unspecified"),
                   sha256=stored.sha256, size_bytes=stored.size_bytes, training_step=stored.training_step,
                   metadata=dict(stored.metadata), aliases=list(stored.aliases), create_time=stored.create_time)

    @classmethod
    def from_proto(cls, proto: common_pb2.AdapterVersion) -> VersionInfo:
        return cls.from_stored(stored_version(proto))


@dataclass
class SaveStateResponse:
    path: str
    version: VersionInfo


@dataclass
class LoadStateResponse:
    path: str
    model_id: str
    step: int


@dataclass
class TrainerAdapterInfo:
    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    seed: int
    base_model: str
    step: int
    last_seq_id: int
    resident: bool
    parameter_count: int
    # "float32" or "bfloat16": the dtype of the adapter's published weights versions.
    weights_dtype: str = "float32"
    # A MoE adapter's "per_expert" or "shared_outer"; "" for a dense one.
    expert_layout: str = ""

    @classmethod
    def from_proto(cls, proto: trainer_pb2.TrainerAdapter) -> TrainerAdapterInfo:
        lora = proto.lora_config
        return cls(name=proto.name, rank=lora.rank, alpha=lora.alpha, target_modules=list(lora.target_modules),
                   seed=lora.seed, base_model=proto.base_model, step=proto.step, last_seq_id=proto.last_seq_id,
                   resident=proto.resident, parameter_count=proto.parameter_count,
                   weights_dtype=weights_dtype_name(lora.weights_dtype),
                   expert_layout=expert_layout_name(lora.expert_layout))


# ---- adapter paths -------------------------------------------------------------------------------------------

PATH_SCHEME = "loraplane://"


def format_path(adapter: str, version: int = 0, alias: str = "") -> str:
    if version:
        return f"{PATH_SCHEME}{adapter}@v{version}"
    if alias:
        return f"{PATH_SCHEME}{adapter}@{alias}"
    return f"{PATH_SCHEME}{adapter}"


def parse_path(path: str) -> tuple[str, int, str]:
    """`loraplane://name@v3`, `name@v3`, `name@prod` (alias) or `name` (latest) -> (name, version, alias)."""
    text = path.removeprefix(PATH_SCHEME)
    if not text:
        raise ValueError(f"empty adapter path {path!r}")
    name, sep, selector = text.rpartition("@")
    if not sep:
        return text, 0, ""
    if not name:
        raise ValueError(f"adapter path {path!r} has no adapter name before '@'")
    if selector.startswith("v") and selector[1:].isdigit():
        return name, int(selector[1:]), ""
    if selector.isdigit():
        return name, int(selector), ""
    return name, 0, selector


def adapter_ref(name: str, version: int = 0, alias: str = "") -> common_pb2.AdapterRef:
    ref = common_pb2.AdapterRef(name=name)
    if version:
        ref.version = version
    elif alias:
        ref.alias = alias
    return ref
