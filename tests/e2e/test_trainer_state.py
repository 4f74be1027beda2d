"""SaveState / LoadState round trips, and the published PEFT blob in HF PEFT vs the trainer's own Forward."""

from __future__ import annotations

import grpc
import pytest
import torch

from loraplane.adapter_format import materialize_peft_dir, parse_adapter, parse_training_state
from loraplane.models import load_base_model
from loraplane.v1 import common_pb2, trainer_pb2
from tests.fixtures.trainer import Sequenced

ADAM = trainer_pb2.AdamParams(learning_rate=0.03, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def datum(seed: int, n: int) -> trainer_pb2.Datum:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, 261, (n + 1,), generator=generator).tolist()
    return trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])


def create(stub, name, rank=4, alpha=8.0, seed=1, targets=()):
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=rank, alpha=alpha, seed=seed, target_modules=targets)))


def test_save_then_load_with_optimizer_continues_exactly_and_without_it_restarts_adam(trainer):
    stub = trainer.stub()
    create(stub, "orig", seed=4)
    create(stub, "copy-full", seed=99)  # a different seed: LoadState must overwrite everything
    create(stub, "copy-params", seed=98)
    orig = Sequenced(stub, "orig", ADAM)
    batches = [[datum(10 * i + j, 9 + j) for j in range(2)] for i in range(5)]
    for batch in batches[:3]:
        orig.train(batch)
    saved = orig.save()
    assert saved.kind == common_pb2.VERSION_KIND_TRAINING_STATE and saved.training_step == 3
    state = parse_training_state(trainer.download("orig", saved.version))
    assert state.step == 3

    full = Sequenced(stub, "copy-full", ADAM)
    loaded = full.load("orig", saved.version, with_optimizer=True)
    assert loaded.step == 3 and loaded.lora_config.seed == 99
    params_only = Sequenced(stub, "copy-params", ADAM)
    assert params_only.load("orig", saved.version, with_optimizer=False).step == 0

    for batch in batches[3:]:
        want = orig.train(batch)
        got = full.train(batch)
        assert (got.step, got.grad_norm) == (want.step, want.grad_norm)
    after_orig = parse_training_state(trainer.download("orig", orig.save().version))
    after_full = parse_training_state(trainer.download("copy-full", full.save().version))
    assert after_full.step == after_orig.step == 5
    for key in after_orig.params:
        assert torch.equal(after_full.params[key], after_orig.params[key]), key
        assert torch.equal(after_full.exp_avg[key], after_orig.exp_avg[key]), key
        assert torch.equal(after_full.exp_avg_sq[key], after_orig.exp_avg_sq[key]), key

    # Without the optimizer: same params, fresh AdamW. After one step the moments hold exactly one gradient:
    # m = (1 - b1) g and v = (1 - b2) g^2, so v == (1 - b2) / (1 - b1)^2 * m^2; the params then differ from the
    # run that kept its moments.
    outcome = params_only.train(batches[3])
    assert outcome.step == 1
    fresh = parse_training_state(trainer.download("copy-params", params_only.save().version))
    kept = parse_training_state(trainer.download("copy-full", Sequenced(stub, "copy-full", ADAM).stub.SaveState(
        trainer_pb2.SaveStateRequest(adapter="copy-full", seq_id=full.next())).version.version))
    factor = (1 - ADAM.beta2) / (1 - ADAM.beta1) ** 2
    for key in fresh.params:
        m, v = fresh.exp_avg[key], fresh.exp_avg_sq[key]
        assert torch.allclose(v, factor * m * m, rtol=1e-4, atol=1e-12), key
    assert any(not torch.equal(fresh.params[k], kept.params[k]) for k in fresh.params)


def test_load_state_rejects_incompatible_or_wrong_sources(trainer):
    stub = trainer.stub()
    create(stub, "src", rank=4)
    create(stub, "wide", rank=8)
    create(stub, "target", rank=4)
    src = Sequenced(stub, "src", ADAM)
    src.train([datum(1, 8)])
    saved = src.save()
    weights = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="src", seq_id=src.next())).version
    wide = Sequenced(stub, "wide", ADAM)
    # Tried: a rank-4 state into a rank-8 adapter.
    with pytest.raises(grpc.RpcError) as info:
        wide.load("src", saved.version, with_optimizer=True)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "rank" in info.value.details()
    # Tried: a weights version instead of a training state.
    target = Sequenced(stub, "target", ADAM)
    with pytest.raises(grpc.RpcError) as info:
        target.load("src", weights.version, with_optimizer=False)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "SaveState" in info.value.details()
    # Tried: a version that does not exist.
    with pytest.raises(grpc.RpcError) as info:
        target.load("src", 77, with_optimizer=False)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # The failed loads changed nothing: the target still equals its fresh twin.
    rows = {a.name: a for a in stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters}
    assert rows["target"].step == 0 and rows["wide"].step == 0
    # The latest training state is found without naming a version.
    loaded = stub.LoadState(trainer_pb2.LoadStateRequest(adapter="target", seq_id=target.next(),
                                                         source=common_pb2.AdapterRef(name="src"),
                                                         with_optimizer=True)).adapter
    assert loaded.step == 1


def test_published_blob_in_hf_peft_gives_the_trainers_forward_logprobs(trainer, tmp_path):
    peft = pytest.importorskip("peft")
    stub = trainer.stub()
    create(stub, "peft-check", rank=8, alpha=16, seed=3, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"])
    seq = Sequenced(stub, "peft-check", ADAM)
    for i in range(4):
        seq.train([datum(100 + i, 15), datum(200 + i, 7)])
    probe = [datum(300, 20), datum(301, 9)]
    ours = seq.forward(probe)
    published = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(
        adapter="peft-check", seq_id=seq.next(), aliases=["candidate"], metadata={"note": "peft parity"})).version
    assert list(published.aliases) == ["candidate"] and published.metadata["note"] == "peft parity"
    blob = trainer.download("peft-check", published.version)
    params, spec, base_name = parse_adapter(blob)
    assert base_name == "tiny" and spec.rank == 8 and spec.effective_alpha == 16
    assert len(params) == 2 * 7 * 2 and all(t.dtype == torch.float32 for t in params.values())
    directory = materialize_peft_dir(blob, tmp_path / "peft-check")
    model = peft.PeftModel.from_pretrained(load_base_model("tiny").model, str(directory))
    model.eval()
    base = load_base_model("tiny").model
    moved = 0.0
    for d, out in zip(probe, ours.outputs):
        tokens = torch.tensor([list(d.input_tokens)])
        with torch.no_grad():
            logits = model(tokens).logits[0]
            base_logits = base(tokens).logits[0]
        targets = torch.tensor(list(d.target_tokens))
        theirs = torch.log_softmax(logits, -1)[torch.arange(len(targets)), targets]
        plain = torch.log_softmax(base_logits, -1)[torch.arange(len(targets)), targets]
        assert torch.allclose(torch.tensor(list(out.logprobs)), theirs, atol=1e-4, rtol=0)
        moved = max(moved, float((theirs - plain).abs().max()))
    assert moved > 1e-2, "training did not move the adapter away from the base model"
