"""Our tinker_wire.proto against the SDK's own: the field layout of every message matches the descriptor embedded
in the tinker 0.38 wheel, and what the SDK's converters write our codec reads (and the other way round)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as sdk

from gateway_svc import tinker_codec
from gateway_svc.types import FwdBwdResult, SampledSeq, SampleResult
from gateway_svc.wire import tinker_wire_pb2 as ours

# Messages of the SDK's schema that it never sends or reads on the wire (its sample request is JSON).
_UNUSED = {"SamplingParams", "StopStrings", "StopTokens"}


def _layout(message) -> dict:
    return {f.name: (f.number, f.type, f.label, f.message_type.name if f.message_type else None)
            for f in message.fields}


def test_every_message_and_enum_matches_the_sdk_descriptor():
    sdk_messages = dict(sdk.DESCRIPTOR.message_types_by_name)
    assert set(sdk_messages) - _UNUSED <= set(ours.DESCRIPTOR.message_types_by_name)
    for name, message in sdk_messages.items():
        if name not in _UNUSED:
            assert _layout(message) == _layout(ours.DESCRIPTOR.message_types_by_name[name]), name
    for name, enum in sdk.DESCRIPTOR.enum_types_by_name.items():
        assert [(v.name, v.number) for v in enum.values] == \
            [(v.name, v.number) for v in ours.DESCRIPTOR.enum_types_by_name[name].values]


def test_the_sdks_forward_backward_request_decodes():
    tokens = [5, 6, 7, 8, 9]
    data = [types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=tokens[:2]),
                                                             types.EncodedTextChunk(tokens=tokens[2:4])]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [-1.0, -2.0, -3.0, -4.0],
                                        "advantages": [0.5, 0.5, -1.0, 2.0]})]
    request = types.ForwardBackwardRequest(
        model_id="m:train:0", seq_id=7, forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}))
    import zstandard

    body = request_conv.forward_backward_request_to_proto(request).SerializeToString()
    decoded = tinker_codec.decode_forward_backward(
        tinker_codec.decompress(zstandard.ZstdCompressor().compress(body), "zstd"))
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn, decoded.problem) == ("m:train:0", 7, "ppo", "")
    assert decoded.loss_fn_config == {"clip_low_threshold": 0.7}
    datum = decoded.data[0]
    assert datum.input_tokens == tokens[:4] and datum.target_tokens == tokens[1:]  # the chunks, concatenated
    assert datum.logprobs == [-1.0, -2.0, -3.0, -4.0] and datum.advantages == [0.5, 0.5, -1.0, 2.0]
    assert datum.weights is None


def test_unsupported_inputs_become_a_problem_not_a_crash():
    request = types.ForwardBackwardRequest(model_id="m", seq_id=1, forward_backward_input=types.ForwardBackwardInput(
        data=[types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                          loss_fn_inputs={"target_tokens": [2, 3], "clip_low_threshold": [0.5, 0.5]})],
        loss_fn="ppo"))
    decoded = tinker_codec.decode_forward_backward(
        request_conv.forward_backward_request_to_proto(request).SerializeToString())
    assert decoded.data == [] and "clip_low_threshold" in decoded.problem
    with pytest.raises(Exception, match="ForwardBackwardRequest"):
        tinker_codec.decode_forward_backward(b"\xff\xff not a protobuf")


def _fwdbwd(datum: types.Datum, loss_fn: str, config: dict | None = None):
    request = types.ForwardBackwardRequest(model_id="m", seq_id=1, forward_backward_input=types.ForwardBackwardInput(
        data=[datum], loss_fn=loss_fn, loss_fn_config=config))
    return tinker_codec.decode_forward_backward(
        request_conv.forward_backward_request_to_proto(request).SerializeToString())


def test_provenance_mask_and_config_v2_decode():
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": [2, 3, 4], "advantages": [0.0, 1.0, 1.0], "sequence_ratio_mask": [0.0, 1.0, 1.0]})
    datum = datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="r:0", length=2),
                     types.SampledProvenanceSpan(sequence_id="r:0", length=1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="r:0", offset=1, length=1),
                        types.SampledProvenanceSpan(sequence_id="r:0", offset=0, length=2)])
    decoded = _fwdbwd(datum, "stable_reinforce", {"kl_coeff": 0.25, "ratio_cap": 3})
    assert not decoded.problem and decoded.loss_fn_config == {"kl_coeff": 0.25, "ratio_cap": 3.0}
    d = decoded.data[0]
    assert d.sequence_ratio_mask == [0.0, 1.0, 1.0]
    assert [(s.kind, s.sequence_id, s.offset, s.length) for s in d.input_spans] == [
        ("prompt", "r:0", 0, 2), ("sampled", "r:0", 0, 1)]
    assert [(s.kind, s.offset, s.length) for s in d.target_spans] == [("prompt", 1, 1), ("sampled", 0, 2)]
    refused = _fwdbwd(datum, "stable_reinforce", {"mode": "token"})
    assert refused.data == [] and "loss_fn_config.mode" in refused.problem


def test_the_sdk_reads_our_results():
    out = response_conv.deserialize_forward_backward_output(tinker_codec.encode_forward_backward(FwdBwdResult(
        logprobs=[[-1.0, -2.0], [-3.0]], elementwise_loss=[[1.0, 2.0], [3.0]],
        metrics={"loss:sum": 6.0, "bare": 1.0})))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    assert out.metrics == {"loss:sum": 6.0, "bare:mean": 1.0}  # every key has exactly one ':'
    sample = response_conv.deserialize_sample_response(tinker_codec.encode_sample(SampleResult(
        sequences=[SampledSeq([4, 5], [-0.5, -0.25], "stop"), SampledSeq([6], [-1.0], "length")],
        prompt_logprobs=[math.nan, -2.0, -3.0], served_version=3)))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([4, 5], [-0.5, -0.25], "stop"), ([6], [-1.0], "length")]
    assert sample.prompt_logprobs[0] is None and np.allclose(sample.prompt_logprobs[1:], [-2.0, -3.0])
    topk = response_conv.deserialize_sample_response(tinker_codec.encode_sample(SampleResult(
        sequences=[SampledSeq([4], [-0.5], "stop")], prompt_logprobs=None, served_version=0, topk_k=2,
        topk_token_ids=[0, 0, 7, 8, 9, 3], topk_logprobs=[-99999.0, -99999.0, -0.1, -2.0, -0.3, -1.5])))
    assert topk.topk_prompt_logprobs_np.token_ids.tolist() == [[0, 0], [7, 8], [9, 3]]
    assert np.allclose(topk.topk_prompt_logprobs_np.logprobs[1:], [[-0.1, -2.0], [-0.3, -1.5]])
