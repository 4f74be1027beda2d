"""The encodings the Tinker SDK uses on the wire: the protobuf forward_backward request (optionally zstd-compressed)
and the protobuf forward_backward / sample results (section 5 of the wire reference). Raw arrays are little-endian
int32 tokens, float32 values, int64 indices and offsets."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from gateway_svc.stability import PROMPT, SAMPLED, Span
from gateway_svc.types import DatumIn, FwdBwdResult, SampleResult
from gateway_svc.wire import tinker_wire_pb2 as wire
from loraplane import errors

PROTO = "application/x-protobuf"
_NP = {wire.DTYPE_FLOAT32: np.float32, wire.DTYPE_INT64: np.int64, wire.DTYPE_INT32: np.int32}
# Inputs our losses read; anything else the SDK may send is refused by name.
_KNOWN_INPUTS = {"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"}
MAX_BODY_BYTES = 256 * 1024 * 1024
INT32_MAX = 2**31 - 1


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    data: list[DatumIn]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    # A problem found in the payload: the request is still sequenced (the trainer consumes its seq_id) but fails.
    problem: str = ""
    problem_field: str | None = None


def decompress(body: bytes, encoding: str) -> bytes:
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "zstd":
        import zstandard

        try:
            return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY_BYTES)
        except zstandard.ZstdError as exc:
            raise errors.InvalidArgument(f"body: not a valid zstd frame ({exc})", field="body") from None
    if encoding == "gzip":
        import gzip

        try:
            return gzip.decompress(body)
        except OSError as exc:
            raise errors.InvalidArgument(f"body: not valid gzip ({exc})", field="body") from None
    raise errors.InvalidArgument(f"Content-Encoding {encoding!r} is not supported (zstd, gzip)",
                                 field="Content-Encoding")


def _tensor(t: wire.Tensor, name: str) -> np.ndarray:
    """The tensor as the SDK's TensorData holds it: 1-D (N,), or 2-D (N, K) soft targets, dense or CSR."""
    dtype = _NP.get(t.dtype)
    if dtype is None:
        raise errors.InvalidArgument(f"loss_fn_inputs[{name}]: dtype {t.dtype} is not supported", field=name)
    shape = [int(s) for s in t.shape]
    if len(shape) > 2 or any(s < 0 for s in shape):
        raise errors.InvalidArgument(
            f"loss_fn_inputs[{name}]: shape {shape} is not supported; (N,) or (N, K) tensors", field=name)
    try:
        if t.WhichOneof("data") == "sparse_csr":
            return _csr_dense(t.sparse_csr, dtype, shape, name)
        array = np.frombuffer(t.dense, dtype=dtype)
    except ValueError:  # a byte count that is no whole number of elements
        raise errors.InvalidArgument(f"loss_fn_inputs[{name}]: data is not a whole number of {np.dtype(dtype)} "
                                     "values", field=name) from None
    if len(shape) == 2:
        if array.size != shape[0] * shape[1]:
            raise errors.InvalidArgument(
                f"loss_fn_inputs[{name}]: {array.size} values for shape {shape}", field=name)
        return array.reshape(shape)
    return array


def _csr_dense(csr: wire.SparseCsr, dtype, shape: list[int], name: str) -> np.ndarray:
    """TensorData.from_torch_sparse's form (pad value 0: unlisted slots are token 0 / weight 0), checked as
    torch.sparse_csr_tensor checks its invariants, then made dense."""
    if len(shape) != 2:
        raise errors.InvalidArgument(f"loss_fn_inputs[{name}]: a sparse (CSR) tensor needs a 2-D shape, got "
                                     f"{shape}", field=name)
    rows, cols = shape
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    col = np.frombuffer(csr.col_indices, dtype="<i8")
    if (len(crow) != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != len(col)
            or len(col) != len(values) or (len(col) and (col.min() < 0 or col.max() >= cols))):
        raise errors.InvalidArgument(f"loss_fn_inputs[{name}]: sparse (CSR) indices do not describe a {shape} "
                                     "tensor", field=name)
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def tokens_of_chunks(chunks) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise errors.InvalidArgument(f"model_input.chunks[{i}]: {kind} chunks are not supported (text only)",
                                         field="model_input")
        try:
            values = np.frombuffer(chunk.encoded_text.tokens, dtype="<i4")
        except ValueError:
            raise errors.InvalidArgument(f"model_input.chunks[{i}].tokens: not a whole number of int32 values",
                                         field="model_input") from None
        _token_ids(values, f"model_input.chunks[{i}].tokens")
        tokens.extend(values.tolist())
    return tokens


