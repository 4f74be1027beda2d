"""TrainerService contract on a live server (tiny model, real registry): every RPC, status codes, ordering, dedup,
validation. Each bad-input case says what was tried and checks the code, the field named, and that nothing changed."""

from __future__ import annotations

import time

import grpc
import pytest
from tokenizers import Tokenizer

from loraplane.models.tiny import build_tiny_tokenizer
from loraplane.v1 import common_pb2, registry_pb2, trainer_pb2
from tests.contract.fuzzing import error_info
from tests.fixtures.trainer import start_live_trainer

CE = "cross_entropy"


def lora(rank=4, alpha=0.0, seed=1, targets=()):
    return common_pb2.LoraConfig(rank=rank, alpha=alpha, seed=seed, target_modules=list(targets))


def create(stub, name, **kwargs):
    return stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=lora(**kwargs)))


def datum(n=8, start=10, **extra):
    tokens = list(range(start, start + n + 1))
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:], **extra)


def fb(adapter, seq, data=None, loss_fn=CE, config=None):
    return trainer_pb2.ForwardBackwardRequest(adapter=adapter, seq_id=seq, data=[datum()] if data is None else data, loss_fn=loss_fn,
                                              loss_fn_config=config or {})


def step(adapter, seq, **adam):
    params = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    params.update(adam)
    return trainer_pb2.OptimStepRequest(adapter=adapter, seq_id=seq, adam_params=trainer_pb2.AdamParams(**params))


def error_field(exc: grpc.RpcError) -> str:
    return error_info(exc)[1]


def expect_error(call, code: grpc.StatusCode, field: str | None = None):
    with pytest.raises(grpc.RpcError) as info:
        call()
    exc = info.value
    assert exc.code() == code, (exc.code(), exc.details())
    if field is not None:
        assert error_field(exc) == field, (error_field(exc), exc.details())
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            # The message itself names the field, for people reading logs.
            assert field.split("[")[0].split(".")[0] in exc.details(), exc.details()
    return exc


def adapter_row(stub, name):
    rows = {a.name: a for a in stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters}
    return rows[name]


def snapshot(stub, name):
    """Logprobs of a fixed probe through Forward, plus step and last_seq_id: changes if anything about the
    adapter changed. Forward is sequenced, so the caller passes the next seq_id."""
    row = adapter_row(stub, name)
    return row.step, row.last_seq_id


def test_get_info_describes_model_limits_and_tokenizer(trainer):
    stub = trainer.stub()
    info = stub.GetInfo(trainer_pb2.GetInfoRequest())
    assert info.base_model == "tiny" and info.backend == "torch" and info.device == "cpu"
    assert info.tokenizer.vocab_size == 261 and list(info.tokenizer.eos_token_ids) == [4]
    assert info.tokenizer.bos_token_id == 1 and info.tokenizer.pad_token_id == 0
    assert "<|im_start|>" in info.tokenizer.chat_template
    assert info.tokenizer.tokenizer_json == b""
    assert info.max_context_length == 512 and info.max_lora_rank >= 8
    assert list(info.supported_losses) == ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                                           "stable_reinforce"]
    assert "q_proj" in info.supported_target_modules and "down_proj" in info.supported_target_modules
    assert info.num_hidden_layers == 2 and info.hidden_size == 64 and info.device_slots >= 1
    with_tokenizer = stub.GetInfo(trainer_pb2.GetInfoRequest(include_tokenizer=True))
    rebuilt = Tokenizer.from_str(with_tokenizer.tokenizer.tokenizer_json.decode())
    assert rebuilt.encode("héllo").ids == build_tiny_tokenizer()("héllo")["input_ids"]


