"""The client SDK end to end: real registry (Valkey + SeaweedFS), real trainer and sampler on the `tiny` model."""

from __future__ import annotations

import random
import select
import socket
import threading

import pytest

from loraplane.client import (
    AdamParams,
    Datum,
    ModelInput,
    NotFoundError,
    RetryConfig,
    SamplingParams,
    ServiceClient,
    datum_from_sequence,
)

FAST_RETRY = RetryConfig(max_attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=60,
                         attempt_timeout_s=60)
ADAM = AdamParams(learning_rate=5e-2)


@pytest.fixture
def cluster(registry, trainer, sampler):
    return registry, trainer, sampler


def service_for(cluster, **kwargs) -> ServiceClient:
    registry, trainer, sampler = cluster
    kwargs.setdefault("trainer", trainer.address)
    return ServiceClient(sampler=sampler.address, registry=registry.address, retry=FAST_RETRY,
                         **kwargs)


def batch(seed: int, count: int = 4, length: int = 24) -> list[Datum]:
    rng = random.Random(seed)
    return [datum_from_sequence([rng.randrange(5, 200) for _ in range(length + 1)]) for _ in range(count)]


def forward_logprobs(training, data) -> list[float]:
    """Every target logprob of the batch, datum after datum."""
    return [lp for o in training.forward(data).result(60).loss_fn_outputs for lp in o["logprobs"].tolist()]


def test_train_publish_and_sample_the_new_version(cluster):
    service = service_for(cluster)
    training = service.create_lora_training_client("tiny", rank=4, seed=1, name="e2e/train-sample")
    data = batch(0)
    losses = []
    for _ in range(4):
        backward = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(ADAM)
        losses.append(backward.result(60).loss)
        assert not step.result(60).skipped
    assert losses[-1] < losses[0] * 0.9, losses

    sampling = training.save_weights_for_sampler("after-4", aliases=["best"]).result(60)
    assert sampling.version == 1 and sampling.path == "loraplane://e2e/train-sample@v1"
    assert sampling.published.aliases == ["best"] and sampling.published.metadata["name"] == "after-4"
    prompt = ModelInput.from_ints(data[0].model_input.tokens[:8])
    reply = sampling.sample(prompt, 2, SamplingParams(max_tokens=6, temperature=0.0, seed=3)).result(60)
    assert reply.served_version == 1
    assert len(reply.sequences) == 2 and all(len(s.tokens) == 6 for s in reply.sequences)
    assert reply.sequences[0].tokens == reply.sequences[1].tokens  # greedy

    # The sampler's logprobs of the published version match the trainer's for the same weights.
    tokens = data[0].model_input.tokens + [data[0].loss_fn_inputs["target_tokens"][-1]]
    sampled = sampling.compute_logprobs(tokens).result(60)
    learned = forward_logprobs(training, [data[0]])
    assert sampled[0] is None
    assert sampled[1:] == pytest.approx(learned, abs=1e-4)

    # A new version does not move the old SamplingClient; the base model differs from both.
    training.forward_backward(data).result(60)
    training.optim_step(ADAM).result(60)
    newer = training.save_weights_for_sampler().result(60)
    assert newer.version == 2
    assert sampling.compute_logprobs(tokens).result(60)[1:] == pytest.approx(sampled[1:], abs=1e-6)
    base = service.create_sampling_client().compute_logprobs(tokens).result(60)
    assert base[1:] != pytest.approx(sampled[1:], abs=1e-3)
    versions = service.list_versions("e2e/train-sample")
    assert [(v.version, v.kind) for v in versions] == [(1, "weights"), (2, "weights")]
    with pytest.raises(NotFoundError):
        service.create_sampling_client("e2e/train-sample", version=9).sample(prompt).result(60)


def _train_twin(service, name, pipelined: bool, steps: int = 3):
    training = service.create_lora_training_client("tiny", rank=4, seed=7, name=name)
    losses, norms = [], []
    pending = []
    for step in range(steps):
        backward = training.forward_backward(batch(step % 2), "cross_entropy")
        optim = training.optim_step(ADAM)
        if pipelined:
            pending.append((backward, optim))
        else:
            losses.append(backward.result(60).loss)
            norms.append(optim.result(60).grad_norm)
    for backward, optim in pending:
        losses.append(backward.result(60).loss)
        norms.append(optim.result(60).grad_norm)
    return training, losses, norms


