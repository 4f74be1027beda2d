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
"""

from __future__ import annotations

import threading

import torch

from loraplane.lora import attach_multi_lora, lora_segments
from loraplane.models import BaseModel, load_base_model
from loraplane.models.packed import enable_packed_attention, packed_position_ids, packed_sequences
from trainer_svc.backends.base import BatchItem, DatumResult, ItemResult, TrainerBackend
from trainer_svc.losses import elementwise_loss, own_targets, packed_targets

MIN_PACKED_TOKENS = 16


class TorchBackend(TrainerBackend):
    name = "torch"

    def __init__(self, base_model: str | BaseModel = "tiny", device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.base = base_model if isinstance(base_model, BaseModel) else load_base_model(
            base_model, device=device, dtype=dtype)
        enable_packed_attention(self.base.model)
        # What else a family needs to keep datums of one row apart (Qwen3.5: the linear-attention state).
        self.base.family.enable_packing(self.base.model)
        attach_multi_lora(self.base.model)
        self._lock = threading.Lock()

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
        with grad_mode, packed_sequences(lengths), lora_segments(self.base.model, segments):
            hidden = self.base.model.model(input_ids=input_ids, position_ids=position_ids,
                                           use_cache=False).last_hidden_state[0]
            # One vocabulary projection over the whole packed batch (filler included, so it too sees >= 16 rows)
            # and one log-softmax over the real tokens: a projection per datum streams the whole lm_head weight
            # from memory once per datum. Both are row-wise, so each token's logprob is the same whatever else is
            # in the batch, as for every other linear layer here.
            logits = self.base.model.get_output_embeddings()(hidden)
            logits = (logits if cursor == logits.shape[0] else logits[:cursor]).float()
            if wide:
                token_logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets)
            else:
                token_logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
            del logits
            item_losses = []
            datum_losses_detached = []
            datum_logprobs = []
            start = 0
            for item in items:
                datum_losses = []
                for datum in item.data:
                    end = start + datum.length
                    lp = own_targets(token_logprobs[start:end], datum.targets_per_position)
                    if wide:
                        datum_logprobs.append(lp.detach().reshape(-1))
                    loss = elementwise_loss(
                        item.loss_fn, item.loss_config, lp,
                        weights=_on(datum.weights, device), q=_on(datum.logprobs, device),
                        advantages=_on(datum.advantages, device))
                    datum_losses.append(loss.sum())
                    datum_losses_detached.append(loss.detach())
                    start = end
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


def _on(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)
