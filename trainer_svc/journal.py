"""Durable training: the trainer's adapter index and a write-ahead journal of sequenced requests, in Redis.

Why Redis Streams and not S3: every sequenced request must be durable *before* it runs (and so before it is
acknowledged), which puts one journal write on every step's critical path. An XADD to the Redis the registry already
needs costs a fraction of a millisecond on the same network (the local cluster's Valkey runs with AOF and fsync on
every write, so a SIGKILL of Valkey loses nothing acknowledged either); an S3 PUT costs tens of milliseconds and
would need one object per request. Checkpoints, which are large and rare, go to the registry (S3) instead.

Layout under `<key_prefix>trainer:<trainer_id>:`
  adapters          hash: adapter name -> JSON AdapterRecord (spec, uid, latest checkpoint)
  journal:<name>    stream, one entry per event, in the order the worker ran them:
                    t=req   the request, written before it runs (seq, kind, payload hash, encoded payload)
                    t=out   its outcome, written after it ran (answers a retry after a restart)
                    t=void  it failed transiently and did not take effect (a retry runs it again)

Payloads and outcomes are plain containers of tensors, numbers, strings and bytes, encoded with `torch.save` and
read back with `weights_only=True` (no arbitrary objects are ever unpickled).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis
import torch

from loraplane import errors
from loraplane.errors import Unavailable
from trainer_svc.backends.base import DatumInput, DatumResult, ItemResult
from trainer_svc.optimizer import AdamHyper, StepOutcome

log = logging.getLogger(__name__)

REQUEST, OUTCOME, VOID = b"req", b"out", b"void"


def encode(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=True)


@dataclass
class Checkpoint:
    version: int
    seq_id: int
    step: int


@dataclass
class AdapterRecord:
    """What a restarted trainer needs to rebuild an adapter before replaying its journal."""

    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    seed: int
    base_model: str
    uid: str
    # The dtype of its published weights versions; records written before the option existed are float32.
    weights_dtype: str = "float32"
    # loraplane.lora.EXPERT_LAYOUTS; records written before expert LoRA existed are per_expert.
    expert_layout: str = "per_expert"
    metadata: dict[str, str] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # oldest first

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> AdapterRecord:
        data = json.loads(raw)
        data["checkpoints"] = [Checkpoint(**c) for c in data.get("checkpoints", [])]
        return cls(**data)

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None


@dataclass
class JournalEntry:
    seq_id: int
    kind: str
    payload_hash: bytes
    payload: object
    entry_id: str
    outcome: object = None
    has_outcome: bool = False


class TrainingJournal:
    """Synchronous on purpose: the worker thread writes the journal between batches, in the order it runs jobs."""

    def __init__(self, url: str, *, key_prefix: str = "lp:", trainer_id: str = "trainer", timeout_s: float = 5.0):
        self.prefix = f"{key_prefix}trainer:{trainer_id}:"
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def close(self) -> None:
        self.redis.close()

    def _stream(self, adapter: str) -> str:
        return f"{self.prefix}journal:{adapter}"

    def _call(self, what: str, fn):
        try:
            return fn()
        except redis.RedisError as exc:
            raise Unavailable(f"the training journal is unavailable ({what}: {exc}); retry") from exc

    # ---- the adapter index
    def put_adapter(self, record: AdapterRecord) -> None:
        self._call("record the adapter", lambda: self.redis.hset(f"{self.prefix}adapters", record.name,
                                                                 record.to_json()))

    def drop_adapter(self, name: str) -> None:
        def drop():
            pipe = self.redis.pipeline()
            pipe.hdel(f"{self.prefix}adapters", name)
            pipe.delete(self._stream(name))
            pipe.execute()
        self._call("forget the adapter", drop)

    def adapters(self) -> list[AdapterRecord]:
        raw = self._call("read the adapter index", lambda: self.redis.hgetall(f"{self.prefix}adapters"))
        return sorted((AdapterRecord.from_json(v) for v in raw.values()), key=lambda r: r.name)

    # ---- the journal
    def append_requests(self, requests: list[tuple[str, int, str, bytes, object]],
                        outcomes: list[tuple[str, int, bytes, object]] = ()) -> list[str]:
        """(adapter, seq_id, kind, payload_hash, payload) each -> the entry ids, in one round trip; `outcomes`
        (as for append_outcomes) of earlier requests ride along ahead of them, under the same fsync."""
        def write():
            pipe = self.redis.pipeline(transaction=False)
            self._add_outcomes(pipe, outcomes)
            for adapter, seq_id, kind, payload_hash, payload in requests:
                pipe.xadd(self._stream(adapter), {"t": REQUEST, "seq": seq_id, "kind": kind, "hash": payload_hash,
                                                  "body": encode(payload)})
            return [entry_id.decode() for entry_id in pipe.execute()[len(outcomes):]]
        return self._call("journal the request", write)

    def _add_outcomes(self, pipe, outcomes) -> None:
        for adapter, seq_id, kind, value in outcomes:
            pipe.xadd(self._stream(adapter), {"t": kind, "seq": seq_id, "body": encode(value)})

    def append_outcomes(self, outcomes: list[tuple[str, int, bytes, object]]) -> None:
        """(adapter, seq_id, type, value) each. Best effort: a lost outcome only means a retry of that seq_id
        after a restart cannot be answered if a checkpoint already covers it; replay regenerates the rest."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            self._add_outcomes(pipe, outcomes)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not journal %d outcomes", len(outcomes), exc_info=True)

    def entries(self, adapter: str) -> list[JournalEntry]:
        """The adapter's requests in run order, each with its outcome if one was written; voided ones dropped."""
        by_seq: dict[int, JournalEntry] = {}
        for entry_id, fields in self._read(adapter):
            seq_id = int(fields[b"seq"])
            kind = fields[b"t"]
            if kind == REQUEST:
                by_seq[seq_id] = JournalEntry(seq_id=seq_id, kind=fields[b"kind"].decode(),
                                              payload_hash=fields[b"hash"], payload=decode(fields[b"body"]),
                                              entry_id=entry_id)
            elif kind == VOID:
                by_seq.pop(seq_id, None)
            elif kind == OUTCOME and seq_id in by_seq:
                by_seq[seq_id].outcome = decode(fields[b"body"])
                by_seq[seq_id].has_outcome = True
        return sorted(by_seq.values(), key=lambda e: e.seq_id)

    def _read(self, adapter: str, batch: int = 512) -> Iterator[tuple[str, dict]]:
        start = "-"
        while True:
            chunk = self._call("read the journal", functools.partial(self.redis.xrange, self._stream(adapter),
                                                                     start, "+", count=batch))
            for entry_id, fields in chunk:
                yield entry_id.decode(), fields
            if len(chunk) < batch:
                return
            start = "(" + chunk[-1][0].decode()

    def trim(self, adapter: str, keep_from_entry: str) -> None:
        """Drops the entries before `keep_from_entry` (a checkpoint covers them)."""
        try:
            self.redis.xtrim(self._stream(adapter), minid=keep_from_entry, approximate=False)
        except redis.RedisError:
            log.warning("could not trim the journal of %s", adapter, exc_info=True)

    def length(self, adapter: str) -> int:
        return int(self._call("measure the journal", lambda: self.redis.xlen(self._stream(adapter))))


