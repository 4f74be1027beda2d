"""cross_entropy soft targets ((N, K) target_tokens / weights) in the megatron engine (megatron-core on CPU: gloo,
fp32, the CPU shims of tests/fixtures/megatron_cpu.py), run in a child process (``python
tests/e2e/test_megatron_soft_targets_cpu.py`` prints one JSON line) because it initializes torch.distributed.

The loss is linear in its K columns: a soft-target datum gives, column by column, the logprobs of the 1-D datum
whose targets and weights are that column, its per-position loss is the sum of theirs, and its gradient the sum of
theirs. The 1-D path is checked against the torch backend elsewhere (test_megatron_cpu.py); here a batch with
soft-target datums of two widths and a 1-D datum, fused, is checked against those 1-D datums (fp32: 1e-5, as the
other megatron CPU checks). Under TP = 2 (torchrun, 2 ranks: one vocab-parallel pass per target column) the soft
batch gives the logprobs and full gradients of one rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.e2e.test_megatron_cpu import run, torchrun

RANK = 4
SOFT = ((9, 4), (5, 2))  # (positions, K) of the soft-target datums
HARD = 6  # positions of the 1-D datum


def main(tp: int = 1, out: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    import tests.fixtures.megatron_cpu  # noqa: F401  (before the backend is used)
    from loraplane.lora import LoraSpec, init_lora_params
    from loraplane.models.base import _wrap
    from loraplane.models.tiny import build_tiny_tokenizer, build_tp_divisible_llama
    from trainer_svc.backends.base import BatchItem, DatumInput
    from trainer_svc.backends.megatron.backend import Driver, MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.backends.megatron.model import init_parallel
    from trainer_svc.pool import AdapterState

    init_parallel(tp)
    base = _wrap("soft-check", build_tp_divisible_llama(7), build_tiny_tokenizer(), torch.device("cpu"),
                 torch.float32)
    engine = Engine(base, device_slots=2, dtype=torch.float32)
    # Through the backend and its driver, as the trainer runs it: rank 0 sends each batch to the other ranks.
    driver = Driver(engine)
    if dist.is_initialized() and dist.get_rank() != 0:
        driver.follow()
        dist.barrier()
        dist.destroy_process_group()
        return
    backend = MegatronBackend(engine=engine, driver=driver)
    spec = LoraSpec.create(RANK, 8.0, [], seed=3)
    params = init_lora_params(base, spec)
    gen = torch.Generator().manual_seed(3)
    for key in sorted(params):
        params[key] = 0.05 * torch.randn(params[key].shape, generator=gen)

    def state(name):  # two adapters with the same weights: one trains the soft batch, one its columns
        p = {k: v.clone() for k, v in params.items()}
        return AdapterState(name, spec, "m", p, {k: torch.zeros_like(v) for k, v in p.items()},
                            {k: torch.zeros_like(v) for k, v in p.items()})

    def full_grads(name):
        (full,) = driver.call("gather", {"name": name, "rows": [1]})
        return torch.cat([full[k].reshape(-1) for k in sorted(full)])

    g = torch.Generator().manual_seed(5)
    soft = []
    for n, k in SOFT:
        inputs = torch.randint(0, base.vocab_size, (n,), generator=g)
        targets = torch.randint(0, base.vocab_size, (n, k), generator=g)
        targets[0, 1] = targets[0, 0]  # a repeated token: its two gradients add up
        weights = torch.softmax(torch.randn(n, k, generator=g), -1)
        weights[1:3, -1] = 0.0  # padding slots of a shorter top-K row
        soft.append(DatumInput(inputs, targets, weights))
    tokens = torch.randint(0, base.vocab_size, (HARD + 1,), generator=g)
    hard = DatumInput(tokens[:-1], tokens[1:], torch.rand(HARD, generator=g))
    batch = [soft[0], hard, soft[1]]
    # The same batch as 1-D datums: one per soft column, and the 1-D datum.
    columns = [DatumInput(d.input_tokens, d.target_tokens[:, j].contiguous(), d.weights[:, j].contiguous())
               for d in soft for j in range(d.target_tokens.shape[1])] + [hard]
    s_state, c_state = state("s"), state("c")
    (result,) = backend.run([BatchItem(s_state, batch, "cross_entropy", {})], backward=True)
    (flat,) = backend.run([BatchItem(c_state, columns, "cross_entropy", {})], backward=True)
    soft_grads, flat_grads = full_grads("s"), full_grads("c")

    outs = result.outputs
    report = {"shapes": [len(o.logprobs) for o in outs], "loss_lengths": [len(o.elementwise_loss) for o in outs],
              "per_position": [o.targets_per_position for o in outs]}
    lp_err = loss_err = 0.0
    c = 0
    for o, d in zip([outs[0], outs[2]], soft):
        lp = torch.tensor(o.logprobs).view(d.target_tokens.shape)
        loss = torch.tensor(o.elementwise_loss)
        summed = torch.zeros_like(loss)
        for j in range(d.target_tokens.shape[1]):
            lp_err = max(lp_err, float((lp[:, j] - torch.tensor(flat.outputs[c].logprobs)).abs().max()))
            summed += torch.tensor(flat.outputs[c].elementwise_loss)
            c += 1
        loss_err = max(loss_err, float((loss - summed).abs().max()))
    report["soft_vs_columns_logprob_max_abs"] = lp_err
    report["soft_vs_columns_loss_max_abs"] = loss_err
    report["hard_logprob_max_abs"] = max(abs(a - b) for a, b in zip(outs[1].logprobs, flat.outputs[-1].logprobs))
    report["loss_sum"] = result.metrics["loss:sum"]
    report["loss_sum_columns"] = flat.metrics["loss:sum"]
    report["grad_norm"] = float(soft_grads.norm())
    report["soft_vs_columns_grad_rel"] = float((soft_grads - flat_grads).norm() / flat_grads.norm())
    if out:
        torch.save({"logprobs": [o.logprobs for o in outs], "grads": soft_grads}, out)
    print(json.dumps(report))
    backend.close()  # releases the followers
    if dist.is_initialized():
        # A rank that exits while gloo's threads still run aborts, which failed a finished run under load.
        dist.barrier()
        dist.destroy_process_group()


def check(report: dict) -> None:
    assert report["shapes"] == [9 * 4, HARD, 5 * 2] and report["loss_lengths"] == [9, HARD, 5], report
    assert report["per_position"] == [4, 1, 2], report
    assert report["soft_vs_columns_logprob_max_abs"] <= 1e-5, report
    assert report["soft_vs_columns_loss_max_abs"] <= 1e-5, report
    assert report["hard_logprob_max_abs"] <= 1e-5, report
    assert abs(report["loss_sum"] - report["loss_sum_columns"]) <= 1e-4, report
    assert report["grad_norm"] > 0 and report["soft_vs_columns_grad_rel"] <= 1e-5, report


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("soft") / "one.pt"
    report = json.loads(run([sys.executable, str(Path(__file__).resolve()), "--out", str(out)]).splitlines()[-1])
    return report, out


def test_soft_targets_are_the_sum_of_their_columns(one_rank):
    check(one_rank[0])


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_soft_targets_on_two_ranks_equal_one_rank(one_rank, tmp_path, tp):
    """TP = 2: one vocab-parallel pass per target column; DP = 2: the datums split over the ranks and their
    (N * K)-long logprob rows summed back."""
    import torch

    two = tmp_path / "two.pt"
    report = json.loads(run(torchrun(2, str(Path(__file__).resolve()), "--tp", str(tp), "--out", str(two)),
                            timeout=280).splitlines()[-1])
    check(report)
    a, b = torch.load(one_rank[1]), torch.load(two)
    worst = max(abs(x - y) for p, q in zip(a["logprobs"], b["logprobs"], strict=True) for x, y in zip(p, q))
    assert worst <= 1e-5, worst
    assert float((a["grads"] - b["grads"]).norm() / a["grads"].norm()) <= 1e-5


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    main(args.tp, args.out)
