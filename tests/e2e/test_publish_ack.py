"""A pushed version is acknowledged before its S3 upload, and nothing acknowledged is lost (issue 34 item 1).

Real servers on loopback: Valkey, SeaweedFS, the registry, a trainer and two samplers of one sampler fleet. The fault
is real too: the S3 server is stopped (SIGSTOP, so every S3 request hangs as on a stalled storage backend) while the
trainer publishes. PublishWeights still answers (`publish_ack = "pushed"`, the default for a trainer that pushes), the
samplers serve exactly that version from the pushed bytes, the registry lists it as pending and a download waits;
once S3 is back the trainer's upload lands and a sampler that joins later loads the version from the registry. A
trainer process SIGKILLed before the upload lands finishes it after its restart, from its spool on disk. With
`publish_ack = "stored"` the answer waits for the upload, as before."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from loraplane.local.processes import free_port
from loraplane.registry_client import CHUNK_BYTES, RegistryClient, StreamedBlob
from loraplane.v1 import common_pb2, registry_pb2, trainer_pb2, trainer_pb2_grpc
from tests.e2e.test_handoff import (
    IDS,
    entry,
    fleet_settings,
    running_deployment,
    sample,
    start_fleet,
    train_and_publish,
)
from tests.fixtures.registry import adapter_blob, bucket_objects, create_adapter, download, sha256_hex
from tests.fixtures.sampler import start_live_sampler
from trainer_svc.upload_spool import UploadSpool, spooled

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def s3_stopped(seaweed):
    os.killpg(seaweed.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(seaweed.process.pid, signal.SIGCONT)


def expect_rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def version_record(registry, name: str, version: int) -> common_pb2.AdapterVersion:
    return registry.stub().GetVersion(registry_pb2.GetVersionRequest(
        ref=common_pb2.AdapterRef(name=name, version=version)), timeout=10).version


def wait_stored(registry, name: str, version: int, timeout: float = 60.0) -> common_pb2.AdapterVersion:
    deadline = time.monotonic() + timeout
    while (record := version_record(registry, name, version)).pending:
        assert time.monotonic() < deadline, f"{name} v{version} was never stored"
        time.sleep(0.1)
    return record


def publish_within(stub, name: str, seconds: float) -> int:
    """train_and_publish's version, failing (instead of hanging) when PublishWeights does not answer in time."""
    answered: dict = {}
    publisher = threading.Thread(target=lambda: answered.update(version=train_and_publish(stub, name, create=False)),
                                 daemon=True)
    publisher.start()
    publisher.join(seconds)
    assert "version" in answered, f"PublishWeights did not answer within {seconds} s"
    return answered["version"]


def spooled_files(settings, trainer_id: str = "trainer", *, parts: bool = False) -> list[str]:
    """The spool's blobs and records; a record's `.part` only with `parts` (it exists while the spool rewrites the
    record, its atomic replace, and may be caught at any moment; once the spool is done, none may be left)."""
    directory = Path(settings.data_dir) / "trainer-uploads" / trainer_id
    return sorted(p.name for p in directory.iterdir() if parts or p.suffix != ".part") if directory.is_dir() else []


@pytest.fixture
def pushing(registry, background_loop):
    with running_deployment(fleet_settings(registry.settings), background_loop, registry.address) as running:
        yield running


def test_a_pushed_version_is_served_while_s3_stalls_and_stored_once_it_is_back(pushing, registry, seaweed):
    trainer, samplers, started = pushing
    stub = trainer.stub()
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name="ack", lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=3), base_model="tiny"))
    with s3_stopped(seaweed):
        version = publish_within(stub, "ack", 30)  # answers although S3 cannot store anything
        record = version_record(registry, "ack", version)
        assert record.pending
        assert trainer.service.spool.pending == 1 and len(spooled_files(trainer.settings)) == 2
        for live in samplers.values():
            live.wait_loaded({f"ack@v{version}"})
            assert (entry(live, f"ack@v{version}").path, entry(live, f"ack@v{version}").sha256) \
                == ("push", record.sha256)
        # Exactly that version: the sampler's logprobs are the trainer's Forward logprobs of its weights.
        reply = sample(samplers[IDS[0]], "ack", version)
        assert reply.served_version == version
        tokens = [17, 42, 99, 7, 120, 64] + list(reply.sequences[0].tokens)
        forward = stub.Forward(trainer_pb2.ForwardRequest(
            adapter="ack", seq_id=4, loss_fn="cross_entropy",
            data=[trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])])).outputs[0]
        assert max(abs(a - b) for a, b in zip(reply.sequences[0].logprobs, list(forward.logprobs)[5:])) <= 1e-4
        # A sampler that joins now (it missed the push) waits for the upload rather than failing or guessing.
        late = start_live_sampler(trainer.settings.model_copy(update={"sampler_fleet": ""}), trainer.loop,
                                  trainer.registry_address, instance_id="sampler-late")
        started.append(late)
        time.sleep(1.0)
        assert f"ack@v{version}" not in {e.key for e in late.manager.list_loaded()}
    stored = wait_stored(registry, "ack", version)
    assert stored.sha256 == record.sha256
    late.wait_loaded({f"ack@v{version}"}, timeout=60)
    assert (entry(late, f"ack@v{version}").path, entry(late, f"ack@v{version}").sha256) == ("registry", stored.sha256)
    assert sample(late, "ack", version).sequences[0].logprobs == reply.sequences[0].logprobs
    deadline = time.monotonic() + 10
    while trainer.service.spool.pending or spooled_files(trainer.settings, parts=True):
        assert time.monotonic() < deadline, "the spool kept the uploaded version"
        time.sleep(0.05)


