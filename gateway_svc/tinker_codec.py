"""The encodings the Tinker SDK uses on the wire: the protobuf forward_backward request (optionally zstd-compressed)
and the protobuf forward_backward / sample results (section 5 of the wire reference). Raw arrays are little-endian
int32 tokens, float32 values, int64 indices and offsets."""

from __future__ import annotations

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
    dtype = _NP.get(t.dtype)
    if dtype is None:
        raise errors.InvalidArgument(f"loss_fn_inputs[{name}]: dtype {t.dtype} is not supported", field=name)
    if t.WhichOneof("data") != "dense":
        raise errors.InvalidArgument(
            f"loss_fn_inputs[{name}]: sparse (2-D soft-target) tensors are not supported; send 1-D dense tensors",
            field=name)
    array = np.frombuffer(t.dense, dtype=dtype)
    if len(t.shape) > 1:
        raise errors.InvalidArgument(
            f"loss_fn_inputs[{name}]: shape {list(t.shape)} is not supported; only 1-D (N,) tensors", field=name)
    return array


def tokens_of_chunks(chunks) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise errors.InvalidArgument(f"model_input.chunks[{i}]: {kind} chunks are not supported (text only)",
                                         field="model_input")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    return tokens


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    msg = wire.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise errors.InvalidArgument("body: not a ForwardBackwardRequest protobuf", field="body") from None
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
            floats = {k: v.astype(np.float32).tolist() for k, v in inputs.items() if k != "target_tokens"}
            request.data.append(DatumIn(
                input_tokens=tokens_of_chunks(d.model_input),
                target_tokens=inputs["target_tokens"].astype(np.int64).tolist(),
                weights=floats.get("weights"), logprobs=floats.get("logprobs"), advantages=floats.get("advantages"),
                sequence_ratio_mask=floats.get("sequence_ratio_mask"),
                input_spans=_spans(d.model_input_spans) if len(d.model_input_spans) else None,
                target_spans=_spans(d.loss_fn_input_spans) if len(d.loss_fn_input_spans) else None))
    except errors.InvalidArgument as exc:
        request.data, request.problem = [], exc.message
    return request


def _spans(spans) -> list[Span]:
    out = []
    for span in spans:
        kind = span.WhichOneof("span")
        arm = span.prompt_tokens if kind == "prompt_tokens" else span.sampled_tokens
        out.append(Span(PROMPT if kind == "prompt_tokens" else SAMPLED, arm.sequence_id, int(arm.offset),
                        int(arm.length)))
    return out


def _batched(arrays: list[list[float]], dtype=np.float32) -> wire.BatchedTensor:
    flat = [np.asarray(a, dtype=dtype) for a in arrays]
    sizes = np.array([0] + [a.nbytes for a in flat], dtype=np.int64)
    data = np.concatenate(flat) if flat else np.zeros(0, dtype=dtype)
    return wire.BatchedTensor(data=data.astype("<f4").tobytes(), offsets=np.cumsum(sizes).astype("<i8").tobytes(),
                              dtype=wire.DTYPE_FLOAT32)


def encode_forward_backward(result: FwdBwdResult) -> bytes:
    record = wire.ArrayRecord(type_tag="ArrayRecord", num_datums=len(result.logprobs))
    record.fields["logprobs"].CopyFrom(_batched(result.logprobs))
    record.fields["elementwise_loss"].CopyFrom(_batched(result.elementwise_loss))
    # The SDK merges chunk metrics by splitting each key at its one ':' (a bare key crashes it).
    metrics = {k if k.count(":") == 1 else f"{k.replace(':', '_')}:mean": float(v) for k, v in result.metrics.items()}
    return wire.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record],
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
