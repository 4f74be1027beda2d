"""The official `tinker` SDK (0.38, unmodified) against a live gateway on real registry, trainer and sampler servers
(`tiny` model): training with every built-in loss, sampling, logprobs, checkpoints and the RestClient."""

from __future__ import annotations

import random
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from loraplane.v1 import trainer_pb2

ADAM = types.AdamParams(learning_rate=5e-2)


def datum(tokens: list[int], **inputs) -> types.Datum:
    """Position-aligned: model_input = tokens[:-1] predicts target_tokens = tokens[1:]."""
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def batch(seed: int, count: int = 2, length: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(length + 1)] for _ in range(count)]


def target_logprobs(training, seqs) -> list[np.ndarray]:
    out = training.forward([datum(s) for s in seqs], "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


@pytest.fixture(scope="module")
def service(cluster):
    client = tinker.ServiceClient(base_url=cluster.base_url)
    yield client
    # Finishes the session (POST sessions/{id}/finish); not awaited: the SDK's shutdown waits out its heartbeat.
    client.close("success")


def test_train_sample_checkpoint_and_rest_client(cluster, service):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    assert training.get_info().model_data.model_name == "tiny"
    # get_tokenizer loads offline from the directory get_info names.
    tokenizer = training.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("hi there")) == "hi there"

    seqs = batch(0)
    data = [datum(s, weights=[1.0] * (len(s) - 1)) for s in seqs]
    losses = []
    for _ in range(4):
        backward = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(ADAM)
        result = backward.result()
        losses.append(result.metrics["loss:sum"])
        assert len(result.loss_fn_outputs) == 2 and list(result.loss_fn_outputs[0]["logprobs"].shape) == [20]
        assert "grad_norm:mean" in step.result().metrics
    assert losses[-1] < losses[0] * 0.9, losses

    # An ephemeral sampling client serves exactly the weights just trained: its prompt logprobs equal the
    # trainer's forward logprobs.
    learned = target_logprobs(training, seqs[:1])[0]
    sampling = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(seqs[0])
    sampled = sampling.compute_logprobs(prompt).result()
    assert sampled[0] is None
    np.testing.assert_allclose(sampled[1:], learned, atol=1e-3)
    reply = sampling.sample(types.ModelInput.from_ints(seqs[0][:6]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=1)).result()
    assert len(reply.sequences) == 2
    for seq in reply.sequences:
        assert len(seq.tokens) == 5 and len(seq.logprobs) == 5 and seq.stop_reason == "length"
        assert seq.sequence_id
    with_prompt = sampling.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True
                                  ).result()
    np.testing.assert_allclose(with_prompt.prompt_logprobs[1:], learned, atol=1e-3)

    # A named sampler checkpoint pins that version: training on does not move it.
    path_v1 = training.save_weights_for_sampler("first").result().path
    assert path_v1 == f"tinker://{training.model_id}/sampler_weights/first"
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(ADAM).result()
    path_v2 = training.save_weights_for_sampler("second").result().path
    pinned = service.create_sampling_client(model_path=path_v1).result()
    assert pinned.get_base_model() == "tiny"
    np.testing.assert_allclose(pinned.compute_logprobs(prompt).result()[1:], learned, atol=1e-3)
    newer = service.create_sampling_client(model_path=path_v2).result().compute_logprobs(prompt).result()
    assert np.abs(np.array(newer[1:]) - learned).max() > 1e-3
    base = service.create_sampling_client(base_model="tiny").result().compute_logprobs(prompt).result()
    assert np.abs(np.array(base[1:]) - learned).max() > 1e-3

    # save_state -> a new training client from it (with optimizer) continues from the same weights.
    state_path = training.save_state("state-a").result().path
    now = target_logprobs(training, seqs[:1])[0]
    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    assert resumed.model_id != training.model_id
    np.testing.assert_allclose(target_logprobs(resumed, seqs[:1])[0], now, atol=1e-5)
    # ... and load_state on the original rewinds it after more training.
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(ADAM).result()
    assert np.abs(target_logprobs(training, seqs[:1])[0] - now).max() > 1e-4
    training.load_state(state_path).result()
    np.testing.assert_allclose(target_logprobs(training, seqs[:1])[0], now, atol=1e-5)
    # load_state_with_optimizer also restores Adam's moments: the next step then equals the resumed client's.
    training.load_state_with_optimizer(state_path).result()
    for client in (training, resumed):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(ADAM).result()
    np.testing.assert_allclose(target_logprobs(training, seqs[:1])[0], target_logprobs(resumed, seqs[:1])[0],
                               atol=1e-5)

    rest = tinker.RestClient(base_url=cluster.base_url)
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert set(listed) == {"sampler_weights/first", "sampler_weights/second", "weights/state-a"}
    assert listed["weights/state-a"].checkpoint_type == "training" and listed["weights/state-a"].tinker_path == \
        state_path
    run = rest.get_training_run(training.model_id).result()
    assert run.base_model == "tiny" and run.lora_rank == 4 and run.is_lora
    runs = rest.list_training_runs(limit=100).result()
    assert {training.model_id, resumed.model_id} <= {r.training_run_id for r in runs.training_runs}
    info = rest.get_weights_info_by_tinker_path(state_path).result()
    assert info.base_model == "tiny" and info.lora_rank == 4
    assert "tiny" in {m.model_name for m in rest.get_server_capabilities().result().supported_models}
    rest.delete_checkpoint_from_tinker_path(path_v2).result()
    listed = {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert "sampler_weights/second" not in listed
    with pytest.raises(tinker.NotFoundError):
        service.create_sampling_client(model_path=path_v2).result()


def test_a_checkpoint_expires_after_its_ttl(cluster, service):
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    kept = training.save_state("kept").result().path
    brief = training.save_state("brief", ttl_seconds=1).result().path
    rest = tinker.RestClient(base_url=cluster.base_url)
    listed = {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed[brief].expires_at is not None and listed[kept].expires_at is None
    adapter = cluster.gateway_settings.default_tenant + "/" + training.model_id.replace(":train:", "-train-")
    assert len(cluster.trainer.registry_versions(adapter)) == 2
    time.sleep(1.2)
    assert {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints} == {kept}
    with pytest.raises(tinker.NotFoundError):
        service.create_training_client_from_state(brief).result()
    assert len(cluster.trainer.registry_versions(adapter)) == 1  # its registry version went with it


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_raise_the_logprobs_of_positive_advantage_tokens(service, loss_fn):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    seqs = batch(1)
    q = target_logprobs(training, seqs)
    data = [datum(s, logprobs=lp.tolist(), advantages=[1.0] * len(lp)) for s, lp in zip(seqs, q)]
    for _ in range(3):
        result = training.forward_backward(data, loss_fn).result()
        assert np.isfinite(result.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = target_logprobs(training, seqs)
    assert np.mean(np.concatenate(after)) > np.mean(np.concatenate(q)) + 0.1


def test_an_unsupported_loss_fails_as_a_user_error_and_the_client_goes_on(service):
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    seqs = batch(2, count=1)
    q = target_logprobs(training, seqs)[0]
    rl = [datum(seqs[0], logprobs=q.tolist(), advantages=[1.0] * len(q))]
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.forward_backward(rl, "custom").result()
    assert "custom" in str(failed.value) and "not supported" in str(failed.value)
    # The refused request still consumed its seq_id on the trainer: the next one runs at once, no gap wait.
    started = time.monotonic()
    training.forward_backward([datum(seqs[0])], "cross_entropy").result()
    assert time.monotonic() - started < 3.0


def test_chunked_compressed_forward_backward_accumulates_in_seq_id_order(cluster, service):
    """With small chunks the SDK splits one forward_backward into several requests sent in parallel, lowest seq_id
    last, here zstd-compressed: the trainer must run them in order and accumulate every chunk's gradient, so one
    step equals the same step on an unchunked twin."""
    replica = cluster.another_gateway(fwdbwd_max_chunk_len=2, compress_fwdbwd=True)
    chunked_service = tinker.ServiceClient(base_url=replica.base_url)
    try:
        seqs = batch(4, count=5)
        data = [datum(s) for s in seqs]
        twin = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        chunked = chunked_service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        forward = chunked.forward(data, "cross_entropy").result()
        singles = [chunked.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
                   for d in data]
        for out, single in zip(forward.loss_fn_outputs, singles):
            np.testing.assert_allclose(out["logprobs"].to_numpy(), single, atol=1e-6)
        results = []
        for client in (twin, chunked):
            results.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            client.optim_step(ADAM).result()
        assert results[0] == pytest.approx(results[1], rel=1e-5)
        after_twin, after_chunked = target_logprobs(twin, seqs), target_logprobs(chunked, seqs)
        for a, b in zip(after_twin, after_chunked):
            np.testing.assert_allclose(a, b, atol=1e-4)
        assert np.abs(after_twin[0] - singles[0]).max() > 1e-3  # the step did move the weights
        # The batches really went as 3 chunks (3 seq_ids each): forward, 5 single forwards, forward_backward,
        # optim_step, forward.
        adapters = {a.name: a for a in cluster.trainer.stub().ListAdapters(
            trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000)).adapters}
        name = cluster.gateway_settings.default_tenant + "/" + chunked.model_id.replace(":train:", "-train-")
        assert adapters[name].last_seq_id == 3 + 5 + 3 + 1 + 3
    finally:
        chunked_service.close("success")
        replica.stop()


def test_wire_errors_and_retries(cluster, service):
    http = httpx.Client(base_url=cluster.base_url + "/api/v1", timeout=30)
    # Unsupported endpoints answer the SDK's error shape, never a 500 or an empty body.
    reply = http.post("/copy_weights", json={})
    assert reply.status_code == 400 and "not supported" in reply.json()["error"]
    assert reply.json()["category"] == "user"
    # A route that does not exist is a 404 (not a 400 "not supported"), in the same shape.
    reply = http.post("/no/such/endpoint", json={})
    assert reply.status_code == 404 and "no such route" in reply.json()["error"]
    assert reply.json()["category"] == "user" and reply.headers["x-should-retry"] == "false"
    reply = http.post("/retrieve_future", json={"request_id": "nope"})
    assert reply.status_code == 404 and "nope" in reply.json()["error"]
    reply = http.post("/create_model", content=b"{not json")
    assert reply.status_code == 400 and reply.json()["field"] == "body"
    reply = http.post("/create_session", json={"tags": []})
    session = reply.json()["session_id"]
    reply = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "gpt-9",
                                             "lora_config": {"rank": 4}})
    assert reply.status_code == 400 and "gpt-9" in reply.json()["error"] and reply.json()["field"] == "base_model"
    reply = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                             "lora_config": {"rank": "four"}})
    assert reply.status_code == 400 and reply.json()["field"] == "lora_config.rank"
    sampler = http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                          "base_model": "tiny"}).json()["sampling_session_id"]
    reply = http.post("/asample", json={"sampling_session_id": sampler, "seq_id": "x", "num_samples": 1,
                                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}})
    assert reply.status_code == 400 and reply.json()["field"] == "seq_id"
    # A retried optim_step (same model, same seq_id) gets the first request's future, applied once.
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    training.forward_backward([datum(batch(3, count=1)[0])], "cross_entropy").result()
    body = {"model_id": training.model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01},
            "type": "optim_step"}
    first, again = http.post("/optim_step", json=body).json(), http.post("/optim_step", json=body).json()
    assert first["request_id"] == again["request_id"]
    result = http.post("/retrieve_future", json={"request_id": first["request_id"]}).json()
    assert result["metrics"]["step:mean"] == 1.0
    # A sequenced request the gateway refuses (a checkpoint name with '/') still spends its seq_id on the
    # trainer, so the next seq_id runs at once instead of waiting out the trainer's gap timeout.
    refused = http.post("/save_weights", json={"model_id": training.model_id, "seq_id": 3, "path": "a/b",
                                               "type": "save_weights"}).json()
    failed = http.post("/retrieve_future", json={"request_id": refused["request_id"]}).json()
    assert failed["category"] == "user" and "a/b" in failed["error"]
    started = time.monotonic()
    nxt = http.post("/optim_step", json={**body, "seq_id": 4}).json()
    assert http.post("/retrieve_future", json={"request_id": nxt["request_id"]}).json()["metrics"]
    assert time.monotonic() - started < 3.0
