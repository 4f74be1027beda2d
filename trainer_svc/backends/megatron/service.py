"""TrainerService for the megatron backend: the shared service, scheduler and servicer, with the adapter tensors
owned by the backend's engine (sharded flat buffers) instead of the shared ``AdapterPool``.

The shared pool is kept for bookkeeping (names, spec, step, the fresh params it was created with) on the host with
no spilling; everything that reads or writes trained tensors goes through the backend. These overrides are the
interface the shared service needs from a backend that owns its tensors (docs/megatron.md).
"""

from __future__ import annotations

import logging

import torch

from loraplane.adapter_format import TrainingState
from trainer_svc.pool import AdapterPool, AdapterState
from trainer_svc.service import AdapterInfo, TrainerService

from .backend import MegatronBackend

log = logging.getLogger(__name__)


class MegatronTrainerService(TrainerService):
    backend: MegatronBackend

    def __init__(self, backend: MegatronBackend, registry, limits=None, journal=None):
        super().__init__(backend, registry, limits, journal)
        # Host-only bookkeeping; device residency is the engine's (its own LRU over device_slots).
        self.pool = AdapterPool(torch.device("cpu"), self.limits.max_adapters, self.limits.max_adapters)

    def _execute(self, jobs: list) -> list:
        self._prefetch_next({job.adapter for job in jobs})
        return super()._execute(jobs)

    def _prefetch_next(self, current: set[str]) -> None:
        """Starts the host→device copy of the adapter the scheduler will most likely run next, so it overlaps
        with this batch."""
        following = self.scheduler.peek_next(exclude=current)
        if following is not None and not self.backend.is_resident(following):
            try:
                self.backend.prefetch(following, protect=tuple(current))
            except Exception:  # a prefetch is only a hint; the batch activates what it needs
                log.debug("prefetch of %s skipped", following, exc_info=True)

    def _info(self, state: AdapterState) -> AdapterInfo:
        info = super()._info(state)
        info.resident = self.backend.is_resident(state.name)
        return info

    async def delete_adapter(self, name: str, delete_from_registry: bool = False) -> None:
        local = name in self.pool
        await super().delete_adapter(name, delete_from_registry)
        if local:
            await self._on_worker(lambda: self.backend.delete_adapter(name))

    def _training_state(self, state: AdapterState) -> TrainingState:
        params, exp_avg, exp_avg_sq, step = self.backend.export_training_state(state)
        return TrainingState(params=params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step, spec=state.spec,
                             base_model_name=state.base_model)

    def _install(self, state: AdapterState, params, exp_avg, exp_avg_sq, step: int) -> None:
        super()._install(state, params, exp_avg, exp_avg_sq, step)
        self.backend.load_training_state(state, state.params, state.exp_avg, state.exp_avg_sq, state.step)
