"""Recorded sampling (Tinker's `record_stability_info`) and the provenance spans that name it.

A sample requested with `record_stability_info=True` records, per returned sequence, what stable_reinforce trains
on: the sampled tokens, the sampler's logprob of each (the importance weights' denominator: the loss must use these,
never the client's copy), the exact adapter version that served them, the engine and the prompt length. Records
live in the caller's tenant's namespace of the gateway's Redis (Store), under the sequence's `sequence_id`, for
`ttl` after their last use, and name the Tinker session that sampled them: a span that names a sequence of another
session, of another tenant, an evicted, expired or never-issued one gets one and the same answer.

`forward_backward` datums carry provenance: `model_input_spans` tile the input tokens and `loss_fn_input_spans` the
targets, each run either prompt positions of a sampling request or sampled positions of a sequence. For
stable_reinforce the gateway checks every run against its record (bounds; sampled tokens equal the recorded ones)
and rewrites the datum: sampled runs get the recorded logprobs and `sequence_ratio_mask = k` (the datum's k-th
sampled run), prompt runs logprob 0 and mask 0, and an advantage outside the sampled runs is refused (the cookbook
says Tinker refuses it). Plain domain code: no HTTP, no Redis, no protobuf."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from gateway_svc.types import DatumIn, SampleResult
from loraplane import errors

PROMPT, SAMPLED = "prompt", "sampled"


@dataclass(frozen=True)
class Span:
    kind: str  # PROMPT | SAMPLED
    sequence_id: str
    offset: int
    length: int


@dataclass
class SequenceRecord:
    session_id: str
    adapter: str
    version: int
    engine: str
    prompt_length: int
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, exactly as the sampler returned them

    def encode(self) -> bytes:
        return json.dumps({
            "s": self.session_id, "a": self.adapter, "v": self.version, "e": self.engine, "p": self.prompt_length,
            "t": base64.b64encode(self.tokens.astype("<i4").tobytes()).decode(),
            "l": base64.b64encode(self.logprobs.astype("<f4").tobytes()).decode()}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> SequenceRecord:
        d = json.loads(raw)
        return cls(session_id=d["s"], adapter=d["a"], version=int(d["v"]), engine=d["e"], prompt_length=int(d["p"]),
                   tokens=np.frombuffer(base64.b64decode(d["t"]), dtype="<i4"),
                   logprobs=np.frombuffer(base64.b64decode(d["l"]), dtype="<f4"))


def sequence_ids(request_id: str, num_samples: int) -> list[str]:
    """The ids asample promises: fixed at submission (the SDK stamps them on the result), unguessable (the request
    id is random) and only meaningful inside the caller's tenant (the store keys them by tenant)."""
    return [f"{request_id}:{i}" for i in range(num_samples)]


def records_of(result: SampleResult, ids: list[str], *, session_id: str, adapter: str, engine: str,
               prompt_length: int) -> dict[str, bytes]:
    if len(ids) != len(result.sequences):
        raise errors.Unavailable(f"sampler returned {len(result.sequences)} sequences for {len(ids)} requested")
    return {sid: SequenceRecord(session_id=session_id, adapter=adapter, version=result.served_version, engine=engine,
                                prompt_length=prompt_length, tokens=np.asarray(seq.tokens, dtype=np.int32),
                                logprobs=np.asarray(seq.logprobs, dtype=np.float32)).encode()
            for sid, seq in zip(ids, result.sequences, strict=True)}


def unknown(where: str, sequence_id: str) -> errors.NotFound:
    # One message for never-issued, expired, evicted, another session's and another tenant's sequences.
    return errors.NotFound(
        f"{where}: sequence_id {errors.shown(sequence_id)} has no stability record (unknown, expired or not "
        "recorded: sample with record_stability_info=True in this session; records are kept for a day after "
        "their last use)", field="sequence_id")


def _check_tiling(where: str, spans: list[Span], size: int) -> None:
    total = sum(s.length for s in spans)
    if total != size:
        raise errors.InvalidArgument(f"{where}: spans cover {total} positions, the field has {size}; the runs must "
                                     "tile it exactly", field=where.rsplit(".", 1)[-1])