def test_pipelined_forward_backward_and_optim_step_equal_sequential_ones(cluster):
    service = service_for(cluster)
    pipelined, losses_p, norms_p = _train_twin(service, "e2e/pipelined", pipelined=True)
    sequential, losses_s, norms_s = _train_twin(service, "e2e/sequential", pipelined=False)
    assert losses_p == pytest.approx(losses_s, rel=1e-5)
    assert norms_p == pytest.approx(norms_s, rel=1e-5)
    assert losses_p[2] < losses_p[0]  # same batch at steps 0 and 2: it trained
    probe = batch(99, count=2)
    assert forward_logprobs(pipelined, probe) == pytest.approx(forward_logprobs(sequential, probe), abs=1e-5)
    assert pipelined.get_info().step == sequential.get_info().step == 3


def test_chunked_batches_accumulate_like_one_request(cluster):
    chunked_service = service_for(cluster, max_chunk_datums=2)
    whole_service = service_for(cluster)
    chunked = chunked_service.create_lora_training_client("tiny", rank=4, seed=5, name="e2e/chunked")
    whole = whole_service.create_lora_training_client("tiny", rank=4, seed=5, name="e2e/whole")
    data = batch(11, count=5)
    out_chunked = chunked.forward_backward(data).result(60)
    out_whole = whole.forward_backward(data).result(60)
    assert chunked.last_seq_id == 3 and whole.last_seq_id == 1
    assert out_chunked.loss == pytest.approx(out_whole.loss, rel=1e-5)
    for a, b in zip(out_chunked.loss_fn_outputs, out_whole.loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)
    norm_chunked = chunked.optim_step(ADAM).result(60).grad_norm
    norm_whole = whole.optim_step(ADAM).result(60).grad_norm
    assert norm_chunked == pytest.approx(norm_whole, rel=1e-4)