def test_with_publish_ack_stored_the_answer_waits_for_the_upload(registry, background_loop, seaweed):
    settings = fleet_settings(registry.settings).model_copy(update={"publish_ack": "stored"})
    with running_deployment(settings, background_loop, registry.address) as (trainer, _, _):
        stub = trainer.stub()
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="slow", lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=3), base_model="tiny"))
        answered: dict = {}
        with s3_stopped(seaweed):
            publisher = threading.Thread(target=lambda: answered.update(
                version=train_and_publish(stub, "slow", create=False)))
            publisher.start()
            publisher.join(3.0)
            assert publisher.is_alive() and not answered, "answered before the upload"
        publisher.join(60)
        assert not version_record(registry, "slow", answered["version"]).pending
        assert not spooled_files(trainer.settings, parts=True)


def test_a_trainer_killed_before_the_upload_lands_uploads_the_version_after_its_restart(
        registry, background_loop, seaweed, tmp_path):
    settings = fleet_settings(registry.settings)
    samplers = start_fleet(settings, background_loop, registry.address)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), LORAPLANE_REGISTRY_ADDRESS=registry.address,
               LORAPLANE_REDIS_URL=settings.redis_url, LORAPLANE_KEY_PREFIX=settings.key_prefix,
               LORAPLANE_BASE_MODEL="tiny", LORAPLANE_SAMPLER_FLEET=settings.sampler_fleet,
               LORAPLANE_DATA_DIR=str(tmp_path / "trainer-data"), LORAPLANE_TRAINER_ID="t1")

    def start():
        with open(tmp_path / "trainer.log", "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "trainer_svc", "--port", str(port), "--gap-timeout-s", "30"],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                    start_new_session=True)
        line = proc.stdout.readline()
        assert line.startswith("TRAINER_READY "), (line, (tmp_path / "trainer.log").read_text()[-3000:])
        return proc

    proc = start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="crash", lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=3), base_model="tiny"))
        with s3_stopped(seaweed):
            version = publish_within(stub, "crash", 30)
            sha = version_record(registry, "crash", version).sha256
            assert version_record(registry, "crash", version).pending
            for live in samplers.values():
                live.wait_loaded({f"crash@v{version}"})
            os.killpg(proc.pid, signal.SIGKILL)  # before the upload can land
            proc.wait(10)
        spool = tmp_path / "trainer-data" / "trainer-uploads" / "t1"
        # The record and its whole blob (a record being rewritten with the version when the kill came leaves a
        # .part beside it, which recovery removes).
        assert {p.suffix for p in spool.iterdir()} - {".part"} == {".blob", ".json"}
        time.sleep(1.0)
        assert version_record(registry, "crash", version).pending  # nobody else uploads it
        proc = start()  # recovery reserves the version again (the same one comes back) and uploads it
        stored = wait_stored(registry, "crash", version)
        assert stored.sha256 == sha
        assert [v.version for v in registry.stub().ListVersions(
            registry_pb2.ListVersionsRequest(adapter="crash")).versions if v.kind == common_pb2.VERSION_KIND_WEIGHTS] \
            == [version]
        deadline = time.monotonic() + 10
        while list(spool.iterdir()):
            assert time.monotonic() < deadline, "the spool kept the uploaded version"
            time.sleep(0.05)
        late = start_live_sampler(settings.model_copy(update={"sampler_fleet": ""}), background_loop,
                                  registry.address, instance_id="sampler-late")
        samplers["late"] = late
        late.wait_loaded({f"crash@v{version}"}, timeout=60)
        assert (entry(late, f"crash@v{version}").path, entry(late, f"crash@v{version}").sha256) == ("registry", sha)
    finally:
        channel.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for live in samplers.values():
            live.close()


