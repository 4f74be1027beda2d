"""How every asyncio service opens Redis: one bounded pool per client whose callers wait for a free connection."""

from __future__ import annotations

import redis.asyncio as aioredis

# redis-py 8 caps an asyncio pool at 100 connections and then *raises* MaxConnectionsError. A burst of concurrent
# requests (one step of a cookbook RL loop sends 512 sample calls at once through the gateway) must queue for a
# connection instead of failing: a BlockingConnectionPool waits up to `wait_s` for one.
MAX_CONNECTIONS = 256
WAIT_S = 30.0


def async_redis(url: str, *, max_connections: int = MAX_CONNECTIONS, wait_s: float = WAIT_S,
                **kwargs) -> aioredis.Redis:
    """An asyncio Redis client on a blocking pool; `kwargs` are redis-py's connection options. Closing the client
    closes its pool."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s, **kwargs)
    return aioredis.Redis.from_pool(pool)
