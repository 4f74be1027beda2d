"""Multi-rank check of the backend's Driver (rank 0 drives, the others follow) under torchrun.

    torchrun --nproc-per-node N scripts/gpu/driver_check.py --tp T --out result.json

Rank 0 runs the backend API (run with backward, optim_step, export, training-state export/import, prefetch,
delete) on a seeded tiny Llama (2 KV heads, vocabulary 256); the other ranks follow the broadcast work items.
Comparing the JSON of (N=1, T=1), (N=2, T=2) and (N=2, T=1: data parallel) checks TP and DP end to end.
On CPU, add --cpu-dev (gloo; the shims of tests/fixtures/megatron_cpu.py).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-dev", action="store_true")
    args = ap.parse_args()
    if args.cpu_dev:
        sys.path.insert(0, ".")
        import tests.fixtures.megatron_cpu  # noqa: F401

    from loraplane.lora import LoraSpec, init_lora_params
    from loraplane.models.base import _wrap
    from loraplane.models.tiny import build_tiny_tokenizer, build_tp_divisible_llama
    from trainer_svc.backends.base import BatchItem, DatumInput
    from trainer_svc.backends.megatron import model as megatron_model
    from trainer_svc.backends.megatron.backend import Driver, MegatronBackend
    from trainer_svc.backends.megatron.engine import Engine
    from trainer_svc.optimizer import AdamHyper
    from trainer_svc.pool import AdapterState

    torch.backends.cuda.matmul.allow_tf32 = False
    megatron_model.init_parallel(args.tp)
    base = _wrap("driver-check", build_tp_divisible_llama(7), build_tiny_tokenizer(), torch.device("cpu"),
                 torch.float32)
    engine = Engine(base, device_slots=2, dtype=torch.float32)
    driver = Driver(engine)
    if dist.get_rank() != 0:
        driver.follow()
    else:
        backend = MegatronBackend(engine=engine, driver=driver)
        specs = {"a": LoraSpec.create(4, 8.0, [], seed=1), "b": LoraSpec.create(2, 4.0, ["q_proj", "down_proj"], 2),
                 "z": LoraSpec.create(4, 4.0, [], seed=3)}
        states = {}
        for n, spec in specs.items():
            p = init_lora_params(base, spec)
            states[n] = AdapterState(n, spec, "m", p, {k: torch.zeros_like(v) for k, v in p.items()},
                                     {k: torch.zeros_like(v) for k, v in p.items()})
        g = torch.Generator().manual_seed(3)

        def data(k):
            out = []
            for n in range(k):
                t = torch.randint(0, 256, (10 + 3 * n,), generator=g)
                out.append(DatumInput(t[:-1].clone(), t[1:].clone()))
            return out

        hyper = AdamHyper(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5)
        norms = []
        for _ in range(2):  # three adapters on two slots: the pool spills (with un-stepped grads)
            backend.run([BatchItem(states["a"], data(3), "cross_entropy", {}),
                         BatchItem(states["b"], data(2), "cross_entropy", {})], backward=True)
            # Two backward batches before one step: gradients accumulate (and, under DP, are reduced once).
            backend.run([BatchItem(states["z"], data(2), "cross_entropy", {})], backward=True)
            backend.run([BatchItem(states["z"], data(1), "cross_entropy", {})], backward=True)
            norms += [backend.optim_step(states[n], hyper).grad_norm for n in ("a", "b", "z")]
        try:  # a failing op (3 adapters > 2 slots) must leave every rank in step
            backend.run([BatchItem(states[n], data(1), "cross_entropy", {}) for n in ("a", "b", "z")],
                        backward=False)
            raise AssertionError("expected InvalidArgument")
        except Exception as exc:  # noqa: BLE001
            assert "device slots" in str(exc), exc
        backend.prefetch("b")
        params, m, v, step = backend.export_training_state(states["a"])
        copy = AdapterState("c", specs["a"], "m", {}, {}, {})
        backend.load_training_state(copy, params, m, v, step)
        (res,) = backend.run([BatchItem(copy, data(2), "cross_entropy", {})], backward=False)
        exported = backend.export_params(states["b"])
        backend.delete_adapter("c")
        with open(args.out, "w") as f:
            json.dump({"norms": norms, "step": step, "logprobs": [x for o in res.outputs for x in o.logprobs],
                       "b_params": torch.cat([exported[k].reshape(-1) for k in sorted(exported)]).tolist(),
                       "gone": "c" not in engine.slots}, f)
        backend.close()  # releases the followers
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
