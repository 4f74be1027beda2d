"""What a trainer fleet answers about no adapter in particular, whichever member is asked: ListAdapters lists every
adapter of the fleet the caller may see (each as the trainer serving it describes it, or from the journal while its
trainer is gone), in one name order across pages, never another tenant's; GetInfo is answered by any live member,
so the gateway and the Python client ride over a dead one. Real trainers (tiny model) on the session's Valkey and
SeaweedFS, with authentication on and the services' own key (trainer_svc/fleet.py, loraplane/client/routing.py)."""

from __future__ import annotations

import uuid

import grpc
import httpx
import pytest

from gateway_svc.config import GatewaySettings
from loraplane.client import AdamParams, ServiceClient, datum_from_sequence
from loraplane.client._runtime import RetryConfig
from loraplane.config import Settings
from loraplane.membership import Membership
from loraplane.rpc import ClientSecurity, sync_channel
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc
from tests.contract.auth_helpers import auth_settings, issue_standard_keys
from tests.e2e.test_trainer_fleet import LIMITS, member_settings
from tests.fixtures.trainer import start_live_trainer
from tests.gateway.conftest import LiveGateway, free_port

ADAM = AdamParams(learning_rate=0.02)
RETRY = RetryConfig(initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=60.0, attempt_timeout_s=30.0)
# Long heartbeats: a stopped member still counts as live for this long, so the survivors do not take its adapters
# over during the test; what they list of it must then come from the journal.
TTL_S = 60.0


def row(adapter: trainer_pb2.TrainerAdapter) -> tuple:
    """What must not depend on who describes the adapter (residency does: a journal row is never resident)."""
    lora = adapter.lora_config
    return (adapter.name, adapter.step, adapter.last_seq_id, adapter.parameter_count, adapter.base_model, lora.rank,
            lora.alpha, lora.seed, tuple(lora.target_modules), lora.weights_dtype)


def listing(stub, *, page_size: int = 0, this_trainer_only: bool = False) -> tuple[list, list[str]]:
    """Every row, page after page, and the page tokens the trainer gave."""
    rows, tokens, token = [], [], ""
    while True:
        reply = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(
            page_size=page_size, page_token=token, this_trainer_only=this_trainer_only), timeout=30)
        rows.extend(reply.adapters)
        token = reply.next_page_token
        if not token:
            return rows, tokens
        tokens.append(token)


def train(client, steps: int) -> None:
    for step in range(steps):
        data = [datum_from_sequence([(7 * step + i) % 200 + 5 for i in range(11)])]
        client.forward_backward(data, "cross_entropy").result(60)
        client.optim_step(ADAM).result(60)


@pytest.fixture
def secured_fleet(registry, background_loop):
    """Three trainers of one fleet with authentication on, each with the services' key; the standard keys."""
    keys = issue_standard_keys(registry.settings, background_loop)
    fleet = f"l{uuid.uuid4().hex[:6]}"
    service = auth_settings(registry.settings, api_key=keys.tokens["service"])
    trainers = {m: start_live_trainer(member_settings(service, m, fleet, ttl_s=TTL_S), background_loop,
                                      registry.address, **LIMITS) for m in ("t0", "t1", "t2")}
    channels: list[grpc.Channel] = []

    def stub(member: str, label: str) -> trainer_pb2_grpc.TrainerServiceStub:
        channels.append(sync_channel(trainers[member].address, ClientSecurity(api_key=keys.tokens[label])))
        return trainer_pb2_grpc.TrainerServiceStub(channels[-1])

    stopped: set[str] = set()
    yield trainers, keys, stub, stopped, fleet
    for channel in channels:
        channel.close()
    for member, live in trainers.items():
        if member not in stopped:
            live.close()


