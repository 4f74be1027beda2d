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

In a trainer fleet (trainer_svc/fleet.py) every member writes under the fleet's name, and each write is fenced: one
Lua script checks that the adapter's placement still names this trainer with the epoch it adopted the adapter under
and only then writes, so a trainer that was presumed dead and comes back can no longer change an adapter another
trainer took over (its writes are refused and it answers "moved").

Payloads and outcomes are plain containers of tensors, numbers, strings and bytes, encoded with `torch.save` and
read back with `weights_only=True` (no arbitrary objects are ever unpickled).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import redis
import torch

from loraplane import errors
from loraplane.errors import Unavailable
from loraplane.fleet import moved
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

    def with_checkpoint(self, checkpoint: Checkpoint, kept: int) -> AdapterRecord:
        """A copy pointing at one more checkpoint, keeping the newest `kept`."""
        return dataclasses.replace(self, checkpoints=(self.checkpoints + [checkpoint])[-kept:])

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


class Fence(Protocol):
    """What fences a fleet member's journal writes (trainer_svc.fleet.FleetMember)."""

    member_id: str

    def epoch_of(self, adapter: str) -> int | None:
        """The epoch this trainer serves the adapter under; None when it does not serve it."""

    def placement_key(self, adapter: str) -> str: ...

    def lost(self, adapter: str) -> None:
        """A write found the adapter placed elsewhere (called from any thread)."""


# KEYS: the placement hash of each adapter the write touches. ARGV: member id, one epoch per KEY, the number of
# commands, then per command: its adapter's KEYS index, 1 if it must not be skipped, its argument count, the
# arguments. A required command of a fenced adapter refuses the whole write ({0, fenced indexes}); the optional ones
# (outcomes, which only answer retries) of fenced adapters are skipped and the rest written ({1, replies}).
_FENCED_WRITE = """
local me = ARGV[1]
local fenced = {}
for i = 1, #KEYS do
  local current = redis.call('HMGET', KEYS[i], 'trainer', 'epoch')
  if current[1] ~= me or current[2] ~= ARGV[i + 1] then fenced[i] = true end
end
local pos = #KEYS + 2
local count = tonumber(ARGV[pos])
pos = pos + 1
local commands = {}
local refused = {}
for c = 1, count do
  local index, required, argc = tonumber(ARGV[pos]), ARGV[pos + 1], tonumber(ARGV[pos + 2])
  local args = {}
  for k = 1, argc do args[k] = ARGV[pos + 2 + k] end
  pos = pos + 3 + argc
  commands[c] = {index, args}
  if fenced[index] and required == '1' then table.insert(refused, index) end
end
if #refused > 0 then return {0, refused} end
local replies = {}
for c = 1, count do
  if fenced[commands[c][1]] then replies[c] = '' else replies[c] = redis.call(unpack(commands[c][2])) end
end
return {1, replies}
"""


@dataclass(frozen=True)
class _Op:
    adapter: str
    required: bool
    command: tuple


