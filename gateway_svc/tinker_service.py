"""The Tinker API's semantics on loraplane (no HTTP here: tinker_routes converts requests and replies).

Mapping:
- a Tinker session is a Redis record; a training model `<session_id>:train:<n>` (the id the SDK itself computes for
  create_training_client_from_state) is the loraplane adapter `<tenant>/<session_id>-train-<n>`;
- a Tinker request's per-client seq_id (1, 2, 3 ...) is the adapter's trainer seq_id, shifted by one for models
  created from a checkpoint (their LoadState took seq 1). The trainer runs them in seq_id order whatever order
  they arrive in (parallel forward_backward chunks arrive lowest-last) and applies a retried seq_id once; the
  gateway itself also deduplicates (model, seq_id) so a retry gets the first request's future;
- every request that carries a seq_id reaches the trainer, even one the gateway refuses, so the seq_id is consumed
  and the model's later requests never wait on a gap;
- save_weights_for_sampler publishes a registry weights version; its tinker:// path (and the ephemeral sampling
  session) pins that exact version on the sampler; save_weights is a SaveState training-state version.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import math
import re
import secrets
import time
import uuid
from typing import Any

from gateway_svc import stability, tinker_codec
from gateway_svc.config import GatewaySettings
from gateway_svc.futures import Futures
from gateway_svc.http_errors import Unsupported
from gateway_svc.served_names import ServedNames
from gateway_svc.store import Store
from gateway_svc.types import SamplingSpec
from gateway_svc.upstream import Upstream
from loraplane import auth, errors
from loraplane.client.targets import narrow_targets
from loraplane.metrics import RPC_SECONDS

PROTO = tinker_codec.PROTO
JSON = "application/json"
_CKPT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SEGMENT = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
# The files of an external (Hugging Face PEFT) checkpoint, as `tinker checkpoint download` writes them.
EXTERNAL_FILES = ("adapter_model.safetensors", "adapter_config.json")
URL_TTL_S = 3600
# target_prompt_logprobs: cells scored per request (each costs the sampler one prefill of its prefix).
MAX_TARGET_CELLS = 256
ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
# The LoRA scale numerator of every adapter the gateway creates, whatever its rank: what Tinker's adapters carry
# (tinker_cookbook/hyperparam_utils.py:66 `lora_alpha: int = 32`, weights/README.md:59; its get_lr takes no rank,
# hyperparam_utils.py:306), so a learning rate tuned on Tinker means the same here (scale alpha / rank).
TINKER_LORA_ALPHA = 32.0
INT32_MAX = 2**31 - 1


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1e6):06d}Z"


def num(value: Any, field: str, kind: type = int, lo: float | None = None, hi: float | None = None) -> Any:
    """`kind(value)` for a number the caller sent, finite and within [lo, hi] when given, or InvalidArgument naming
    the field (never a 500)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or (kind is int and value != int(value))):
        what = "an integer" if kind is int else "a finite number"
        raise errors.InvalidArgument(f"{field} {errors.shown(value)}: must be {what}", field=field)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise errors.InvalidArgument(f"{field} {errors.shown(value)}: must be in [{lo}, {hi}]", field=field)
    return kind(value)


