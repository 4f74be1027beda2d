"""TP check for tests/gpu/test_megatron.py::test_tp2_matches_tp1 (run under torchrun, one job per TP size).

A seeded tiny Llama with 2 KV heads and a 256-token vocabulary (both divisible by 2; the `tiny` model's 261-token
vocabulary and SmolLM2's 3 KV heads cannot be split in two), a seeded adapter with non-zero B, one forward/backward
in fp32. Rank 0 writes the logprobs, the gathered full PEFT gradient and the global grad norm as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from loraplane.lora import LoraSpec, init_lora_params
from loraplane.models.base import _wrap
from loraplane.models.tiny import build_tiny_tokenizer
from trainer_svc.backends.megatron.engine import DatumWork, Engine
from trainer_svc.backends.megatron.model import init_parallel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    init_parallel(args.tp)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(1234)
    hf = LlamaForCausalLM(config).float()
    base = _wrap("tp-check", hf, build_tiny_tokenizer(), torch.device("cpu"), torch.float32)
    engine = Engine(base, device_slots=2, dtype=torch.float32)
    spec = LoraSpec.create(4, 8.0, [], seed=3)
    params = init_lora_params(base, spec)
    g = torch.Generator().manual_seed(5)
    for k, v in params.items():
        if k.endswith("lora_B.weight"):
            v.copy_(torch.randn(v.shape, generator=g) * 0.05)
    engine.load_state("a", params, None, None, 0, spec)
    gen = torch.Generator().manual_seed(9)
    work = []
    for n in (33, 17, 50):
        toks = torch.randint(0, 256, (n + 1,), generator=gen).tolist()
        work.append(DatumWork("a", toks[:-1], toks[1:]))
    result = engine.run_batch(work, "cross_entropy", {}, backward=True)
    grad_norm = float(engine.grad_norm(engine.slot("a")))
    (grads,) = engine.gather_full("a", rows=(1,)) or (None,)
    if dist.get_rank() == 0:
        keys = sorted(grads)
        with open(args.out, "w") as f:
            json.dump({"logprobs": [x for lp in result.logprobs for x in lp],
                       "grads": torch.cat([grads[k].reshape(-1) for k in keys]).tolist(),
                       "grad_norm": grad_norm}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
