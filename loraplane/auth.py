"""Identities, API keys, tenant scopes and quotas: the domain side of authentication (no grpc here).

A key is `lpk_<key_id>_<secret>`; Redis keeps only the SHA-256 of the whole key (a 256-bit random secret needs no
slow hash), its tenant, role and state, under the cluster's key prefix:

    {prefix}auth:key:<key_id>     hash  sha256, tenant, role, description, created_ms, revoked_ms
    {prefix}auth:keys             set   every key id ever issued
    {prefix}auth:quota:<tenant>   hash  max_adapters, max_stored_bytes, max_queued_requests, max_concurrent_samples

Roles: `admin` reaches everything; `tenant` reaches adapter names under `<tenant>/` only; `service` (the trainer
and the sampler talking to the registry) reaches every namespace, narrowed to one tenant's while it acts for a
tenant's request (`acting_for`). The transport (loraplane.rpc) turns the `authorization` metadata into an
`Identity` with an `Authenticator`; servicers pass it to the domain, which calls `authorize`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

from loraplane import errors

log = logging.getLogger(__name__)

ROLE_ADMIN = "admin"
ROLE_TENANT = "tenant"
ROLE_SERVICE = "service"
ROLES = (ROLE_ADMIN, ROLE_TENANT, ROLE_SERVICE)

KEY_PREFIX = "lpk_"
# The Tinker SDK refuses a key that does not start with this; `tml-lpk_...` is the same key as `lpk_...`.
TINKER_KEY_PREFIX = "tml-"
TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}\Z")
_KEY_RE = re.compile(r"^lpk_([0-9a-f]{16})_([A-Za-z0-9_-]{20,100})\Z")
# Revocation and quota changes reach every server within this many seconds.
CACHE_TTL_S = 0.5
ACTING_FOR_HEADER = "x-loraplane-acting-for"
# The audit stream (a Redis Stream under the key prefix): deletes, alias moves, key changes, denials.
AUDIT_STREAM = "auth:audit"
AUDIT_MAX_ENTRIES = 100_000


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; 0 = unlimited."""

    max_adapters: int = 0
    max_stored_bytes: int = 0
    max_queued_requests: int = 0
    max_concurrent_samples: int = 0

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


@dataclass(frozen=True)
class Identity:
    key_id: str
    tenant: str
    role: str
    quotas: Quotas = Quotas()
    # Set when a service key acts for one tenant's request: the service is then held to that tenant's scope.
    acting_for: str = ""

    @property
    def scope(self) -> str | None:
        """The name prefix this caller is confined to, or None for the whole cluster."""
        if self.role == ROLE_TENANT:
            return f"{self.tenant}/"
        if self.role == ROLE_SERVICE and self.acting_for:
            return f"{self.acting_for}/"
        return None

    @property
    def scoped_tenant(self) -> str:
        """The tenant whose quotas apply to this caller ('' = none)."""
        scope = self.scope
        return scope[:-1] if scope else ""

    def may_see(self, name: str) -> bool:
        scope = self.scope
        return scope is None or name.startswith(scope)

    def authorize(self, name: str, field: str = "name") -> None:
        """PERMISSION_DENIED unless `name` lies in this caller's scope. Checked before any lookup, so the answer is
        the same whether or not the name exists, and the message names only the caller's own namespace."""
        if not self.may_see(name):
            # For the audit record only (admins read it); the caller's message never names it.
            _denied_target.set(name)
            raise errors.PermissionDenied(
                f"{field}: this key may only reach adapters named {self.scope}*", field=field)

    def require_admin(self, what: str) -> None:
        if self.role != ROLE_ADMIN:
            raise errors.PermissionDenied(f"{what} needs an admin key")

    def require_service(self, what: str) -> None:
        """PERMISSION_DENIED for a tenant's key: `what` is between the services of one deployment (and operators)."""
        if self.role not in (ROLE_SERVICE, ROLE_ADMIN):
            raise errors.PermissionDenied(f"{what} needs a service key")

    def narrow_prefix(self, prefix: str) -> str | None:
        """The listing prefix to use for a caller asking for `prefix`: the caller's scope when the prefix is
        broader, the prefix itself when narrower, None when the two are disjoint (the answer is empty)."""
        scope = self.scope
        if scope is None or prefix.startswith(scope):
            return prefix
        if scope.startswith(prefix):
            return scope
        return None


