"""Durable training: the journal and checkpoints bring every adapter back after the trainer dies, bit for bit.

Each test compares against a crash-free reference run of the same requests on the same seed: params, AdamW moments,
step and last_seq_id must be equal (torch.equal on CPU fp32), and retries of requests that ran before the crash are
answered with their recorded outcome instead of being applied twice. The crashes are real: an in-process trainer is
dropped without any shutdown work reaching the journal, and `python -m trainer_svc` is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch

from loraplane.adapter_format import parse_training_state
from loraplane.local.processes import free_port, valkey_server
from loraplane.v1 import common_pb2, trainer_pb2
from tests.fixtures.trainer import Sequenced, start_live_trainer
from trainer_svc.journal import TrainingJournal

ROOT = Path(__file__).resolve().parents[2]
ADAM = trainer_pb2.AdamParams(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def datum(seed: int, n: int = 12) -> trainer_pb2.Datum:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, 261, (n + 1,), generator=generator).tolist()
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])


def create(stub, name: str, seed: int = 7) -> None:
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=seed)))


def snapshot(live, stub, runner: Sequenced):
    """The adapter's full training state through SaveState (a sequenced request itself) and its last_seq_id."""
    version = runner.save()
    state = parse_training_state(live.download(runner.name, version.version))
    info = next(a for a in stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters
                if a.name == runner.name)
    return state, info.last_seq_id


def assert_same_state(got, want) -> None:
    """(training state, last_seq_id) pairs: equal step and seq_id, and params and moments bit for bit."""
    (got_state, got_seq), (want_state, want_seq) = got, want
    assert got_seq == want_seq
    assert_same_training_state(got_state, want_state)


def assert_same_training_state(got, want) -> None:
    assert (got.step, set(got.params)) == (want.step, set(want.params))
    for key in want.params:
        assert torch.equal(got.params[key], want.params[key]), key
        assert torch.equal(got.exp_avg[key], want.exp_avg[key]), key
        assert torch.equal(got.exp_avg_sq[key], want.exp_avg_sq[key]), key


def script(runner: Sequenced, phase: int) -> list:
    """One phase of a realistic loop: accumulate over two ForwardBackwards, step, look with Forward, one rejected
    request (a token outside the vocabulary: it consumes its seq_id), and every other phase a publish."""
    outcomes = []
    stub = runner.stub
    outcomes.append(stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
        adapter=runner.name, seq_id=runner.next(), data=[datum(100 * phase + 1)], loss_fn="cross_entropy")))
    outcomes.append(stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
        adapter=runner.name, seq_id=runner.next(), data=[datum(100 * phase + 2, 9)], loss_fn="cross_entropy")))
    outcomes.append(stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=runner.name, seq_id=runner.next(),
                                                                adam_params=ADAM)))
    outcomes.append(runner.forward([datum(100 * phase + 3)]))
    bad = trainer_pb2.Datum(input_tokens=[5, 6, 10**6], target_tokens=[6, 7, 8])
    with pytest.raises(grpc.RpcError) as rejected:
        stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter=runner.name, seq_id=runner.next(),
                                                                data=[bad]))
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    if phase % 2 == 1:
        outcomes.append(stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter=runner.name,
                                                                              seq_id=runner.next())).version.version)
    return outcomes


def journal_of(settings) -> TrainingJournal:
    return TrainingJournal(settings.redis_url, key_prefix=settings.key_prefix, trainer_id=settings.trainer_id)


