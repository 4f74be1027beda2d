"""Fuzz: malformed requests for every TrainerService RPC and field, thrown at a live trainer (tiny model, real
registry). Each must get a clear caller-error status naming the field, and leave everything as it was: the
adapter's params, moments and step, the registry, and the seq_id rule (a rejected sequenced request of an existing
adapter consumes its seq_id; one for an unknown adapter or with seq_id 0 consumes nothing)."""

from __future__ import annotations

import hashlib
import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.v1 import common_pb2, trainer_pb2
from tests.contract.fuzzing import (
    FUZZ_SETTINGS,
    NON_FINITE,
    assert_clear_rejection,
    bad_aliases,
    bad_names,
    finite_or_not,
    hostile_text,
    oversized_metadata,
    registry_view,
)
from tests.fixtures.registry import registry_state

INVALID = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
NOT_FOUND = frozenset({grpc.StatusCode.NOT_FOUND})
VOCAB = 261
MAX_RANK = 128
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
ADAM = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}

bad_token = st.one_of(st.integers(-(2**31), -1), st.integers(VOCAB, 2**31 - 1))


def good_datum(n: int = 4, **extra) -> trainer_pb2.Datum:
    return trainer_pb2.Datum(input_tokens=list(range(10, 10 + n)), target_tokens=list(range(11, 11 + n)), **extra)


@st.composite
def bad_datum(draw) -> tuple[trainer_pb2.Datum, str, str]:
    """(datum, loss_fn, field) with exactly one malformed per-token field."""
    n = draw(st.integers(1, 6))
    which = draw(st.sampled_from(["input_tokens", "target_tokens", "target_length", "weights", "logprobs",
                                  "advantages", "empty"]))
    datum = good_datum(n)
    if which in ("input_tokens", "target_tokens"):
        tokens = list(getattr(datum, which))
        tokens[draw(st.integers(0, n - 1))] = draw(bad_token)
        getattr(datum, which)[:] = tokens
        return datum, "cross_entropy", which
    if which == "target_length":
        length = draw(st.integers(0, 12).filter(lambda k: k != n))
        datum.target_tokens[:] = [7] * length
        return datum, "cross_entropy", "target_tokens"
    if which == "empty":
        return trainer_pb2.Datum(), "cross_entropy", "input_tokens"
    loss = "cross_entropy" if which == "weights" else "importance_sampling"
    if loss == "importance_sampling":
        datum.logprobs[:] = [-1.0] * n
        datum.advantages[:] = [0.5] * n
    if draw(st.booleans()):
        values = [0.5] * n
        values[draw(st.integers(0, n - 1))] = draw(NON_FINITE)
    else:
        values = [0.5] * draw(st.integers(1, 12).filter(lambda k: k != n))
    getattr(datum, which)[:] = values
    return datum, loss, which


@st.composite
def bad_training_request(draw, adapter: str):
    """(what, rpc, request without seq_id, expected field, codes, consumes) for ForwardBackward / Forward."""
    rpc = draw(st.sampled_from(["ForwardBackward", "Forward"]))
    request_type = trainer_pb2.ForwardBackwardRequest if rpc == "ForwardBackward" else trainer_pb2.ForwardRequest
    kind = draw(st.sampled_from(["datum", "loss_fn", "config_key", "config_value", "no_data", "too_many",
                                 "context", "adapter"]))
    if kind == "datum":
        bad, loss, field = draw(bad_datum())
        index = draw(st.integers(0, 2))
        data = [good_datum()] * index + [bad]
        if loss != "cross_entropy":
            data = [good_datum(logprobs=[-1.0] * 4, advantages=[0.5] * 4)] * index + [bad]
        return kind, rpc, request_type(adapter=adapter, data=data, loss_fn=loss), f"data[{index}].{field}", INVALID
    if kind == "loss_fn":
        loss = draw(hostile_text(1).filter(lambda s: s not in LOSSES))
        return kind, rpc, request_type(adapter=adapter, data=[good_datum()], loss_fn=loss), "loss_fn", INVALID
    if kind == "config_key":
        key = draw(hostile_text().filter(lambda k: k not in ("clip_low_threshold", "clip_high_threshold", "beta")))
        request = request_type(adapter=adapter, data=[good_datum()], loss_fn="cross_entropy",
                               loss_fn_config={key: 1.0})
        return kind, rpc, request, "loss_fn_config", INVALID
    if kind == "config_value":
        loss, key = draw(st.sampled_from([("ppo", "clip_low_threshold"), ("cispo", "clip_high_threshold"),
                                          ("dro", "beta")]))
        value = draw(finite_or_not(st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False)))
        data = [good_datum(logprobs=[-1.0] * 4, advantages=[0.5] * 4)]
        request = request_type(adapter=adapter, data=data, loss_fn=loss, loss_fn_config={key: value})
        return kind, rpc, request, "loss_fn_config", INVALID
    if kind == "no_data":
        return kind, rpc, request_type(adapter=adapter, loss_fn="cross_entropy"), "data", INVALID
    if kind == "too_many":
        return kind, rpc, request_type(adapter=adapter, data=[good_datum(1)] * 1025), "data", INVALID
    if kind == "context":
        long = trainer_pb2.Datum(input_tokens=[5] * 513, target_tokens=[6] * 513)
        return kind, rpc, request_type(adapter=adapter, data=[long]), "data[0].input_tokens", INVALID
    return kind, rpc, request_type(adapter=draw(bad_names()), data=[good_datum()]), "adapter", NOT_FOUND