def test_a_recovered_spool_uploads_to_its_recorded_versions_and_never_revives_a_deleted_one(
        registry, background_loop, tmp_path):
    """What a restarted trainer finds in its spool: a version recorded there is uploaded to that version; one
    deleted while the trainer was down stays deleted (its bytes dropped, no new version); one whose number the
    trainer never recorded (it died before the reservation's answer) is reserved again under its idempotency key,
    which brings the same version back."""
    stub = registry.stub()
    create_adapter(stub, "sp")
    client = RegistryClient(registry.address)
    blobs = {key: adapter_blob(3_000, seed=seed) for key, seed in (("kept", 21), ("gone", 22), ("unrecorded", 23))}

    async def spool_them(spool: UploadSpool) -> dict[str, int]:
        versions = {}
        for key, data in blobs.items():
            blob = StreamedBlob(len(data), iter([data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]))
            blob.make()
            entry = spooled("sp", blob, key, 1, {}, [])
            spool.write(entry, blob)
            versions[key] = (await client.reserve("sp", blob.sha256, blob.size, idempotency_key=key)).version
            if key != "unrecorded":
                entry.version = versions[key]
                spool._write_record(entry)
        return versions

    directory = tmp_path / "spool"
    versions = background_loop.run(spool_them(UploadSpool(directory, client)), timeout=30)
    assert all(version_record(registry, "sp", v).pending for v in versions.values())
    stub.DeleteVersion(registry_pb2.DeleteVersionRequest(adapter="sp", version=versions["gone"]))

    restarted = UploadSpool(directory, client)
    started = background_loop.run(restarted.recover(), timeout=30)
    assert sorted(started) == sorted([("sp", versions["kept"]), ("sp", versions["gone"]), ("sp", 0)])
    deadline = time.monotonic() + 30
    while restarted.pending or list(directory.iterdir()):
        assert time.monotonic() < deadline, ("the spool was not drained", restarted.pending, list(directory.iterdir()))
        time.sleep(0.05)
    listed = stub.ListVersions(registry_pb2.ListVersionsRequest(adapter="sp")).versions
    assert sorted((v.version, v.pending) for v in listed) == [(versions["kept"], False), (versions["unrecorded"], False)]
    for key in ("kept", "unrecorded"):
        assert download(stub, "sp", version=versions[key])[1] == blobs[key]
    assert not [k for k in bucket_objects(registry.settings) if sha256_hex(blobs["gone"]) in k]
    background_loop.run(client.close(), timeout=10)


def test_an_on_demand_load_of_a_pending_version_staged_here_never_downloads(registry, sampler):
    """A sample naming a version still pending (its bytes not in S3) is served from bytes pushed here without any
    download: the sampler asks the registry only for the version's digest. The control: the same for a version whose
    bytes are not staged here fails once the (shortened) wait for the upload runs out."""
    from tests.fixtures.sampler import adapter_blob as sampler_blob

    sampler.create_adapter("od")
    sampler.manager.preloads = lambda adapter: False  # nothing on the event: the sample's own load must do it
    sampler.manager.registry.pending_wait_s = 1.0  # a download of a pending version gives up after 1 s

    def reserve(blob: bytes, key: str) -> int:
        reply = registry.stub().PublishVersion(iter([registry_pb2.PublishVersionRequest(
            header=registry_pb2.PublishVersionHeader(adapter="od", sha256=sha256_hex(blob), size_bytes=len(blob),
                                                     idempotency_key=key, upload_later=True))]), timeout=30)
        assert reply.version.pending
        return reply.version.version

    staged, missing = sampler_blob(31), sampler_blob(32)
    version, other = reserve(staged, "staged"), reserve(missing, "missing")

    async def stage() -> None:
        staging = sampler.manager.staging
        await staging.finish(staging.begin("od", sha256_hex(staged), len(staged)), staged)

    sampler.loop.run(stage(), timeout=30)
    assert sample(sampler, "od", version).served_version == version
    assert (entry(sampler, f"od@v{version}").path, entry(sampler, f"od@v{version}").sha256) \
        == ("push", sha256_hex(staged))
    assert version_record(registry, "od", version).pending  # nothing was stored that could have been downloaded
    error = expect_rpc_error(lambda: sample(sampler, "od", other))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "still being uploaded" in error.details()
