"""The defects of issue 10, each reproduced as a user met it, against live servers (tiny model, real registry on
Valkey + SeaweedFS). Every test here failed before its fix."""

from __future__ import annotations

import hashlib
import math
import os

import grpc
import pytest

from loraplane.client import AdamParams, RetryConfig, ServiceClient, datum_from_sequence
from loraplane.client.errors import InvalidArgumentError
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc, sampler_pb2, trainer_pb2, trainer_pb2_grpc
from tests.contract.fuzzing import error_info
from tests.fixtures.registry import TEST_BASE_MODEL, TEST_LORA, adapter_blob, publish_requests, registry_state
from tests.fixtures.sampler import adapter_blob as sampler_adapter_blob

CE = "cross_entropy"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def datum(n=8, start=10) -> trainer_pb2.Datum:
    tokens = list(range(start, start + n + 1))
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])


def create(stub, name: str, rank: int = 4, seed: int = 1):
    return stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=rank, seed=seed))).adapter


def row(stub, name: str) -> trainer_pb2.TrainerAdapter:
    return {a.name: a for a in stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters}[name]


def failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def error_field(exc: grpc.RpcError) -> str:
    return error_info(exc)[1]


def params_digest(trainer, name: str) -> str:
    """sha256 over the adapter's params and AdamW moments as the trainer holds them."""
    state = trainer.service.pool.get(name)
    digest = hashlib.sha256()
    for tensors in (state.params, state.exp_avg, state.exp_avg_sq):
        for key in sorted(tensors):
            digest.update(tensors[key].detach().cpu().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------- AdamParams

def test_optim_step_with_only_a_learning_rate_uses_tinker_defaults_and_keeps_the_adapter_finite(trainer):
    """Before: unset beta1/beta2/eps arrived as 0; the step returned OK and every later logprob was NaN."""
    stub = trainer.stub()
    create(stub, "defaults", seed=3)
    create(stub, "explicit", seed=3)
    for name, adam in (("defaults", trainer_pb2.AdamParams(learning_rate=0.05)),
                       ("explicit", trainer_pb2.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-12,
                                                           weight_decay=0.0, grad_clip_norm=0.0))):
        stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter=name, seq_id=1, data=[datum()], loss_fn=CE))
        outcome = stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, seq_id=2, adam_params=adam))
        assert outcome.step == 1 and not outcome.skipped
        probe = stub.Forward(trainer_pb2.ForwardRequest(adapter=name, seq_id=3, data=[datum(12, 40)], loss_fn=CE))
        assert all(math.isfinite(v) for v in probe.outputs[0].logprobs)
    # Unset fields are exactly Tinker's defaults: both adapters are bit-identical.
    assert params_digest(trainer, "defaults") == params_digest(trainer, "explicit")
    version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="defaults", seq_id=4)).version
    assert version.version == 1