class TrainingJournal:
    """Synchronous on purpose: the worker thread writes the journal between batches, in the order it runs jobs.
    `trainer_id` names the journal's namespace: a trainer's own id, or its fleet's name (shared by the members)."""

    def __init__(self, url: str, *, key_prefix: str = "lp:", trainer_id: str = "trainer", timeout_s: float = 5.0,
                 fence: Fence | None = None):
        self.prefix = f"{key_prefix}trainer:{trainer_id}:"
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.fence = fence
        self._fenced_write = self.redis.register_script(_FENCED_WRITE)

    def close(self) -> None:
        self.redis.close()

    def _stream(self, adapter: str) -> str:
        return f"{self.prefix}journal:{adapter}"

    def _call(self, what: str, fn):
        try:
            return fn()
        except redis.RedisError as exc:
            raise Unavailable(f"the training journal is unavailable ({what}: {exc}); retry") from exc

    def _write(self, what: str, ops: list[_Op], transaction: bool = False) -> list:
        """Runs the commands in one round trip (fenced in a fleet); their replies in order ('' = skipped)."""
        if self.fence is None:
            def plain():
                pipe = self.redis.pipeline(transaction=transaction)
                for op in ops:
                    pipe.execute_command(*op.command)
                return pipe.execute()
            return self._call(what, plain)
        epochs: dict[str, int | None] = {}
        for op in ops:
            if op.adapter not in epochs:
                epochs[op.adapter] = self.fence.epoch_of(op.adapter)
        gone = [op.adapter for op in ops if op.required and epochs[op.adapter] is None]
        if gone:
            raise moved(gone[0])
        kept = [op for op in ops if epochs[op.adapter] is not None]
        adapters = list(dict.fromkeys(op.adapter for op in kept))
        if not kept:
            return [""] * len(ops)
        index = {adapter: i + 1 for i, adapter in enumerate(adapters)}
        args: list = [self.fence.member_id, *(epochs[a] for a in adapters), len(kept)]
        for op in kept:
            args += [index[op.adapter], 1 if op.required else 0, len(op.command), *op.command]
        ok, replies = self._call(what, lambda: self._fenced_write(
            keys=[self.fence.placement_key(a) for a in adapters], args=args))
        if not ok:
            lost = [adapters[int(i) - 1] for i in replies]
            for adapter in lost:
                self.fence.lost(adapter)
            raise moved(lost[0])
        by_op = iter(replies)
        return [next(by_op) if epochs[op.adapter] is not None else "" for op in ops]

    # ---- the adapter index
    def put_adapter(self, record: AdapterRecord) -> None:
        self._write("record the adapter", [_Op(record.name, True, ("HSET", f"{self.prefix}adapters", record.name,
                                                                     record.to_json()))])

    def drop_adapter(self, name: str) -> None:
        self._write("forget the adapter", [_Op(name, True, ("HDEL", f"{self.prefix}adapters", name)),
                                           _Op(name, True, ("DEL", self._stream(name)))], transaction=True)

    def record(self, name: str) -> AdapterRecord | None:
        raw = self._call("read the adapter index", lambda: self.redis.hget(f"{self.prefix}adapters", name))
        return None if raw is None else AdapterRecord.from_json(raw)

    def adapters(self) -> list[AdapterRecord]:
        raw = self._call("read the adapter index", lambda: self.redis.hgetall(f"{self.prefix}adapters"))
        return sorted((AdapterRecord.from_json(v) for v in raw.values()), key=lambda r: r.name)

    # ---- the journal
    def append_requests(self, requests: list[tuple[str, int, str, bytes, object]],
                        outcomes: list[tuple[str, int, bytes, object]] = ()) -> list[str]:
        """(adapter, seq_id, kind, payload_hash, payload) each -> the entry ids, in one round trip; `outcomes`
        (as for append_outcomes) of earlier requests ride along ahead of them, under the same fsync."""
        ops = self._outcome_ops(outcomes) + [
            _Op(adapter, True, ("XADD", self._stream(adapter), "*", "t", REQUEST, "seq", seq_id, "kind", kind,
                                "hash", payload_hash, "body", encode(payload)))
            for adapter, seq_id, kind, payload_hash, payload in requests]
        replies = self._write("journal the request", ops)
        return [entry_id.decode() for entry_id in replies[len(outcomes):]]

    def _outcome_ops(self, outcomes) -> list[_Op]:
        return [_Op(adapter, False, ("XADD", self._stream(adapter), "*", "t", kind, "seq", seq_id,
                                     "body", encode(value)))
                for adapter, seq_id, kind, value in outcomes]

    def append_outcomes(self, outcomes: list[tuple[str, int, bytes, object]]) -> None:
        """(adapter, seq_id, type, value) each. Best effort: a lost outcome only means a retry of that seq_id
        after a restart cannot be answered if a checkpoint already covers it; replay regenerates the rest."""
        try:
            self._write("journal outcomes", self._outcome_ops(outcomes))
        except Unavailable:
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
            self._write("trim the journal", [_Op(adapter, True, ("XTRIM", self._stream(adapter), "MINID",
                                                                 keep_from_entry))])
        except Unavailable:
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


# A forward/forward_backward request's datums are journaled as one flat tensor per field plus each datum's shape,
# not as a list of per-datum tensors: torch.save of a math_rl batch (512 datums, 5 tensors each) took 52 ms on the
# worker thread before the batch could run, and reading it back 138 ms; packed it is a few tensors (~1 ms).
_DATUM_FIELDS = tuple(f.name for f in dataclasses.fields(DatumInput))
_PACKED = "packed_datums"