@st.composite
def bad_sequenced_request(draw, adapter: str):
    """Malformed OptimStep / PublishWeights / SaveState / LoadState requests (seq_id filled in later)."""
    rpc = draw(st.sampled_from(["OptimStep", "PublishWeights", "SaveState", "LoadState"]))
    if rpc == "OptimStep":
        field = draw(st.sampled_from(list(ADAM) + ["missing"]))
        params = dict(ADAM)
        if field == "missing":
            del params["learning_rate"]
            if draw(st.booleans()):
                return rpc, trainer_pb2.OptimStepRequest(adapter=adapter), "adam_params.learning_rate", INVALID
            return (rpc, trainer_pb2.OptimStepRequest(adapter=adapter, adam_params=trainer_pb2.AdamParams(**params)),
                    "adam_params.learning_rate", INVALID)
        bad = {
            "learning_rate": st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
            "eps": st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
            "beta1": st.one_of(st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
                               st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)),
            "weight_decay": st.floats(max_value=-1e-12, allow_nan=False, allow_infinity=False),
            "grad_clip_norm": st.floats(max_value=-1e-12, allow_nan=False, allow_infinity=False),
        }
        bad["beta2"] = bad["beta1"]
        params[field] = draw(finite_or_not(bad[field]))
        return (rpc, trainer_pb2.OptimStepRequest(adapter=adapter, adam_params=trainer_pb2.AdamParams(**params)),
                f"adam_params.{field}", INVALID)
    if rpc == "PublishWeights":
        choice = draw(st.sampled_from(["alias", "too_many_aliases", "metadata"]))
        if choice == "alias":
            aliases = ["ok"] * draw(st.integers(0, 2)) + [draw(bad_aliases())]
            return rpc, trainer_pb2.PublishWeightsRequest(adapter=adapter, aliases=aliases), "aliases", INVALID
        if choice == "too_many_aliases":
            return (rpc, trainer_pb2.PublishWeightsRequest(adapter=adapter, aliases=[f"a{i}" for i in range(17)]),
                    "aliases", INVALID)
        return (rpc, trainer_pb2.PublishWeightsRequest(adapter=adapter, metadata=draw(oversized_metadata())),
                "metadata", INVALID)
    if rpc == "SaveState":
        return (rpc, trainer_pb2.SaveStateRequest(adapter=adapter, metadata=draw(oversized_metadata())), "metadata",
                INVALID)
    choice = draw(st.sampled_from(["no_source", "source_name", "source_alias"]))
    if choice == "no_source":
        return rpc, trainer_pb2.LoadStateRequest(adapter=adapter), "source.name", INVALID
    if choice == "source_name":
        source = common_pb2.AdapterRef(name=draw(bad_names().filter(bool)))
        return rpc, trainer_pb2.LoadStateRequest(adapter=adapter, source=source), "source.name", INVALID
    source = common_pb2.AdapterRef(name=adapter, alias=draw(bad_aliases()))
    return rpc, trainer_pb2.LoadStateRequest(adapter=adapter, source=source), "source.alias", INVALID


@st.composite
def bad_create_request(draw):
    field = draw(st.sampled_from(["name", "rank", "alpha", "target_modules", "base_model", "metadata"]))
    lora = common_pb2.LoraConfig(rank=4)
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(name="fresh", lora_config=lora)
    if field == "name":
        request.name = draw(bad_names())
        return request, "name"
    if field == "rank":
        request.lora_config.rank = draw(st.one_of(st.just(0), st.integers(MAX_RANK + 1, 2**32 - 1)))
        return request, "lora_config.rank"
    if field == "alpha":
        request.lora_config.alpha = draw(finite_or_not(st.floats(max_value=-0.5, allow_nan=False,
                                                                 allow_infinity=False, width=32)))
        return request, "lora_config.alpha"
    if field == "target_modules":
        modules = ["q_proj"] + [draw(hostile_text().filter(lambda s: not s.endswith("_proj")))]
        if draw(st.booleans()):
            modules = ["q_proj", "q_proj"]
        request.lora_config.target_modules[:] = modules
        return request, "lora_config.target_modules"
    if field == "base_model":
        request.base_model = draw(hostile_text(1).filter(lambda s: s != "tiny"))
        return request, "base_model"
    request.metadata.update(draw(oversized_metadata()))
    return request, "metadata"