@pytest.mark.parametrize("what,adam,field", [
    ("no adam_params at all", None, "adam_params.learning_rate"),
    ("unset learning_rate", trainer_pb2.AdamParams(beta1=0.9), "adam_params.learning_rate"),
    ("learning_rate 0", trainer_pb2.AdamParams(learning_rate=0.0), "adam_params.learning_rate"),
    ("eps 0", trainer_pb2.AdamParams(learning_rate=0.05, eps=0.0), "adam_params.eps"),
    ("beta1 1", trainer_pb2.AdamParams(learning_rate=0.05, beta1=1.0), "adam_params.beta1"),
    ("beta2 -0.5", trainer_pb2.AdamParams(learning_rate=0.05, beta2=-0.5), "adam_params.beta2"),
    ("beta1 0 set explicitly is allowed", trainer_pb2.AdamParams(learning_rate=0.05, beta1=0.0), None),
    ("inf weight_decay", trainer_pb2.AdamParams(learning_rate=0.05, weight_decay=math.inf),
     "adam_params.weight_decay"),
    # Issue 31: finite doubles beyond float32 were torch's overflow error inside the step (INTERNAL).
    ("learning_rate 1e300", trainer_pb2.AdamParams(learning_rate=1e300), "adam_params.learning_rate"),
    ("learning_rate 1e38 / (1 - beta1)", trainer_pb2.AdamParams(learning_rate=1e38), "adam_params.learning_rate"),
    ("eps 1e300", trainer_pb2.AdamParams(learning_rate=0.05, eps=1e300), "adam_params.eps"),
    ("grad_clip_norm 1e300", trainer_pb2.AdamParams(learning_rate=0.05, grad_clip_norm=1e300),
     "adam_params.grad_clip_norm"),
])
def test_optim_step_rejects_hyper_parameters_that_would_break_the_adapter(trainer, what, adam, field):
    """Before: eps = 0 was accepted and made every zero-gradient entry 0/0 = NaN."""
    stub = trainer.stub()
    create(stub, "guarded", seed=4)
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="guarded", seq_id=1, data=[datum()], loss_fn=CE))
    before = params_digest(trainer, "guarded")
    request = trainer_pb2.OptimStepRequest(adapter="guarded", seq_id=2)
    if adam is not None:
        request.adam_params.CopyFrom(adam)
    if field is None:
        assert stub.OptimStep(request).step == 1
        return
    exc = failure(lambda: stub.OptimStep(request))
    assert exc.code() == INVALID and error_field(exc) == field and field in exc.details(), what
    assert params_digest(trainer, "guarded") == before
    # The gradient is still there and the next seq_id steps normally, to a finite adapter.
    good = trainer_pb2.OptimStepRequest(adapter="guarded", seq_id=3, adam_params=trainer_pb2.AdamParams(
        learning_rate=0.05))
    assert stub.OptimStep(good).step == 1
    probe = stub.Forward(trainer_pb2.ForwardRequest(adapter="guarded", seq_id=4, data=[datum()], loss_fn=CE))
    assert all(math.isfinite(v) for v in probe.outputs[0].logprobs)


# ---------------------------------------------------------------------------------------------------- seq_id rule

def test_a_rejected_request_does_not_wedge_the_python_client(registry, trainer, sampler):
    """Before: after one INVALID_ARGUMENT every later call failed with FAILED_PRECONDITION "waited for seq_id 2"."""
    service = ServiceClient(trainer=trainer.address, sampler=sampler.address, registry=registry.address,
                            retry=RetryConfig(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2,
                                              total_timeout_s=30, attempt_timeout_s=30))
    training = service.create_lora_training_client("tiny", rank=4, seed=1, name="wedge")
    good = [datum_from_sequence(list(range(20, 45)))]
    training.forward_backward(good, CE).result(30)
    with pytest.raises(InvalidArgumentError) as caught:
        training.forward_backward([datum_from_sequence([1, 2, 10_000])], CE).result(30)
    assert "input_tokens" in str(caught.value) or "target_tokens" in str(caught.value)
    # Every later call works: client and trainer agree that the rejected request used seq_id 2.
    step = training.optim_step(AdamParams(learning_rate=0.05)).result(30)
    assert step.step == 1 and not step.skipped
    assert training.forward_backward(good, CE).result(30).loss > 0
    assert row(trainer.stub(), "wedge").last_seq_id == training.last_seq_id == 4


def test_every_kind_of_rejection_consumes_its_seq_id_alike(trainer, registry):
    """Before: PublishWeights with alias "../x" advanced last_seq_id (the registry rejected it after the export),
    while a rejected ForwardBackward did not. Now both are that seq_id's outcome, and nothing is exported."""
    stub = trainer.stub()
    create(stub, "rule", seed=6)
    before_registry = registry_state(registry.stub(), registry.settings)
    bad_publish = trainer_pb2.PublishWeightsRequest(adapter="rule", seq_id=1, aliases=["../x"])
    exc = failure(lambda: stub.PublishWeights(bad_publish))
    assert exc.code() == INVALID and error_field(exc) == "aliases[0]"
    assert row(stub, "rule").last_seq_id == 1
    bad_fb = trainer_pb2.ForwardBackwardRequest(adapter="rule", seq_id=2, loss_fn=CE, data=[
        trainer_pb2.Datum(input_tokens=[1, 2, 300], target_tokens=[2, 3, 4])])
    exc = failure(lambda: stub.ForwardBackward(bad_fb))
    assert exc.code() == INVALID and error_field(exc) == "data[0].input_tokens"
    assert row(stub, "rule").last_seq_id == 2
    # A retry of the same request gets the same answer; another payload on a used seq_id is ALREADY_EXISTS.
    assert failure(lambda: stub.PublishWeights(bad_publish)).code() == INVALID
    assert failure(lambda: stub.ForwardBackward(bad_fb)).code() == INVALID
    other = trainer_pb2.ForwardBackwardRequest(adapter="rule", seq_id=2, loss_fn=CE, data=[datum()])
    assert failure(lambda: stub.ForwardBackward(other)).code() == grpc.StatusCode.ALREADY_EXISTS
    # Nothing reached the registry, the adapter is untouched, and seq_id 3 runs at once.
    assert registry_state(registry.stub(), registry.settings) == before_registry
    assert row(stub, "rule").step == 0
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="rule", seq_id=3, data=[datum()], loss_fn=CE),
                         timeout=10)
    # Consumed nothing: an unknown adapter, seq_id 0.
    assert failure(lambda: stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
        adapter="rule", seq_id=0, data=[datum()]))).code() == INVALID
    assert row(stub, "rule").last_seq_id == 3


