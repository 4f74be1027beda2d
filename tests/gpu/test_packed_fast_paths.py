"""The torch backend's packed rows on CUDA (loraplane.models.packed: one call per layer, BATCHED or fla's varlen
kernels) against the CPU's per-datum path (EXACT, fp32, the bit-exact reference), on tiny random checkpoints of
every family with per-datum pieces: Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet), gpt-oss (sink attention), Nemotron-H
(Mamba-2). Also the sink-as-extra-key attention through CUDA's fused SDPA kernel, and activation recomputation on
autograd's device thread. Run by ``scripts/gpu/`` with ``-m gpu --noconftest``:

    python3 -m pytest -q -m gpu --noconftest tests/gpu/test_packed_fast_paths.py

The bounds:
* fp32 on CUDA (TF32 off), BATCHED: the same math as EXACT in another summation order: logits within 1e-4 of the
  largest logit, every LoRA gradient within 1e-3 of its norm (the CPU tests measure 2.5e-5 between the two orders
  in fp32; CUDA's kernels add their own reduction orders).
* bf16, the production dtype (fla where it can run): these tiny random models are ill-conditioned in bf16 (on CPU
  the per-datum path itself in bf16 is 64% off fp32 at its worst Qwen3.5 logit: a gated RMSNorm of a head whose
  delta-rule output cancelled to near zero scales its rounding error up; a router's top-k flips on Nemotron-H), so
  the gated norms' epsilon is raised to 1e-2 in every model here (measured on CPU: Qwen3.5's bf16 error then 2.7% max,
  0.26% mean, gradients 6%), and the fast path is held to the per-datum path in the same dtype on the same GPU,
  both against the fp32 reference: its error at most twice EXACT's plus 1% of the largest logit (max), 0.2% (mean)
  and 5% of each gradient's norm. fla's own check (scripts/gpu/fla_check.py) measures 0.63% of the largest value
  for its kernel alone in bf16.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FAMILIES = ["qwen3_5", "qwen3_5_moe", "gpt_oss", "nemotron_h"]
LENGTHS = [37, 64, 5, 130, 64]  # mixed: padded batches, and a datum longer than one 64-token chunk


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    from tests.fixtures.models import build_checkpoint

    return build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The CPU fp32 per-datum step: (backend, logits per datum, LoRA gradients per tenant)."""

    import inspect
    import sys

    backend = backend_on(checkpoint, "cpu", torch.float32)
    # transformers binds fla's kernel in place of its torch delta rule when fla imports (the tests-fla run); the
    # CPU reference needs the torch one.
    swapped = []
    for module in backend.base.model.modules():
        modeling = sys.modules[type(module).__module__]
        kernel = getattr(modeling, "torch_chunk_gated_delta_rule", None)
        if kernel is not None and inspect.unwrap(kernel) is not kernel:
            swapped.append((modeling, kernel))
            modeling.torch_chunk_gated_delta_rule = inspect.unwrap(kernel)
    try:
        return backend, *step(backend, "exact")
    finally:
        for modeling, kernel in swapped:
            modeling.torch_chunk_gated_delta_rule = kernel


def backend_on(checkpoint, device, dtype, recompute="none"):
    """The torch backend on `checkpoint`, its gated norms' epsilon raised to 1e-2 (see the module's docstring)."""
    from trainer_svc.backends.torch_backend import TorchBackend

    backend = TorchBackend(str(checkpoint), device=device, dtype=dtype, recompute=recompute)
    for name, module in backend.base.model.named_modules():
        if name.endswith(("linear_attn.norm", "mixer.norm")) and hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 1e-2
    return backend


def tenants(base, device):
    from loraplane.lora import AdapterTensors, LoraSpec
    from tests.fixtures.family_checks import trained_like

    spec = LoraSpec.create(4, 8, [], seed=3, available=tuple(base.module_dims))
    out = []
    for i in range(2):
        params = {k: v.to(device).requires_grad_() for k, v in trained_like(base, spec, 10 + i).items()}
        out.append((params, AdapterTensors.from_params(params, spec)))
    return out


def step(backend, impl, lengths=LENGTHS, threaded_backward=False):
    """Each datum's fp32 logits (on the host) from one packed row, datum i with tenant i % 2, and each tenant's
    LoRA gradients (on the host) of a fixed function of them, with the packed pieces run as `impl`."""
    import threading

    from loraplane.lora import lora_segments
    from loraplane.models.packed import packed_implementation, packed_position_ids, packed_sequences

    model, device = backend.base.model, backend.device
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 250, (1, sum(lengths)), generator=generator).to(device)
    pair = tenants(backend.base, device)
    segments, cursor = [], 0
    for i, length in enumerate(lengths):
        segments.append((cursor, cursor + length, pair[i % 2][1]))
        cursor += length
    backend.recompute.plan(sum(lengths), True, device)
    with packed_implementation(impl), packed_sequences(lengths), lora_segments(model, segments):
        hidden = model.model(input_ids=ids, position_ids=packed_position_ids(lengths, device=device),
                             use_cache=False)
        logits = model.lm_head(hidden.last_hidden_state[0]).float()
        weights = torch.linspace(-1, 1, logits.shape[-1], device=device)
        loss = (logits * weights).sum()
        if not threaded_backward:
            loss.backward()
    if threaded_backward:  # after the scopes exited, on another thread (recomputation must restore them)
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    grads = [{k: p.grad.detach().cpu() for k, p in params.items()} for params, _ in pair]
    return logits.detach().cpu().split(lengths), grads