def test_create_registers_in_registry_lists_and_deletes(trainer, registry):
    stub = trainer.stub()
    registry_stub = registry.stub()
    created = create(stub, "team/alpha", rank=8, alpha=16, seed=3, targets=["v_proj", "q_proj"]).adapter
    assert created.name == "team/alpha" and created.step == 0 and created.last_seq_id == 0
    assert list(created.lora_config.target_modules) == ["q_proj", "v_proj"] and created.lora_config.alpha == 16
    assert created.parameter_count == 2 * 2 * (8 * 64 + 64 * 8) // 2 + 2 * (8 * 64 + 32 * 8)
    registered = registry_stub.GetAdapter(registry_pb2.GetAdapterRequest(name="team/alpha")).adapter
    assert registered.base_model == "tiny" and registered.lora_config.rank == 8
    # alpha 0 means alpha = rank.
    assert create(stub, "beta", rank=4).adapter.lora_config.alpha == 4
    create(stub, "gamma", rank=2)
    # Tried: the same name again.
    expect_error(lambda: create(stub, "beta", rank=4), grpc.StatusCode.ALREADY_EXISTS, "name")
    page = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(page_size=2))
    assert [a.name for a in page.adapters] == ["beta", "gamma"] and page.next_page_token
    rest = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(page_size=2,
                                                                           page_token=page.next_page_token))
    assert [a.name for a in rest.adapters] == ["team/alpha"] and not rest.next_page_token
    expect_error(lambda: stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest(page_size=-1)),
                 grpc.StatusCode.INVALID_ARGUMENT, "page_size")

    stub.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name="beta", delete_from_registry=True))
    expect_error(lambda: registry_stub.GetAdapter(registry_pb2.GetAdapterRequest(name="beta")),
                 grpc.StatusCode.NOT_FOUND)
    # Deleting only here keeps the registry's copy.
    stub.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name="gamma"))
    assert registry_stub.GetAdapter(registry_pb2.GetAdapterRequest(name="gamma")).adapter.name == "gamma"
    # Tried: using and deleting adapters that are gone / never existed.
    expect_error(lambda: stub.ForwardBackward(fb("beta", 1)), grpc.StatusCode.NOT_FOUND, "adapter")
    expect_error(lambda: stub.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name="nobody")),
                 grpc.StatusCode.NOT_FOUND, "name")
    assert [a.name for a in stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters] == [
        "team/alpha"]
    # A deleted name can be created again, starting over at seq_id 1.
    create(stub, "gamma", rank=2)
    stub.ForwardBackward(fb("gamma", 1))


@pytest.mark.parametrize("what,request_kwargs,field", [
    ("rank 0", {"lora_config": lora(rank=0)}, "lora_config.rank"),
    ("rank over the limit", {"lora_config": lora(rank=100000)}, "lora_config.rank"),
    ("unknown target module", {"lora_config": lora(targets=["lm_head"])}, "lora_config.target_modules"),
    ("negative alpha", {"lora_config": lora(alpha=-2)}, "lora_config.alpha"),
    ("other base model", {"lora_config": lora(), "base_model": "llama-70b"}, "base_model"),
    ("bad name", {"lora_config": lora(), "name": "Has Spaces"}, "name"),
])
def test_create_rejects_bad_config_and_creates_nothing(trainer, registry, what, request_kwargs, field):
    stub = trainer.stub()
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(**{"name": "fresh", **request_kwargs})
    expect_error(lambda: stub.CreateAdapter(request), grpc.StatusCode.INVALID_ARGUMENT, field)
    assert list(stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters) == []
    expect_error(lambda: registry.stub().GetAdapter(registry_pb2.GetAdapterRequest(name="fresh")),
                 grpc.StatusCode.NOT_FOUND)