def check_tiling(i: int, datum: DatumIn) -> None:
    """Structural checks that need no record (every loss)."""
    if datum.input_spans is None and datum.target_spans is None:
        return
    if (datum.input_spans is None) != (datum.target_spans is None):
        raise errors.InvalidArgument(f"data[{i}]: model_input_spans and loss_fn_input_spans come as a pair",
                                     field="loss_fn_input_spans")
    for name, spans, size in (("model_input_spans", datum.input_spans, len(datum.input_tokens)),
                              ("loss_fn_input_spans", datum.target_spans, len(datum.target_tokens))):
        for j, s in enumerate(spans):
            if s.length < 0 or s.offset < 0 or not s.sequence_id:
                raise errors.InvalidArgument(f"data[{i}].{name}[{j}]: needs a sequence_id, offset >= 0 and "
                                             "length >= 0", field=name)
        _check_tiling(f"data[{i}].{name}", spans, size)


def referenced(data: list[DatumIn]) -> list[str]:
    ids: dict[str, None] = {}
    for d in data:
        for s in (d.input_spans or []) + (d.target_spans or []):
            ids[s.sequence_id] = None
    return list(ids)


def _check_span(where: str, span: Span, record: SequenceRecord | None, tokens: list[int], pos: int) -> None:
    if record is None:
        raise unknown(where, span.sequence_id)
    end = span.offset + span.length
    if span.kind == PROMPT:
        if end > record.prompt_length:
            raise errors.InvalidArgument(f"{where}: prompt positions [{span.offset}, {end}) lie outside the "
                                         f"sequence's prompt of {record.prompt_length} tokens", field="offset")
        return
    if end > len(record.tokens):
        raise errors.InvalidArgument(f"{where}: sampled positions [{span.offset}, {end}) lie outside the "
                                     f"{len(record.tokens)} sampled tokens", field="offset")
    mismatch = np.nonzero(np.asarray(tokens[pos:pos + span.length], dtype=np.int64)
                          != record.tokens[span.offset:end])[0]
    if len(mismatch):
        t = int(mismatch[0])
        raise errors.InvalidArgument(f"{where}: token {tokens[pos + t]} at datum position {pos + t} is not the "
                                     f"sampled token {int(record.tokens[span.offset + t])} it claims to be",
                                     field="loss_fn_input_spans")


def apply_records(data: list[DatumIn], records: dict[str, SequenceRecord], session_id: str) -> int:
    """Checks stable_reinforce datums against their records and fills them (see the module docstring); returns the
    number of sampled positions whose logprob came from a record."""
    filled = 0
    for i, d in enumerate(data):
        if d.target_spans is None:
            raise errors.InvalidArgument(
                f"data[{i}]: stable_reinforce needs provenance spans (Datum.with_provenance) naming sequences "
                "sampled with record_stability_info=True", field="loss_fn_input_spans")
        def rec(span: Span) -> SequenceRecord | None:
            r = records.get(span.sequence_id)
            return r if r is not None and r.session_id == session_id else None
        pos = 0
        for j, s in enumerate(d.input_spans):
            _check_span(f"data[{i}].model_input_spans[{j}]", s, rec(s), d.input_tokens, pos)
            pos += s.length
        n = len(d.target_tokens)
        logprobs = np.zeros(n, dtype=np.float32)
        mask = np.zeros(n, dtype=np.float32)
        advantages = np.asarray(d.advantages if d.advantages is not None else np.zeros(n), dtype=np.float32)
        if len(advantages) != n:
            raise errors.InvalidArgument(f"data[{i}].advantages: {len(advantages)} values for {n} targets",
                                         field="advantages")
        pos, k = 0, 0
        for j, s in enumerate(d.target_spans):
            r = rec(s)
            _check_span(f"data[{i}].loss_fn_input_spans[{j}]", s, r, d.target_tokens, pos)
            if s.kind == SAMPLED and s.length:
                k += 1
                logprobs[pos:pos + s.length] = r.logprobs[s.offset:s.offset + s.length]
                mask[pos:pos + s.length] = k
                filled += s.length
            elif s.kind == PROMPT and np.any(advantages[pos:pos + s.length] != 0):
                raise errors.InvalidArgument(
                    f"data[{i}].advantages: nonzero advantage on prompt positions [{pos}, {pos + s.length}) "
                    f"(loss_fn_input_spans[{j}]); stable_reinforce trains sampled tokens only", field="advantages")
            pos += s.length
        d.logprobs = logprobs.tolist()
        d.sequence_ratio_mask = mask.tolist()
    return filled
