"""In-process multi-LoRA generation with a KV cache and continuous batching (CPU or GPU).

One worker thread owns the model. Between decode steps it admits queued requests (prefill, batch of one), then runs
one decode step for every active row; each row uses its own adapter version or the base model.

Batch invariance (a row's tokens and logprobs do not depend on which other rows share its batch, bit for bit):
* each row has its own KV cache and its own attention call, so no padding ever enters a row's softmax;
* every matmul of a decode step runs on a row count padded to a fixed bucket (`decode_row_pad`, 16): BLAS picks
  kernels and blocking by shape, so the same shape gives each row the same reduction order whatever its neighbours;
  the LoRA delta of each adapter's rows is likewise computed on fixed-size row windows
  (`loraplane.lora.lora_row_windows`, the same hooks the trainer and the prefill route through);
* sampling uses one torch.Generator per row, seeded from (seed, sample index), so the same seed gives the same
  tokens in any batch.
Prefill runs alone (one request, its true length), so prompt logprobs are batch-independent too.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraplane import errors
from loraplane.adapter_format import parse_adapter
from loraplane.lora import (
    AdapterTensors,
    attach_multi_lora,
    expected_shapes,
    lora_routing,
    lora_row_windows,
    lora_segments,
)
from loraplane.models import BaseModel, load_base_model
from sampler_svc.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    GenerationRequest,
    GenerationUpdate,
    LoadedAdapterInfo,
    TopkRows,
)

log = logging.getLogger(__name__)


def _pad_rows(count: int, bucket: int) -> int:
    return max(bucket, -(-count // bucket) * bucket)


@dataclass
class _Request:
    request: GenerationRequest
    adapter: AdapterTensors | None
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    stop_token_ids: frozenset[int]
    cancelled: bool = False
    rows_left: int = 0
    enqueued_at: float = field(default_factory=time.monotonic)

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening anymore
            self.cancelled = True


@dataclass
class _Row:
    owner: _Request
    sample_index: int
    generator: torch.Generator
    keys: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    values: torch.Tensor
    length: int  # tokens in the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_token: int = 0
    finish_reason: str | None = None
    # transformers' own cache of this row, for families the engine decodes through the HF forward (hf_decode).
    cache: object | None = None


class TorchEngine(Engine):
    name = "torch"

    def __init__(
        self,
        base_model: str = "tiny",
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_rows: int = 16,
        max_queue: int = 256,
        decode_row_pad: int = 16,
        lora_row_bucket: int = 4,
    ):
        self._base_model_name = base_model
        self._device = torch.device(device)
        self._dtype = dtype
        self.max_batch_rows = max_batch_rows
        self.max_queue = max_queue
        self.decode_row_pad = decode_row_pad
        self.lora_row_bucket = min(lora_row_bucket, decode_row_pad)
        self.base: BaseModel | None = None
        self._adapters: dict[str, AdapterTensors] = {}
        self._pending: deque[_Request] = deque()
        self._rows: list[_Row] = []
        self._wakeup = threading.Condition()
        self._worker: threading.Thread | None = None
        self._stopping = False
        self.decode_steps = 0
        # Time inside decode steps and the tokens they produced (benchmarks read decode throughput from these).
        self.decode_seconds = 0.0
        self.decode_tokens = 0

    # ------------------------------------------------------------------ Engine properties

    @property
    def base_model_name(self) -> str:
        return self._base_model_name

    @property
    def vocab_size(self) -> int:
        return self._require_base().vocab_size

    @property
    def max_context_length(self) -> int:
        return self._require_base().max_context_length

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._require_base().eos_token_ids)

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def running_requests(self) -> int:
        return len({id(row.owner) for row in self._rows})

    def _require_base(self) -> BaseModel:
        if self.base is None:
            raise errors.Unavailable("the torch engine is not started")
        return self.base

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.base = await asyncio.to_thread(load_base_model, self._base_model_name, str(self._device), self._dtype)
        attach_multi_lora(self.base.model, tuple(self.base.module_dims))
        self._worker = threading.Thread(target=self._run_worker, name="torch-engine", daemon=True)
        self._worker.start()

    async def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.join, 30)

    # ------------------------------------------------------------------ adapters

    async def load_adapter(self, key: str, blob: bytes) -> LoadedAdapterInfo:
        base = self._require_base()
        adapter = await asyncio.to_thread(self._prepare_adapter, base, key, blob)
        self._adapters[key] = adapter
        return LoadedAdapterInfo(key=key, rank=adapter.rank or next(iter(adapter.modules.values()))[0].shape[0])

    def _prepare_adapter(self, base: BaseModel, key: str, blob: bytes) -> AdapterTensors:
        params, spec, base_name = parse_adapter(blob)
        if base_name and base_name != base.name:
            raise errors.FailedPrecondition(
                f"{key} was trained on base model {base_name!r}; this sampler serves {base.name!r}", field="adapter")
        expected = expected_shapes(base, spec)
        for name, tensor in params.items():
            if expected.get(name) != tuple(tensor.shape):
                raise errors.FailedPrecondition(
                    f"{key}: tensor {name} has shape {tuple(tensor.shape)}, base model {base.name!r} needs "
                    f"{expected.get(name)}", field="adapter")
        # The registry checks a blob's layers against each other only (it has no base model): a layer of this
        # model without one of the adapter's targets it offers would silently serve the base weights there.
        missing = [name for name in expected if name not in params]
        if missing:
            raise errors.FailedPrecondition(
                f"{key}: {len(missing)} tensors base model {base.name!r} needs for the adapter's targets are "
                f"missing, first {missing[0]}", field="adapter")
        params = {k: v.to(device=self._device, dtype=torch.float32) for k, v in params.items()}
        return AdapterTensors.from_params(params, spec, name=key)

    async def unload_adapter(self, key: str) -> None:
        # Rows already running keep their own reference to the tensors; the manager unloads only idle versions.
        self._adapters.pop(key, None)

    def _adapter(self, key: str | None) -> AdapterTensors | None:
        if key is None:
            return None
        adapter = self._adapters.get(key)
        if adapter is None:
            raise errors.NotFound(f"adapter version {key} is not loaded in the engine", field="adapter")
        return adapter

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        base = self._require_base()
        stop_ids = frozenset(request.options.stop_token_ids)
        if not request.options.ignore_eos:
            stop_ids |= frozenset(base.eos_token_ids)
        state = _Request(request=request, adapter=self._adapter(request.adapter_key),
                         loop=asyncio.get_running_loop(), updates=asyncio.Queue(), stop_token_ids=stop_ids,
                         rows_left=request.num_samples)
        with self._wakeup:
            if len(self._pending) >= self.max_queue:
                raise errors.ResourceExhausted(f"the sampler queue is full ({self.max_queue} requests waiting)")
            self._pending.append(state)
            self._wakeup.notify_all()
        finished = 0
        try:
            while finished < request.num_samples:
                item = await state.updates.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    finished += 1
                yield item
        finally:
            state.cancelled = True

    async def compute_logprobs(self, tokens: Sequence[int], adapter_key: str | None) -> list[float]:
        adapter = self._adapter(adapter_key)
        return await asyncio.to_thread(self._score, list(tokens), adapter)

    def _score(self, tokens: list[int], adapter: AdapterTensors | None) -> list[float]:
        with torch.inference_mode():
            logits, _, _ = self._prefill(tokens, adapter)
            return _prompt_logprobs(logits, tokens)

    # ------------------------------------------------------------------ the worker

    def _run_worker(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wakeup:
                while not self._stopping and not self._pending and not self._rows:
                    self._wakeup.wait()
                if self._stopping:
                    break
                admitted: list[_Request] = []
                while self._pending and (len(self._rows) + sum(r.request.num_samples for r in admitted)
                                         + self._pending[0].request.num_samples <= self.max_batch_rows
                                         or not self._rows and not admitted):
                    admitted.append(self._pending.popleft())
            try:
                with torch.inference_mode():
                    for state in admitted:
                        if not state.cancelled:
                            self._admit(state)
                    self._rows = [row for row in self._rows if not row.owner.cancelled]
                    if self._rows:
                        self._decode_step()
            except Exception as exc:
                log.exception("torch engine step failed")
                failed = {id(row.owner): row.owner for row in self._rows}
                failed.update({id(s): s for s in admitted})
                for state in failed.values():
                    state.emit(errors.Unavailable(f"the torch engine failed: {type(exc).__name__}: {exc}"))
                    state.cancelled = True
                self._rows = []
        for row in self._rows:
            row.owner.emit(errors.Unavailable("the sampler is shutting down"))
        for state in self._pending:
            state.emit(errors.Unavailable("the sampler is shutting down"))

    def _admit(self, state: _Request) -> None:
        request = state.request
        prompt = list(request.prompt_tokens)
        if self._require_base().family.hf_decode:
            logits, cache = self._hf_prefill(prompt, state.adapter, all_logits=request.wants_prompt_scores)
            keys = values = None
        else:
            logits, keys, values = self._prefill(prompt, state.adapter, all_logits=request.wants_prompt_scores)
        if request.wants_prompt_scores:
            start = request.first_scored_position
            update = GenerationUpdate(sequence_index=0)
            if request.include_prompt_logprobs:
                update.prompt_logprobs = _prompt_logprobs(logits, prompt, start)
            if request.topk_prompt_logprobs:
                update.topk_prompt = _topk_prompt(logits, len(prompt), start, request.topk_prompt_logprobs)
            state.emit(update)
        capacity = len(prompt) + request.options.max_tokens
        last_logits = logits[-1]
        for sample_index in range(request.num_samples):
            if keys is None:
                row = _Row(owner=state, sample_index=sample_index,
                           generator=_row_generator(request.options.seed, sample_index), keys=None, values=None,
                           length=len(prompt),
                           cache=cache if sample_index == request.num_samples - 1 else copy.deepcopy(cache))
                self._append_token(row, last_logits)
                self._flush(row)
                if row.finish_reason is None:
                    self._rows.append(row)
                continue
            row_keys = keys.new_empty((keys.shape[0], keys.shape[1], capacity, keys.shape[3]))
            row_values = values.new_empty(row_keys.shape)
            row_keys[:, :, : len(prompt)] = keys
            row_values[:, :, : len(prompt)] = values
            row = _Row(owner=state, sample_index=sample_index,
                       generator=_row_generator(request.options.seed, sample_index), keys=row_keys,
                       values=row_values, length=len(prompt))
            self._append_token(row, last_logits)
            self._flush(row)
            if row.finish_reason is None:
                self._rows.append(row)

    def _prefill(self, tokens: list[int], adapter: AdapterTensors | None, *, all_logits: bool = True):
        """Full forward of one sequence: logits [T, V] (fp32; only the last position's, [1, V], unless
        all_logits) and its KV cache [layers, kv_heads, T, head_dim]. Skipping the vocabulary projection of the
        prompt positions saves a fifth of a SmolLM2 prefill when no prompt logprobs are wanted."""
        base = self._require_base()
        if base.family.hf_decode:
            return self._hf_prefill(tokens, adapter, all_logits=all_logits)[0], None, None
        model = base.model
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)
        positions = torch.arange(len(tokens), device=self._device)[None]
        hidden = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary_emb(hidden, positions)
        keys, values = [], []
        with lora_routing(model, [adapter]):
            for layer in model.model.layers:
                attn = layer.self_attn
                residual = hidden
                x = layer.input_layernorm(hidden)
                q, k, v = _project_qkv(attn, x, cos, sin)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                                     enable_gqa=q.shape[1] != k.shape[1])
                hidden = residual + attn.o_proj(out.transpose(1, 2).reshape(1, len(tokens), -1))
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
                keys.append(k[0])
                values.append(v[0])
            final = model.model.norm(hidden)[0]
            # The last position always gets its own projection, so the first sampled token's logits do not
            # depend on whether prompt logprobs were asked for.
            logits = model.lm_head(final[-1:]).float()
            if all_logits and len(tokens) > 1:
                logits = torch.cat([model.lm_head(final[:-1]).float(), logits])
        return logits, torch.stack(keys), torch.stack(values)

    def _decode_step(self) -> None:
        started = time.perf_counter()
        self._decode_step_inner()
        self.decode_seconds += time.perf_counter() - started

    def _hf_prefill(self, tokens: list[int], adapter: AdapterTensors | None, *, all_logits: bool = True):
        """transformers' own forward of one sequence (its attention as the family runs it: gpt-oss's sinks and
        windows): logits [T, V] (or the last position's, [1, V]) and the model's cache."""
        model = self._require_base().model
        ids = torch.tensor([tokens], dtype=torch.long, device=self._device)
        with _whole_call(model, adapter, len(tokens)):
            out = model(input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits[0].float(), out.past_key_values

    def _hf_decode_step(self) -> None:
        """One token for every row, each through transformers' forward alone with its own cache (a row's result
        cannot depend on its neighbours)."""
        model = self._require_base().model
        rows = list(self._rows)
        for row in rows:
            ids = torch.tensor([[row.last_token]], dtype=torch.long, device=self._device)
            positions = torch.tensor([[row.length]], dtype=torch.long, device=self._device)
            with _whole_call(model, row.owner.adapter, 1):
                out = model(input_ids=ids, position_ids=positions, use_cache=True, **{_cache_kwarg(model): row.cache})
            row.cache = out.past_key_values
            row.length += 1
            if not row.owner.cancelled:
                self._append_token(row, out.logits[0, -1].float())
                self._flush(row)
        self.decode_steps += 1
        self.decode_tokens += len(rows)
        self._rows = [row for row in rows if row.finish_reason is None and not row.owner.cancelled]

    def _decode_step_inner(self) -> None:
        base = self._require_base()
        if base.family.hf_decode:
            self._hf_decode_step()
            return
        model = base.model
        # Rows of one adapter side by side (row order changes no row's result: every op is per row or a
        # fixed-shape matmul); base-model rows first.
        rows = sorted(self._rows, key=lambda row: (row.owner.adapter is not None, id(row.owner.adapter)))
        count = len(rows)
        padded = _pad_rows(count, self.decode_row_pad)
        ids = torch.zeros((padded, 1), dtype=torch.long, device=self._device)
        positions = torch.zeros((padded, 1), dtype=torch.long, device=self._device)
        ids[:count, 0] = torch.tensor([row.last_token for row in rows], device=self._device)
        positions[:count, 0] = torch.tensor([row.length for row in rows], device=self._device)
        routed: list[tuple[AdapterTensors, int, int]] = []
        for index, row in enumerate(rows):
            adapter = row.owner.adapter
            if adapter is None:
                continue
            if routed and routed[-1][0] is adapter:
                routed[-1] = (adapter, routed[-1][1], index + 1)
            else:
                routed.append((adapter, index, index + 1))
        hidden = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary_emb(hidden, positions)
        with lora_row_windows(model, routed, padded, self.lora_row_bucket):
            for layer_index, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                residual = hidden
                x = layer.input_layernorm(hidden)
                q, k, v = _project_qkv(attn, x, cos, sin)
                outputs = q.new_zeros(q.shape)
                gqa = q.shape[1] != k.shape[1]
                for index, row in enumerate(rows):
                    end = row.length + 1
                    row.keys[layer_index, :, row.length] = k[index, :, 0]
                    row.values[layer_index, :, row.length] = v[index, :, 0]
                    outputs[index] = F.scaled_dot_product_attention(
                        q[index: index + 1], row.keys[layer_index: layer_index + 1, :, :end],
                        row.values[layer_index: layer_index + 1, :, :end], scale=attn.scaling, enable_gqa=gqa)[0]
                hidden = residual + attn.o_proj(outputs.transpose(1, 2).reshape(padded, 1, -1))
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            logits = model.lm_head(model.model.norm(hidden))[:count, 0].float()
        self.decode_steps += 1
        self.decode_tokens += count
        for index, row in enumerate(rows):
            row.length += 1
            if not row.owner.cancelled:
                self._append_token(row, logits[index])
                self._flush(row)
        self._rows = [row for row in rows if row.finish_reason is None and not row.owner.cancelled]

    def _append_token(self, row: _Row, logits: torch.Tensor) -> None:
        options = row.owner.request.options
        token = _sample(logits, options, row.generator)
        logprob = float(torch.log_softmax(logits, dim=-1)[token])
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.last_token = token
        if token in row.owner.stop_token_ids or (options.stop_strings and self._hits_stop_string(row)):
            row.finish_reason = FINISH_STOP
        elif len(row.tokens) >= options.max_tokens:
            row.finish_reason = FINISH_LENGTH

    def _hits_stop_string(self, row: _Row) -> bool:
        tokenizer = self._require_base().tokenizer
        # Only the tail can contain a stop string that the previous token had not completed yet.
        longest = max(len(s) for s in row.owner.request.options.stop_strings)
        tail = tokenizer.decode(row.tokens[-(longest + 8):], skip_special_tokens=False)
        return any(stop in tail for stop in row.owner.request.options.stop_strings)

    def _flush(self, row: _Row) -> None:
        # One update per new token: SampleStream relays them as they come.
        row.owner.emit(GenerationUpdate(sequence_index=row.sample_index, tokens=[row.tokens[-1]],
                                        logprobs=[row.logprobs[-1]], finish_reason=row.finish_reason))


def _cache_kwarg(model) -> str:
    """The name transformers' forward takes the cache by: ``cache`` (5.24, ``past_key_values`` deprecated) or
    ``past_key_values`` (releases before the rename, whose forward would take ``cache=`` into its **kwargs and
    ignore it, decoding every token without its history)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _whole_call(model, adapter: AdapterTensors | None, tokens: int):
    """LoRA routing for a forward of one row: its `tokens` tokens all use `adapter`. As token ranges, like the
    trainer's packed rows, so a module that flattens the row to [tokens, hidden] (Qwen3.5-MoE's shared expert) is
    routed as well."""
    return lora_segments(model, [(0, tokens, adapter)])


