"""The megatron backend runs behind the one shared :class:`trainer_svc.service.TrainerService`.

It used to need a subclass that sent tensor reads and writes, residency, prefetch and deletion to the backend; those
six overrides are now the backend interface (``TrainerBackend.owns_adapter_tensors`` and the methods after it,
trainer_svc/backends/base.py), which every backend implements. The name stays for code that imports it.
"""

from __future__ import annotations

from trainer_svc.service import TrainerService

MegatronTrainerService = TrainerService

__all__ = ["MegatronTrainerService"]
