"""A trainer as one member of a fleet: several trainer processes serving one base model, each adapter on one of them.

The member heartbeats its load into Redis (trainer_svc/fleet_store.py), places the adapters created through it by
the pure policy in loraplane/fleet.py, serves only the adapters whose placement names it with the epoch it took them
under (its journal writes are fenced by that placement), and every `interval_s`:
  * gives up the adapters whose placement moved away (it was presumed dead, or a drain moved them),
  * when it is draining, moves each of its adapters to the trainer the policy picks (the moves fence it at once;
    the new owner replays the journal, which holds every request this trainer acknowledged),
  * takes over the adapters of members whose heartbeat expired (each live member computes the same assignment from
    its snapshot and claims only its share, by compare-and-set), and
  * adopts what was placed on it: exactly the recovery of a restarted trainer (checkpoint + journal replay), so the
    adapter continues bit for bit and a client's retry of an acknowledged seq_id is answered from the journal.
Requests for an adapter it does not serve are answered UNAVAILABLE with reason ADAPTER_MOVED (loraplane.fleet);
the client asks any trainer where the adapter lives (ResolveAdapter) and retries the same seq_id there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplane.auth import Identity
from loraplane.errors import LoraplaneError, NotFound, Unavailable, shown
from loraplane.fleet import assign, choose_trainer, moved
from loraplane.lora import LoraSpec, expected_shapes
from trainer_svc.fleet_store import FleetStore, MemberInfo, Placement
from trainer_svc.journal import OUTCOME, REQUEST, VOID, AdapterRecord, JournalEntry, decode, outcome_from_plain
from trainer_svc.optimizer import StepOutcome
from trainer_svc.service import AdapterInfo
from trainer_svc.validation import validate_page

log = logging.getLogger(__name__)

# Bytes of trainer state per LoRA parameter: fp32 params, grads and the two AdamW moments.
STATE_BYTES_PER_PARAM = 16


def adapter_bytes(description, spec: LoraSpec) -> int:
    shapes = expected_shapes(description, spec)
    return STATE_BYTES_PER_PARAM * sum(a * b for a, b in shapes.values())


@dataclass
class ListingPage:
    """One page of the fleet's adapters as a caller may see them, in name order, split by who can describe each:
    this trainer (it serves them), another live member (by its address), or nobody right now (its trainer died or
    it is moving: described from the journal, as the next owner will restore it)."""

    names: list[str]
    here: list[str] = field(default_factory=list)
    elsewhere: dict[str, list[str]] = field(default_factory=dict)
    in_transit: list[str] = field(default_factory=list)
    next_token: str = ""


def journal_progress(record: AdapterRecord, entries: Sequence[JournalEntry]) -> tuple[int, int]:
    """(step, last seq_id) the adapter has once its journal is replayed on its checkpoint: what a restore yields.
    Every journaled request counts (a replay runs those without an outcome); an OptimStep without an outcome counts
    as one step, the one thing a replay could still skip (non-finite gradients)."""
    checkpoint = record.checkpoint
    step = checkpoint.step if checkpoint is not None else 0
    last_seq = covered = checkpoint.seq_id if checkpoint is not None else 0
    for entry in entries:
        if entry.seq_id <= covered:
            continue
        last_seq = max(last_seq, entry.seq_id)
        outcome = entry.outcome if entry.has_outcome else None
        if isinstance(outcome, dict) and "load_state_step" in outcome:
            step = int(outcome["load_state_step"])
        elif entry.kind == "optim_step":
            if outcome is None:
                step += 1
            else:
                decoded = outcome_from_plain(outcome)
                if isinstance(decoded, StepOutcome):
                    step = decoded.step
    return step, last_seq


# The request kinds whose outcome moves the step; no other entry's body needs decoding to describe an adapter.
_STEP_KINDS = frozenset({"optim_step", "load_state"})


def _progress_entries(journal, name: str) -> list[JournalEntry]:
    """The adapter's journal as `journal.entries` reads it (voided requests dropped), without decoding request
    payloads (token tensors) or outcomes other than OptimStep's and LoadState's."""
    by_seq: dict[int, JournalEntry] = {}
    for entry_id, fields in journal._read(name):
        seq_id, kind = int(fields[b"seq"]), fields[b"t"]
        if kind == REQUEST:
            by_seq[seq_id] = JournalEntry(seq_id=seq_id, kind=fields[b"kind"].decode(), payload_hash=b"",
                                          payload=None, entry_id=entry_id)
        elif kind == VOID:
            by_seq.pop(seq_id, None)
        elif kind == OUTCOME and seq_id in by_seq and by_seq[seq_id].kind in _STEP_KINDS:
            by_seq[seq_id].outcome = decode(fields[b"body"])
            by_seq[seq_id].has_outcome = True
    return sorted(by_seq.values(), key=lambda e: e.seq_id)


def measure_device(device: torch.device) -> tuple[int, int, int]:
    """(total, free, used by this process) in bytes: the GPU's own numbers on CUDA; on CPU the host's memory and
    this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free), int(torch.cuda.memory_reserved(device))
    total = free = used = 0
    try:
        with open("/proc/meminfo") as meminfo:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
        total, free = fields.get("MemTotal", 0), fields.get("MemAvailable", 0)
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    return total, free, used


