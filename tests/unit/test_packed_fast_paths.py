"""The packed rows' one-call-per-layer paths (loraplane.models.packed: BATCHED, what CUDA runs without fla) against
the per-datum path the CPU runs (EXACT), on tiny random checkpoints of every family with per-datum pieces: Qwen3.5
(Gated DeltaNet), Qwen3.5-MoE (and its shared-expert gate), gpt-oss (sink attention) and Nemotron-H (Mamba-2).
Forced onto the CPU in fp32 they must agree within 1e-5, logits and every LoRA gradient, for rows of equal lengths
(no padding) and of mixed lengths (padded); and a packed row must equal each datum alone (fp32 tolerance: BATCHED
makes no bit-exactness promise). The GPU counterpart is tests/gpu/test_packed_fast_paths.py."""

from __future__ import annotations

import pytest
import torch

from loraplane.lora import AdapterTensors, LoraSpec, lora_segments
from loraplane.models import packed
from loraplane.models.packed import packed_implementation, packed_position_ids, packed_sequences
from tests.fixtures.family_checks import trained_like
from tests.fixtures.models import build_checkpoint
from trainer_svc.backends.torch_backend import TorchBackend

FAMILIES = ["qwen3_5", "qwen3_5_moe", "gpt_oss", "nemotron_h"]
TOL = 1e-5
# LoRA gradients relative to their largest entry: each sums many products through the delta rule / scan, and the
# padded batch rounds differently from the per-datum one (measured on Qwen3.5's tiny model: 2.5e-5 in fp32; in
# fp64 the logits agree exactly and the gradients to 1.5e-7, the fp32 gated norm inside transformers' layer).
GRAD_TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def backend(request, tmp_path_factory):
    return TorchBackend(str(build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))))


def adapters(base, count):
    spec = LoraSpec.create(4, 8, [], seed=3, available=tuple(base.module_dims))
    out = []
    for i in range(count):
        params = {k: v.requires_grad_() for k, v in trained_like(base, spec, 10 + i).items()}
        out.append((params, AdapterTensors.from_params(params, spec)))
    return out


def rows_of(lengths, seed=4):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 250, (n,), generator=generator).tolist() for n in lengths]


def step(backend, rows, tenants, impl):
    """Each datum's logits from one packed row (datum i with tenants[i]) and every tenant's LoRA gradients of a
    fixed function of those logits, under `impl`."""
    model = backend.base.model
    lengths = [len(r) for r in rows]
    ids = torch.tensor([t for r in rows for t in r]).unsqueeze(0)
    segments, cursor = [], 0
    for length, (_, adapter) in zip(lengths, tenants):
        segments.append((cursor, cursor + length, adapter))
        cursor += length
    for params, _ in tenants:
        for p in params.values():
            p.grad = None
    with packed_implementation(impl), packed_sequences(lengths), lora_segments(model, segments):
        hidden = model.model(input_ids=ids, position_ids=packed_position_ids(lengths), use_cache=False)
        logits = model.lm_head(hidden.last_hidden_state[0])
        weights = torch.linspace(-1, 1, logits.shape[-1])
        (logits * weights).sum().backward()
    grads = [{k: p.grad.clone() for k, p in params.items()} for params, _ in tenants]
    return logits.detach().split(lengths), grads


@pytest.mark.parametrize("lengths", [[8, 8, 8], [9, 12, 5, 12]], ids=["equal", "mixed"])
def test_batched_equals_per_datum_logits_and_gradients(backend, lengths):
    rows = rows_of(lengths)
    tenants = adapters(backend.base, 2)
    assign = [tenants[i % 2] for i in range(len(rows))]
    exact_logits, exact_grads = step(backend, rows, assign, packed.EXACT)
    batched_logits, batched_grads = step(backend, rows, assign, packed.BATCHED)
    for a, b in zip(exact_logits, batched_logits):
        assert torch.allclose(a, b, atol=TOL, rtol=0), float((a - b).abs().max())
    for mine, theirs in zip(exact_grads, batched_grads):
        for key in mine:
            scale = float(mine[key].abs().max())
            assert scale > 0, key
            assert torch.allclose(mine[key], theirs[key], atol=GRAD_TOL * scale, rtol=0), key
    # Datums really are kept apart: a datum's logits do not depend on the datum before it.
    alone, _ = step(backend, rows[1:2], assign[1:2], packed.BATCHED)
    assert torch.allclose(alone[0], batched_logits[1], atol=TOL, rtol=0)