def _parsed_forward_backward(body: bytes) -> wire.ForwardBackwardRequest:
    msg = wire.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise errors.InvalidArgument("body: not a ForwardBackwardRequest protobuf", field="body") from None
    return msg


def forward_backward_target(body: bytes) -> tuple[str, int]:
    """The model_id and seq_id of a ForwardBackwardRequest: all that sequencing it needs. Its datums are converted
    once, when the future runs (a bad datum fails the future there, as decode_forward_backward reports it)."""
    msg = _parsed_forward_backward(body)
    return msg.model_id, msg.seq_id


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    msg = _parsed_forward_backward(body)
    request = FwdBwdRequest(model_id=msg.model_id, seq_id=msg.seq_id, data=[], loss_fn=msg.loss_fn,
                            loss_fn_config={}, forward_only=msg.forward_only)
    try:
        # The SDK writes every option to v2 (numbers also to the legacy map, for older servers): v2 wins.
        config = {k: float(v) for k, v in msg.loss_fn_config.items()}
        for key, value in msg.loss_fn_config_v2.items():
            if value.WhichOneof("value") == "text":
                raise errors.InvalidArgument(f"loss_fn_config.{key}: text values are not supported (numbers only)",
                                             field=f"loss_fn_config.{key}")
            if value.WhichOneof("value") == "number":
                config[key] = float(value.number)
        request.loss_fn_config = config
        for i, d in enumerate(msg.data):
            unknown = sorted(set(d.loss_fn_inputs) - _KNOWN_INPUTS)
            if unknown:
                raise errors.InvalidArgument(f"data[{i}].loss_fn_inputs: {unknown} not supported "
                                             f"(supported: {sorted(_KNOWN_INPUTS)})", field="loss_fn_inputs")
            inputs = {k: _tensor(t, k) for k, t in d.loss_fn_inputs.items()}
            if "target_tokens" not in inputs:
                raise errors.InvalidArgument(f"data[{i}].loss_fn_inputs: target_tokens is required",
                                             field="target_tokens")
            per_position = _soft_targets(i, inputs, msg.loss_fn, len(d.loss_fn_input_spans) > 0)
            _token_ids(inputs["target_tokens"], f"data[{i}].loss_fn_inputs[target_tokens]")
            floats = {k: v.astype(np.float32).reshape(-1).tolist() for k, v in inputs.items() if k != "target_tokens"}
            request.data.append(DatumIn(
                input_tokens=tokens_of_chunks(d.model_input),
                target_tokens=inputs["target_tokens"].astype(np.int64).reshape(-1).tolist(),
                targets_per_position=per_position,
                weights=floats.get("weights"), logprobs=floats.get("logprobs"), advantages=floats.get("advantages"),
                sequence_ratio_mask=floats.get("sequence_ratio_mask"),
                input_spans=_spans(d.model_input_spans) if len(d.model_input_spans) else None,
                target_spans=_spans(d.loss_fn_input_spans) if len(d.loss_fn_input_spans) else None))
    except errors.InvalidArgument as exc:
        request.data, request.problem, request.problem_field = [], exc.message, exc.field
    return request


def _token_ids(values: np.ndarray, field: str) -> None:
    """Token ids travel to the trainer as int32 (the SDK sends targets as int64): one outside [0, 2^31) is the
    caller's error here, not a conversion failure later."""
    if values.size and (values.min() < 0 or values.max() > INT32_MAX):
        bad = int(values[(values < 0) | (values > INT32_MAX)].reshape(-1)[0])
        raise errors.InvalidArgument(f"{field}: token id {bad} is outside [0, {INT32_MAX}]", field=field)


def _soft_targets(i: int, inputs: dict[str, np.ndarray], loss_fn: str, spans: bool) -> int:
    """K of (N, K) target_tokens (0 for 1-D ones); the other inputs must match them."""
    targets = inputs["target_tokens"]
    for name, value in inputs.items():
        if name == "target_tokens" or value.ndim == 1:
            continue
        if name != "weights":
            raise errors.InvalidArgument(f"data[{i}].loss_fn_inputs[{name}]: shape {list(value.shape)}; only "
                                         "target_tokens and weights may be 2-D", field=name)
        if value.shape != targets.shape:
            raise errors.InvalidArgument(f"data[{i}].loss_fn_inputs[weights]: shape {list(value.shape)} needs "
                                         f"target_tokens of the same shape, got {list(targets.shape)}",
                                         field="weights")
    if targets.ndim == 1:
        return 0
    if (loss_fn or "cross_entropy") != "cross_entropy":
        raise errors.InvalidArgument(f"data[{i}].loss_fn_inputs[target_tokens]: shape {list(targets.shape)}: "
                                     f"(N, K) soft targets are only read by cross_entropy, not {loss_fn}",
                                     field="target_tokens")
    if "weights" in inputs and inputs["weights"].ndim != 2:
        raise errors.InvalidArgument(f"data[{i}].loss_fn_inputs[weights]: (N, K) target_tokens need (N, K) weights "
                                     f"(or none), got shape {list(inputs['weights'].shape)}", field="weights")
    if targets.shape[1] < 1:
        raise errors.InvalidArgument(f"data[{i}].loss_fn_inputs[target_tokens]: shape {list(targets.shape)} has no "
                                     "targets per position", field="target_tokens")
    if spans:
        raise errors.InvalidArgument(f"data[{i}]: provenance spans with (N, K) target_tokens are not supported",
                                     field="loss_fn_input_spans")
    return int(targets.shape[1])


