"""(N, K) soft targets for cross_entropy through the gateway with the official `tinker` SDK, as tinker-cookbook's
SDFT distillation sends them (TensorData.from_torch of the teacher's top-K tokens and probabilities), and in the
SDK's sparse CSR form (TensorData.from_torch_sparse)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import request_conv, response_conv

from gateway_svc import tinker_codec
from gateway_svc.types import FwdBwdResult

N, K = 12, 4


@pytest.fixture(scope="module")
def service(cluster):
    client = tinker.ServiceClient(base_url=cluster.base_url)
    yield client
    client.close("success")


def soft(seed: int, used: int = K) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(5, 200, (N,), generator=generator).tolist()
    targets = torch.stack([torch.randperm(195, generator=generator)[:K] + 5 for _ in range(N)])
    weights = torch.softmax(torch.randn(N, K, generator=generator), -1)
    targets[:, used:] = 0
    weights[:, used:] = 0.0
    return inputs, targets, weights


def soft_datum(inputs, targets, weights, sparse: bool = False) -> types.Datum:
    encode = types.TensorData.from_torch_sparse if sparse else types.TensorData.from_torch
    return types.Datum(model_input=types.ModelInput.from_ints(inputs),
                       loss_fn_inputs={"target_tokens": encode(targets), "weights": encode(weights)})


def column_logprobs(training, inputs, targets) -> np.ndarray:
    """[N, K]: a 1-D forward per column of target_tokens."""
    data = [types.Datum(model_input=types.ModelInput.from_ints(inputs),
                        loss_fn_inputs={"target_tokens": targets[:, k].tolist()}) for k in range(targets.shape[1])]
    out = training.forward(data, "cross_entropy").result()
    return np.stack([o["logprobs"].to_numpy() for o in out.loss_fn_outputs], 1)


def test_soft_targets_dense_and_csr_match_forwards_and_train(service):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    dense = soft(1)
    sparse = soft(2, used=1)
    sparse_datum = soft_datum(*sparse, sparse=True)
    assert sparse_datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # the CSR wire form
    hard_tokens = list(range(20, 20 + N + 1))
    hard = types.Datum(model_input=types.ModelInput.from_ints(hard_tokens[:-1]),
                       loss_fn_inputs={"target_tokens": hard_tokens[1:]})
    result = training.forward_backward([soft_datum(*dense), sparse_datum, hard], "cross_entropy").result()
    outs = result.loss_fn_outputs
    assert list(outs[0]["logprobs"].shape) == [N, K] and list(outs[1]["logprobs"].shape) == [N, K]
    assert list(outs[2]["logprobs"].shape) == [N] and list(outs[0]["elementwise_loss"].shape) == [N]

    total = 0.0
    for out, (inputs, targets, weights) in zip(outs, (dense, sparse)):
        reference = column_logprobs(training, inputs, targets)
        np.testing.assert_allclose(out["logprobs"].to_numpy(), reference, atol=2e-5)
        loss = -(weights.numpy() * reference).sum(1)
        np.testing.assert_allclose(out["elementwise_loss"].to_numpy(), loss, atol=2e-5)
        total += float(loss.sum())
    total += float(outs[2]["elementwise_loss"].to_numpy().sum())
    assert result.metrics["loss:sum"] == pytest.approx(total, abs=1e-3)

    # (N, 1) is the 1-D datum, exactly, returned as (N, 1).
    inputs, targets, _ = dense
    one = training.forward([types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(targets[:, :1])})], "cross_entropy").result()
    assert list(one.loss_fn_outputs[0]["logprobs"].shape) == [N, 1]
    flat = column_logprobs(training, inputs, targets[:, :1])
    assert np.array_equal(one.loss_fn_outputs[0]["logprobs"].to_numpy(), flat)

    # Distillation pulls the student towards the soft targets.
    for _ in range(3):
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        after = training.forward_backward([soft_datum(*dense)], "cross_entropy").result()
    before = float(outs[0]["elementwise_loss"].to_numpy().sum())
    assert after.metrics["loss:sum"] < before - 0.1


def test_bad_soft_target_shapes_name_the_field(service):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    inputs, targets, weights = soft(3)
    model_input = types.ModelInput.from_ints(inputs)

    def refused(inputs_, loss_fn: str, field: str) -> str:
        with pytest.raises(tinker.RequestFailedError) as failed:
            training.forward_backward([types.Datum(model_input=model_input, loss_fn_inputs=inputs_)],
                                      loss_fn).result()
        assert field in str(failed.value), str(failed.value)
        return str(failed.value)

    as_td = types.TensorData.from_torch
    refused({"target_tokens": targets[:, 0].tolist(), "weights": as_td(weights)}, "cross_entropy", "weights")
    refused({"target_tokens": as_td(targets), "weights": as_td(weights[:, :2].contiguous())}, "cross_entropy",
            "weights")
    message = refused({"target_tokens": as_td(targets), "logprobs": [0.0] * N, "advantages": [1.0] * N},
                      "importance_sampling", "target_tokens")
    assert "cross_entropy" in message
    refused({"target_tokens": as_td(targets[: N - 1].contiguous()), "weights": as_td(weights[: N - 1].contiguous())},
            "cross_entropy", "target_tokens")
    # The refused requests consumed their seq_ids: the client goes on.
    ok = training.forward_backward([soft_datum(inputs, targets, weights)], "cross_entropy").result()
    assert np.isfinite(ok.metrics["loss:sum"])


def _encoded(datum: types.Datum, loss_fn: str = "cross_entropy"):
    request = types.ForwardBackwardRequest(model_id="m", seq_id=1, forward_backward_input=types.ForwardBackwardInput(
        data=[datum], loss_fn=loss_fn))
    return request_conv.forward_backward_request_to_proto(request)


def test_codec_decodes_dense_and_csr_alike_and_refuses_bad_csr():
    inputs, targets, weights = soft(4, used=1)
    dense = tinker_codec.decode_forward_backward(_encoded(soft_datum(inputs, targets, weights)).SerializeToString())
    message = _encoded(soft_datum(inputs, targets, weights, sparse=True))
    assert message.data[0].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"
    csr = tinker_codec.decode_forward_backward(message.SerializeToString())
    assert not dense.problem and not csr.problem
    for d in (dense.data[0], csr.data[0]):
        assert d.targets_per_position == K
        assert d.target_tokens == targets.reshape(-1).tolist()
        assert d.weights == weights.reshape(-1).tolist()
    # A column index past K, and a row pointer array of the wrong length.
    bad_col = _encoded(soft_datum(inputs, targets, weights, sparse=True))
    tensor = bad_col.data[0].loss_fn_inputs["target_tokens"]
    cols = np.frombuffer(tensor.sparse_csr.col_indices, "<i8").copy()
    cols[0] = K
    tensor.sparse_csr.col_indices = cols.tobytes()
    decoded = tinker_codec.decode_forward_backward(bad_col.SerializeToString())
    assert decoded.data == [] and "target_tokens" in decoded.problem and "CSR" in decoded.problem
    bad_rows = _encoded(soft_datum(inputs, targets, weights, sparse=True))
    tensor = bad_rows.data[0].loss_fn_inputs["weights"]
    tensor.sparse_csr.crow_indices = tensor.sparse_csr.crow_indices[:-8]
    decoded = tinker_codec.decode_forward_backward(bad_rows.SerializeToString())
    assert decoded.data == [] and "weights" in decoded.problem
    # 3-D is no shape the losses read.
    cube = _encoded(types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(targets.reshape(N, 2, 2))}))
    decoded = tinker_codec.decode_forward_backward(cube.SerializeToString())
    assert decoded.data == [] and "target_tokens" in decoded.problem and "[12, 2, 2]" in decoded.problem


def test_the_sdk_reads_mixed_1d_and_2d_logprobs():
    result = FwdBwdResult(logprobs=[[-1.0, -2.0], [-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0], [-7.0]],
                          elementwise_loss=[[1.0, 2.0], [3.0, 4.0], [5.0], [6.0]], metrics={"loss:sum": 21.0})
    out = response_conv.deserialize_forward_backward_output(
        tinker_codec.encode_forward_backward(result, [0, 2, 2, 1]))
    shapes = [list(o["logprobs"].shape) for o in out.loss_fn_outputs]
    assert shapes == [[2], [2, 2], [1, 2], [1, 1]]
    assert out.loss_fn_outputs[1]["logprobs"].to_numpy().tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    assert [list(o["elementwise_loss"].shape) for o in out.loss_fn_outputs] == [[2], [2], [1], [1]]


def test_the_cookbooks_sdft_topk_datums_train_unmodified(service):
    """tinker-cookbook 0.6.1's own SDFT datum builder (teacher top-K from topk_prompt_logprobs, renormalized into
    (N, K) target_tokens / weights) against the gateway. The teacher is the base model with the student's own
    prompt and the student a fresh adapter (B = 0, so the base model too): at every completion position the
    student's logprobs of the K teacher tokens, renormalized over them, are the teacher's weights."""
    import asyncio

    from tinker_cookbook.distillation.sdft import build_topk_distillation_datums

    topk = 4
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    teacher = service.create_sampling_client(base_model="tiny").result()
    prompt, completion = list(range(30, 40)), [50, 61, 72, 83, 94, 105]
    full = prompt + completion
    mask = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    rollout = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "mask": types.TensorData.from_numpy(np.asarray(mask, np.float32))})
    datums, metrics = asyncio.run(build_topk_distillation_datums(
        [rollout], [{"group_idx": 0}], teacher, [types.ModelInput.from_ints(prompt)], topk=topk,
        skip_first_n_tokens=0))
    assert metrics["sdft/total_completion_tokens"] == len(completion)
    weights = datums[0].loss_fn_inputs["weights"].to_numpy()
    assert weights.shape == (len(full) - 1, topk)

    result = training.forward_backward(datums, "cross_entropy").result()
    logprobs = result.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == weights.shape
    rows = weights.sum(1) > 0
    assert rows.sum() == len(completion)
    renormalized = logprobs[rows] - np.log(np.exp(logprobs[rows].astype(np.float64)).sum(1, keepdims=True))
    np.testing.assert_allclose(renormalized, np.log(weights[rows]), atol=2e-4)
    assert result.metrics["loss:sum"] == pytest.approx(float(-(weights * logprobs).sum()), rel=1e-5)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = training.forward(datums, "cross_entropy").result()
    assert after.metrics["loss:sum"] < result.metrics["loss:sum"]
