"""The megatron trainer's choice between replicas (DP) and expert parallelism (EP) from the model's shape and the
GPUs (trainer_svc/backends/megatron/parallel_plan.py, issue 35): Qwen3-30B-A3B fits one H200 and gets replicas; a
GPU too small for it gets the smallest EP that fits; the memory plan counts the all-to-all's buffers; an explicit EP
wins."""

from __future__ import annotations

import pytest

from trainer_svc.backends.megatron.parallel_plan import (
    A2A_IMBALANCE,
    RESERVE_FRACTION,
    AdapterMemory,
    Gpus,
    ModelSize,
    memory_plan,
    plan_parallelism,
    trainer_plan,
)

GB = 10**9
H200 = 140 * GB


def _qwen3_30b_a3b():
    from transformers import AutoConfig

    from tests.e2e.test_megatron_moe_cpu import QWEN3_30B_A3B

    fields = dict(QWEN3_30B_A3B)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _model(config) -> ModelSize:
    from trainer_svc.backends.megatron.model import spec_from_hf_config

    spec = spec_from_hf_config(config)
    return ModelSize(spec.shape, spec.moe_top_k, spec.tie_word_embeddings, dtype_bytes=2)


def test_the_model_size_counts_qwen3_30b_a3b_parameters():
    model = _model(_qwen3_30b_a3b())
    assert 30.4e9 < model.params < 30.6e9  # "30.5B total"
    assert model.expert_params == 48 * 128 * 3 * 2048 * 768


def test_qwen3_30b_a3b_fits_one_h200_and_trains_on_replicas():
    plan = trainer_plan(_qwen3_30b_a3b(), 2, 1, dtype_bytes=2, device_memory_bytes=H200, device_slots=8)
    assert (plan.data_parallel, plan.expert_parallel) == (2, 1), plan.reason
    m = plan.memory
    assert m.fits and m.all_to_all == 0
    assert 60 * GB < m.weights < 62 * GB  # the whole bf16 base on every GPU
    assert m.adapters > 0 and m.activations > 0 and m.total <= H200
    assert plan.as_dict()["memory_bytes"]["total"] == m.total


@pytest.mark.parametrize(("gpus", "memory", "want"), [(2, 80 * GB, 2), (8, 48 * GB, 8), (4, 80 * GB, 2)])
def test_a_model_that_does_not_fit_one_gpu_gets_the_smallest_expert_parallelism_that_fits(gpus, memory, want):
    config = _qwen3_30b_a3b()
    plan = trainer_plan(config, gpus, 1, dtype_bytes=2, device_memory_bytes=memory, device_slots=8)
    assert plan.expert_parallel == want and plan.data_parallel == gpus and plan.memory.fits, plan.as_dict()
    # Every smaller degree (the operator's, taken as given) does not fit.
    for smaller in (ep for ep in range(1, want) if gpus % ep == 0):
        other = trainer_plan(config, gpus, 1, dtype_bytes=2, device_memory_bytes=memory, device_slots=8,
                             expert_parallel=smaller)
        assert not other.memory.fits and other.expert_parallel == smaller


def test_the_memory_plan_counts_the_all_to_all_buffers():
    model = _model(_qwen3_30b_a3b())
    adapters = AdapterMemory(replicated=1 * GB, per_expert=8 * GB)
    tokens = 4 * 2048
    ep2 = memory_plan(model, Gpus(2, 80 * GB), adapters, ep=2, tokens_per_gpu=tokens)
    # Each token's k=8 expert rows of h=2048 bf16 values, sent and received in the dispatch and in the combine.
    assert ep2.all_to_all == int(2 * (1 + A2A_IMBALANCE) * tokens * 8 * 2048 * 2) > 0
    assert ep2.total == ep2.weights + ep2.adapters + ep2.activations + ep2.all_to_all + ep2.reserve
    assert ep2.adapters == 1 * GB + 4 * GB  # per-expert factors split over the two EP ranks
    # A GPU that would hold everything else but not the buffers is too small: the buffers decide.
    rest = ep2.weights + ep2.adapters + ep2.activations
    tight = int((rest + ep2.all_to_all // 2) / (1 - RESERVE_FRACTION))
    plan = memory_plan(model, Gpus(2, tight), adapters, ep=2, tokens_per_gpu=tokens)
    assert rest + plan.reserve <= tight and not plan.fits
    assert memory_plan(model, Gpus(2, tight), adapters, ep=1, tokens_per_gpu=tokens).all_to_all == 0


def test_an_explicit_expert_parallel_size_wins_and_a_dense_model_stays_on_replicas():
    model = _model(_qwen3_30b_a3b())
    plan = plan_parallelism(model, Gpus(2, H200), AdapterMemory(), expert_parallel=2)
    assert plan.expert_parallel == 2 and "operator" in plan.reason
    from transformers import LlamaConfig

    dense = _model(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    assert plan_parallelism(dense, Gpus(2, 16 * GB), AdapterMemory()).expert_parallel == 1


def test_where_nothing_fits_the_plan_says_so_and_takes_the_closest_degree():
    plan = trainer_plan(_qwen3_30b_a3b(), 2, 1, dtype_bytes=2, device_memory_bytes=24 * GB, device_slots=8)
    assert plan.expert_parallel == 2 and not plan.memory.fits and "closest" in plan.reason
