"""Services over TLS and mTLS with certificates from the local CA that `loraplane up --tls` makes (real servers,
real grpc TLS): a trusting client connects, a plaintext client and an untrusting one are refused, mTLS refuses a
client without a certificate, and the trainer reaches a TLS registry with its service key."""

from __future__ import annotations

import grpc
import pytest

from loraplane.local.tls import make_local_pki
from loraplane.rpc import ClientSecurity, check_health, sync_channel
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from tests.contract.auth_helpers import auth_settings, expect_code, issue_standard_keys
from tests.fixtures.registry import start_live_registry
from tests.fixtures.trainer import start_live_trainer


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_local_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def foreign_pki(tmp_path_factory):
    return make_local_pki(tmp_path_factory.mktemp("foreign-pki"))


def tls_settings(settings, pki, mtls: bool = False, **extra):
    return settings.model_copy(update={
        "tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key), "tls_ca": str(pki.ca),
        "tls_client_ca": str(pki.ca) if mtls else "",
        "tls_client_cert": str(pki.client_cert) if mtls else "", "tls_client_key": str(pki.client_key) if mtls else "",
        **extra})


def list_adapters(address: str, security: ClientSecurity):
    with sync_channel(address, security) as channel:
        return registry_pb2_grpc.AdapterRegistryServiceStub(channel).ListAdapters(
            registry_pb2.ListAdaptersRequest(), timeout=5)


def test_tls_registry_serves_trusting_clients_only(isolated_settings, background_loop, pki, foreign_pki):
    live = start_live_registry(tls_settings(isolated_settings, pki), background_loop)
    try:
        list_adapters(live.address, ClientSecurity(tls=True, ca=pki.ca.read_bytes()))
        assert check_health(live.address, security=ClientSecurity(tls=True, ca=pki.ca.read_bytes()))
        # Plaintext against a TLS port, and TLS trusting another CA, never get an answer.
        expect_code(lambda: list_adapters(live.address, ClientSecurity()), grpc.StatusCode.UNAVAILABLE)
        expect_code(lambda: list_adapters(live.address, ClientSecurity(tls=True, ca=foreign_pki.ca.read_bytes())),
                    grpc.StatusCode.UNAVAILABLE)
        assert not check_health(live.address, timeout=1.0, security=ClientSecurity())
    finally:
        live.close()


def test_mtls_registry_demands_a_client_certificate(isolated_settings, background_loop, pki, foreign_pki):
    live = start_live_registry(tls_settings(isolated_settings, pki, mtls=True), background_loop)
    ca = pki.ca.read_bytes()
    try:
        list_adapters(live.address, ClientSecurity(tls=True, ca=ca, cert=pki.client_cert.read_bytes(),
                                                   key=pki.client_key.read_bytes()))
        expect_code(lambda: list_adapters(live.address, ClientSecurity(tls=True, ca=ca)), grpc.StatusCode.UNAVAILABLE)
        # A certificate from another CA is no better than none.
        expect_code(lambda: list_adapters(live.address, ClientSecurity(
            tls=True, ca=ca, cert=foreign_pki.client_cert.read_bytes(), key=foreign_pki.client_key.read_bytes())),
            grpc.StatusCode.UNAVAILABLE)
    finally:
        live.close()


def test_trainer_and_registry_over_mtls_with_keys(isolated_settings, background_loop, pki):
    """The whole secured path: client → trainer (mTLS + tenant key) → registry (mTLS + service key)."""
    settings = tls_settings(auth_settings(isolated_settings), pki, mtls=True)
    keys = issue_standard_keys(settings, background_loop)
    registry = start_live_registry(settings, background_loop)
    trainer = start_live_trainer(settings.model_copy(update={"api_key": keys.tokens["service"]}), background_loop,
                                 registry.address)
    client_tls = {"tls": True, "ca": pki.ca.read_bytes(), "cert": pki.client_cert.read_bytes(),
                  "key": pki.client_key.read_bytes()}
    try:
        stub = keys.stub(trainer_pb2_grpc.TrainerServiceStub, trainer.address, "own", **client_tls)
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="acme/tls", lora_config=common_pb2.LoraConfig(rank=2, alpha=4.0)))
        version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="acme/tls", seq_id=1)).version
        assert version.adapter == "acme/tls" and version.version == 1
        expect_code(lambda: keys.stub(trainer_pb2_grpc.TrainerServiceStub, trainer.address, "none", **client_tls)
                    .GetInfo(trainer_pb2.GetInfoRequest()), grpc.StatusCode.UNAUTHENTICATED)
    finally:
        trainer.close()
        keys.close()
        registry.close()
