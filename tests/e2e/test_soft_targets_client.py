"""The loraplane client with (N, K) soft targets against a real trainer (`tiny`): what the trainer computes for a
soft-target datum is what 1-D forwards of its K target columns give, and a loss that reads no soft targets is
refused with the field named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplane.client import AdamParams, Datum, InvalidArgumentError, RetryConfig, ServiceClient

RETRY = RetryConfig(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=60,
                    attempt_timeout_s=60)


def test_soft_targets_through_the_client(registry, trainer):
    service = ServiceClient(trainer=trainer.address, registry=registry.address, sampler="127.0.0.1:1", retry=RETRY)
    training = service.create_lora_training_client("tiny", rank=4, seed=2, name="e2e/soft-targets")
    generator = torch.Generator().manual_seed(0)
    n, k = 10, 3
    inputs = torch.randint(5, 200, (n,), generator=generator).tolist()
    targets = torch.randint(5, 200, (n, k), generator=generator)
    weights = torch.softmax(torch.randn(n, k, generator=generator), -1)
    soft = Datum(inputs, {"target_tokens": targets, "weights": weights})
    out = training.forward_backward([soft], "cross_entropy").result(60)
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (n, k) and out.loss_fn_outputs[0]["elementwise_loss"].shape == [n]
    columns = training.forward([Datum(inputs, {"target_tokens": targets[:, j]}) for j in range(k)]).result(60)
    reference = np.stack([o["logprobs"].to_numpy() for o in columns.loss_fn_outputs], 1)
    np.testing.assert_allclose(logprobs, reference, atol=2e-5)
    assert out.loss == pytest.approx(float(-(weights.numpy() * reference).sum()), abs=1e-3)

    with pytest.raises(InvalidArgumentError) as refused:
        training.forward_backward([Datum(inputs, {"target_tokens": targets, "logprobs": [0.0] * n,
                                                  "advantages": [1.0] * n})], "importance_sampling").result(60)
    assert refused.value.field == "data[0].target_tokens" and "cross_entropy" in str(refused.value)
    # The refusal consumed its seq_id; training goes on.
    assert not training.optim_step(AdamParams(learning_rate=1e-2)).result(60).skipped
