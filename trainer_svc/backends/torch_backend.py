"""Torch backend: the HF transformers model runs every base computation; LoRA comes from `loraplane.lora` hooks.

Fused batches are packed: the datums of every request in the batch are laid end to end in one (1, N) sequence,
attention runs per datum (`loraplane.models.packed`), and each token range is routed to its own adapter
(`loraplane.lora.lora_segments`). This is what makes a fused batch bit-identical, per adapter, to running that
adapter's request alone (fp32, CPU), which we verified empirically for this CPU's BLAS:

* Linear layers see a (N, K) matrix. MKL/oneDNN sgemm rows are independent of the other rows as long as M is not
  tiny: M < 12 takes other kernels whose rounding differs. We therefore pad every packed batch to at least
  MIN_PACKED_TOKENS tokens with a dummy segment (no adapter, attention to itself only).
* Attention is computed per datum on that datum's own (1, H, T, D) tensors, so padding never changes the key length
  (a padded SDPA call rounds differently from an unpadded one); a run of equal-length datums goes through SDPA as
  one (count, H, T, D) batch, which computes each entry exactly as alone.
* Each adapter's LoRA matmuls (forward and weight gradients) see exactly its own tokens in the same order, fused or
  not. The lm_head and log-softmax are row-wise like every other linear layer: one projection for all tokens.
* One backward over the sum of the items' losses: d(sum)/d(loss_i) = 1, and every per-token quantity is reached
  only through its own datum, so each adapter gets the gradient it would get alone (sums with exact zeros from
  other adapters' ranges leave values unchanged).

On CUDA the contract is bf16 bounds, not bit-exactness, and the families' per-datum pieces run in one call per
layer (loraplane.models.packed's implementations). Activation recomputation (:class:`LayerRecompute`) keeps a
step that would not fit the device's memory from running out of it, and :meth:`TorchBackend.memory_plan` refuses
an adapter whose training state cannot fit before it is created.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading

import torch
from torch.utils.checkpoint import checkpoint

from loraplane import lora as lora_module
from loraplane.errors import InvalidArgument, ResourceExhausted
from loraplane.lora import LoraSpec, attach_multi_lora, lora_segments, routing_state
from loraplane.models import BaseModel, load_base_model
from loraplane.models.packed import enable_packed_attention, packed_position_ids, packed_sequences, packed_state
from trainer_svc.backends.base import BatchItem, DatumResult, ItemResult, TrainerBackend
from trainer_svc.losses import elementwise_loss, own_targets, packed_targets

MIN_PACKED_TOKENS = 16
RECOMPUTE_MODES = ("auto", "none", "full")
RECOMPUTE_ENV = "LORAPLANE_TORCH_RECOMPUTE"
# Device memory kept out of every plan: allocator fragmentation, kernel workspaces, the CUDA context's growth.
RESERVE_FRACTION = 0.06
# An adapter slot on the device: fp32 params, their gradients, both AdamW moments.
SLOT_BYTES_PER_PARAM = 16
log = logging.getLogger(__name__)


class TorchBackend(TrainerBackend):
    name = "torch"

    def __init__(self, base_model: str | BaseModel = "tiny", device: str = "cpu", dtype: torch.dtype = torch.float32,
                 recompute: str | None = None):
        self.base = base_model if isinstance(base_model, BaseModel) else load_base_model(
            base_model, device=device, dtype=dtype)
        enable_packed_attention(self.base.model)
        # What else a family needs to keep datums of one row apart (Qwen3.5: the linear-attention state).
        self.base.family.enable_packing(self.base.model)
        attach_multi_lora(self.base.model)
        self.recompute = LayerRecompute(self.base.model, recompute or os.environ.get(RECOMPUTE_ENV) or "auto")
        if self.device.type == "cuda":
            self.recompute.logits_chunk = self.logits_chunk
        self._lock = threading.Lock()

    def init_params(self, spec: LoraSpec) -> dict[str, torch.Tensor]:
        """As every backend's, after the memory plan said the adapter's training state fits the device."""
        self.check_slot_fits(spec)
        return super().init_params(spec)

    # -- memory --------------------------------------------------------------------------------------------------

    # The vocabulary projection in chunks of this many tokens (CUDA), each recomputed in the backward: the fp32
    # logits of 8 x 2048 tokens over Qwen3.5's 248k vocabulary and their log-softmax are 33 GB at once. 0: one
    # projection. The CPU keeps one projection (bit-exactness: a GEMM's rows round alike only for enough rows).
    logits_chunk = int(os.environ.get("LORAPLANE_LOGITS_CHUNK", "2048"))

    def logits_chunk_tokens(self, tokens: int, device: torch.device) -> int:
        if device.type != "cuda" or self.logits_chunk <= 0 or tokens <= self.logits_chunk:
            return 0
        return self.logits_chunk

    def slot_bytes(self, spec: LoraSpec) -> int:
        """Device bytes one resident adapter of `spec` holds while training (AdapterState.device_bytes of it)."""
        from loraplane.lora import expected_shapes

        params = sum(math.prod(shape) for shape in expected_shapes(self.base, spec).values())
        return SLOT_BYTES_PER_PARAM * params

    def memory_plan(self, spec: LoraSpec | None = None, tokens: int = 0) -> dict[str, float]:
        """What the device holds and what a step needs, in GiB: the device's total, the base model's weights,
        what is free now, one adapter slot of `spec`, the logits of `tokens` and the layers' activations
        (`activations_gib`: without recomputation; `min_activations_gib`: every layer recomputed)."""
        gib = 2.0**30
        base = sum(p.numel() * p.element_size() for p in {id(p): p for p in self.base.model.parameters()}.values())
        plan = {"base_gib": base / gib}
        if spec is not None:
            plan["slot_gib"] = self.slot_bytes(spec) / gib
        if self.device.type == "cuda":
            free, total = _free_bytes(self.device)
            plan.update(total_gib=total / gib, free_gib=free / gib, reserve_gib=RESERVE_FRACTION * total / gib)
        if tokens:
            plan["logits_gib"] = self.recompute.logits_bytes(tokens) / gib
            if self.device.type == "cuda":
                full, least = self.recompute.activation_bytes(tokens)
                plan.update(activations_gib=full / gib, min_activations_gib=least / gib)
        return plan

    def check_slot_fits(self, spec: LoraSpec, tokens: int = 0) -> None:
        """ResourceExhausted, naming the numbers, when one adapter slot of `spec` (and, with `tokens`, a step of that
        many tokens with every layer recomputed) cannot fit the device beside the base model even with no other
        adapter resident: said at CreateAdapter, not as an out-of-memory error in the middle of a step. (Other
        adapters are the pool's to spill; CPU: no check, host memory is the operator's.)"""
        if self.device.type != "cuda":
            return
        plan = self.memory_plan(spec, tokens)
        need = plan["slot_gib"] + plan.get("logits_gib", 0.0) + plan.get("min_activations_gib", 0.0)
        room = plan["total_gib"] - plan["reserve_gib"] - plan["base_gib"]
        if need <= room:
            return
        experts = [t for t in spec.target_modules if t.startswith("experts.") or ".experts." in t]
        hint = ""
        if experts and spec.expert_layout == lora_module.PER_EXPERT:
            shared = LoraSpec.create(spec.rank, spec.alpha, spec.target_modules, spec.seed,
                                     max_rank=max(spec.rank, lora_module.DEFAULT_MAX_RANK),
                                     expert_layout=lora_module.SHARED_OUTER)
            hint = (f"; its per-expert LoRA on {self.base.num_experts} experts is most of it: expert_layout "
                    f"shared_outer needs {self.slot_bytes(shared) / 2**30:.1f} GiB")
        raise ResourceExhausted(
            f"an adapter of rank {spec.rank} on {len(spec.target_modules)} targets needs {plan['slot_gib']:.1f} GiB on "
            f"{self.device} (fp32 params, gradients and AdamW moments)"
            + (f" plus {need - plan['slot_gib']:.1f} GiB for a {tokens}-token step" if tokens else "")
            + f"; the device has {room:.1f} GiB beside the base model ({plan['base_gib']:.1f} GiB) and a "
            f"{plan['reserve_gib']:.1f} GiB reserve{hint}", field="lora_config")

    @property
    def device(self) -> torch.device:
        return self.base.device

    def run(self, items: list[BatchItem], *, backward: bool) -> list[ItemResult]:
        with self._lock:
            return self._run(items, backward)

    def _run(self, items: list[BatchItem], backward: bool) -> list[ItemResult]:
        device = self.device
        lengths: list[int] = []
        segments = []
        inputs = []
        cursor = 0
        for item in items:
            adapter = item.state.tensors()
            for datum in item.data:
                lengths.append(datum.length)
                segments.append((cursor, cursor + datum.length, adapter))
                inputs.append(datum.input_tokens)
                cursor += datum.length
        if cursor < MIN_PACKED_TOKENS:
            filler = MIN_PACKED_TOKENS - cursor
            pad_id = max(self.base.pad_token_id, 0)
            inputs.append(torch.full((filler,), pad_id, dtype=torch.long))
            lengths.append(filler)
        input_ids = torch.cat(inputs).to(device).unsqueeze(0)
        position_ids = packed_position_ids(lengths, device=device)
        datums = [datum for item in items for datum in item.data]
        # Soft targets ((N, K) target_tokens) in the batch: one [T, Kmax] gather, each datum reading its own
        # columns. A gather only indexes, so every value equals the 1-D gather's.
        targets = packed_targets([datum.target_tokens for datum in datums]).to(device)
        wide = targets.dim() == 2
        grad_mode = torch.enable_grad() if backward else torch.no_grad()
        # The gradients the backward allocates for the first time (an adapter's first step) come out of the budget.
        new_grads = sum(p.numel() * p.element_size() for item in items for p in item.state.params.values()
                        if p.grad is None) if backward else 0
        self.recompute.plan(len(position_ids[0]), backward, device, extra_bytes=new_grads)
        with grad_mode, packed_sequences(lengths), lora_segments(self.base.model, segments):
            hidden = self.base.model.model(input_ids=input_ids, position_ids=position_ids,
                                           use_cache=False).last_hidden_state[0]
            # One vocabulary projection over the whole packed batch (filler included, so it too sees >= 16 rows)
            # and one log-softmax over the real tokens: a projection per datum streams the whole lm_head weight
            # from memory once per datum. Both are row-wise, so each token's logprob is the same whatever else is
            # in the batch, as for every other linear layer here.
            head = self.base.model.get_output_embeddings()
            chunk = self.logits_chunk_tokens(cursor, device)
            if chunk:
                token_logprobs = chunked_target_logprobs(head, hidden[:cursor], targets, chunk, backward)
            else:
                logits = head(hidden)
                logits = (logits if cursor == logits.shape[0] else logits[:cursor]).float()
                token_logprobs = _target_logprobs(logits, targets)
                del logits
            item_losses = []
            datum_losses_detached = []
            datum_logprobs = []
            # One split, not a slice per datum: a slice's backward zero-fills a gradient of the whole batch.
            pieces = iter(torch.split(token_logprobs, [datum.length for datum in datums]))
            for item in items:
                datum_losses = []
                for datum in item.data:
                    lp = own_targets(next(pieces), datum.targets_per_position)
                    if wide:
                        datum_logprobs.append(lp.detach().reshape(-1))
                    loss = elementwise_loss(
                        item.loss_fn, item.loss_config, lp,
                        weights=_on(datum.weights, device), q=_on(datum.logprobs, device),
                        advantages=_on(datum.advantages, device))
                    datum_losses.append(loss.sum())
                    datum_losses_detached.append(loss.detach())
                item_losses.append(torch.stack(datum_losses).sum())
            if backward:
                total = None
                for item_loss in item_losses:
                    total = item_loss if total is None else total + item_loss
                if total is not None and total.requires_grad:
                    total.backward()
        # Host values in one transfer each; the per-datum lists are slices of them.
        logprob_values = (torch.cat(datum_logprobs) if wide else token_logprobs.detach()).cpu().tolist()
        loss_values = torch.cat(datum_losses_detached).cpu().tolist()
        item_sums = torch.stack([loss.detach() for loss in item_losses]).cpu().tolist()
        results: list[ItemResult] = []
        start = lp_start = 0
        for item, item_sum in zip(items, item_sums):
            outputs = []
            for datum in item.data:
                end = start + datum.length
                k = datum.targets_per_position
                lp_end = lp_start + datum.length * k
                outputs.append(DatumResult(logprob_values[lp_start:lp_end], loss_values[start:end], k))
                start, lp_start = end, lp_end
            results.append(ItemResult(outputs, {
                "loss:sum": float(item_sum),
                "num_tokens:sum": float(sum(datum.length for datum in item.data)),
                "num_datums:sum": float(len(item.data)),
            }))
        return results


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's log-probabilities of its targets ((N,) or soft (N, K)) from fp32 logits."""
    if targets.dim() == 2:
        return torch.log_softmax(logits, dim=-1).gather(1, targets)
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _target_logprobs(head(hidden).float(), targets)


