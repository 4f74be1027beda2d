"""A burst of concurrent requests queues for Redis connections instead of failing (real Valkey on loopback).

Found on the H100: one step of tinker-cookbook's math_rl (512 concurrent sample calls through the gateway) exceeded
redis-py 8's 100-connection asyncio pool and failed requests with MaxConnectionsError."""

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from loraplane.redis_pool import async_redis

BURST = 400  # concurrent commands, more than the pools below hold connections


async def _burst(client) -> list:
    # BLPOP with a short timeout holds its connection for that long, so every command needs a connection of its own.
    try:
        return await asyncio.gather(*(client.blpop([f"lp-pool-test-{i}"], timeout=0.2) for i in range(BURST)))
    finally:
        await client.aclose()


def test_the_plain_pool_fails_a_burst_that_the_blocking_pool_queues(valkey):
    # The failure this module exists for, shown on redis-py's own default pool with the same small cap.
    with pytest.raises(redis.exceptions.MaxConnectionsError):
        asyncio.run(_burst(aioredis.Redis.from_url(valkey.url, max_connections=64)))
    results = asyncio.run(_burst(async_redis(valkey.url, max_connections=64)))
    assert results == [None] * BURST
