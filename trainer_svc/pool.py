"""Adapter pool: every adapter's fp32 LoRA params, grads, AdamW moments and step.

K adapters are resident "on the device" (their tensors live there); the rest are spilled to host memory (pinned when
the device is CUDA) and brought back on demand, evicting the least recently used resident adapter. Activating a
resident adapter copies nothing. Only the scheduler's worker thread touches the pool's tensors.

Residency is bounded by a slot count and, optionally, by device bytes: an expert adapter is large (Qwen3-30B-A3B
rank 32 per expert: ~20 GB of fp32 params, grads and AdamW moments) and adapters of different ranks, targets and
expert layouts differ by orders of magnitude, so a byte budget sized from each tenant's measured tensors is what
says how many fit (docs/architecture.md, "Expert adapters").
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from loraplane.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from loraplane.lora import AdapterTensors, LoraSpec


@dataclass
class AdapterState:
    name: str
    spec: LoraSpec
    base_model: str
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int = 0
    last_seq_id: int = 0
    resident: bool = False
    created: float = field(default_factory=time.time)
    metadata: dict[str, str] = field(default_factory=dict)
    # Reused host memory for spills (pinned on CUDA), created at the first spill.
    host_buffers: dict[str, dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    @property
    def parameter_count(self) -> int:
        return sum(t.numel() for t in self.params.values())

    def tensors(self) -> AdapterTensors:
        return AdapterTensors.from_params(self.params, self.spec, name=self.name)

    def param_list(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params.values())

    @property
    def device_bytes(self) -> int:
        """Measured bytes this adapter holds while resident and training: its params, their gradients (allocated
        by the first backward, counted whether or not they exist yet) and both AdamW moments."""
        return sum(t.numel() * t.element_size() for group in (self.params, self.params, self.exp_avg,
                                                              self.exp_avg_sq) for t in group.values())


class Residency:
    """Which adapters hold the device's slots, least recently used first, and which of them to spill to make room:
    the one residency policy of the trainer. The shared :class:`AdapterPool` (per-tensor adapters) and the megatron
    engine's pool (one flat sharded buffer per adapter, copied asynchronously) both keep their adapters' residency
    here and move their own tensors (``spill`` callbacks).

    Room means fewer than ``slots`` residents and, with a ``memory_bytes`` budget, ``size_of`` (an adapter's device
    bytes) of the residents plus the newcomer within it. Counters: ``activations`` (adapters a batch asked for),
    ``misses`` (of them, not resident), ``prefetches`` (copies started ahead of the batch)."""

    def __init__(self, slots: int, memory_bytes: int = 0, size_of: Callable[[str], int] | None = None):
        self.slots = slots
        self.memory_bytes = memory_bytes
        self._size_of = size_of or (lambda _name: 0)
        self._order: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.activations = 0
        self.misses = 0
        self.prefetches = 0

    def __contains__(self, name: str) -> bool:
        return name in self._order

    def __len__(self) -> int:
        return len(self._order)

    def names(self) -> list[str]:
        """The residents, least recently used first."""
        return list(self._order)

    @property
    def bytes(self) -> int:
        return sum(self._size_of(n) for n in self._order)

    def check_batch(self, unique: int) -> None:
        """A batch of ``unique`` adapters needs them all resident at once."""
        if unique > self.slots:
            raise InvalidArgument(f"{unique} adapters in one batch exceed {self.slots} device slots", field="batch")

    def used(self, name: str) -> None:
        """``name`` (resident) is the most recently used."""
        self._order.move_to_end(name)

    def make_room(self, name: str, protect: Iterable[str], spill: Callable[[str], None]) -> None:
        """Spills least recently used residents, never one in ``protect``, until ``name`` fits; ``spill(victim)``
        copies the victim back to host memory and calls :meth:`remove`."""
        protect = set(protect)
        while len(self._order) >= self.slots or (
                self.memory_bytes and self.bytes + self._size_of(name) > self.memory_bytes):
            victim = next((n for n in self._order if n not in protect), None)
            if victim is None:
                raise InvalidArgument(f"all {self.slots} device slots are held by the batch", field="batch")
            spill(victim)

    def add(self, name: str) -> None:
        """``name`` now holds a device slot (the most recently used)."""
        self._order[name] = None

    def remove(self, name: str) -> None:
        self._order.pop(name, None)


def slots_for_budget(per_tenant_bytes: int, budget_bytes: int) -> int:
    """How many adapters of `per_tenant_bytes` fit in `budget_bytes` of device memory (at least 0)."""
    return max(0, budget_bytes // max(1, per_tenant_bytes))


class AdapterPool:
    def __init__(self, device: torch.device, device_slots: int, max_adapters: int = 1024,
                 device_memory_bytes: int = 0):
        if device_slots < 1:
            raise InvalidArgument(f"device_slots must be >= 1, got {device_slots}", field="device_slots")
        if device_memory_bytes < 0:
            raise InvalidArgument(f"device_memory_bytes must be >= 0, got {device_memory_bytes}",
                                  field="device_memory_bytes")
        self.device = torch.device(device)
        # 0 = slots only; else resident adapters' measured bytes (AdapterState.device_bytes) stay within it.
        self.max_adapters = max_adapters
        self._adapters: dict[str, AdapterState] = {}
        self._residency = Residency(device_slots, device_memory_bytes, lambda n: self._adapters[n].device_bytes)
        # The worker thread mutates the adapter table; the event loop reads it (ListAdapters, existence checks).
        self._table_lock = threading.Lock()

    @property
    def device_slots(self) -> int:
        return self._residency.slots

    @property
    def device_memory_bytes(self) -> int:
        return self._residency.memory_bytes

    @property
    def activations(self) -> int:
        return self._residency.activations

    @property
    def misses(self) -> int:
        return self._residency.misses

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def names(self) -> list[str]:
        with self._table_lock:
            return sorted(self._adapters)

    def get(self, name: str) -> AdapterState:
        with self._table_lock:
            state = self._adapters.get(name)
        if state is None:
            raise NotFound(f"adapter {name!r} does not exist on this trainer", field="adapter")
        return state

    def add(self, state: AdapterState) -> None:
        if state.name in self._adapters:
            raise AlreadyExists(f"adapter {state.name!r} already exists on this trainer", field="name")
        if len(self._adapters) >= self.max_adapters:
            raise ResourceExhausted(f"trainer holds the maximum of {self.max_adapters} adapters", field="name")
        host = self._host_copy_all(state)
        with self._table_lock:
            self._adapters[state.name] = host

    def remove(self, name: str) -> AdapterState:
        state = self.get(name)
        with self._table_lock:
            del self._adapters[name]
        self._residency.remove(name)
        return state

    def activate(self, names: list[str]) -> list[AdapterState]:
        """Makes these adapters resident (all at once: a fused batch needs every one of them) and returns them."""
        residency = self._residency
        residency.check_batch(len(set(names)))
        states = [self.get(n) for n in names]
        if self.device_memory_bytes:
            need = sum({s.name: s.device_bytes for s in states}.values())
            if need > self.device_memory_bytes:
                raise ResourceExhausted(
                    f"the {len(set(names))} adapters of this batch need {need} bytes of device memory; the trainer's "
                    f"adapter budget is {self.device_memory_bytes}", field="batch")
        for state in states:
            residency.activations += 1
            if state.resident:
                residency.used(state.name)
                continue
            residency.misses += 1
            residency.make_room(state.name, names, lambda victim: self._spill(self._adapters[victim]))
            self._load(state)
        return states

    @property
    def resident_bytes(self) -> int:
        return self._residency.bytes

    def replace_tensors(self, state: AdapterState, params, exp_avg, exp_avg_sq) -> None:
        """Swaps in new tensors (LoadState) wherever the adapter lives now."""
        target = self.device if state.resident else torch.device("cpu")
        pin = self._pin and not state.resident
        # Keep the adapter's canonical key order (a parsed blob comes back sorted): the global grad norm is
        # reduced in this order, so a reordering would change its last bits.
        order = list(state.params)
        state.params = {k: _leaf(_to(params[k], target, pin)) for k in order}
        state.exp_avg = {k: _to(exp_avg[k], target, pin) for k in order}
        state.exp_avg_sq = {k: _to(exp_avg_sq[k], target, pin) for k in order}

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    def _host_copy_all(self, state: AdapterState) -> AdapterState:
        state.params = {k: _leaf(_to(v, torch.device("cpu"), self._pin)) for k, v in state.params.items()}
        state.exp_avg = {k: _to(v, torch.device("cpu"), self._pin) for k, v in state.exp_avg.items()}
        state.exp_avg_sq = {k: _to(v, torch.device("cpu"), self._pin) for k, v in state.exp_avg_sq.items()}
        state.resident = False
        return state

    def _load(self, state: AdapterState) -> None:
        state.params = {k: _leaf(_to(v, self.device, False), grad=v.grad) for k, v in state.params.items()}
        state.exp_avg = {k: _to(v, self.device, False) for k, v in state.exp_avg.items()}
        state.exp_avg_sq = {k: _to(v, self.device, False) for k, v in state.exp_avg_sq.items()}
        state.resident = True
        self._residency.add(state.name)

    def _spill(self, state: AdapterState) -> None:
        # Copy into the adapter's own host buffers, allocated once: pinned allocations (cudaHostAlloc) cost far
        # more than the copy itself, so a spill must not allocate them every time.
        buffers = state.host_buffers
        if buffers is None or set(buffers["params"]) != set(state.params):
            buffers = state.host_buffers = {
                "params": {k: _to(v, torch.device("cpu"), self._pin) for k, v in state.params.items()},
                "exp_avg": {k: _to(v, torch.device("cpu"), self._pin) for k, v in state.exp_avg.items()},
                "exp_avg_sq": {k: _to(v, torch.device("cpu"), self._pin) for k, v in state.exp_avg_sq.items()},
            }
        else:
            with torch.no_grad():
                for group in ("params", "exp_avg", "exp_avg_sq"):
                    for key, tensor in getattr(state, group).items():
                        buffers[group][key].copy_(tensor.detach())
        state.params = {k: _leaf(buffers["params"][k], grad=v.grad) for k, v in state.params.items()}
        state.exp_avg = dict(buffers["exp_avg"])
        state.exp_avg_sq = dict(buffers["exp_avg_sq"])
        state.resident = False
        self._residency.remove(state.name)


def _to(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A fresh copy on `device` (a spilled and a resident copy never alias, also when both are CPU memory)."""
    data = tensor.detach()
    if device.type == "cpu":
        out = torch.empty(data.shape, dtype=torch.float32, pin_memory=pin)
        out.copy_(data, non_blocking=False)
        return out
    return data.to(device=device, dtype=torch.float32, non_blocking=True, copy=True)


def _leaf(tensor: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    tensor.requires_grad_(True)
    tensor.grad = None if grad is None else grad.detach().to(tensor.device, copy=True)
    return tensor