def _json(value: Any) -> tuple[str, bytes]:
    return JSON, json.dumps(value).encode()


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """tinker://<model_id>/<weights|sampler_weights>/<name> -> (model_id, checkpoint_id, checkpoint type)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise errors.InvalidArgument(f"path {errors.shown(path)}: must start with tinker://", field="path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in _SEGMENT or not parts[0] or not parts[2]:
        raise errors.InvalidArgument(
            f"path {errors.shown(path)}: expected tinker://<model_id>/weights|sampler_weights|external_weights/<name>",
            field="path")
    return parts[0], f"{parts[1]}/{parts[2]}", _SEGMENT[parts[1]]


def _opt(params: dict[str, Any], key: str) -> float | None:
    return None if params.get(key) is None else num(params[key], f"sampling_params.{key}", float)


def sampling_spec(params: dict[str, Any], default_max_tokens: int) -> SamplingSpec:
    stop = params.get("stop")
    seed = params.get("seed")
    spec = SamplingSpec(max_tokens=num(params.get("max_tokens") or default_max_tokens, "sampling_params.max_tokens",
                                       lo=1, hi=INT32_MAX),
                        temperature=_opt(params, "temperature"), top_p=_opt(params, "top_p"),
                        top_k=max(num(params.get("top_k") or 0, "sampling_params.top_k", lo=-1, hi=INT32_MAX), 0),
                        seed=None if seed is None else num(seed, "sampling_params.seed", lo=0, hi=2**64 - 1))
    if isinstance(stop, str):
        spec.stop_strings = [stop]
    elif isinstance(stop, list):
        if all(isinstance(s, str) for s in stop):
            spec.stop_strings = list(stop)
        elif all(isinstance(s, int) for s in stop):
            spec.stop_token_ids = [num(s, "sampling_params.stop", lo=0, hi=INT32_MAX) for s in stop]
        else:
            raise errors.InvalidArgument("sampling_params.stop: strings or token ids, not both",
                                         field="sampling_params.stop")
    elif stop is not None:
        raise errors.InvalidArgument(f"sampling_params.stop {errors.shown(stop)}: a string or a list of strings or "
                                     "token ids", field="sampling_params.stop")
    if spec.top_p is not None and spec.top_p >= 1.0:
        spec.top_p = None
    return spec


class TinkerService:
    def __init__(self, settings: GatewaySettings, store: Store, upstream: Upstream):
        self.settings = settings
        self.store = store
        self.upstream = upstream
        self.futures = Futures(store, self.run_spec, long_poll_s=settings.long_poll_s,
                               lease_s=settings.future_lease_s)
        self.served = ServedNames(settings, upstream)

    # ---- naming ----------------------------------------------------------------------------------------------
    def adapter_of(self, model_id: str) -> str:
        session, _sep, n = model_id.rpartition(":train:")
        return f"{self.tenant()}/{session}-train-{n}"

    def tenant(self) -> str:
        """Whose namespace the caller's models live in (the same tenant the store keys its records by)."""
        return self.store.tenant()

    @staticmethod
    def _visible(record: dict[str, Any] | None) -> bool:
        """Whether the caller may know of a model, checkpoint or sampling session. The store already keys every
        record by the caller's tenant (another tenant's record is simply absent); this second, independent check by
        the adapter the record names never shows a record whose adapter lies outside the caller's scope."""
        return record is not None and (not record.get("adapter") or auth.current_caller().may_see(record["adapter"]))

    async def base_names(self) -> list[str]:
        return await self.served.names()

    async def check_base_model(self, name: str | None) -> str:
        names = await self.base_names()
        if not name:
            return names[0]
        if name not in names:
            raise errors.InvalidArgument(
                f"base_model {errors.shown(name)} is not served here (served: {', '.join(names)})",
                field="base_model")
        return name

    async def model(self, model_id: str) -> dict[str, Any]:
        record = await self.store.get_model(model_id)
        if not self._visible(record):
            raise errors.NotFound(f"model_id {errors.shown(model_id)} not found", field="model_id")
        return record

    # ---- sessions --------------------------------------------------------------------------------------------
    async def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = "s" + uuid.uuid4().hex[:12]
        now = time.time()
        await self.store.create_session(session_id, {
            "session_id": session_id, "tags": body.get("tags") or [], "user_metadata": body.get("user_metadata"),
            "sdk_version": body.get("sdk_version"), "created": now, "last_seen": now})
        return {"type": "create_session", "session_id": session_id}

    async def heartbeat(self, session_id: str) -> dict[str, Any]:
        if not await self.store.touch_session(session_id):
            raise errors.NotFound(f"session {errors.shown(session_id)} not found", field="session_id")
        return {"type": "session_heartbeat"}

    async def finish_session(self, session_id: str, reason: Any) -> dict[str, Any]:
        if not await self.store.touch_session(session_id, finished=reason or True):
            raise errors.NotFound(f"session {errors.shown(session_id)} not found", field="session_id")
        return {}

    async def list_sessions(self, limit: int, offset: int) -> dict[str, Any]:
        """The caller's tenant's sessions, newest first (the SDK's ListSessionsResponse, plus a cursor)."""
        ids, total = await self.store.list_sessions(offset, limit)
        return {"sessions": ids, "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    async def get_session(self, session_id: str) -> dict[str, Any]:
        record = await self.store.get_session(session_id) if session_id else None
        if record is None:
            raise errors.NotFound(f"session {errors.shown(session_id)} not found", field="session_id")
        models, samplers = await self.store.session_members(session_id)
        metadata = record.get("user_metadata")
        return {"training_run_ids": models, "sampler_ids": samplers,
                "user_metadata": {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else None}

    async def require_session(self, session_id: str) -> None:
        if not session_id or await self.store.get_session(session_id) is None:
            raise errors.NotFound(f"session_id {errors.shown(session_id)} not found (call create_session first)",
                                  field="session_id")

    # ---- futures ---------------------------------------------------------------------------------------------
    async def _submit(self, scope: str, seq_id: int | None, spec: dict[str, Any]) -> str:
        # Whichever replica runs the future acts for the same tenant (the key itself is never stored).
        request_id = uuid.uuid4().hex
        spec = {**spec, "acting_for": auth.acting_for_value(), "request_id": request_id}
        if seq_id is not None:
            owner = await self.store.claim_request(scope, seq_id, request_id)
            if owner != request_id:
                return owner  # a retry of an accepted request: the first request's future
        return await self.futures.submit(request_id, spec)

    async def run_spec(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        """Runs in the future's own task: it acts for the tenant recorded at submission (nobody's in particular for an
        admin's or the open mode's), whoever's request happens to start it on this replica."""
        acting_for = spec.get("acting_for")
        auth.set_caller(auth.Identity(key_id="", tenant=acting_for, role=auth.ROLE_TENANT) if acting_for
                        else auth.OPEN)
        start = time.perf_counter()
        try:
            return await getattr(self, f"_run_{spec['kind']}")(spec)
        finally:
            RPC_SECONDS.labels("gateway", f"future:{spec['kind']}").observe(time.perf_counter() - start)

    # ---- training models -------------------------------------------------------------------------------------
    async def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = body.get("session_id", "")
        await self.require_session(session_id)
        base = await self.check_base_model(body.get("base_model"))
        lora = body.get("lora_config") or {}
        rank = num(lora.get("rank") or 32, "lora_config.rank", lo=1, hi=INT32_MAX)
        info = await self.upstream.info()
        if not 1 <= rank <= info.max_lora_rank:
            raise errors.InvalidArgument(f"lora_config.rank {rank}: must be in [1, {info.max_lora_rank}]",
                                         field="lora_config.rank")
        train_mlp, train_attn = lora.get("train_mlp", True), lora.get("train_attn", True)
        if not (train_mlp or train_attn):
            raise errors.InvalidArgument("lora_config: train_mlp and train_attn cannot both be false "
                                         "(loraplane adapts the decoder's linear projections only)",
                                         field="lora_config")
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise Unsupported(f"optimizer_config.type {errors.shown(opt)} is not supported (adamw only)")
        model_id = f"{session_id}:train:{num(body.get('model_seq_id', 0), 'model_seq_id', lo=0, hi=INT32_MAX)}"
        # The flags select by the base model's family: its token mixers (attention, linear attention, Mamba) and
        # the MLP it has (dense projections, shared and routed experts).
        targets = narrow_targets(info.target_modules, train_attn=bool(train_attn), train_mlp=bool(train_mlp))
        now = time.time()
        seed = lora.get("seed")
        # LoraConfig.seed=None is a random seed (the SDK's documented meaning); it is recorded with the model, so a
        # re-run of this future (or a resumed run reading the record) initializes the same adapter.
        seed = secrets.randbits(63) if seed is None else num(seed, "lora_config.seed", lo=0, hi=2**64 - 1)
        record = {"model_id": model_id, "adapter": self.adapter_of(model_id), "base_model": base, "rank": rank,
                  "alpha": TINKER_LORA_ALPHA, "seed": seed, "targets": targets, "train_mlp": train_mlp,
                  "train_attn": train_attn, "train_unembed": bool(lora.get("train_unembed", False)),
                  "seq_offset": 0, "session_id": session_id, "created": now, "last_request_time": now,
                  "user_metadata": body.get("user_metadata")}
        await self.store.put_model(model_id, record, nx=True)
        request_id = await self._submit(model_id, 0, {"kind": "create_model", "model_id": model_id})
        return {"request_id": request_id, "model_id": model_id}

    async def unload_model(self, body: dict[str, Any]) -> dict[str, Any]:
        """Releases a training model: its trainer adapter (slot, optimizer state, journal) is deleted; its
        checkpoints stay (they are registry versions) and load into a new training client. Later requests on the
        model answer FAILED_PRECONDITION."""
        record = await self.model(body.get("model_id", ""))
        request_id = uuid.uuid4().hex
        await self.futures.submit(request_id, {"kind": "unload", "model_id": record["model_id"],
                                               "acting_for": auth.acting_for_value(), "request_id": request_id})
        return {"request_id": request_id, "model_id": record["model_id"]}

    async def _run_unload(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record = await self.model(spec["model_id"])
        if not record.get("unloaded"):
            record["unloaded"] = True
            await self.store.put_model(record["model_id"], record)  # first: no new request starts on it
        try:
            await self.upstream.delete_adapter(record["adapter"])
        except errors.NotFound:
            pass  # a re-run of this future: already gone
        return _json({"type": "unload_model", "model_id": record["model_id"]})

    async def _run_create_model(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record = await self.model(spec["model_id"])
        try:
            await self.upstream.create_adapter(record["adapter"], rank=record["rank"], seed=record["seed"],
                                               alpha=record.get("alpha", 0.0), targets=record["targets"],
                                               metadata={"tinker_model_id": record["model_id"]})
        except errors.AlreadyExists:
            pass  # a re-run of this very future after a gateway restart
        return _json({"type": "create_model", "model_id": spec["model_id"]})

    async def tokenizer_dir(self) -> str:
        return await self.served.tokenizer_dir()

    async def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        record = await self.model(body.get("model_id", ""))
        return {"type": "get_info", "model_id": record["model_id"], "is_lora": True, "lora_rank": record["rank"],
                "model_name": record["base_model"], "lora_alpha": record.get("alpha"), "seed": record.get("seed"),
                "model_data": {"arch": "llama", "model_name": record["base_model"],
                               "tokenizer_id": await self.tokenizer_dir()}}

    # ---- sequenced training requests -------------------------------------------------------------------------
    async def _sequenced(self, model_id: str, seq_id: Any, spec: dict[str, Any]) -> dict[str, Any]:
        record = await self.model(model_id)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 1 <= seq_id <= INT32_MAX:
            raise errors.InvalidArgument(f"seq_id {errors.shown(seq_id)}: must be an integer in [1, {INT32_MAX}]",
                                         field="seq_id")
        if record.get("unloaded"):
            raise errors.FailedPrecondition(f"model_id {errors.shown(model_id)} was unloaded (unload_model); load "
                                            "its last checkpoint into a new training client", field="model_id")
        spec.update(model_id=model_id, seq_id=seq_id)
        request_id = await self._submit(model_id, seq_id, spec)
        return {"request_id": request_id, "model_id": record["model_id"]}

    async def _target(self, spec: dict[str, Any]) -> tuple[dict[str, Any], int]:
        record = await self.store.get_model_touched(spec["model_id"])
        if record is None:
            raise errors.NotFound(f"model_id {errors.shown(spec['model_id'])} not found", field="model_id")
        return record, spec["seq_id"] + int(record.get("seq_offset", 0))

    async def forward_backward(self, body: bytes, encoding: str) -> dict[str, Any]:
        raw = tinker_codec.decompress(body, encoding)
        model_id, seq_id = tinker_codec.forward_backward_target(raw)
        return await self._sequenced(model_id, seq_id, {"kind": "fwdbwd", "body": base64.b64encode(raw).decode()})

    async def _run_fwdbwd(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        request = tinker_codec.decode_forward_backward(base64.b64decode(spec["body"]))
        record, seq = await self._target(spec)
        if request.problem:
            await self._consume(record["adapter"], seq)
            raise errors.InvalidArgument(request.problem, field=request.problem_field)

        async def check() -> int:
            for i, datum in enumerate(request.data):
                stability.check_tiling(i, datum)
            if request.loss_fn != "stable_reinforce":
                return 0  # other losses take the client's logprobs; their spans are not looked up
            ids = stability.referenced(request.data)
            raw = await self.store.get_sequences(ids, ttl_s=self.settings.stability_ttl_s)
            records = {i: stability.SequenceRecord.decode(r) for i, r in raw.items()}
            return stability.apply_records(request.data, records, record["session_id"])
        filled = await self._checked(record, seq, check)
        # Building the gRPC request converts every value to its protobuf type: a refusal there is the caller's too.
        prepared = await self._checked(record, seq, self._prepare(
            record["adapter"], seq, request.data, request.loss_fn, request.loss_fn_config, request.forward_only))
        try:
            result = await self.upstream.send_forward_backward(prepared)
        except errors.InvalidArgument as exc:
            if request.loss_fn == "custom":
                info = await self.upstream.info()
                raise Unsupported(
                    f"loss_fn {request.loss_fn!r} is not supported by loraplane (supported: "
                    f"{', '.join(info.supported_losses)}); forward_backward_custom computes custom losses "
                    "client-side") from exc
            raise
        if request.loss_fn == "stable_reinforce":
            # How many trained positions took the recorded sampler logprob (the client's copy is never used).
            result.metrics["recorded_logprobs:sum"] = float(filled)
        return PROTO, tinker_codec.encode_forward_backward(result, [d.targets_per_position for d in request.data])

    def _prepare(self, *args):
        """The trainer request's build as a `_checked` check (see upstream.prepare_forward_backward)."""
        async def prepare():
            return self.upstream.prepare_forward_backward(*args)
        return prepare

    async def _consume(self, adapter: str, seq: int) -> None:
        """Spends `seq` on the trainer with a request it refuses, so the adapter's later seq_ids never wait on it."""
        try:
            await self.upstream.forward_backward(adapter, seq, [], "cross_entropy", {}, True)
        except errors.LoraplaneError:
            pass  # the trainer's refusal of the empty request is the point; anything else: the caller's error stands

    async def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._sequenced(body.get("model_id", ""), body.get("seq_id"), {
            "kind": "optim", "adam": body.get("adam_params"), "other": body.get("optimizer_params")})

    async def _run_optim(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record, seq = await self._target(spec)
        adam = spec.get("adam")
        if not isinstance(adam, dict):
            await self._consume(record["adapter"], seq)
            kind = (spec.get("other") or {}).get("type", "none")
            raise Unsupported(f"optimizer {errors.shown(kind)} is not supported: send adam_params (AdamW)")
        async def check():
            return {k: num(adam[k], f"adam_params.{k}", float) for k in ADAM_FIELDS if adam.get(k) is not None}
        params = await self._checked(record, seq, check)
        metrics = await self.upstream.optim_step(record["adapter"], seq, params)
        # Tinker metric keys are `<name>:<reduction>`.
        return _json({"type": "optim_step",
                      "metrics": {k if k.count(":") == 1 else f"{k.replace(':', '_')}:mean": v
                                  for k, v in metrics.items()}})

    def _checkpoint_name(self, name: Any) -> str:
        if not isinstance(name, str) or not _CKPT_NAME.match(name):
            raise errors.InvalidArgument(
                f"path {errors.shown(name)}: a checkpoint name is 1-128 of [A-Za-z0-9._-] (no '/')", field="path")
        return name

    async def _checked(self, record: dict[str, Any], seq: int, check):
        """`await check()`, or, when it refuses the request, spend `seq` on the trainer first and re-raise: a
        sequenced request the gateway refuses must not leave a gap the model's next requests would wait on."""
        try:
            return await check()
        except errors.LoraplaneError as exc:
            if isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded, errors.ResourceExhausted)):
                raise  # transient: the future is re-run (or retried by the client) with this same seq_id
            await self._consume(record["adapter"], seq)
            raise
        except (ValueError, TypeError, OverflowError, KeyError, IndexError) as exc:
            # A value the checks above let through and a conversion refused: still the caller's request.
            await self._consume(record["adapter"], seq)
            raise errors.InvalidArgument(f"request refused: {type(exc).__name__}: {exc}") from None

    async def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        # Every check that needs the request's content runs in the future (see _checked), not here.
        return await self._sequenced(body.get("model_id", ""), body.get("seq_id"), {
            "kind": "save_weights", "name": body.get("path"),
            "metadata": body.get("user_metadata") or {}, "ttl": body.get("ttl_seconds")})

    async def _run_save_weights(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record, seq = await self._target(spec)

        async def check():
            self._checkpoint_name(spec["name"])
        await self._checked(record, seq, check)
        version = await self.upstream.save_state(record["adapter"], seq, {"tinker_checkpoint": spec["name"]})
        path = await self._record_checkpoint(record, "weights", spec["name"], version, spec)
        return _json({"type": "save_weights", "path": path})

    async def _record_checkpoint(self, record, segment: str, name: str, version, spec) -> str:
        path = f"tinker://{record['model_id']}/{segment}/{name}"
        now = time.time()
        ttl = spec.get("ttl")
        await self.store.put_checkpoint(record["model_id"], f"{segment}/{name}", {
            "checkpoint_id": f"{segment}/{name}", "checkpoint_type": _SEGMENT[segment], "tinker_path": path,
            "adapter": version.adapter, "version": version.version, "size_bytes": version.size_bytes,
            "time": now, "expires_at": now + ttl if ttl else None,
            "user_metadata": {str(k): str(v) for k, v in (spec.get("metadata") or {}).items()} or None})
        return path

    async def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": "save_for_sampler", "metadata": body.get("user_metadata") or {},
                                "ttl": body.get("ttl_seconds")}
        if body.get("path") is not None:
            spec["name"] = body["path"]
        else:
            # Checked in the future (which spends the seq_id when it refuses), like every content field.
            spec["sampler_seq"] = body.get("sampling_session_seq_id") or 0
        return await self._sequenced(body.get("model_id", ""), body.get("seq_id"), spec)

    async def _run_save_for_sampler(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record, seq = await self._target(spec)

        async def check():
            if "name" in spec:
                self._checkpoint_name(spec["name"])
            else:
                n = num(spec.get("sampler_seq", 0), "sampling_session_seq_id", lo=0, hi=INT32_MAX)
                spec["sampler_id"] = spec.get("sampler_id") or f"{record['session_id']}:sample:{n}"
        await self._checked(record, seq, check)
        version = await self.upstream.publish_weights(
            record["adapter"], seq, {"tinker_checkpoint": spec.get("name") or spec["sampler_id"]})
        if "name" in spec:
            path = await self._record_checkpoint(record, "sampler_weights", spec["name"], version, spec)
            return _json({"type": "save_weights_for_sampler", "path": path})
        await self.store.put_sampler(spec["sampler_id"], {
            "sampler_id": spec["sampler_id"], "base_model": record["base_model"], "model_path": None,
            "adapter": version.adapter, "version": version.version})
        return _json({"type": "save_weights_for_sampler", "path": None, "sampling_session_id": spec["sampler_id"]})

    async def save_weights_external(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._sequenced(body.get("model_id", ""), body.get("seq_id"), {
            "kind": "save_external", "name": body.get("path"), "ttl": body.get("ttl_seconds"),
            "encrypt": bool(body.get("age_encryption_recipients")), "metadata": {}})

    async def _run_save_external(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        """A PEFT export is what a weights version already is: publish one and name it by a tinker:// path."""
        record, seq = await self._target(spec)

        async def check():
            self._checkpoint_name(spec["name"])
            if spec.get("encrypt"):
                raise Unsupported("age_encryption_recipients is not supported (exports are not encrypted)")
        await self._checked(record, seq, check)
        version = await self.upstream.publish_weights(record["adapter"], seq, {"tinker_checkpoint": spec["name"]})
        path = await self._record_checkpoint(record, "external_weights", spec["name"], version, spec)
        return _json({"type": "save_weights_external", "path": path, "size_bytes": version.size_bytes})

    async def _live_checkpoint(self, model_id: str, ckpt_id: str) -> dict[str, Any]:
        """The caller's unexpired checkpoint, or NOT_FOUND (as for one that never existed)."""
        ckpt = await self._alive(model_id, await self.store.get_checkpoint(model_id, ckpt_id))
        if not self._visible(ckpt):
            raise errors.NotFound(f"checkpoint {errors.shown(model_id)}/{errors.shown(ckpt_id)} not found",
                                  field="checkpoint_id")
        return ckpt

    async def set_checkpoint_ttl(self, model_id: str, ckpt_id: str, ttl: Any) -> None:
        ckpt = await self._live_checkpoint(model_id, ckpt_id)
        if ttl is not None and num(ttl, "ttl_seconds") <= 0:
            raise errors.InvalidArgument(f"ttl_seconds {ttl}: must be > 0 (or null for no expiry)",
                                         field="ttl_seconds")
        ckpt["expires_at"] = time.time() + ttl if ttl is not None else None
        await self.store.put_checkpoint(model_id, ckpt_id, ckpt)

    async def external_weights_urls(self, model_id: str, ckpt_id: str, base_url: str) -> dict[str, Any]:
        """Signed URLs, one per file, that download the checkpoint without an API key (as the CLI fetches them:
        plain urllib). Each carries the tenant, checkpoint and expiry under the gateway's HMAC."""
        ckpt = await self._live_checkpoint(model_id, ckpt_id)
        if ckpt["checkpoint_type"] != "external":
            raise errors.InvalidArgument(f"checkpoint {errors.shown(ckpt_id)}: download URLs are for external "
                                         "weights (save_weights_external)", field="checkpoint_id")
        expires = time.time() + URL_TTL_S
        token = await self._sign({"t": self.tenant(), "m": model_id, "c": ckpt_id, "e": int(expires)})
        return {"urls": {f: f"{base_url.rstrip('/')}/api/v1/external_weights/{token}/{f}" for f in EXTERNAL_FILES},
                "expires": _iso(expires)}

    async def _sign(self, payload: dict[str, Any]) -> str:
        import hashlib
        import hmac

        body = base64.urlsafe_b64encode(json.dumps(payload, separators=(",", ":")).encode()).decode().rstrip("=")
        mac = hmac.new(await self.store.signing_secret(), body.encode(), hashlib.sha256).hexdigest()
        return f"{body}.{mac}"

    async def _verified(self, token: str) -> dict[str, Any] | None:
        import hashlib
        import hmac

        body, _sep, mac = token.partition(".")
        good = hmac.new(await self.store.signing_secret(), body.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, good):
            return None
        try:
            payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except ValueError:
            return None
        return payload if payload.get("e", 0) > time.time() else None

    async def external_file(self, token: str, name: str) -> bytes:
        """A file of a signed download URL. An altered, expired or unknown token answers as a missing file."""
        payload = await self._verified(token)
        if payload is None or name not in EXTERNAL_FILES:
            raise errors.NotFound("download URL not found or expired (ask for new URLs)", field="url")
        # Act for the tenant the URL was signed for: its records, its adapters.
        auth.set_caller(auth.Identity(key_id="", tenant=payload["t"], role=auth.ROLE_TENANT)
                        if payload["t"] != self.store.default_tenant else auth.OPEN)
        ckpt = await self._alive(payload["m"], await self.store.get_checkpoint(payload["m"], payload["c"]))
        if ckpt is None:
            raise errors.NotFound("download URL not found or expired (ask for new URLs)", field="url")
        blob = await self.upstream.download_version(ckpt["adapter"], ckpt["version"])
        # What Tinker hands out: its own layout (routed experts as 3-D w1/w3/w2 tensors, a shared-outer adapter's
        # shared side once), the input of tinker-cookbook's build_hf_model / build_lora_adapter; a dense adapter's
        # is plain PEFT. `loraplane` exports HF PEFT's per-expert layout where a consumer needs that
        # (adapter_format.materialize_peft_dir).
        from loraplane.adapter_format import tinker_files

        weights, config = await asyncio.to_thread(tinker_files, blob)
        return weights if name == "adapter_model.safetensors" else config

    async def _alive(self, model_id: str, ckpt: dict[str, Any] | None) -> dict[str, Any] | None:
        """The checkpoint, or None once its ttl_seconds have passed (it is then deleted, registry version too)."""
        if ckpt is not None and ckpt.get("expires_at") and ckpt["expires_at"] <= time.time():
            try:
                await self.delete_checkpoint(model_id, ckpt["checkpoint_id"])
            except errors.NotFound:
                pass  # a concurrent request deleted it first
            return None
        return ckpt

    async def _live_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        found = [await self._alive(model_id, c) for c in (await self.store.list_checkpoints(model_id)).values()]
        return sorted((c for c in found if c is not None), key=lambda c: c["time"])

    async def resolve_checkpoint(self, path: str) -> dict[str, Any]:
        model_id, ckpt_id, _kind = parse_tinker_path(path)
        ckpt = await self._alive(model_id, await self.store.get_checkpoint(model_id, ckpt_id))
        if not self._visible(ckpt):
            raise errors.NotFound(f"checkpoint {errors.shown(path)} not found", field="path")
        return ckpt

    async def sampler_weights(self, path: str) -> tuple[str, int]:
        """(adapter, version) of a weights checkpoint (save_weights_for_sampler / save_weights_external) of the
        caller's tenant: what the OpenAI-compatible routes sample when `model` is a tinker:// path."""
        try:
            ckpt = await self.resolve_checkpoint(path)
        except errors.LoraplaneError as exc:
            raise type(exc)(exc.message.replace("path ", "model ", 1), field="model") from None
        if ckpt["checkpoint_type"] == "training":
            raise errors.InvalidArgument(f"model {errors.shown(path)}: a training-state checkpoint "
                                         "(tinker://.../weights/...) cannot be sampled; use the path "
                                         "save_weights_for_sampler returned", field="model")
        return ckpt["adapter"], int(ckpt["version"])

    async def training_checkpoint(self, path: str) -> dict[str, Any]:
        ckpt = await self.resolve_checkpoint(path)
        if ckpt["checkpoint_type"] != "training":
            raise errors.InvalidArgument(
                f"path {errors.shown(path)}: load_weights needs a save_state checkpoint (tinker://.../weights/...), "
                "not sampler weights", field="path")
        return ckpt

    async def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("path", "")
        spec = {"kind": "load_weights", "path": path, "optimizer": bool(body.get("optimizer"))}
        if body.get("model_id"):
            return await self._sequenced(body["model_id"], body.get("seq_id"), spec)
        # create_training_client_from_state: a new model, whose id the SDK computes itself. Every lookup (the
        # session first: the new model lives in it) is made within the caller's tenant before anything is written.
        session_id = body.get("session_id", "")
        await self.require_session(session_id)
        await self.training_checkpoint(path)
        source = await self.model(parse_tinker_path(path)[0])
        model_id = f"{session_id}:train:{num(body.get('model_seq_id', 0), 'model_seq_id', lo=0, hi=INT32_MAX)}"
        now = time.time()
        record = {**source, "model_id": model_id, "adapter": self.adapter_of(model_id), "seq_offset": 1,
                  "session_id": session_id, "created": now, "last_request_time": now,
                  "base_model": await self.check_base_model(body.get("base_model") or source["base_model"]),
                  "user_metadata": body.get("user_metadata") or source.get("user_metadata")}
        await self.store.put_model(model_id, record, nx=True)
        spec.update(kind="create_from_state", model_id=model_id)
        request_id = await self._submit(model_id, 0, spec)
        return {"request_id": request_id, "model_id": model_id}

    async def _run_load_weights(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record, seq = await self._target(spec)
        ckpt = await self._checked(record, seq, lambda: self.training_checkpoint(spec["path"]))
        await self.upstream.load_state(record["adapter"], seq, ckpt["adapter"], ckpt["version"], spec["optimizer"])
        return _json({"type": "load_weights", "path": spec["path"], "model_id": record["model_id"]})

    async def _run_create_from_state(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record = await self.model(spec["model_id"])
        ckpt = await self.resolve_checkpoint(spec["path"])
        # The state's own expert layout (a checkpoint of an older per-expert adapter loads into a per-expert one).
        source = await self.upstream.get_adapter(ckpt["adapter"])
        try:
            await self.upstream.create_adapter(record["adapter"], rank=record["rank"], seed=record["seed"],
                                               alpha=record.get("alpha", 0.0), targets=record["targets"],
                                               metadata={"tinker_model_id": record["model_id"]},
                                               expert_layout=source.expert_layout)
        except errors.AlreadyExists:
            pass  # a re-run of this future after a restart; the LoadState below is deduplicated by its seq_id
        await self.upstream.load_state(record["adapter"], 1, ckpt["adapter"], ckpt["version"], spec["optimizer"])
        return _json({"type": "load_weights", "path": spec["path"], "model_id": record["model_id"]})

    # ---- sampling --------------------------------------------------------------------------------------------
    async def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = body.get("session_id", "")
        await self.require_session(session_id)
        n = num(body.get("sampling_session_seq_id") or 0, "sampling_session_seq_id", lo=0, hi=INT32_MAX)
        sampler_id = f"{session_id}:sample:{n}"
        if body.get("model_path"):
            ckpt = await self.resolve_checkpoint(body["model_path"])
            if ckpt["checkpoint_type"] != "sampler":
                raise errors.InvalidArgument(
                    f"model_path {errors.shown(body['model_path'])}: sampling needs save_weights_for_sampler "
                    "weights (tinker://.../sampler_weights/...)", field="model_path")
            source = await self.model(parse_tinker_path(body["model_path"])[0])
            record = {"sampler_id": sampler_id, "base_model": source["base_model"],
                      "model_path": body["model_path"], "adapter": ckpt["adapter"], "version": ckpt["version"]}
        else:
            base = await self.check_base_model(body.get("base_model"))
            record = {"sampler_id": sampler_id, "base_model": base, "model_path": None, "adapter": "", "version": 0}
        await self.store.put_sampler(sampler_id, record)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    async def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        record = await self.store.get_sampler(sampler_id)
        if not self._visible(record):
            raise errors.NotFound(f"sampler {errors.shown(sampler_id)} not found", field="sampler_id")
        out = {"sampler_id": sampler_id, "base_model": record["base_model"]}
        if record.get("model_path"):
            out["model_path"] = record["model_path"]
        return out

    async def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        sampler_id = body.get("sampling_session_id") or ""
        if not sampler_id:
            raise Unsupported("asample needs a sampling_session_id (base_model / model_path in asample are not "
                              "supported; create a sampling client first)")
        if not self._visible(await self.store.get_sampler(sampler_id)):
            raise errors.NotFound(f"sampling_session_id {errors.shown(sampler_id)} not found",
                                  field="sampling_session_id")
        num_samples = num(body.get("num_samples") or 1, "num_samples")
        if not 1 <= num_samples <= 128:
            raise errors.InvalidArgument(f"num_samples {num_samples}: must be in [1, 128]", field="num_samples")
        for option in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(option):
                raise Unsupported(f"{option} is not supported by loraplane")
        targets = _target_cells(body.get("target_prompt_logprobs"), _prompt_length(body.get("prompt") or {}))
        topk = num(body.get("topk_prompt_logprobs") or 0, "topk_prompt_logprobs")
        if not 0 <= topk <= 20:
            raise errors.InvalidArgument(f"topk_prompt_logprobs {topk}: must be in [0, 20]",
                                         field="topk_prompt_logprobs")
        last_n = body.get("prompt_logprobs_last_n")
        last_n = 0 if last_n is None else num(last_n, "prompt_logprobs_last_n")
        if last_n < 0 or (last_n and not (body.get("prompt_logprobs") or topk)):
            raise errors.InvalidArgument(
                f"prompt_logprobs_last_n {last_n}: must be >= 1 and needs prompt_logprobs or topk_prompt_logprobs",
                field="prompt_logprobs_last_n")
        sampling_spec(body.get("sampling_params") or {}, self.settings.default_max_tokens)  # refused here, not later
        # (sampling session, seq_id) identifies a sample; a request without a seq_id is never deduplicated.
        seq_id = num(body["seq_id"], "seq_id") if body.get("seq_id") is not None else None
        request_id = await self._submit(f"sampler:{sampler_id}", seq_id, {
            "kind": "sample", "sampler_id": sampler_id, "num_samples": num_samples,
            "prompt": body.get("prompt") or {}, "sampling_params": body.get("sampling_params") or {},
            "prompt_logprobs": bool(body.get("prompt_logprobs")), "topk": topk, "last_n": last_n,
            "record": bool(body.get("record_stability_info")), "targets": targets})
        return {"request_id": request_id, "sample_sequence_ids": stability.sequence_ids(request_id, num_samples)}

    async def _run_sample(self, spec: dict[str, Any]) -> tuple[str, bytes]:
        record = await self.store.get_sampler(spec["sampler_id"])
        prompt: list[int] = []
        for i, chunk in enumerate(spec["prompt"].get("chunks") or []):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise errors.InvalidArgument(f"prompt.chunks[{i}]: {chunk.get('type')} chunks are not supported "
                                             "(text only)", field="prompt")
            prompt.extend(num(t, f"prompt.chunks[{i}].tokens", lo=0, hi=INT32_MAX) for t in chunk.get("tokens") or [])
        if spec.get("last_n") and not 1 <= spec["last_n"] <= len(prompt) - 1:
            raise errors.InvalidArgument(f"prompt_logprobs_last_n {spec['last_n']}: must be in [1, "
                                         f"{len(prompt) - 1}] (the prompt has {len(prompt)} tokens)",
                                         field="prompt_logprobs_last_n")
        params = sampling_spec(spec["sampling_params"], self.settings.default_max_tokens)
        result = await self.upstream.sample(record["adapter"], record["version"], prompt, spec["num_samples"],
                                            params, spec["prompt_logprobs"], topk_prompt_logprobs=spec.get("topk", 0),
                                            prompt_logprobs_last_n=spec.get("last_n", 0))
        if record["version"] and result.served_version != record["version"]:
            raise errors.Unavailable(f"sampler served version {result.served_version}, "
                                     f"pinned {record['version']}")
        if spec.get("targets"):
            result.target_prompt = await self._target_logprobs(record, prompt, spec["targets"])
        if spec.get("record"):
            ids = stability.sequence_ids(spec["request_id"], spec["num_samples"])
            records = stability.records_of(
                result, ids, session_id=spec["sampler_id"].rpartition(":sample:")[0], adapter=record["adapter"],
                engine=await self.upstream.sampler_engine(), prompt_length=len(prompt))
            limit = self.settings.stability_max_bytes_per_tenant
            if sum(len(r) for r in records.values()) > limit:
                raise errors.ResourceExhausted(
                    f"record_stability_info: this sample's records exceed the tenant's {limit} bytes; sample fewer "
                    "or shorter sequences", field="record_stability_info")
            await self.store.put_sequences(records, ttl_s=self.settings.stability_ttl_s, max_bytes=limit)
        return PROTO, tinker_codec.encode_sample(result)

    async def _target_logprobs(self, record: dict[str, Any], prompt: list[int], targets: dict[str, Any]) -> dict:
        """The logprob of each requested token at its prompt position: one prefill of `prompt[:row + 1] + [token]`
        per distinct cell, scoring only its last token (the sampler's prompt logprobs are the unmodified model
        distribution, as Tinker's are), on the same pinned version."""
        import asyncio

        gate = asyncio.Semaphore(8)
        params = SamplingSpec(max_tokens=1)

        async def score(row: int, token: int) -> float:
            async with gate:
                out = await self.upstream.sample(record["adapter"], record["version"], prompt[:row + 1] + [token], 1,
                                                 params, True, prompt_logprobs_last_n=1)
            if record["version"] and out.served_version != record["version"]:
                raise errors.Unavailable(f"sampler served version {out.served_version}, pinned {record['version']}")
            return float(out.prompt_logprobs[-1])
        cells = [tuple(c) for c in targets["cells"]]
        distinct = sorted({(r, t) for r, _c, t in cells})
        scored = dict(zip(distinct, await asyncio.gather(*(score(r, t) for r, t in distinct)), strict=True))
        rows, k = targets["shape"]
        if targets.get("crow") is not None:
            return {"shape": [rows, k], "values": [scored[(r, t)] for r, _c, t in cells],
                    "crow": targets["crow"], "col": targets["col"]}
        dense = [0.0] * (rows * k)
        for r, c, t in cells:
            dense[r * k + c] = scored[(r, t)]
        return {"shape": [rows, k], "values": dense, "crow": None, "col": None}

    # ---- REST ------------------------------------------------------------------------------------------------
    async def capabilities(self) -> dict[str, Any]:
        info = await self.upstream.info()
        return {"supported_models": [{"model_name": n, "max_context_length": info.max_context_length or None,
                                      "trainable": True, "sampleable": True} for n in await self.base_names()]}

    def _checkpoint_json(self, ckpt: dict[str, Any]) -> dict[str, Any]:
        out = {k: ckpt.get(k) for k in ("checkpoint_id", "checkpoint_type", "tinker_path", "size_bytes",
                                         "user_metadata")}
        out["time"] = _iso(ckpt["time"])
        out["public"] = False
        if ckpt.get("expires_at"):
            out["expires_at"] = _iso(ckpt["expires_at"])
        return out

    async def training_run(self, model_id: str) -> dict[str, Any]:
        record = await self.model(model_id)
        ckpts = await self._live_checkpoints(model_id)
        last = {t: self._checkpoint_json(c) for c in ckpts for t in [c["checkpoint_type"]]}
        metadata = record.get("user_metadata")
        return {"training_run_id": model_id, "base_model": record["base_model"],
                "model_owner": record["adapter"].split("/", 1)[0], "is_lora": True, "lora_rank": record["rank"],
                "corrupted": False,
                "last_request_time": _iso(await self.store.last_request_time(model_id) or record["created"]),
                "last_checkpoint": last.get("training"), "last_sampler_checkpoint": last.get("sampler"),
                "user_metadata": {str(k): str(v) for k, v in metadata.items()} if metadata else None}

    async def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        # The store lists (and counts) the caller's tenant's runs only.
        ids, total = await self.store.list_models(offset, limit)
        ids = [i for i in ids if self._visible(await self.store.get_model(i))]
        return {"training_runs": [await self.training_run(i) for i in ids],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    async def checkpoints(self, model_id: str) -> dict[str, Any]:
        await self.model(model_id)
        ckpts = await self._live_checkpoints(model_id)
        return {"checkpoints": [self._checkpoint_json(c) for c in ckpts]}

    async def user_checkpoints(self, limit: int, offset: int) -> dict[str, Any]:
        rows, total = await self.store.list_all_checkpoints(offset, limit)
        out = []
        for model_id, ckpt_id in rows:
            ckpt = await self._alive(model_id, await self.store.get_checkpoint(model_id, ckpt_id))
            if ckpt and self._visible(ckpt):
                out.append(self._checkpoint_json(ckpt))
        return {"checkpoints": out, "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    async def delete_checkpoint(self, model_id: str, ckpt_id: str) -> None:
        ckpt = await self.store.get_checkpoint(model_id, ckpt_id)
        if not self._visible(ckpt):
            raise errors.NotFound(f"checkpoint {errors.shown(model_id)}/{errors.shown(ckpt_id)} not found",
                                  field="checkpoint_id")
        try:
            await self.upstream.delete_version(ckpt["adapter"], ckpt["version"])
        except errors.NotFound:
            pass
        await self.store.delete_checkpoint(model_id, ckpt_id)

    async def weights_info(self, path: str) -> dict[str, Any]:
        ckpt = await self.resolve_checkpoint(path)
        record = await self.model(parse_tinker_path(path)[0])
        del ckpt
        return {"base_model": record["base_model"], "is_lora": True, "lora_rank": record["rank"],
                "train_unembed": record.get("train_unembed", False), "train_mlp": record.get("train_mlp", True),
                "train_attn": record.get("train_attn", True)}


def _prompt_length(prompt: dict[str, Any]) -> int:
    return sum(len(c.get("tokens") or []) for c in prompt.get("chunks") or [] if isinstance(c, dict))


def _target_cells(tensor: Any, prompt_length: int) -> dict[str, Any] | None:
    """target_prompt_logprobs (the SDK's JSON TensorData, dense or CSR, shape [len(prompt) - 1, K], -1 = nothing
    asked) -> {"shape", "cells": [[row, col, token]...], "crow", "col"}; None when absent."""
    if tensor is None:
        return None
    field = "target_prompt_logprobs"
    if not isinstance(tensor, dict) or not isinstance(tensor.get("data"), list):
        raise errors.InvalidArgument(f"{field}: expected a TensorData", field=field)
    shape = tensor.get("shape") or []
    if not isinstance(shape, list) or len(shape) != 2 or num(shape[0], f"{field}.shape") != prompt_length - 1 or num(shape[1], f"{field}.shape") < 1:
        raise errors.InvalidArgument(f"{field}: shape {errors.shown(shape)} must be [len(prompt) - 1, K] = "
                                     f"[{prompt_length - 1}, K]", field=field)
    rows, k = int(shape[0]), int(shape[1])
    data = [num(v, f"{field}.data", lo=-1, hi=INT32_MAX) for v in tensor["data"]]
    crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
    cells = []
    if crow is not None:
        if not isinstance(crow, list) or not isinstance(col or [], list):
            raise errors.InvalidArgument(f"{field}: CSR indices must be lists", field=field)
        crow = [num(v, f"{field}.sparse_crow_indices", lo=0, hi=INT32_MAX) for v in crow]
        col = [num(v, f"{field}.sparse_col_indices", lo=0, hi=INT32_MAX) for v in col or []]
        if (len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(data) or len(col) != len(data)
                or any(b < a for a, b in itertools.pairwise(crow)) or any(not 0 <= c < k for c in col)):
            raise errors.InvalidArgument(f"{field}: inconsistent CSR indices", field=field)
        cells = [[r, col[j], data[j]] for r in range(rows) for j in range(crow[r], crow[r + 1])]
    else:
        if len(data) != rows * k:
            raise errors.InvalidArgument(f"{field}: {len(data)} values for shape [{rows}, {k}]", field=field)
        cells = [[i // k, i % k, t] for i, t in enumerate(data) if t != -1]
    if any(t < -1 for _r, _c, t in cells):
        raise errors.InvalidArgument(f"{field}: token ids must be >= 0 (-1 = nothing asked)", field=field)
    if crow is not None and any(t == -1 for _r, _c, t in cells):
        raise errors.InvalidArgument(f"{field}: a listed CSR cell must name a token", field=field)
    if len(cells) > MAX_TARGET_CELLS:
        raise errors.InvalidArgument(f"{field}: {len(cells)} cells asked; at most {MAX_TARGET_CELLS} per request",
                                     field=field)
    return {"shape": [rows, k], "cells": cells, "crow": crow, "col": col if crow is not None else None}

