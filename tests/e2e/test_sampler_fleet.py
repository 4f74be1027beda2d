"""A sampler fleet on CPU: three real samplers (torch engine, `tiny` model) in one fleet, following one real registry
(Valkey + SeaweedFS), reached through the real clients: the SDK's SamplingClient and the gateway's Upstream.

Affinity (an adapter's requests land on one replica), bounded load (a hot adapter spreads over the others while its
replica is at the bound), a replica that dies is routed around within a second (an in-flight request included),
version exactness and retention on every replica, and what ListReplicas shows. The replicas run in this process, so
a "crash" is the server torn down without a goodbye (no leave from the membership, connections reset), the way a
SIGKILL looks from the clients; the CLI test starts real processes."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from gateway_svc.types import SamplingSpec
from gateway_svc.upstream import Upstream
from loraplane.client import SamplingParams
from loraplane.client._runtime import runtime
from loraplane.client.sampler_routing import router_for
from loraplane.client.sampling_client import SamplingClient
from loraplane.routing import HashRing
from loraplane.v1 import common_pb2, sampler_pb2
from tests.fixtures.sampler import adapter_blob, start_live_sampler

PROMPT = [17, 42, 99, 7, 120, 64]
TTL_S = 3.0  # a member silent this long is dead; 1 s flaked on a loaded 2-core host
IDS = ["sampler-a", "sampler-b", "sampler-c"]


class Fleet:
    def __init__(self, registry, background_loop, keep_versions: int = 2):
        self.registry = registry
        self.loop = background_loop
        self.fleet = "samplers"  # under the test's own key prefix
        settings = registry.settings.model_copy(update={"sampler_heartbeat_ttl_s": TTL_S})
        self.replicas = {i: start_live_sampler(settings, background_loop, registry.address, instance_id=i,
                                               fleet=self.fleet, keep_versions=keep_versions) for i in IDS}
        self.crashed: set[str] = set()
        self.seed = self.replicas[IDS[0]].address
        # Each replica lists the fleet as of its last heartbeat round (every TTL / 3): until all three have run one
        # after the last joined, an early one lists fewer.
        deadline = time.monotonic() + 10 * TTL_S
        for replica in self.replicas.values():
            stub = replica.stub()
            while len(stub.ListReplicas(sampler_pb2.ListReplicasRequest(), timeout=10).replicas) < len(IDS):
                assert time.monotonic() < deadline, "the replicas never listed each other"
                time.sleep(0.05)

    def by_address(self, address: str) -> str:
        return next(i for i, r in self.replicas.items() if r.address == address)

    def served(self) -> dict[str, int]:
        return {i: r.running.service.served for i, r in self.replicas.items()}

    def home(self, adapter: str) -> str:
        return HashRing(IDS).order(adapter)[0]

    def crash(self, replica_id: str) -> None:
        """The server goes away without leaving the membership (its heartbeat just stops) and resets every
        connection, as a killed process's do."""
        running = self.replicas[replica_id].running

        async def crash():
            running.fleet._task.cancel()
            await running.server.stop(grace=0)
            await running.manager.stop()
            await running.engine.stop()
            await running.registry.close()
        self.loop.run(crash(), timeout=60)
        self.crashed.add(replica_id)

    def publish(self, adapter: str, seed: int) -> int:
        return self.replicas[IDS[0]].publish(adapter, adapter_blob(seed)).version

    def close(self) -> None:
        for replica_id, replica in self.replicas.items():
            if replica_id not in self.crashed:
                replica.close()


@pytest.fixture
def fleet(registry, background_loop):
    live = Fleet(registry, background_loop)
    yield live
    live.close()


def params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3)


