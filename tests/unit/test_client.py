"""The client SDK against real gRPC servers on loopback.

The trainer and sampler here are small recording servicers (not the real services): they let these tests see
exactly which requests the client sent (seq_ids, chunks, converted fields) and make a server answer UNAVAILABLE a
chosen number of times. End-to-end behaviour against the real services is in tests/e2e/test_client*.py.
"""

from __future__ import annotations

import math
import threading

import grpc
import numpy as np
import pytest
import torch

from loraplane import errors
from loraplane.client import (
    AdamParams,
    APIError,
    Datum,
    InvalidArgumentError,
    ModelInput,
    NotFoundError,
    RetryConfig,
    SamplingClient,
    SamplingParams,
    ServiceClient,
    TensorData,
    UnavailableError,
    datum_from_sequence,
    merge_metrics,
    parse_path,
    split_into_chunks,
)
from loraplane.client._runtime import runtime
from loraplane.rpc import GrpcServer, map_servicer_errors
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from trainer_svc.losses import supported_losses

FAST_RETRY = RetryConfig(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05, total_timeout_s=10)


@map_servicer_errors
class RecordingTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """Answers like a trainer would in shape: per-datum logprobs = -target/1000, elementwise_loss = weights.
    Records every attempt; applies each (adapter, seq_id) once and replays its first reply to a retry."""

    def __init__(self):
        self.attempts: list[tuple[str, str, int, int]] = []  # (method, adapter, seq_id, n_datums)
        self.applied: dict[tuple[str, int], object] = {}
        self.unavailable_left: dict[int, int] = {}  # seq_id -> how many attempts still fail
        self.max_batch_datums = 0
        self.adapters: dict[str, trainer_pb2.TrainerAdapter] = {}
        self.lock = threading.Lock()

    def _record(self, method, adapter, seq_id, n):
        with self.lock:
            self.attempts.append((method, adapter, seq_id, n))
            if self.unavailable_left.get(seq_id, 0) > 0:
                self.unavailable_left[seq_id] -= 1
                raise errors.Unavailable(f"injected outage for seq_id {seq_id}")

    def _apply(self, adapter, seq_id, make_reply):
        key = (adapter, seq_id)
        with self.lock:
            if key not in self.applied:
                self.applied[key] = make_reply()
                self.adapters[adapter].last_seq_id = max(self.adapters[adapter].last_seq_id, seq_id)
            return self.applied[key]

    async def CreateAdapter(self, request, context):
        if request.name in self.adapters:
            raise errors.AlreadyExists(f"adapter {request.name!r} exists", field="name")
        if request.lora_config.rank > 64:
            raise errors.InvalidArgument("lora_config.rank 128 exceeds max_lora_rank 64", field="lora_config.rank")
        adapter = trainer_pb2.TrainerAdapter(name=request.name, lora_config=request.lora_config,
                                             base_model=request.base_model or "tiny")
        self.adapters[request.name] = adapter
        return trainer_pb2.TrainerServiceCreateAdapterResponse(adapter=adapter)

    async def ListAdapters(self, request, context):
        return trainer_pb2.TrainerServiceListAdaptersResponse(adapters=list(self.adapters.values()))

    async def GetInfo(self, request, context):
        # What a real trainer lists: the SDK checks a loss against it before taking a seq_id.
        return trainer_pb2.GetInfoResponse(base_model="tiny", backend="torch",
                                           max_batch_datums=self.max_batch_datums,
                                           supported_losses=supported_losses())

    def _outputs(self, request):
        def make():
            outputs = [trainer_pb2.DatumOutput(logprobs=[-t / 1000 for t in d.target_tokens],
                                               elementwise_loss=list(d.weights) or [1.0] * len(d.target_tokens))
                       for d in request.data]
            losses = [sum(o.elementwise_loss) for o in outputs]
            return outputs, {"loss:sum": sum(losses), "loss_per_datum:mean": sum(losses) / len(losses),
                             "tokens:max": max(len(d.input_tokens) for d in request.data),
                             "tokens:min": min(len(d.input_tokens) for d in request.data)}
        return make

    async def ForwardBackward(self, request, context):
        if request.adapter not in self.adapters:
            raise errors.NotFound(f"adapter {request.adapter!r} not found", field="adapter")
        self._record("ForwardBackward", request.adapter, request.seq_id, len(request.data))
        outputs, metrics = self._apply(request.adapter, request.seq_id, self._outputs(request))
        return trainer_pb2.ForwardBackwardResponse(outputs=outputs, metrics=metrics)

    async def Forward(self, request, context):
        self._record("Forward", request.adapter, request.seq_id, len(request.data))
        outputs, metrics = self._apply(request.adapter, request.seq_id, self._outputs(request))
        return trainer_pb2.ForwardResponse(outputs=outputs, metrics=metrics)

    async def OptimStep(self, request, context):
        self._record("OptimStep", request.adapter, request.seq_id, 0)
        self.last_adam = request.adam_params

        def make():
            adapter = self.adapters[request.adapter]
            adapter.step += 1
            return adapter.step
        step = self._apply(request.adapter, request.seq_id, make)
        return trainer_pb2.OptimStepResponse(step=step, grad_norm=1.5)

    async def PublishWeights(self, request, context):
        self._record("PublishWeights", request.adapter, request.seq_id, 0)
        version = self._apply(request.adapter, request.seq_id, lambda: len(
            [k for k in self.applied if k[0] == request.adapter and self.attempts]) + 1)
        return trainer_pb2.PublishWeightsResponse(version=common_pb2.AdapterVersion(
            adapter=request.adapter, version=7, kind=common_pb2.VERSION_KIND_WEIGHTS, sha256="ab" * 32,
            metadata=dict(request.metadata), aliases=list(request.aliases), training_step=int(bool(version))))