def errors(ours, ref) -> dict[str, float]:
    """Logit errors relative to the largest reference logit (max and mean over every logit) and the worst LoRA
    gradient's error relative to its norm."""
    (ours_logits, ours_grads), (ref_logits, ref_grads) = ours, ref
    scale = max(float(r.abs().max()) for r in ref_logits)
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(ours_logits, ref_logits)])
    worst = 0.0
    for mine, theirs in zip(ours_grads, ref_grads):
        assert mine.keys() == theirs.keys()
        for key in mine:
            a, b = mine[key].float(), theirs[key].float()
            assert float(b.norm()) > 0, key
            worst = max(worst, float((a - b).norm() / b.norm()))
    return {"logit_max": float(diff.max()) / scale, "logit_mean": float(diff.mean()) / scale, "grad_rel": worst}


def assert_within(found: dict[str, float], bounds: dict[str, float]) -> None:
    for key, bound in bounds.items():
        assert found[key] <= bound, (key, found, bounds)


def assert_no_worse_than_exact(backend, impl, reference):
    """`impl` in the backend's dtype against the per-datum path in the same dtype and device, both measured against
    the fp32 CPU reference."""
    from loraplane.models import packed

    _, ref_logits, ref_grads = reference
    exact = errors(step(backend, packed.EXACT), (ref_logits, ref_grads))
    fast = errors(step(backend, impl), (ref_logits, ref_grads))
    slack = {"logit_max": 1e-2, "logit_mean": 2e-3, "grad_rel": 5e-2}
    assert_within(fast, {key: 2 * exact[key] + slack[key] for key in slack})


def test_batched_in_fp32_on_cuda_equals_the_cpu_per_datum_path(checkpoint, reference):
    from loraplane.models import packed

    backend = backend_on(checkpoint, "cuda", torch.float32)
    _, ref_logits, ref_grads = reference
    assert_within(errors(step(backend, packed.BATCHED), (ref_logits, ref_grads)),
                  {"logit_max": 1e-4, "logit_mean": 1e-5, "grad_rel": 1e-3})


def test_bf16_on_cuda_as_deployed_is_no_worse_than_per_datum(checkpoint, reference):
    """auto: fla's kernels where they can run (Qwen3.5 with fla installed), else BATCHED; recomputation auto."""
    backend = backend_on(checkpoint, "cuda", torch.bfloat16, recompute="auto")
    assert_no_worse_than_exact(backend, None, reference)


def test_fla_is_no_worse_than_per_datum_in_bf16(checkpoint, reference):
    from loraplane.models import packed

    if "qwen3_5" not in checkpoint.name:
        pytest.skip("fla runs the Gated DeltaNet (Qwen3.5) only")
    reason = packed.fla_unusable(torch.device("cuda", torch.cuda.current_device()))
    if reason is not None:
        pytest.skip(f"fla cannot run: {reason}")
    assert_no_worse_than_exact(backend_on(checkpoint, "cuda", torch.bfloat16), packed.FLA, reference)


def test_recomputation_on_autograds_device_thread_equals_none(checkpoint):
    """Every layer recomputed, the backward on another thread after the step's scopes exited (as CUDA's autograd
    runs it): the same gradients as without recomputation (the same kernels rerun; fp32)."""
    from loraplane.models import packed

    backend = backend_on(checkpoint, "cuda", torch.float32)
    plain = step(backend, packed.BATCHED)
    backend.recompute.mode = "full"
    recomputed = step(backend, packed.BATCHED, threaded_backward=True)
    assert len(backend.recompute.selected) == backend.base.num_layers
    assert_within(errors(recomputed, plain), {"logit_max": 1e-6, "logit_mean": 1e-7, "grad_rel": 1e-5})
    per_token = backend.recompute.measure(backend.device)
    assert min(per_token) >= backend.base.hidden_size * 4


@pytest.mark.parametrize("window", [None, 128])
def test_the_sink_key_through_cudas_fused_sdpa_matches_eager_sinks(window):
    """gpt-oss-20b's head shape (64 query / 8 KV heads of 64), bf16 on CUDA through the fused kernel against
    transformers' eager sink attention per datum in fp32: outputs and every gradient within bf16 bounds."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from loraplane.models.families.gpt_oss import _batched_sink_attention, _datum_mask
    from loraplane.models.packed import PackedLayout

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, lengths = 64, 8, 64, [300, 17, 512, 300]
    total = sum(lengths)

    class Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads
        training = False

        def __init__(self, sinks):
            super().__init__()
            self.sinks = torch.nn.Parameter(sinks)

    sinks = torch.randn(heads, generator=generator)
    tensors = [torch.randn(1, h, total, dim, generator=generator) for h in (heads, kv_heads, kv_heads)]
    cotangent = torch.randn(1, total, heads, dim, generator=generator)

    def run(device, dtype, fused):
        module = Module(sinks.to(device, dtype))
        q, k, v = (t.to(device, dtype).requires_grad_() for t in tensors)
        if fused:
            out = _batched_sink_attention(module, q, k, v, dim**-0.5, window, PackedLayout(lengths, q.device))
        else:
            pieces, start = [], 0
            for n in lengths:
                mask = _datum_mask(n, window, q.dtype, q.device)
                piece, _ = eager_attention_forward(module, q[:, :, start:start + n], k[:, :, start:start + n],
                                                   v[:, :, start:start + n], mask, scaling=dim**-0.5)
                pieces.append(piece)
                start += n
            out = torch.cat(pieces, dim=1)
        (out.float() * cotangent.to(device)).sum().backward()
        return [t.detach().float().cpu() for t in (out, q.grad, k.grad, v.grad, module.sinks.grad)]

    fused = run("cuda", torch.bfloat16, True)
    ref = run("cpu", torch.float32, False)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), fused, ref):
        rel = float((a - b).norm() / b.norm())
        assert rel <= 2e-2, (name, rel)  # bf16 inputs and outputs: a few u of the norm
