"""SGLang engine routing and authority rules against FAKE SGLang HTTP servers.

This is a fake on purpose and only an addition: it checks what the engine sends (which names, to which server, which
tensors in which dtype), which a real server cannot report. The real SGLang 0.5.17 behaviour is covered by
tests/gpu/test_sglang_engine.py and bench/sampler.py --engine sglang.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import time

import pytest
import torch

from loraplane import errors
from loraplane.adapter_format import parse_adapter, peft_adapter_config
from sampler_svc.engines.base import GenerationRequest, SamplingOptions
from sampler_svc.engines.sglang_engine import SGLangEngine
from tests.fixtures.http import JsonHandler, serve
from tests.fixtures.sampler import adapter_blob


class TorchOnlyUnpickler(pickle.Unpickler):
    """Admits what SGLang 0.5.17's SafeUnpickler admits for tensors (torch, builtins, collections) and nothing else,
    so a payload that needs another module fails here as it would there."""

    def find_class(self, module, name):
        if not any((module + ".").startswith(p) for p in ("torch.", "builtins.", "collections.")):
            raise pickle.UnpicklingError(f"Blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


class FakeSGLang:
    """Records every call; /generate answers one fixed token per sample with logprob -1. `tensor_endpoint=False`
    plays a server older than /load_lora_adapter_from_tensors (FastAPI's 404)."""

    def __init__(self, *, tensor_endpoint: bool = True, tp_size: int = 1, dtype: str = "auto",
                 max_loaded_loras: int = 8, incremental_streaming: bool = False, chunk_interval_s: float = 0.0):
        self.calls: list[tuple[str, dict]] = []
        self.loaded: set[str] = set()
        # name -> one dict of tensors per TP rank copy, as the server would deserialize them
        self.tensors: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.configs: dict[str, dict] = {}
        fake = self

        class Handler(JsonHandler):
            def do_GET(self):
                if self.path == "/server_info":
                    return self.reply(200, {"tp_size": tp_size, "dtype": dtype,
                                            "max_loaded_loras": max_loaded_loras})
                self.reply(200, {})

            def do_POST(self):
                body = self.json_body()
                fake.calls.append((self.path, body))
                if self.path in ("/load_lora_adapter", "/load_lora_adapter_from_tensors"):
                    if self.path.endswith("tensors") and not tensor_endpoint:
                        return self.reply(404, {"detail": "Not Found"})
                    if body["lora_name"] in fake.loaded:
                        return self.reply(400, {"success": False, "error_message":
                                                f"Failed to load LoRA adapter {body['lora_name']} because it is "
                                                "already loaded"})
                    if self.path.endswith("tensors"):
                        fake.tensors[body["lora_name"]] = [
                            TorchOnlyUnpickler(io.BytesIO(base64.b64decode(copy, validate=True))).load()
                            for copy in body["serialized_named_tensors"]]
                        fake.configs[body["lora_name"]] = body["config_dict"]
                    fake.loaded.add(body["lora_name"])
                    return self.reply(200, {"success": True})
                if self.path == "/unload_lora_adapter":
                    fake.loaded.discard(body["lora_name"])
                    return self.reply(200, {"success": True})
                if body.get("stream"):
                    return self._stream(body["sampling_params"]["max_new_tokens"])
                count = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 1
                out = [{"output_ids": [7], "meta_info": {"output_token_logprobs": [[-1.0, 7, None]],
                                                         "finish_reason": {"type": "length"}}}] * count
                return self.reply(200, out)

            def _stream(self, tokens):
                """Server-sent events as SGLang 0.5.17 writes them: token i is 10 + i with logprob -(i + 1) / 10;
                every chunk repeats the output so far unless the server streams incrementally."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                pairs = [[-(i + 1) / 10, 10 + i, None] for i in range(tokens)]
                for i in range(tokens):
                    shown = pairs[i : i + 1] if incremental_streaming else pairs[: i + 1]
                    meta = {"output_token_logprobs": shown, "completion_tokens": i + 1,
                            "finish_reason": {"type": "length"} if i == tokens - 1 else None}
                    chunk = {"output_ids": [p[1] for p in shown], "meta_info": meta}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                    time.sleep(chunk_interval_s)  # a decode step
                self.wfile.write(b"data: [DONE]\n\n")

        self.http, self.url = serve(Handler)

    def names_sent(self) -> list:
        return [body.get("lora_path") for path, body in self.calls if path == "/generate"]

    def paths(self, prefix: str = "/load") -> list[str]:
        return [path for path, _ in self.calls if path.startswith(prefix)]


@pytest.fixture
def fakes():
    servers = [FakeSGLang(), FakeSGLang()]
    yield servers
    for server in servers:
        server.http.shutdown()


async def collect(engine, key):
    request = GenerationRequest(prompt_tokens=(5, 6), options=SamplingOptions(max_tokens=1), adapter_key=key)
    return [u async for u in engine.generate(request)]


async def test_routes_to_the_owning_server_and_never_sends_unloaded_names(fakes, tmp_path):
    engine = SGLangEngine("tiny", urls=[f.url for f in fakes], work_dir=tmp_path)
    await engine.start()
    await engine.load_adapter("a@v1", adapter_blob(1))
    await engine.load_adapter("b@v1", adapter_blob(2))
    owner = {key: next(f for f in fakes if key in f.loaded) for key in ("a@v1", "b@v1")}
    assert owner["a@v1"] is not owner["b@v1"]  # spread over the servers
    updates = await collect(engine, "a@v1")
    assert updates[0].tokens == [7] and owner["a@v1"].names_sent() == [["a@v1"]]
    await collect(engine, "b@v1")
    assert owner["b@v1"].names_sent() == [["b@v1"]]

    await engine.unload_adapter("a@v1")
    assert "a@v1" not in owner["a@v1"].loaded
    sent_before = sum(len(f.calls) for f in fakes)
    for key in ("a@v1", "never@v9"):
        with pytest.raises(errors.NotFound):
            await collect(engine, key)
    assert sum(len(f.calls) for f in fakes) == sent_before  # refused before any HTTP call
    await engine.stop()


async def test_loads_that_overlap_spread_over_the_servers_and_a_name_loads_once(fakes, tmp_path):
    """Each load picks its server before it awaits SGLang: without counting the loads under way, eight overlapping
    loads all chose the server that was emptiest when they began (8/0 over two servers)."""
    engine = SGLangEngine("tiny", urls=[f.url for f in fakes], work_dir=tmp_path)
    await engine.start()
    keys = [f"t{i}@v1" for i in range(8)]
    blob = adapter_blob(1)
    await asyncio.gather(*(engine.load_adapter(key, blob) for key in keys))
    counts = sorted(sum(key in f.loaded for key in keys) for f in fakes)
    assert counts == [4, 4]
    results = await asyncio.gather(engine.load_adapter("twice@v1", blob), engine.load_adapter("twice@v1", blob),
                                   return_exceptions=True)
    assert sum(isinstance(r, errors.AlreadyExists) for r in results) == 1
    assert sum(("twice@v1" in f.loaded) for f in fakes) == 1
    assert all(f_server.loading == 0 for f_server in engine.servers)
    await engine.stop()


def adapter_dirs(tmp_path) -> list:
    root = tmp_path / "adapters"
    return sorted(root.iterdir()) if root.exists() else []


async def test_versions_travel_as_tensors_exactly_and_no_file_is_written(tmp_path):
    fake = FakeSGLang()
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path, adapter_transport="tensors")
    await engine.start()
    try:
        blob = adapter_blob(1)
        await engine.load_adapter("a@v1", blob)
        assert fake.paths() == ["/load_lora_adapter_from_tensors"]
        assert adapter_dirs(tmp_path) == []
        params, spec, base_name = parse_adapter(blob)
        [sent] = fake.tensors["a@v1"]
        # tiny is fp32 and the server says "auto": the tensors go in fp32, bit for bit what the file would hold
        assert sorted(sent) == sorted(params)
        assert all(sent[k].dtype == torch.float32 and torch.equal(sent[k], params[k]) for k in params)
        expected_config = peft_adapter_config(spec, base_name)
        expected_config.pop("loraplane_seed")
        assert fake.configs["a@v1"] == json.loads(json.dumps(expected_config))
        updates = await collect(engine, "a@v1")
        assert updates[0].tokens == [7] and fake.names_sent() == [["a@v1"]]

        # The authority rules are the same as for files: unloaded first, then never sent again.
        await engine.unload_adapter("a@v1")
        assert "a@v1" not in fake.loaded
        with pytest.raises(errors.NotFound):
            await collect(engine, "a@v1")
        assert fake.names_sent() == [["a@v1"]]
    finally:
        await engine.stop()
        fake.http.shutdown()


async def test_bf16_server_gets_bf16_only_when_the_scale_is_a_power_of_two_and_one_copy_per_tp_rank(tmp_path):
    fake = FakeSGLang(dtype="bfloat16", tp_size=2)
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path, adapter_transport="tensors")
    await engine.start()
    try:
        exact = adapter_blob(1, rank=4, alpha=8.0)  # scale 2: rounding to bf16 commutes with it
        await engine.load_adapter("a@v1", exact)
        params = parse_adapter(exact)[0]
        copies = fake.tensors["a@v1"]
        assert len(copies) == 2
        for copy in copies:
            assert all(copy[k].dtype == torch.bfloat16 and torch.equal(copy[k], params[k].to(torch.bfloat16))
                       for k in params)
        odd = adapter_blob(2, rank=4, alpha=6.0)  # scale 1.5: only fp32 gives the file path's result
        await engine.load_adapter("b@v1", odd)
        assert all(t.dtype == torch.float32 for t in fake.tensors["b@v1"][0].values())
    finally:
        await engine.stop()
        fake.http.shutdown()


async def test_server_without_the_tensor_endpoint_gets_files_from_then_on(tmp_path):
    old, new = FakeSGLang(tensor_endpoint=False), FakeSGLang()
    engine = SGLangEngine("tiny", urls=[old.url, new.url], work_dir=tmp_path, adapter_transport="tensors")
    await engine.start()
    try:
        for index, key in enumerate(("a@v1", "b@v1", "c@v1", "d@v1")):
            await engine.load_adapter(key, adapter_blob(index + 1))
        # Asked once, refused with 404, then straight to files; the other server keeps getting tensors.
        assert old.paths() == ["/load_lora_adapter_from_tensors", "/load_lora_adapter", "/load_lora_adapter"]
        assert new.paths() == ["/load_lora_adapter_from_tensors"] * 2
        assert len(old.loaded) == len(new.loaded) == 2
        assert len(adapter_dirs(tmp_path)) == 2  # only the file-loaded versions have a directory
        file_key = next(iter(old.loaded))
        await collect(engine, file_key)
        assert old.names_sent() == [[file_key]]
        await engine.unload_adapter(file_key)
        assert len(adapter_dirs(tmp_path)) == 1 and file_key not in old.loaded
        with pytest.raises(errors.NotFound):
            await collect(engine, file_key)
    finally:
        await engine.stop()
        old.http.shutdown()
        new.http.shutdown()


async def test_a_name_left_by_an_earlier_sampler_is_replaced_on_the_tensor_path(tmp_path):
    fake = FakeSGLang()
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path, adapter_transport="tensors")
    await engine.start()
    try:
        fake.loaded.add("a@v1")  # loaded behind the engine's back (an earlier process)
        await engine.load_adapter("a@v1", adapter_blob(3))
        assert fake.paths("/") [-3:] == ["/load_lora_adapter_from_tensors", "/unload_lora_adapter",
                                        "/load_lora_adapter_from_tensors"]
        assert "a@v1" in engine.loaded_names
    finally:
        await engine.stop()
        fake.http.shutdown()


async def test_file_transport_never_sends_tensors_and_bad_transport_is_refused(tmp_path):
    fake = FakeSGLang()
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path, adapter_transport="file")
    await engine.start()
    try:
        await engine.load_adapter("a@v1", adapter_blob(1))
        assert fake.paths() == ["/load_lora_adapter"] and len(adapter_dirs(tmp_path)) == 1
    finally:
        await engine.stop()
        fake.http.shutdown()
    with pytest.raises(errors.InvalidArgument) as caught:
        SGLangEngine("tiny", urls=[fake.url], adapter_transport="shm")
    assert caught.value.field == "adapter_transport"


def test_base_model_facts_without_weights_match_the_loaded_model(tmp_path):
    from loraplane.models import load_base_model
    from sampler_svc.engines.sglang_engine import _base_model_facts

    tiny = load_base_model("tiny")
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    loaded, facts = load_base_model(str(tmp_path)), _base_model_facts(str(tmp_path))
    assert facts.model.device.type == "meta"  # no weights read
    for name in ("vocab_size", "max_context_length", "eos_token_ids", "num_layers", "hidden_size", "module_dims"):
        assert getattr(facts, name) == getattr(loaded, name), name


async def test_never_loads_past_sglangs_own_limit_so_sglang_never_evicts_behind_the_manager(tmp_path):
    fake = FakeSGLang(max_loaded_loras=2)
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path)
    await engine.start()
    try:
        await engine.load_adapter("a@v1", adapter_blob(1))
        await engine.load_adapter("b@v1", adapter_blob(2))
        sent = len(fake.calls)
        with pytest.raises(errors.ResourceExhausted):
            await engine.load_adapter("c@v1", adapter_blob(3))
        assert len(fake.calls) == sent and "c@v1" not in engine.loaded_names
        await engine.unload_adapter("a@v1")
        await engine.load_adapter("c@v1", adapter_blob(3))
        assert fake.loaded == {"b@v1", "c@v1"}
    finally:
        await engine.stop()
        fake.http.shutdown()


async def test_a_version_goes_to_a_server_with_room_when_the_least_loaded_one_is_at_its_own_limit(tmp_path):
    """The server choice is the sampler placement policy (loraplane/routing.py, FEWEST_ADAPTERS): among servers with
    room under their --max-loaded-loras, the one holding the fewest versions (the first on a tie)."""
    small, large = FakeSGLang(max_loaded_loras=1), FakeSGLang(max_loaded_loras=8)
    engine = SGLangEngine("tiny", urls=[small.url, large.url], work_dir=tmp_path)
    await engine.start()
    try:
        for key in ("a@v1", "b@v1", "c@v1"):
            await engine.load_adapter(key, adapter_blob(1))
        assert (small.loaded, large.loaded) == ({"a@v1"}, {"b@v1", "c@v1"})
    finally:
        await engine.stop()
        small.http.shutdown()
        large.http.shutdown()


async def test_auto_sends_files_to_servers_on_this_host_and_tensors_to_the_others(tmp_path):
    fake = FakeSGLang()
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path)  # default "auto", loopback URL
    await engine.start()
    try:
        blob = adapter_blob(1)
        await engine.load_adapter("a@v1", blob)
        assert fake.paths() == ["/load_lora_adapter"]
        [directory] = adapter_dirs(tmp_path)
        # A float32 blob is written as it is: SGLang reads the same tensors the blob holds.
        assert (directory / "adapter_model.safetensors").read_bytes() == blob
        config = json.loads((directory / "adapter_config.json").read_text())
        spec = parse_adapter(blob)[1]
        assert config["r"] == spec.rank and config["lora_alpha"] == spec.effective_alpha
        assert "loraplane_seed" not in config
        # The same server seen under a name that is not loopback (the engine cannot tell it is local): tensors.
        engine.servers[0].url = fake.url.replace("127.0.0.1", "127.0.0.1.nip.invalid")
        assert engine.transport.sends_tensors(engine.servers[0])
        engine.servers[0].url = fake.url
        assert not engine.transport.sends_tensors(engine.servers[0])
    finally:
        await engine.stop()
        fake.http.shutdown()


@pytest.mark.parametrize("stored, written", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_blobs_reach_sglang_as_bf16_or_float32_files(tmp_path, stored, written):
    """A bf16 blob (LoraConfig.weights_dtype, or a producer other than this project) is written as it is, half the
    bytes of float32, which SGLang casts exactly to its own dtype; other dtypes become float32."""
    from safetensors.torch import load_file, save

    from sampler_svc.engines.sglang_transport import write_peft_dir

    params, spec, base_name = parse_adapter(adapter_blob(1))
    blob = save({k: v.to(stored) for k, v in params.items()},
                metadata={"format": "pt", "adapter_config": json.dumps(peft_adapter_config(spec, base_name))})
    directory = write_peft_dir(blob, tmp_path / "d")
    on_disk = load_file(directory / "adapter_model.safetensors")
    assert sorted(on_disk) == sorted(params)
    assert all(on_disk[k].dtype == written and torch.equal(on_disk[k], params[k].to(stored).to(written))
               for k in params)
    if stored == written:
        assert (directory / "adapter_model.safetensors").read_bytes() == blob


async def test_status_names_the_engines_servers_to_the_operator_only(fakes, tmp_path):
    """GetStatus.engine_servers: an admin (or the open mode) learns where the SGLang servers run, a tenant does not
    (where the servers run is the operator's business). The manager is never started: status reads no registry."""
    from loraplane.auth import OPEN, ROLE_TENANT, Identity
    from loraplane.local.processes import free_port
    from loraplane.registry_client import RegistryClient
    from sampler_svc.adapter_manager import AdapterManager
    from sampler_svc.service import SamplerService

    engine = SGLangEngine("tiny", urls=[f.url for f in fakes], work_dir=tmp_path)
    await engine.start()
    registry = RegistryClient(f"127.0.0.1:{free_port()}")
    try:
        manager = AdapterManager(engine, registry, redis_url=f"redis://127.0.0.1:{free_port()}", key_prefix="t:",
                                 instance_id="status-test")
        service = SamplerService(engine, manager)
        assert service.status(caller=OPEN).engine_servers == [f.url for f in fakes]
        tenant = Identity(key_id="k1", tenant="acme", role=ROLE_TENANT)
        assert service.status(caller=tenant).engine_servers == []
    finally:
        await registry.close()
        await engine.stop()


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative-chunks", "incremental-chunks"])
async def test_streamed_samples_arrive_whole_whether_or_not_a_backlog_is_coalesced(tmp_path, incremental):
    """Tried: both chunk forms SGLang can stream, read promptly (one update per token) and after a deliberate stall
    (the backlog must leave as fewer, merged updates with nothing lost or repeated)."""
    # One token every 40 ms per sample (a decode step), so a consumer that keeps up sees them one by one.
    fake = FakeSGLang(incremental_streaming=incremental, chunk_interval_s=0.04)
    engine = SGLangEngine("tiny", urls=[fake.url], work_dir=tmp_path)
    await engine.start()
    try:
        tokens = 12
        expected = {"tokens": [10 + i for i in range(tokens)], "logprobs": [-(i + 1) / 10 for i in range(tokens)]}
        for stall in (False, True):
            request = GenerationRequest(prompt_tokens=(5, 6), options=SamplingOptions(max_tokens=tokens),
                                        num_samples=3, stream=True)
            per_sequence: dict[int, dict[str, list]] = {}
            updates, finished = 0, []
            stream = engine.generate(request)
            async for update in stream:
                if stall and updates == 0:
                    await asyncio.sleep(1.0)  # every sample's remaining chunks (12 x 40 ms) queue up meanwhile
                updates += 1
                got = per_sequence.setdefault(update.sequence_index, {"tokens": [], "logprobs": []})
                got["tokens"] += update.tokens
                got["logprobs"] += update.logprobs
                if update.finish_reason is not None:
                    finished.append(update.sequence_index)
            assert per_sequence == {i: expected for i in range(3)}
            assert sorted(finished) == [0, 1, 2]
            if stall:
                assert updates < 3 * tokens / 2, f"backlog not coalesced: {updates} updates"
            else:
                # Read promptly, tokens leave as they come: far more updates than the stalled read gives (a loaded
                # machine may still merge a few neighbours).
                assert updates >= 2 * tokens, f"a prompt reader got only {updates} updates"
    finally:
        await engine.stop()
        fake.http.shutdown()