@map_servicer_errors
class RecordingSampler(sampler_pb2_grpc.SamplerServiceServicer):
    def __init__(self):
        self.requests: list[sampler_pb2.SampleRequest] = []

    async def Sample(self, request, context):
        self.requests.append(request)
        if request.adapter.name == "missing":
            raise errors.NotFound("adapter 'missing' has no loaded version", field="adapter.name")
        sequences = [sampler_pb2.SampledSequence(tokens=[5 + i, 6], logprobs=[-0.5, -0.25],
                                                 finish_reason=sampler_pb2.FINISH_REASON_STOP)
                     for i in range(request.num_samples)]
        prompt_logprobs = ([math.nan] + [-1.0] * (len(request.prompt_tokens) - 1)
                           if request.include_prompt_logprobs else [])
        return sampler_pb2.SampleResponse(sequences=sequences, prompt_logprobs=prompt_logprobs,
                                          served_version=request.adapter.version)

    async def ComputeLogprobs(self, request, context):
        return sampler_pb2.ComputeLogprobsResponse(logprobs=[math.nan] + [-2.0] * (len(request.tokens) - 1))


@pytest.fixture
def recording(background_loop):
    trainer, sampler = RecordingTrainer(), RecordingSampler()

    async def start():
        server = GrpcServer("127.0.0.1", 0)
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(trainer, server.server)
        sampler_pb2_grpc.add_SamplerServiceServicer_to_server(sampler, server.server)
        server.add_service("loraplane.v1.TrainerService")
        server.add_service("loraplane.v1.SamplerService")
        await server.start()
        return server

    server = background_loop.run(start())
    service = ServiceClient(trainer=server.address, sampler=server.address, registry="127.0.0.1:1",
                            retry=FAST_RETRY)
    yield service, trainer, sampler
    background_loop.run(server.stop(0))
    # The process shares channels per address: a later test's server may get this port, and a channel left in
    # reconnect backoff towards the stopped one would refuse its first calls for longer than FAST_RETRY waits.
    runtime().close_channels([server.address])


def sequence_datum(length: int, start: int = 1) -> Datum:
    tokens = list(range(start, start + length + 1))
    return datum_from_sequence(tokens, weights=[1.0] * (length + 1))