def _pack_datums(datums) -> dict | None:
    """{field: (flat values, shapes [D, 2])}: row (-1, 0) = None, (n, 0) = 1-D of n, (n, k) = 2-D. None when the
    datums' tensors do not share one dtype per field (concatenating would convert them): the list form is kept."""
    packed = {}
    for name in _DATUM_FIELDS:
        tensors = [getattr(d, name) for d in datums]
        present = [t for t in tensors if t is not None]
        if not present or len({t.dtype for t in present}) != 1 or any(t.dim() not in (1, 2) for t in present):
            if present:
                return None
            packed[name] = (torch.zeros(0), torch.tensor([[-1, 0]] * len(tensors), dtype=torch.int64))
            continue
        shapes = torch.tensor([[-1, 0] if t is None else [t.shape[0], t.shape[1] if t.dim() == 2 else 0]
                               for t in tensors], dtype=torch.int64)
        packed[name] = (torch.cat([t.reshape(-1) for t in present]), shapes)
    return packed


def _unpack_datums(packed: dict) -> list[DatumInput]:
    columns = {}
    for name in _DATUM_FIELDS:
        flat, shapes = packed[name]
        rows = shapes.tolist()
        sizes = [n * (k or 1) for n, k in rows if n >= 0]
        pieces = iter(torch.split(flat, sizes) if sizes else ())
        column = []
        for n, k in rows:
            if n < 0:
                column.append(None)
            else:
                piece = next(pieces)
                column.append(piece.view(n, k) if k else piece)
        columns[name] = column
    return [DatumInput(**dict(zip(_DATUM_FIELDS, values))) for values in zip(*columns.values())]


def payload_to_plain(kind: str, payload) -> object:
    if kind in ("forward_backward", "forward"):
        datums, loss_fn, loss_config = payload
        packed = _pack_datums(datums) if datums else None
        body = ({_PACKED: packed} if packed is not None else
                {"datums": [{f.name: getattr(d, f.name) for f in dataclasses.fields(d)} for d in datums]})
        return {**body, "loss_fn": loss_fn, "loss_config": dict(loss_config)}
    if kind == "optim_step":
        return dataclasses.asdict(payload)
    if kind == "rejected":
        return _error_to_plain(payload)
    if kind == "load_state":
        return dataclasses.asdict(payload)
    return None


def payload_from_plain(kind: str, data):
    if kind in ("forward_backward", "forward"):
        # Journals written before the packed form (a list of per-datum dicts) still replay.
        datums = _unpack_datums(data[_PACKED]) if _PACKED in data else [DatumInput(**d) for d in data["datums"]]
        return datums, data["loss_fn"], dict(data["loss_config"])
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
        # One float64 tensor per field for all datums (exact for the Python floats the backend returned), as for
        # the request's datums above.
        outputs = outcome.outputs
        return {"packed_outputs": {
                    "logprobs": torch.tensor(list(itertools.chain.from_iterable(o.logprobs for o in outputs)),
                                             dtype=torch.float64),
                    "elementwise_loss": torch.tensor(
                        list(itertools.chain.from_iterable(o.elementwise_loss for o in outputs)), dtype=torch.float64),
                    "sizes": torch.tensor([[len(o.logprobs), len(o.elementwise_loss), o.targets_per_position]
                                           for o in outputs], dtype=torch.int64).reshape(-1, 3)},
                "metrics": dict(outcome.metrics)}
    if isinstance(outcome, StepOutcome):
        return {"step_outcome": dataclasses.asdict(outcome)}
    raise TypeError(f"no journal encoding for {type(outcome).__name__}")


def outcome_from_plain(data: dict):
    if "error" in data:
        return _error_from_plain(data)
    if "packed_outputs" in data:
        packed = data["packed_outputs"]
        logprobs, losses = packed["logprobs"].tolist(), packed["elementwise_loss"].tolist()
        outputs = []
        lp = loss = 0
        for n_lp, n_loss, k in packed["sizes"].tolist():
            outputs.append(DatumResult(logprobs=logprobs[lp:lp + n_lp], elementwise_loss=losses[loss:loss + n_loss],
                                       targets_per_position=k))
            lp, loss = lp + n_lp, loss + n_loss
        return ItemResult(outputs=outputs, metrics=dict(data["metrics"]))
    if "outputs" in data:  # journaled before the packed form
        return ItemResult(outputs=[DatumResult(logprobs=o["logprobs"].tolist(),
                                               elementwise_loss=o["elementwise_loss"].tolist(),
                                               targets_per_position=int(o.get("targets_per_position", 1)))
                                   for o in data["outputs"]], metrics=dict(data["metrics"]))
    if "step_outcome" in data:
        return StepOutcome(**data["step_outcome"])
    return data
