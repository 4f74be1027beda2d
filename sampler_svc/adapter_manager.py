"""Which adapter versions the sampler has loaded, and why.

The manager follows the registry's event stream from a cursor it persists in Redis (one key per sampler
instance), downloads each newly published WEIGHTS version, verifies it and loads it into the engine as
`<adapter>@v<N>`. It keeps the newest `keep_versions` versions of every adapter, never unloads a version while a
request holds it (leases), evicts least-recently-used idle versions past `max_loaded`, loads a requested-but-absent
version on demand (one load per version however many requests wait for it) and unloads on delete events.
A version whose bytes a trainer pushed here ahead of the commit (sampler_svc/staging.py) is loaded from them instead
of being downloaded, when the registry's digest for it is the pushed one; each load counts under its path
(`push` or `registry`: loraplane_sampler_version_loads_total).

The persisted state is the cursor of the last applied event plus the versions retention wanted at that point, so a
restarted sampler reloads exactly those and resumes after the cursor: no event is skipped or applied twice.
If the registry or Redis goes away, loaded versions keep serving; the watcher reconnects with backoff and catches up.

All state is mutated on the asyncio loop only, so no locks are needed; engine calls are awaited.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Self

import redis.exceptions

from loraplane import errors, metrics
from loraplane.redis_pool import async_redis
from loraplane.registry_client import EventType, RegistryClient, RegistryEvent, StoredVersion, VersionKind
from sampler_svc.engines.base import Engine
from sampler_svc.staging import Staging

log = logging.getLogger(__name__)

MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
# A version whose blob keeps failing its integrity check is skipped after this many tries, so one corrupt blob
# cannot stall the event stream for every other adapter.
MAX_LOAD_ATTEMPTS = 3
# Longest wait for each background task or connection to wind down in stop().
STOP_WAIT_S = 5.0
WEIGHT_KINDS = (VersionKind.WEIGHTS, VersionKind.UNSPECIFIED)
# Where a loaded version's bytes came from: pushed by the trainer that published it, or read from the registry.
PATH_PUSH = "push"
PATH_REGISTRY = "registry"


def version_key(adapter: str, version: int) -> str:
    return f"{adapter}@v{version}"


@dataclass
class LoadedVersion:
    adapter: str
    version: int
    sha256: str
    key: str
    rank: int
    load_time: float
    last_used_time: float
    pinned: bool = False
    # Leases held by requests (including requests still waiting for this version's on-demand load).
    active_requests: int = 0
    # Outside retention: unloaded as soon as the last lease is released.
    retired: bool = False
    # Deleted in the registry: no new leases.
    deleted: bool = False
    # PATH_PUSH or PATH_REGISTRY.
    path: str = PATH_REGISTRY


@dataclass
class Lease:
    """A request's hold on one loaded version (or on the base model when `entry` is None)."""

    manager: AdapterManager | None
    entry: LoadedVersion | None
    _released: bool = field(default=False, repr=False)

    @property
    def adapter_key(self) -> str | None:
        return self.entry.key if self.entry else None

    @property
    def version(self) -> int:
        return self.entry.version if self.entry else 0

    def release(self) -> None:
        if self._released or self.entry is None or self.manager is None:
            return
        self._released = True
        self.manager._release(self.entry)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.release()