def test_publish_metadata_over_the_registry_limits_is_rejected_before_export(trainer, registry):
    stub = trainer.stub()
    create(stub, "meta", seed=6)
    before = registry_state(registry.stub(), registry.settings)
    exc = failure(lambda: stub.PublishWeights(trainer_pb2.PublishWeightsRequest(
        adapter="meta", seq_id=1, metadata={"k": "v" * 5000})))
    assert exc.code() == INVALID and error_field(exc) == "metadata"
    exc = failure(lambda: stub.SaveState(trainer_pb2.SaveStateRequest(adapter="meta", seq_id=2,
                                                                      metadata={"": "empty key"})))
    assert exc.code() == INVALID and error_field(exc) == "metadata"
    assert registry_state(registry.stub(), registry.settings) == before
    assert row(stub, "meta").last_seq_id == 2


# ---------------------------------------------------------------------------------------------------- echoed values

@pytest.mark.parametrize("name", ["n" * 10_000, "é" * 10_000, "\U0001f600" * 5000])
def test_an_overlong_name_gets_invalid_argument_through_a_default_client(trainer, registry, name):
    """Before: the name was echoed whole in the message and in ErrorInfo (~20 KB of trailers), so a default gRPC
    client got RESOURCE_EXHAUSTED "received metadata size exceeds hard limit"."""
    create(trainer.stub(), "present")
    with grpc.insecure_channel(trainer.address) as channel:  # default options: default metadata limits
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        calls = [
            (lambda: stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
                name=name, lora_config=common_pb2.LoraConfig(rank=4))), INVALID, "name"),
            (lambda: stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
                adapter=name, seq_id=1, data=[datum()])), grpc.StatusCode.NOT_FOUND, "adapter"),
            (lambda: stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
                adapter="present", seq_id=1, data=[datum()], loss_fn=name)), INVALID, "loss_fn"),
        ]
        for call, code, field in calls:
            exc = failure(call)
            assert exc.code() == code, (exc.code(), exc.details()[:200])
            assert error_field(exc) == field and len(exc.details()) < 2048
    with grpc.insecure_channel(registry.address) as channel:
        stub = registry_pb2_grpc.AdapterRegistryServiceStub(channel)
        for call, code, field in [
            (lambda: stub.GetAdapter(registry_pb2.GetAdapterRequest(name=name)), INVALID, "name"),
            (lambda: stub.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
                name="ok", lora_config=TEST_LORA, base_model=TEST_BASE_MODEL, metadata={name: "v"}))),
             INVALID, "adapter.metadata"),
        ]:
            exc = failure(call)
            assert exc.code() == code, (exc.code(), exc.details()[:200])
            assert error_field(exc) == field and len(exc.details()) < 2048


def test_an_overlong_loss_config_key_is_named_but_clipped(trainer):
    stub = trainer.stub()
    create(stub, "keys")
    key = "k" * 20_000
    with grpc.insecure_channel(trainer.address) as channel:
        exc = failure(lambda: trainer_pb2_grpc.TrainerServiceStub(channel).ForwardBackward(
            trainer_pb2.ForwardBackwardRequest(adapter="keys", seq_id=1, data=[datum()], loss_fn="ppo",
                                               loss_fn_config={key: 1.0})))
    assert exc.code() == INVALID
    assert error_field(exc).startswith("loss_fn_config.kkk") and len(error_field(exc)) < 256
    assert "loss_fn_config" in exc.details() and len(exc.details()) < 2048