def test_the_implementation_is_chosen_by_device_and_can_be_pinned(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(packed.IMPL_ENV, raising=False)
    assert packed.packed_impl(cpu, fla=True) == packed.EXACT
    monkeypatch.setenv(packed.IMPL_ENV, "batched")
    assert packed.packed_impl(cpu) == packed.BATCHED
    with packed_implementation(packed.EXACT):
        assert packed.packed_impl(cpu) == packed.EXACT  # the scope wins over the environment
    monkeypatch.setenv(packed.IMPL_ENV, "fla")
    assert packed.packed_impl(cpu, fla=False) == packed.BATCHED  # a family without an fla path
    with pytest.raises(RuntimeError, match="fla cannot run here: not a CUDA device"):
        packed.packed_impl(cpu, fla=True)
    monkeypatch.setenv(packed.IMPL_ENV, "fast")
    with pytest.raises(ValueError, match="LORAPLANE_PACKED_IMPL"):
        packed.packed_impl(cpu)


def test_the_padded_layout_round_trips_a_packed_row():
    layout = packed.PackedLayout([3, 1, 2], torch.device("cpu"))
    row = torch.arange(6 * 2, dtype=torch.float32).reshape(1, 6, 2)
    padded = layout.pad(row)
    assert padded.shape == (3, 3, 2)
    assert torch.equal(padded[1, 1:], torch.zeros(2, 2)) and torch.equal(padded[2, 2], torch.zeros(2))
    assert torch.equal(layout.unpad(padded), row)
    host = layout.cu_seqlens()[1]
    assert host.tolist() == [0, 3, 4, 6]


@pytest.mark.parametrize("window", [None, 3])
def test_sink_attention_as_an_extra_key_equals_transformers_eager(window):
    """The fused sink attention (the sink as one extra key through an extra feature column) against transformers'
    eager sink attention per datum: outputs and the gradients of q, k, v and the sinks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from loraplane.models.families.gpt_oss import _batched_sink_attention, _datum_mask

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, lengths = 4, 2, 16, [5, 7, 2]
    total = sum(lengths)

    class Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads
        training = False

        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.randn(heads, generator=generator))

    module = Module()
    q = torch.randn(1, heads, total, dim, generator=generator, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, generator=generator, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, generator=generator, requires_grad=True)
    cotangent = torch.randn(1, total, heads, dim, generator=generator)
    scaling = dim**-0.5

    def grads(out):
        for t in (q, k, v, module.sinks):
            t.grad = None
        (out * cotangent).sum().backward()
        return [t.grad.clone() for t in (q, k, v, module.sinks)]

    pieces, start = [], 0
    for n in lengths:
        mask = _datum_mask(n, window, q.dtype, q.device)
        out, _ = eager_attention_forward(module, q[:, :, start:start + n], k[:, :, start:start + n],
                                         v[:, :, start:start + n], mask, scaling=scaling)
        pieces.append(out)
        start += n
    eager = torch.cat(pieces, dim=1)
    eager_grads = grads(eager)
    fused = _batched_sink_attention(module, q, k, v, scaling, window, packed.PackedLayout(lengths, q.device))
    fused_grads = grads(fused)
    assert fused.shape == eager.shape
    assert torch.allclose(fused, eager, atol=TOL, rtol=0), float((fused - eager).abs().max())
    for name, a, b in zip(("q", "k", "v", "sinks"), fused_grads, eager_grads):
        assert torch.allclose(a, b, atol=TOL, rtol=0), (name, float((a - b).abs().max()))
    assert float(module.sinks.grad.abs().max()) > 0


@pytest.mark.parametrize("backend", ["qwen3_5", "qwen3_5_moe", "nemotron_h"], indirect=True)
@pytest.mark.parametrize("impl", [packed.EXACT, packed.BATCHED])
def test_older_transformers_without_the_helpers_gives_the_same_row(backend, impl, monkeypatch):
    """transformers 5.12 (SGLang 0.5.17's pin) leaves causal_conv1d_fn None without the causal-conv1d package and
    has no mamba2_chunk_scan (Nemotron-H's scan is inline in the mixer's forward there); this transformers has both.
    That one cannot be installed beside this one, so it is simulated here (the test says so): the conv function set
    to None and the scan removed, as 5.12 has them; a packed row never calls transformers' own mixer forward. The
    row's logits and gradients stay those of the helpers' path."""
    import sys

    modeling = next(sys.modules[type(m).__module__] for m in backend.base.model.modules()
                    if type(m).__name__.endswith(("GatedDeltaNet", "Mamba2Mixer")))
    rows = rows_of([9, 12, 5])
    tenants = adapters(backend.base, 2)
    assign = [tenants[i % 2] for i in range(len(rows))]
    want_logits, want_grads = step(backend, rows, assign, impl)
    assert modeling.causal_conv1d_fn is not None
    monkeypatch.setattr(modeling, "causal_conv1d_fn", None)
    if backend.base.family.model_type == "nemotron_h":
        monkeypatch.delattr(modeling, "mamba2_chunk_scan")
    got_logits, got_grads = step(backend, rows, assign, impl)
    for a, b in zip(want_logits, got_logits):
        assert torch.allclose(a, b, atol=TOL, rtol=0), float((a - b).abs().max())
    for mine, theirs in zip(want_grads, got_grads):
        for key in mine:
            scale = float(mine[key].abs().max())
            assert torch.allclose(mine[key], theirs[key], atol=GRAD_TOL * scale, rtol=0), key


def test_the_recurrent_scan_equals_transformers_chunked_scan():
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    from loraplane.models.families.nemotron_h import recurrent_scan

    generator = torch.Generator().manual_seed(7)
    batch, length, heads, head_dim, groups, state = 2, 37, 4, 8, 2, 16
    x = torch.randn(batch, length, heads, head_dim, generator=generator)
    dt = torch.randn(batch, length, heads, generator=generator)
    A = -torch.rand(heads, generator=generator) * 2
    B, C = (torch.randn(batch, length, groups, state, generator=generator) for _ in range(2))
    D, dt_bias = torch.randn(heads, generator=generator), torch.randn(heads, generator=generator)
    kwargs = {"D": D, "dt_bias": dt_bias, "dt_softplus": True, "dt_limit": (0.0, 10.0)}
    want = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=16, **kwargs)
    got = recurrent_scan(x, dt, A, B, C, chunk_size=16, **kwargs)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=0), float((got - want).abs().max())