# ---- domain values <-> the plain containers the journal stores
@dataclass(frozen=True)
class ResolvedSource:
    """A LoadState source resolved to one registry version, so a replay loads exactly what the live run loaded."""

    name: str
    version: int
    with_optimizer: bool


def _error_to_plain(exc: BaseException) -> dict:
    if isinstance(exc, errors.LoraplaneError):
        return {"error": type(exc).__name__, "message": exc.message, "field": exc.field, "reason": exc.reason}
    return {"error": "LoraplaneError", "message": f"{type(exc).__name__}: {exc}", "field": None,
            "reason": "INTERNAL"}


def _error_from_plain(data: dict) -> errors.LoraplaneError:
    cls = getattr(errors, data["error"], errors.LoraplaneError)
    if not (isinstance(cls, type) and issubclass(cls, errors.LoraplaneError)):
        cls = errors.LoraplaneError
    return cls(data["message"], field=data["field"], reason=data["reason"])


def payload_to_plain(kind: str, payload) -> object:
    if kind in ("forward_backward", "forward"):
        datums, loss_fn, loss_config = payload
        return {"datums": [{f.name: getattr(d, f.name) for f in dataclasses.fields(d)} for d in datums],
                "loss_fn": loss_fn, "loss_config": dict(loss_config)}
    if kind == "optim_step":
        return dataclasses.asdict(payload)
    if kind == "rejected":
        return _error_to_plain(payload)
    if kind == "load_state":
        return dataclasses.asdict(payload)
    return None


def payload_from_plain(kind: str, data):
    if kind in ("forward_backward", "forward"):
        return ([DatumInput(**d) for d in data["datums"]], data["loss_fn"], dict(data["loss_config"]))
    if kind == "optim_step":
        return AdamHyper(**data)
    if kind == "rejected":
        return _error_from_plain(data)
    if kind == "load_state":
        return ResolvedSource(**data)
    return None


def outcome_to_plain(outcome) -> dict:
    if isinstance(outcome, BaseException):
        return _error_to_plain(outcome)
    if isinstance(outcome, ItemResult):
        return {"outputs": [{"logprobs": torch.tensor(o.logprobs, dtype=torch.float64),
                             "elementwise_loss": torch.tensor(o.elementwise_loss, dtype=torch.float64)}
                            for o in outcome.outputs],
                "metrics": dict(outcome.metrics)}
    if isinstance(outcome, StepOutcome):
        return {"step_outcome": dataclasses.asdict(outcome)}
    raise TypeError(f"no journal encoding for {type(outcome).__name__}")


def outcome_from_plain(data: dict):
    if "error" in data:
        return _error_from_plain(data)
    if "outputs" in data:
        return ItemResult(outputs=[DatumResult(logprobs=o["logprobs"].tolist(),
                                               elementwise_loss=o["elementwise_loss"].tolist())
                                   for o in data["outputs"]], metrics=dict(data["metrics"]))
    if "step_outcome" in data:
        return StepOutcome(**data["step_outcome"])
    return data
