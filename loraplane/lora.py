"""PEFT-standard LoRA math shared by the trainer and the sampler.

Parameterization (identical to HF PEFT): for each targeted projection W (out x in) of each decoder layer,
y = W x + scale * B (A x) with A (r x in) kaiming-uniform(a=sqrt(5)), B (out x r) zero, scale = alpha / r.

Multi-adapter forward: `attach_multi_lora(model)` installs one forward hook on every targeted nn.Linear of the HF
model (the module tree and its state_dict stay untouched). Inside `lora_routing(model, ...)` each hook adds every
routed adapter's delta to the rows/tokens routed to it; outside it the model is the plain base model. Two routings:

* rows (`lora_routing(model, [adapter_or_None per batch row])`): for batched generation with a KV cache; works for
  any sequence length per call (prefill or one-token decode).
* token segments (`lora_segments(model, [(start, end, adapter_or_None), ...])`): for a packed (1, N) batch in
  which datums are laid end to end; the trainer uses this.
* row windows (`lora_row_windows(model, [(adapter, first_row, end_row), ...], rows, bucket)`): batch-invariant
  rows for the sampler's decode steps; every LoRA matmul has a fixed shape whatever else shares the batch.

Each adapter's delta is computed only from its own rows (gather, two small matmuls, scatter), so autograd sends
gradient only into that adapter's A and B, and an adapter's weight-gradient matmuls see exactly the same operands
whether or not other adapters share the batch.

Mixture-of-experts layers (Qwen3-MoE) take LoRA on the routed experts (`experts.gate_up_proj`, `experts.down_proj`)
inside an experts implementation of our own that the same routings drive: see "routed experts" below.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from loraplane.errors import InvalidArgument
from loraplane.models import families
from loraplane.models.families import ALL_TARGETS, TARGET_BY_KEY_PATH, TARGETS
from loraplane.models.families.base import ROUTED_EXPERT_TARGETS
from loraplane.threads import one_thread, share_work

# The default targets of a dense model (every decoder projection); a MoE model's defaults come from its family
# (`LoraSpec.create(available=...)`).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model.model.layers"
DEFAULT_MAX_RANK = 256
# How an adapter's expert targets hold their factors (LoraConfig.expert_layout): PEFT's per-expert A and B, or
# SGLang's shared-outer layout (gate_up A and down B shared by a layer's experts). See "Routed experts" below.
PER_EXPERT = "per_expert"
SHARED_OUTER = "shared_outer"
EXPERT_LAYOUTS = (PER_EXPERT, SHARED_OUTER)


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float = 0.0
    target_modules: tuple[str, ...] = TARGET_MODULES
    seed: int = 0
    expert_layout: str = PER_EXPERT

    @property
    def has_experts(self) -> bool:
        return any(t in ROUTED_EXPERT_TARGETS for t in self.target_modules)

    @property
    def effective_alpha(self) -> float:
        return float(self.alpha) if self.alpha else float(self.rank)

    @property
    def scale(self) -> float:
        return self.effective_alpha / self.rank

    @classmethod
    def create(cls, rank: int, alpha: float = 0.0, target_modules: Iterable[str] = (), seed: int = 0,
               *, max_rank: int = DEFAULT_MAX_RANK, field_prefix: str = "lora_config",
               expert_layout: str = "", available: Sequence[str] | None = None) -> LoraSpec:
        """Validates and canonicalizes (targets in ALL_TARGETS order; empty = every target in `available`, the
        base model's targets, or TARGET_MODULES when not given)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise InvalidArgument(f"{field_prefix}.rank must be >= 1, got {rank!r}", field=f"{field_prefix}.rank")
        if rank > max_rank:
            raise InvalidArgument(f"{field_prefix}.rank {rank} exceeds the maximum LoRA rank {max_rank}",
                                  field=f"{field_prefix}.rank")
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha < 0:
            raise InvalidArgument(f"{field_prefix}.alpha must be finite and >= 0, got {alpha}",
                                  field=f"{field_prefix}.alpha")
        targets = list(target_modules)
        allowed = [t for t in ALL_TARGETS if available is None or t in available]
        unknown = sorted(set(targets) - set(allowed))
        if unknown:
            raise InvalidArgument(
                f"{field_prefix}.target_modules: unknown {unknown}; allowed {allowed}",
                field=f"{field_prefix}.target_modules",
            )
        if len(set(targets)) != len(targets):
            raise InvalidArgument(f"{field_prefix}.target_modules has duplicates: {targets}",
                                  field=f"{field_prefix}.target_modules")
        if targets:
            chosen = tuple(m for m in ALL_TARGETS if m in targets)
        else:
            chosen = tuple(allowed) if available is not None else TARGET_MODULES
        if not isinstance(seed, int) or seed < 0 or seed >= 2**64:
            raise InvalidArgument(f"{field_prefix}.seed must be in [0, 2^64), got {seed!r}",
                                  field=f"{field_prefix}.seed")
        layout = expert_layout or PER_EXPERT
        if layout not in EXPERT_LAYOUTS:
            raise InvalidArgument(f"{field_prefix}.expert_layout must be one of {list(EXPERT_LAYOUTS)}, got "
                                  f"{str(expert_layout)[:40]!r}", field=f"{field_prefix}.expert_layout")
        return cls(rank=rank, alpha=alpha if alpha else float(rank), target_modules=chosen, seed=seed,
                   expert_layout=layout)


def peft_key(layer: int, module: str, which: str) -> str:
    """PEFT state-dict key (the path of each target is the model families' TARGETS), e.g.
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight; for the expert targets (HF PEFT's
    `target_parameters` wraps a MoE layer's `mlp.experts` twice, gate_up_proj innermost)
    base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight (gate_up_proj) and
    ...mlp.experts.lora_A.weight (down_proj); Tinker's split in_proj_q/k/v of a Qwen3.5 linear-attention layer
    ...linear_attn.in_proj_q.lora_A.weight."""
    return f"{PEFT_PREFIX}.{layer}.{TARGETS[module].key_path}.lora_{which}.weight"


def expert_shapes(module: str, dims: tuple[int, int], rank: int, experts: int,
                  layout: str = PER_EXPERT) -> tuple[tuple[int, int], tuple[int, int]]:
    """(A shape, B shape) of an expert target in PEFT's ParamWrapper layout: A [rank * E, in] with expert e's rows
    at [e*rank, (e+1)*rank), B [out, rank * E] with expert e's column j at j*E + e. In the shared-outer layout
    (the trainer's own tensors and training state) the shared factor is one expert's: gate_up A [rank, in], down B
    [out, rank]."""
    in_features, out_features = dims
    shared_a = layout == SHARED_OUTER and module == "experts.gate_up_proj"
    shared_b = layout == SHARED_OUTER and module == "experts.down_proj"
    return ((rank if shared_a else rank * experts, in_features), (out_features, rank if shared_b else rank * experts))


def expected_shapes(base, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """PEFT key -> shape for this base model (a `loraplane.models.BaseModel`) and spec, in canonical order. A
    target a layer does not have (the experts of a dense layer) has no keys in that layer."""
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(base.num_layers):
        offered = base.layer_targets(layer) if hasattr(base, "layer_targets") else TARGET_MODULES
        for module in spec.target_modules:
            if module not in offered:
                continue
            if module in ROUTED_EXPERT_TARGETS:
                a_shape, b_shape = expert_shapes(module, base.module_dims[module], spec.rank, base.num_experts,
                                                 spec.expert_layout)
                shapes[peft_key(layer, module, "A")] = a_shape
                shapes[peft_key(layer, module, "B")] = b_shape
                continue
            in_features, out_features = base.module_dims[module]
            shapes[peft_key(layer, module, "A")] = (spec.rank, in_features)
            shapes[peft_key(layer, module, "B")] = (out_features, spec.rank)
    return shapes


def init_lora_params(base, spec: LoraSpec, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Fresh fp32 params: A kaiming-uniform(a=sqrt(5)) drawn on CPU from a generator seeded by spec.seed (layer by
    layer, modules in canonical order), so a seed gives the same adapter on every machine; B zeros."""
    generator = torch.Generator(device="cpu").manual_seed(int(spec.seed))
    params: dict[str, torch.Tensor] = {}
    for key, shape in expected_shapes(base, spec).items():
        tensor = torch.empty(shape, dtype=torch.float32)
        if key.endswith("lora_A.weight"):
            torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        else:
            tensor.zero_()
        params[key] = tensor.to(device)
    return params


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference LoRA delta, PEFT order: lora_B(lora_A(x)) * scale."""
    return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scale


@dataclass(eq=False)
class AdapterTensors:
    """One adapter's live tensors for routing: (layer, module) -> (A, B), plus its scale. Identity matters: rows
    routed to the same AdapterTensors object share one delta computation."""

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scale: float
    name: str = ""
    expert_layout: str = PER_EXPERT
    rank: int = 0

    @classmethod
    def from_params(cls, params: dict[str, torch.Tensor], spec: LoraSpec, name: str = "") -> AdapterTensors:
        modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for key, tensor in params.items():
            layer, module, which = parse_peft_key(key)
            a, b = modules.get((layer, module), (None, None))
            modules[(layer, module)] = (tensor, b) if which == "A" else (a, tensor)
        return cls(modules=modules, scale=spec.scale, name=name, expert_layout=spec.expert_layout, rank=spec.rank)


def parse_peft_key(key: str) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a key :func:`peft_key` writes; InvalidArgument for any other key."""
    parts = key.split(".")
    prefix = PEFT_PREFIX.count(".") + 1
    target = TARGET_BY_KEY_PATH.get(".".join(parts[prefix + 1:-2])) if len(parts) > prefix + 3 else None
    if (target is None or ".".join(parts[:prefix]) != PEFT_PREFIX or not parts[prefix].isdigit()
            or parts[-2] not in ("lora_A", "lora_B") or parts[-1] != "weight"):
        raise InvalidArgument(f"not a PEFT LoRA key of a decoder projection: {key!r}", field="adapter.keys")
    return int(parts[prefix]), target, parts[-2][-1]


@dataclass
class _Routing:
    # Exactly one of the three is set.
    rows: list[AdapterTensors | None] | None = None
    segments: list[tuple[int, int, AdapterTensors | None]] | None = None
    # (adapter, window start, window end, first, last, chunk start, chunk end): see lora_row_windows.
    windows: list[tuple[AdapterTensors, int, int, int, int, int, int]] | None = None
    _row_groups: list[tuple[AdapterTensors, torch.Tensor]] | None = field(default=None, repr=False)


_HOOKS_ATTR = "_loraplane_lora_hooks"
_local = threading.local()


def _current(model) -> _Routing | None:
    return _routing_for(id(model))


def _routing_for(model_id: int) -> _Routing | None:
    table = getattr(_local, "routing", None)
    return None if table is None else table.get(model_id)


def attach_multi_lora(model, target_modules: Sequence[str] = ALL_TARGETS) -> None:
    """Installs the routing hooks on every targeted projection of every decoder layer (idempotent). Where the
    targets are is the model family's (loraplane.models.families); parts of one fused projection (Tinker's
    in_proj_q/k/v on a Qwen3.5 in_proj_qkv) share one hook that adds each part's delta to its own output rows."""
    if getattr(model, _HOOKS_ATTR, None) is not None:
        return
    family = families.lookup(model.config) or families.FAMILIES["llama"]
    handles = []
    for layer_index, block in enumerate(model.model.layers):
        by_module: dict[int, tuple[torch.nn.Module, list[str]]] = {}
        for module_name in target_modules:
            if module_name in ROUTED_EXPERT_TARGETS:
                continue  # the experts' LoRA runs inside the experts implementation (attach_experts)
            linear = family.target_module(block, module_name)
            if linear is None:
                continue
            by_module.setdefault(id(linear), (linear, []))[1].append(module_name)
        for linear, names in by_module.values():
            if TARGETS[names[0]].part is None:
                handles.append(linear.register_forward_hook(_make_hook(model, layer_index, names[0])))
            else:
                widths = family.fused_widths(block, names[0])
                part_names: list[str | None] = [None] * len(widths)
                for name in names:
                    part_names[TARGETS[name].part] = name
                handles.append(linear.register_forward_hook(
                    _make_parts_hook(model, layer_index, part_names, widths)))
    handles.extend(attach_experts(model))
    setattr(model, _HOOKS_ATTR, handles)


def detach_multi_lora(model) -> None:
    for handle in getattr(model, _HOOKS_ATTR, None) or []:
        handle.remove()
    setattr(model, _HOOKS_ATTR, None)
    previous = getattr(model, "_loraplane_experts_previous", None)
    if previous is not None:
        model.config._experts_implementation = previous


def _make_hook(model, layer_index: int, module_name: str):
    key = (layer_index, module_name)
    model_id = id(model)

    def hook(_module, inputs, output):
        routing = _routing_for(model_id)
        if routing is None:
            return None
        return _apply_routing(routing, key, inputs[0], output)

    return hook


def _make_parts_hook(model, layer_index: int, names: list[str | None], widths: tuple[int, ...]):
    model_id = id(model)

    def hook(_module, inputs, output):
        routing = _routing_for(model_id)
        if routing is None:
            return None
        # Each part's delta goes to its own slice of the fused output, computed as for a projection of its own
        # (the routings add in place, so each part works on its own contiguous copy).
        pieces = list(output.split(widths, dim=-1))
        for index, name in enumerate(names):
            if name is not None:
                piece = pieces[index].clone(memory_format=torch.contiguous_format)
                pieces[index] = _apply_routing(routing, (layer_index, name), inputs[0], piece)
        return torch.cat(pieces, dim=-1)

    return hook


def _module_tensors(adapter: AdapterTensors, key) -> tuple[torch.Tensor, torch.Tensor] | None:
    pair = adapter.modules.get(key)
    if pair is None or pair[0] is None or pair[1] is None:
        return None
    return pair


def _delta(x: torch.Tensor, pair, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    a, b = pair
    return lora_delta(x.to(a.dtype), a, b, scale).to(out_dtype)


# Per adapter range, a LoRA product at most this large (rows x (in + out) x rank multiply-adds: 64 tokens of a
# SmolLM2 projection at rank 16 is ~2M) runs on the calling thread alone, forward and backward. Such matmuls take
# tens of microseconds; splitting them over the intra-op threads costs a fork/join per op that is slower even on an
# idle CPU (~50 vs ~32 us for the forward pair on 2 cores) and, when other processes hold a core, waits for the
# descheduled thread (milliseconds per op). A fused batch of 8 tenants issues thousands of them per step. The
# choice depends on the adapter's own rows and shapes only, so a tenant's numbers are the same fused or alone.
SINGLE_THREAD_MACS = 1 << 23


class _RangeDeltas(torch.autograd.Function):
    """Adds every routed adapter's delta to its own token range of one projection's output, in place:
    out[s:e] += scale * (x[s:e] A^T) B^T (PEFT's order of operations), with the backward autograd would run for
    that expression (same products, same order), for all ranges in one node. Each range's products see exactly its
    own rows, so a range's results do not depend on what else shares the batch; small ranges run on one thread
    each (see SINGLE_THREAD_MACS), shared between the calling thread and a helper thread."""

    @staticmethod
    def forward(ctx, output, x, ranges, *weights):
        flat_x = x.reshape(-1, x.shape[-1])
        flat_out = output.view(-1, output.shape[-1])
        hidden: list[torch.Tensor | None] = [None] * len(ranges)

        def one(index: int) -> None:
            start, end, scale = ranges[index]
            a, b = weights[2 * index], weights[2 * index + 1]
            h = flat_x[start:end].to(a.dtype).mm(a.t())
            delta = h.mm(b.t())
            delta.mul_(scale)
            flat_out[start:end] += delta
            hidden[index] = h

        _run_ranges(ranges, weights, one)
        ctx.mark_dirty(output)
        ctx.save_for_backward(x, *weights)
        ctx.ranges = ranges
        ctx.hidden = hidden
        return output

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        ranges, hidden = ctx.ranges, ctx.hidden
        flat_x = x.reshape(-1, x.shape[-1])
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weights: list[torch.Tensor | None] = [None] * len(weights)
        grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = torch.empty_like(flat_x)
            cursor = 0
            for start, end, _ in ranges:  # rows no adapter touches get exact zeros
                if start > cursor:
                    grad_x[cursor:start].zero_()
                cursor = end
            grad_x[cursor:].zero_()
        needs = ctx.needs_input_grad

        def one(index: int) -> None:
            start, end, scale = ranges[index]
            a, b = weights[2 * index], weights[2 * index + 1]
            g = flat_grad[start:end].to(b.dtype) * scale
            if needs[4 + 2 * index]:
                grad_weights[2 * index + 1] = g.t().mm(hidden[index])
            gh = g.mm(b)
            if needs[3 + 2 * index]:
                grad_weights[2 * index] = gh.t().mm(flat_x[start:end].to(a.dtype))
            if grad_x is not None:
                if grad_x.dtype == a.dtype:
                    torch.mm(gh, a, out=grad_x[start:end])
                else:  # fp32 adapters on a bf16/fp16 base model
                    grad_x[start:end] = gh.mm(a)

        _run_ranges(ranges, weights, one)
        ctx.hidden = None
        return (grad, None if grad_x is None else grad_x.view(x.shape), None, *grad_weights)


def _is_small(start: int, end: int, a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device.type == "cpu" and (end - start) * (a.shape[1] + b.shape[0]) * a.shape[0] <= SINGLE_THREAD_MACS


def _run_ranges(ranges, weights, one) -> None:
    """Runs one(i) for every range: large ranges with the intra-op threads, small ones one thread each. The
    decision is per range (its own rows and shapes), so it is the same whatever else shares the batch."""
    small = []
    for index, (start, end, _) in enumerate(ranges):
        if _is_small(start, end, weights[2 * index], weights[2 * index + 1]):
            small.append(index)
        else:
            one(index)
    if small:
        share_work(small, one)


@contextlib.contextmanager
def _threads_for(ranges, weights) -> Iterator[None]:
    a, b = weights[0], weights[1]
    if all(_is_small(start, end, a, b) for start, end, _ in ranges):
        with one_thread(torch.get_num_threads()):
            yield
    else:
        yield


def _apply_windows(windows, key, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    if not windows:  # a decode step of base-model rows only
        return output
    flat_x = x.reshape(-1, x.shape[-1])
    flat_out = output.view(-1, output.shape[-1])
    for adapter, window, window_end, first, last, chunk, stop in windows:
        pair = _module_tensors(adapter, key)
        if pair is None:
            continue
        a, b = pair
        window_x = flat_x[window:window_end]
        if window_x.dtype != a.dtype:  # fp32 adapters on a bf16/fp16 base model
            window_x = window_x.to(a.dtype)
        delta = lora_delta(window_x, a, b, adapter.scale)
        flat_out[chunk:stop] += delta[first:last].to(flat_out.dtype)
    return output


def _apply_routing(routing: _Routing, key, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    if routing.windows is not None:
        return _apply_windows(routing.windows, key, x, output)
    if routing.segments is not None:
        ranges = []
        weights = []
        for start, end, adapter in routing.segments:
            pair = None if adapter is None else _module_tensors(adapter, key)
            if pair is not None and end > start:
                ranges.append((start, end, adapter.scale))
                weights.extend(pair)
        if not ranges:
            return output
        return _RangeDeltas.apply(output, x, ranges, *weights)

    rows = routing.rows or []
    batch = x.shape[0]
    if len(rows) != batch:
        raise InvalidArgument(f"lora routing has {len(rows)} rows but the batch has {batch}", field="row_adapters")
    first = rows[0] if rows else None
    if rows and all(r is first for r in rows):
        pair = None if first is None else _module_tensors(first, key)
        if pair is None:
            return output
        rows_total = x.numel() // x.shape[-1]
        with _threads_for([(0, rows_total, first.scale)], pair):
            return output + _delta(x, pair, first.scale, output.dtype)
    if routing._row_groups is None:
        groups: dict[int, tuple[AdapterTensors, list[int]]] = {}
        for index, adapter in enumerate(rows):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(index)
        routing._row_groups = [
            (adapter, torch.tensor(indices, dtype=torch.long, device=x.device)) for adapter, indices in groups.values()
        ]
    result = output
    for adapter, row_index in routing._row_groups:
        pair = _module_tensors(adapter, key)
        if pair is None:
            continue
        selected = x.index_select(0, row_index)
        result = result.index_add(0, row_index, _delta(selected, pair, adapter.scale, output.dtype))
    return result


@contextlib.contextmanager
def _routing_scope(model, routing: _Routing) -> Iterator[None]:
    if getattr(model, _HOOKS_ATTR, None) is None:
        attach_multi_lora(model)
    table = getattr(_local, "routing", None)
    if table is None:
        table = _local.routing = {}
    previous = table.get(id(model))
    table[id(model)] = routing
    try:
        yield
    finally:
        if previous is None:
            table.pop(id(model), None)
        else:
            table[id(model)] = previous


def routing_state(model) -> Callable[[], contextlib.AbstractContextManager]:
    """This thread's LoRA routing of `model` (which adapter each row runs), as a context-manager factory that puts
    it in force again: activation recomputation reruns a layer's forward inside the backward, on autograd's thread,
    after the routing scope has exited."""
    routing = _current(model)

    def restore() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if routing is None else _routing_scope(model, routing)

    return restore


def lora_routing(model, row_adapters: Sequence[AdapterTensors | None]):
    """Context manager: batch row i uses row_adapters[i] (None = base model) for every forward inside it.
    Routing is per thread, so concurrent threads may drive the same model with different routings."""
    return _routing_scope(model, _Routing(rows=list(row_adapters)))


def lora_segments(model, segments: Sequence[tuple[int, int, AdapterTensors | None]]):
    """Context manager for a packed batch of shape (1, N): tokens [start, end) use that adapter. Segments must be
    sorted and non-overlapping; tokens outside every segment use the base model."""
    cursor = 0
    merged: list[tuple[int, int, AdapterTensors | None]] = []
    for start, end, adapter in segments:
        if start < cursor or end < start:
            raise InvalidArgument("lora segments must be sorted and non-overlapping", field="segments")
        cursor = end
        # Adjacent ranges of one adapter become one range: one pair of matmuls per adapter, not per datum. The
        # merged shape depends only on that adapter's own tokens, so it is the same fused or alone.
        if merged and merged[-1][1] == start and merged[-1][2] is adapter:
            merged[-1] = (merged[-1][0], end, adapter)
        else:
            merged.append((start, end, adapter))
    return _routing_scope(model, _Routing(segments=merged))


def lora_row_windows(model, slices: Sequence[tuple[AdapterTensors, int, int]], rows: int, bucket: int):
    """Context manager for batch-invariant row routing (no gradients; the sampler's decode steps): a row's output
    does not depend, bit for bit, on which other rows share the batch.

    `lora_routing` gathers each adapter's rows and multiplies them as one group, so the matmul shape (and with it
    the BLAS reduction order) changes with how many rows share the adapter. Here the caller orders the batch so
    that each adapter's rows are one contiguous slice `(adapter, first_row, end_row)` of a batch of `rows` rows
    (padded to a fixed row count; rows outside every slice use the base model). Each slice is cut into chunks of
    `bucket` rows; a chunk's delta is computed with `lora_delta` on a window of exactly `bucket` rows of the batch
    that covers the chunk, and added in place to the chunk's rows only. Every LoRA matmul therefore has the same
    shape whatever the batch holds, and there is no gather/scatter: a few kernels per chunk, and little wasted
    work for small groups. The windows are worked out once here, not once per projection in the hooks."""
    if rows < 1 or bucket < 1:
        raise InvalidArgument(f"lora row windows need rows >= 1 and bucket >= 1, got {rows}, {bucket}",
                              field="bucket")
    bucket = min(bucket, rows)
    windows: list[tuple[AdapterTensors, int, int, int, int, int, int]] = []
    cursor = 0
    for adapter, start, end in slices:
        if start < cursor or end < start or end > rows:
            raise InvalidArgument(f"lora row slices must be sorted, non-overlapping and within {rows} rows",
                                  field="slices")
        cursor = end
        for chunk in range(start, end, bucket):
            window = min(chunk, rows - bucket)
            stop = min(chunk + bucket, end)
            windows.append((adapter, window, window + bucket, chunk - window, stop - window, chunk, stop))
    return _routing_scope(model, _Routing(windows=windows))


# ------------------------------------------------------------------------------------------------ routed experts
#
# transformers keeps a Qwen3-MoE layer's experts fused: `mlp.experts.gate_up_proj` [E, 2 ffn, hidden] (gate rows
# first) and `mlp.experts.down_proj` [E, hidden, ffn]; the router `mlp.gate` picks top-k experts per token. HF's
# experts module dispatches its forward through transformers' ExpertsInterface by `config._experts_implementation`;
# `attach_multi_lora` registers ours ("loraplane") and selects it, so the model object, its router and its weights
# stay transformers' own. Ours computes, for each token range of the current routing (a tenant's tokens, or one
# batch row), the routed experts with grouped matmuls over the range's tokens sorted by expert:
#
#   gate_up = x W_gu[e]^T + scale * (x A_gu[e]^T) B_gu[e]^T      (one A per expert shared by gate and up: PEFT)
#   y       = a W_d[e]^T  + scale * (a A_d[e]^T)  B_d[e]^T,      a = silu(gate) * up
#   out[t]  = sum over the token's experts, in expert order, of weight[t, k] * y
#
# No loop over experts and no 0/1 mask: one grouped matmul per projection and range (torch._grouped_mm; CPU and
# CUDA), the LoRA factors as [E, ...] views of the PEFT tensors (or one shared factor in the shared-outer layout).
# Rows are sorted by expert, then by (k, token) as transformers' eager loop visits them, and summed in expert order
# with index_add_, so with B = 0 the result is bit for bit transformers' eager experts (fp32, CPU). A range sees
# only its own tokens, so a tenant's expert outputs and gradients do not depend on what else shares the batch.

EXPERTS_IMPLEMENTATION = "loraplane"
_MOE_SHAPE_ATTR = "_loraplane_moe_shape"


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm wants 16-byte aligned strides (fp32: every dim a multiple of 4) and matching dtypes.
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[-1] % align == 0 and w.shape[-2] % align == 0


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """x [S, k] rows sorted by group; w [G, k, n]; offsets [G] int32 cumulative ends; experts [S] the group of each
    row. Returns [S, n] with row i = x[i] @ w[experts[i]]. torch._grouped_mm where its alignment rules hold, else a
    gathered batched matmul (each row with its own group's matrix: still one op, no loop over groups)."""
    if _grouped_mm_ok(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    return torch.bmm(x.unsqueeze(1), w.index_select(0, experts)).squeeze(1)


def _a_operand(a: torch.Tensor, experts: int, rank: int) -> torch.Tensor:
    if a.shape[0] == rank * experts and experts > 1:
        return a.view(experts, rank, a.shape[1]).transpose(1, 2)  # [E, in, r]
    return a.t()  # shared: [in, r]


def _b_operand(b: torch.Tensor, experts: int, rank: int) -> torch.Tensor:
    if b.shape[1] == rank * experts and experts > 1:
        # PEFT: column j*E + e is expert e's column j.
        return b.view(b.shape[0], rank, experts).permute(2, 1, 0).contiguous()  # [E, r, out]
    return b.t()  # shared: [r, out]


def _lora_through(x, pair, rank: int, experts: int, offsets, expert_of_row, scale: float) -> torch.Tensor:
    a, b = pair
    xa = x if x.dtype == a.dtype else x.to(a.dtype)
    a_op = _a_operand(a, experts, rank)
    h = grouped_mm(xa, a_op, offsets, expert_of_row) if a_op.dim() == 3 else xa.mm(a_op)
    b_op = _b_operand(b, experts, rank)
    delta = grouped_mm(h, b_op, offsets, expert_of_row) if b_op.dim() == 3 else h.mm(b_op)
    return (delta * scale).to(x.dtype)


def _experts_range(module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   adapter: AdapterTensors | None, layer: int) -> torch.Tensor:
    tokens = top_k_index.shape[0]
    experts = module.num_experts
    # (k, token) order, stably sorted by expert: transformers' eager loop visits each expert's rows this way.
    flat = top_k_index.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert_of_row = flat.index_select(0, order)
    token_of_row = order % tokens
    weight_of_row = top_k_weights.t().reshape(-1).index_select(0, order)
    offsets = torch.cumsum(torch.bincount(expert_of_row, minlength=experts), 0).to(torch.int32)
    rows = x.index_select(0, token_of_row)
    # gpt-oss stores its experts [E, in, out] (transformers' is_transposed), with biases, gate/up interleaved and
    # a clamped SwiGLU (its own _apply_gate); the Qwen layout is [E, out, in], gate rows first, silu.
    transposed = getattr(module, "is_transposed", False)
    biased = getattr(module, "has_bias", False)
    # Nemotron-H's experts are not gated (has_gate False): up_proj [E, ffn, hidden], act(up), down_proj.
    gated = getattr(module, "has_gate", True)
    in_target, out_target = getattr(module, "_loraplane_targets", ("experts.gate_up_proj", "experts.down_proj"))
    in_param = module.gate_up_proj if gated else module.up_proj
    gate_up_w = in_param if transposed else in_param.transpose(1, 2)
    gate_up = grouped_mm(rows, gate_up_w, offsets, expert_of_row)
    if biased:
        gate_up = gate_up + (module.gate_up_proj_bias if gated else module.up_proj_bias).index_select(
            0, expert_of_row)
    pair = None if adapter is None else _module_tensors(adapter, (layer, in_target))
    if pair is not None:
        gate_up = gate_up + _lora_through(rows, pair, adapter.rank, experts, offsets, expert_of_row, adapter.scale)
    if not gated:
        hidden = module.act_fn(gate_up)
    elif transposed or biased:
        hidden = module._apply_gate(gate_up)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = module.act_fn(gate) * up
    out = grouped_mm(hidden, module.down_proj if transposed else module.down_proj.transpose(1, 2), offsets,
                     expert_of_row)
    if biased:
        out = out + module.down_proj_bias.index_select(0, expert_of_row)
    pair = None if adapter is None else _module_tensors(adapter, (layer, out_target))
    if pair is not None:
        out = out + _lora_through(hidden, pair, adapter.rank, experts, offsets, expert_of_row, adapter.scale)
    out = out * weight_of_row.unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_of_row, out.to(x.dtype))


def _token_ranges(routing: _Routing | None, tokens: int, shape) -> list[tuple[int, int, AdapterTensors | None]]:
    """The routing as ranges of the flattened tokens: a trainer segment per adapter run, or one batch row each."""
    if routing is None:
        rows = shape[0] if shape is not None and shape[0] * shape[1] == tokens else 1
        per_row = tokens // rows
        return [(r * per_row, (r + 1) * per_row, None) for r in range(rows)]
    if routing.segments is not None:
        ranges: list[tuple[int, int, AdapterTensors | None]] = []
        cursor = 0
        for start, end, adapter in routing.segments:
            if start > cursor:
                ranges.append((cursor, start, None))
            if end > start:
                ranges.append((start, end, adapter))
            cursor = max(cursor, end)
        if cursor < tokens:
            ranges.append((cursor, tokens, None))
        return ranges
    if routing.rows is not None:
        row_adapters = list(routing.rows)
    else:
        count = shape[0] if shape is not None else 1
        row_adapters = [None] * count
        for adapter, _window, _window_end, _first, _last, chunk, stop in routing.windows or ():
            for row in range(chunk, stop):
                row_adapters[row] = adapter
    per_row = tokens // max(1, len(row_adapters))
    return [(r * per_row, (r + 1) * per_row, adapter) for r, adapter in enumerate(row_adapters)]


def _loraplane_experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    model_id = getattr(module, "_loraplane_model_id", None)
    table = getattr(_local, "routing", None)
    routing = None if table is None or model_id is None else table.get(model_id)
    shape = getattr(_local, "moe_shape", None)
    ranges = _token_ranges(routing, hidden_states.shape[0], shape)
    layer = getattr(module, "_loraplane_layer", -1)
    outputs = [_experts_range(module, hidden_states[start:end], top_k_index[start:end], top_k_weights[start:end],
                              adapter, layer) for start, end, adapter in ranges if end > start]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _register_experts_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, _loraplane_experts_forward)


def _record_moe_shape(_module, args, kwargs):
    # The experts see flattened tokens; a row routing needs the (batch, seq) shape of the block's input.
    hidden = args[0] if args else kwargs.get("hidden_states")
    _local.moe_shape = tuple(hidden.shape[:2]) if hidden is not None and hidden.dim() == 3 else None


def attach_experts(model) -> list:
    """Routes every MoE layer's experts through `_loraplane_experts_forward` (returns the hook handles)."""
    handles = []
    # The experts live in a decoder layer's mlp, or in a Nemotron-H MoE block's mixer; their two targets are the
    # ones TARGETS places there (input side first).
    moe_blocks = []
    for i, block in enumerate(model.model.layers):
        for owner_name in ("mlp", "mixer"):
            owner = getattr(block, owner_name, None)
            if getattr(owner, "experts", None) is not None:
                moe_blocks.append((i, owner, tuple(t for t in ROUTED_EXPERT_TARGETS
                                                   if TARGETS[t].module == f"{owner_name}.experts")))
                break
    if not moe_blocks:
        return handles
    _register_experts_implementation()
    for index, mlp, targets in moe_blocks:
        mlp.experts._loraplane_layer = index
        mlp.experts._loraplane_model_id = id(model)
        mlp.experts._loraplane_targets = targets
        handles.append(mlp.register_forward_pre_hook(_record_moe_shape, with_kwargs=True))
    # The config object is shared by every experts module of the model (and its sub-configs).
    if model.config._experts_implementation != EXPERTS_IMPLEMENTATION:
        model._loraplane_experts_previous = model.config._experts_implementation
    model.config._experts_implementation = EXPERTS_IMPLEMENTATION
    return handles
