"""Recorded sampling (`record_stability_info`), provenance spans, stable_reinforce / gspo and top-k prompt logprobs
through the official tinker SDK against a live gateway (`tiny` model, real services, real Valkey)."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import tinker
from tinker import types

PROMPT = [5, 17, 42, 9, 77, 3]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def service(cluster):
    client = tinker.ServiceClient(base_url=cluster.base_url)
    yield client
    client.close("success")


def rl_datum(prompt: list[int], seq: types.SampledSequence, advantage: float, client_logprobs=None,
             sequence_id: str | None = None) -> types.Datum:
    """What rl_loop builds: input = prompt + sampled[:-1], targets = prompt[1:] + sampled, with provenance."""
    sampled = list(seq.tokens)
    ob = len(prompt) - 1
    logprobs = client_logprobs if client_logprobs is not None else list(seq.logprobs)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:] + sampled, "logprobs": [0.0] * ob + list(logprobs),
                        "advantages": [0.0] * ob + [advantage] * len(sampled)})
    sid = sequence_id or seq.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))])


def recorded_run(service, seed: int = 1):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=PARAMS).result()
    return training, sampler, result


def test_stable_reinforce_trains_on_the_recorded_logprobs_not_the_clients(service):
    training, _sampler, result = recorded_run(service)
    seqs = result.sequences
    assert len({s.sequence_id for s in seqs}) == 2 and all(s.sequence_id for s in seqs)
    honest = [rl_datum(PROMPT, s, a) for s, a in zip(seqs, (1.0, -1.0))]
    # The same data with the client's logprobs replaced by nonsense: were they used, every ratio would leave the
    # trust band (exp(lp + 50)) and the loss would be 0.
    forged = [rl_datum(PROMPT, s, a, client_logprobs=[-50.0] * len(s.tokens)) for s, a in zip(seqs, (1.0, -1.0))]
    a = training.forward(honest, "stable_reinforce").result()
    b = training.forward(forged, "stable_reinforce").result()
    sampled = sum(len(s.tokens) for s in seqs)
    assert a.metrics["recorded_logprobs:sum"] == b.metrics["recorded_logprobs:sum"] == sampled
    assert a.metrics["loss:sum"] != 0.0 and b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], abs=1e-6)
    for oa, ob in zip(a.loss_fn_outputs, b.loss_fn_outputs):
        np.testing.assert_array_equal(oa["elementwise_loss"].to_numpy(), ob["elementwise_loss"].to_numpy())
        # Prompt positions carry no loss (mask 0).
        assert not oa["elementwise_loss"].to_numpy()[: len(PROMPT) - 1].any()

    # Training on them raises the positive-advantage sequence's logprob (REINFORCE on policy) and stays finite.
    before = a.loss_fn_outputs[0]["logprobs"].to_numpy()[len(PROMPT) - 1:].sum()
    for _ in range(3):
        out = training.forward_backward(honest, "stable_reinforce", {"ratio_cap": 2.0, "kl_coeff": 0.01}).result()
        assert np.isfinite(out.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    after = training.forward(honest, "stable_reinforce").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert after[len(PROMPT) - 1:].sum() > before + 0.1


def failure(training, data, loss_fn="stable_reinforce", config=None) -> str:
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.forward_backward(data, loss_fn, config).result()
    return str(failed.value)


def test_spans_are_checked_against_the_record(service, cluster):
    training, _sampler, result = recorded_run(service, seed=2)
    seq = result.sequences[0]
    # A never-issued sequence, one sampled without recording and one of another session of the same tenant all
    # answer alike.
    plain = training.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS).result().sequences[0]
    other_service = tinker.ServiceClient(base_url=cluster.base_url)
    try:
        other = other_service.create_lora_training_client(base_model="tiny", rank=4).result()
        foreign = other.save_weights_and_get_sampling_client(record_stability_info=True).result().sample(
            types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS).result().sequences[0]
    finally:
        other_service.close("success")
    messages = []
    for sid in ("f" * 32 + ":0", plain.sequence_id, foreign.sequence_id):
        message = failure(training, [rl_datum(PROMPT, seq if sid != foreign.sequence_id else foreign, 1.0,
                                              sequence_id=sid)])
        assert "has no stability record" in message
        messages.append(re.sub(r"request_id='\w+'", "", message.replace(sid, "<id>")))
    assert len(set(messages)) == 1, messages

    # Sampled tokens that are not the recorded ones.
    forged = SimpleNamespace(tokens=[t + 1 for t in seq.tokens], logprobs=seq.logprobs,
                             sequence_id=seq.sequence_id)
    assert "is not the sampled token" in failure(training, [rl_datum(PROMPT, forged, 1.0)])
    # Positions beyond the record (the span claims more sampled tokens than there were).
    longer = SimpleNamespace(tokens=list(seq.tokens) + [5], logprobs=list(seq.logprobs) + [0.0],
                             sequence_id=seq.sequence_id)
    assert "outside the" in failure(training, [rl_datum(PROMPT, longer, 1.0)])
    # A nonzero advantage on a prompt position.
    bad = rl_datum(PROMPT, seq, 1.0)
    advantages = bad.loss_fn_inputs["advantages"].to_numpy().copy()
    advantages[0] = 1.0
    bad = types.Datum(model_input=bad.model_input, loss_fn_inputs={**bad.loss_fn_inputs, "advantages": advantages},
                      model_input_spans=bad.model_input_spans, loss_fn_input_spans=bad.loss_fn_input_spans)
    assert "nonzero advantage on prompt positions" in failure(training, [bad])
    # stable_reinforce without provenance; an unknown config key; a text config value.
    no_spans = types.Datum(model_input=bad.model_input, loss_fn_inputs=rl_datum(PROMPT, seq, 1.0).loss_fn_inputs)
    assert "needs provenance spans" in failure(training, [no_spans])
    assert "clip_ratio" in failure(training, [rl_datum(PROMPT, seq, 1.0)], config={"clip_ratio": 1.0})
    assert "loss_fn_config.mode" in failure(training, [rl_datum(PROMPT, seq, 1.0)], config={"mode": "x"})
    # Every refusal consumed its seq_id: the client goes on at once.
    started = time.monotonic()
    assert training.forward_backward([rl_datum(PROMPT, seq, 1.0)], "stable_reinforce").result().metrics
    assert time.monotonic() - started < 3.0


def test_records_expire_and_are_bounded_per_tenant(service, cluster):
    brief = cluster.another_gateway(stability_ttl_s=1)
    small = cluster.another_gateway(stability_max_bytes_per_tenant=400)
    try:
        for replica, pause in ((brief, 1.5), (small, 0.0)):
            client = tinker.ServiceClient(base_url=replica.base_url)
            try:
                training = client.create_lora_training_client(base_model="tiny", rank=4).result()
                sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
                first = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences[0]
                assert training.forward([rl_datum(PROMPT, first, 1.0)], "stable_reinforce").result().metrics
                time.sleep(pause)
                # The small bound holds two records of this size (about 170 bytes each): older ones go first.
                newer = [sampler.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences[0]
                         for _ in range(4)]
                assert "has no stability record" in failure(training, [rl_datum(PROMPT, first, 1.0)])
                assert training.forward([rl_datum(PROMPT, newer[-1], 1.0)], "stable_reinforce").result().metrics
            finally:
                client.close("success")
    finally:
        brief.stop()
        small.stop()


def test_gspo_takes_the_sequence_ratio_mask(service):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences[0]
    ob = len(PROMPT) - 1
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + list(seq.tokens[:-1])), loss_fn_inputs={
        "target_tokens": PROMPT[1:] + list(seq.tokens), "logprobs": [0.0] * ob + list(seq.logprobs),
        "advantages": [0.0] * ob + [1.0] * len(seq.tokens),
        "sequence_ratio_mask": [0.0] * ob + [1.0] * len(seq.tokens)})
    first = training.forward_backward([datum], "gspo").result()
    assert np.isfinite(first.metrics["loss:sum"]) and first.metrics["loss:sum"] < 0
    for _ in range(2):
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        training.forward_backward([datum], "gspo").result()
    after = training.forward([datum], "gspo").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert after[ob:].sum() > first.loss_fn_outputs[0]["logprobs"].to_numpy()[ob:].sum()


def test_topk_prompt_logprobs_and_last_n(service):
    sampler = service.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(PROMPT)
    result = sampler.sample(prompt, 1, PARAMS, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    topk = result.topk_prompt_logprobs_np
    assert topk.token_ids.shape == (len(PROMPT), 3) and topk.logprobs.shape == (len(PROMPT), 3)
    assert (topk.token_ids[0] == 0).all()  # no context before the first token
    lp = np.asarray(result.prompt_logprobs[1:], dtype=np.float32)
    # Most likely first, and the best alternative is at least as likely as the actual token.
    assert (np.diff(topk.logprobs[1:], axis=1) <= 0).all() and (topk.logprobs[1:, 0] >= lp - 1e-5).all()
    last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=2).result()
    full = sampler.compute_logprobs(prompt).result()
    assert all(v is None or np.isnan(v) for v in last[:-2])
    np.testing.assert_allclose(last[-2:], full[-2:], atol=1e-5)
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs"):
        sampler.sample(prompt, 1, PARAMS, topk_prompt_logprobs=50).result()


def test_target_prompt_logprobs_dense_and_sparse(service):
    """decisions-style: the logprobs of chosen tokens at chosen prompt positions, in the request's shape and layout
    (0.0 where nothing was asked)."""
    import torch

    sampler = service.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(PROMPT)
    full = sampler.compute_logprobs(prompt).result()
    targets = torch.full((len(PROMPT) - 1, 3), -1, dtype=torch.int64)
    # Row i scores position i + 1: the actual next token (whose logprob compute_logprobs gives) and two others.
    targets[2] = torch.tensor([PROMPT[3], 11, 12])
    targets[4, 0] = PROMPT[5]
    for tensor in (tinker.TensorData.from_torch_sparse(targets, pad_value=-1), tinker.TensorData.from_torch(targets)):
        out = sampler.sample(prompt, 1, PARAMS, target_prompt_logprobs=tensor).result().target_prompt_logprobs
        got = out.to_numpy()
        assert got.shape == (len(PROMPT) - 1, 3)
        assert got[2, 0] == pytest.approx(full[3], abs=1e-5) and got[4, 0] == pytest.approx(full[5], abs=1e-5)
        assert got[2, 1] < 0 and got[2, 2] < 0 and got[2, 1] != got[2, 2]
        asked = (targets != -1).numpy()
        assert (got[~asked] == 0.0).all()
    with pytest.raises(tinker.BadRequestError, match="target_prompt_logprobs"):
        sampler.sample(prompt, 1, PARAMS, target_prompt_logprobs=tinker.TensorData.from_torch(targets[:2])).result()
