"""The measuring clients of the sampler benchmarks (bench/stream_clients.py) against bench/synthetic_sglang.py (a real
HTTP server speaking SGLang's /generate): a path spread over several processes reports the same requests and tokens
as one process, with percentiles of the union, and the raw path over several servers sends adapter i to server
i mod n (the placement the two-server sampler gives the versions, which raw2 in bench/sampler_vs_sglang.py assumes)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from bench.stream_clients import Worker
from tests.fixtures.http import synthetic_sglang

MAX_TOKENS = 6


@pytest.fixture
def servers():
    with synthetic_sglang() as first, synthetic_sglang() as second:
        yield [first, second]


def steps(url: str) -> int:
    with urllib.request.urlopen(url + "/synthetic_stats", timeout=5) as reply:
        return json.loads(reply.read())["steps"]


def command(op: str, adapters: list[int], concurrency: int) -> dict:
    return {"op": op, "concurrency": concurrency, "max_tokens": MAX_TOKENS,
            "requests": [[a, [11 + i, 12, 13]] for i, a in enumerate(adapters)]}


def test_several_processes_report_the_union_of_their_requests(servers):
    adapters = [i % 8 for i in range(30)]
    one = Worker("raw", url=servers[0])
    three = Worker("raw", url=servers[0], processes=3)
    try:
        single = one.run(command("stream", adapters, 12))
        spread = three.run(command("stream", adapters, 12))
        unary = three.run(command("unary", adapters, 12))
    finally:
        one.close()
        three.close()
    assert len(three.processes) == 3
    for summary in (single, spread):
        assert summary["requests"] == 30 and summary["tokens"] == 30 * MAX_TOKENS
        assert summary["messages"] == 30 * MAX_TOKENS  # one SSE chunk per token from the synthetic server
        assert 3.0 < summary["itl_p50_ms"] < 50.0  # one token per 5 ms decode step, whatever the process count
    assert spread["client_processes"] == 3 and "client_processes" not in single
    assert set(single) | {"client_processes"} == set(spread)
    assert unary["requests"] == 30 and unary["tokens"] == 30 * MAX_TOKENS


def test_raw_over_two_servers_sends_adapter_i_to_server_i_mod_2(servers):
    before = [steps(url) for url in servers]
    raw2 = Worker("raw", url=",".join(servers))
    try:
        summary = raw2.run(command("unary", [1, 3, 5, 7], 4))
        after_odd = [steps(url) for url in servers]
        raw2.run(command("unary", [0, 2, -1], 3))
        after_even = [steps(url) for url in servers]
    finally:
        raw2.close()
    assert summary["tokens"] == 4 * MAX_TOKENS
    assert after_odd[0] == before[0] and after_odd[1] > before[1]  # odd adapters: the second server only
    assert after_even[0] > after_odd[0] and after_even[1] == after_odd[1]  # even and the base model: the first
