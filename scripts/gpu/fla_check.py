"""Is fla's Gated DeltaNet kernel right and fast on this GPU with the Triton we carry? (issue 32)

fla-core 0.6.0 refuses Triton < 3.7.1 on Hopper (a wrong-results bug in its backward); the image has 3.6.0, so the
Qwen3.5 runs carry Triton 3.7.1 (scripts/gpu/fla-wheels.txt). Before any benchmark trusts it, this checks fla's
chunked kernel on a packed varlen row (cu_seqlens) against an fp32 token-by-token recurrence of our own, forward and
every gradient, per datum; then times it against transformers' torch fallback on the Qwen3.5-9B linear-attention
shape (8 x 2048 tokens, 32 value heads of 128, 16 key heads of 128), forward + backward.

    python3 scripts/gpu/fla_check.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F


def recurrent_reference(q, k, v, g, beta):
    """One datum, fp32, token by token: S <- exp(g) S; S <- S + k (beta (v - k S)); o = q S / sqrt(dk); q, k
    l2-normalised (Qwen3.5's use_qk_l2norm_in_kernel). q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H]."""
    q = F.normalize(q.float(), dim=-1) * q.shape[-1] ** -0.5
    k = F.normalize(k.float(), dim=-1)
    v, g, beta = v.float(), g.float(), beta.float()
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    state = q.new_zeros(heads, dk, dv)
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        memory = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - memory) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out)


def inputs(lengths, heads, dk, dv, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(lengths)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype).requires_grad_()

    q, k = rand(1, total, heads, dk), rand(1, total, heads, dk)
    v = rand(1, total, heads, dv)
    g = (-torch.rand(1, total, heads, generator=gen) * 0.5).to(device=device, dtype=torch.float32).requires_grad_()
    beta = torch.rand(1, total, heads, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    return q, k, v, g, beta


def correctness(chunk_gated_delta_rule) -> dict:
    lengths = [37, 256, 5, 130]
    heads, dk, dv = 4, 64, 128
    device = "cuda"
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=device, dtype=torch.int32)
    q, k, v, g, beta = inputs(lengths, heads, dk, dv, torch.bfloat16, device)
    out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                    output_final_state=False)
    cotangent = torch.randn_like(out, dtype=torch.float32)
    (out.float() * cotangent).sum().backward()
    fast = [out.detach().float()] + [t.grad.float() for t in (q, k, v, g, beta)]
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
    pieces = []
    start = 0
    for n in lengths:
        pieces.append(recurrent_reference(*(t[0, start:start + n] for t in ref_leaves)))
        start += n
    ref_out = torch.cat(pieces)[None]
    (ref_out * cotangent).sum().backward()
    ref = [ref_out.detach()] + [t.grad for t in ref_leaves]
    report = {}
    for name, a, b in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), fast, ref):
        scale = b.abs().max().item()
        report[name] = {"max_abs_err": (a - b).abs().max().item(), "ref_max": scale,
                        "rel_to_max": (a - b).abs().max().item() / max(scale, 1e-30)}
    return report


def timing(fn, lengths, heads, dk, dv, repeat=5, **kwargs) -> float:
    """Median ms of forward + backward; Q/K already repeated to the value heads, as the layer hands them over."""
    q, k, v, g, beta = inputs([sum(lengths)], heads, dk, dv, torch.bfloat16, "cuda", seed=1)
    ms = []
    for i in range(repeat + 1):
        for t in (q, k, v, g, beta):
            t.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(q, k, v, g, beta, lengths, **kwargs)
        out.float().sum().backward()
        torch.cuda.synchronize()
        if i:
            ms.append((time.perf_counter() - t0) * 1e3)
    return sorted(ms)[len(ms) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import triton

    result = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        result["fla"] = fla.__version__
    except (ImportError, RuntimeError) as exc:  # the point of the check: say why fla is unusable here
        result["fla_error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(result, indent=1))
        return 1
    result["correctness"] = correctness(chunk_gated_delta_rule)

    def fla_row(q, k, v, g, beta, lengths):
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]

    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    fallback = getattr(modeling.torch_chunk_gated_delta_rule, "__wrapped__", modeling.torch_chunk_gated_delta_rule)

    def torch_batched(q, k, v, g, beta, lengths):
        n = len(lengths)

        def shape(t):  # equal lengths: one batch entry per datum
            return t.reshape(n, lengths[0], *t.shape[2:])

        out, _ = fallback(shape(q), shape(k), shape(v), g=shape(g), beta=shape(beta), initial_state=None,
                          output_final_state=False, use_qk_l2norm_in_kernel=True)
        return out.reshape(1, -1, *out.shape[2:])

    lengths = [2048] * 8
    result["qwen3.5-9b_layer_fwd_bwd_ms"] = {
        "fla_varlen_row": timing(fla_row, lengths, 32, 128, 128),
        "torch_fallback_batched": timing(torch_batched, lengths, 32, 128, 128, repeat=2),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    worst = max(r["rel_to_max"] for r in result["correctness"].values())
    print(f"worst error relative to the reference's max: {worst:.4f}")
    return 0 if worst < 0.05 else 2


if __name__ == "__main__":
    sys.exit(main())
