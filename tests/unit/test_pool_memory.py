"""The adapter pool bounded by measured device bytes as well as slots: expert adapters of different layouts take
very different memory, so residency follows each tenant's own tensors."""

from __future__ import annotations

import pytest
import torch

from loraplane.errors import ResourceExhausted
from loraplane.lora import LoraSpec, init_lora_params
from loraplane.models import load_base_model
from trainer_svc.pool import AdapterPool, AdapterState, slots_for_budget


@pytest.fixture(scope="module")
def moe():
    return load_base_model("tiny-moe")


def state(base, name: str, layout: str, rank: int = 4) -> AdapterState:
    spec = LoraSpec.create(rank, 0, (), 1, available=tuple(base.module_dims), expert_layout=layout)
    params = init_lora_params(base, spec)
    return AdapterState(name=name, spec=spec, base_model=base.name, params=params,
                        exp_avg={k: torch.zeros_like(v) for k, v in params.items()},
                        exp_avg_sq={k: torch.zeros_like(v) for k, v in params.items()})


def test_device_bytes_are_params_grads_and_moments(moe):
    per_expert = state(moe, "a", "per_expert")
    shared = state(moe, "b", "shared_outer")
    assert per_expert.device_bytes == 16 * per_expert.parameter_count
    assert shared.device_bytes == 16 * shared.parameter_count
    # Shared-outer keeps one gate_up A and one down B per layer instead of one per expert.
    assert shared.device_bytes < per_expert.device_bytes
    assert slots_for_budget(per_expert.device_bytes, 10 * per_expert.device_bytes + 1) == 10


def test_residency_follows_the_byte_budget(moe):
    big = [state(moe, f"big-{i}", "per_expert") for i in range(3)]
    small = state(moe, "small", "shared_outer")
    budget = 2 * big[0].device_bytes + small.device_bytes
    pool = AdapterPool(torch.device("cpu"), device_slots=8, device_memory_bytes=budget)
    for s in (*big, small):
        pool.add(s)
    pool.activate(["big-0", "big-1"])
    pool.activate(["small"])
    assert pool.resident_bytes <= budget and pool.get("small").resident
    pool.activate(["big-2"])  # over the byte budget (slots are free): the least recently used one spills
    assert not pool.get("big-0").resident and pool.get("big-2").resident
    assert pool.resident_bytes <= budget
    with pytest.raises(ResourceExhausted) as info:
        pool.activate(["big-0", "big-1", "big-2"])
    assert info.value.field == "batch"