BAD_TRAINING_INPUTS = [
    ("token id = vocab size", lambda: fb("a", 1, [trainer_pb2.Datum(input_tokens=[1, 2, 261],
                                                                    target_tokens=[2, 3, 4])]),
     "data[0].input_tokens"),
    ("negative target id", lambda: fb("a", 1, [trainer_pb2.Datum(input_tokens=[1, 2, 3], target_tokens=[2, -1, 4])]),
     "data[0].target_tokens"),
    ("target length differs", lambda: fb("a", 1, [trainer_pb2.Datum(input_tokens=[1, 2, 3], target_tokens=[2, 3])]),
     "data[0].target_tokens"),
    ("weights length differs", lambda: fb("a", 1, [datum(), datum(n=4, weights=[1.0, 1.0])]), "data[1].weights"),
    ("empty data", lambda: fb("a", 1, []), "data"),
    ("empty datum", lambda: fb("a", 1, [trainer_pb2.Datum()]), "data[0].input_tokens"),
    ("over the context limit", lambda: fb("a", 1, [datum(n=513, start=0)]), "data[0].input_tokens"),
    ("unknown loss", lambda: fb("a", 1, loss_fn="mse"), "loss_fn"),
    ("unknown config key", lambda: fb("a", 1, loss_fn="ppo", config={"eps_clip": 0.2}), "loss_fn_config.eps_clip"),
    ("NaN config value", lambda: fb("a", 1, loss_fn="dro", config={"beta": float("nan")}), "loss_fn_config.beta"),
    ("NaN weight", lambda: fb("a", 1, [datum(n=3, weights=[1.0, float("nan"), 1.0])]), "data[0].weights"),
    ("inf advantage", lambda: fb("a", 1, [datum(n=2, logprobs=[-1.0, -1.0], advantages=[1.0, float("inf")])],
                                 loss_fn="importance_sampling"), "data[0].advantages"),
    ("ppo without sampler logprobs", lambda: fb("a", 1, [datum(n=2, advantages=[1.0, 1.0])], loss_fn="ppo"),
     "data[0].logprobs"),
    ("seq_id 0", lambda: fb("a", 0), "seq_id"),
]


def test_every_bad_training_input_is_rejected_consumes_its_seq_id_and_changes_nothing(trainer):
    """The seq_id rule (trainer.proto): a rejected request of an existing adapter is that seq_id's outcome. It
    changes no params, moments or step; last_seq_id advances; a retry gets the same error."""
    stub = trainer.stub()
    create(stub, "a", rank=4, seed=9)
    seq = 0
    for what, build, field in BAD_TRAINING_INPUTS:
        request = build()
        forward = trainer_pb2.ForwardRequest(adapter=request.adapter, seq_id=request.seq_id, data=request.data,
                                             loss_fn=request.loss_fn, loss_fn_config=request.loss_fn_config)
        for call, message in ((stub.ForwardBackward, request), (stub.Forward, forward)):  # same validation
            if request.seq_id != 0:  # a malformed seq_id is refused without consuming anything
                seq += 1
                message.seq_id = seq
            expect_error(lambda call=call, message=message: call(message), grpc.StatusCode.INVALID_ARGUMENT, field)
            expect_error(lambda call=call, message=message: call(message), grpc.StatusCode.INVALID_ARGUMENT, field)
            assert snapshot(stub, "a") == (0, seq), what
    # Tried: OptimStep with bad hyper-parameters; LoadState with no source.
    for field, value in (("learning_rate", float("nan")), ("beta2", 1.0), ("eps", -1.0), ("eps", 0.0),
                         ("learning_rate", 0.0), ("beta1", -0.1)):
        seq += 1
        expect_error(lambda field=field, value=value, seq=seq: stub.OptimStep(step("a", seq, **{field: value})),
                     grpc.StatusCode.INVALID_ARGUMENT, f"adam_params.{field}")
    seq += 1
    expect_error(lambda: stub.LoadState(trainer_pb2.LoadStateRequest(adapter="a", seq_id=seq)),
                 grpc.StatusCode.INVALID_ARGUMENT, "source.name")
    # Tried: every sequenced RPC on an unknown adapter (consumes nothing anywhere).
    expect_error(lambda: stub.ForwardBackward(fb("zzz", seq + 1)), grpc.StatusCode.NOT_FOUND, "adapter")
    expect_error(lambda: stub.OptimStep(step("zzz", seq + 1)), grpc.StatusCode.NOT_FOUND, "adapter")
    expect_error(lambda: stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="zzz", seq_id=seq + 1)),
                 grpc.StatusCode.NOT_FOUND, "adapter")
    assert snapshot(stub, "a") == (0, seq)
    # Nothing changed: the adapter is still its fresh init (B = 0, so Forward equals that of a twin that saw no
    # request, and an OptimStep has nothing to apply).
    probe = trainer_pb2.ForwardRequest(adapter="a", seq_id=seq + 1, data=[datum(n=12)], loss_fn=CE)
    first = stub.Forward(probe)
    fresh = create(stub, "twin", rank=4, seed=9)
    assert fresh.adapter.step == 0
    twin_probe = trainer_pb2.ForwardRequest(adapter="twin", seq_id=1, data=[datum(n=12)], loss_fn=CE)
    assert list(stub.Forward(twin_probe).outputs[0].logprobs) == list(first.outputs[0].logprobs)
    outcome = stub.OptimStep(step("a", seq + 2))
    assert outcome.step == 1 and outcome.grad_norm == 0.0


