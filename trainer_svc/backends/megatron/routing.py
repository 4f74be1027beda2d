"""What the dense LoRA hooks (:mod:`.lora`), the expert LoRA (:mod:`.expert_lora`) and the MoE layer (:mod:`.moe`)
share, below all three: an adapter's stored tensor classes on this rank, the token rows a batch routes to each
adapter, and the routing in force on this thread.

The routing in force is whatever :meth:`.lora.MegatronLora.route` installed: the hooks and the experts only read
its ``active``/``anchor`` and its ``experts`` (the batch's :class:`.expert_lora.ExpertBatch`, or None), so the MoE
layer never imports the dense LoRA.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraClass:
    """One stored tensor class: ``[num_layers, len(targets), rank, dim]`` per adapter and rank."""

    name: str
    hook: str
    targets: tuple[str, ...]
    which: str  # "A" (rows = rank, cols = in features) or "B" (stored as B^T: rows = rank, cols = out features)
    dim: int  # this rank's share of the feature dimension
    sharded: bool  # differs between TP ranks (counted once per rank in the global gradient norm)
    # Expert classes (Qwen3-MoE): one [L_moe, G, r, dim] block over the MoE layers only, G = this rank's experts
    # (ep_sharded: a different block of experts on every EP rank) or 1 (a factor the layer's experts share).
    layers: int = 0  # 0: every decoder layer
    groups: int = 0  # 0: len(targets)
    ep_sharded: bool = False
    expert: bool = False

    def block_shape(self, num_layers: int, rank: int) -> tuple[int, int, int, int]:
        return (self.layers or num_layers, self.groups or len(self.targets), rank, self.dim)


@dataclass(eq=False)
class AdapterTensors:
    """One resident adapter on this rank: per class, its params and grads ``[L, G, r, dim]`` (views of its
    buffer), its rank and scale; ``experts``: its expert layout when it trains the routed experts."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    rank: int
    scale: float
    experts: str | None = None


@dataclass(frozen=True)
class RowSegment:
    """Token rows ``[start, end)`` of the flattened batch, routed to ``adapter`` (None: no adapter)."""

    start: int
    end: int
    adapter: AdapterTensors | None


_local = threading.local()  # the active routing, per thread


def current():
    """The routing in force on this thread (what the hooks and the experts will use), or None."""
    return getattr(_local, "routing", None)


@contextlib.contextmanager
def using(routing) -> Iterator[None]:
    """Puts ``routing`` in force on this thread for the duration (None: no adapter)."""
    previous = getattr(_local, "routing", None)
    _local.routing = routing
    try:
        yield
    finally:
        _local.routing = previous