def test_affinity_and_a_hot_adapter_spreading_past_the_bound(fleet):
    names = [f"acme/run-{i}" for i in range(6)]
    for i, name in enumerate(names):
        fleet.replicas[IDS[0]].create_adapter(name)
        fleet.publish(name, 20 + i)
    # Every version of an adapter goes where the adapter's name hashes: v1 and v2 alike.
    fleet.publish(names[0], 40)
    for name in names:
        before = fleet.served()
        for version in ((1, 2) if name == names[0] else (1,)):
            client = SamplingClient(fleet.seed, name, version)
            for _ in range(2):
                reply = client.sample(PROMPT, 1, params()).result(timeout=60)
                assert reply.served_version == version
        after = fleet.served()
        grew = {i for i in IDS if after[i] > before[i]}
        assert grew == {fleet.home(name)}, (name, before, after)
    # The six adapters do not all live on one replica.
    assert len({fleet.home(name) for name in names}) > 1

    # A hot adapter: 24 requests at once. Its replica takes them up to the bound (ceil(1.25 x (in flight + 1) / 3)),
    # the rest go to the next replicas of its list, so every replica serves some.
    hot = names[1]
    before = fleet.served()
    client = SamplingClient(fleet.seed, hot)
    futures = [client.sample(PROMPT, 1, params(24)) for _ in range(24)]
    assert all(f.result(timeout=120).served_version == 1 for f in futures)
    after = fleet.served()
    spread = {i: after[i] - before[i] for i in IDS}
    assert sum(spread.values()) == 24
    assert all(count > 0 for count in spread.values()), spread
    assert max(spread.values()) <= 10, spread  # the bound at 24 in flight is 10; one replica alone would take 24
    assert spread[fleet.home(hot)] == max(spread.values()), spread


def test_a_dead_replica_is_routed_around_within_a_second(fleet):
    name = "acme/steady"
    fleet.replicas[IDS[0]].create_adapter(name)
    fleet.publish(name, 7)
    home, second, third = HashRing(IDS).order(name)
    for replica_id in (home, second):  # the two first in its order preload it (sampler_fleet_preload = 2)
        fleet.replicas[replica_id].wait_loaded({f"{name}@v1"})
    client = SamplingClient(fleet.seed, name)
    assert client.sample(PROMPT, 1, params()).result(timeout=60).served_version == 1
    # The list names the three of them (what the router routes over).
    router = router_for(fleet.seed)
    assert set(router.replicas) == set(IDS)

    fleet.crash(home)
    crashed_at = time.monotonic()
    # One failed attempt on the dead replica, then at once the next replica of the adapter's order: no backoff.
    assert client.sample(PROMPT, 1, params(2)).result(timeout=30).served_version == 1
    assert time.monotonic() - crashed_at < 1.0
    assert router.failovers == 1
    # Later requests go to the adapter's next replica. (Not timed one by one: the shared CI box stalls a process for
    # seconds at times.)
    before = fleet.served()
    for _ in range(5):
        assert client.sample(PROMPT, 1, params()).result(timeout=30).served_version == 1
    after = fleet.served()
    assert after[second] - before[second] == 5

    # A long request is running there when that one dies too: it is re-run on the last replica.
    in_flight = client.sample(PROMPT, 1, SamplingParams(max_tokens=200, temperature=1.0, seed=5))
    deadline = time.monotonic() + 30
    while fleet.replicas[second].running.service.in_flight == 0:
        assert time.monotonic() < deadline, "the long request never reached its replica"
        time.sleep(0.005)
    fleet.crash(second)
    assert in_flight.result(timeout=60).served_version == 1
    assert fleet.replicas[third].running.service.served > after[third]

    # Once their heartbeats expire the fleet stops listing them.
    survivor = fleet.replicas[third]
    deadline = time.monotonic() + 10 * TTL_S
    while True:
        listed = survivor.stub().ListReplicas(sampler_pb2.ListReplicasRequest(), timeout=10)
        if len(listed.replicas) == 1:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.1)
    assert [(r.replica_id, r.address) for r in listed.replicas] == [(third, survivor.address)]


