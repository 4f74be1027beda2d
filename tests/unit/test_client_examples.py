"""The pure parts of examples/rl_loop.py: the verifiable reward, GRPO advantages and the datum alignment."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
_spec = importlib.util.spec_from_file_location("rl_loop_example", _PATH)
rl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = rl  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(rl)


def test_reward_is_verified_from_the_first_number():
    problem = rl.Problem(3, 4, "+")
    assert problem.answer == 7 and problem.question.startswith("What is 3 + 4?")
    assert rl.reward(problem, " 7") == (1.0, True)
    assert rl.reward(problem, "The answer is 7.") == (1.0, True)
    assert rl.reward(problem, "8, not 7") == (pytest.approx(0.3 * 0.8), False)
    assert rl.reward(problem, "70") == (0.0, False)
    assert rl.reward(problem, "seven") == (0.0, False)
    assert rl.Problem(2, 5, "-").answer == -3
    assert rl.reward(rl.Problem(2, 5, "-"), "-3") == (1.0, True)


def test_group_advantages_are_normalized_and_empty_without_signal():
    advantages = rl.group_advantages([1.0, 0.0, 0.0, 1.0])
    assert advantages == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert sum(rl.group_advantages([0.3, 0.1, 1.0])) == pytest.approx(0.0, abs=1e-9)
    assert rl.group_advantages([0.2, 0.2, 0.2]) is None


def test_rl_datum_aligns_prompt_and_completion():
    datum = rl.rl_datum([1, 2, 3], [7, 8], [-0.5, -0.25], 2.0)
    proto = datum.to_proto()
    assert list(proto.input_tokens) == [1, 2, 3, 7]
    assert list(proto.target_tokens) == [2, 3, 7, 8]
    assert list(proto.logprobs) == [0.0, 0.0, -0.5, -0.25]
    assert list(proto.advantages) == [0.0, 0.0, 2.0, 2.0]