def test_seq_ids_run_in_order_whatever_the_arrival_order(trainer):
    stub = trainer.stub()
    create(stub, "ordered", rank=4)
    # seq 2 (OptimStep) arrives first and must wait for seq 1 (ForwardBackward): if it ran first it would see no
    # gradient (norm 0).
    later = stub.OptimStep.future(step("ordered", 2))
    time.sleep(0.3)
    assert not later.done()
    first = stub.ForwardBackward(fb("ordered", 1))
    outcome = later.result(30)
    assert first.metrics["loss:sum"] > 0
    assert outcome.step == 1 and outcome.grad_norm > 0 and not outcome.skipped
    assert adapter_row(stub, "ordered").last_seq_id == 2


def test_retry_returns_the_first_result_and_conflicting_retry_fails(trainer):
    stub = trainer.stub()
    create(stub, "retry", rank=4, seed=5)
    create(stub, "once", rank=4, seed=5)
    data = [datum(n=10, weights=[0.5] * 10)]
    first = stub.ForwardBackward(fb("retry", 1, data))
    again = stub.ForwardBackward(fb("retry", 1, data))
    assert again == first
    # Tried: seq_id 1 again with different data.
    expect_error(lambda: stub.ForwardBackward(fb("retry", 1, [datum(n=3)])), grpc.StatusCode.ALREADY_EXISTS,
                 "seq_id")
    stub.ForwardBackward(fb("once", 1, data))
    # The retry did not accumulate a second gradient: same grad norm as the adapter that saw it once.
    norm_retry = stub.OptimStep(step("retry", 2)).grad_norm
    norm_once = stub.OptimStep(step("once", 2)).grad_norm
    assert norm_retry == norm_once and norm_once > 0
    # Publishing twice with the same seq_id gives the same registry version, not a new one.
    v1 = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="retry", seq_id=3, aliases=["prod"]))
    v2 = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="retry", seq_id=3, aliases=["prod"]))
    assert v1.version.version == v2.version.version == 1
    assert v1.version.training_step == 1 and v1.version.kind == common_pb2.VERSION_KIND_WEIGHTS
    v3 = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="retry", seq_id=4))
    assert v3.version.version == 2
    expect_error(lambda: stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="retry", seq_id=4,
                                                                               aliases=["x"])),
                 grpc.StatusCode.ALREADY_EXISTS, "seq_id")


def test_non_finite_gradients_skip_the_step_and_change_nothing(trainer):
    stub = trainer.stub()
    create(stub, "blowup", rank=4, seed=2)
    stub.ForwardBackward(fb("blowup", 1))
    stub.OptimStep(step("blowup", 2))
    probe = [datum(n=12, start=30)]
    before = stub.Forward(trainer_pb2.ForwardRequest(adapter="blowup", seq_id=3, data=probe, loss_fn=CE))
    saved_before = stub.SaveState(trainer_pb2.SaveStateRequest(adapter="blowup", seq_id=4)).version
    # Finite inputs whose loss overflows float32: a real non-finite gradient.
    stub.ForwardBackward(fb("blowup", 5, [datum(n=6, weights=[3e38] * 6)]))
    outcome = stub.OptimStep(step("blowup", 6, weight_decay=0.1))
    assert outcome.skipped and outcome.step == 1
    after = stub.Forward(trainer_pb2.ForwardRequest(adapter="blowup", seq_id=7, data=probe, loss_fn=CE))
    assert list(after.outputs[0].logprobs) == list(before.outputs[0].logprobs)
    saved_after = stub.SaveState(trainer_pb2.SaveStateRequest(adapter="blowup", seq_id=8)).version
    # Params, both moments and the step are bit-identical: the training-state blobs hash the same.
    assert saved_after.sha256 == saved_before.sha256
    # The skip also dropped the bad gradient: the next step trains normally.
    stub.ForwardBackward(fb("blowup", 9))
    assert stub.OptimStep(step("blowup", 10)).step == 2


