"""The interface every trainer backend implements. The service, scheduler, pool, losses and optimizer are shared;
everything that touches the base model's weights or the LoRA forward/backward lives behind this interface."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from loraplane.lora import LoraSpec, init_lora_params
from loraplane.models import BaseModel
from trainer_svc.optimizer import AdamHyper, StepOutcome, adamw_step
from trainer_svc.pool import AdapterState


@dataclass
class DatumInput:
    input_tokens: torch.Tensor  # int64 (N,)
    target_tokens: torch.Tensor  # int64 (N,), or (N, K) soft targets (cross_entropy only; K >= 2)
    weights: torch.Tensor | None = None  # float32, the shape of target_tokens
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.input_tokens.shape[0])

    @property
    def targets_per_position(self) -> int:
        return 1 if self.target_tokens.dim() == 1 else int(self.target_tokens.shape[1])


@dataclass
class BatchItem:
    """One request's share of a (possibly fused) batch: its adapter, its datums, its loss."""

    state: AdapterState
    data: list[DatumInput]
    loss_fn: str
    loss_config: dict[str, float]


@dataclass
class DatumResult:
    logprobs: list[float]  # N * K values, row-major [N, K]
    elementwise_loss: list[float]  # N values
    targets_per_position: int = 1


@dataclass
class ItemResult:
    outputs: list[DatumResult]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ModelDescription:
    name: str
    vocab_size: int
    max_context_length: int
    num_layers: int
    hidden_size: int
    module_dims: dict[str, tuple[int, int]]
    tokenizer_name: str
    eos_token_ids: list[int]
    bos_token_id: int
    pad_token_id: int
    chat_template: str

    @classmethod
    def of(cls, base) -> ModelDescription:
        """The description of a loaded `loraplane.models.BaseModel` (every backend serves one)."""
        return cls(
            name=base.name,
            vocab_size=base.vocab_size,
            max_context_length=base.max_context_length,
            num_layers=base.num_layers,
            hidden_size=base.hidden_size,
            module_dims=dict(base.module_dims),
            tokenizer_name=str(getattr(base.tokenizer, "name_or_path", "") or base.name),
            eos_token_ids=list(base.eos_token_ids),
            bos_token_id=base.bos_token_id,
            pad_token_id=base.pad_token_id,
            chat_template=base.chat_template,
        )


class TrainerBackend(ABC):
    """Every backend serves one `loraplane.models.BaseModel` (`self.base`): the HF model, tokenizer and dims that
    describe it, whatever runs the math (the HF model itself, or megatron built from its weights)."""

    name: str = "abstract"
    base: BaseModel
    # The most soft targets per position (DatumInput.target_tokens (N, K)) this backend computes.
    max_targets_per_position: int = 64

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @functools.cached_property
    def description(self) -> ModelDescription:
        return ModelDescription.of(self.base)

    def tokenizer_json(self) -> bytes:
        return self.base.tokenizer_json()

    def init_params(self, spec: LoraSpec) -> dict[str, torch.Tensor]:
        """Fresh PEFT-standard params (PEFT key -> fp32 tensor, on the host)."""
        return init_lora_params(self.base, spec)

    @abstractmethod
    def run(self, items: list[BatchItem], *, backward: bool) -> list[ItemResult]:
        """One fused forward (and backward, accumulating into each item's own adapter grads) over all items."""

    def optim_step(self, state: AdapterState, hyper: AdamHyper) -> StepOutcome:
        keys = list(state.params)
        return adamw_step([state.params[k] for k in keys], [state.exp_avg[k] for k in keys],
                          [state.exp_avg_sq[k] for k in keys], state.step, hyper)

    def export_params(self, state: AdapterState) -> dict[str, torch.Tensor]:
        """Host fp32 copies of the params in PEFT layout (device -> host, no disk)."""
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in state.params.items()}

    # -- adapters whose tensors the backend owns ------------------------------------------------------------------
    #
    # The service keeps every adapter in its AdapterPool. By default the pool's AdapterState tensors ARE the
    # adapter's (the torch backend trains them in place, the pool spills them to pinned host memory). A backend
    # that keeps the trained tensors itself (megatron: sharded flat device buffers, its own residency over its
    # device slots) says so with ``owns_adapter_tensors``: the pool then holds host bookkeeping only (names, spec,
    # step, the fresh params an adapter was created with) and the service reads and writes tensors, residency and
    # deletion through the methods below, whose defaults are right for a backend that does not own them.

    owns_adapter_tensors: bool = False

    def is_resident(self, name: str) -> bool | None:
        """Whether the adapter's tensors are on the device now; None: the service's pool knows."""
        return None

    def prefetch(self, name: str, protect: tuple[str, ...] = ()) -> None:
        """A hint (worker thread): the adapter is likely in the next batch; start bringing it to the device without
        evicting ``protect``."""
        return

    def delete_adapter(self, name: str) -> None:
        """Worker thread: the adapter is gone; drop whatever the backend holds of it."""
        return

    def export_training_state(self, state: AdapterState) -> tuple[dict, dict, dict, int]:
        """Host copies (training goes on while they are saved) of (params, exp_avg, exp_avg_sq, step)."""
        return (self.export_params(state),
                {k: v.detach().to("cpu", copy=True) for k, v in state.exp_avg.items()},
                {k: v.detach().to("cpu", copy=True) for k, v in state.exp_avg_sq.items()},
                state.step)

    def load_training_state(self, state: AdapterState, params, exp_avg, exp_avg_sq, step: int) -> None:
        """Worker thread, after the service installed these tensors and step in the pool's state (LoadState,
        recovery): a backend that owns the tensors takes them over."""
        return

    def close(self) -> None:
        return None