def chunked_target_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int,
                            backward: bool) -> torch.Tensor:
    """:func:`_target_logprobs` of ``head(hidden)`` a chunk of rows at a time; with a backward, each chunk keeps only
    its hidden rows and recomputes its logits when the backward reaches it (non-reentrant checkpoint), so the step
    holds one chunk's logits at a time instead of every token's. Row-wise, the same values as one projection up to
    the GEMM's blocking."""
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        rows, wanted = hidden[start:start + chunk], targets[start:start + chunk]
        if backward and torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, head, rows, wanted, use_reentrant=False,
                                     preserve_rng_state=False))
        else:
            pieces.append(_chunk_logprobs(head, rows, wanted))
    return torch.cat(pieces)


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _free_bytes(device: torch.device) -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info(device)
    # What the allocator holds but does not use is free to a step too.
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


# ------------------------------------------------------------------------------------------------ recomputation

class LayerRecompute:
    """Per-decoder-layer activation recomputation (``torch.utils.checkpoint``, non-reentrant): a recomputed layer
    keeps only its input for the backward and runs its forward again when the backward reaches it.

    Modes: ``none``; ``full`` (every layer, every backward); ``auto`` (default): on CUDA, as few layers as make the
    step's activations fit the free device memory (the largest first), none when they fit; on CPU none. The policy
    is the megatron backend's ``--recompute auto`` (trainer_svc/backends/megatron/recompute.py: budget = free memory
    less the logits and a reserve; recompute until the estimate fits), with the per-layer bytes measured instead of
    derived from a megatron layer spec: the HF layers differ by family (a Gated DeltaNet layer on transformers'
    fp32 torch kernel keeps several times what an attention layer keeps), so one forward of a calibration row
    counts what each layer saves for the backward (:meth:`measure`).

    Exact: the recomputation reruns the same ops on the same inputs, so every gradient equals the one without
    recomputation bit for bit on CPU (tests/unit/test_torch_recompute.py). The LoRA routing and the packed-row
    scope are thread-local and the recomputation runs inside the backward (on autograd's thread on CUDA, after the
    step's scopes have exited), so both are captured at the forward and put back in force around it."""

    def __init__(self, model, mode: str = "auto", calibration_tokens: int = 1024):
        if mode not in RECOMPUTE_MODES:
            raise InvalidArgument(f"recompute {mode!r}: one of {RECOMPUTE_MODES}", field="recompute")
        self.mode = mode
        self.model = model
        self.layers = list(model.model.layers)
        self.selected: frozenset[int] = frozenset()
        self.calibration_tokens = calibration_tokens
        self._per_token: list[float] | None = None  # bytes each layer keeps per token without recomputation
        config = model.config
        self._hidden_bytes = int(config.hidden_size) * _dtype_bytes(model)
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._dtype_bytes = _dtype_bytes(model)
        for index, layer in enumerate(self.layers):
            if not hasattr(layer, "_loraplane_unwrapped_forward"):
                layer._loraplane_unwrapped_forward = layer.forward
            layer.forward = self._wrap(index, layer._loraplane_unwrapped_forward)

    def _wrap(self, index: int, forward):
        model = self.model

        def run(*args, **kwargs):
            if index not in self.selected or not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            routing_scope = routing_state(model)
            packed_scope = packed_state()

            @contextlib.contextmanager
            def in_force():
                with packed_scope(), routing_scope():
                    yield

            def contexts():
                return contextlib.nullcontext(), in_force()

            return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, preserve_rng_state=False,
                              **kwargs)

        return run

    # -- the plan -------------------------------------------------------------------------------------------------

    def plan(self, tokens: int, backward: bool, device: torch.device, extra_bytes: int = 0) -> frozenset[int]:
        """Sets (and returns) the layers the next forward recomputes; `extra_bytes`: what else the step will
        allocate beside activations and logits (first gradients)."""
        if not backward or self.mode == "none" or (self.mode == "auto" and device.type != "cuda"):
            self.selected = frozenset()
        elif self.mode == "full":
            self.selected = frozenset(range(len(self.layers)))
        else:
            free, total = _free_bytes(device)
            per_layer = self.layer_bytes(tokens, device)
            budget = free - self.logits_bytes(tokens) - extra_bytes - RESERVE_FRACTION * total
            self.selected = choose_layers(per_layer, self._hidden_bytes * tokens, budget)
            if self.selected:
                log.info("recomputing %d of %d layers for a %d-token step", len(self.selected), len(self.layers),
                         tokens)
        return self.selected

    logits_chunk = 0  # the backend's chunk of the vocabulary projection (TorchBackend.logits_chunk_tokens)

    def logits_bytes(self, tokens: int) -> int:
        """The logits in the model's dtype, their fp32 copy, log-softmax and its gradient (of one chunk of
        `logits_chunk` tokens, plus the (tokens,) logprobs, when the projection is chunked)."""
        if 0 < self.logits_chunk < tokens:
            return min(tokens, self.logits_chunk) * self._vocab * (self._dtype_bytes + 12) + 8 * tokens
        return tokens * self._vocab * (self._dtype_bytes + 12)

    # What a layer really costs over what the calibration counts: the LoRA deltas and their mids (the calibration
    # row runs without them) and the backward's transients. Measured on an H200 at 8 x 2048 (run s32, no layer
    # recomputed): Qwen3.5-9B with fla ran out of 131 GiB where the count said 66 GiB of activations, gpt-oss-20b
    # out of 93 GiB where it said 75; 3x the count plans both with room.
    UNDERCOUNT = 3.0

    def layer_bytes(self, tokens: int, device: torch.device) -> list[float]:
        """Each layer's activations for `tokens` without recomputation (measured once, scaled by tokens and by
        UNDERCOUNT)."""
        if self._per_token is None:
            self._per_token = self.measure(device)
        return [self.UNDERCOUNT * b * tokens for b in self._per_token]

    def activation_bytes(self, tokens: int) -> tuple[float, float]:
        """(every layer's activations, the least any plan keeps: each layer's input plus one layer's working set)."""
        per_layer = self.layer_bytes(tokens, next(self.model.parameters()).device)
        return sum(per_layer), len(per_layer) * self._hidden_bytes * tokens + max(per_layer, default=0.0)

    @torch.no_grad()
    def measure(self, device: torch.device) -> list[float]:
        """Bytes per token each decoder layer saves for the backward, from one packed forward of a calibration row
        whose embeddings require grad: every tensor autograd saves is counted once per storage (the weights, which
        are saved by reference, not at all) and dropped at once, so the calibration itself keeps nothing."""
        tokens = self.calibration_tokens
        selected, self.selected = self.selected, frozenset()  # a checkpointed layer would hide what it saves
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        seen: list[dict[int, int]] = [{} for _ in self.layers]
        current = [-1]

        def pack(tensor):
            if current[0] >= 0 and isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in params:
                    seen[current[0]][storage.data_ptr()] = storage.nbytes()
            # Nothing is kept: the calibration row never runs a backward.

        def enter(index):
            def hook(*_):
                current[0] = index
            return hook

        def leave(*_):
            current[0] = -1

        handles = []
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(enter(index)))
            handles.append(layer.register_forward_hook(leave))
        try:
            ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
            with torch.enable_grad(), packed_sequences([tokens]), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
                embeds = self.model.get_input_embeddings()(ids).detach().requires_grad_()
                self.model.model(inputs_embeds=embeds, position_ids=packed_position_ids([tokens], device=device),
                                 use_cache=False)
        finally:
            self.selected = selected
            for handle in handles:
                handle.remove()
        return [sum(found.values()) / tokens for found in seen]


def choose_layers(layer_bytes: list[float], kept_bytes: float, budget: float) -> frozenset[int]:
    """The fewest layers to recompute so that the activations fit `budget`: `layer_bytes` each layer keeps without
    recomputation, `kept_bytes` what a recomputed layer keeps (its input), plus the largest layer's working set when
    it reruns. The largest layers go first (a Gated DeltaNet layer before an attention layer); all of them when
    even that does not fit (the step then runs as small as it can)."""
    order = sorted(range(len(layer_bytes)), key=lambda i: (-layer_bytes[i], i))
    need = sum(layer_bytes) + max(layer_bytes, default=0.0)
    chosen: list[int] = []
    for index in order:
        if need <= budget:
            break
        chosen.append(index)
        need -= layer_bytes[index] - kept_bytes
    return frozenset(chosen)


def _dtype_bytes(model) -> int:
    return next(model.parameters()).element_size()