class FleetMember:
    def __init__(self, service, store: FleetStore, member_id: str, *, ttl_s: float = 10.0,
                 interval_s: float | None = None):
        self.service = service
        self.store = store
        self.member_id = member_id
        self.ttl_s = ttl_s
        self.interval_s = interval_s if interval_s is not None else max(0.05, ttl_s / 4)
        self.address = ""
        # adapter -> the epoch this trainer serves it under. Read from the worker thread (the fence): replaced,
        # never mutated in place, so a reader sees one consistent dict.
        self._owned: dict[str, int] = {}
        # When each owned adapter was taken (a counter): a tick only judges adapters taken before it read Redis.
        self._taken_at: dict[str, int] = {}
        self._clock = 0
        self._adopting: set[str] = set()
        self._started_at = time.time()
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._draining = False

    def _own(self, name: str, epoch: int) -> None:
        self._clock += 1
        self._taken_at[name] = self._clock
        self._owned = {**self._owned, name: epoch}

    def _disown(self, name: str) -> None:
        self._taken_at.pop(name, None)
        self._owned = {k: v for k, v in self._owned.items() if k != name}

    # ---- the fence (trainer_svc.journal.Fence): called from the worker thread
    def epoch_of(self, adapter: str) -> int | None:
        return self._owned.get(adapter)

    def placement_key(self, adapter: str) -> str:
        return self.store.placement_key(adapter)

    def lost(self, adapter: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ---- what the service asks
    def serves(self, adapter: str) -> bool:
        return adapter in self._owned and adapter not in self._adopting

    def require(self, adapter: str) -> None:
        """Before a request for `adapter` is taken: raises ADAPTER_MOVED when another trainer serves it, UNAVAILABLE
        while it is being adopted here; returns when it is served here or nowhere (the service says NOT_FOUND)."""
        if adapter in self._adopting:
            raise Unavailable(f"adapter {adapter!r} is being restored on this trainer; retry", field="adapter")
        if adapter in self._owned:
            return
        placement = self.store.placement(adapter)
        if placement is None:
            return
        if placement.trainer != self.member_id:
            raise moved(adapter)
        if self.service.journal.record(adapter) is not None:  # placed here a moment ago, adoption to follow
            raise Unavailable(f"adapter {adapter!r} is being restored on this trainer; retry", field="adapter")

    def refusals(self, jobs: Sequence) -> list[LoraplaneError | None]:
        """Worker side, per job of a batch: the error for a new request of an adapter this trainer no longer serves
        (it would be fenced anyway; refusing it here keeps the rest of a fused batch running)."""
        return [None if job.replayed or job.adapter in self._owned else moved(job.adapter) for job in jobs]

    async def place_new(self, name: str, spec: LoraSpec) -> bool:
        """Before CreateAdapter: places the new adapter (on this trainer or, by the policy, on another: then
        ADAPTER_MOVED). True when this call made the placement (undone by `abandon` if the creation fails)."""
        if name in self._adopting:
            raise Unavailable(f"adapter {name!r} is being restored on this trainer; retry", field="adapter")
        need = adapter_bytes(self.service.backend.description, spec)
        existing = await asyncio.to_thread(self.store.placement, name)
        members = None
        if existing is not None and existing.trainer != self.member_id:
            members = await asyncio.to_thread(self.store.members)
            owner = next((m for m in members if m.trainer_id == existing.trainer), None)
            if owner is not None and owner.live:
                raise moved(name)
            # Placed on a trainer that is gone, and never created there (else the index would have it and the
            # failover would have moved it): place it afresh.
            if await asyncio.to_thread(self._has_record, name):
                raise Unavailable(f"adapter {name!r} is moving between trainers; retry", field="adapter")
        if existing is None or existing.trainer != self.member_id:
            members = members or await asyncio.to_thread(self.store.members)
            target = choose_trainer([self._self_view(m).load() for m in members], need) or self.member_id
            if existing is None:
                placement, created = await asyncio.to_thread(self.store.place_new, name, target, need)
            else:
                placement, created = await asyncio.to_thread(self.store.move, existing, target), False
                if placement is None:
                    raise Unavailable(f"adapter {name!r} is being placed; retry", field="adapter")
        else:
            placement, created = existing, False
        if placement.trainer != self.member_id:
            raise moved(name)
        self._own(name, placement.epoch)
        return created

    def _record_sizes(self, names: list[str]) -> dict[str, int]:
        sizes = {}
        for name in names:
            record = self.service.journal.record(name)
            if record is None:
                continue
            try:
                spec = LoraSpec.create(record.rank, record.alpha, record.target_modules, record.seed,
                                       max_rank=max(record.rank, 1), expert_layout=record.expert_layout)
                sizes[name] = adapter_bytes(self.service.backend.description, spec)
            except (LoraplaneError, KeyError, ValueError):
                sizes[name] = 0
        return sizes

    def _has_record(self, name: str) -> bool:
        return self.service.journal.record(name) is not None

    def _self_view(self, member: MemberInfo) -> MemberInfo:
        # This trainer counts as live even before its first heartbeat landed.
        if member.trainer_id == self.member_id:
            member.live = True
        return member

    async def abandon(self, name: str) -> None:
        """CreateAdapter failed after `place_new` placed the adapter here: the placement goes too."""
        epoch = self._owned.get(name)
        self._disown(name)
        if epoch is not None:
            await asyncio.to_thread(self.store.release, Placement(name, self.member_id, epoch))

    async def deleted(self, name: str) -> None:
        await self.abandon(name)

    # ---- start, the loop, stop
    async def claim_own(self) -> list[str]:
        """At start-up, before serving: takes back (under a new epoch, fencing any earlier incarnation of this
        id) the adapters still placed on this trainer. Returns their names, for the service to recover."""
        self._loop = asyncio.get_running_loop()
        placements = await asyncio.to_thread(self.store.all_placements)
        claimed = {}
        for name, placement in placements.items():
            if placement.trainer != self.member_id:
                continue
            taken = await asyncio.to_thread(self.store.move, placement, self.member_id)
            if taken is not None:
                claimed[name] = taken.epoch
        for name, epoch in claimed.items():
            self._own(name, epoch)
        return sorted(claimed)

    def start(self, address: str) -> None:
        self.address = address
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"fleet-{self.member_id}")

    def wake(self) -> None:
        """Runs the next tick now (the address became known, a write was fenced)."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Adoptions run on the worker: cancelling one midway would leave the worker a cancelled future to fill.
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)
        self.store.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("fleet tick of %s failed", self.member_id, exc_info=True)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass

    def report(self) -> MemberInfo:
        total, free, used = measure_device(self.service.backend.device)
        return MemberInfo(trainer_id=self.member_id, address=self.address, device=str(self.service.backend.device),
                          device_total=total, device_free=free, device_used=used,
                          queue_depth=int(self.service.scheduler._queued), adapters=len(self._owned),
                          started_at=self._started_at)

    async def tick(self) -> None:
        await asyncio.to_thread(self.store.heartbeat, self.report(), self.ttl_s)
        seen_at = self._clock
        members = await asyncio.to_thread(self.store.members)
        placements = await asyncio.to_thread(self.store.all_placements)
        mine = {name: p for name, p in placements.items() if p.trainer == self.member_id}
        # Given up: placements that moved away (or vanished) while this trainer was away or being drained.
        for name, epoch in list(self._owned.items()):
            if name in self._adopting or self._taken_at.get(name, 0) > seen_at:
                continue  # placed or taken after this tick read the placements
            current = placements.get(name)
            if current is None or current.trainer != self.member_id or current.epoch != epoch:
                if name in self.service.pool or current is not None:
                    log.warning("adapter %s is no longer placed on %s (epoch %s -> %s); giving it up", name,
                                self.member_id, epoch, current)
                await self.give_up(name)
        me = next((m for m in members if m.trainer_id == self.member_id), None)
        self._draining = bool(me and me.draining)
        if self._draining:
            await self._hand_over([p for name, p in mine.items() if name in self._owned], members)
            return
        # Failover: adapters of members whose heartbeat expired, spread over the live ones by the policy.
        live = {m.trainer_id for m in members if m.live}
        orphans = [p for p in placements.values() if p.trainer not in live]
        orphan_names = {p.adapter for p in orphans}
        if orphans:
            loads = [self._self_view(m).load() for m in members]
            plan = assign([(p.adapter, p.bytes) for p in orphans], loads)
            for placement in orphans:
                if plan.get(placement.adapter) == self.member_id:
                    # Marked before the move: from the moment it names this trainer, requests hear "retry".
                    self._adopting.add(placement.adapter)
                    taken = await asyncio.to_thread(self.store.move, placement, self.member_id)
                    if taken is None:
                        self._adopting.discard(placement.adapter)
                    else:
                        log.warning("taking over adapter %s from %s (presumed dead), epoch %d", placement.adapter,
                                    placement.trainer, taken.epoch)
                        mine[placement.adapter] = taken
        indexed = set(await asyncio.to_thread(self.store.adapter_names))
        # Adapters with no placement at all (journaled by a lone trainer before it joined a fleet, or a placement
        # lost with an un-persisted Redis): placed by the policy like new ones, each member claiming its share.
        unplaced = sorted(indexed - set(placements))
        if unplaced:
            sizes = await asyncio.to_thread(self._record_sizes, unplaced)
            plan = assign(list(sizes.items()), [self._self_view(m).load() for m in members])
            for name, target in plan.items():
                if target != self.member_id:
                    continue
                self._adopting.add(name)
                placement, created = await asyncio.to_thread(self.store.place_new, name, self.member_id,
                                                             sizes[name])
                if created:
                    orphan_names.add(name)
                    mine[name] = placement
                else:
                    self._adopting.discard(name)
        # Adoption: whatever is placed here and not served yet (moved here by a drain or by the failover above).
        for name, placement in mine.items():
            if name in self._owned or (name in self._adopting and name not in orphan_names):
                continue
            if name not in indexed:
                self._adopting.discard(name)
                continue  # placed, not created yet: CreateAdapter will arrive here
            # In its own task: a big adapter's restore must not hold up the heartbeat.
            self._adopting.add(name)
            task = asyncio.get_running_loop().create_task(self.adopt(placement), name=f"adopt-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def adopt(self, placement: Placement) -> bool:
        name = placement.adapter
        self._adopting.add(name)
        self._own(name, placement.epoch)
        try:
            if name in self.service.pool:
                await self.service.forget_local(name)
            failed = await self.service.recover(names=[name])
            if failed:
                raise RuntimeError(f"adapter {name!r} could not be recovered")
            log.info("adopted adapter %s at epoch %d", name, placement.epoch)
            return True
        except Exception as exc:  # noqa: BLE001 - the next tick tries again
            log.warning("adopting adapter %s failed: %s", name, exc)
            self._disown(name)
            if name in self.service.pool:
                await self.service.forget_local(name)
            return False
        finally:
            self._adopting.discard(name)

    async def give_up(self, name: str) -> None:
        """Stops serving the adapter here (its journal and checkpoints stay: they are the new owner's now)."""
        self._disown(name)
        if name in self.service.pool:
            await self.service.forget_local(name, moved(name))

    async def _hand_over(self, placements: list[Placement], members: list[MemberInfo]) -> None:
        others = [m.load() for m in members if m.trainer_id != self.member_id]
        plan = assign([(p.adapter, p.bytes) for p in placements], others)
        for placement in placements:
            target = plan.get(placement.adapter)
            if target is None:
                log.warning("draining %s: no other trainer can take adapter %s now", self.member_id,
                            placement.adapter)
                continue
            # The move fences this trainer at once; what it acknowledged is in the journal, which the new owner
            # replays. Queued requests that were not journaled yet fail as ADAPTER_MOVED and are retried there.
            if await asyncio.to_thread(self.store.move, placement, target) is not None:
                log.info("draining %s: adapter %s -> %s", self.member_id, placement.adapter, target)
            await self.give_up(placement.adapter)

    async def resolve(self, name: str) -> tuple[str, str, int, list[str]]:
        """(address, trainer id, epoch, live trainers' addresses) of the trainer serving `name`."""
        placement, members = await asyncio.gather(asyncio.to_thread(self.store.placement, name),
                                                  asyncio.to_thread(self.store.members))
        live = [m.address for m in members if m.live and m.address and not m.draining]
        if placement is None:
            raise NotFound(f"name: adapter {shown(name)} does not exist", field="name")
        owner = next((m for m in members if m.trainer_id == placement.trainer and m.live), None)
        if owner is None or not owner.address:
            raise Unavailable(f"adapter {name!r} is moving to another trainer (its trainer stopped); retry",
                              field="name")
        return owner.address, owner.trainer_id, placement.epoch, live

    # ---- the fleet-wide listing (ListAdapters on any member)
    async def listing(self, page_size: int, page_token: str, caller: Identity) -> ListingPage:
        """The page of the fleet's adapters (the journal index: every adapter created in the fleet, wherever it
        lives) after `page_token` that `caller` may see, and who describes each."""
        size = validate_page(page_size)
        names = [n for n in await asyncio.to_thread(self.store.adapter_names)
                 if (not page_token or n > page_token) and caller.may_see(n)]
        page = ListingPage(names=names[:size], next_token=names[size - 1] if len(names) > size else "")
        placements, members = await asyncio.gather(asyncio.to_thread(self.store.placements, page.names),
                                                   asyncio.to_thread(self.store.members))
        address_of = {m.trainer_id: m.address for m in members
                      if m.live and m.address and m.trainer_id != self.member_id}
        for name in page.names:
            placement = placements.get(name)
            if self.serves(name) and name in self.service.pool:
                page.here.append(name)
            elif placement is not None and placement.trainer in address_of:
                page.elsewhere.setdefault(address_of[placement.trainer], []).append(name)
            else:
                page.in_transit.append(name)
        return page

    def local_infos(self, names: Sequence[str]) -> dict[str, AdapterInfo]:
        infos = {}
        for name in names:
            try:
                infos[name] = self.service._info(self.service.pool.get(name))
            except NotFound:
                continue  # gone since the page was read (moved away or deleted): the journal describes it
        return infos

    async def journal_infos(self, names: Sequence[str]) -> dict[str, AdapterInfo]:
        """The adapters as their next owner will restore them (checkpoint + journal), for those no live member
        describes right now; an adapter deleted meanwhile is left out."""
        return {name: info for name in names if (info := await asyncio.to_thread(self._journal_info, name))}

    def _journal_info(self, name: str) -> AdapterInfo | None:
        journal = self.service.journal
        record = journal.record(name)
        if record is None:
            return None
        spec = LoraSpec.create(record.rank, record.alpha, record.target_modules, record.seed,
                               max_rank=max(record.rank, self.service.limits.max_lora_rank),
                               expert_layout=record.expert_layout)
        step, last_seq_id = journal_progress(record, _progress_entries(journal, name))
        shapes = expected_shapes(self.service.backend.description, spec)
        return AdapterInfo(name=name, spec=spec, base_model=record.base_model, step=step, last_seq_id=last_seq_id,
                           resident=False, parameter_count=sum(a * b for a, b in shapes.values()),
                           weights_dtype=record.weights_dtype)

    @property
    def draining(self) -> bool:
        return self._draining

    def owned(self) -> list[str]:
        return sorted(self._owned)