class AdapterManager:
    def __init__(
        self,
        engine: Engine,
        registry: RegistryClient,
        *,
        redis_url: str,
        key_prefix: str,
        instance_id: str,
        keep_versions: int = 2,
        max_loaded: int = 64,
        watch_prefix: str = "",
        staging: Staging | None = None,
    ):
        if keep_versions < 1:
            raise errors.InvalidArgument(f"keep_versions must be >= 1, got {keep_versions}", field="keep_versions")
        if max_loaded < 1:
            raise errors.InvalidArgument(f"max_loaded must be >= 1, got {max_loaded}", field="max_loaded")
        self.engine = engine
        self.registry = registry
        self.keep_versions = keep_versions
        self.max_loaded = max_loaded
        self.watch_prefix = watch_prefix
        self.staging = staging or Staging()
        self.instance_id = instance_id
        self.state_key = f"{key_prefix}sampler:{instance_id}:state"
        self._redis = async_redis(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0,
                                  retry_on_timeout=False) if redis_url else None

        self.cursor = ""
        self.registry_connected = False
        self.redis_connected = False
        self.state_restored = asyncio.Event()
        # Live WEIGHTS versions the manager knows of, per adapter (from events, restored state, on-demand loads).
        self._known: dict[str, set[int]] = {}
        self._aliases: dict[str, dict[str, int]] = {}
        self._pinned_keys: set[str] = set()
        self._loaded: dict[str, LoadedVersion] = {}
        self._flights: dict[str, asyncio.Task[LoadedVersion]] = {}
        # Holds taken by requests waiting for a version whose load is in flight; handed to the entry once loaded.
        self._waiting_holds: dict[str, int] = {}
        self._unloads: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task] = []
        self._dirty = False
        self._stopping = False
        self.events_applied = 0
        self.loads = 0
        self.loads_by_path = {PATH_PUSH: 0, PATH_REGISTRY: 0}
        # Whether a version published for an adapter is loaded ahead of its first request. A fleet replica
        # (sampler_svc/fleet.py) preloads only the adapters whose requests it is first in line for; the others'
        # versions are recorded (retention counts them) and loaded on demand.
        self.preloads: Callable[[str], bool] = lambda adapter: True

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._watch_loop(), name="adapter-watch"))
        self._tasks.append(asyncio.create_task(self._flush_loop(), name="adapter-state-flush"))

    async def stop(self) -> None:
        """Cancels the watcher and background work. Every wait is bounded: a shutdown must not hang on a peer
        (a Redis command cancelled mid-flight can leave redis-py's asyncio connection waiting)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # asyncio.wait, not wait_for: wait_for would itself wait for a stuck task to finish cancelling.
            done, stuck = await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("adapter manager task %s failed while stopping", task.get_name(),
                              exc_info=task.exception())
            for task in stuck:
                log.warning("adapter manager task %s did not stop within %.0fs", task.get_name(), STOP_WAIT_S)
        self._tasks.clear()
        for task in list(self._flights.values()) + list(self._unloads.values()):
            task.cancel()
        if self._redis is not None:
            closing = asyncio.ensure_future(self._redis.aclose())
            _, stuck = await asyncio.wait({closing}, timeout=STOP_WAIT_S)
            if stuck:
                log.warning("closing the sampler's Redis connection did not finish within %.0fs", STOP_WAIT_S)

    # ------------------------------------------------------------------ requests

    async def acquire(self, adapter: str, version: int = 0, alias: str = "") -> Lease:
        """A lease on the version a request names (empty adapter = base model); loads it on demand."""
        if not adapter:
            if version or alias:
                raise errors.InvalidArgument("adapter.version / adapter.alias need adapter.name", field="adapter.name")
            return Lease(None, None)
        version = await self._resolve(adapter, version, alias)
        key = version_key(adapter, version)
        entry = self._loaded.get(key)
        if entry is not None and not entry.deleted:
            entry.active_requests += 1
            entry.last_used_time = time.time()
            return Lease(self, entry)
        entry = await self._hold_while_loading(adapter, version)
        return Lease(self, entry)

    async def pin(self, adapter: str, version: int = 0, alias: str = "", *, pin: bool = True) -> LoadedVersion:
        lease = await self.acquire(adapter, version, alias)
        try:
            assert lease.entry is not None
            if pin:
                lease.entry.pinned = True
                lease.entry.retired = False
                self._pinned_keys.add(lease.entry.key)
                self._dirty = True
            return lease.entry
        finally:
            lease.release()

    def unpin(self, adapter: str, version: int = 0) -> list[LoadedVersion]:
        """Unpins the version (0 = every loaded version of the adapter); each is unloaded unless retention keeps it
        or a request holds it."""
        entries = [e for e in self._loaded.values()
                   if e.adapter == adapter and (version == 0 or e.version == version)]
        if not entries:
            what = f"version {version} of adapter {adapter!r}" if version else f"adapter {adapter!r}"
            raise errors.NotFound(f"{what} is not loaded", field="adapter")
        for entry in entries:
            entry.pinned = False
            self._pinned_keys.discard(entry.key)
            # An explicit unload asks for the version to go even if it is one of the newest: only a request's
            # lease keeps it then. Versions retention keeps stay.
        self._dirty = True
        self._enforce_retention(adapter)
        return entries

    def list_loaded(self, adapter: str = "") -> list[LoadedVersion]:
        entries = [e for e in self._loaded.values() if not adapter or e.adapter == adapter]
        return sorted(entries, key=lambda e: (e.adapter, e.version))

    def known_versions(self, adapter: str) -> list[int]:
        return sorted(self._known.get(adapter, ()))

    async def _resolve(self, adapter: str, version: int, alias: str) -> int:
        if version:
            return version
        if alias:
            try:
                described = await self.registry.get_version(adapter, alias=alias)
            except errors.Unavailable:
                # The registry is down: the alias as of the last event seen is the best answer there is.
                known = self._aliases.get(adapter, {}).get(alias)
                if known is None:
                    raise
                return known
            self._check_weights(described)
            return described.version
        known = self._known.get(adapter)
        if known:
            return max(known)
        described = await self.registry.get_version(adapter)
        self._check_weights(described)
        return described.version

    @staticmethod
    def _check_weights(described: StoredVersion) -> None:
        if described.kind not in WEIGHT_KINDS:
            raise errors.InvalidArgument(
                f"version {described.version} of adapter {described.adapter!r} is a training state, not weights",
                field="adapter.version")

    async def _hold_while_loading(self, adapter: str, version: int) -> LoadedVersion:
        key = version_key(adapter, version)
        flight = self._flight(adapter, version, expected_sha256="")
        self._waiting_holds[key] = self._waiting_holds.get(key, 0) + 1
        try:
            return await asyncio.shield(flight)
        except BaseException:
            if flight.done() and not flight.cancelled() and flight.exception() is None:
                self._release(flight.result())
            elif not flight.done():
                self._waiting_holds[key] -= 1
            raise

    def _release(self, entry: LoadedVersion) -> None:
        entry.active_requests -= 1
        entry.last_used_time = time.time()
        self._maybe_unload(entry)

    # ------------------------------------------------------------------ loading and unloading

    def _flight(self, adapter: str, version: int, expected_sha256: str) -> asyncio.Task[LoadedVersion]:
        key = version_key(adapter, version)
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.create_task(self._load(adapter, version, expected_sha256), name=f"load {key}")
            self._flights[key] = flight
            # A failed flight nobody awaits anymore must not log "exception never retrieved".
            flight.add_done_callback(lambda t: t.cancelled() or t.exception())
        return flight

    async def _load(self, adapter: str, version: int, expected_sha256: str) -> LoadedVersion:
        key = version_key(adapter, version)
        try:
            unloading = self._unloads.get(key)
            if unloading is not None:
                await asyncio.shield(unloading)
            existing = self._loaded.get(key)
            if existing is not None and not existing.deleted:
                existing.active_requests += self._waiting_holds.pop(key, 0)
                return existing
            sha256, blob = await self._pushed(adapter, version, expected_sha256)
            path = PATH_PUSH
            if blob is None:
                path = PATH_REGISTRY
                described, blob = await self.registry.download(adapter, version)
                self._check_weights(described)
                if expected_sha256 and described.sha256 != expected_sha256:
                    raise errors.DataLoss(f"{key}: registry serves sha256 {described.sha256}, the publish event "
                                          f"said {expected_sha256}")
                sha256 = described.sha256
            self._make_room(exclude=key)
            info = await self.engine.load_adapter(key, blob)
            now = time.time()
            entry = LoadedVersion(adapter=adapter, version=version, sha256=sha256, key=key,
                                  rank=info.rank, load_time=now, last_used_time=now,
                                  pinned=key in self._pinned_keys, path=path)
            entry.active_requests = self._waiting_holds.pop(key, 0)
            self._loaded[key] = entry
            self._known.setdefault(adapter, set()).add(version)
            self.loads += 1
            self.loads_by_path[path] += 1
            metrics.SAMPLER_VERSION_LOADS.labels(path).inc()
            log.info("loaded %s (rank %d, path %s)", key, info.rank, path)
            self._enforce_retention(adapter)
            return entry
        except BaseException:
            self._waiting_holds.pop(key, None)
            raise
        finally:
            self._flights.pop(key, None)

    async def _pushed(self, adapter: str, version: int, committed_sha256: str) -> tuple[str, bytes | None]:
        """The committed digest of the version and its pushed bytes, if staged here: only bytes whose digest the
        registry committed as this version are ever used. An on-demand load knows no digest yet; it asks the
        registry (one small call) only when something of the adapter was pushed."""
        if not committed_sha256:
            if not self.staging.holds(adapter):
                return "", None
            described = await self.registry.get_version(adapter, version)
            self._check_weights(described)
            committed_sha256 = described.sha256
        return committed_sha256, await self.staging.claim(adapter, committed_sha256)

    def holds_blob(self, adapter: str, sha256: str) -> bool:
        """Whether a version of `adapter` with these bytes is loaded (a push of them would add nothing)."""
        return any(e.adapter == adapter and e.sha256 == sha256 and not e.deleted for e in self._loaded.values())

    def _make_room(self, exclude: str) -> None:
        """Evicts least-recently-used idle, unpinned versions until one more fits under max_loaded."""
        while len(self._loaded) >= self.max_loaded:
            idle = [e for e in self._loaded.values()
                    if e.active_requests == 0 and not e.pinned and e.key != exclude]
            if not idle:
                raise errors.ResourceExhausted(
                    f"max_loaded={self.max_loaded} adapter versions are loaded and all are pinned or in use")
            victim = min(idle, key=lambda e: e.last_used_time)
            log.info("evicting least recently used %s", victim.key)
            self._unload_now(victim)

    def _retained_versions(self, adapter: str) -> set[int]:
        return set(sorted(self._known.get(adapter, ()), reverse=True)[: self.keep_versions])

    def _enforce_retention(self, adapter: str) -> None:
        retained = self._retained_versions(adapter)
        for entry in [e for e in self._loaded.values() if e.adapter == adapter]:
            entry.retired = entry.version not in retained and not entry.pinned
            self._maybe_unload(entry)

    def _maybe_unload(self, entry: LoadedVersion) -> None:
        if entry.active_requests > 0 or entry.pinned or not (entry.retired or entry.deleted):
            return
        if self._loaded.get(entry.key) is entry:
            self._unload_now(entry)

    def _unload_now(self, entry: LoadedVersion) -> None:
        # Removed from the table at once, so no new lease can reach a version on its way out.
        del self._loaded[entry.key]
        previous = self._unloads.get(entry.key)

        async def unload() -> None:
            if previous is not None:
                await previous
            try:
                await self.engine.unload_adapter(entry.key)
                log.info("unloaded %s", entry.key)
            except Exception:
                log.exception("engine failed to unload %s", entry.key)
            finally:
                if self._unloads.get(entry.key) is task:
                    del self._unloads[entry.key]

        task = asyncio.create_task(unload(), name=f"unload {entry.key}")
        self._unloads[entry.key] = task

    async def wait_idle(self) -> None:
        """Waits for loads and unloads in flight (tests and benchmarks use it to observe a settled state)."""
        while self._flights or self._unloads:
            await asyncio.gather(*self._flights.values(), *self._unloads.values(), return_exceptions=True)

    # ------------------------------------------------------------------ events

    async def _apply_event(self, event: RegistryEvent) -> None:
        adapter = event.adapter
        if event.type == EventType.VERSION_PUBLISHED:
            if event.kind not in WEIGHT_KINDS:
                return
            self._known.setdefault(adapter, set()).add(event.version)
            if event.version in self._retained_versions(adapter) and self.preloads(adapter):
                await self._load_for_event(adapter, event.version, event.sha256)
            self._enforce_retention(adapter)
        elif event.type == EventType.VERSION_DELETED:
            self._forget(adapter, [event.version])
            if self.preloads(adapter):
                await self._load_retained(adapter)
        elif event.type == EventType.ADAPTER_DELETED:
            self._forget(adapter, list(self._known.get(adapter, ())) +
                         [e.version for e in self._loaded.values() if e.adapter == adapter])
            self._known.pop(adapter, None)
            self._aliases.pop(adapter, None)
            self.staging.forget(adapter)
        elif event.type == EventType.ALIAS_SET:
            aliases = self._aliases.setdefault(adapter, {})
            if event.version:
                aliases[event.alias] = event.version
            else:
                aliases.pop(event.alias, None)
        self._dirty = True

    def _forget(self, adapter: str, versions: Iterable[int]) -> None:
        for version in set(versions):
            self._known.get(adapter, set()).discard(version)
            key = version_key(adapter, version)
            self._pinned_keys.discard(key)
            entry = self._loaded.get(key)
            if entry is not None:
                entry.deleted = True
                entry.pinned = False
                self._maybe_unload(entry)

    async def _load_retained(self, adapter: str) -> None:
        for version in sorted(self._retained_versions(adapter), reverse=True):
            key = version_key(adapter, version)
            if key not in self._loaded:
                await self._load_for_event(adapter, version, "")

    async def _load_for_event(self, adapter: str, version: int, sha256: str) -> None:
        key = version_key(adapter, version)
        for attempt in range(1, MAX_LOAD_ATTEMPTS + 1):
            try:
                await asyncio.shield(self._flight(adapter, version, sha256))
                return
            except errors.NotFound:
                # Deleted after publishing (registry retention, a user): its delete event follows.
                log.info("%s no longer exists in the registry", key)
                self._known.get(adapter, set()).discard(version)
                return
            except (errors.InvalidArgument, errors.FailedPrecondition, errors.ResourceExhausted) as exc:
                log.warning("not loading %s: %s", key, exc.message)
                return
            except errors.DataLoss as exc:
                log.error("%s failed its integrity check (attempt %d): %s", key, attempt, exc.message)
            except errors.Unavailable:
                raise
        log.error("skipping %s after %d failed integrity checks", key, MAX_LOAD_ATTEMPTS)

    # ------------------------------------------------------------------ watch loop and persisted state

    async def _watch_loop(self) -> None:
        backoff = MIN_BACKOFF_S
        while not self._stopping:
            try:
                if not self.state_restored.is_set():
                    await self._restore_state()
                # A cheap call that proves the registry answers; the watch stream only speaks when events come.
                await self.registry.list_adapters(prefix="~")
                self.registry_connected = True
                backoff = MIN_BACKOFF_S
                async for event in self.registry.watch(after_cursor=self.cursor, prefix=self.watch_prefix):
                    await self._apply_event(event)
                    self.cursor = event.cursor
                    self.events_applied += 1
                    self._dirty = True
                    await self._persist_state()
            except asyncio.CancelledError:
                raise
            except (errors.Unavailable, errors.DeadlineExceeded, redis.exceptions.RedisError, OSError) as exc:
                self.registry_connected = False
                log.warning("adapter watch interrupted (%s); retrying in %.2fs", exc, backoff)
            except Exception:
                self.registry_connected = False
                log.exception("adapter watch failed; retrying in %.2fs", backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _state_document(self) -> dict:
        retained = {adapter: sorted(self._retained_versions(adapter)) for adapter in self._known
                    if self._known[adapter]}
        return {"cursor": self.cursor, "retained": retained, "pinned": sorted(self._pinned_keys),
                "aliases": self._aliases}

    async def _persist_state(self) -> None:
        if self._redis is None:
            self._dirty = False
            return
        document = json.dumps(self._state_document(), sort_keys=True)
        try:
            await self._redis.set(self.state_key, document)
            self.redis_connected = True
            self._dirty = False
        except (redis.exceptions.RedisError, OSError) as exc:
            # Keep serving and keep applying events; the flush loop writes the newer state when Redis is back.
            self.redis_connected = False
            log.warning("cannot persist sampler state to Redis: %s", exc)

    async def _flush_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.5)
            self.staging.sweep()
            if self._dirty and self.state_restored.is_set():
                await self._persist_state()

    async def _restore_state(self) -> None:
        """Reads the persisted cursor and retained versions and loads those versions (Redis must answer: starting
        from an empty cursor instead would replay the whole history)."""
        document = None
        if self._redis is not None:
            raw = await self._redis.get(self.state_key)
            self.redis_connected = True
            if raw:
                document = json.loads(raw)
        if document:
            self.cursor = document.get("cursor", "")
            for adapter, versions in document.get("retained", {}).items():
                self._known[adapter] = {int(v) for v in versions}
            self._pinned_keys = set(document.get("pinned", []))
            self._aliases = {a: {k: int(v) for k, v in m.items()} for a, m in document.get("aliases", {}).items()}
            # Adapters reload side by side (a few downloads at a time): a restart of a sampler serving many
            # adapters should not take one download round trip per version.
            limit = asyncio.Semaphore(4)

            async def reload(adapter: str) -> None:
                async with limit:
                    await self._load_retained(adapter)

            await asyncio.gather(*(reload(adapter) for adapter in list(self._known)))
            for key in list(self._pinned_keys):
                if key not in self._loaded:
                    adapter, _, version = key.rpartition("@v")
                    await self._load_for_event(adapter, int(version), "")
            log.info("restored sampler state: cursor %r, %d versions loaded", self.cursor, len(self._loaded))
        self.state_restored.set()
