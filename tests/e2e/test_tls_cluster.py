"""`loraplane up --mtls` as an operator runs it (real subprocesses): keys on by default, the admin key in the data dir
with mode 0600, mutual TLS with a local CA, `loraplane keys` issuing and revoking tenant keys that the services honour.
Valkey and SeaweedFS are the test session's (external to the cluster): embedded ones are tests/e2e/test_cli_cluster.py's,
and starting and stopping them here again would only add time."""

from __future__ import annotations

import re
import stat
import time
import urllib.request

import grpc

from loraplane.auth import CACHE_TTL_S
from loraplane.client import ServiceClient
from loraplane.client.errors import APIError
from loraplane.local.state import read_cluster_state
from loraplane.rpc import ClientSecurity, check_health, sync_channel
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from tests.e2e.test_cli_cluster import _cli, _cli_here


def test_up_tls_with_keys_end_to_end(tmp_path, isolated_settings):
    data_dir = tmp_path / "cluster"
    s = isolated_settings
    env = {"LORAPLANE_REDIS_URL": s.redis_url, "LORAPLANE_S3_ENDPOINT": s.s3_endpoint,
           "LORAPLANE_S3_ACCESS_KEY": s.s3_access_key, "LORAPLANE_S3_SECRET_KEY": s.s3_secret_key,
           "LORAPLANE_S3_BUCKET": s.s3_bucket, "LORAPLANE_KEY_PREFIX": s.key_prefix}
    up = _cli("up", "--data-dir", str(data_dir), "--services", "registry", "--mtls", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        key_file = data_dir / "admin.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        ca = (data_dir / "tls" / "ca.pem").read_bytes()
        address = read_cluster_state(data_dir).addresses()["registry"]
        metrics_url = re.search(r"registry metrics: (http://\S+)", up.stdout).group(1)
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            assert reply.status == 200
        status = _cli_here("status", "--data-dir", str(data_dir), env=env)
        assert "healthy" in status.stdout and "unhealthy" not in status.stdout, status.stdout

        # Over mTLS a plaintext probe gets nothing, nor does TLS without a client certificate; with the CA and the
        # client certificate but no key, the registry answers UNAUTHENTICATED.
        assert not check_health(address, timeout=1.0, security=ClientSecurity())
        assert not check_health(address, timeout=1.0, security=ClientSecurity(tls=True, ca=ca))
        client_cert = {"cert": (data_dir / "tls" / "client.pem").read_bytes(),
                       "key": (data_dir / "tls" / "client.key").read_bytes()}
        with sync_channel(address, ClientSecurity(tls=True, ca=ca, **client_cert)) as channel:
            try:
                registry_pb2_grpc.AdapterRegistryServiceStub(channel).ListAdapters(registry_pb2.ListAdaptersRequest())
                raise AssertionError("a keyless call was answered")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED

        # The admin (the SDK reads the key and the CA from the data dir) makes adapters of two tenants.
        admin = ServiceClient(data_dir=data_dir)
        for name in ("acme/a", "globex/b"):
            admin._registry_call("CreateAdapter", lambda c, n=name: c.create_adapter(
                n, base_model="tiny", lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0)))
        assert [a.name for a in admin.list_adapters()] == ["acme/a", "globex/b"]
        admin.close()

        created = _cli_here("keys", "create", "--tenant", "acme", "--data-dir", str(data_dir), env=env)
        assert created.returncode == 0, created.stdout + created.stderr
        token = re.search(r"^(lpk_\S+)$", created.stdout, re.MULTILINE).group(1)
        key_id = token.split("_")[1]
        listed = _cli_here("keys", "ls", "--data-dir", str(data_dir), env=env)
        assert key_id in listed.stdout and token not in listed.stdout

        tenant = ServiceClient(data_dir=data_dir, api_key=token)
        assert [a.name for a in tenant.list_adapters()] == ["acme/a"]
        tenant.close()

        assert _cli_here("keys", "revoke", key_id, "--data-dir", str(data_dir), env=env).returncode == 0
        time.sleep(CACHE_TTL_S)  # the registry's key cache forgets the key by then
        revoked = ServiceClient(data_dir=data_dir, api_key=token)
        try:
            revoked.list_adapters()
            raise AssertionError("a revoked key was accepted")
        except APIError as exc:
            assert "UNAUTHENTICATED" in str(exc) or "revoked" in str(exc), exc
        revoked.close()
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            scraped = reply.read().decode()
        assert 'loraplane_rpc_total{code="UNAUTHENTICATED",method="ListAdapters",service="AdapterRegistryService"}' \
            in scraped, scraped[:2000]
    finally:
        down = _cli("down", "--data-dir", str(data_dir), env=env)
    assert down.returncode == 0, down.stdout + down.stderr
