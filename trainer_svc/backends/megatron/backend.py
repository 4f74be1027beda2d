"""The megatron trainer backend (rank 0's side): implements ``TrainerBackend`` over one :class:`Engine` per rank.

Rank 0 runs the gRPC service, the scheduler and this backend. Every engine call goes through :class:`Driver`:
rank 0 broadcasts the work item (a JSON header plus any tensors) on a gloo control group, then every rank runs
the same engine method on its shard. With one process the driver calls the engine directly.

The adapter tensors live in the engine's pool (sharded flat buffers, GPU slots + pinned host copies), not in the
shared ``AdapterPool``'s ``AdapterState.params``: the backend installs an adapter into the engine the first time it
sees its state (from ``state.params``), and afterwards reads and writes it only through the engine
(``export_params``, ``export_training_state``, ``load_training_state``).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from loraplane.lora import LoraSpec
from loraplane.models import BaseModel, load_base_model
from trainer_svc.backends.base import BatchItem, DatumResult, ItemResult, TrainerBackend
from trainer_svc.optimizer import AdamHyper, StepOutcome

from .engine import DatumWork, Engine

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)  # follower ranks wait for work indefinitely


def _spec_json(spec: LoraSpec) -> dict:
    return {"rank": spec.rank, "alpha": spec.effective_alpha, "targets": list(spec.target_modules), "seed": spec.seed,
            "expert_layout": spec.expert_layout}


def _spec_from(d: dict) -> LoraSpec:
    return LoraSpec(rank=int(d["rank"]), alpha=float(d["alpha"]), target_modules=tuple(d["targets"]),
                    seed=int(d["seed"]), expert_layout=d["expert_layout"])


class Driver:
    """Runs engine operations on every rank in lockstep. Rank 0 calls :meth:`call`; the others :meth:`follow`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if self.world > 1 else None

    # -- wire ---------------------------------------------------------------------------------------------------

    def _send(self, header: dict, tensors: list[torch.Tensor]) -> None:
        payload = json.dumps(header).encode()
        head = torch.tensor([len(payload), len(tensors)], dtype=torch.int64)
        dist.broadcast(head, src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)
        for t in tensors:
            meta = torch.tensor(list(t.shape) + [-1] * (4 - t.dim()), dtype=torch.int64)
            dist.broadcast(meta, src=0, group=self.group)
            dist.broadcast(t.detach().to("cpu", torch.float32).contiguous(), src=0, group=self.group)

    def _receive(self) -> tuple[dict, list[torch.Tensor]]:
        head = torch.empty(2, dtype=torch.int64)
        dist.broadcast(head, src=0, group=self.group)
        buf = torch.empty(int(head[0]), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        header = json.loads(bytes(buf.numpy()))
        tensors = []
        for _ in range(int(head[1])):
            meta = torch.empty(4, dtype=torch.int64)
            dist.broadcast(meta, src=0, group=self.group)
            t = torch.empty([int(x) for x in meta if x >= 0], dtype=torch.float32)
            dist.broadcast(t, src=0, group=self.group)
            tensors.append(t)
        return header, tensors

    # -- ops ----------------------------------------------------------------------------------------------------

    def call(self, op: str, args: dict, tensors: list[torch.Tensor] | None = None):
        tensors = tensors or []
        if self.world > 1:
            self._send({"op": op, "args": args}, tensors)
        return self._execute(op, args, tensors)

    def follow(self) -> None:
        """Follower ranks: execute work items until rank 0 sends ``shutdown``."""
        while True:
            header, tensors = self._receive()
            if header["op"] == "shutdown":
                return
            try:
                self._execute(header["op"], header["args"], tensors)
            except Exception:  # rank 0 hits the same error and reports it; this rank stays in step
                log.debug("engine op %s failed on rank %d", header["op"], self.rank, exc_info=True)

    def shutdown(self) -> None:
        if self.world > 1 and self.rank == 0:
            self._send({"op": "shutdown", "args": {}}, [])

    def _execute(self, op: str, args: dict, tensors: list[torch.Tensor]):
        e = self.engine
        if op == "create":
            return e.create(args["name"], _spec_from(args["spec"]))
        if op == "install":
            keys = args["keys"]
            n = len(keys)
            params = dict(zip(keys, tensors[:n]))
            m = dict(zip(keys, tensors[n : 2 * n])) if args["with_moments"] else None
            v = dict(zip(keys, tensors[2 * n : 3 * n])) if args["with_moments"] else None
            return e.load_state(args["name"], params, m, v, int(args["step"]), _spec_from(args["spec"]))
        if op == "delete":
            return e.delete(args["name"])
        if op == "prefetch":
            return e.prefetch(args["name"], tuple(args.get("protect", ())))
        if op == "activate":
            return e.activate(list(args["names"]))
        if op == "run":
            datums = [DatumWork(**d) for d in args["datums"]]
            routes = [tuple(r) for r in args["routes"]]
            return e.run_batch(datums, "", {}, bool(args["backward"]), routes=routes)
        if op == "optim_step":
            return e.optim_step(args["name"], AdamHyper(**args["hyper"]))
        if op == "gather":
            return e.gather_full(args["name"], tuple(args["rows"]))
        raise ValueError(f"unknown engine op {op!r}")


class MegatronBackend(TrainerBackend):
    name = "megatron"
    # The adapters' tensors live in the engine's sharded pool: the shared service keeps host bookkeeping only and
    # goes through export/load_training_state, is_resident, prefetch and delete_adapter (base.TrainerBackend).
    owns_adapter_tensors = True

    def __init__(self, base_model: str | BaseModel = "smollm2-135m-instruct", *, tensor_parallel_size: int = 1,
                 expert_parallel_size: int | None = None, device_slots: int = 8, dtype: torch.dtype = torch.bfloat16,
                 lora_compute_dtype: torch.dtype | None = None, attention: str = "sdpa", recompute: str = "auto",
                 expert_lora_slots: int = 8, device_memory_bytes: int | None = None,
                 plan_tokens_per_gpu: int | None = None, engine: Engine | None = None, driver: Driver | None = None):
        """``expert_parallel_size`` None: chosen from the model and the GPUs (:mod:`.parallel_plan`: replicas where
        the model fits one GPU, else the smallest EP that fits), planning for GPUs of ``device_memory_bytes`` each
        (default: the CUDA device's memory) and backward passes of ``plan_tokens_per_gpu`` tokens per GPU (default
        8 x 2048)."""
        if engine is None:
            import os

            from .model import init_parallel
            from .parallel_plan import planned_expert_parallel

            # The HF model only feeds the weight conversion (and the tokenizer/description); keep it on the host.
            base = base_model if isinstance(base_model, BaseModel) else load_base_model(
                base_model, device="cpu", dtype=torch.float32, backend="megatron")
            if expert_parallel_size is None:
                world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
                expert_parallel_size = planned_expert_parallel(
                    base.model.config, world, tensor_parallel_size, dtype_bytes=torch.finfo(dtype).bits // 8,
                    device_slots=device_slots, expert_lora_slots=expert_lora_slots,
                    device_memory_bytes=device_memory_bytes, tokens_per_gpu=plan_tokens_per_gpu)
            init_parallel(tensor_parallel_size, expert_parallel_size=expert_parallel_size)
            engine = Engine(base, device_slots=device_slots, dtype=dtype, lora_compute_dtype=lora_compute_dtype,
                            attention=attention, recompute=recompute, expert_lora_slots=expert_lora_slots)
        self.engine = engine
        self.base = engine.base
        self.driver = driver or Driver(engine)
        self._lock = threading.Lock()
        # name -> the AdapterState object the engine's copy was installed from (a re-created adapter is new). A weak
        # reference, not id(): a new state can reuse a dead one's id and would then skip its install, keeping the
        # old slot's weights and gradients.
        self._installed: dict[str, weakref.ref] = {}

    # -- TrainerBackend -----------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def run(self, items: list[BatchItem], *, backward: bool) -> list[ItemResult]:
        with self._lock:
            for item in items:
                self._ensure(item.state)
            datums, routes = [], []
            for item in items:
                for d in item.data:
                    datums.append({
                        "adapter": item.state.name,
                        "input_tokens": d.input_tokens.tolist(),
                        "target_tokens": d.target_tokens.reshape(-1).tolist(),
                        "weights": None if d.weights is None else d.weights.reshape(-1).tolist(),
                        "targets_per_position": d.targets_per_position,
                        "logprobs": None if d.logprobs is None else d.logprobs.tolist(),
                        "advantages": None if d.advantages is None else d.advantages.tolist(),
                    })
                    routes.append([item.state.name, item.loss_fn, dict(item.loss_config)])
            result = self.driver.call("run", {"datums": datums, "routes": routes, "backward": backward})
        out, cursor = [], 0
        for item in items:
            outputs = []
            loss_sum, tokens = 0.0, 0
            for d in item.data:
                lp, el = result.logprobs[cursor], result.elementwise_loss[cursor]
                outputs.append(DatumResult(lp, el, d.targets_per_position))
                loss_sum += float(sum(el))
                tokens += d.length
                cursor += 1
            out.append(ItemResult(outputs, {"loss:sum": loss_sum, "num_tokens:sum": float(tokens),
                                            "num_datums:sum": float(len(item.data))}))
        return out

    def optim_step(self, state, hyper: AdamHyper) -> StepOutcome:
        with self._lock:
            self._ensure(state)
            outcome = self.driver.call("optim_step", {"name": state.name, "hyper": hyper.__dict__})
        return outcome

    def export_params(self, state) -> dict[str, torch.Tensor]:
        with self._lock:
            self._ensure(state)
            (params,) = self.driver.call("gather", {"name": state.name, "rows": [0]})
        return params

    # -- what the shared pool cannot do for this backend (see docs/megatron.md) ---------------------------------

    def export_training_state(self, state) -> tuple[dict, dict, dict, int]:
        """(params, exp_avg, exp_avg_sq, step) as full PEFT-keyed host tensors."""
        with self._lock:
            self._ensure(state)
            params, m, v = self.driver.call("gather", {"name": state.name, "rows": [0, 2, 3]})
            step = self.engine.slot(state.name).step
        return params, m, v, step

    def load_training_state(self, state, params, exp_avg=None, exp_avg_sq=None, step: int = 0) -> None:
        with self._lock:
            self._install(state, params, exp_avg, exp_avg_sq, step)

    def delete_adapter(self, name: str) -> None:
        with self._lock:
            self._installed.pop(name, None)
            self.driver.call("delete", {"name": name})

    def prefetch(self, name: str, protect: tuple[str, ...] = ()) -> None:
        """Starts the async host→device copy of a queued adapter (the scheduler calls this for the next one)."""
        with self._lock:
            if name in self.engine.slots:
                self.driver.call("prefetch", {"name": name, "protect": list(protect)})

    def is_resident(self, name: str) -> bool:
        return self.engine.is_resident(name)

    def activation_seconds(self, name: str) -> float:
        """Times one activation (benchmark use; single process)."""
        with self._lock:
            return self.engine.time_activation(name)

    def close(self) -> None:
        self.driver.shutdown()

    # -- installing adapters ----------------------------------------------------------------------------------------

    def _ensure(self, state) -> None:
        installed = self._installed.get(state.name)
        if installed is not None and installed() is state and state.name in self.engine.slots:
            return
        self._install(state, state.params, state.exp_avg or None, state.exp_avg_sq or None, state.step)

    def _install(self, state, params, exp_avg, exp_avg_sq, step) -> None:
        keys = list(params)
        with_moments = exp_avg is not None and exp_avg_sq is not None
        tensors = [params[k] for k in keys]
        if with_moments:
            tensors += [exp_avg[k] for k in keys] + [exp_avg_sq[k] for k in keys]
        self.driver.call("install", {"name": state.name, "keys": keys, "with_moments": with_moments,
                                     "step": int(step), "spec": _spec_json(state.spec)},
                         [t.detach().to("cpu", torch.float32) for t in tensors])
        self._installed[state.name] = weakref.ref(state)