def test_a_restarted_trainer_recovers_every_adapter_bit_for_bit_and_answers_retries_from_the_journal(
        registry, background_loop):
    limits = {"gap_timeout_s": 5.0, "checkpoint_every_steps": 3}
    reference = start_live_trainer(registry.settings.model_copy(update={"trainer_id": "reference"}),
                                   background_loop, registry.address, **limits)
    live = start_live_trainer(registry.settings, background_loop, registry.address, **limits)
    try:
        ref_stub, stub = reference.stub(), live.stub()
        for name, seed in (("ten/a", 3), ("ten/b", 4)):
            create(ref_stub, f"ref-{name}", seed)
            create(stub, name, seed)
        runners = {name: Sequenced(stub, name, ADAM) for name in ("ten/a", "ten/b")}
        ref_runners = {name: Sequenced(ref_stub, f"ref-{name}", ADAM) for name in ("ten/a", "ten/b")}
        for phase in range(5):  # ten/a reaches step 5: one checkpoint (step 3) plus journal
            script(runners["ten/a"], phase)
            script(ref_runners["ten/a"], phase)
        for phase in range(2):  # ten/b: no checkpoint yet, recovered from its journal alone
            script(runners["ten/b"], phase)
            script(ref_runners["ten/b"], phase)
        # A ForwardBackward whose answer the client never saw: it ran, then the trainer died.
        last_fb = trainer_pb2.ForwardBackwardRequest(adapter="ten/b", seq_id=runners["ten/b"].next(),
                                                     data=[datum(999)], loss_fn="cross_entropy")
        first_answer = stub.ForwardBackward(last_fb)
        ref_runners["ten/b"].next()
        ref_stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            adapter="ref-ten/b", seq_id=last_fb.seq_id, data=[datum(999)], loss_fn="cross_entropy"))
        deadline = time.monotonic() + 20
        while not any(v.metadata.get("loraplane.checkpoint") == "auto" for v in
                      live.registry_versions("ten/a")) and time.monotonic() < deadline:
            time.sleep(0.1)
        live.close()  # the in-memory state is gone; only the journal and the checkpoints remain

        live = start_live_trainer(registry.settings, background_loop, registry.address, **limits)
        stub = live.stub()
        for runner in runners.values():
            runner.stub = stub
        # The retry is answered from the journal: the same outputs, and the gradient is not accumulated twice.
        again = stub.ForwardBackward(last_fb)
        assert list(again.outputs[0].logprobs) == list(first_answer.outputs[0].logprobs)
        # The same seq_id with another payload is still refused.
        with pytest.raises(grpc.RpcError) as reused:
            stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="ten/b", seq_id=last_fb.seq_id,
                                                                    data=[datum(5)]))
        assert reused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # Training continues with the next seq_ids, on both adapters.
        step_b = stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="ten/b", seq_id=runners["ten/b"].next(),
                                                             adam_params=ADAM))
        ref_step_b = ref_stub.OptimStep(trainer_pb2.OptimStepRequest(
            adapter="ref-ten/b", seq_id=ref_runners["ten/b"].next(), adam_params=ADAM))
        assert (step_b.step, step_b.grad_norm) == (ref_step_b.step, ref_step_b.grad_norm)
        script(runners["ten/a"], 5)
        script(ref_runners["ten/a"], 5)
        for name in ("ten/a", "ten/b"):
            assert_same_state(snapshot(live, stub, runners[name]), snapshot(reference, ref_stub, ref_runners[name]))
    finally:
        live.close()
        reference.close()


def test_checkpoints_trim_the_journal_keep_a_bounded_number_and_are_not_loadstates_latest(registry, background_loop):
    live = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=5.0,
                              checkpoint_every_steps=2, checkpoints_kept=2, journal_retry_window=2)
    journal = journal_of(registry.settings)
    try:
        stub = live.stub()
        create(stub, "ckpt")
        runner = Sequenced(stub, "ckpt", ADAM)
        for i in range(9):
            runner.train([datum(i)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            auto = [v for v in live.registry_versions("ckpt") if v.metadata.get("loraplane.checkpoint") == "auto"]
            if sorted(v.training_step for v in auto) == [6, 8] and journal.length("ckpt") <= 7:
                break
            time.sleep(0.1)
        assert sorted(v.training_step for v in auto) == [6, 8]  # older ones deleted by retention
        # 9 steps wrote 18 requests and 17 outcomes (the last waits to ride along with the next request); the
        # checkpoint at step 8 left the retry window (2 requests and their outcomes) and step 9's 3 entries. (How
        # long the journal grows meanwhile depends on how fast the checkpoint uploads land, so only the settled
        # length is asserted.)
        assert journal.length("ckpt") == 7
        # LoadState's "newest training state" means the user's SaveStates, never the trainer's own checkpoints.
        with pytest.raises(grpc.RpcError) as none_saved:
            stub.LoadState(trainer_pb2.LoadStateRequest(adapter="ckpt", seq_id=runner.next(),
                                                        source=common_pb2.AdapterRef(name="ckpt")))
        assert none_saved.value.code() == grpc.StatusCode.NOT_FOUND
        # Deleting the adapter from the trainer deletes its checkpoints and its journal.
        stub.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name="ckpt"))
        assert not [v for v in live.registry_versions("ckpt") if v.metadata.get("loraplane.checkpoint")]
        assert journal.length("ckpt") == 0 and journal.adapters() == []
    finally:
        journal.close()
        live.close()