# ---------------------------------------------------------------------------------------------------- registry

def test_the_registry_refuses_a_weights_version_that_is_not_an_adapter(registry, sampler):
    """Before: 4 KB of garbage with a correct sha256 became the latest version and every Sample of it DATA_LOSS."""
    sampler.create_adapter("victim")
    sampler.publish("victim", sampler_adapter_blob(11))
    sampler.wait_loaded({"victim@v1"})
    stub = registry.stub()
    before = registry_state(stub, registry.settings)
    for garbage in (os.urandom(4096), b"\x00" * 4096):
        exc = failure(lambda garbage=garbage: stub.PublishVersion(publish_requests("victim", garbage), timeout=30))
        assert exc.code() == INVALID and error_field(exc) == "chunk", exc.details()
        assert "PEFT safetensors" in exc.details()
    assert registry_state(stub, registry.settings) == before
    reply = sampler.stub().Sample(sampler_pb2.SampleRequest(
        adapter=common_pb2.AdapterRef(name="victim"), prompt_tokens=[1, 20, 21],
        sampling_params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)
    assert reply.served_version == 1 and len(reply.sequences[0].tokens) == 4


@pytest.mark.parametrize("what,fields,field", [
    ("rank 0", {"lora_config": common_pb2.LoraConfig(rank=0)}, "adapter.lora_config.rank"),
    ("no lora_config", {"lora_config": None}, "adapter.lora_config.rank"),
    ("no base model", {"base_model": ""}, "adapter.base_model"),
    ("path traversal base model", {"base_model": "../../secrets"}, "adapter.base_model"),
    ("control characters in base model", {"base_model": "tiny\x00"}, "adapter.base_model"),
])
def test_the_registry_enforces_the_documented_adapter_bounds(registry, what, fields, field):
    """Before: rank 0 was accepted although the proto says >= 1, and base_model was not checked."""
    stub = registry.stub()
    given = {"name": "bounded", "lora_config": TEST_LORA, "base_model": TEST_BASE_MODEL, **fields}
    adapter = registry_pb2.Adapter(**{key: value for key, value in given.items() if value is not None})
    exc = failure(lambda: stub.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=adapter)))
    assert exc.code() == INVALID and error_field(exc) == field and field in exc.details(), what
    assert list(stub.ListAdapters(registry_pb2.ListAdaptersRequest()).adapters) == []


def test_a_training_state_upload_must_be_a_training_state(registry):
    stub = registry.stub()
    stub.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name="states", lora_config=TEST_LORA, base_model=TEST_BASE_MODEL)))
    state = common_pb2.VERSION_KIND_TRAINING_STATE
    for blob in (adapter_blob(3000), os.urandom(3000)):
        exc = failure(lambda blob=blob: stub.PublishVersion(publish_requests("states", blob, kind=state), timeout=30))
        assert exc.code() == INVALID and error_field(exc) == "chunk" and "training state" in exc.details()
    reply = stub.PublishVersion(publish_requests("states", adapter_blob(3000, training_state=True), kind=state))
    assert reply.version.version == 1 and reply.version.kind == state


def test_a_rejection_takes_its_turn_in_seq_id_order(trainer):
    """A rejected request that arrives ahead of its turn waits like any other, then is consumed in order."""
    stub = trainer.stub()
    create(stub, "turns", seed=8)
    early = stub.OptimStep.future(trainer_pb2.OptimStepRequest(
        adapter="turns", seq_id=2, adam_params=trainer_pb2.AdamParams(learning_rate=0.05, eps=-1.0)))
    assert failure(lambda: stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="turns", seq_id=1))).code() == INVALID
    with pytest.raises(grpc.RpcError) as caught:
        early.result(30)
    assert caught.value.code() == INVALID and error_field(caught.value) == "adam_params.eps"
    assert row(stub, "turns").last_seq_id == 2 and row(stub, "turns").step == 0
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="turns", seq_id=3, data=[datum()], loss_fn=CE),
                         timeout=10)
    step = stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="turns", seq_id=4, adam_params=trainer_pb2.AdamParams(
        learning_rate=0.05)), timeout=10)
    assert step.step == 1 and step.grad_norm > 0
