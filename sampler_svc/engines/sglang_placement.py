"""Which SGLang server an adapter version lives on and a request goes to.

A version lives on one server: the one the sampler placement policy chooses when it is loaded (loraplane/routing.py,
FEWEST_ADAPTERS: the server holding or loading the fewest versions that still has room under its --max-loaded-loras),
and its requests are routed there; base-model requests go round-robin.

This table is the authority on which versions exist. SGLang 0.5.17 silently reloads an unloaded name from its cached
path, so a name leaves the table BEFORE SGLang is asked to unload it, and a request naming a version that is not in
the table is refused (NotFound): such a name never reaches SGLang.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

from loraplane import errors
from loraplane.routing import FEWEST_ADAPTERS, Candidate, PlacementPolicy
from sampler_svc.engines.sglang_servers import SGLangServer


class ServerChoice:
    def __init__(self, servers: Sequence[SGLangServer], policy: PlacementPolicy = FEWEST_ADAPTERS):
        """`servers`: the engine's list (filled when the servers are up; read at each choice)."""
        self.servers = servers
        self.policy = policy
        self._route: dict[str, SGLangServer] = {}  # version name -> the server that has it loaded
        self._loading: set[str] = set()  # versions whose load is under way
        self._round_robin = itertools.count()

    @property
    def loaded_names(self) -> dict[str, str]:
        return {key: server.url for key, server in self._route.items()}

    def loaded_keys(self) -> list[str]:
        return list(self._route)

    @contextlib.contextmanager
    def placing(self, key: str) -> Iterator[SGLangServer]:
        """The server to load `key` on, counted as loading there while the block runs; on success the caller
        records it with `placed`. AlreadyExists for a name loaded or loading; ResourceExhausted when every server
        holds its --max-loaded-loras (SGLang would make room by evicting a name on its own, behind the manager's
        back, and a version that came as tensors cannot be reloaded from anywhere)."""
        if key in self._route or key in self._loading:
            raise errors.AlreadyExists(f"{key} is already loaded", field="adapter")
        candidates = [Candidate(str(i), held=len(s.adapters) + s.loading, limit=s.max_loaded)
                      for i, s in enumerate(self.servers)]
        chosen = self.policy.choose(key, candidates)
        if chosen is None:
            limits = sorted({s.max_loaded for s in self.servers})
            raise errors.ResourceExhausted(
                f"every SGLang server holds its --max-loaded-loras ({', '.join(map(str, limits))}) adapter versions; "
                f"unload some or raise the limit", field="adapter")
        server = self.servers[int(chosen)]
        self._loading.add(key)
        server.loading += 1
        try:
            yield server
        finally:
            server.loading -= 1
            self._loading.discard(key)

    def placed(self, key: str, server: SGLangServer) -> None:
        server.adapters.add(key)
        self._route[key] = server

    def remove(self, key: str) -> SGLangServer | None:
        """Forgets `key` (from now on no request can name it); the server it was on, None if it was not loaded."""
        server = self._route.pop(key, None)
        if server is not None:
            server.adapters.discard(key)
        return server

    def for_request(self, key: str | None) -> SGLangServer:
        if key is None:
            return self.servers[next(self._round_robin) % len(self.servers)]
        server = self._route.get(key)
        if server is None:
            raise errors.NotFound(f"adapter version {key} is not loaded", field="adapter")
        return server