def test_every_replica_serves_the_exact_version_and_keeps_its_retention(fleet):
    name = "acme/exact"
    fleet.replicas[IDS[0]].create_adapter(name)
    tokens = PROMPT + [5, 9, 200, 31]
    fleet.publish(name, 101)

    def logprobs(replica_id: str, version: int) -> torch.Tensor:
        reply = fleet.replicas[replica_id].stub().ComputeLogprobs(sampler_pb2.ComputeLogprobsRequest(
            adapter=common_pb2.AdapterRef(name=name, version=version), tokens=tokens), timeout=60)
        assert reply.served_version == version
        return torch.tensor(list(reply.logprobs)[1:])

    first, second, last = HashRing(IDS).order(name)
    fleet.replicas[first].wait_loaded({f"{name}@v1"})
    v1 = logprobs(first, 1)
    fleet.publish(name, 202)
    fleet.publish(name, 303)
    # The adapter's first two replicas load new versions ahead of requests; the last one only records them.
    for replica_id in (first, second):
        fleet.replicas[replica_id].wait_loaded({f"{name}@v2", f"{name}@v3"}, exact=True)
    assert fleet.replicas[last].wait_loaded(set(), exact=True) == set()
    assert fleet.replicas[last].manager.known_versions(name) == [1, 2, 3]
    for replica_id in IDS:
        # v1 is past retention (keep 2) everywhere: each replica loads it on demand and serves exactly its weights.
        assert torch.equal(logprobs(replica_id, 1), v1), replica_id
        assert (logprobs(replica_id, 3) - v1).abs().max() > 1e-3
    # Through the client too, whichever replica it picks.
    assert SamplingClient(fleet.seed, name, 1).compute_logprobs(tokens).result(timeout=60)[1:] == \
        pytest.approx(v1.tolist(), abs=0)
    # And each replica, once idle, keeps the newest two at most: v1, loaded on demand, went with its last request.
    for replica_id in (first, second):
        fleet.replicas[replica_id].wait_loaded({f"{name}@v2", f"{name}@v3"}, exact=True)
    fleet.replicas[last].wait_loaded({f"{name}@v3"}, exact=True)


def test_the_gateway_routes_by_affinity_and_fails_over(fleet):
    name = "acme/gw"
    fleet.replicas[IDS[0]].create_adapter(name)
    fleet.publish(name, 55)
    home = fleet.home(name)
    upstream = Upstream("127.0.0.1:1", fleet.registry.address, fleet.seed)  # no trainer: sampling only
    spec = SamplingSpec(max_tokens=6, temperature=1.0, seed=1)

    async def sample():
        return await upstream.sample(name, 1, PROMPT, 1, spec, False)

    async def stream():
        return [delta async for delta in upstream.sample_stream(name, 1, PROMPT, 1, spec)]

    try:
        before = fleet.served()
        assert fleet.loop.run(sample(), timeout=60).served_version == 1
        assert len(fleet.loop.run(stream(), timeout=60)) >= 1
        after = fleet.served()
        assert {i for i in IDS if after[i] > before[i]} == {home}
        fleet.crash(home)
        started = time.monotonic()
        assert fleet.loop.run(sample(), timeout=60).served_version == 1
        assert sum(len(d.tokens) for d in fleet.loop.run(stream(), timeout=60)) == 6
        assert time.monotonic() - started < 2.0
        assert upstream.sampler_router.failovers >= 1
    finally:
        fleet.loop.run(upstream.close(), timeout=30)


def test_list_replicas_pages_and_rejects_a_bad_token(fleet):
    stub = fleet.replicas[IDS[1]].stub()
    whole = stub.ListReplicas(sampler_pb2.ListReplicasRequest(), timeout=10)
    assert [r.replica_id for r in whole.replicas] == IDS and whole.fleet == fleet.fleet
    assert whole.replica_id == IDS[1]
    assert [r.address for r in whole.replicas] == [fleet.replicas[i].address for i in IDS]
    first = stub.ListReplicas(sampler_pb2.ListReplicasRequest(page_size=2), timeout=10)
    rest = stub.ListReplicas(sampler_pb2.ListReplicasRequest(page_size=2, page_token=first.next_page_token),
                             timeout=10)
    assert [r.replica_id for r in [*first.replicas, *rest.replicas]] == IDS and not rest.next_page_token
    with pytest.raises(grpc.RpcError) as bad:
        stub.ListReplicas(sampler_pb2.ListReplicasRequest(page_token="%%%"), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in bad.value.details()
    with pytest.raises(grpc.RpcError) as negative:
        stub.ListReplicas(sampler_pb2.ListReplicasRequest(page_size=-1), timeout=10)
    assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_size" in negative.value.details()


def test_bounded_load_router_counts_its_own_calls(fleet):
    """The router's view of load: its own calls in flight plus what the replicas reported for everyone else."""
    router = router_for(fleet.seed)

    async def go():
        await router.refresh()
        first = (await router.candidates("acme/x"))[0][0]
        with router.holding(first), router.holding(first):
            assert (await router.candidates("acme/x"))[0][0] != first
        assert (await router.candidates("acme/x"))[0][0] == first

    runtime().run(go(), timeout=30)
