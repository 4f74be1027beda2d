"""The SDK's loss functions are the trainer's (its GetInfo.supported_losses, asked once per client): no list of its
own to go stale. Real registry (Valkey + SeaweedFS) and trainer on the `tiny` model."""

from __future__ import annotations

import pytest

from loraplane.client import Datum, ModelInput, RetryConfig, ServiceClient
from trainer_svc.losses import supported_losses

FAST_RETRY = RetryConfig(max_attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5, total_timeout_s=60,
                         attempt_timeout_s=60)


def rl_datum(offset: int) -> Datum:
    tokens = [5 + offset + i for i in range(9)]
    return Datum(ModelInput(tokens[:-1]), {"target_tokens": tokens[1:], "logprobs": [-1.0] * 8,
                                           "advantages": [0.5] * 8})


def test_every_loss_the_trainer_serves_is_accepted_and_only_those(registry, trainer):
    service = ServiceClient(trainer=trainer.address, registry=registry.address, retry=FAST_RETRY)
    training = service.create_lora_training_client("tiny", rank=4, seed=2, name="e2e/losses")
    info = service.get_server_capabilities()
    assert list(info.supported_losses) == supported_losses()
    assert {"gspo", "stable_reinforce"} <= set(info.supported_losses)
    for loss in ("gspo", "stable_reinforce"):  # the two the SDK's own list lacked
        out = training.forward_backward([rl_datum(0), rl_datum(3)], loss).result(60)
        assert out.loss_fn_output_type == loss and len(out.loss_fn_outputs) == 2
    before = training.last_seq_id
    with pytest.raises(ValueError, match="gspo, stable_reinforce") as caught:
        training.forward([rl_datum(0)], "reinforce++")
    assert "'reinforce++'" in str(caught.value)
    assert training.last_seq_id == before  # refused before a seq_id was taken: nothing waits for it
    assert training.forward([rl_datum(1)], "ppo").result(60).loss_fn_output_type == "ppo"
    assert service.get_server_capabilities() is info  # one GetInfo, kept
