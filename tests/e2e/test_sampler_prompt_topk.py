"""Top-k prompt logprobs and prompt_logprobs_last_n on a live sampler (torch engine, `tiny` model, real registry),
through real gRPC and the loraplane client: the top-k at every prompt position equals the top-k of the model's own
log-softmax at that position, computed directly."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch

from loraplane.adapter_format import parse_adapter
from loraplane.client import SamplingClient, SamplingParams
from loraplane.lora import AdapterTensors, lora_routing
from loraplane.v1 import common_pb2, sampler_pb2
from tests.fixtures.sampler import adapter_blob, tiny_base

PROMPT = [17, 42, 99, 7, 120, 64, 5, 230]
K = 5


def reference_logprobs(tokens: list[int], blob: bytes) -> torch.Tensor:
    base = tiny_base()
    params, spec, _ = parse_adapter(blob)
    with torch.no_grad(), lora_routing(base.model, [AdapterTensors.from_params(params, spec)]):
        return torch.log_softmax(base.model(torch.tensor([tokens])).logits[0].double(), dim=-1)


def request(**fields) -> sampler_pb2.SampleRequest:
    return sampler_pb2.SampleRequest(adapter=common_pb2.AdapterRef(name="topk"), prompt_tokens=PROMPT,
                                     sampling_params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0),
                                     **fields)


@pytest.fixture
def topk_sampler(sampler):
    blob = adapter_blob(31)
    sampler.create_adapter("topk")
    sampler.publish("topk", blob)
    sampler.wait_loaded({"topk@v1"})
    return sampler, blob


def test_topk_prompt_logprobs_equal_the_models_own_topk(topk_sampler):
    sampler, blob = topk_sampler
    reference = reference_logprobs(PROMPT, blob)
    reply = sampler.stub().Sample(request(topk_prompt_logprobs=K, include_prompt_logprobs=True), timeout=60)
    assert reply.topk_prompt_k == K
    ids = np.asarray(reply.topk_prompt_token_ids).reshape(len(PROMPT), K)
    values = np.asarray(reply.topk_prompt_logprobs).reshape(len(PROMPT), K)
    assert ids[0].tolist() == [0] * K and values[0].tolist() == [-99999.0] * K
    for position in range(1, len(PROMPT)):
        row = reference[position - 1]
        expected = torch.topk(row, K)
        assert np.allclose(values[position], expected.values.numpy(), atol=1e-4), position
        # Same tokens (ties aside): each returned id's own logprob is the value reported beside it.
        assert np.allclose(row[torch.tensor(ids[position])].numpy(), values[position], atol=1e-4), position
        assert set(ids[position].tolist()) == set(expected.indices.tolist()), position
        assert list(values[position]) == sorted(values[position], reverse=True)
        # The prompt token's own logprob is consistent with the top-k (it is in it exactly when it ranks there).
        assert reply.prompt_logprobs[position] <= values[position][0] + 1e-5

    # Without include_prompt_logprobs only the top-k comes back; without topk nothing of it.
    only_topk = sampler.stub().Sample(request(topk_prompt_logprobs=2), timeout=60)
    assert only_topk.topk_prompt_k == 2 and len(only_topk.prompt_logprobs) == 0
    assert np.allclose(np.asarray(only_topk.topk_prompt_logprobs).reshape(-1, 2)[1:], values[1:, :2], atol=1e-5)
    plain = sampler.stub().Sample(request(include_prompt_logprobs=True), timeout=60)
    assert plain.topk_prompt_k == 0 and len(plain.topk_prompt_token_ids) == 0


def test_prompt_logprobs_last_n_scores_only_the_suffix(topk_sampler):
    sampler, blob = topk_sampler
    reference = reference_logprobs(PROMPT, blob)
    reply = sampler.stub().Sample(request(topk_prompt_logprobs=3, include_prompt_logprobs=True,
                                          prompt_logprobs_last_n=3), timeout=60)
    first = len(PROMPT) - 3
    assert all(math.isnan(v) for v in reply.prompt_logprobs[:first])
    expected = [float(reference[i - 1, PROMPT[i]]) for i in range(first, len(PROMPT))]
    assert np.allclose(reply.prompt_logprobs[first:], expected, atol=1e-4)
    values = np.asarray(reply.topk_prompt_logprobs).reshape(len(PROMPT), 3)
    assert (values[:first] == -99999.0).all()
    assert np.allclose(values[first:], torch.topk(reference[first - 1:-1], 3).values.numpy(), atol=1e-4)


@pytest.mark.parametrize("fields,field", [
    ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),
    ({"prompt_logprobs_last_n": len(PROMPT), "include_prompt_logprobs": True}, "prompt_logprobs_last_n"),
])
def test_bad_prompt_logprob_options_are_invalid_argument_naming_the_field(topk_sampler, fields, field):
    sampler, _ = topk_sampler
    with pytest.raises(grpc.RpcError) as info:
        sampler.stub().Sample(request(**fields), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def test_client_returns_dense_topk_as_the_tinker_sdk_does(topk_sampler):
    sampler, blob = topk_sampler
    reference = reference_logprobs(PROMPT, blob)
    client = SamplingClient(sampler.address, "topk")
    reply = client.sample(PROMPT, 1, SamplingParams(max_tokens=2, temperature=0.0), topk_prompt_logprobs=K,
                          prompt_logprobs_last_n=4).result(60)
    topk = reply.topk_prompt_logprobs_np
    assert topk.token_ids.shape == (len(PROMPT), K) and topk.token_ids.dtype == np.int32
    assert topk.logprobs.shape == (len(PROMPT), K) and topk.logprobs.dtype == np.float32
    rows = reply.topk_prompt_logprobs
    assert rows[: len(PROMPT) - 4] == [None] * (len(PROMPT) - 4)
    last = rows[-1]
    assert len(last) == K
    assert np.allclose([v for _, v in last], torch.topk(reference[-2], K).values.numpy(), atol=1e-4)
    assert reply.prompt_logprobs is None
