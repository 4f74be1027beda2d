"""One rule for a shared-outer file's shared factors (loraplane/expert_layout.py): the sampler's fold and the
registry's streamed check agree on every tensor, however the stream is cut."""

from __future__ import annotations

import random

import pytest
import torch

from loraplane.errors import InvalidArgument
from loraplane.expert_layout import CopiesCheck, fold_copies, shared_copies
from loraplane.lora import LoraSpec, peft_key

RANK, EXPERTS = 3, 4
SPEC = LoraSpec.create(RANK, 6.0, ["experts.gate_up_proj", "experts.down_proj"], 0, expert_layout="shared_outer")
GATE_UP_A = peft_key(1, "experts.gate_up_proj", "A")
DOWN_B = peft_key(1, "experts.down_proj", "B")


def expanded(key: str, shared: torch.Tensor) -> torch.Tensor:
    """The PEFT file's form of a shared factor (as adapter_format.expand_shared_outer writes it)."""
    return shared.repeat(EXPERTS, 1) if key == GATE_UP_A else shared.repeat_interleave(EXPERTS, dim=1)


def streamed(copies, tensor: torch.Tensor, rng: random.Random) -> bool:
    bits = tensor.contiguous().view(torch.int32).reshape(-1).numpy()
    check = CopiesCheck(copies, "tensors")
    try:
        start = 0
        while start < bits.size:
            end = min(bits.size, start + rng.randint(1, 11))
            check.feed(bits[start:end])
            start = end
    except InvalidArgument:
        return False
    return True


@pytest.mark.parametrize("key,shape", [(GATE_UP_A, (RANK, 5)), (DOWN_B, (7, RANK))])
def test_the_fold_and_the_streamed_check_agree(key, shape):
    rng = random.Random(key)
    shared = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    tensor = expanded(key, shared)
    copies = shared_copies(key, tuple(tensor.shape), SPEC)
    assert copies is not None and copies.experts == EXPERTS
    assert torch.equal(fold_copies(tensor, copies), shared)
    assert all(streamed(copies, tensor, rng) for _ in range(5))
    for flat in range(tensor.numel()):
        changed = tensor.clone().reshape(-1)
        changed[flat] = -changed[flat] if changed[flat] != 0 else 1.0
        changed = changed.reshape(tensor.shape)
        with pytest.raises(InvalidArgument, match="differs between experts"):
            fold_copies(changed, copies)
        assert not streamed(copies, changed, rng), flat


def test_a_per_expert_adapter_and_an_experts_own_factor_have_no_shared_copies():
    per_expert = LoraSpec.create(RANK, 6.0, ["experts.gate_up_proj"], 0)
    assert shared_copies(GATE_UP_A, (RANK * EXPERTS, 5), per_expert) is None
    assert shared_copies(peft_key(1, "experts.gate_up_proj", "B"), (10, RANK * EXPERTS), SPEC) is None
    assert shared_copies(peft_key(0, "q_proj", "A"), (RANK, 5), SPEC) is None