class TrainerProbe:
    """What a caller and the trainer can observe of one adapter, and the registry's whole state."""

    def __init__(self, live, registry, name: str):
        self.live, self.registry, self.name = live, registry, name
        self.stub = live.stub()
        self.registry_stub = registry.stub()

    def adapter(self) -> trainer_pb2.TrainerAdapter:
        rows = self.stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters
        return {a.name: a for a in rows}[self.name]

    def tensors_digest(self) -> str:
        state = self.live.service.pool.get(self.name)
        digest = hashlib.sha256()
        for tensors in (state.params, state.exp_avg, state.exp_avg_sq):
            for key in sorted(tensors):
                digest.update(tensors[key].detach().cpu().float().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def snapshot(self):
        row = self.adapter()
        names = [a.name for a in self.stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters]
        return row.step, self.tensors_digest(), names, registry_view(self.registry_stub)


@pytest.fixture
def probe(trainer, registry):
    stub = trainer.stub()
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name="fz", lora_config=common_pb2.LoraConfig(rank=4, seed=3)))
    # Some history, so "unchanged" covers non-zero params, moments and a step.
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="fz", seq_id=1, data=[good_datum(6)]))
    stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="fz", seq_id=2, adam_params=trainer_pb2.AdamParams(**ADAM)))
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="fz", seq_id=3, data=[good_datum(5)]))
    before = registry_state(registry.stub(), registry.settings)
    probe = TrainerProbe(trainer, registry, "fz")
    yield probe
    assert registry_state(registry.stub(), registry.settings) == before
    # After the barrage the adapter is intact and usable: the next seq_ids train it to finite values.
    last = probe.adapter().last_seq_id
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="fz", seq_id=last + 1, data=[good_datum(6)]))
    outcome = stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="fz", seq_id=last + 2,
                                                          adam_params=trainer_pb2.AdamParams(learning_rate=0.01)))
    assert outcome.step == 2 and not outcome.skipped and math.isfinite(outcome.grad_norm)


def _call(stub, rpc: str, request):
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stub, rpc)(request, timeout=30)
    return caught.value


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_sequenced_trainer_rpcs(probe, data):
    before = probe.snapshot()
    last = probe.adapter().last_seq_id
    if data.draw(st.booleans()):
        what, rpc, request, field, codes = data.draw(bad_training_request("fz"))
    else:
        rpc, request, field, codes = data.draw(bad_sequenced_request("fz"))
        what = rpc
    consumes = request.adapter == "fz"
    zero = consumes and data.draw(st.integers(0, 9)) == 0
    if zero:  # a malformed seq_id is refused first and consumes nothing
        request.seq_id, field, codes, consumes = 0, "seq_id", INVALID, False
    else:
        request.seq_id = last + 1
    exc = _call(probe.stub, rpc, request)
    assert_clear_rejection(exc, field, codes, what=f"{rpc} {what}")
    if consumes:
        # The rejection is that seq_id's outcome: a retry gets it again.
        assert_clear_rejection(_call(probe.stub, rpc, request), field, codes, what=f"{rpc} {what} (retry)")
    assert probe.adapter().last_seq_id == last + (1 if consumes else 0)
    assert probe.snapshot() == before


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_unsequenced_trainer_rpcs(probe, data):
    before = probe.snapshot()
    last = probe.adapter().last_seq_id
    rpc = data.draw(st.sampled_from(["CreateAdapter", "DeleteAdapter", "ListAdapters"]))
    if rpc == "CreateAdapter":
        request, field = data.draw(bad_create_request())
        assert_clear_rejection(_call(probe.stub, rpc, request), field, INVALID, what=f"CreateAdapter {field}")
    elif rpc == "DeleteAdapter":
        request = trainer_pb2.TrainerServiceDeleteAdapterRequest(name=data.draw(bad_names()),
                                                                 delete_from_registry=data.draw(st.booleans()))
        assert_clear_rejection(_call(probe.stub, rpc, request), "name", INVALID | NOT_FOUND, what="DeleteAdapter")
    else:
        request = trainer_pb2.TrainerServiceListAdaptersRequest(page_size=data.draw(st.integers(-(2**31), -1)))
        assert_clear_rejection(_call(probe.stub, rpc, request), "page_size", INVALID, what="ListAdapters")
    assert probe.adapter().last_seq_id == last
    assert probe.snapshot() == before
