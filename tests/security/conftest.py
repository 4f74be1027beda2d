"""One secured cluster for the whole isolation suite: a registry, trainer, sampler and gateway with authentication on
(all real servers on the session's Valkey and SeaweedFS), the standard keys (acme = tenant A, the victim; globex =
tenant B, the attacker; admin; the services' own key) and A's resources of every kind, made through the same APIs a
tenant uses. Every case of the suite runs against this one cluster, so the suite pays for one start-up."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
import redis

from gateway_svc.config import GatewaySettings
from loraplane.config import Settings
from loraplane.rpc import ClientSecurity, sync_channel
from loraplane.v1 import (
    common_pb2,
    registry_pb2,
    registry_pb2_grpc,
    sampler_pb2,
    sampler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from tests.contract.auth_helpers import Keys, auth_settings, issue_standard_keys
from tests.fixtures.registry import start_live_registry
from tests.fixtures.sampler import adapter_blob, start_live_sampler
from tests.fixtures.trainer import start_live_trainer
from tests.gateway.conftest import LiveGateway, free_port

LORA = common_pb2.LoraConfig(rank=4, alpha=8.0, seed=1)
ADAM = trainer_pb2.AdamParams(learning_rate=1e-2)
A, B = "own", "other"  # labels of auth_helpers' keys: acme's and globex's


def datum(seed: int = 1) -> trainer_pb2.Datum:
    tokens = [(seed * 7 + i * 13) % 200 + 5 for i in range(9)]
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])


@dataclass
class Secured:
    """The running cluster, the keys, and A's resources (their ids in `a`)."""

    registry: object
    trainer: object
    sampler: object
    gateway: LiveGateway
    keys: Keys
    settings: Settings
    gateway_settings: GatewaySettings
    a: dict[str, str] = field(default_factory=dict)
    # Things of A's that must never appear in an answer to B (names, ids, tokens, sha256s, metadata values).
    secrets: set[str] = field(default_factory=set)
    # A's trainer adapter's next seq_id, A's Tinker model's next seq_id, fresh-name counter.
    trainer_seq: int = 0
    model_seq: int = 0
    _channels: dict = field(default_factory=dict)

    # ---- gRPC ---------------------------------------------------------------------------------------------
    def channel(self, service: str, label: str) -> grpc.Channel:
        key = (service, label)
        if key not in self._channels:
            address = {"registry": self.registry.address, "trainer": self.trainer.address,
                       "sampler": self.sampler.address}[service]
            self._channels[key] = sync_channel(address, ClientSecurity(api_key=self.keys.tokens.get(label, "")))
        return self._channels[key]

    def registry_stub(self, label: str = A):
        return registry_pb2_grpc.AdapterRegistryServiceStub(self.channel("registry", label))

    def trainer_stub(self, label: str = A):
        return trainer_pb2_grpc.TrainerServiceStub(self.channel("trainer", label))

    def sampler_stub(self, label: str = A):
        return sampler_pb2_grpc.SamplerServiceStub(self.channel("sampler", label))

    def next_trainer_seq(self) -> int:
        self.trainer_seq += 1
        return self.trainer_seq

    def next_model_seq(self) -> int:
        self.model_seq += 1
        return self.model_seq

    @property
    def addresses(self) -> list[str]:
        """Internal addresses no tenant may ever be shown."""
        return [self.registry.address, self.trainer.address, self.sampler.address,
                self.settings.s3_endpoint.split("://")[-1]]

    # ---- HTTP ---------------------------------------------------------------------------------------------
    def headers(self, label: str) -> dict[str, str]:
        return {"X-API-Key": f"tml-{self.keys.tokens[label]}"}

    def http(self, label: str, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers(label), **kwargs.pop("headers", {})}
        return httpx.request(method, self.gateway.base_url + path, headers=headers, timeout=60, **kwargs)

    def ok(self, method: str, path: str, label: str = A, **kwargs) -> dict:
        reply = self.http(label, method, path, **kwargs)
        assert reply.status_code == 200, (path, reply.status_code, reply.text)
        return reply.json()

    def future(self, request_id: str, label: str = A, *, may_fail: bool = False) -> dict:
        """Polls retrieve_future until the result is there (a failed one only `may_fail`)."""
        deadline = time.monotonic() + 120
        while True:
            reply = self.http(label, "POST", "/api/v1/retrieve_future", json={"request_id": request_id})
            assert reply.status_code == 200, reply.text
            if reply.headers.get("content-type", "").startswith("application/json"):
                body = reply.json()
                if body.get("type") == "try_again":
                    assert time.monotonic() < deadline
                    continue
                assert may_fail or "error" not in body, body
                return body
            return {"bytes": reply.content}

    # ---- state A's resources live in ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything of A's: the gateway's records outside B's namespace (all of them, whatever their key layout,
        so a write by B into A's records shows up here however the store keys them), A's registry adapters and
        versions (read by the admin), A's trainer adapters (their seq_ids) and what the sampler has loaded of A's;
        taken once two readings 0.1 s apart agree. Background work of A's own (an upload landing after its answer, the
        sampler following a publish) settles on a loaded machine after a case has begun; a change B's request caused,
        at once or later, still shows in the settled reading after it."""
        deadline = time.monotonic() + 60
        previous = self._snapshot_once()
        while True:
            time.sleep(0.1)
            current = self._snapshot_once()
            if current == previous or time.monotonic() > deadline:
                return current
            previous = current

    def _snapshot_once(self) -> dict:
        # The sampler follows the registry in the background (an owner's publish in the previous case): let it
        # settle first, so the snapshot holds only what a request could have changed.
        self.sampler.loop.run(self.sampler.manager.wait_idle(), timeout=60)
        r = redis.Redis.from_url(self.gateway_settings.redis_url)
        try:
            gw: dict[str, object] = {}
            b_space = f"{self.gateway_settings.key_prefix}t:globex:".encode()
            for key in r.scan_iter(match=self.gateway_settings.key_prefix.encode() + b"*", count=1000):
                if key.startswith(b_space) or b":lastreq:" in key or b":lease:" in key:
                    continue
                kind = r.type(key)
                if kind == b"string":
                    gw[key.decode()] = r.get(key)
                elif kind == b"hash":
                    gw[key.decode()] = sorted(r.hgetall(key).items())
                elif kind == b"zset":
                    gw[key.decode()] = r.zrange(key, 0, -1, withscores=True)
        finally:
            r.close()
        admin = self.registry_stub("admin")
        adapters = admin.ListAdapters(registry_pb2.ListAdaptersRequest(prefix="acme/", page_size=1000)).adapters
        # A version published before its upload (the trainer pushes to its samplers first) turns from pending to
        # stored when the upload lands, whenever that is: wait for it, as for the sampler above.
        deadline = time.monotonic() + 60
        while True:
            listed = {a.name: admin.ListVersions(registry_pb2.ListVersionsRequest(adapter=a.name, page_size=1000))
                      .versions for a in adapters}
            if not any(v.pending for vs in listed.values() for v in vs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        versions = {name: [v.SerializeToString(deterministic=True) for v in vs] for name, vs in listed.items()}
        trainer = self.trainer_stub(A).ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000))
        loaded = self.sampler_stub(A).ListLoadedAdapters(sampler_pb2.ListLoadedAdaptersRequest(page_size=1000))
        return {"gateway": gw, "registry": [a.SerializeToString(deterministic=True) for a in adapters],
                "versions": versions,
                "trainer": sorted(a.SerializeToString(deterministic=True) for a in trainer.adapters),
                "sampler": sorted((e.adapter, e.version, e.pinned) for e in loaded.adapters)}

    def tenant_state(self, label: str) -> dict:
        """What a tenant itself sees of its adapters: its registry listing (versions included) and its trainer
        listing (with seq_ids), as its own key lists them."""
        registry = self.registry_stub(label).ListAdapters(registry_pb2.ListAdaptersRequest(page_size=1000)).adapters
        trainer = self.trainer_stub(label).ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000))
        return {"registry": sorted((a.name, a.latest_version) for a in registry),
                "trainer": sorted((a.name, a.last_seq_id, a.step) for a in trainer.adapters)}

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def _seed_grpc(c: Secured) -> None:
    """A's registry adapter (metadata, a published version, an alias) and A's trainer adapter (trained, published,
    saved), all made with A's own key."""
    tag = uuid.uuid4().hex[:6]
    reg_name, train_name = f"acme/secret-reg-{tag}", f"acme/secret-train-{tag}"
    alias, meta = f"alias{tag}", f"acme-metadata-{tag}"
    registry = c.registry_stub(A)
    registry.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name=reg_name, lora_config=LORA, base_model="tiny", metadata={"owner-note": meta})))
    blob = adapter_blob(5)
    import hashlib

    sha = hashlib.sha256(blob).hexdigest()

    def publish():
        yield registry_pb2.PublishVersionRequest(header=registry_pb2.PublishVersionHeader(
            adapter=reg_name, sha256=sha, size_bytes=len(blob), metadata={"run-note": meta}, aliases=[alias]))
        yield registry_pb2.PublishVersionRequest(chunk=blob)

    version = registry.PublishVersion(publish()).version
    trainer = c.trainer_stub(A)
    trainer.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=train_name, lora_config=LORA, base_model="tiny", metadata={"train-note": meta}))
    trainer.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter=train_name, seq_id=c.next_trainer_seq(),
                                                               data=[datum(1)], loss_fn="cross_entropy"))
    trainer.OptimStep(trainer_pb2.OptimStepRequest(adapter=train_name, seq_id=c.next_trainer_seq(), adam_params=ADAM))
    published = trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter=train_name,
                                                                         seq_id=c.next_trainer_seq())).version
    saved = trainer.SaveState(trainer_pb2.SaveStateRequest(adapter=train_name, seq_id=c.next_trainer_seq())).version
    c.a.update(reg=reg_name, train=train_name, alias=alias, meta=meta, sha=sha, version=str(version.version),
               published=str(published.version), saved=str(saved.version))
    c.secrets |= {reg_name, train_name, f"secret-reg-{tag}", f"secret-train-{tag}", alias, meta, sha,
                  published.sha256, saved.sha256}