def _spans(spans) -> list[Span]:
    out = []
    for span in spans:
        kind = span.WhichOneof("span")
        arm = span.prompt_tokens if kind == "prompt_tokens" else span.sampled_tokens
        out.append(Span(PROMPT if kind == "prompt_tokens" else SAMPLED, arm.sequence_id, int(arm.offset),
                        int(arm.length)))
    return out


def _batched(arrays: list[list[float]], dtype=np.float32, trailing: tuple[int, ...] = ()) -> wire.BatchedTensor:
    flat = [np.asarray(a, dtype=dtype) for a in arrays]
    sizes = np.array([0] + [a.nbytes for a in flat], dtype=np.int64)
    data = np.concatenate(flat) if flat else np.zeros(0, dtype=dtype)
    return wire.BatchedTensor(data=data.astype("<f4").tobytes(), offsets=np.cumsum(sizes).astype("<i8").tobytes(),
                              dtype=wire.DTYPE_FLOAT32, trailing_shape=trailing)


def encode_forward_backward(result: FwdBwdResult, targets_per_position: list[int] | None = None) -> bytes:
    """`targets_per_position`: per datum, K of its (N, K) target_tokens (0 for 1-D ones): its logprobs go back
    (N, K). One BatchedTensor has one trailing shape, so each run of datums of one K is an ArrayRecord of its own
    (the SDK concatenates them, as it does for its own ragged outputs)."""
    shapes = targets_per_position or [0] * len(result.logprobs)
    runs = [(k, len(list(group))) for k, group in itertools.groupby(shapes)] or [(0, 0)]
    records, start = [], 0
    for k, count in runs:
        end = start + count
        record = wire.ArrayRecord(type_tag="ArrayRecord", num_datums=count)
        record.fields["logprobs"].CopyFrom(_batched(result.logprobs[start:end], trailing=(k,) if k else ()))
        record.fields["elementwise_loss"].CopyFrom(_batched(result.elementwise_loss[start:end]))
        records.append(record)
        start = end
    # The SDK merges chunk metrics by splitting each key at its one ':' (a bare key crashes it).
    metrics = {k if k.count(":") == 1 else f"{k.replace(':', '_')}:mean": float(v) for k, v in result.metrics.items()}
    return wire.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=records,
                                      metrics=metrics).SerializeToString()


def encode_sample(result: SampleResult) -> bytes:
    out = wire.SampleResponse()
    for seq in result.sequences:
        out.sequences.add(
            stop_reason=wire.STOP_REASON_STOP if seq.finish_reason == "stop" else wire.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes())
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(
            [math.nan if v is None else v for v in result.prompt_logprobs], dtype="<f4").tobytes()
    if result.target_prompt is not None:
        t = result.target_prompt
        tensor = wire.Tensor(dtype=wire.DTYPE_FLOAT32, shape=t["shape"])
        values = np.asarray(t["values"], dtype="<f4").tobytes()
        if t.get("crow") is not None:
            tensor.sparse_csr.CopyFrom(wire.SparseCsr(values=values,
                                                      crow_indices=np.asarray(t["crow"], dtype="<i8").tobytes(),
                                                      col_indices=np.asarray(t["col"], dtype="<i8").tobytes()))
        else:
            tensor.dense = values
        out.target_prompt_logprobs.CopyFrom(tensor)
    if result.topk_k:
        # The SDK reads an (length, k) row-major matrix, the sampler's own layout.
        out.topk_prompt_logprobs.CopyFrom(wire.TopkLogprobs(
            token_ids=np.asarray(result.topk_token_ids, dtype="<i4").tobytes(),
            logprobs=np.asarray(result.topk_logprobs, dtype="<f4").tobytes(), k=result.topk_k,
            length=len(result.topk_token_ids) // result.topk_k))
    return out.SerializeToString()
