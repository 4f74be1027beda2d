"""Adapters whose weights versions are bfloat16 (LoraConfig.weights_dtype), end to end on real servers: the trainer
trains float32 masters and publishes them rounded to bfloat16 (training state stays float32); the blob holds BF16
tensors that HF PEFT loads with exactly the logits of the rounded weights; the torch sampler serves it exactly as
it serves a float32 version of the same rounded weights; a restarted trainer keeps publishing bfloat16."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load as st_load

from loraplane.adapter_format import materialize_peft_dir, parse_training_state, peft_adapter_config, serialize_adapter
from loraplane.models import load_base_model
from loraplane.v1 import common_pb2, registry_pb2, sampler_pb2, trainer_pb2
from sampler_svc.engines.sglang_transport import write_peft_dir
from tests.fixtures.registry import download
from tests.fixtures.trainer import start_live_trainer

BF16 = common_pb2.WEIGHTS_DTYPE_BFLOAT16
PROMPT = [17, 42, 99, 7, 120, 64]
ADAM = trainer_pb2.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.999, eps=1e-8)


def tensor_dtypes(blob: bytes) -> set[str]:
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def data_bytes(blob: bytes) -> int:
    return len(blob) - 8 - int.from_bytes(blob[:8], "little")


def peft_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    peft = pytest.importorskip("peft")
    model = peft.PeftModel.from_pretrained(load_base_model("tiny").model, str(directory)).eval()
    with torch.no_grad():
        return model(tokens).logits


def test_a_bfloat16_adapter_publishes_rounded_weights_that_peft_and_the_sampler_load(
        registry, background_loop, sampler, tmp_path):
    live = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=5.0)
    try:
        stub = live.stub()
        made = stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="half", base_model="tiny",
            lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=3, weights_dtype=BF16))).adapter
        assert made.lora_config.weights_dtype == BF16
        registered = registry.stub().GetAdapter(registry_pb2.GetAdapterRequest(name="half")).adapter
        assert registered.lora_config.weights_dtype == BF16
        datum = trainer_pb2.Datum(input_tokens=[5, 6, 7, 8, 9], target_tokens=[6, 7, 8, 9, 10])
        stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="half", seq_id=1, data=[datum],
                                                                loss_fn="cross_entropy"))
        stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="half", seq_id=2, adam_params=ADAM))
        version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="half", seq_id=3)).version
        state_version = stub.SaveState(trainer_pb2.SaveStateRequest(adapter="half", seq_id=4)).version

        _, blob = download(registry.stub(), "half", version=version.version)
        _, state_blob = download(registry.stub(), "half", version=state_version.version)
        assert tensor_dtypes(blob) == {"BF16"}
        # Training state is the float32 masters, untouched by the weights dtype.
        assert tensor_dtypes(state_blob) == {"F32"}
        masters = parse_training_state(state_blob)
        spec = masters.spec
        published = st_load(blob)
        assert set(published) == set(masters.params)
        assert all(torch.equal(published[k], masters.params[k].to(torch.bfloat16)) for k in published)
        rounded = {k: v.to(torch.float32) for k, v in published.items()}
        # The step made B non-zero, and rounding changed it: the version is not exactly the trainer's adapter.
        assert any(not torch.equal(rounded[k], masters.params[k]) for k in rounded)
        assert 2 * data_bytes(blob) == data_bytes(serialize_adapter(masters.params, spec, "tiny"))

        # HF PEFT loads the published file as it is (BF16 in its header) with the logits of the rounded weights.
        as_published = tmp_path / "as-published"
        as_published.mkdir()
        (as_published / "adapter_model.safetensors").write_bytes(blob)
        config = peft_adapter_config(spec, "tiny")
        config.pop("loraplane_seed")
        (as_published / "adapter_config.json").write_text(json.dumps(config))
        tokens = torch.tensor([PROMPT + [5, 6, 7, 8]])
        theirs = peft_logits(as_published, tokens)
        rounded_dir = materialize_peft_dir(serialize_adapter(rounded, spec, "tiny"), tmp_path / "rounded")
        assert torch.equal(theirs, peft_logits(rounded_dir, tokens))
        masters_dir = materialize_peft_dir(serialize_adapter(masters.params, spec, "tiny"), tmp_path / "masters")
        exact = peft_logits(masters_dir, tokens)
        assert not torch.equal(theirs, exact) and torch.allclose(theirs, exact, atol=1e-2)
        # The SGLang engine's file transport writes a directory PEFT loads, with the same weights.
        sglang_dir = write_peft_dir(blob, tmp_path / "sglang")
        assert torch.equal(peft_logits(sglang_dir, tokens), theirs)
        # Written as published: BF16 tensors, half the bytes of a float32 file for SGLang to read.
        assert tensor_dtypes((sglang_dir / "adapter_model.safetensors").read_bytes()) == {"BF16"}

        # The torch sampler serves the bf16 version exactly as a float32 version of the rounded weights.
        sampler.create_adapter("twin", lora_config=common_pb2.LoraConfig(rank=spec.rank, alpha=spec.alpha))
        twin = sampler.publish("twin", serialize_adapter(rounded, spec, "tiny"))
        sampler.wait_loaded({f"half@v{version.version}", f"twin@v{twin.version}"})
        params = common_pb2.SamplingParams(max_tokens=12, temperature=1.0, seed=21)
        replies = {name: sampler.stub().Sample(sampler_pb2.SampleRequest(
            adapter=common_pb2.AdapterRef(name=name), prompt_tokens=PROMPT, sampling_params=params))
            for name in ("half", "twin")}
        assert replies["half"].served_version == version.version
        half, same = replies["half"].sequences[0], replies["twin"].sequences[0]
        assert list(half.tokens) == list(same.tokens) and list(half.logprobs) == list(same.logprobs)
        # What the option trades: the trainer's Forward (float32 masters) differs from the sampler by the rounding.
        full = PROMPT + list(half.tokens)
        forward = stub.Forward(trainer_pb2.ForwardRequest(
            adapter="half", seq_id=5, loss_fn="cross_entropy",
            data=[trainer_pb2.Datum(input_tokens=full[:-1], target_tokens=full[1:])])).outputs[0]
        trainer_logprobs = list(forward.logprobs)[len(PROMPT) - 1:]
        assert max(abs(a - b) for a, b in zip(half.logprobs, trainer_logprobs)) < 5e-2

        # A restarted trainer (state from its journal) still publishes this adapter in bfloat16.
        live.close()
        live = start_live_trainer(registry.settings, background_loop, registry.address, gap_timeout_s=5.0)
        stub = live.stub()
        listed = stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters
        assert [(a.name, a.lora_config.weights_dtype) for a in listed] == [("half", BF16)]
        again = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="half", seq_id=6)).version
        assert tensor_dtypes(download(registry.stub(), "half", version=again.version)[1]) == {"BF16"}
    finally:
        live.close()


def test_an_unknown_weights_dtype_is_rejected_naming_the_field(trainer):
    stub = trainer.stub()
    with pytest.raises(grpc.RpcError) as caught:
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="odd", base_model="tiny", lora_config=common_pb2.LoraConfig(rank=4, weights_dtype=9)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_config.weights_dtype" in caught.value.details()
    assert list(stub.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters) == []
    # The default is float32, and says so.
    made = stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name="full", base_model="tiny", lora_config=common_pb2.LoraConfig(rank=4)))
    assert made.adapter.lora_config.weights_dtype == common_pb2.WEIGHTS_DTYPE_FLOAT32
    version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="full", seq_id=1)).version
    assert tensor_dtypes(trainer.download("full", version.version)) == {"F32"}


def test_the_python_client_creates_a_bfloat16_adapter(registry, trainer):
    from loraplane.client import ServiceClient

    with ServiceClient(trainer=trainer.address, registry=registry.address) as service:
        with pytest.raises(ValueError, match="weights_dtype"):
            service.create_lora_training_client("tiny", rank=4, name="nope", weights_dtype="fp8")
        service.create_lora_training_client("tiny", rank=4, name="sdk", weights_dtype="bfloat16")
        assert [(a.name, a.weights_dtype) for a in service.list_training_adapters()] == [("sdk", "bfloat16")]
        assert service.get_adapter("sdk").lora_config.weights_dtype == BF16