# Open mode: every caller is this anonymous admin (no key store configured).
OPEN = Identity(key_id="", tenant="", role=ROLE_ADMIN)

_caller: contextvars.ContextVar[Identity] = contextvars.ContextVar("loraplane_caller", default=OPEN)
_denied_target: contextvars.ContextVar[str] = contextvars.ContextVar("loraplane_denied_target", default="")


def denied_target() -> str:
    """The name the current RPC was last refused (PERMISSION_DENIED) for, '' if none."""
    return _denied_target.get()


def current_caller() -> Identity:
    """The identity of the RPC this task serves (set by the server interceptor), OPEN outside any RPC."""
    return _caller.get()


def set_caller(identity: Identity) -> contextvars.Token:
    return _caller.set(identity)


def acting_for_value() -> str:
    """What a service's outgoing call says it acts for: the tenant of the request being served, if it is one."""
    caller = _caller.get()
    if caller.role == ROLE_TENANT:
        return caller.tenant
    if caller.role == ROLE_SERVICE and caller.acting_for:
        return caller.acting_for
    return ""


def audit_entry(identity: Identity | None, action: str, target: str = "", outcome: str = "ok",
                detail: str = "", actor: str = "") -> dict[str, str]:
    """One audit record: who (key id, tenant, role, acting_for), did what to which name, and how it ended."""
    entry = {"time_ms": str(int(time.time() * 1000)), "action": action, "target": target[:256],
             "outcome": outcome, "detail": detail[:512]}
    if identity is not None:
        entry.update({"key_id": identity.key_id or "open", "tenant": identity.tenant, "role": identity.role,
                      "acting_for": identity.acting_for})
    if actor:
        entry["actor"] = actor
    return entry


async def append_audit(redis, key_prefix: str, entry: dict[str, str]) -> None:
    """Appends to the audit stream; a failure is logged, not raised (the audited operation already happened)."""
    try:
        await redis.xadd(key_prefix + AUDIT_STREAM, entry, maxlen=AUDIT_MAX_ENTRIES, approximate=True)
    except Exception as exc:  # noqa: BLE001 - any Redis failure: the record is lost, the operation stands
        log.warning("audit record lost (%s): %s", exc, entry)


def validate_tenant(tenant: str, field: str = "tenant") -> str:
    if not TENANT_RE.match(tenant or ""):
        raise errors.InvalidArgument(f"{field}: {errors.shown(tenant)} is not a tenant name ([a-z0-9][a-z0-9._-]"
                                     "{0,62})", field=field)
    return tenant


def validate_role(role: str) -> str:
    if role not in ROLES:
        raise errors.InvalidArgument(f"role: {errors.shown(role)} is not one of {', '.join(ROLES)}", field="role")
    return role


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRecord:
    key_id: str
    tenant: str
    role: str
    description: str
    created_ms: int
    revoked_ms: int = 0


class TenantCounter:
    """Counts a tenant's work in progress against one of its quotas (queued training requests, running samples).
    Per process: each trainer / sampler enforces its own share."""

    def __init__(self, quota: str):
        self.quota = quota
        self._counts: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, caller: Identity) -> Iterator[None]:
        tenant = caller.scoped_tenant
        limit = getattr(caller.quotas, self.quota)
        if not tenant or not limit:
            yield
            return
        if self._counts.get(tenant, 0) >= limit:
            raise errors.ResourceExhausted(
                f"quota {self.quota}: tenant {tenant!r} already has {limit} in progress (its quota); retry later",
                reason="QUOTA_EXCEEDED", field=self.quota)
        self._counts[tenant] = self._counts.get(tenant, 0) + 1
        try:
            yield
        finally:
            self._counts[tenant] -= 1
            if not self._counts[tenant]:
                del self._counts[tenant]


def quota_exceeded(quota: str, tenant: str, used: int, limit: int, unit: str = "") -> errors.ResourceExhausted:
    return errors.ResourceExhausted(f"quota {quota}: tenant {tenant!r} would have {used}{unit}, its quota is "
                                    f"{limit}{unit}", reason="QUOTA_EXCEEDED", field=quota)