def test_every_member_lists_the_whole_fleet_in_pages_per_tenant_and_a_dead_members_adapters_from_the_journal(
        registry, secured_fleet):
    trainers, keys, stub, stopped, fleet = secured_fleet
    acme = ServiceClient(trainer=trainers["t0"].address, registry=registry.address, sampler="127.0.0.1:9",
                         retry=RETRY, api_key=keys.tokens["own"])
    globex = ServiceClient(trainer=trainers["t0"].address, registry=registry.address, sampler="127.0.0.1:9",
                           retry=RETRY, api_key=keys.tokens["other"])
    # Created through t0, placed by the policy two per trainer (acme's) and one per trainer (globex's).
    mine = [acme.create_lora_training_client("tiny", rank=4, seed=i, name=f"acme/a{i}") for i in range(6)]
    theirs = [globex.create_lora_training_client("tiny", rank=2, seed=i, name=f"globex/b{i}") for i in range(3)]
    for i, client in enumerate(mine):
        train(client, i % 3)
    train(theirs[0], 1)
    own = {m: {a.name: a for a in listing(stub(m, "admin"), this_trainer_only=True)[0]} for m in trainers}
    assert sorted(len([n for n in names if n.startswith("acme/")]) for names in own.values()) == [2, 2, 2]
    truth = {name: row(a) for rows in own.values() for name, a in rows.items()}
    acme_names = sorted(n for n in truth if n.startswith("acme/"))
    globex_names = sorted(n for n in truth if n.startswith("globex/"))
    assert len(acme_names) == 6 and len(globex_names) == 3
    assert {truth[n][1:3] for n in acme_names} == {(0, 0), (1, 2), (2, 4)}  # (step, last seq_id): the training

    resident = {name: a.resident for rows in own.values() for name, a in rows.items()}
    assert any(resident.values())  # so the check below tells the owners' rows from journal ones (never resident)
    # Any member lists the whole fleet, each adapter as its own trainer describes it, and only the caller's.
    for member in trainers:
        rows, _ = listing(stub(member, "own"))
        assert [row(a) for a in rows] == [truth[n] for n in acme_names]
        assert [a.resident for a in rows] == [resident[n] for n in acme_names]
        assert [a.name for a in listing(stub(member, "other"))[0]] == globex_names
        assert [a.name for a in listing(stub(member, "admin"))[0]] == sorted(truth)
    # Pages of two: one name order across the fleet, every adapter once, tokens that name only the caller's own.
    rows, tokens = listing(stub("t1", "own"), page_size=2)
    assert [a.name for a in rows] == acme_names and len(tokens) == 2
    assert all(token.startswith("acme/") for token in tokens)
    # A token naming another tenant's adapter shows nothing of that tenant.
    reply = stub("t2", "other").ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(
        page_token=acme_names[0]), timeout=30)
    assert [a.name for a in reply.adapters] == globex_names
    # The Python client: the fleet's adapters from its one trainer address, and each found where it lives.
    assert [(i.name, i.step, i.last_seq_id) for i in acme.list_training_adapters()] == \
        [(n, *truth[n][1:3]) for n in acme_names]

    # t1 stops. Its heartbeat has not expired yet, so nobody takes its adapters over: what any member lists of them
    # now comes from the journal (the checkpoint and every journaled request), as the next owner will restore them.
    gone = sorted(own["t1"])
    trainers["t1"].close()
    stopped.add("t1")
    rows, _ = listing(stub("t0", "admin"))
    assert [row(a) for a in rows] == [truth[n] for n in sorted(truth)]
    assert not any(a.resident for a in rows if a.name in gone)
    rows, _ = listing(stub("t2", "own"), page_size=4)
    assert [row(a) for a in rows] == [truth[n] for n in acme_names]
    # Attaching to one of them continues after its last seq_id, however long its trainer stays away.
    on_t1 = next(n for n in gone if n.startswith("acme/") and truth[n][2] > 0)
    assert acme.get_training_client(on_t1).info.last_seq_id == truth[on_t1][2]

    # Then t1's heartbeat is gone (as after its TTL): the survivors adopt its adapters, and the listing is the same.
    Membership(registry.settings.redis_url, key_prefix=registry.settings.key_prefix, fleet=fleet).leave("t1")
    rows, _ = listing(stub("t2", "admin"))
    assert [row(a) for a in rows] == [truth[n] for n in sorted(truth)]


def test_get_info_is_answered_by_any_live_member(registry, background_loop, tmp_path, valkey):
    """The gateway's first GetInfo finds a live trainer through the fleet's heartbeats in Redis when the trainer it
    was configured with is down; the Python client falls over to the trainers it has learnt."""
    settings = registry.settings
    fleet = f"i{uuid.uuid4().hex[:6]}"
    trainers = {m: start_live_trainer(member_settings(settings, m, fleet, ttl_s=TTL_S), background_loop,
                                      registry.address, **LIMITS) for m in ("t0", "t1")}
    client = ServiceClient(trainer=trainers["t0"].address, registry=registry.address, sampler="127.0.0.1:9",
                           retry=RETRY)
    gateway = None
    try:
        # The client learns the fleet from the first adapter it resolves (ResolveAdapter names the live members).
        created = [client.create_lora_training_client("tiny", rank=4, seed=i, name=f"ops/i{i}") for i in range(2)]
        assert len(created) == 2
        want = client.get_server_capabilities()
        trainers["t0"].close()
        again = ServiceClient(trainer=trainers["t0"].address, registry=registry.address, sampler="127.0.0.1:9",
                              retry=RETRY)
        assert again.get_server_capabilities() == want  # from t1: t0 is gone
        assert again.get_tokenizer().encode("hello fleet") == client.get_tokenizer().encode("hello fleet")
        assert {i.name for i in again.list_training_adapters()} == {"ops/i0", "ops/i1"}

        cluster = settings.model_copy(update={"trainer_fleet": fleet})
        gateway_settings = GatewaySettings(
            port=free_port(), trainer_address=trainers["t0"].address, registry_address=registry.address,
            sampler_address="127.0.0.1:9", redis_url=valkey.url, key_prefix=f"{settings.key_prefix}gw:",
            tokenizer_dir=str(tmp_path / "tokenizers"), upstream_retry_s=5.0)
        gateway = LiveGateway(gateway_settings, cluster).start()
        reply = httpx.get(f"{gateway.base_url}/api/v1/get_server_capabilities", timeout=60)
        assert reply.status_code == 200, reply.text
        assert want.base_model in reply.text
        # Without the fleet's records the same gateway has only the dead trainer to ask.
        lone = LiveGateway(gateway_settings.model_copy(update={"port": free_port()}),
                           Settings(**{**cluster.model_dump(), "trainer_fleet": ""})).start()
        try:
            failed = httpx.get(f"{lone.base_url}/api/v1/get_server_capabilities", timeout=60)
            assert failed.status_code >= 500 and trainers["t0"].address not in failed.text
        finally:
            lone.stop()
    finally:
        if gateway is not None:
            gateway.stop()
        client.close()
        trainers["t1"].close()
