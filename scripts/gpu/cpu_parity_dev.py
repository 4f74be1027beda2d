# Dev check of the megatron model + LoRA against HF Llama + per-projection LoRA, fp32 on CPU (gloo).
# Run: PYTHONPATH=<megatron-core>:. python scripts/gpu/cpu_parity_dev.py   (or torchrun --nproc_per_node 2 for TP=2)
# The CPU shims below (current_device, rng tracker) exist only for this script; the backend runs on CUDA.
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch.distributed as dist

if not torch.cuda.is_available(): torch.cuda.current_device = lambda: "cpu"  # CPU dev only
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_svc.backends.megatron.layout import ALL_TARGETS, lora_shard
from trainer_svc.backends.megatron.lora import LocalAdapter, MegatronLora, RowSegment
from trainer_svc.backends.megatron.model import build_from_hf, forward_logits, init_parallel, target_logprobs

tp = int(os.environ.get("WORLD_SIZE", "1"))
init_parallel(tp)
if not torch.cuda.is_available():
    import contextlib

    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
rank = dist.get_rank()
hc = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=128)
torch.manual_seed(0)
hf = LlamaForCausalLM(hc).float().eval()
m, spec = build_from_hf(hf, torch.float32, torch.device("cpu"))
ids = torch.randint(0, 256, (3, 10))
tg = torch.randint(0, 256, (3, 10))
with torch.no_grad():
    ref = torch.log_softmax(hf(ids).logits.float(), -1).gather(-1, tg.unsqueeze(-1)).squeeze(-1)
    lp = target_logprobs(forward_logits(m, ids), tg)
print(rank, "base maxdiff", (ref - lp).abs().max().item())
# LoRA with random A, B
g = torch.Generator().manual_seed(1)
r = 4; scale = 2.0
full = {}
for i in range(2):
    for t in ALL_TARGETS:
        lin = getattr(hf.model.layers[i].self_attn if t in ("q_proj","k_proj","v_proj","o_proj") else hf.model.layers[i].mlp, t)
        full[(i,t)] = (torch.randn(r, lin.in_features, generator=g)*0.1, torch.randn(lin.out_features, r, generator=g)*0.1)
# reference: manual hooks on HF
def mk(i,t):
    a,b = full[(i,t)]
    return lambda mod, inp, out: out + (inp[0] @ a.t()) @ b.t() * scale
hs = []
for i in range(2):
    for t in ALL_TARGETS:
        lin = getattr(hf.model.layers[i].self_attn if t in ("q_proj","k_proj","v_proj","o_proj") else hf.model.layers[i].mlp, t)
        hs.append(lin.register_forward_hook(mk(i,t)))
ref2 = torch.log_softmax(hf(ids).logits.float(), -1).gather(-1, tg.unsqueeze(-1)).squeeze(-1)
ref2.sum().backward() if False else None
local = {}
for k,(a,b) in full.items():
    al, bl = lora_shard(k[1], a, b, tp, rank)
    local[k] = (al.clone().requires_grad_(), bl.clone().requires_grad_())
ad = LocalAdapter(local, scale)
lora = MegatronLora(m, spec.shape)
with lora.route([RowSegment(0, 2, ad), RowSegment(2, 3, None)]):
    lp2 = target_logprobs(forward_logits(m, ids), tg)
print(rank, "lora maxdiff rows0-1", (ref2[:2] - lp2[:2]).abs().max().item(), "row2 base", (ref[2]-lp2[2]).abs().max().item())
# gradient check: reference grads with autograd on full tensors
for h in hs: h.remove()
fullg = {k:(a.clone().requires_grad_(), b.clone().requires_grad_()) for k,(a,b) in full.items()}
def mk2(i,t):
    a,b = fullg[(i,t)]
    return lambda mod, inp, out: out + (inp[0] @ a.t()) @ b.t() * scale
hs=[]
for i in range(2):
    for t in ALL_TARGETS:
        lin = getattr(hf.model.layers[i].self_attn if t in ("q_proj","k_proj","v_proj","o_proj") else hf.model.layers[i].mlp, t)
        hs.append(lin.register_forward_hook(mk2(i,t)))
ref3 = torch.log_softmax(hf(ids[:2]).logits.float(), -1).gather(-1, tg[:2].unsqueeze(-1)).squeeze(-1)
(-ref3.sum()).backward()
(-lp2[:2].sum()).backward()
worst = 0
for k in full:
    ga, gb = lora_shard(k[1], fullg[k][0].grad, fullg[k][1].grad, tp, rank)
    worst = max(worst, (ga - local[k][0].grad).abs().max().item(), (gb - local[k][1].grad).abs().max().item())
print(rank, "grad maxdiff", worst)