class KeyStore:
    """API keys and quotas in Redis (redis-py's asyncio client)."""

    def __init__(self, redis_url: str, key_prefix: str = "lp:"):
        if not redis_url:
            raise errors.FailedPrecondition("authentication needs a Redis server: LORAPLANE_REDIS_URL is empty")
        from loraplane.redis_pool import async_redis

        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.prefix = key_prefix + "auth:"
        self.redis = async_redis(redis_url, decode_responses=True, socket_timeout=5, socket_connect_timeout=3)

    async def close(self) -> None:
        await self.redis.aclose()

    @contextlib.contextmanager
    def _redis_errors(self):
        import redis.exceptions

        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise errors.Unavailable(f"key store (Redis at {self.redis_url}) is unavailable: {exc}",
                                     reason="REDIS_UNAVAILABLE") from None

    async def create_key(self, tenant: str, role: str = ROLE_TENANT, description: str = "") -> tuple[KeyRecord, str]:
        """A new key: its record and the key itself, which exists nowhere else afterwards."""
        validate_tenant(tenant)
        validate_role(role)
        key_id = secrets.token_hex(8)
        token = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        record = KeyRecord(key_id, tenant, role, description[:256], int(time.time() * 1000))
        with self._redis_errors():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self.prefix + f"key:{key_id}", mapping={
                    "sha256": _digest(token), "tenant": tenant, "role": role, "description": record.description,
                    "created_ms": record.created_ms, "revoked_ms": 0})
                pipe.sadd(self.prefix + "keys", key_id)
                await pipe.execute()
        await self.audit(audit_entry(None, "CreateKey", key_id, detail=f"tenant={tenant} role={role}",
                                     actor=_operator()))
        return record, token

    async def audit(self, entry: dict[str, str]) -> None:
        await append_audit(self.redis, self.key_prefix, entry)

    async def read_audit(self, count: int = 100) -> list[dict[str, str]]:
        """The newest `count` audit records, oldest first."""
        with self._redis_errors():
            rows = await self.redis.xrevrange(self.key_prefix + AUDIT_STREAM, "+", "-", count=count)
        return [{"id": entry_id, **fields} for entry_id, fields in reversed(rows)]

    async def list_keys(self, tenant: str = "", include_revoked: bool = False) -> list[KeyRecord]:
        with self._redis_errors():
            ids = sorted(await self.redis.smembers(self.prefix + "keys"))
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hgetall(self.prefix + f"key:{key_id}")
                rows = await pipe.execute()
        records = [KeyRecord(key_id, row["tenant"], row["role"], row.get("description", ""),
                             int(row.get("created_ms") or 0), int(row.get("revoked_ms") or 0))
                   for key_id, row in zip(ids, rows, strict=True) if row]
        return [r for r in records if (include_revoked or not r.revoked_ms) and (not tenant or r.tenant == tenant)]

    async def revoke(self, key_id: str) -> bool:
        """True when the key existed and was active. Servers stop accepting it within CACHE_TTL_S."""
        key = self.prefix + f"key:{key_id}"
        with self._redis_errors():
            if not re.fullmatch(r"[0-9a-f]{16}", key_id or "") or not await self.redis.exists(key):
                return False
            if int(await self.redis.hget(key, "revoked_ms") or 0):
                return False
            await self.redis.hset(key, "revoked_ms", int(time.time() * 1000))
            # Only the record of its existence stays: the digest goes, so the key can never be accepted again.
            await self.redis.hdel(key, "sha256")
        await self.audit(audit_entry(None, "RevokeKey", key_id, actor=_operator()))
        return True

    async def lookup(self, token: str) -> KeyRecord | None:
        match = _KEY_RE.match(token or "")
        if not match:
            return None
        with self._redis_errors():
            row = await self.redis.hgetall(self.prefix + f"key:{match.group(1)}")
        if not row or int(row.get("revoked_ms") or 0) or not row.get("sha256"):
            return None
        if not hmac.compare_digest(row["sha256"], _digest(token)):
            return None
        return KeyRecord(match.group(1), row["tenant"], row["role"], row.get("description", ""),
                         int(row.get("created_ms") or 0))

    async def get_quotas(self, tenant: str) -> Quotas:
        with self._redis_errors():
            row = await self.redis.hgetall(self.prefix + f"quota:{tenant}")
        return Quotas(**{name: int(row.get(name) or 0) for name in Quotas.names()})

    async def set_quotas(self, tenant: str, **values: int) -> Quotas:
        validate_tenant(tenant)
        unknown = sorted(set(values) - set(Quotas.names()))
        if unknown:
            raise errors.InvalidArgument(f"unknown quotas {unknown}; known: {Quotas.names()}", field="quota")
        for name, value in values.items():
            if value < 0:
                raise errors.InvalidArgument(f"{name}: {value} must be >= 0 (0 = unlimited)", field=name)
        if values:
            with self._redis_errors():
                await self.redis.hset(self.prefix + f"quota:{tenant}", mapping=values)
        return await self.get_quotas(tenant)

    async def list_quotas(self) -> dict[str, Quotas]:
        with self._redis_errors():
            keys = [k async for k in self.redis.scan_iter(match=self.prefix + "quota:*", count=500)]
        return {key.rsplit(":", 1)[1]: await self.get_quotas(key.rsplit(":", 1)[1]) for key in sorted(keys)}


