"""One rank's share of the megatron backend: the model, the adapter pool and the model work.

Every rank of the job holds an ``Engine``; rank 0's backend (:mod:`.backend`) broadcasts each work item and all
ranks call the same method with the same arguments (:mod:`.launch`). Nothing here knows about gRPC or the
scheduler.

Adapter pool. Each adapter owns one flat fp32 buffer per rank, shape ``[4, n]``: row 0 params (this rank's LoRA
shards laid end to end), row 1 grads, row 2 AdamW exp_avg, row 3 exp_avg_sq. A pinned host copy always exists; up
to ``device_slots`` adapters also have a device copy (resident). Activating a resident adapter copies nothing; a
spilled one is one host→device copy of the whole buffer on a side stream (``prefetch`` starts it early, the compute
stream waits on its event), and the least recently used resident adapter is copied back and dropped. Which adapters
are resident and which one to spill is the trainer's one residency policy, :class:`trainer_svc.pool.Residency`, which
the shared adapter pool uses too; this engine moves its own flat buffers.

Within the flat buffer the tensors that are sharded over tensor-parallel ranks come first, then the dense
replicated ones, then (adapters that train the routed experts of an MoE model) the per-expert factors, sharded over
expert-parallel ranks, then the expert factors shared by a layer's experts; so the global gradient norm is
``all_reduce_TP(Σ tp-sharded²) + Σ dense replicated² + all_reduce_EP(Σ per-expert²) + Σ shared²``, and the
gradients of a data-parallel batch are summed over the data-parallel group (dense part), over the ranks holding
the same experts (per-expert part) and over every rank (shared expert factors).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as adamw_update

from loraplane.errors import NotFound
from loraplane.lora import LoraSpec, expected_shapes, init_lora_params, peft_key
from trainer_svc import losses as loss_lib
from trainer_svc.optimizer import AdamHyper, StepOutcome
from trainer_svc.pool import Residency

from .expert_lora import expert_lora_classes
from .layout import (
    EXPERT_TARGETS,
    LlamaShape,
    chunk_for_rank,
    expert_factor_shared,
    expert_lora_from_stacked,
    expert_lora_to_stacked,
)
from .lora import MegatronLora, lora_classes
from .model import build_from_hf, forward_logits, target_logprobs
from .recompute import LayerRecompute
from .routing import AdapterTensors, LoraClass, RowSegment

ROWS = 4  # params, grads, exp_avg, exp_avg_sq
# The smallest micro-batch (tokens per rank) worth a pass of its own; below it one pass recomputes instead.
MIN_MICRO_BATCH_TOKENS = 4096


@dataclass(frozen=True)
class FlatEntry:
    key: str  # PEFT key
    layer: int
    target: str
    which: str  # "A" | "B"
    shape: tuple[int, ...]  # as stored on this rank: A's shard [r, in], or B's shard transposed [r, out]; experts:
    # [G, r, dim] (this rank's experts, or 1 shared)
    offset: int
    sharded: bool
    ep_sharded: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class FlatLayout:
    classes: list[tuple[LoraClass, int]]  # (class, offset): each class is one [L, G, rank, dim] block
    entries: list[FlatEntry]
    rank: int
    numel: int
    sharded_numel: int  # the sharded classes come first and occupy [0, sharded_numel)
    dense_numel: int = 0  # [0, dense_numel): the dense classes; then the expert classes
    ep_numel: int = 0  # [dense_numel, ep_numel): per-expert factors (EP-sharded); [ep_numel, numel): shared


def flat_layout(shape: LlamaShape, rank: int, tp: int, experts: str | None = None, ep: int = 1) -> FlatLayout:
    """This rank's flat layout of a rank-``rank`` adapter: every class of :func:`.lora.lora_classes` (all seven
    projections, so adapters with different targets stack in one batch; untargeted ones stay zero), in order;
    with ``experts`` (an expert layout) the expert classes of :func:`.expert_lora.expert_lora_classes` after them."""
    classes, entries, offset, sharded_numel = [], [], 0, 0
    layers = shape.num_layers
    for c in lora_classes(shape, tp):
        classes.append((c, offset))
        groups = len(c.targets)
        for layer in range(layers):
            for g, target in enumerate(c.targets):
                if not shape.has_target(layer, target):
                    continue  # an MoE layer's dense-MLP storage stays zero and is never exported
                at = offset + (layer * groups + g) * rank * c.dim
                entries.append(FlatEntry(peft_key(layer, target, c.which), layer, target, c.which, (rank, c.dim),
                                         at, c.sharded))
        offset += layers * groups * rank * c.dim
        if c.sharded:
            sharded_numel = offset
    dense_numel = ep_numel = offset
    for c in expert_lora_classes(shape, experts, ep) if experts else ():
        classes.append((c, offset))
        target = c.targets[0]
        for k, layer in enumerate(shape.moe_layers):
            at = offset + k * c.groups * rank * c.dim
            entries.append(FlatEntry(peft_key(layer, target, c.which), layer, target, c.which,
                                     (c.groups, rank, c.dim), at, False, c.ep_sharded))
        offset += c.layers * c.groups * rank * c.dim
        if c.groups > 1:
            ep_numel = offset
    return FlatLayout(classes, entries, rank, offset, sharded_numel, dense_numel, ep_numel)


@dataclass
class Slot:
    name: str
    spec: LoraSpec
    layout: FlatLayout
    host: torch.Tensor  # [4, n] fp32, pinned on CUDA
    device: torch.Tensor | None = None  # [4, n] fp32 when resident
    tensors: AdapterTensors | None = None  # per-class views of device[0] and device[1], while resident
    ready: torch.cuda.Event | None = None  # set while a prefetch copy is in flight
    host_valid: bool = True  # False while the device copy is newer than the host copy
    step: int = 0
    has_grads: bool = False


@dataclass
class DatumWork:
    adapter: str
    input_tokens: list[int]
    target_tokens: list[int]  # N values, or N * K row-major for K soft targets per position
    weights: list[float] | None = None  # as target_tokens
    logprobs: list[float] | None = None
    advantages: list[float] | None = None
    targets_per_position: int = 1


@dataclass
class BatchResult:
    logprobs: list[list[float]]
    elementwise_loss: list[list[float]]
    loss_sum_by_adapter: dict[str, float] = field(default_factory=dict)


class Engine:
    def __init__(self, base, *, device_slots: int = 8, dtype: torch.dtype = torch.bfloat16,
                 lora_compute_dtype: torch.dtype | None = None, data_parallel_size: int | None = None,
                 attention: str = "sdpa", recompute: str = "auto", expert_lora_slots: int = 8,
                 micro_batch_tokens: int | None = None):
        """``lora_compute_dtype``: dtype of the LoRA matmuls (None = the model's dtype, as megatron's own adapters
        do; the fp32 masters and their gradients stay fp32 either way). ``attention``: ``sdpa`` (fused, no s^2
        scores; :mod:`.attention`) or ``unfused`` (megatron's DotProductAttention). ``recompute``: ``auto`` (as
        many layers as the batch needs to fit; :mod:`.recompute`), ``none`` or ``full``. ``micro_batch_tokens``: cut
        a backward batch into micro-batches of at most this many tokens per rank (None: as many as fit without
        recomputation, when recompute is ``auto``; 0: never)."""
        from megatron.core import parallel_state as ps

        self.base = base
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
            torch.device("cpu"))
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        # Expert parallelism: the EP ranks are data-parallel ranks whose MoE layers exchange tokens, so every one of
        # them runs every forward and backward, with or without datums of its own (:meth:`run_batch`).
        self.ep = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group() if self.ep > 1 else None
        # The ranks that hold the same experts (their per-expert LoRA gradients are summed over them).
        self.edp = ps.get_expert_data_parallel_world_size()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.edp_group = ps.get_expert_data_parallel_group() if self.edp > 1 else None
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if data_parallel_size is not None and data_parallel_size != self.dp:
            raise ValueError(f"data_parallel_size={data_parallel_size} but the job has {self.dp} data-parallel ranks")
        self.model, self.spec = build_from_hf(base.model, dtype, self.device, attention,
                                              expert_lora_slots=expert_lora_slots)
        self.shape = self.spec.shape
        self.lora = MegatronLora(self.model, self.shape, compute_dtype=lora_compute_dtype or dtype)
        self.recompute = LayerRecompute(self.model, self.lora, self.shape, self.tp, dtype, recompute)
        self.micro_batch_tokens = micro_batch_tokens
        self.slots: dict[str, Slot] = {}
        # The trainer's one residency policy (trainer_svc.pool): slots, LRU order, which adapter to spill.
        self.residency = Residency(int(device_slots))
        self.copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self.pin = self.device.type == "cuda"
        self._stats: dict[str, int] = {}

    @property
    def stats(self) -> dict[str, int]:
        """Counters: the pool's (activations, misses, prefetches), then the model work's (fused-batch modes,
        recomputed layers, micro-batches, expert-LoRA GEMMs)."""
        r = self.residency
        return {"activations": r.activations, "misses": r.misses, "prefetches": r.prefetches, **self._stats}

    @property
    def device_slots(self) -> int:
        return self.residency.slots

    @device_slots.setter
    def device_slots(self, value: int) -> None:
        self.residency.slots = int(value)

    @property
    def resident(self) -> list[str]:
        """The adapters with a device copy (or one in flight), least recently used first."""
        return self.residency.names()

    # -- adapters -------------------------------------------------------------------------------------------------

    def full_shapes(self, spec: LoraSpec) -> dict[str, tuple[int, int]]:
        """PEFT key -> full shape of the adapter's tensors (the canonical blob's, shared with every backend)."""
        return expected_shapes(self.base, spec)

    def _layout(self, spec: LoraSpec) -> FlatLayout:
        experts = spec.expert_layout if spec.has_experts and self.shape.moe_layers else None
        return flat_layout(self.shape, spec.rank, self.tp, experts, self.ep)

    def create(self, name: str, spec: LoraSpec) -> int:
        """Fresh adapter from its seed (the same A as every backend draws); returns the full parameter count."""
        params = init_lora_params(self.base, spec, device="cpu")
        self._install(name, spec, params, None, None, 0)
        return sum(t.numel() for t in params.values())

    def _install(self, name, spec, params, exp_avg, exp_avg_sq, step) -> None:
        layout = self._layout(spec)
        host = torch.zeros(ROWS, layout.numel, dtype=torch.float32, pin_memory=self.pin)
        for e in layout.entries:
            if e.target not in spec.target_modules:
                continue  # stays zero: a zero A and B add nothing and get zero gradients
            for row, source in ((0, params), (2, exp_avg), (3, exp_avg_sq)):
                if source is None:
                    continue
                host[row, e.offset : e.offset + e.numel].view(e.shape).copy_(self._stored(e, source[e.key], spec))
        old = self.slots.pop(name, None)
        if old is not None:
            self.residency.remove(name)
        self.slots[name] = Slot(name=name, spec=spec, layout=layout, host=host, step=int(step))

    def _stored(self, e: FlatEntry, full: torch.Tensor, spec: LoraSpec) -> torch.Tensor:
        """A full PEFT tensor → this rank's stored form (its shard; B transposed)."""
        full = full.detach().to("cpu", torch.float32)
        if e.target in EXPERT_TARGETS:
            shared = expert_factor_shared(e.target, e.which, spec.expert_layout)
            stacked = expert_lora_to_stacked(e.which, full, e.shape[1], shared)
            return chunk_for_rank(stacked, self.ep, self.ep_rank, 0) if e.ep_sharded else stacked
        if e.sharded:
            # Column-parallel B keeps a row chunk; row-parallel A keeps a column chunk (layout.lora_shard).
            full = chunk_for_rank(full, self.tp, self.tp_rank, 0 if e.which == "B" else 1)
        return full.t() if e.which == "B" else full

    def delete(self, name: str) -> None:
        self.slots.pop(name, None)
        self.residency.remove(name)

    def slot(self, name: str) -> Slot:
        s = self.slots.get(name)
        if s is None:
            raise NotFound(f"adapter {name!r} does not exist on this trainer", field="adapter")
        return s

    def is_resident(self, name: str) -> bool:
        return name in self.residency

    # -- pool: residency ---------------------------------------------------------------------------------------

    def prefetch(self, name: str, protect: tuple[str, ...] = ()) -> None:
        """Starts the host→device copy of a spilled adapter on the copy stream (no-op when resident)."""
        s = self.slots.get(name)
        if s is None or s.device is not None:
            return
        self.residency.make_room(name, (*protect, name), self._spill_named)
        self.residency.prefetches += 1
        self._load(s, asynchronous=True)

    def activate(self, names: list[str]) -> list[Slot]:
        """Makes every named adapter resident (a fused batch needs all of them) and ready on the compute stream."""
        unique = list(dict.fromkeys(names))
        residency = self.residency
        residency.check_batch(len(unique))
        slots = [self.slot(n) for n in unique]
        for s in slots:
            residency.activations += 1
            if s.device is None:
                residency.misses += 1
                residency.make_room(s.name, unique, self._spill_named)
                self._load(s, asynchronous=False)
            residency.used(s.name)
            if s.ready is not None:
                torch.cuda.current_stream().wait_event(s.ready)
                s.ready = None
        return slots

    def _load(self, s: Slot, asynchronous: bool) -> None:
        stream = self.copy_stream if (asynchronous and self.copy_stream is not None) else None
        if stream is not None:
            # No wait on the compute stream: host buffers are complete (spills synchronize), so the copy overlaps
            # whatever the compute stream is running.
            with torch.cuda.stream(stream):
                dev = torch.empty_like(s.host, device=self.device)
                dev.copy_(s.host, non_blocking=True)
                s.ready = torch.cuda.Event()
                s.ready.record(stream)
            dev.record_stream(torch.cuda.current_stream())
        else:
            dev = s.host.to(self.device, non_blocking=True)
        s.device = dev
        s.tensors = None
        if stream is not None:
            self.tensors(s)  # prefetch: build the views while the copy runs (metadata only)
        # else: built on first use (run_batch), so an activation is only the copy
        self.residency.add(s.name)

    def _spill_named(self, name: str) -> None:
        self._spill(self.slots[name])

    def _spill(self, s: Slot) -> None:
        if s.ready is not None:  # a prefetch that was never used: its copy must land before we read it back
            torch.cuda.current_stream().wait_event(s.ready)
            s.ready = None
        if not s.host_valid:
            s.host.copy_(s.device, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            s.host_valid = True
        s.device = s.tensors = None
        self.residency.remove(s.name)

    def tensors(self, s: Slot) -> AdapterTensors:
        """Per-class ``[L, G, r, dim]`` views of the resident params and grads, cached while resident."""
        if s.tensors is None:
            params, grads, layers, r = s.device[0], s.device[1], self.shape.num_layers, s.layout.rank
            p, g = {}, {}
            for c, offset in s.layout.classes:
                block = c.block_shape(layers, r)
                size = math.prod(block)
                p[c.name] = params[offset : offset + size].view(block)
                g[c.name] = grads[offset : offset + size].view(block)
            experts = s.spec.expert_layout if s.layout.numel > s.layout.dense_numel else None
            s.tensors = AdapterTensors(p, g, r, s.spec.scale, experts)
        return s.tensors

    def sync_host(self, s: Slot) -> torch.Tensor:
        """The up-to-date host buffer (copies the device buffer back when it is newer)."""
        if s.device is not None and not s.host_valid:
            if s.ready is not None:
                torch.cuda.current_stream().wait_event(s.ready)
                s.ready = None
            s.host.copy_(s.device, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            s.host_valid = True
        return s.host

    # -- model work --------------------------------------------------------------------------------------------

    def run_batch(self, datums: list[DatumWork], loss_fn: str, loss_cfg: dict[str, float], backward: bool,
                  routes: list[tuple[str, str, dict[str, float]]] | None = None) -> BatchResult:
        """One fused forward (and backward) over datums of possibly several adapters, run as one packed row per
        rank (no padding; each adapter's tokens one contiguous range, see :mod:`.lora`).

        ``routes`` (optional) gives each datum's own (adapter, loss_fn, loss_cfg) when requests with different
        losses share the batch; otherwise every datum uses ``loss_fn``/``loss_cfg``. Data-parallel ranks take
        datums ``dp_rank::dp``; outputs are summed over the data-parallel group so every rank returns all of them.
        """
        names = [d.adapter for d in datums]
        slots = {s.name: s for s in self.activate(names)}
        if backward:
            # Every rank of a reduction group holds the same already-reduced sum of earlier batches; keep it on one
            # rank of the group only, so the all-reduce below adds this batch's gradients to it exactly once.
            for s in slots.values():
                if s.has_grads:
                    for part, group_rank in self._grad_parts(s):
                        if group_rank != 0:
                            part.zero_()
        n = len(datums)
        mine = list(range(self.dp_rank, n, self.dp))
        # My datums back to back in one packed row, grouped by adapter so that each adapter's tokens are one
        # contiguous range (what the LoRA routing, and its grouped GEMM, needs).
        order = sorted(mine, key=lambda i: (list(slots).index(datums[i].adapter), i))
        lengths = [len(datums[i].input_tokens) for i in order]
        tokens = sum(lengths)
        # A datum's logprobs row holds its N * K values (K = 1 but for soft targets).
        out_lp = torch.zeros(n, max(len(d.target_tokens) for d in datums) if n else 0, dtype=torch.float32,
                             device=self.device)
        out_loss = torch.zeros(n, max(len(d.input_tokens) for d in datums) if n else 0, dtype=torch.float32,
                               device=self.device)
        loss_by_adapter = torch.zeros(len(slots), dtype=torch.float64, device=self.device)
        placeholder = not tokens and self.ep > 1 and n > 0
        if placeholder:
            # No datum here, but the other EP ranks' MoE layers exchange tokens with this one in the forward and
            # the backward: run one token through the first adapter with a loss of exactly zero (its gradients are
            # zeros, added by the all-reduce below).
            self._run_packed(datums, [], slots, routes, loss_fn, loss_cfg, backward, out_lp, out_loss,
                             loss_by_adapter, placeholder=True)
        for chunk in self._micro_batches(order, lengths, backward):
            self._run_packed(datums, chunk, slots, routes, loss_fn, loss_cfg, backward, out_lp, out_loss,
                             loss_by_adapter)
        if backward:
            for s in slots.values():
                for part, group in self._grad_groups(s):
                    dist.all_reduce(part, group=group)
                s.host_valid = False
                s.has_grads = True
        if self.dp > 1:
            for t in (out_lp, out_loss, loss_by_adapter):
                dist.all_reduce(t, group=self.dp_group)
        self._stats.update(self.lora.expert_gemms)
        lp_cpu, loss_cpu = out_lp.cpu(), out_loss.cpu()
        return BatchResult(
            logprobs=[lp_cpu[i, : len(d.target_tokens)].tolist() for i, d in enumerate(datums)],
            elementwise_loss=[loss_cpu[i, : len(d.input_tokens)].tolist() for i, d in enumerate(datums)],
            loss_sum_by_adapter={name: float(v) for name, v in zip(slots, loss_by_adapter.cpu().tolist())},
        )

    def _micro_batches(self, order: list[int], lengths: list[int], backward: bool) -> list[list[int]]:
        """This rank's datums (in packed order) cut into micro-batches whose activations fit without recomputation,
        when a backward over all of them would have to recompute layers. A recomputed layer runs its forward twice;
        micro-batches run every forward once and add their LoRA gradients up before the one optimizer step (the
        gradients are the same sums, in another order). ``micro_batch_tokens`` (set by tests, or 0 for never)
        overrides the limit the memory plan gives. Under EP every rank must run the same number of passes (its
        MoE layers exchange tokens), so EP jobs keep one pass and recompute instead."""
        limit = self.micro_batch_tokens
        if limit is None:
            limit = self.recompute.max_tokens_without_recompute(backward, self.device)
            if self.tp > 1 and limit:
                # The TP ranks of a group run every pass together (their layers all-reduce): one limit for all,
                # whatever each rank's free memory says.
                agreed = torch.tensor([limit], dtype=torch.int64, device=self.device)
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.tp_group)
                limit = int(agreed.item())
            if limit and limit < MIN_MICRO_BATCH_TOKENS:
                # Passes this small cost more than the recomputation they avoid: Llama-3-70B on 4 H100s (TP=4,
                # 8 x 2048) ran 2,992 tok/s in passes of one datum against 4,070 in one pass recomputing 75 of 80
                # layers (docs/benchmarks.md, runs mg3 and s23); 8B on one GPU gains 1.36x from passes of 8,192.
                limit = 0
        if not order or not limit or self.ep > 1 or sum(lengths) <= limit:
            return [order] if order else []
        chunks, current, used = [], [], 0
        for i, length in zip(order, lengths):
            if current and used + length > limit:
                chunks.append(current)
                current, used = [], 0
            current.append(i)
            used += length
        chunks.append(current)
        self._stats["micro_batches"] = self._stats.get("micro_batches", 0) + len(chunks)
        return chunks

    def _run_packed(self, datums, chunk: list[int], slots: dict[str, Slot], routes, loss_fn, loss_cfg,
                    backward: bool, out_lp, out_loss, loss_by_adapter, placeholder: bool = False) -> None:
        """One packed forward (and backward) over the datums ``chunk`` (grouped by adapter, so each adapter's
        tokens are one contiguous range); writes their outputs into the batch's buffers."""
        lengths = [len(datums[i].input_tokens) for i in chunk]
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        tokens = offsets[-1]
        if placeholder:
            ids = tgt = torch.zeros(1, dtype=torch.long)
            lengths, offsets, tokens = [1], [0, 1], 1
        else:
            ids = torch.tensor([t for i in chunk for t in datums[i].input_tokens], dtype=torch.long)
            if max(datums[i].targets_per_position for i in chunk) == 1:
                tgt = torch.tensor([t for i in chunk for t in datums[i].target_tokens], dtype=torch.long)
            else:
                tgt = loss_lib.packed_targets([torch.tensor(datums[i].target_tokens, dtype=torch.long).view(
                    len(datums[i].input_tokens), -1) for i in chunk])
        ids = ids.to(self.device, non_blocking=True)
        tgt = tgt.to(self.device, non_blocking=True)
        segments, row = [], 0
        for name, s in slots.items():
            count = sum(len(datums[i].input_tokens) for i in chunk if datums[i].adapter == name)
            if placeholder and not segments:
                count = 1
            if count:
                segments.append(RowSegment(row, row + count, self.tensors(s)))
                row += count
        planned = tokens
        if self.ep > 1:
            # Every EP rank must recompute the same layers: a recomputed MoE layer exchanges tokens again.
            most = torch.tensor([tokens], dtype=torch.int64, device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
            planned = int(most.item())
        self._stats["recomputed_layers"] = self.recompute.plan(planned, backward, self.device)
        with torch.set_grad_enabled(backward), self.lora.route(segments, tokens) as routing:
            self._stats[f"lora_{routing.mode}"] = self._stats.get(f"lora_{routing.mode}", 0) + 1
            logits = forward_logits(self.model, ids, lengths)  # [1, T, V/TP]
            lp_all = target_logprobs(logits, tgt[None])[0]  # [T] fp32 ([T, Kmax] with soft targets)
            total = lp_all.new_zeros(())
            for k, i in enumerate(chunk):
                d = datums[i]
                length = lengths[k]
                lp = lp_all[offsets[k] : offsets[k] + length]
                width = d.targets_per_position
                lp = loss_lib.own_targets(lp, width)
                name, lname, lcfg = routes[i] if routes is not None else (d.adapter, loss_fn, loss_cfg)

                def opt(values):
                    return None if values is None else torch.tensor(values, dtype=torch.float32, device=self.device)

                weights = opt(d.weights)
                if width > 1 and weights is not None:
                    weights = weights.view(length, width)
                per_token = loss_lib.elementwise_loss(
                    lname, lcfg, lp, weights=weights, q=opt(d.logprobs), advantages=opt(d.advantages)
                )
                out_lp[i, : length * width] = lp.detach().reshape(-1)
                out_loss[i, :length] = per_token.detach()
                loss_by_adapter[list(slots).index(name)] += per_token.detach().double().sum()
                total = total + per_token.sum()
            if placeholder:
                total = lp_all.sum() * 0.0
        if backward and total.requires_grad:
            total.backward()
            routing.accumulate_grads()

    def _grad_regions(self, s: Slot) -> list[tuple[torch.Tensor, int, object, int]]:
        """(gradient region, reduction group size, group, this rank's index in it): the dense classes over the
        data-parallel group, per-expert factors over the ranks holding the same experts, shared expert factors
        over every rank (each holds a partial sum over its experts and tokens)."""
        g, lay = s.device[1], s.layout
        regions = [(g[: lay.dense_numel], self.dp, self.dp_group, self.dp_rank)]
        if lay.numel > lay.dense_numel:
            regions.append((g[lay.dense_numel : lay.ep_numel], self.edp, self.edp_group, self.edp_rank))
            regions.append((g[lay.ep_numel :], self.world, None, dist.get_rank() if self.world > 1 else 0))
        return [r for r in regions if r[0].numel()]

    def _grad_parts(self, s: Slot):
        return [(part, index) for part, size, _, index in self._grad_regions(s) if size > 1]

    def _grad_groups(self, s: Slot):
        return [(part, group) for part, size, group, _ in self._grad_regions(s) if size > 1]

    # -- optimizer -----------------------------------------------------------------------------------------------

    def grad_norm(self, s: Slot) -> torch.Tensor:
        g = s.device[1]
        lay = s.layout
        k = lay.sharded_numel

        def sq(t):  # accumulated in float64 inside the reduction (no float64 copy of the gradients)
            return torch.linalg.vector_norm(t, dtype=torch.float64) ** 2

        sharded = sq(g[:k])
        if self.tp > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        experts = sq(g[lay.dense_numel : lay.ep_numel])
        if self.ep > 1 and lay.ep_numel > lay.dense_numel:
            dist.all_reduce(experts, group=self.ep_group)
        return torch.sqrt(sharded + sq(g[k : lay.dense_numel]) + experts + sq(g[lay.ep_numel :]))

    def optim_step(self, name: str, hyper: AdamHyper) -> StepOutcome:
        """``torch.optim.AdamW`` on this rank's flat shard with the request's hyper-parameters; the clip uses the
        global norm over all ranks (``torch.nn.utils.clip_grad_norm_``'s coefficient)."""
        (s,) = self.activate([name])
        norm = float(self.grad_norm(s))
        grads = s.device[1]
        if not math.isfinite(norm):
            grads.zero_()
            s.host_valid = False
            s.has_grads = False
            return StepOutcome(step=s.step, grad_norm=norm, skipped=True)
        if hyper.grad_clip_norm > 0:
            coef = hyper.grad_clip_norm / (norm + 1e-6)
            if coef < 1.0:
                grads.mul_(coef)
        # torch.optim.AdamW's own update (its functional form: no optimizer object per step) on one flat tensor,
        # since AdamW is elementwise; the fused kernel on CUDA (one pass over params, grads and moments).
        fused = self.device.type == "cuda"
        step = torch.tensor(float(s.step), dtype=torch.float32, device=self.device if fused else "cpu")
        adamw_update(
            [s.device[0]], [grads], [s.device[2]], [s.device[3]], [], [step], foreach=False, fused=fused,
            amsgrad=False, beta1=hyper.beta1, beta2=hyper.beta2, lr=hyper.learning_rate,
            weight_decay=hyper.weight_decay, eps=hyper.eps, maximize=False)
        grads.zero_()
        s.step += 1
        s.host_valid = False
        s.has_grads = False
        return StepOutcome(step=s.step, grad_norm=norm, skipped=False)

    # -- export / state ------------------------------------------------------------------------------------------

    def gather_full(self, name: str, rows: tuple[int, ...] = (0,)) -> list[dict[str, torch.Tensor]] | None:
        """Full PEFT tensors of the requested rows, assembled from every TP rank; None on other ranks than TP 0
        (all TP ranks must call it). Device → host once, no disk."""
        s = self.slot(name)
        if s.device is not None:
            local = s.device[list(rows)]
        else:
            local = s.host[list(rows)].to(self.device)
        if self.tp > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        else:
            parts = [local]
        ep_parts = [local]
        if self.ep > 1 and s.layout.ep_numel > s.layout.dense_numel:
            ep_parts = [torch.empty_like(local) for _ in range(self.ep)]
            dist.all_gather(ep_parts, local.contiguous(), group=self.ep_group)
        if self.tp_rank != 0:
            return None
        parts = [p.cpu() for p in parts]
        ep_parts = [p.cpu() for p in ep_parts]
        out = []
        for r in range(len(rows)):
            full = {}
            for e in s.layout.entries:
                if e.target not in s.spec.target_modules:
                    continue
                if e.target in EXPERT_TARGETS:
                    blocks = [p[r, e.offset : e.offset + e.numel].view(e.shape)
                              for p in (ep_parts if e.ep_sharded else ep_parts[:1])]
                    full[e.key] = expert_lora_from_stacked(e.which, torch.cat(blocks, 0),
                                                           expert_factor_shared(e.target, e.which, s.spec.expert_layout))
                    continue
                shards = [p[r, e.offset : e.offset + e.numel].view(e.shape) for p in parts]
                if e.which == "B":
                    shards = [t.t() for t in shards]
                # Inverse of _stored: B row chunks / A column chunks in rank order.
                full[e.key] = torch.cat(shards, 0 if e.which == "B" else 1) if e.sharded else shards[0]
            # Contiguous tensors of their own (A's are views of this call's host copy; B's transposes are copied).
            out.append({k: full[k].contiguous() for k in self.full_shapes(s.spec)})
        return out

    def load_state(self, name: str, params, exp_avg, exp_avg_sq, step: int, spec: LoraSpec) -> None:
        """Replaces the adapter's params (and moments + step, or fresh ones) with full PEFT tensors."""
        was_resident = name in self.residency
        self._install(name, spec, params, exp_avg, exp_avg_sq, step)
        if was_resident:
            self.activate([name])

    def time_activation(self, name: str) -> float:
        t0 = time.perf_counter()
        self.activate([name])
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0
