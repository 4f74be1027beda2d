"""The gateway's log while a service is down: every waiting call retries with backoff, so one line per attempt
buried the operator (15k INFO lines in one RL run against a busy trainer). A call logs its first retry at INFO and
the rest at DEBUG; the service's address and status go to WARNING at most once per LOG_EVERY_S."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway_svc import upstream as upstream_module
from gateway_svc.upstream import Upstream
from loraplane import errors
from tests.gateway.conftest import free_port


def test_a_down_service_is_retried_quietly_and_named_once(caplog):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: grpc's own UNAVAILABLE, for real

    async def go():
        up = Upstream(dead, dead, dead, retry_s=2.0)
        try:
            for _ in range(2):
                with pytest.raises(errors.Unavailable):
                    await up.info()
        finally:
            await up.close()

    with caplog.at_level(logging.DEBUG, logger=upstream_module.__name__):
        asyncio.run(go())
    records = [r for r in caplog.records if r.name == upstream_module.__name__]
    retries = [r for r in records if "retrying in" in r.getMessage()]
    assert [r.levelno for r in retries].count(logging.INFO) == 2  # the first retry of each of the two calls
    assert [r.levelno for r in retries].count(logging.DEBUG) >= 4  # the rest of their backoff
    named = [r for r in records if dead in r.getMessage()]
    assert len(named) >= 6
    assert [r.levelno for r in named].count(logging.WARNING) == 1  # the address once per LOG_EVERY_S
