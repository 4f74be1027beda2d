"""Qwen3-MoE (`tiny-moe`: a dense layer, two MoE layers of 8 experts top-2, GQA, q/k norms) end to end on CPU fp32:
tenants with expert adapters of both layouts train interleaved in fused batches bit-identically to training alone,
each gradient lands only in its own adapter, and a trained version publishes and samples through the gRPC client
with the sampler's logprobs equal to the trainer's Forward."""

from __future__ import annotations

import pytest
import torch

from loraplane.client import ServiceClient
from loraplane.lora import LoraSpec, init_lora_params
from loraplane.models import load_base_model
from loraplane.v1 import common_pb2, trainer_pb2
from tests.e2e.test_trainer_isolation import ADAM, assert_states_identical, fb, rounds, saved_state, wait_queued
from tests.fixtures.family_flow import publish_and_sample, random_data, retrying_service, train_until_loss_drops
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
PER_EXPERT = common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT
SHARED_OUTER = common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER


@pytest.fixture
def moe_trainer(registry, background_loop):
    live = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=5.0,
                              base_model="tiny-moe")
    yield live
    live.close()


@pytest.fixture
def moe_sampler(registry, background_loop):
    live = start_live_sampler(registry.settings, background_loop, registry.address, base_model="tiny-moe")
    yield live
    live.close()


def create(stub, name, rank, alpha, seed, targets=(), layout=0):
    return stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=rank, alpha=alpha, seed=seed, target_modules=targets,
                                                     expert_layout=layout))).adapter


def test_moe_tenants_fused_equal_alone_and_isolated(moe_trainer):
    stub = moe_trainer.stub()
    scheduler = moe_trainer.service.scheduler
    pool = moe_trainer.service.pool
    data_a = rounds(1, [7, 12], count=2)
    data_b = rounds(2, [5], count=2)
    # Default targets on a MoE model: attention + experts, per expert; B: shared-outer experts only at rank 2
    # (misaligned for torch._grouped_mm, so the gathered fallback runs too).
    info = create(stub, "alone-a", 4, 8, 11)
    assert list(info.lora_config.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj", *EXPERTS]
    assert info.lora_config.expert_layout == PER_EXPERT
    create(stub, "alone-b", 2, 0, 22, EXPERTS, SHARED_OUTER)
    create(stub, "mixed-a", 4, 8, 11)
    shared = create(stub, "mixed-b", 2, 0, 22, EXPERTS, SHARED_OUTER)
    assert shared.lora_config.expert_layout == SHARED_OUTER
    # 8 experts x (rank 2 x 32 + 64 x 2) + the shared factors (2 x 64 + 64 x 2), two MoE layers.
    assert shared.parameter_count == 2 * (8 * (2 * 32 + 64 * 2) + 2 * 64 + 64 * 2)
    create(stub, "bystander", 4, 8, 33)

    alone = {}
    for name, data in (("alone-a", data_a), ("alone-b", data_b)):
        seq, outputs = 0, []
        for batch in data:
            seq += 1
            outputs.append(stub.ForwardBackward(fb(name, seq, batch)))
            seq += 1
            stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, seq_id=seq, adam_params=ADAM))
        alone[name] = outputs
    fused_before = scheduler.stats.fused_batches
    mixed = {"mixed-a": [], "mixed-b": []}
    seq = 0
    for batch_a, batch_b in zip(data_a, data_b):
        seq += 1
        scheduler.hold()
        try:
            future_a = stub.ForwardBackward.future(fb("mixed-a", seq, batch_a))
            future_b = stub.ForwardBackward.future(fb("mixed-b", seq, batch_b))
            wait_queued(scheduler, 2)
        finally:
            scheduler.release()
        mixed["mixed-a"].append(future_a.result(60))
        mixed["mixed-b"].append(future_b.result(60))
        # Isolation: the fused backward left no gradient in an adapter outside the batch.
        assert not pool.get("bystander").has_grads()
        assert pool.get("mixed-a").has_grads() and pool.get("mixed-b").has_grads()
        seq += 1
        for name in mixed:
            step = stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, seq_id=seq, adam_params=ADAM))
            assert not step.skipped
    assert scheduler.stats.fused_batches - fused_before == len(data_a)

    for name in ("a", "b"):
        for got, want in zip(mixed[f"mixed-{name}"], alone[f"alone-{name}"]):
            assert got.metrics["loss:sum"] == want.metrics["loss:sum"]
            for out_got, out_want in zip(got.outputs, want.outputs):
                assert list(out_got.logprobs) == list(out_want.logprobs)
        assert_states_identical(saved_state(moe_trainer, stub, f"mixed-{name}", 5),
                                saved_state(moe_trainer, stub, f"alone-{name}", 5))
    # Training moved the expert factors of both layouts (the equality above is not about untouched tensors).
    state_b = saved_state(moe_trainer, stub, "mixed-b", 6)
    fresh_b = init_lora_params(load_base_model("tiny-moe"), LoraSpec.create(
        2, 0, EXPERTS, 22, expert_layout="shared_outer"))
    assert set(fresh_b) == set(state_b.params)
    assert all(not torch.equal(fresh_b[k], state_b.params[k]) for k in fresh_b if "lora_B" in k)
    assert state_b.params["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"].shape == (2, 64)


