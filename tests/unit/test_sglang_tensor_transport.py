"""How adapter tensors reach SGLang (`/load_lora_adapter_from_tensors`): a tiny random Qwen3-MoE adapter of either
expert layout, in either SGLang expert form (per-expert keys, stacked 3-D tensors), inline in the request body or
through a /dev/shm segment, arrives with exactly the values the conversion defines, and converts back losslessly.

The receiver is a FAKE SGLang in a process of its own (not a child of this one, its own session, as a launched
SGLang is): it unpickles what it gets with what SGLang 0.5.17's SafeUnpickler admits (torch, builtins,
collections) and reports what it holds. The real server is covered by tests/gpu/test_sglang_moe.py and
bench/sampler.py --shape qwen3moe.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

from loraplane.adapter_format import adapter_tensor_views, from_sglang, parse_adapter, sglang_packing, to_sglang
from loraplane.errors import FailedPrecondition, InvalidArgument
from loraplane.models import load_base_model
from sampler_svc.engines.sglang_engine import SGLangEngine
from sampler_svc.engines.sglang_transport import PackedTensors
from tests.fixtures.sampler import adapter_blob

REPO = Path(__file__).resolve().parents[2]
MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")

FAKE = textwrap.dedent('''
    import base64, hashlib, io, pickle, sys
    from http.server import ThreadingHTTPServer
    import torch
    from tests.fixtures.http import JsonHandler

    class TorchOnly(pickle.Unpickler):
        def find_class(self, module, name):
            if not any((module + ".").startswith(p) for p in ("torch.", "builtins.", "collections.")):
                raise pickle.UnpicklingError(f"Blocked unsafe class loading ({module}.{name})")
            return super().find_class(module, name)

    held = {}  # name -> the tensors rank 0 holds

    def digests(tensors):
        return {k: [str(t.dtype), list(t.shape),
                    hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
                for k, t in tensors.items()}

    class Handler(JsonHandler):
        def do_GET(self):
            if self.path == "/server_info":
                return self.reply(200, {"tp_size": TP, "dtype": DTYPE, "max_loaded_loras": 8})
            if self.path.startswith("/held/"):  # digests computed now, from what the server still maps
                tensors = held.get(self.path[len("/held/"):])
                return self.reply(200, digests(tensors) if tensors is not None else None)
            self.reply(200, {"data": []} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = self.json_body()
            if self.path == "/load_lora_adapter_from_tensors":
                # SGLang's TP ranks are processes of their own, each unpickling its own copy: this one process
                # plays rank 0 and checks that the other ranks' copies are the same pickle.
                copies = body["serialized_named_tensors"]
                assert all(c == copies[0] for c in copies), "TP ranks got different payloads"
                held[body["lora_name"]] = TorchOnly(io.BytesIO(base64.b64decode(copies[0], validate=True))).load()
                return self.reply(200, {"success": True, "config": body["config_dict"],
                                        "request_bytes": int(self.headers["Content-Length"])})
            if self.path == "/unload_lora_adapter":
                held.pop(body["lora_name"], None)
                return self.reply(200, {"success": True})
            self.reply(404, {"detail": "Not Found"})

    TP, DTYPE = int(sys.argv[1]), sys.argv[2]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
''')


class FakeProcess:
    def __init__(self, tp: int = 1, dtype: str = "auto"):
        # Run from the repository's root, where the fake finds tests.fixtures.http.
        self.process = subprocess.Popen([sys.executable, "-c", FAKE, str(tp), dtype], stdout=subprocess.PIPE,
                                        text=True, start_new_session=True, cwd=REPO)
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def held(self, name: str) -> dict | None:
        with urllib.request.urlopen(f"{self.url}/held/{name}", timeout=30) as reply:
            return json.loads(reply.read())

    def stop(self):
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def moe_base():
    return load_base_model("tiny-moe")


def moe_adapter(base, seed: int, layout: str) -> bytes:
    return adapter_blob(seed, base=base, targets=MOE_TARGETS, expert_layout=layout)


def digests(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    out = {}
    for key, tensor in tensors.items():
        data = tensor.to(dtype).contiguous()
        out[key] = [str(dtype), list(data.shape),
                    hashlib.sha256(data.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
    return out


def shm_segments() -> set[str]:
    # This process's only (torch names a segment torch_<pid>_...): other xdist workers make and free their own.
    return set(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))


class TorchOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if not any((module + ".").startswith(p) for p in ("torch.", "builtins.", "collections.")):
            raise pickle.UnpicklingError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
@pytest.mark.parametrize("form", ["per_expert", "stacked"])
def test_both_forms_convert_back_exactly_and_carry_the_same_numbers(moe_base, layout, form):
    blob = moe_adapter(moe_base, 5, layout)
    params, spec, _ = parse_adapter(blob)
    tensors, config = to_sglang(params, spec, form=form)
    back = from_sglang(tensors, spec)
    assert set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)
    experts = [k for k in tensors if ".mlp.experts." in k]
    layer1 = "base_model.model.model.layers.1.mlp.experts"
    if form == "stacked":
        assert config["target_modules"][-2:] == ["gate_up_proj", "down_proj"]
        assert len(experts) == 4 * spec_layers(params)  # 4 tensors per layer, whatever the number of experts
        per, _ = to_sglang(params, spec, form="per_expert")
        gate_up_a, gate_up_b = tensors[f"{layer1}.gate_up_proj.lora_A.weight"], tensors[f"{layer1}.gate_up_proj.lora_B.weight"]
        assert gate_up_a.dim() == 3 and gate_up_a.shape[1] == spec.rank
        for e in range(gate_up_a.shape[0]):
            assert torch.equal(gate_up_a[e], per[f"{layer1}.{e}.gate_proj.lora_A.weight"])
            assert torch.equal(gate_up_b[e], torch.cat([per[f"{layer1}.{e}.gate_proj.lora_B.weight"],
                                                        per[f"{layer1}.{e}.up_proj.lora_B.weight"]]))
            assert torch.equal(tensors[f"{layer1}.down_proj.lora_B.weight"][e],
                               per[f"{layer1}.{e}.down_proj.lora_B.weight"])
    else:
        assert config["target_modules"][-3:] == ["gate_proj", "up_proj", "down_proj"]
        # gate and up share their A: one tensor, so a transfer carries it once
        assert tensors[f"{layer1}.3.gate_proj.lora_A.weight"] is tensors[f"{layer1}.3.up_proj.lora_A.weight"]


@pytest.mark.parametrize("stored", ["compact", "expanded"])
def test_the_shared_outer_form_holds_each_shared_factor_once_and_converts_back_exactly(moe_base, stored):
    """What a server run with --experts-shared-outer-loras gets: gate_up A and down B with expert dimension 1
    (SGLang's expert_dim=1), the other two factors per expert; from a compact blob's params or a blob's stored
    (format 1: expanded) views alike."""
    blob = moe_adapter(moe_base, 8, "shared_outer")
    params, spec, _ = parse_adapter(blob)
    source = params if stored == "compact" else adapter_tensor_views(blob)[0]
    tensors, config = to_sglang(source, spec, form="shared_outer")
    layer1 = "base_model.model.model.layers.1.mlp.experts"
    experts = tensors[f"{layer1}.down_proj.lora_A.weight"].shape[0]
    assert experts > 1
    assert tensors[f"{layer1}.gate_up_proj.lora_A.weight"].shape == (1, spec.rank, moe_base.hidden_size)
    assert tensors[f"{layer1}.down_proj.lora_B.weight"].shape[::2] == (1, spec.rank)
    assert tensors[f"{layer1}.gate_up_proj.lora_B.weight"].shape[0] == experts
    assert config["target_modules"][-2:] == ["gate_up_proj", "down_proj"]
    back = from_sglang(tensors, spec)
    assert set(back) == set(params) and all(torch.equal(back[k], params[k]) for k in params)
    stacked, _ = to_sglang(params, spec, form="stacked")  # every expert's copy of the shared factor is this one
    assert torch.equal(stacked[f"{layer1}.gate_up_proj.lora_A.weight"][experts - 1],
                       tensors[f"{layer1}.gate_up_proj.lora_A.weight"][0])
    per_expert, spec_pe, _ = parse_adapter(moe_adapter(moe_base, 9, "per_expert"))
    with pytest.raises(FailedPrecondition, match="per-expert"):
        to_sglang(per_expert, spec_pe, form="shared_outer")


def spec_layers(params) -> int:
    return len({int(k.split(".")[4]) for k in params if ".mlp.experts." in k})


def test_blob_views_are_the_blob_in_its_own_dtype(moe_base):
    blob = moe_adapter(moe_base, 6, "shared_outer")
    views, spec, base_name = adapter_tensor_views(blob)
    params, spec2, base2 = parse_adapter(blob)
    assert (spec, base_name) == (spec2, base2)
    # shared-outer factors stay expanded, as stored; folded they are the parsed params
    assert from_sglang(to_sglang(views, spec)[0], spec).keys() == params.keys()
    assert all(torch.equal(from_sglang(to_sglang(views, spec)[0], spec)[k], params[k]) for k in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inline_pickle_holds_each_tensor_once_and_rebuilds_under_sglangs_allowlist(moe_base, dtype):
    params, spec, _ = parse_adapter(moe_adapter(moe_base, 7, "per_expert"))
    tensors, _ = to_sglang(params, spec)
    packed = PackedTensors(tensors, dtype, shared=False)
    payload = packed.pickled()
    unique = {id(t): t.numel() for t in tensors.values()}
    data_bytes = sum(unique.values()) * torch.empty((), dtype=dtype).element_size()
    # The buffer once: plain pickle of these views would carry A's whole storage once per expert.
    assert data_bytes < len(payload) < data_bytes + 160 * len(tensors) + 4096  # names, offsets, shapes
    rebuilt = TorchOnly(__import__("io").BytesIO(payload)).load()
    assert digests(rebuilt, dtype) == digests(tensors, dtype)


@pytest.mark.parametrize("layout", ["per_expert", "shared_outer"])
def test_per_expert_keys_are_slices_of_stacked_tensors_copied_once(moe_base, layout):
    """The engine packs each layer's stacked expert tensor with one copy and names its per-expert slices: the same
    names and bytes as the per-expert form of to_sglang, with as many copies as the stacked form makes."""
    params, spec, _ = parse_adapter(moe_adapter(moe_base, 8, layout))
    per_expert, _ = to_sglang(params, spec, form="per_expert")
    whole, parts, config = sglang_packing(params, spec, form="per_expert")
    stacked, _ = to_sglang(params, spec, form="stacked")
    assert whole.keys() == stacked.keys() and parts.keys() <= whole.keys() and parts
    assert config == to_sglang(params, spec, form="per_expert")[1]
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        copies.append(tuple(src.shape))
        return real_copy(self, src, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    try:
        packed = PackedTensors(whole, torch.float32, shared=False, parts=parts)
    finally:
        torch.Tensor.copy_ = real_copy
    assert len(copies) == len(stacked)
    rebuilt = TorchOnly(__import__("io").BytesIO(packed.pickled())).load()
    assert rebuilt.keys() == per_expert.keys()
    assert digests(rebuilt, torch.float32) == digests(per_expert, torch.float32)


async def test_tensors_reach_a_server_process_exactly_inline_and_through_shared_memory(moe_base, tmp_path):
    fake = FakeProcess()
    engine = SGLangEngine("tiny-moe", urls=[fake.url], work_dir=tmp_path, adapter_transport="tensors")
    await engine.start()
    try:
        before = shm_segments()
        sizes = {}
        for n, (sharing, form, layout) in enumerate([("never", "per_expert", "per_expert"),
                                                     ("loopback", "per_expert", "shared_outer"),
                                                     ("loopback", "stacked", "per_expert")]):
            engine.shared_memory_tensors, engine.tensor_expert_form = sharing, form
            blob = moe_adapter(moe_base, 10 + n, layout)
            key = f"a{n}@v1"
            request_bytes = []
            real_call = engine.transport.load_call

            async def spy(server, name, path, request, real_call=real_call, request_bytes=request_bytes):
                request_bytes.append(len(request))
                return await real_call(server, name, path, request)

            engine.transport.load_call = spy
            await engine.load_adapter(key, blob)
            engine.transport.load_call = real_call
            sizes[sharing, form] = request_bytes[0]
            # Released by the engine once SGLang answered: nothing is left in /dev/shm ...
            assert shm_segments() == before
            # ... while the server still maps what it got, byte for byte the conversion's output (fp32: the server
            # serves this model's float32).
            params, spec, _ = parse_adapter(blob)
            expected = digests(to_sglang(params, spec, form=form)[0], torch.float32)
            assert fake.held(key) == expected
        blob_bytes = len(blob)
        assert sizes["never", "per_expert"] > blob_bytes  # inline: the tensors' bytes, base64
        assert sizes["loopback", "per_expert"] < blob_bytes / 4  # shared: names and offsets only
        assert sizes["loopback", "stacked"] < sizes["loopback", "per_expert"]
        await engine.unload_adapter("a1@v1")
        assert fake.held("a1@v1") is None
    finally:
        await engine.stop()
        fake.stop()


async def test_a_shared_outer_engine_sends_the_shared_factors_once_and_refuses_per_expert_adapters(moe_base,
                                                                                                    tmp_path):
    with pytest.raises(InvalidArgument, match="adapter_transport"):
        SGLangEngine("tiny-moe", urls=["http://127.0.0.1:1"], work_dir=tmp_path, expert_form="shared_outer",
                     adapter_transport="file")
    fake = FakeProcess()
    engine = SGLangEngine("tiny-moe", urls=[fake.url], work_dir=tmp_path, expert_form="shared_outer")
    # Launched servers run SGLang's shared-outer mode; versions always travel as tensors.
    assert "--experts-shared-outer-loras" in engine.launcher.extra_server_args
    assert engine.transport.adapter_transport == "tensors"
    await engine.start()
    try:
        blob = moe_adapter(moe_base, 21, "shared_outer")
        await engine.load_adapter("so@v1", blob)
        params, spec, _ = parse_adapter(blob)
        held = fake.held("so@v1")
        assert held == digests(to_sglang(params, spec, form="shared_outer")[0], torch.float32)
        assert held["base_model.model.model.layers.1.mlp.experts.gate_up_proj.lora_A.weight"][1][0] == 1
        with pytest.raises(FailedPrecondition, match="per-expert"):
            await engine.load_adapter("pe@v1", moe_adapter(moe_base, 22, "per_expert"))
        assert fake.held("pe@v1") is None
    finally:
        await engine.stop()
        fake.stop()


async def test_the_engine_adds_the_base_models_family_server_arguments(tmp_path):
    """gpt-oss's experts need SGLang's plain triton MoE runner once LoRA covers them (the family module says so);
    a Qwen3-MoE base adds nothing, and an operator's own --moe-runner-backend is kept."""
    from tests.fixtures.models import build_checkpoint

    checkpoint = build_checkpoint("gpt_oss", tmp_path / "gpt-oss")
    fake = FakeProcess()
    try:
        for base, given, expected in [
                (str(checkpoint), [], ["--moe-runner-backend", "triton"]),
                (str(checkpoint), ["--moe-runner-backend", "marlin"], ["--moe-runner-backend", "marlin"]),
                ("tiny-moe", [], [])]:
            engine = SGLangEngine(base, urls=[fake.url], work_dir=tmp_path / "w", extra_server_args=given)
            await engine.start()
            try:
                assert engine.launcher.extra_server_args == expected
            finally:
                await engine.stop()
    finally:
        fake.stop()


async def test_launched_servers_share_memory_url_servers_only_when_asked(tmp_path):
    fake = FakeProcess()
    engine = SGLangEngine("tiny-moe", urls=[fake.url], work_dir=tmp_path, adapter_transport="tensors")
    try:
        await engine.start()
        [server] = engine.servers
        assert not engine.transport.shares_memory(server)  # a URL: maybe another host's port, whose /dev/shm is not ours
        engine.shared_memory_tensors = "loopback"
        assert engine.transport.shares_memory(server)
        server.url = "http://10.1.2.3:30000"
        assert not engine.transport.shares_memory(server)
        engine.shared_memory_tensors = "launched"
        server.process = fake.process  # what a launched server's record holds
        assert engine.transport.shares_memory(server)
        engine.shared_memory_tensors = "never"
        assert not engine.transport.shares_memory(server)
        server.process = None
    finally:
        await engine.stop()
        fake.stop()


async def test_bf16_serving_tp2_server_gets_bf16_and_late_ranks_can_still_map_it(moe_base, tmp_path):
    fake = FakeProcess(tp=2, dtype="bfloat16")
    engine = SGLangEngine("tiny-moe", urls=[fake.url], work_dir=tmp_path, adapter_transport="tensors")
    engine.shared_memory_tensors = "loopback"
    await engine.start()
    try:
        before = shm_segments()
        blob = moe_adapter(moe_base, 21, "per_expert")  # alpha / rank = 2: bf16 rounding commutes with it
        await engine.load_adapter("b@v1", blob)
        params, spec, _ = parse_adapter(blob)
        assert fake.held("b@v1") == digests(to_sglang(params, spec)[0], torch.bfloat16)
        # SGLang answers when rank 0 has loaded: the name stays a while for the other ranks.
        [late] = shm_segments() - before
        payload = engine.transport.tensor_body("probe@v1", params, spec, "tiny-moe", engine.servers[0], shared=True)[1]
        assert payload.shared and payload.flat.dtype == torch.bfloat16
        payload.release()
        assert os.path.exists(late)
    finally:
        await engine.stop()
        fake.stop()