def test_seq_ids_number_every_sequenced_call_of_an_adapter_from_one(recording):
    service, trainer, _ = recording
    training = service.create_lora_training_client("tiny", rank=4, name="seq-a")
    futures = [training.forward_backward([sequence_datum(3)]), training.optim_step(AdamParams()),
               training.forward([sequence_datum(3)]), training.save_weights_for_sampler("first")]
    for future in futures:
        future.result(10)
    sent = sorted((seq, method) for method, adapter, seq, _ in trainer.attempts if adapter == "seq-a")
    assert sent == [(1, "ForwardBackward"), (2, "OptimStep"), (3, "Forward"), (4, "PublishWeights")]
    assert training.last_seq_id == 4
    # A second adapter counts from 1 on its own.
    other = service.create_lora_training_client("tiny", rank=4, name="seq-b")
    other.forward_backward([sequence_datum(2)]).result(10)
    assert ("ForwardBackward", "seq-b", 1, 1) in trainer.attempts


def test_attaching_to_an_existing_adapter_continues_after_its_last_seq_id(recording):
    service, trainer, _ = recording
    first = service.create_lora_training_client("tiny", rank=4, name="resume")
    first.forward_backward([sequence_datum(2)]).result(10)
    first.optim_step().result(10)
    fresh_service = ServiceClient(trainer=service.trainer_address, sampler=service.sampler_address,
                                  retry=FAST_RETRY)
    attached = fresh_service.get_training_client("resume")
    attached.optim_step().result(10)
    assert [seq for m, a, seq, _ in trainer.attempts if a == "resume"] == [1, 2, 3]
    with pytest.raises(NotFoundError):
        fresh_service.get_training_client("nobody")