class CuttableProxy:
    """A real TCP proxy in front of a server. Armed, it holds the server's reply bytes and, once more than
    `threshold` bytes arrived (the reply is on its way, so the server has done the work), resets both connections:
    the client never sees the reply of a call the server applied."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.armed_threshold: int | None = None
        self.cuts = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, threshold: int) -> None:
        with self._lock:
            self.armed_threshold = threshold

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _reset(*sockets: socket.socket) -> None:
        for sock in sockets:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.close()
            except OSError:
                pass

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        held = 0
        try:
            while True:
                readable, _, _ = select.select([client, upstream], [], [], 1.0)
                if self._closed:
                    break
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        raise ConnectionError
                    if sock is client:
                        upstream.sendall(data)
                        continue
                    with self._lock:
                        threshold = self.armed_threshold
                        if threshold is not None:
                            held += len(data)
                            if held > threshold:
                                self.armed_threshold = None
                                self.cuts += 1
                                self._reset(client, upstream)
                                return
                            continue  # held back, never delivered
                    client.sendall(data)
        except (ConnectionError, OSError):
            pass
        self._reset(client, upstream)

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def test_a_call_retried_after_a_cut_connection_is_applied_once(cluster):
    _, trainer, _ = cluster
    proxy = CuttableProxy(trainer.address)
    try:
        through_proxy = service_for(cluster, trainer=proxy.address)
        direct = service_for(cluster)
        cut = through_proxy.create_lora_training_client("tiny", rank=4, seed=3, name="e2e/cut")
        reference = direct.create_lora_training_client("tiny", rank=4, seed=3, name="e2e/reference")
        data = batch(21, count=6, length=32)  # a reply of several KiB: well past the threshold

        proxy.arm(threshold=1024)
        out_cut = cut.forward_backward(data).result(120)
        assert proxy.cuts == 1 and proxy.connections >= 2  # the first connection died; the retry reconnected
        out_reference = reference.forward_backward(data).result(60)
        assert out_cut.loss == pytest.approx(out_reference.loss, rel=1e-6)

        # Applied once: a second application would have doubled the accumulated gradient.
        step_cut = cut.optim_step(ADAM).result(60)
        step_reference = reference.optim_step(ADAM).result(60)
        assert step_cut.grad_norm == pytest.approx(step_reference.grad_norm, rel=1e-5)
        info = cut.get_info()
        assert (info.step, info.last_seq_id) == (1, 2)
        probe = batch(22, count=2)
        assert forward_logprobs(cut, probe) == pytest.approx(forward_logprobs(reference, probe), abs=1e-6)
    finally:
        proxy.close()


def test_two_clients_in_parallel_threads_do_not_disturb_each_other(cluster):
    def train(service, name, seed, results):
        training = service.create_lora_training_client("tiny", rank=4, seed=seed, name=name)
        futures = []
        for step in range(3):
            futures.append(training.forward_backward(batch(seed * 10 + step)))
            training.optim_step(ADAM)
        results[name] = ([f.result(60).loss for f in futures], forward_logprobs(training, batch(500, count=1)))

    parallel: dict = {}
    threads = [threading.Thread(target=train, args=(service_for(cluster), f"e2e/par-{i}", i + 1, parallel))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert set(parallel) == {"e2e/par-0", "e2e/par-1"}

    # The same two trainings, one after the other, give the same numbers.
    alone: dict = {}
    for i in range(2):
        train(service_for(cluster), f"e2e/alone-{i}", i + 1, alone)
    for i in range(2):
        losses_par, probe_par = parallel[f"e2e/par-{i}"]
        losses_alone, probe_alone = alone[f"e2e/alone-{i}"]
        assert losses_par == pytest.approx(losses_alone, rel=1e-5)
        assert probe_par == pytest.approx(probe_alone, abs=1e-5)
    assert parallel["e2e/par-0"][0] != pytest.approx(parallel["e2e/par-1"][0], rel=1e-3)


def test_save_and_load_state_restore_the_weights(cluster):
    service = service_for(cluster)
    training = service.create_lora_training_client("tiny", rank=4, seed=2, name="e2e/state")
    probe = batch(77, count=1)
    training.forward_backward(batch(1)).result(60)
    training.optim_step(ADAM).result(60)
    saved = training.save_state("checkpoint").result(60)
    assert saved.path == f"loraplane://e2e/state@v{saved.version.version}"
    assert saved.version.kind == "training_state"
    at_save = forward_logprobs(training, probe)
    training.forward_backward(batch(2)).result(60)
    training.optim_step(ADAM).result(60)
    assert forward_logprobs(training, probe) != pytest.approx(at_save, abs=1e-4)
    loaded = training.load_state_with_optimizer(saved.path).result(60)
    assert loaded.step == 1
    assert forward_logprobs(training, probe) == pytest.approx(at_save, abs=1e-6)
    # A new adapter created from the state starts from the same weights.
    clone = service.create_training_client_from_state(saved.path, name="e2e/state-clone")
    assert forward_logprobs(clone, probe) == pytest.approx(at_save, abs=1e-6)


def test_tokenizer_comes_from_the_trainer(cluster):
    service = service_for(cluster)
    tokenizer = service.get_tokenizer()
    ids = tokenizer.encode("hello loraplane", add_special_tokens=False)
    assert tokenizer.decode(ids) == "hello loraplane"
    assert tokenizer.eos_token is not None
    info = service.get_server_capabilities()
    assert info.base_model == "tiny" and "cross_entropy" in info.supported_losses


def test_rl_step_with_sampler_logprobs_and_importance_sampling(cluster):
    """The RL path of examples/rl_loop.py: sample at temperature 1 from a published version, then the trainer's
    learner logprobs of those tokens equal the sampler's (ratio 1), so the importance_sampling loss is -Σ A."""
    service = service_for(cluster)
    training = service.create_lora_training_client("tiny", rank=4, seed=9, name="e2e/rl")
    training.forward_backward(batch(3)).result(60)
    training.optim_step(ADAM).result(60)
    sampling = training.save_weights_for_sampler().result(60)
    prompt = [3, 40, 41, 42, 43]
    reply = sampling.sample(prompt, 4, SamplingParams(max_tokens=5, temperature=1.0, seed=123)).result(60)
    assert reply.served_version == sampling.version
    data, expected_loss = [], 0.0
    for index, sequence in enumerate(reply.sequences):
        advantage = [1.0, -1.0, 0.5, -0.5][index]
        tokens = prompt + sequence.tokens
        data.append(Datum(ModelInput(tokens[:-1]), {
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * (len(prompt) - 1) + sequence.logprobs,
            "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(sequence.tokens)}))
        expected_loss -= advantage * len(sequence.tokens)
    output = training.forward_backward(data, "importance_sampling").result(60)
    for sequence, out in zip(reply.sequences, output.loss_fn_outputs, strict=True):
        learner = out["logprobs"].tolist()[len(prompt) - 1:]
        assert learner == pytest.approx(sequence.logprobs, abs=1e-4)
    assert output.loss == pytest.approx(expected_loss, abs=1e-3)
    step = training.optim_step(ADAM).result(60)
    assert step.grad_norm > 0 and not step.skipped