def _operator() -> str:
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no user name in this environment
        return "cli"


def tinker_api_key(token: str) -> str:
    """The form of a key the Tinker SDK accepts (TINKER_API_KEY)."""
    return TINKER_KEY_PREFIX + token


def strip_tinker_prefix(token: str) -> str:
    """`tml-lpk_...` -> `lpk_...`; anything else unchanged."""
    if token.startswith(TINKER_KEY_PREFIX) and token[len(TINKER_KEY_PREFIX):].startswith(KEY_PREFIX):
        return token[len(TINKER_KEY_PREFIX):]
    return token


class Authenticator:
    """Turns the `authorization` metadata of a call into an Identity. Lookups are cached for CACHE_TTL_S, so a
    revocation takes effect within a second while a busy server asks Redis about each key only twice a second."""

    def __init__(self, keys: KeyStore | None):
        self.keys = keys
        self._cache: dict[str, tuple[float, KeyRecord | None]] = {}
        self._quotas: dict[str, tuple[float, Quotas]] = {}

    @property
    def open(self) -> bool:
        return self.keys is None

    async def close(self) -> None:
        if self.keys is not None:
            await self.keys.close()

    async def _record(self, token: str) -> KeyRecord | None:
        digest = _digest(token)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            return cached[1]
        record = await self.keys.lookup(token)
        if len(self._cache) > 10_000:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[digest] = (now + CACHE_TTL_S, record)
        return record

    async def quotas(self, tenant: str) -> Quotas:
        now = time.monotonic()
        cached = self._quotas.get(tenant)
        if cached is not None and cached[0] > now:
            return cached[1]
        quotas = await self.keys.get_quotas(tenant)
        self._quotas[tenant] = (now + CACHE_TTL_S, quotas)
        return quotas

    async def audit_denial(self, identity: Identity | None, method: str, code: str, detail: str,
                           target: str = "") -> None:
        if self.keys is not None:
            await self.keys.audit(audit_entry(identity, method, target, outcome=code, detail=detail))

    async def authenticate(self, authorization: str | None, acting_for: str | None = None) -> Identity:
        if self.keys is None:
            return OPEN
        token = (authorization or "").strip()
        if token.lower().startswith("bearer "):
            token = token[7:].strip()
        token = strip_tinker_prefix(token)
        if not token:
            raise errors.Unauthenticated("missing API key: send `authorization: Bearer <key>` (LORAPLANE_API_KEY)")
        record = await self._record(token)
        if record is None:
            raise errors.Unauthenticated("unknown or revoked API key")
        if record.role == ROLE_SERVICE and acting_for:
            validate_tenant(acting_for, ACTING_FOR_HEADER)
            return Identity(record.key_id, record.tenant, record.role, await self.quotas(acting_for), acting_for)
        if record.role == ROLE_TENANT:
            return Identity(record.key_id, record.tenant, record.role, await self.quotas(record.tenant))
        return Identity(record.key_id, record.tenant, record.role)


def authenticator_from_settings(settings, service: str) -> Authenticator:
    """The authenticator a service runs with: keys in the cluster's Redis when `settings.auth` is on, otherwise
    the open mode, which is announced loudly because anyone who can reach the port can do anything."""
    if settings.auth:
        return Authenticator(KeyStore(settings.redis_url, settings.key_prefix))
    log.warning("AUTHENTICATION IS OFF for the %s: anyone who can reach its port can read, change and delete "
                "every tenant's adapters. Set LORAPLANE_AUTH=1 (and issue keys with `loraplane keys create`) "
                "outside tests and the embedded demo.", service)
    return Authenticator(None)