def test_large_batches_are_split_into_sequenced_chunks_and_merged(recording):
    service, trainer, _ = recording
    service.max_chunk_datums = 3
    training = service.create_lora_training_client("tiny", rank=4, name="chunky")
    data = [sequence_datum(2 + i % 4, start=10 * i + 1) for i in range(10)]
    output = training.forward_backward(data).result(10)

    chunks = sorted((seq, n) for m, a, seq, n in trainer.attempts if a == "chunky")
    assert chunks == [(1, 3), (2, 3), (3, 3), (4, 1)]
    # Per-datum outputs come back in the caller's order, whatever order the chunks completed in.
    assert len(output.loss_fn_outputs) == 10
    for datum, out in zip(data, output.loss_fn_outputs):
        expected = [-t / 1000 for t in datum.loss_fn_inputs["target_tokens"]]
        assert out["logprobs"].tolist() == pytest.approx(expected)
    lengths = [d.model_input.length for d in data]
    assert output.metrics["loss:sum"] == pytest.approx(sum(lengths))
    assert output.metrics["loss_per_datum:mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert output.metrics["tokens:max"] == max(lengths)
    assert output.metrics["tokens:min"] == min(lengths)
    # The next call continues after the chunks' seq_ids.
    training.optim_step().result(10)
    assert ("OptimStep", "chunky", 5, 0) in trainer.attempts


def test_the_trainers_max_batch_datums_caps_the_chunk_size(recording):
    service, trainer, _ = recording
    trainer.max_batch_datums = 2
    training = service.create_lora_training_client("tiny", rank=4, name="capped")
    training.forward_backward([sequence_datum(2) for _ in range(5)]).result(10)
    assert sorted(n for m, a, _, n in trainer.attempts if a == "capped") == [1, 2, 2]


def test_chunks_respect_the_byte_limit_and_never_split_a_datum():
    data = [sequence_datum(100).to_proto() for _ in range(6)]
    size = data[0].ByteSize()
    chunks = split_into_chunks(data, max_datums=100, max_bytes=2 * size + 20)
    assert [len(c) for c in chunks] == [2, 2, 2]
    # One datum above the byte limit still travels, alone.
    assert [len(c) for c in split_into_chunks(data[:2], max_datums=100, max_bytes=10)] == [1, 1]
    with pytest.raises(ValueError, match="max_datums"):
        split_into_chunks(data, max_datums=0)


def test_merge_metrics_by_reduction_suffix():
    merged = merge_metrics([{"loss:sum": 1.0, "acc:mean": 1.0, "g:max": 3.0, "g:min": 3.0, "id:unique": 9.0},
                            {"loss:sum": 2.5, "acc:mean": 0.0, "g:max": 5.0, "g:min": -1.0, "id:unique": 8.0}],
                           weights=[3, 1])
    assert merged == {"loss:sum": 3.5, "acc:mean": 0.75, "g:max": 5.0, "g:min": -1.0, "id:unique": 9.0}
    assert merge_metrics([{"x:sum": 2.0}]) == {"x:sum": 2.0}
    assert merge_metrics([]) == {}


def test_lists_numpy_and_torch_inputs_convert_to_the_same_datum():
    tokens = [3, 4, 5, 6]
    weights = [0.0, 1.0, -0.5, 2.0]
    from_lists = Datum(ModelInput.from_ints(tokens), {"target_tokens": tokens, "weights": weights}).to_proto()
    from_numpy = Datum(ModelInput.from_ints(np.array(tokens, dtype=np.int64)),
                       {"target_tokens": np.array(tokens, dtype=np.int32),
                        "weights": np.array(weights, dtype=np.float32)}).to_proto()
    from_torch = Datum(ModelInput.from_ints(torch.tensor(tokens)),
                       {"target_tokens": torch.tensor(tokens), "weights": torch.tensor(weights)}).to_proto()
    from_tensordata = Datum(tokens, {"target_tokens": TensorData.from_numpy(np.array(tokens)),
                                     "weights": TensorData.from_torch(torch.tensor(weights))}).to_proto()
    assert from_lists == from_numpy == from_torch == from_tensordata
    assert list(from_lists.weights) == weights
    assert ModelInput.from_ints(np.arange(5)).length == 5
    assert ModelInput.from_ints([1, 2]).append_int(3).to_ints() == [1, 2, 3]


@pytest.mark.parametrize("inputs, message", [
    ({"target_tokens": [1, 2]}, "has 2 entries but model_input has 3"),
    ({"target_tokens": np.zeros((3, 2, 2), dtype=np.int64)}, "must be 1-D"),
    ({"target_tokens": [1, 2, 3], "weights": np.ones((3, 2))}, "must be 1-D"),
    ({"target_tokens": np.zeros((3, 2), dtype=np.int64), "weights": np.ones((3, 3))}, "weights go with"),
    ({"target_tokens": np.zeros((2, 2), dtype=np.int64)}, "has 4 entries but model_input has 3"),
    ({"target_tokens": [1.5, 2.0, 3.0]}, "integer token ids"),
    ({"weights": [1.0, 1.0, 1.0]}, "must contain target_tokens"),
    ({"target_tokens": [1, 2, 3], "rewards": [1, 1, 1]}, "unknown loss_fn_inputs keys"),
])
def test_bad_datums_fail_before_a_seq_id_is_spent(recording, inputs, message):
    service, trainer, _ = recording
    training = service.create_lora_training_client("tiny", rank=4, name="bad-input")
    with pytest.raises(ValueError, match=message):
        training.forward_backward([Datum(ModelInput.from_ints([1, 2, 3]), inputs)])
    training.optim_step().result(10)
    assert [(m, seq) for m, a, seq, _ in trainer.attempts if a == "bad-input"] == [("OptimStep", 1)]


def test_unknown_loss_and_empty_batch_are_rejected_locally(recording):
    service, _, _ = recording
    training = service.create_lora_training_client("tiny", rank=4, name="local-checks")
    with pytest.raises(ValueError, match="loss_fn must be one of"):
        training.forward_backward([sequence_datum(2)], "mse")
    with pytest.raises(ValueError, match="data is empty"):
        training.forward_backward([])
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        training.optim_step(AdamParams(learning_rate=float("nan")))
    assert training.last_seq_id == 0


def test_adam_params_default_to_tinkers_and_travel_unchanged(recording):
    service, trainer, _ = recording
    assert AdamParams() == AdamParams(1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)
    training = service.create_lora_training_client("tiny", rank=4, name="adam")
    training.optim_step(AdamParams(learning_rate=3e-3, beta2=0.999, weight_decay=0.1, grad_clip_norm=1.0)).result(10)
    sent = trainer.last_adam
    assert (sent.learning_rate, sent.beta1, sent.beta2, sent.eps, sent.weight_decay, sent.grad_clip_norm) == (
        3e-3, 0.9, 0.999, 1e-12, 0.1, 1.0)


def test_unavailable_is_retried_with_the_same_seq_id_and_applied_once(recording):
    service, trainer, _ = recording
    training = service.create_lora_training_client("tiny", rank=4, name="flaky")
    trainer.unavailable_left[1] = 2
    output = training.forward_backward([sequence_datum(3)]).result(10)
    assert output.metrics["loss:sum"] == 3
    attempts = [(m, seq) for m, a, seq, _ in trainer.attempts if a == "flaky"]
    assert attempts == [("ForwardBackward", 1)] * 3
    assert [k for k in trainer.applied if k[0] == "flaky"] == [("flaky", 1)]


def test_retries_stop_after_the_budget_with_the_status_and_attempt_count(recording):
    service, trainer, _ = recording
    training = service.create_lora_training_client("tiny", rank=4, name="down")
    trainer.unavailable_left[1] = 100
    with pytest.raises(UnavailableError) as caught:
        training.optim_step().result(10)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.attempts == FAST_RETRY.max_attempts
    assert "injected outage for seq_id 1" in str(caught.value)
    assert isinstance(caught.value, errors.Unavailable)


def test_server_errors_carry_code_message_and_field_without_retry(recording):
    service, _trainer, _ = recording
    with pytest.raises(InvalidArgumentError) as caught:
        service.create_lora_training_client("tiny", rank=128, name="too-big")
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.field == "lora_config.rank"
    assert error.server_message == "lora_config.rank 128 exceeds max_lora_rank 64"
    assert "CreateAdapter" in str(error) and error.attempts == 1
    assert isinstance(error, APIError) and isinstance(error, errors.InvalidArgument)
    training = service.create_lora_training_client("tiny", rank=4, name="ghost")
    training.adapter = "not-there"
    with pytest.raises(NotFoundError, match="not found"):
        training.forward_backward([sequence_datum(2)]).result(10)


def test_exist_ok_attaches_to_an_existing_adapter(recording):
    service, _, _ = recording
    service.create_lora_training_client("tiny", rank=4, name="twice")
    with pytest.raises(Exception) as caught:
        service.create_lora_training_client("tiny", rank=4, name="twice")
    assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert service.create_lora_training_client("tiny", rank=4, name="twice", exist_ok=True).adapter == "twice"


async def test_async_twins_submit_in_call_order_and_await_results(recording):
    service, trainer, _ = recording
    training = await service.create_lora_training_client_async("tiny", rank=4, name="async")
    fb = await training.forward_backward_async([sequence_datum(4)])
    step = await training.optim_step_async(AdamParams(learning_rate=1e-3))
    output, stepped = await fb, await step
    assert output.metrics["loss:sum"] == 4 and stepped.step == 1
    assert sorted((seq, m) for m, a, seq, _ in trainer.attempts if a == "async") == [
        (1, "ForwardBackward"), (2, "OptimStep")]
    assert (await fb.result_async(5)).metrics == output.metrics


def test_publish_returns_a_sampling_client_pinned_to_the_new_version(recording):
    service, _, sampler = recording
    training = service.create_lora_training_client("tiny", rank=4, name="pub")
    sampling = training.save_weights_for_sampler("ckpt", aliases=["prod"]).result(10)
    assert (sampling.adapter, sampling.version, sampling.path) == ("pub", 7, "loraplane://pub@v7")
    assert sampling.published.metadata == {"name": "ckpt"} and sampling.published.aliases == ["prod"]
    reply = sampling.sample(ModelInput.from_ints([1, 2, 3]), 2, SamplingParams(max_tokens=5, temperature=0.0,
                                                                            stop=["\n", "END"], seed=11),
                            include_prompt_logprobs=True).result(10)
    sent = sampler.requests[-1]
    assert (sent.adapter.name, sent.adapter.version, sent.num_samples) == ("pub", 7, 2)
    assert (sent.sampling_params.max_tokens, sent.sampling_params.temperature, sent.sampling_params.seed) == (5, 0, 11)
    assert list(sent.sampling_params.stop_strings) == ["\n", "END"]
    assert [s.tokens for s in reply.sequences] == [[5, 6], [6, 6]]
    assert reply.sequences[0].stop_reason == "stop" and reply.served_version == 7
    assert reply.prompt_logprobs == [None, -1.0, -1.0]


def test_sampling_client_pickles_and_computes_logprobs(recording):
    import pickle

    service, _, _sampler = recording
    client = pickle.loads(pickle.dumps(service.create_sampling_client(model_path="loraplane://team/a@v3")))
    assert (client.adapter, client.version) == ("team/a", 3)
    assert client.compute_logprobs([4, 5, 6]).result(10) == [None, -2.0, -2.0]
    with pytest.raises(NotFoundError) as caught:
        SamplingClient(service.sampler_address, "missing").sample([1]).result(10)
    assert caught.value.field == "adapter.name"
    stop_ids = SamplingParams(stop=[7, 8]).to_proto()
    assert list(stop_ids.stop_token_ids) == [7, 8] and not stop_ids.stop_strings


async def test_sample_async_returns_the_response(recording):
    service, _, _ = recording
    reply = await service.create_sampling_client().sample_async([1, 2], num_samples=3)
    assert len(reply.sequences) == 3 and reply.served_version == 0


def test_two_threads_pipelining_on_two_adapters_keep_separate_contiguous_numbering(recording):
    service, trainer, _ = recording
    clients = [service.create_lora_training_client("tiny", rank=4, name=f"thread-{i}") for i in range(2)]

    def run(training):
        futures = []
        for _ in range(5):
            futures.append(training.forward_backward([sequence_datum(2)]))
            futures.append(training.optim_step())
        for future in futures:
            future.result(10)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for client in clients:
        calls = sorted((seq, m) for m, a, seq, _ in trainer.attempts if a == client.adapter)
        assert [seq for seq, _ in calls] == list(range(1, 11))
        assert [m for _, m in calls] == ["ForwardBackward", "OptimStep"] * 5
        assert trainer.adapters[client.adapter].step == 5


def test_paths_parse_versions_aliases_and_tenants():
    assert parse_path("loraplane://team/x@v12") == ("team/x", 12, "")
    assert parse_path("x@prod") == ("x", 0, "prod")
    assert parse_path("x") == ("x", 0, "")
    assert parse_path("x@3") == ("x", 3, "")
    with pytest.raises(ValueError):
        parse_path("@v1")


def test_no_address_gives_a_clear_error(monkeypatch, tmp_path):
    for name in ("TRAINER", "SAMPLER", "REGISTRY"):
        monkeypatch.delenv(f"LORAPLANE_{name}_ADDRESS", raising=False)
    monkeypatch.setenv("LORAPLANE_DATA_DIR", str(tmp_path))
    service = ServiceClient()
    with pytest.raises(ValueError, match="LORAPLANE_TRAINER_ADDRESS"):
        service.create_lora_training_client("tiny")
    monkeypatch.setenv("LORAPLANE_SAMPLER_ADDRESS", "127.0.0.1:9")
    assert ServiceClient().sampler_address == "127.0.0.1:9"


def test_future_map_carries_results_and_errors(recording):
    service, _, _ = recording
    client = service.create_sampling_client()
    future = client.sample([1, 2]).map(lambda r: len(r.sequences))
    assert future.result(10) == 1
    failing = client.sample([1]).map(lambda r: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
