"""How a fleet member describes an adapter no live member serves (its trainer died, or it is moving): step and last
seq_id as its next owner will restore them from the checkpoint and the journal (trainer_svc/fleet.py), read from a
real journal on Valkey without decoding request payloads."""

from __future__ import annotations

import uuid

import pytest

from trainer_svc.fleet import _progress_entries, journal_progress
from trainer_svc.journal import OUTCOME, VOID, AdapterRecord, Checkpoint, TrainingJournal, outcome_to_plain
from trainer_svc.optimizer import StepOutcome

NAME = "ten/moving"


@pytest.fixture
def journal(valkey):
    journal = TrainingJournal(valkey.url, key_prefix=f"lpunit:{uuid.uuid4().hex[:8]}:", trainer_id="fleet")
    yield journal
    journal.close()


def record(checkpoint: Checkpoint | None = None) -> AdapterRecord:
    return AdapterRecord(name=NAME, rank=4, alpha=8.0, target_modules=["q_proj"], seed=1, base_model="tiny",
                         uid="u1", checkpoints=[checkpoint] if checkpoint else [])


def step(value: int, skipped: bool = False) -> dict:
    return outcome_to_plain(StepOutcome(step=value, grad_norm=1.0, skipped=skipped))


def request(journal: TrainingJournal, seq_id: int, kind: str, outcome=None) -> None:
    # A request body as big as a real one's would be: it is never decoded to describe the adapter.
    journal.append_requests([(NAME, seq_id, kind, b"h%d" % seq_id, {"tokens": list(range(2000))})])
    if outcome is not None:
        journal.append_outcomes([(NAME, seq_id, OUTCOME, outcome)])


def progress(journal: TrainingJournal, rec: AdapterRecord) -> tuple[int, int]:
    light = journal_progress(rec, _progress_entries(journal, NAME))
    assert light == journal_progress(rec, journal.entries(NAME))  # the same as from the fully decoded journal
    return light


def test_an_empty_journal_is_its_checkpoint(journal):
    assert progress(journal, record()) == (0, 0)
    assert progress(journal, record(Checkpoint(version=3, seq_id=12, step=6))) == (6, 12)


def test_step_and_last_seq_id_follow_outcomes_and_count_what_a_replay_will_run(journal):
    rec = record(Checkpoint(version=2, seq_id=2, step=1))
    request(journal, 1, "forward_backward", {"metrics": {}})  # covered by the checkpoint
    request(journal, 2, "optim_step", step(1))
    request(journal, 3, "forward_backward", {"metrics": {}})
    request(journal, 4, "optim_step", step(2))
    assert progress(journal, rec) == (2, 4)
    request(journal, 5, "optim_step", step(2, skipped=True))  # non-finite gradients: no step
    assert progress(journal, rec) == (2, 5)
    request(journal, 6, "load_state", {"load_state_step": 7})
    assert progress(journal, rec) == (7, 6)
    request(journal, 7, "optim_step")  # journaled, its trainer died before it ran: the replay runs it
    assert progress(journal, rec) == (8, 7)
    request(journal, 8, "forward_backward")
    journal.append_outcomes([(NAME, 8, VOID, {})])  # failed transiently: the client sends seq_id 8 again
    assert progress(journal, rec) == (8, 7)
