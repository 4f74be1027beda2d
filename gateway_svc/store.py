"""Everything the gateway remembers, in Redis: sessions, training models (Tinker model_id -> loraplane adapter),
sampling sessions, tinker:// checkpoints, request dedup keys and futures. No gateway replica holds state of its own,
so replicas behind one load balancer agree and a restarted gateway carries on.

Tenant isolation lives here, in one place: every Redis key is built by `k()`, and `k()` puts the calling tenant's
namespace in front of it (`<prefix>t:<tenant>:<kind>:...`). A record is therefore reachable only by requests of the
tenant that wrote it; another tenant's lookup of the same id reads a key that does not exist and gets exactly the
answer a never-issued id gets. A new record type gets this for free as long as it builds its keys with `k()`; no
code outside this module may build a Redis key."""

from __future__ import annotations

import json
import time
from typing import Any

from loraplane import auth
from loraplane.redis_pool import async_redis


def tenant_of(caller: auth.Identity, default_tenant: str) -> str:
    """The namespace a gateway caller acts in: a tenant key's tenant; anyone else (admin and service keys, the open
    mode, a future run for such a caller) the configured default tenant, whose adapters its requests create."""
    return caller.tenant if caller.role == auth.ROLE_TENANT and caller.tenant else default_tenant


class Store:
    def __init__(self, url: str, prefix: str = "lpgw:", *, future_ttl_s: int = 24 * 3600,
                 default_tenant: str = "tinker"):
        self.redis = async_redis(url, decode_responses=False)
        self.prefix = prefix
        self.future_ttl_s = future_ttl_s
        self.default_tenant = default_tenant
        self._signing_secret: bytes | None = None

    def tenant(self) -> str:
        """The tenant of the request (or future) this task serves: the caller set by the app's authentication."""
        return tenant_of(auth.current_caller(), self.default_tenant)

    def k(self, *parts: object) -> str:
        """The Redis key of a record of the current caller's tenant (the only way a key is made)."""
        return f"{self.prefix}t:{self.tenant()}:" + ":".join(str(p) for p in parts)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # ---- generic JSON records --------------------------------------------------------------------------------
    async def _put(self, key: str, value: dict[str, Any], *, nx: bool = False, ttl: int | None = None) -> bool:
        return bool(await self.redis.set(key, json.dumps(value), nx=nx, ex=ttl))

    async def _get(self, key: str) -> dict[str, Any] | None:
        raw = await self.redis.get(key)
        return None if raw is None else json.loads(raw)

    # ---- sessions ---------------------------------------------------------------------------------------------
    async def create_session(self, session_id: str, record: dict[str, Any]) -> None:
        await self._put(self.k("session", session_id), record)
        await self.redis.zadd(self.k("sessions"), {session_id: record.get("created", time.time())}, nx=True)

    async def list_sessions(self, offset: int, limit: int) -> tuple[list[str], int]:
        """The caller's tenant's session ids, newest first, and how many there are."""
        total = int(await self.redis.zcard(self.k("sessions")))
        ids = await self.redis.zrevrange(self.k("sessions"), offset, offset + limit - 1) if limit > 0 else []
        return [i.decode() for i in ids], total

    async def session_members(self, session_id: str) -> tuple[list[str], list[str]]:
        """The training model ids and sampling session ids made in the caller's tenant's session, oldest first."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrange(self.k("session-models", session_id), 0, -1)
            pipe.zrange(self.k("session-samplers", session_id), 0, -1)
            models, samplers = await pipe.execute()
        return [m.decode() for m in models], [s.decode() for s in samplers]

    async def get_session(self, session_id: str) -> dict[str, Any] | None:
        return await self._get(self.k("session", session_id))

    async def touch_session(self, session_id: str, **fields: Any) -> bool:
        record = await self.get_session(session_id)
        if record is None:
            return False
        record.update(fields, last_seen=time.time())
        await self.create_session(session_id, record)
        return True

    # ---- training models (runs) -------------------------------------------------------------------------------
    async def put_model(self, model_id: str, record: dict[str, Any], *, nx: bool = False) -> bool:
        ok = await self._put(self.k("model", model_id), record, nx=nx)
        if ok:
            created = record.get("created", time.time())
            await self.redis.zadd(self.k("models"), {model_id: created}, nx=True)
            if record.get("session_id"):
                await self.redis.zadd(self.k("session-models", record["session_id"]), {model_id: created}, nx=True)
        return ok

    async def get_model(self, model_id: str) -> dict[str, Any] | None:
        return await self._get(self.k("model", model_id))

    async def get_model_touched(self, model_id: str) -> dict[str, Any] | None:
        """The model's record, noting the time of this request (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.k("model", model_id))
            pipe.set(self.k("lastreq", model_id), str(time.time()), ex=self.future_ttl_s * 30)
            raw, _ = await pipe.execute()
        return None if raw is None else json.loads(raw)

    async def last_request_time(self, model_id: str) -> float | None:
        raw = await self.redis.get(self.k("lastreq", model_id))
        return None if raw is None else float(raw)

    async def list_models(self, offset: int, limit: int) -> tuple[list[str], int]:
        total = int(await self.redis.zcard(self.k("models")))
        ids = await self.redis.zrevrange(self.k("models"), offset, offset + limit - 1) if limit > 0 else []
        return [i.decode() for i in ids], total

    # ---- checkpoints (tinker:// paths) -------------------------------------------------------------------------
    async def put_checkpoint(self, model_id: str, ckpt_id: str, record: dict[str, Any]) -> None:
        await self.redis.hset(self.k("ckpts", model_id), ckpt_id, json.dumps(record))
        await self.redis.zadd(self.k("allckpts"), {f"{model_id}\n{ckpt_id}": record.get("time", time.time())})

    async def get_checkpoint(self, model_id: str, ckpt_id: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self.k("ckpts", model_id), ckpt_id)
        return None if raw is None else json.loads(raw)

    async def list_checkpoints(self, model_id: str) -> dict[str, dict[str, Any]]:
        raw = await self.redis.hgetall(self.k("ckpts", model_id))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    async def list_all_checkpoints(self, offset: int, limit: int) -> tuple[list[tuple[str, str]], int]:
        total = int(await self.redis.zcard(self.k("allckpts")))
        rows = await self.redis.zrevrange(self.k("allckpts"), offset, offset + limit - 1) if limit > 0 else []
        return [tuple(r.decode().split("\n", 1)) for r in rows], total

    async def delete_checkpoint(self, model_id: str, ckpt_id: str) -> bool:
        await self.redis.zrem(self.k("allckpts"), f"{model_id}\n{ckpt_id}")
        return bool(await self.redis.hdel(self.k("ckpts", model_id), ckpt_id))

    # ---- sampling sessions ------------------------------------------------------------------------------------
    async def put_sampler(self, sampler_id: str, record: dict[str, Any]) -> None:
        await self._put(self.k("sampler", sampler_id), record)
        session_id = sampler_id.rpartition(":sample:")[0]
        if session_id:
            await self.redis.zadd(self.k("session-samplers", session_id), {sampler_id: time.time()}, nx=True)

    async def get_sampler(self, sampler_id: str) -> dict[str, Any] | None:
        return await self._get(self.k("sampler", sampler_id))

    # ---- recorded sampling (record_stability_info) ---------------------------------------------------------------
    # One hash of records per tenant (field = sequence_id), a sorted set of their last-use times and a byte counter,
    # kept consistent by these scripts. A record lives `ttl` seconds after its last use; past the tenant's byte
    # bound the least recently used records are evicted (an RL run trains on its newest samples: evicting the
    # oldest keeps a long run going where refusing new samples would stop it).
    _PUT_SEQUENCES = """
    local recs, lru, bytes = KEYS[1], KEYS[2], KEYS[3]
    local now, ttl, bound = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
    local function drop(id)
      local size = redis.call('HSTRLEN', recs, id)
      redis.call('HDEL', recs, id)
      redis.call('ZREM', lru, id)
      if size > 0 then redis.call('DECRBY', bytes, size) end
    end
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', lru, '-inf', now - ttl)) do drop(id) end
    for i = 4, #ARGV, 2 do
      local id, rec = ARGV[i], ARGV[i + 1]
      if redis.call('HEXISTS', recs, id) == 1 then drop(id) end
      redis.call('HSET', recs, id, rec)
      redis.call('ZADD', lru, now, id)
      redis.call('INCRBY', bytes, #rec)
    end
    local evicted = 0
    while tonumber(redis.call('GET', bytes) or '0') > bound do
      local oldest = redis.call('ZRANGE', lru, 0, 0)
      if #oldest == 0 then redis.call('SET', bytes, 0) break end
      drop(oldest[1])
      evicted = evicted + 1
    end
    for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl) end
    return evicted
    """
    _GET_SEQUENCES = """
    local recs, lru, hits = KEYS[1], KEYS[2], KEYS[3]
    local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
    local out = {}
    for i = 3, #ARGV do
      local id = ARGV[i]
      local last = redis.call('ZSCORE', lru, id)
      local rec = false
      if last and tonumber(last) > now - ttl then
        rec = redis.call('HGET', recs, id)
        if rec then
          redis.call('ZADD', lru, now, id)
          redis.call('INCR', hits)
        end
      end
      out[#out + 1] = rec
    end
    for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl) end
    return out
    """

    def _sequence_keys(self) -> list[str]:
        return [self.k("seqrec"), self.k("seqlru"), self.k("seqbytes"), self.k("seqhits")]

    async def put_sequences(self, records: dict[str, bytes], *, ttl_s: int, max_bytes: int) -> int:
        """Stores the caller's tenant's sampled-sequence records; returns how many old ones were evicted."""
        args: list[Any] = [time.time(), ttl_s, max_bytes]
        for sequence_id, record in records.items():
            args += [sequence_id, record]
        return int(await self.redis.eval(self._PUT_SEQUENCES, 3, *self._sequence_keys()[:3], *args))

    async def get_sequences(self, sequence_ids: list[str], *, ttl_s: int) -> dict[str, bytes]:
        """The caller's tenant's live records among `sequence_ids` (each found one counts as used now)."""
        if not sequence_ids:
            return {}
        keys = [self._sequence_keys()[i] for i in (0, 1, 3)]
        found = await self.redis.eval(self._GET_SEQUENCES, 3, *keys, time.time(), ttl_s, *sequence_ids)
        return {i: r for i, r in zip(sequence_ids, found, strict=True) if r}

    async def sequence_stats(self) -> dict[str, int]:
        """The caller's tenant's records: how many, their bytes, and how many times a record was used (the count
        of trained sequence lookups; operators and tests read it)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hlen(self.k("seqrec"))
            pipe.get(self.k("seqbytes"))
            pipe.get(self.k("seqhits"))
            count, size, hits = await pipe.execute()
        return {"records": int(count), "bytes": int(size or 0), "hits": int(hits or 0)}

    # ---- signed download URLs ----------------------------------------------------------------------------------
    async def signing_secret(self) -> bytes:
        """The HMAC key of the gateway's signed download URLs, shared by every replica. The one key that is not a
        tenant's record: it lives beside the tenants' namespaces (`<prefix>gateway:`, never under `t:`), so no
        tenant's id can name it."""
        import secrets

        if self._signing_secret is None:  # made once, never changed: read once per process
            key = f"{self.prefix}gateway:url-signing-secret"
            await self.redis.set(key, secrets.token_bytes(32), nx=True)
            self._signing_secret = bytes(await self.redis.get(key))
        return self._signing_secret

    # ---- request dedup ----------------------------------------------------------------------------------------
    async def claim_request(self, scope: str, seq_id: int, request_id: str) -> str:
        """The request id that owns (scope, seq_id): `request_id` if this call claimed it, else the first one's."""
        key = self.k("seq", scope, seq_id)
        if await self.redis.set(key, request_id, nx=True, ex=self.future_ttl_s):
            return request_id
        existing = await self.redis.get(key)
        return existing.decode() if existing is not None else request_id

    # ---- futures ----------------------------------------------------------------------------------------------
    async def create_future(self, request_id: str, spec: dict[str, Any], owner: str, lease_s: float) -> bool:
        """Records a pending future and takes its lease, in one round trip. True if the lease was taken."""
        key = self.k("future", request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={"state": "pending", "spec": json.dumps(spec), "created": str(time.time())})
            pipe.expire(key, self.future_ttl_s)
            pipe.set(self.k("lease", request_id), owner, nx=True, px=int(lease_s * 1000))
            return bool((await pipe.execute())[2])

    async def finish_future(self, request_id: str, state: str, content_type: str, body: bytes) -> None:
        """Stores the outcome and releases the lease, in one round trip."""
        key = self.k("future", request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={"state": state, "content_type": content_type, "body": body})
            pipe.expire(key, self.future_ttl_s)
            pipe.delete(self.k("lease", request_id))
            await pipe.execute()

    async def get_future(self, request_id: str) -> dict[str, bytes] | None:
        raw = await self.redis.hgetall(self.k("future", request_id))
        return {k.decode(): v for k, v in raw.items()} if raw else None

    async def take_lease(self, request_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self.redis.set(self.k("lease", request_id), owner, nx=True, px=int(ttl_s * 1000)))

    async def renew_lease(self, request_id: str, owner: str, ttl_s: float) -> None:
        await self.redis.set(self.k("lease", request_id), owner, px=int(ttl_s * 1000))