def test_a_journal_that_cannot_be_written_fails_requests_as_unavailable_without_consuming_seq_ids(
        registry, background_loop, tmp_path):
    # A real fault: the journal lives on its own Valkey, which is killed (the registry keeps its own Redis).
    valkey = valkey_server(tmp_path / "journal-valkey")
    valkey.start()
    settings = registry.settings.model_copy(update={"redis_url": valkey.url})
    live = start_live_trainer(settings, background_loop, registry.address, gap_timeout_s=5.0)
    try:
        stub = live.stub()
        create(stub, "fragile")
        runner = Sequenced(stub, "fragile", ADAM)
        assert runner.train([datum(1)]).step == 1
        port = valkey.port
        valkey.kill()
        # Tried: ForwardBackward while the journal's Redis is dead.
        with pytest.raises(grpc.RpcError) as down:
            stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="fragile", seq_id=3,
                                                                    data=[datum(2)]))
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "journal" in down.value.details()
        valkey = valkey_server(tmp_path / "journal-valkey", port=port)
        valkey.start()
        # The seq_id was not consumed and nothing ran: the retry runs it once, and the step follows as usual.
        runner.seq = 2
        assert runner.train([datum(2)]).step == 2
        info = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters[0]
        assert info.last_seq_id == 4
    finally:
        live.close()
        valkey.stop()


def test_sigkilled_trainer_process_comes_back_and_the_client_rides_across(registry, background_loop, tmp_path):
    """`python -m trainer_svc` SIGKILLed mid-training (twice, once with requests in flight) and restarted on the
    same port: the Python client's retries carry its pipelined calls across, and the final state equals a
    crash-free run of the same calls on an in-process trainer."""
    from loraplane.client import AdamParams, ServiceClient, datum_from_sequence

    port = free_port()
    settings = registry.settings
    env = dict(os.environ, PYTHONPATH=str(ROOT), LORAPLANE_REGISTRY_ADDRESS=registry.address,
               LORAPLANE_REDIS_URL=settings.redis_url, LORAPLANE_KEY_PREFIX=settings.key_prefix,
               LORAPLANE_CHECKPOINT_EVERY_STEPS="2", LORAPLANE_BASE_MODEL="tiny")

    def start():
        with open(tmp_path / "trainer.log", "a") as log:
            return subprocess.Popen([sys.executable, "-m", "trainer_svc", "--port", str(port), "--gap-timeout-s", "30"],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                    start_new_session=True)

    def wait_ready(proc):
        line = proc.stdout.readline()
        assert line.startswith("TRAINER_READY "), (line, (tmp_path / "trainer.log").read_text()[-3000:])

    def kill(proc):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def batch(i):
        tokens = torch.randint(5, 261, (14,), generator=torch.Generator().manual_seed(i)).tolist()
        return [datum_from_sequence(tokens)]

    adam = AdamParams(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8)
    proc = start()
    wait_ready(proc)
    address = f"127.0.0.1:{port}"
    try:
        with ServiceClient(trainer=address, registry=registry.address) as service:
            client = service.create_lora_training_client("tiny", rank=4, seed=11, name="crashy")
            for i in range(3):
                client.forward_backward(batch(i)).result()
                client.optim_step(adam).result()
            kill(proc)  # between calls
            proc = start()
            wait_ready(proc)
            for i in range(3, 5):
                client.forward_backward(batch(i)).result()
                client.optim_step(adam).result()
            # Pipelined calls in flight while the trainer dies; the restart happens under the client's retries.
            pending = [client.forward_backward(batch(5)), client.optim_step(adam)]
            time.sleep(0.05)
            kill(proc)
            proc = start()
            results = [future.result() for future in pending]
            wait_ready(proc)
            assert results[1].step == 6
            crashed_version = client.save_state().result().version.version
            last_seq = client.get_info().last_seq_id
    finally:
        if proc.poll() is None:
            kill(proc)

    # The reference: the same calls on an in-process trainer that never crashes.
    reference = start_live_trainer(settings.model_copy(update={"trainer_id": "reference"}), background_loop,
                                   registry.address)
    try:
        with ServiceClient(trainer=reference.address, registry=registry.address) as service:
            client = service.create_lora_training_client("tiny", rank=4, seed=11, name="calm")
            for i in range(6):
                client.forward_backward(batch(i)).result()
                client.optim_step(adam).result()
            final = client.save_state().result()
            assert client.get_info().last_seq_id == last_seq
        calm = parse_training_state(reference.download("calm", final.version.version))
        crashed = parse_training_state(reference.download("crashy", crashed_version))
    finally:
        reference.close()
    assert crashed.step == calm.step == 6
    for key in calm.params:
        assert torch.equal(crashed.params[key], calm.params[key]), key
        assert torch.equal(crashed.exp_avg[key], calm.exp_avg[key]), key
        assert torch.equal(crashed.exp_avg_sq[key], calm.exp_avg_sq[key]), key
    with redis.Redis.from_url(settings.redis_url) as db:
        assert db.hexists(f"{settings.key_prefix}trainer:trainer:adapters", "crashy")
