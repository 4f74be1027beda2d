"""Sampler logprobs at temperature 1 equal the trainer's Forward logprobs for the same published version."""

from __future__ import annotations

import math

from loraplane.v1 import common_pb2, sampler_pb2, trainer_pb2

PROMPT = [17, 42, 99, 7, 120, 64]


def test_sample_logprobs_equal_trainer_forward(trainer, sampler):
    stub = trainer.stub()
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name="tc", lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=3), base_model="tiny"))
    # One real training step, so B is no longer zero and the adapter differs from the base model.
    datum = trainer_pb2.Datum(input_tokens=[5, 6, 7, 8, 9], target_tokens=[6, 7, 8, 9, 10])
    stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="tc", seq_id=1, data=[datum],
                                                            loss_fn="cross_entropy"))
    stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="tc", seq_id=2, adam_params=trainer_pb2.AdamParams(
        learning_rate=0.05, beta1=0.9, beta2=0.999, eps=1e-8)))
    version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="tc", seq_id=3)).version
    sampler.wait_loaded({f"tc@v{version.version}"})

    reply = sampler.stub().Sample(sampler_pb2.SampleRequest(
        adapter=common_pb2.AdapterRef(name="tc"), prompt_tokens=PROMPT,
        sampling_params=common_pb2.SamplingParams(max_tokens=16, temperature=1.0, seed=21)))
    assert reply.served_version == version.version
    sampled = reply.sequences[0]
    full = PROMPT + list(sampled.tokens)
    forward = stub.Forward(trainer_pb2.ForwardRequest(
        adapter="tc", seq_id=4, loss_fn="cross_entropy",
        data=[trainer_pb2.Datum(input_tokens=full[:-1], target_tokens=full[1:])])).outputs[0]
    trainer_logprobs = list(forward.logprobs)[len(PROMPT) - 1:]
    assert len(trainer_logprobs) == len(sampled.logprobs)
    assert max(abs(a - b) for a, b in zip(sampled.logprobs, trainer_logprobs)) <= 1e-4
    assert all(math.isfinite(v) for v in sampled.logprobs)

    base = sampler.stub().ComputeLogprobs(sampler_pb2.ComputeLogprobsRequest(tokens=full))
    # The trained adapter is not the base model.
    assert max(abs(a - b) for a, b in zip(base.logprobs[len(PROMPT):], sampled.logprobs)) > 1e-3