def _project_qkv(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, length, _ = x.shape
    head_dim = attn.head_dim
    q = attn.q_proj(x).view(batch, length, -1, head_dim)
    k = attn.k_proj(x).view(batch, length, -1, head_dim)
    v = attn.v_proj(x).view(batch, length, -1, head_dim)
    # Qwen3-style per-head norms, when the architecture has them.
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def _prompt_logprobs(logits: torch.Tensor, tokens: list[int], start: int = 1) -> list[float]:
    """logprob of tokens[i] given tokens[:i] for i >= start; NaN before. Row i - 1 of logits predicts token i."""
    if len(tokens) <= start:
        return [math.nan] * len(tokens)
    logprobs = torch.log_softmax(logits[start - 1:-1], dim=-1)
    picked = logprobs.gather(1, torch.tensor(tokens[start:], device=logits.device)[:, None])[:, 0]
    return [math.nan] * start + picked.tolist()


def _topk_prompt(logits: torch.Tensor, length: int, start: int, k: int) -> TopkRows:
    """The k most likely tokens (unmodified distribution) at prompt positions start..length-1."""
    rows = TopkRows.empty(length, k)
    if length <= start:
        return rows
    k_here = min(k, logits.shape[-1])
    top = torch.topk(torch.log_softmax(logits[start - 1:length - 1], dim=-1), k_here, dim=-1)
    for offset, (ids, values) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
        rows.token_ids[start + offset][:k_here] = ids
        rows.logprobs[start + offset][:k_here] = values
    return rows


def _row_generator(seed: int | None, sample_index: int) -> torch.Generator:
    if seed is None:
        value = int.from_bytes(os.urandom(8), "little")
    else:
        # Distinct, reproducible streams per sample of one request.
        value = int.from_bytes(hashlib.sha256(f"{seed}:{sample_index}".encode()).digest()[:8], "little")
    return torch.Generator(device="cpu").manual_seed(value)


def _sample(logits: torch.Tensor, options, generator: torch.Generator) -> int:
    if options.greedy:
        return int(torch.argmax(logits))
    scaled = logits / options.temperature
    if options.top_k > 0 and options.top_k < scaled.shape[-1]:
        threshold = torch.topk(scaled, options.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, -math.inf)
    if options.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= options.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, -math.inf))
    probs = torch.softmax(scaled, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


__all__ = ["TorchEngine"]