def _seed_gateway(c: Secured) -> None:
    """A's Tinker session, model, checkpoints (training state, sampler weights, one kept for the owner's delete),
    sampling session and futures, made through the gateway with A's key."""
    session = c.ok("POST", "/api/v1/create_session", json={"tags": ["acme-tag"], "user_metadata": {"k": c.a["meta"]}})
    sid = session["session_id"]
    created = c.ok("POST", "/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                          "base_model": "tiny", "lora_config": {"rank": 4}})
    model_id = created["model_id"]
    c.future(created["request_id"])
    seq = iter(range(1, 100))
    paths = {}
    for route, name in (("save_weights", "acme-ckpt-w"), ("save_weights_for_sampler", "acme-ckpt-s"),
                        ("save_weights_for_sampler", "acme-ckpt-del"), ("save_weights_external", "acme-ckpt-x")):
        accepted = c.ok("POST", f"/api/v1/{route}", json={"model_id": model_id, "seq_id": next(seq), "path": name})
        paths[name] = c.future(accepted["request_id"])["path"]
    c.model_seq = 4
    # A's signed download URL, and that URL's token re-signed by someone without the gateway's key (B's forgery).
    urls = c.ok("GET", f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/acme-ckpt-x/"
                       "external_weights_urls")["urls"]
    token = urls["adapter_config.json"].split("/external_weights/", 1)[1].split("/", 1)[0]
    forged = token.split(".")[0] + "." + "0" * 64
    sampler_id = c.ok("POST", "/api/v1/create_sampling_session", json={
        "session_id": sid, "sampling_session_seq_id": 0, "model_path": paths["acme-ckpt-s"]})["sampling_session_id"]
    sample = c.ok("POST", "/api/v1/asample", json={
        "sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 3, "seed": 1}})
    c.future(sample["request_id"])
    c.a.update(session=sid, model=model_id, sampler=sampler_id, request=sample["request_id"],
               create_request=created["request_id"], ckpt_w=paths["acme-ckpt-w"], ckpt_s=paths["acme-ckpt-s"],
               ckpt_del=paths["acme-ckpt-del"], gw_adapter=f"acme/{sid}-train-0", ckpt_x=paths["acme-ckpt-x"],
               url_token=token, url_forged=forged)
    c.secrets |= {sid, model_id, sampler_id, sample["request_id"], created["request_id"], *paths.values(), token,
                  "acme-ckpt", "acme-tag", f"{sid}-train-0"}


@pytest.fixture(scope="session")
def secured(valkey, seaweed, background_loop, tmp_path_factory) -> Secured:
    suffix = uuid.uuid4().hex[:10]
    settings = auth_settings(Settings(
        redis_url=valkey.url, s3_endpoint=seaweed.endpoint, s3_access_key=seaweed.access_key,
        s3_secret_key=seaweed.secret_key, s3_bucket=f"lp-sec-{suffix}", key_prefix=f"lpsec{suffix}:",
        base_model="tiny"))
    keys = issue_standard_keys(settings, background_loop)
    service = auth_settings(settings, api_key=keys.tokens["service"])
    registry = start_live_registry(settings, background_loop)
    trainer = start_live_trainer(service, background_loop, registry.address, gap_timeout_s=5.0)
    sampler = start_live_sampler(service, background_loop, registry.address)
    gateway_settings = GatewaySettings(
        port=free_port(), trainer_address=trainer.address, registry_address=registry.address,
        sampler_address=sampler.address, redis_url=valkey.url, key_prefix=f"lpsec{suffix}:gw:",
        tokenizer_dir=str(tmp_path_factory.mktemp("security-tokenizers")), long_poll_s=2.0, future_lease_s=3.0)
    gateway = LiveGateway(gateway_settings, cluster=service).start()
    cluster = Secured(registry, trainer, sampler, gateway, keys, settings, gateway_settings)
    try:
        _seed_grpc(cluster)
        _seed_gateway(cluster)
        # Every key token but B's own is a secret too.
        cluster.secrets |= {t for label, t in keys.tokens.items() if label != B}
        yield cluster
    finally:
        cluster.close()
        gateway.stop()
        sampler.close()
        trainer.close()
        keys.close()
        registry.close()