def test_gap_timeout_fails_waiting_requests_with_a_clear_error(registry, background_loop):
    live = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=0.5)
    try:
        stub = live.stub()
        create(stub, "gappy", rank=2)
        stub.ForwardBackward(fb("gappy", 1))
        # Tried: seq 3 without ever sending seq 2.
        exc = expect_error(lambda: stub.OptimStep(step("gappy", 3)), grpc.StatusCode.FAILED_PRECONDITION, "seq_id")
        assert "seq_id 2" in exc.details()
        # The sequence is intact: seq 2 still runs.
        assert stub.OptimStep(step("gappy", 2)).step == 1
    finally:
        live.close()


def test_full_queues_are_resource_exhausted(registry, background_loop):
    live = start_live_trainer(registry.settings, background_loop, registry.address, max_queue_per_adapter=2)
    try:
        stub = live.stub()
        create(stub, "busy", rank=2)
        scheduler = live.service.scheduler
        scheduler.hold()
        try:
            queued = [stub.ForwardBackward.future(fb("busy", seq)) for seq in (1, 2)]
            deadline = time.monotonic() + 10
            while scheduler._queued < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            expect_error(lambda: stub.ForwardBackward(fb("busy", 3)), grpc.StatusCode.RESOURCE_EXHAUSTED)
        finally:
            scheduler.release()
        assert all(f.result(30).metrics["loss:sum"] > 0 for f in queued)
        # Once drained, the rejected seq_id is accepted.
        stub.ForwardBackward(fb("busy", 3))
    finally:
        live.close()


@pytest.mark.parametrize(("base_model", "layout"), [
    ("tiny", common_pb2.EXPERT_LORA_LAYOUT_UNSPECIFIED),
    # Expert adapters (every routed expert's factors, both layouts) spill and come back like dense ones.
    ("tiny-moe", common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT),
    ("tiny-moe", common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER),
])
def test_spilled_adapters_train_exactly_like_resident_ones(registry, background_loop, base_model, layout):
    live = start_live_trainer(registry.settings, background_loop, registry.address, device_slots=2,
                              base_model=base_model)
    try:
        stub = live.stub()
        pool = live.service.pool
        for name in ("s1", "s2", "s3"):
            config = lora(rank=4, seed=7)
            config.expert_layout = layout
            stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=config))
        assert any("experts" in key for key in pool.get("s1").params) == (base_model == "tiny-moe")
        misses = pool.misses
        # Interleaving 3 adapters over 2 slots spills one each time, including while its gradient is pending.
        for round_index in range(2):
            for name in ("s1", "s2", "s3"):
                stub.ForwardBackward(fb(name, 2 * round_index + 1, [datum(n=9, start=40 + round_index)]))
            for name in ("s1", "s2", "s3"):
                stub.OptimStep(step(name, 2 * round_index + 2))
        assert pool.misses - misses >= 6
        rows = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters
        assert sum(a.resident for a in rows) == 2
        states = [stub.SaveState(trainer_pb2.SaveStateRequest(adapter=n, seq_id=5)).version.sha256
                  for n in ("s1", "s2", "s3")]
        # Same seed, same data: identical training state whatever was spilled when.
        assert states[0] == states[1] == states[2]
    finally:
        live.close()