def test_unknown_and_dense_mlp_targets_are_refused_on_a_moe_model(moe_trainer):
    import grpc

    stub = moe_trainer.stub()
    for targets, layout in ((["gate_proj"], 0), (["experts.up_proj"], 0), (EXPERTS, 7)):
        with pytest.raises(grpc.RpcError) as info:
            create(stub, "bad", 4, 8, 1, targets, layout)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lora_config." in info.value.details()
    # Attention only stays possible.
    attention = create(stub, "attn-only", 4, 8, 1, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert attention.parameter_count == 3 * 4 * ((64 + 48) + (64 + 24) * 2 + (48 + 64))


def test_the_clients_train_mlp_flag_means_the_experts_on_a_moe_model(registry, moe_trainer):
    """ServiceClient's train_mlp / train_attn narrow to what the base model offers: on a MoE model the MLP is its
    routed experts (gate/up/down of a dense model would be refused, as the test above shows)."""
    service = ServiceClient(trainer=moe_trainer.address, registry=registry.address)
    try:
        mlp = service.create_lora_training_client("tiny-moe", rank=4, seed=1, name="moe/mlp-only", train_attn=False)
        attn = service.create_lora_training_client("tiny-moe", rank=4, seed=1, name="moe/attn-only",
                                                   train_mlp=False)
        assert sorted(mlp.info.target_modules) == sorted(EXPERTS)
        assert list(attn.info.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    finally:
        service.close()


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_train_publish_sample_through_the_client(registry, moe_trainer, moe_sampler, layout):
    service = retrying_service(moe_trainer.address, moe_sampler.address, registry.address)
    name = f"moe/{layout.replace('_', '-')}"
    training = service.create_lora_training_client("tiny-moe", rank=4, seed=5, name=name, expert_layout=layout)
    assert training.info.expert_layout == layout
    data = random_data(lengths=(17, 17, 17))
    train_until_loss_drops(training, data)
    publish_and_sample(service, training, data, "moe", num_samples=1, check_generated=False)
    # A training state of either layout resumes through the client into an adapter of the same layout.
    state = training.save_state().result()
    resumed = service.create_training_client_from_state(state.path, name=f"{name}-resumed")
    assert resumed.info.expert_layout == layout
    assert resumed.forward(data).result().loss == training.forward(data).result().loss


def test_a_restarted_trainer_brings_a_shared_outer_adapter_back_bit_for_bit(registry, background_loop):
    limits = {"gap_timeout_s": 5.0, "checkpoint_every_steps": 2, "base_model": "tiny-moe"}
    live = start_live_trainer(registry.settings, background_loop, registry.address, **limits)
    try:
        stub = live.stub()
        create(stub, "ten/so", 4, 8, 9, [], SHARED_OUTER)
        data = rounds(3, [9, 6], count=3)
        seq = 0
        for batch in data:  # 3 steps: a checkpoint at step 2 (compact training state) plus the journal
            seq += 1
            stub.ForwardBackward(fb("ten/so", seq, batch))
            seq += 1
            stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="ten/so", seq_id=seq, adam_params=ADAM))
        before = saved_state(live, stub, "ten/so", seq + 1)
        live.close()
        live = start_live_trainer(registry.settings, background_loop, registry.address, **limits)
        stub = live.stub()
        listed = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters
        assert [a.lora_config.expert_layout for a in listed if a.name == "ten/so"] == [SHARED_OUTER]
        after = saved_state(live, stub, "ten/so", seq + 2)
        assert after.spec.expert_layout == "shared_outer" and after.step == 3
        assert_states_identical(after, before)
    finally:
        live.close()
