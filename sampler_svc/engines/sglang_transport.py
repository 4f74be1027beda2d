"""Adapter versions to and from SGLang servers: one class, AdapterTransport, that loads a version onto the server
chosen for it and unloads it.

Each adapter version is loaded under its own name (`<adapter>@v<N>`: SGLang cannot replace a loaded name), one of
two ways (`adapter_transport`):
- "file": written as a PEFT directory and loaded with `/load_lora_adapter` (the server must see this filesystem);
- "tensors": sent to `/load_lora_adapter_from_tensors` (SGLang >= 0.5.8): to a server on another host with their
  bytes in the request body; to a server this engine launched (`shared_memory_tensors`) as the name of a /dev/shm
  segment holding them, which SGLang's ranks map (a 2.6 GB Qwen3-30B-A3B expert adapter: a 100 KB request instead
  of 3.4 GB of base64 that SGLang decodes, copies to its scheduler and unpickles). Nothing is written to a file
  system, so it works where SGLang cannot read adapter files (`--load-format dummy`). A server without that
  endpoint (HTTP 404/405, or 422 from the older request shape) gets files from then on.
- "auto" (default): files for servers on this host, tensors for the others. On SGLang 0.5.17 over HTTP the tensor
  path is the slower one on one host (H100, 8B-shape rank-32 adapter: 4.0 s vs 1.2 s; docs/benchmarks.md): the
  tensors travel base64 in JSON and are pickled twice on the way, while the file path reads the page cache.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

from loraplane import errors
from loraplane.adapter_format import (
    SGLANG_SHARED_OUTER,
    adapter_header,
    adapter_tensor_views,
    materialize_peft_dir,
    materialize_sglang_dir,
    peft_adapter_config,
    sglang_modules,
    sglang_packing,
    sglang_target_modules,
)
from sampler_svc.engines.base import LoadedAdapterInfo
from sampler_svc.engines.sglang_servers import SGLangHTTP, SGLangServer

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "tensors", "file")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def _no_tensor_endpoint(status: int, body: object) -> bool:
    """A server that lacks /load_lora_adapter_from_tensors (404/405), knows only its pre-0.5.17 request shape
    (422), or whose unpickler refuses a class the tensors need: it gets files instead."""
    return status in (404, 405, 422) or (status != 200 and "Blocked unsafe class" in str(body))


@dataclass
class AdapterTransport:
    """Loads and unloads adapter versions on SGLang servers. `checkpoint_dtype`: the base checkpoint's dtype, the
    serving dtype of a server that reports "auto" (set by the engine once it has read the base model)."""

    http: SGLangHTTP
    base_model_name: str
    work_dir: Path
    max_lora_rank: int = 64
    adapter_transport: str = "auto"
    checkpoint_dtype: str = ""
    # The form expert LoRA travels in as tensors (adapter_format.sglang_packing): "per_expert" keys (the form the GPU
    # tests verified), "stacked" 3-D tensors (4 per layer instead of 6 per expert: 288 keys for Qwen3-30B-A3B, not
    # 37k), or "shared_outer" (stacked, shared factors once: servers with --experts-shared-outer-loras).
    tensor_expert_form: str = "per_expert"
    # Which servers get tensors through shared memory instead of in the request body: "launched" (the servers this
    # engine started, on this host for sure), "loopback" (also those given by a loopback URL), "never". Only where
    # the server surely shares this host's /dev/shm: SGLang 0.5.17 unpickles in its scheduler without a guard, so a
    # segment it cannot open would end the server, not fail the request.
    shared_memory_tensors: str = "launched"
    # The base model's family (loraplane.models.families): which LoRA targets SGLang serves on it. None: not known
    # (every target goes to SGLang as it is).
    family: object | None = None

    def __post_init__(self):
        if self.adapter_transport not in TRANSPORTS:
            raise errors.InvalidArgument(
                f"adapter_transport must be one of {TRANSPORTS}, not {self.adapter_transport!r}",
                field="adapter_transport")

    def adapter_dir(self, key: str) -> Path:
        return self.work_dir / "adapters" / key.replace("/", "__")

    async def load(self, server: SGLangServer, key: str, blob: bytes) -> LoadedAdapterInfo:
        tensors = self.sends_tensors(server)
        # The digest was checked on download and the values by the registry: the header is all that must be read (a
        # file is the blob's own bytes; tensors go as views of them, in their stored dtype, until packed).
        header = await asyncio.to_thread(adapter_header, blob)
        spec, base_name, _dtypes = header
        if base_name and base_name != self.base_model_name:
            raise errors.FailedPrecondition(
                f"{key} was trained on {base_name!r}; this sampler serves {self.base_model_name!r}", field="adapter")
        if spec.rank > self.max_lora_rank:
            raise errors.FailedPrecondition(
                f"{key} has rank {spec.rank}; the SGLang servers allow at most {self.max_lora_rank}", field="adapter")
        if self.family is not None:
            sglang_modules(spec, self.family)  # a target SGLang cannot serve: refused here, never sent
        status, body = None, None
        if tensors:
            status, body = await self.load_tensors(server, key, blob)
            if _no_tensor_endpoint(status, body):
                if self.tensor_expert_form == SGLANG_SHARED_OUTER:
                    raise errors.FailedPrecondition(
                        f"SGLang {server.url} takes no adapter tensors (HTTP {status}), and its shared-outer expert "
                        f"LoRA cannot go to it as a PEFT directory: {str(body)[:200]}", field="adapter")
                log.warning("SGLang %s has no usable /load_lora_adapter_from_tensors (HTTP %s: %s); adapter versions "
                            "go to it as files from now on", server.url, status, str(body)[:200])
                server.tensor_loads = False
                status = None
            else:
                server.tensor_loads = server.tensor_loads or status == 200
        if status is None:
            directory = self.adapter_dir(key)
            await asyncio.to_thread(write_peft_dir, blob, directory, header, self.family)
            status, body = await self.load_call(server, key, "/load_lora_adapter",
                                                {"lora_name": key, "lora_path": str(directory)})
            if status != 200 or (isinstance(body, dict) and body.get("success") is False):
                await asyncio.to_thread(shutil.rmtree, directory, True)
        if status != 200 or (isinstance(body, dict) and body.get("success") is False):
            raise errors.FailedPrecondition(f"SGLang {server.url} refused to load {key}: {str(body)[:500]}",
                                            field="adapter")
        return LoadedAdapterInfo(key=key, rank=spec.rank)

    def sends_tensors(self, server: SGLangServer) -> bool:
        if server.tensor_loads is False or self.adapter_transport == "file":
            return False
        if self.adapter_transport == "tensors":
            return True
        from urllib.parse import urlsplit

        return server.process is None and urlsplit(server.url).hostname not in _LOOPBACK_HOSTS

    async def load_call(self, server: SGLangServer, key: str, path: str, request: dict | bytes
                        ) -> tuple[int, object]:
        status, body = await self.http.request(server, path, request)
        if status == 400 and "already loaded" in str(body):
            # Left there by an earlier sampler process: the bytes may differ, so replace it.
            await self.http.request(server, "/unload_lora_adapter", {"lora_name": key})
            status, body = await self.http.request(server, path, request)
        return status, body

    def transfer_dtype(self, spec, server: SGLangServer):
        """The dtype the tensors travel in. SGLang copies each weight into its LoRA buffers in the serving dtype
        (MoE layers first multiply B by alpha/rank in the dtype it arrives in). Sent in fp32, the result is exactly
        the file path's; sent in bf16 it is the same bits when SGLang serves bf16 and alpha/rank is a power of two
        (rounding then commutes with the scaling), at half the bytes. Otherwise fp32."""
        import torch

        serving = server.dtype if server.dtype not in ("auto", "") else self.checkpoint_dtype
        scale = spec.scale
        power_of_two = scale > 0 and math.frexp(scale)[0] == 0.5
        return torch.bfloat16 if serving == "bfloat16" and power_of_two else torch.float32

    def shares_memory(self, server: SGLangServer) -> bool:
        """Whether tensors reach `server` through shared memory (see shared_memory_tensors)."""
        if self.shared_memory_tensors == "never":
            return False
        if server.process is not None:
            return True
        from urllib.parse import urlsplit

        return self.shared_memory_tensors == "loopback" and urlsplit(server.url).hostname in _LOOPBACK_HOSTS

    async def load_tensors(self, server: SGLangServer, key: str, blob: bytes) -> tuple[int, object]:
        """/load_lora_adapter_from_tensors with the blob's tensors, through shared memory where the server shares
        this host's. The segment's name is unlinked when this engine lets go of it, right after SGLang answered
        (its rank has mapped it by then; the mapping lives on as long as SGLang keeps the adapter), so nothing is
        left in /dev/shm whatever SGLang did with the call. With several TP ranks, SGLang answers when rank 0 has
        loaded: the name is kept _LATE_RANKS_S longer for the others to map it."""

        def build() -> tuple[bytes, PackedTensors]:
            params, spec, base_name = adapter_tensor_views(blob)
            return self.tensor_body(key, params, spec, base_name, server, self.shares_memory(server))

        request, packed = await asyncio.to_thread(build)
        try:
            return await self.load_call(server, key, "/load_lora_adapter_from_tensors", request)
        finally:
            if packed.shared and server.tp_size > 1:
                asyncio.get_running_loop().call_later(_LATE_RANKS_S, packed.release)
            else:
                packed.release()

    def tensor_body(self, key: str, params: dict, spec, base_name: str, server: SGLangServer, shared: bool
                    ) -> tuple[bytes, PackedTensors]:
        """The JSON body of /load_lora_adapter_from_tensors: the PEFT config and the PEFT-named tensors (expert
        LoRA in the form SGLang serves, tensor_expert_form) in the transfer dtype, pickled as views of one buffer
        (PackedTensors), the same pickle once per TP rank; and the buffer, which must outlive the call when shared."""
        dtype = self.transfer_dtype(spec, server)
        config = peft_adapter_config(spec, base_name)
        if spec.has_experts:
            # SGLang serves expert LoRA from per-expert keys or 3-D expert tensors; PEFT's target_parameters layout
            # would be accepted with its experts silently dropped (adapter_format.sglang_packing).
            params, parts, config = sglang_packing(params, spec, form=self.tensor_expert_form)
            config["base_model_name_or_path"] = base_name
        else:
            parts = None
        packed = PackedTensors(params, dtype, shared, parts)
        encoded = base64.b64encode(packed.pickled())
        if not packed.shared:
            packed.release()  # its bytes are in the pickle
        config.pop("loraplane_seed", None)
        config.pop("loraplane_expert_layout", None)
        if self.family is not None:
            config["target_modules"] = sglang_target_modules(config["target_modules"], self.family)
        head = json.dumps({"lora_name": key, "config_dict": config}).encode()[:-1]
        copies = b",".join([b'"' + encoded + b'"'] * server.tp_size)
        return head + b', "serialized_named_tensors": [' + copies + b"]}", packed

    async def unload(self, server: SGLangServer, key: str) -> None:
        status, body = await self.http.request(server, "/unload_lora_adapter", {"lora_name": key})
        if status != 200:
            log.warning("SGLang %s failed to unload %s: %s", server.url, key, body)
        await asyncio.to_thread(shutil.rmtree, self.adapter_dir(key), True)


def write_peft_dir(blob: bytes, directory: Path, header: tuple | None = None, family=None) -> Path:
    """The PEFT directory SGLang loads. A float32 or bfloat16 blob already is the adapter_model.safetensors SGLang
    reads (PEFT tensor names; its extra metadata is ignored; SGLang casts to the server's dtype, which is exact from
    either), so its bytes are written as they are, without parsing and re-serializing them (for an 8B-shape
    rank-32 adapter, 335 MB, that pair cost as much as SGLang's load; a bf16 version stays half of it). Other
    dtypes go through materialize_peft_dir, which writes float32. ``header``: the blob's ``adapter_header`` where the
    caller already read it. ``family``: the served model's, whose names for fused modules the config then uses
    (sglang_target_modules)."""
    spec, base_name, dtypes = header or adapter_header(blob)
    if spec.has_experts or any(dtype not in ("F32", "BF16") for dtype in dtypes.values()):
        # per-expert keys (the expert layout SGLang serves), or float32 from another dtype
        written = (materialize_sglang_dir if spec.has_experts else materialize_peft_dir)(blob, directory)
        if family is not None:
            path = directory / "adapter_config.json"
            config = json.loads(path.read_text())
            config["target_modules"] = sglang_target_modules(config["target_modules"], family)
            path.write_text(json.dumps(config, indent=2, sort_keys=True))
        return written
    directory.mkdir(parents=True, exist_ok=True)
    config = peft_adapter_config(spec, base_name)
    config.pop("loraplane_seed", None)
    if family is not None:
        config["target_modules"] = sglang_target_modules(config["target_modules"], family)
    for name, data in (("adapter_model.safetensors", blob),
                       ("adapter_config.json", json.dumps(config, indent=2, sort_keys=True).encode())):
        temporary = directory / f".{name}.tmp"
        temporary.write_bytes(data)
        temporary.replace(directory / name)
    return directory


class PackedTensors:
    """Named tensors copied, cast to one dtype, into one flat buffer (a tensor object named twice, such as the A
    gate_proj and up_proj share, is stored once), and pickled as views of it that SGLang's restricted unpickler
    rebuilds (torch.multiprocessing.reductions.rebuild_tensor: every name the pickle needs is torch's). The buffer
    is pickled once (the pickle memo), not per tensor: plain pickle of 37k tensors costs a torch.save per tensor
    on each side, and a view pickles its whole storage.

    shared: the buffer is a POSIX shared-memory segment (torch's file_system sharing, /dev/shm) and the pickle
    carries its name, not its bytes; each SGLang rank (a process of its own) maps it once (torch.multiprocessing.
    reductions.rebuild_storage_filename, one storage object per pickle). torch's own reduction adds a reference
    for each reader, which leaks the segment when the reader never comes (a refused call, a dead server); none is
    added here, so the segment's name goes when release() drops this buffer (a reader's rebuild takes back the
    reference its mapping added), and the memory when the last mapping goes. Falls back to private memory when
    /dev/shm has no room for it (a full tmpfs would kill this process with SIGBUS mid-copy)."""

    def __init__(self, named: dict, dtype, shared: bool, parts: dict | None = None):
        import torch

        slots: dict[int, tuple[int, torch.Tensor]] = {}
        self.layout: dict[str, tuple[int, tuple[int, ...]]] = {}
        total = 0
        for name, tensor in named.items():
            slot = slots.get(id(tensor))
            if slot is None:
                slot = slots[id(tensor)] = (total, tensor)
                total += tensor.numel()
            split = parts.get(name) if parts else None
            if split is None:
                self.layout[name] = (slot[0], tuple(tensor.shape))
                continue
            # A stacked expert tensor [E, rows, cols] goes in with one copy and is named by its per-expert slices
            # (adapter_format.sglang_packing): 37k copies of strided slices took 7 s at 48 layers on an idle H100
            # host and 100 s beside a busy process, against 0.8 s for the 576 stacked copies (docs/benchmarks.md).
            _, rows, cols = tensor.shape
            for part, expert, first, end in split:
                self.layout[part] = (slot[0] + (expert * rows + first) * cols, (end - first, cols))
        nbytes = max(1, total * torch.empty((), dtype=dtype).element_size())
        self.shared = shared and _shm_room(nbytes)
        storage = None
        if self.shared:
            try:
                storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
            except RuntimeError as exc:  # no torch_shm_manager, no /dev/shm: the bytes go inline
                log.warning("no shared memory for adapter tensors (%s); sending them in the request", exc)
                self.shared = False
        if storage is None:
            storage = torch.UntypedStorage(nbytes)
        self.dtype = dtype
        self.flat = torch.empty(0, dtype=dtype).set_(storage, 0, (total,), (1,))
        for offset, tensor in slots.values():
            self.flat[offset:offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        self.nbytes = nbytes

    def pickled(self) -> bytes:
        import torch

        if self.shared:
            manager, handle, nbytes = self.flat.untyped_storage()._share_filename_cpu_()
            storage = _SharedStorage(manager, handle, nbytes, self.dtype)
        else:
            storage = torch.TypedStorage(wrap_storage=self.flat.untyped_storage(), dtype=self.dtype, _internal=True)
        views = {name: _View(storage, offset, shape) for name, (offset, shape) in self.layout.items()}
        return pickle.dumps(views, protocol=pickle.HIGHEST_PROTOCOL)

    def release(self) -> None:
        self.flat = None


class _View:
    """Pickles as rebuild_tensor(Tensor, storage, (offset, shape, contiguous strides, no grad)); one `storage`
    object shared by every view, so the pickle holds it once."""

    __slots__ = ("offset", "shape", "storage")

    def __init__(self, storage, offset: int, shape: tuple[int, ...]):
        self.storage, self.offset, self.shape = storage, offset, shape

    def __reduce__(self):
        import torch
        from torch.multiprocessing.reductions import rebuild_tensor

        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        return rebuild_tensor, (torch.Tensor, self.storage, (self.offset, self.shape, tuple(reversed(strides)), False))


class _SharedStorage:
    """Pickles as a typed storage mapped from shared-memory segment `handle` (torch's manager socket `manager`)."""

    def __init__(self, manager: bytes, handle: bytes, nbytes: int, dtype):
        self.args = (manager, handle, nbytes)
        self.dtype = dtype

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_typed_storage

        return rebuild_typed_storage, (_SharedSegment(*self.args), self.dtype)


class _SharedSegment:
    def __init__(self, manager: bytes, handle: bytes, nbytes: int):
        self.args = (manager, handle, nbytes)

    def __reduce__(self):
        import torch
        from torch.multiprocessing.reductions import rebuild_storage_filename

        return rebuild_storage_filename, (torch.UntypedStorage, *self.args)


# How long a shared segment's name outlives SGLang's answer when the server has several TP ranks (see load_tensors).
_LATE_RANKS_S = 60.0


def _shm_room(nbytes: int) -> bool:
    """Whether /dev/shm has room for `nbytes` more (with 256 MB to spare)."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= nbytes + (256 << 20)

