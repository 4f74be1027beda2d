"""Contract tests of AdapterRegistryService: every RPC through the generated stubs, against a live registry on real
Valkey + SeaweedFS. Bad input: each case says what was tried; the status code and the field named in the message
are asserted, and so is that nothing a caller can observe changed."""

from __future__ import annotations

import io
import math
import os
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplane.v1 import common_pb2, registry_pb2
from tests.fixtures.registry import (
    TEST_BASE_MODEL,
    adapter_blob,
    all_events,
    bucket_objects,
    create_adapter,
    download,
    multipart_uploads,
    publish,
    publish_requests,
    registry_state,
    rpc_error,
    s3_client,
    sha256_hex,
    start_live_registry,
    versions_of,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
WEIGHTS = common_pb2.VERSION_KIND_WEIGHTS
STATE = common_pb2.VERSION_KIND_TRAINING_STATE
E = registry_pb2


def ref(name: str, version: int = 0, alias: str = "") -> common_pb2.AdapterRef:
    r = common_pb2.AdapterRef(name=name)
    if version:
        r.version = version
    if alias:
        r.alias = alias
    return r


def blob_of(size: int, seed: int = 0, *, kind: int = WEIGHTS) -> bytes:
    """A blob the registry accepts (an adapter, or a training state) of about `size` bytes: random values, or the
    same bytes for the same non-zero seed."""
    return adapter_blob(size, seed or None, training_state=kind == STATE)


# ---------------------------------------------------------------------------------------------------- adapters

def test_health_and_service_are_served(registry):
    with grpc.insecure_channel(registry.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="loraplane.v1.AdapterRegistryService"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_create_get_list_delete_adapter(registry, registry_stub):
    stub = registry_stub
    lora = common_pb2.LoraConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=7)
    made = create_adapter(stub, "team/exp-1", lora_config=lora, base_model="tiny", keep_last=3, metadata={"owner": "ann"})
    assert made.name == "team/exp-1" and made.lora_config == lora and made.base_model == "tiny"
    assert made.keep_last == 3 and dict(made.metadata) == {"owner": "ann"} and made.latest_version == 0
    assert made.create_time.seconds > 0

    got = stub.GetAdapter(E.GetAdapterRequest(name="team/exp-1")).adapter
    assert got == made
    create_adapter(stub, "solo")
    names = [a.name for a in stub.ListAdapters(E.ListAdaptersRequest()).adapters]
    assert names == ["solo", "team/exp-1"]

    stub.DeleteAdapter(E.DeleteAdapterRequest(name="team/exp-1"))
    with rpc_error(NOT_FOUND, "name", "team/exp-1"):
        stub.GetAdapter(E.GetAdapterRequest(name="team/exp-1"))
    assert [a.name for a in stub.ListAdapters(E.ListAdaptersRequest()).adapters] == ["solo"]
    events = [(e.type, e.adapter) for e in all_events(stub)]
    assert events == [(E.EVENT_TYPE_ADAPTER_CREATED, "team/exp-1"), (E.EVENT_TYPE_ADAPTER_CREATED, "solo"),
                      (E.EVENT_TYPE_ADAPTER_DELETED, "team/exp-1")]


def test_an_adapters_lora_config_comes_back_exactly_as_given(registry, registry_stub):
    """The registry keeps a LoRA config as the trainer gave it (unspecified stays unspecified), whatever its domain
    type: every expert layout and weights dtype value, alpha 0, no targets."""
    configs = [common_pb2.LoraConfig(rank=4, expert_layout=layout, weights_dtype=dtype)
               for layout in (0, 1, 2) for dtype in (0, 1, 2)]
    configs.append(common_pb2.LoraConfig(rank=2, alpha=3.5, seed=2**63, target_modules=EXPERT_TARGETS,
                                         expert_layout=common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER))
    for index, lora in enumerate(configs):
        made = create_adapter(registry_stub, f"as-given-{index}", lora_config=lora)
        assert made.lora_config == lora
        assert registry_stub.GetAdapter(E.GetAdapterRequest(name=f"as-given-{index}")).adapter.lora_config == lora
    with rpc_error(INVALID, "adapter.lora_config.expert_layout", "7 is not an ExpertLoraLayout"):
        create_adapter(registry_stub, "bad-layout", lora_config=common_pb2.LoraConfig(rank=4, expert_layout=7))


def test_create_adapter_bad_input_is_rejected_and_changes_nothing(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "taken", metadata={"k": "v"})
    before = registry_state(stub, registry.settings)
    cases = [
        # (what was tried, adapter fields, field named in the message)
        ("empty name", {"name": ""}, "adapter.name"),
        ("upper case", {"name": "Exp"}, "adapter.name"),
        ("leading dash", {"name": "-exp"}, "adapter.name"),
        ("64 characters", {"name": "a" * 64}, "adapter.name"),
        ("two tenant levels", {"name": "a/b/c"}, "adapter.name"),
        ("empty tenant", {"name": "/exp"}, "adapter.name"),
        ("empty name after tenant", {"name": "team/"}, "adapter.name"),
        ("space", {"name": "my exp"}, "adapter.name"),
        ("colon", {"name": "a:b"}, "adapter.name"),
        ("rank over the limit", {"name": "x", "lora_config": common_pb2.LoraConfig(rank=10**6)},
         "adapter.lora_config.rank"),
        ("negative alpha", {"name": "x", "lora_config": common_pb2.LoraConfig(rank=4, alpha=-1)},
         "adapter.lora_config.alpha"),
        ("NaN alpha", {"name": "x", "lora_config": common_pb2.LoraConfig(rank=4, alpha=math.nan)},
         "adapter.lora_config.alpha"),
        ("unknown projection", {"name": "x", "lora_config": common_pb2.LoraConfig(rank=4, target_modules=["lm_head"])},
         "adapter.lora_config.target_modules"),
        ("repeated projection",
         {"name": "x", "lora_config": common_pb2.LoraConfig(rank=4, target_modules=["q_proj", "q_proj"])},
         "adapter.lora_config.target_modules"),
        ("65 metadata entries", {"name": "x", "metadata": {f"k{i}": "v" for i in range(65)}}, "adapter.metadata"),
        ("empty metadata key", {"name": "x", "metadata": {"": "v"}}, "adapter.metadata"),
        ("129-char metadata key", {"name": "x", "metadata": {"k" * 129: "v"}}, "adapter.metadata"),
        ("4097-char metadata value", {"name": "x", "metadata": {"k": "v" * 4097}}, "adapter.metadata"),
        ("513-char base model", {"name": "x", "base_model": "m" * 513}, "adapter.base_model"),
        ("rank 0", {"name": "x", "lora_config": common_pb2.LoraConfig(rank=0)}, "adapter.lora_config.rank"),
        ("no lora_config (rank 0)", {"name": "x", "lora_config": common_pb2.LoraConfig()}, "adapter.lora_config.rank"),
        ("empty base model", {"name": "x", "base_model": ""}, "adapter.base_model"),
        ("base model with '..'", {"name": "x", "base_model": "../../etc/passwd"}, "adapter.base_model"),
        ("base model with a space", {"name": "x", "base_model": "my model"}, "adapter.base_model"),
        ("name with a trailing newline", {"name": "exp\n"}, "adapter.name"),
    ]
    for what, fields, field in cases:
        with rpc_error(INVALID, field) as caught:
            create_adapter(stub, **fields)
        assert caught.value.code() == INVALID, what
    with rpc_error(grpc.StatusCode.ALREADY_EXISTS, "adapter.name", "taken"):
        create_adapter(stub, "taken", metadata={"k": "other"})
    assert registry_state(stub, registry.settings) == before


def test_get_and_delete_adapter_bad_input(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "kept")
    before = registry_state(stub, registry.settings)
    with rpc_error(NOT_FOUND, "name", "ghost"):  # unknown name
        stub.GetAdapter(E.GetAdapterRequest(name="ghost"))
    with rpc_error(INVALID, "name"):  # malformed name
        stub.GetAdapter(E.GetAdapterRequest(name="Bad Name"))
    with rpc_error(NOT_FOUND, "name", "ghost"):  # deleting an unknown adapter
        stub.DeleteAdapter(E.DeleteAdapterRequest(name="ghost"))
    with rpc_error(INVALID, "name"):  # deleting with an empty name
        stub.DeleteAdapter(E.DeleteAdapterRequest(name=""))
    assert registry_state(stub, registry.settings) == before


def test_list_adapters_pagination_and_prefix(registry, registry_stub):
    stub = registry_stub
    names = sorted([f"t1/a{i}" for i in range(5)] + [f"t2/b{i}" for i in range(3)] + ["z"])
    for name in names:
        create_adapter(stub, name)

    seen, token, pages = [], "", 0
    while True:
        reply = stub.ListAdapters(E.ListAdaptersRequest(page_size=2, page_token=token))
        assert len(reply.adapters) <= 2
        seen += [a.name for a in reply.adapters]
        token, pages = reply.next_page_token, pages + 1
        if not token:
            break
    assert seen == names and pages == 5

    reply = stub.ListAdapters(E.ListAdaptersRequest(prefix="t1/", page_size=3))
    assert [a.name for a in reply.adapters] == [f"t1/a{i}" for i in range(3)] and reply.next_page_token
    rest = stub.ListAdapters(E.ListAdaptersRequest(prefix="t1/", page_size=3, page_token=reply.next_page_token))
    assert [a.name for a in rest.adapters] == ["t1/a3", "t1/a4"] and rest.next_page_token == ""
    # page_size 0 is the default (100) and above 1000 is coerced, not refused.
    assert [a.name for a in stub.ListAdapters(E.ListAdaptersRequest(page_size=0)).adapters] == names
    assert [a.name for a in stub.ListAdapters(E.ListAdaptersRequest(page_size=5000)).adapters] == names

    before = registry_state(stub, registry.settings)
    with rpc_error(INVALID, "page_size"):  # negative page size
        stub.ListAdapters(E.ListAdaptersRequest(page_size=-1))
    with rpc_error(INVALID, "page_token"):  # a token this registry never issued
        stub.ListAdapters(E.ListAdaptersRequest(page_token="not-a-token"))
    with rpc_error(INVALID, "page_token"):  # a token of another query (prefix changed between pages)
        stub.ListAdapters(E.ListAdaptersRequest(prefix="t2/", page_token=reply.next_page_token))
    with rpc_error(INVALID, "prefix"):  # an absurdly long prefix
        stub.ListAdapters(E.ListAdaptersRequest(prefix="p" * 200))
    assert registry_state(stub, registry.settings) == before


def test_delete_adapter_removes_versions_and_blobs_and_the_name_can_be_reused(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "gone")
    blob = blob_of(3000)
    publish(stub, "gone", blob, aliases=["best"])
    assert f"blobs/sha256/{sha256_hex(blob)}" in bucket_objects(registry.settings)
    stub.DeleteAdapter(E.DeleteAdapterRequest(name="gone"))
    assert bucket_objects(registry.settings) == {}
    with rpc_error(NOT_FOUND, "ref.name"):
        stub.GetVersion(E.GetVersionRequest(ref=ref("gone", 1)))
    create_adapter(stub, "gone")
    assert publish(stub, "gone", blob_of(10)).version.version == 1


# ---------------------------------------------------------------------------------------------------- publish

def test_publish_and_get_version(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "pub")
    first, second, state = blob_of(100), blob_of(2_500_000), blob_of(777, kind=STATE)
    v1 = publish(stub, "pub", first, training_step=10, metadata={"loss": "1.5"}, aliases=["stable"])
    assert not v1.deduplicated
    assert (v1.version.adapter, v1.version.version, v1.version.kind) == ("pub", 1, WEIGHTS)
    assert v1.version.sha256 == sha256_hex(first) and v1.version.size_bytes == len(first)
    assert v1.version.training_step == 10 and dict(v1.version.metadata) == {"loss": "1.5"}
    assert list(v1.version.aliases) == ["stable"] and v1.version.create_time.seconds > 0
    v2 = publish(stub, "pub", second, chunk=300_000)
    v3 = publish(stub, "pub", state, kind=STATE)
    assert (v2.version.version, v3.version.version, v3.version.kind) == (2, 3, STATE)

    # latest = newest WEIGHTS version (the training state does not count); alias; explicit version.
    assert stub.GetVersion(E.GetVersionRequest(ref=ref("pub"))).version.version == 2
    assert stub.GetVersion(E.GetVersionRequest(ref=ref("pub", alias="stable"))).version == v1.version
    assert stub.GetVersion(E.GetVersionRequest(ref=ref("pub", 3))).version == v3.version
    assert stub.GetAdapter(E.GetAdapterRequest(name="pub")).adapter.latest_version == 2
    assert set(bucket_objects(registry.settings)) == {f"blobs/sha256/{sha256_hex(b)}" for b in (first, second, state)}
    events = [(e.type, e.version, e.alias, e.kind) for e in all_events(stub, adapter="pub")]
    assert events == [(E.EVENT_TYPE_ADAPTER_CREATED, 0, "", 0), (E.EVENT_TYPE_VERSION_PUBLISHED, 1, "", WEIGHTS),
                      (E.EVENT_TYPE_ALIAS_SET, 1, "stable", WEIGHTS), (E.EVENT_TYPE_VERSION_PUBLISHED, 2, "", WEIGHTS),
                      (E.EVENT_TYPE_VERSION_PUBLISHED, 3, "", STATE)]


def test_publish_and_download_a_blob_of_several_parts(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "big")
    blob = blob_of(37 * 1024 * 1024 + 3)  # three S3 parts (16 MiB each but the last)
    version = publish(stub, "big", blob, chunk=1024 * 1024).version
    assert (version.size_bytes, version.sha256) == (len(blob), sha256_hex(blob))
    assert bucket_objects(registry.settings) == {f"blobs/sha256/{sha256_hex(blob)}": len(blob)}
    assert multipart_uploads(registry.settings) == []
    assert download(stub, "big")[1] == blob


def test_publish_same_content_twice_shares_one_blob(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "a")
    create_adapter(stub, "b")
    blob = blob_of(5000)
    publish(stub, "a", blob)
    publish(stub, "b", blob)
    assert list(bucket_objects(registry.settings)) == [f"blobs/sha256/{sha256_hex(blob)}"]
    stub.DeleteAdapter(E.DeleteAdapterRequest(name="a"))
    # Still referenced by b's version.
    assert download(stub, "b")[1] == blob
    stub.DeleteAdapter(E.DeleteAdapterRequest(name="b"))
    assert bucket_objects(registry.settings) == {}


def test_publish_with_an_idempotency_key_returns_the_first_version(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "idem")
    blob = blob_of(6_000_000)
    first = publish(stub, "idem", blob, idempotency_key="step-100")
    retry = publish(stub, "idem", blob, idempotency_key="step-100")
    assert not first.deduplicated and retry.deduplicated
    assert retry.version == first.version
    assert versions_of(stub, "idem") == [1]
    before = registry_state(stub, registry.settings)
    with rpc_error(grpc.StatusCode.ALREADY_EXISTS, "header.idempotency_key"):  # same key, other content
        publish(stub, "idem", blob_of(10), idempotency_key="step-100")
    assert registry_state(stub, registry.settings) == before
    assert publish(stub, "idem", blob, idempotency_key="step-200").version.version == 2


def rank_8_blob() -> bytes:
    import torch

    from loraplane.adapter_format import serialize_adapter
    from loraplane.lora import LoraSpec, peft_key

    spec = LoraSpec.create(8, 8.0, ["q_proj"], 0)
    params = {peft_key(0, "q_proj", "A"): torch.ones(8, 16), peft_key(0, "q_proj", "B"): torch.ones(16, 8)}
    return serialize_adapter(params, spec, TEST_BASE_MODEL)


def test_publish_bad_input_is_rejected_and_commits_nothing(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "target")
    publish(stub, "target", blob_of(10))
    before = registry_state(stub, registry.settings)
    good = blob_of(6_000_000)
    header = {"adapter": "target", "sha256": sha256_hex(good), "size_bytes": len(good)}

    def only(*messages):
        return iter(messages)

    def h(**changes):
        return E.PublishVersionRequest(header=E.PublishVersionHeader(**{**header, **changes}))

    cases = [
        # (what was tried, request stream, expected code, field named in the message)
        ("no message at all", only(), INVALID, "header"),
        ("a chunk first", only(E.PublishVersionRequest(chunk=b"abc")), INVALID, "header"),
        ("two headers", only(h(), h()), INVALID, "header"),
        ("malformed adapter name", only(h(adapter="Bad!")), INVALID, "header.adapter"),
        ("unknown adapter", only(h(adapter="nobody")), NOT_FOUND, "header.adapter"),
        ("sha256 too short", only(h(sha256="abc")), INVALID, "header.sha256"),
        ("sha256 upper case", only(h(sha256=sha256_hex(good).upper())), INVALID, "header.sha256"),
        ("size 0", only(h(size_bytes=0)), INVALID, "header.size_bytes"),
        ("size over 4 GiB", only(h(size_bytes=5 * 1024**3)), INVALID, "header.size_bytes"),
        ("unknown kind", only(h(kind=9)), INVALID, "header.kind"),
        ("malformed alias", only(h(aliases=["Best!"])), INVALID, "header.aliases"),
        ("17 aliases", only(h(aliases=[f"a{i}" for i in range(17)])), INVALID, "header.aliases"),
        ("alias on a training state", only(h(kind=STATE, aliases=["x"])), INVALID, "header.aliases"),
        ("65 metadata entries", only(h(metadata={f"k{i}": "" for i in range(65)})), INVALID, "header.metadata"),
        ("257-char idempotency key", only(h(idempotency_key="k" * 257)), INVALID, "header.idempotency_key"),
        ("a 2 MiB chunk", publish_requests("target", good, chunk=2 * 1024 * 1024), INVALID, "chunk"),
        ("more bytes than announced", publish_requests("target", good, size_bytes=len(good) - 1), INVALID, "chunk"),
        ("fewer bytes than announced (multipart)",
         publish_requests("target", good, size_bytes=len(good) + 1), INVALID, "header.size_bytes"),
        ("fewer bytes than announced (small)",
         publish_requests("target", good[:100], size_bytes=101), INVALID, "header.size_bytes"),
        ("wrong sha256 (multipart)", publish_requests("target", good, sha256="0" * 64),
         grpc.StatusCode.DATA_LOSS, "header.sha256"),
        ("wrong sha256 (small)", publish_requests("target", good[:100], sha256="0" * 64),
         grpc.StatusCode.DATA_LOSS, "header.sha256"),
        ("4 KB of garbage as WEIGHTS", publish_requests("target", os.urandom(4096)), INVALID, "chunk"),
        ("6 MB of garbage as WEIGHTS (multipart)", publish_requests("target", os.urandom(6_000_000)), INVALID,
         "chunk"),
        ("a training state as WEIGHTS", publish_requests("target", blob_of(3000, kind=STATE)), INVALID, "chunk"),
        ("an adapter as TRAINING_STATE", publish_requests("target", blob_of(3000), kind=STATE), INVALID, "chunk"),
        ("an adapter cut short, announced so", publish_requests("target", good[:-4096]), INVALID, "chunk"),
        ("an adapter with a NaN", publish_requests("target", good[:-4] + b"\x00\x00\xc0\x7f"), INVALID, "chunk"),
        ("an adapter of another rank", publish_requests("target", rank_8_blob()), INVALID, "chunk"),
        ("an adapter of another base model",
         publish_requests("target", adapter_blob(3000, base_model="other-model")), INVALID, "chunk"),
    ]
    for what, requests, code, field in cases:
        with pytest.raises(grpc.RpcError) as caught:
            stub.PublishVersion(requests, timeout=60)
        assert caught.value.code() == code, f"{what}: {caught.value.code()} {caught.value.details()}"
        assert field in caught.value.details(), f"{what}: {caught.value.details()}"
    assert registry_state(stub, registry.settings) == before
    assert multipart_uploads(registry.settings) == []


EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


def expert_blob(layout: str, *, differ: str = "") -> bytes:
    """A rank-4 expert adapter of 3 experts (PEFT file, format "1"). `layout` "shared_outer" (the shared factors
    repeated per expert, as the trainer wrote them before the compact format "2") or "per_expert"; `differ` names a shared factor ("A": gate_up lora_A, "B":
    down lora_B) in which one expert's copy is changed after the file says shared_outer."""
    import torch
    from safetensors.torch import load, save

    from loraplane.adapter_format import blob_metadata, serialize_adapter
    from loraplane.lora import PER_EXPERT, SHARED_OUTER, LoraSpec, peft_key

    rank, experts, hidden, ffn = 4, 3, 8, 6
    spec = LoraSpec.create(rank, 8.0, EXPERT_TARGETS, 0, expert_layout=layout)
    generator = torch.Generator().manual_seed(5)
    shared = layout == SHARED_OUTER
    params = {
        peft_key(0, "experts.gate_up_proj", "A"): torch.randn(rank * (1 if shared else experts), hidden,
                                                              generator=generator),
        peft_key(0, "experts.gate_up_proj", "B"): torch.randn(2 * ffn, rank * experts, generator=generator),
        peft_key(0, "experts.down_proj", "A"): torch.randn(rank * experts, ffn, generator=generator),
        peft_key(0, "experts.down_proj", "B"): torch.randn(hidden, rank * (1 if shared else experts),
                                                           generator=generator),
    }
    blob = serialize_adapter(params, spec, TEST_BASE_MODEL, compact=False)
    if not differ:
        return blob
    assert layout != PER_EXPERT
    tensors = load(blob)
    if differ == "A":
        tensors[peft_key(0, "experts.gate_up_proj", "A")][rank * 2, 3] += 1.0  # expert 2's copy, one value
    else:
        tensors[peft_key(0, "experts.down_proj", "B")][5, 1 * experts + 1] += 1.0  # expert 1's column 1
    return save(tensors, blob_metadata(blob))


def test_publish_refuses_an_expert_adapter_its_samplers_cannot_load(registry, registry_stub):
    """Issue 31 item 4: a shared-outer file whose shared factor differs between experts, and a per-expert file in a
    shared-outer adapter, are refused before anything is committed; the sampler's loader refuses the first by the
    same rule, and a well-formed shared-outer file is accepted."""
    from loraplane import errors
    from loraplane.adapter_format import parse_adapter

    stub = registry_stub
    create_adapter(stub, "moe", lora_config=common_pb2.LoraConfig(
        rank=4, alpha=8.0, target_modules=EXPERT_TARGETS, expert_layout=common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER))
    before = registry_state(stub, registry.settings)
    cases = [
        ("gate_up lora_A differs between experts", expert_blob("shared_outer", differ="A"),
         "layers.0.mlp.experts.base_layer.lora_A.weight differs between experts"),
        ("down lora_B differs between experts", expert_blob("shared_outer", differ="B"),
         "layers.0.mlp.experts.lora_B.weight differs between experts"),
        ("a per-expert file", expert_blob("per_expert"),
         "tensor base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight is laid out per_expert"),
    ]
    for what, blob, named in cases:
        for chunk in (97, 1024 * 1024):  # the differing value inside one chunk, and across many
            with pytest.raises(grpc.RpcError) as caught:
                publish(stub, "moe", blob, chunk=chunk)
            assert caught.value.code() == INVALID, f"{what}: {caught.value.code()} {caught.value.details()}"
            assert "chunk" in caught.value.details() and named in caught.value.details(), what
    with pytest.raises(errors.InvalidArgument, match="differs between experts"):
        parse_adapter(cases[0][1])
    assert registry_state(stub, registry.settings) == before
    good = expert_blob("shared_outer")
    assert publish(stub, "moe", good, chunk=97).version.version == 1
    assert parse_adapter(download(stub, "moe")[1])[1].expert_layout == "shared_outer"


# ---------------------------------------------------------------------------------------------------- versions

def test_get_version_bad_input(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "empty")
    create_adapter(stub, "full")
    publish(stub, "full", blob_of(10), aliases=["prod"])
    publish(stub, "full", blob_of(10, kind=STATE), kind=STATE)
    before = registry_state(stub, registry.settings)
    cases = [
        ("unknown adapter", ref("ghost"), NOT_FOUND, "ref.name"),
        ("malformed adapter name", ref("Ghost"), INVALID, "ref.name"),
        ("unknown version", ref("full", 9), NOT_FOUND, "ref.version"),
        ("unknown alias", ref("full", alias="canary"), NOT_FOUND, "ref.alias"),
        ("malformed alias", ref("full", alias="Canary!"), INVALID, "ref.alias"),
        ("latest of an adapter without weights", ref("empty"), NOT_FOUND, "ref"),
    ]
    for what, reference, code, field in cases:
        with rpc_error(code, field) as caught:
            stub.GetVersion(E.GetVersionRequest(ref=reference))
        assert caught.value.code() == code, what
    assert registry_state(stub, registry.settings) == before


def test_list_versions_pagination_and_kind(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "many")
    kinds = [WEIGHTS, STATE, WEIGHTS, WEIGHTS, STATE, WEIGHTS, WEIGHTS]
    for index, kind in enumerate(kinds):
        publish(stub, "many", blob_of(20 + index, kind=kind), kind=kind)
    seen, token = [], ""
    while True:
        reply = stub.ListVersions(E.ListVersionsRequest(adapter="many", page_size=3, page_token=token))
        seen += [v.version for v in reply.versions]
        token = reply.next_page_token
        if not token:
            break
    assert seen == list(range(1, 8))
    weights = stub.ListVersions(E.ListVersionsRequest(adapter="many", kind=WEIGHTS, page_size=2))
    assert [v.version for v in weights.versions] == [1, 3]
    rest = stub.ListVersions(E.ListVersionsRequest(adapter="many", kind=WEIGHTS, page_token=weights.next_page_token))
    assert [v.version for v in rest.versions] == [4, 6, 7] and not rest.next_page_token
    states = stub.ListVersions(E.ListVersionsRequest(adapter="many", kind=STATE)).versions
    assert [(v.version, v.kind) for v in states] == [(2, STATE), (5, STATE)]

    before = registry_state(stub, registry.settings)
    with rpc_error(NOT_FOUND, "adapter"):  # unknown adapter
        stub.ListVersions(E.ListVersionsRequest(adapter="ghost"))
    with rpc_error(INVALID, "adapter"):  # malformed adapter
        stub.ListVersions(E.ListVersionsRequest(adapter="G h"))
    with rpc_error(INVALID, "page_size"):  # negative page size
        stub.ListVersions(E.ListVersionsRequest(adapter="many", page_size=-5))
    with rpc_error(INVALID, "kind"):  # unknown kind
        stub.ListVersions(E.ListVersionsRequest(adapter="many", kind=42))
    with rpc_error(INVALID, "page_token"):  # token of a WEIGHTS listing reused for every kind
        stub.ListVersions(E.ListVersionsRequest(adapter="many", page_token=weights.next_page_token))
    assert registry_state(stub, registry.settings) == before


def test_delete_version(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "dv")
    blobs = [blob_of(1000 + i) for i in range(3)]
    for blob in blobs:
        publish(stub, "dv", blob)
    stub.SetAlias(E.SetAliasRequest(adapter="dv", alias="pinned", version=1))
    before = registry_state(stub, registry.settings)
    with rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "version", "pinned"):  # deleting an alias target
        stub.DeleteVersion(E.DeleteVersionRequest(adapter="dv", version=1))
    with rpc_error(NOT_FOUND, "version"):  # unknown version
        stub.DeleteVersion(E.DeleteVersionRequest(adapter="dv", version=99))
    with rpc_error(INVALID, "version"):  # version 0
        stub.DeleteVersion(E.DeleteVersionRequest(adapter="dv", version=0))
    with rpc_error(NOT_FOUND, "adapter"):  # unknown adapter
        stub.DeleteVersion(E.DeleteVersionRequest(adapter="ghost", version=1))
    with rpc_error(INVALID, "adapter"):  # malformed adapter
        stub.DeleteVersion(E.DeleteVersionRequest(adapter="", version=1))
    assert registry_state(stub, registry.settings) == before

    stub.DeleteVersion(E.DeleteVersionRequest(adapter="dv", version=3))
    assert versions_of(stub, "dv") == [1, 2]
    assert stub.GetAdapter(E.GetAdapterRequest(name="dv")).adapter.latest_version == 2
    assert f"blobs/sha256/{sha256_hex(blobs[2])}" not in bucket_objects(registry.settings)
    last = all_events(stub, adapter="dv")[-1]
    assert (last.type, last.version, last.sha256) == (E.EVENT_TYPE_VERSION_DELETED, 3, sha256_hex(blobs[2]))


def test_set_alias(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "al")
    for i in range(3):
        publish(stub, "al", blob_of(50 + i))
    publish(stub, "al", blob_of(9, kind=STATE), kind=STATE)
    adapter = stub.SetAlias(E.SetAliasRequest(adapter="al", alias="prod", version=1)).adapter
    assert dict(adapter.aliases) == {"prod": 1}
    adapter = stub.SetAlias(E.SetAliasRequest(adapter="al", alias="prod", version=2)).adapter
    assert dict(adapter.aliases) == {"prod": 2}
    assert list(stub.GetVersion(E.GetVersionRequest(ref=ref("al", 2))).version.aliases) == ["prod"]
    before = registry_state(stub, registry.settings)
    cases = [
        ("unknown version", E.SetAliasRequest(adapter="al", alias="prod", version=77), NOT_FOUND, "version"),
        ("a training-state version", E.SetAliasRequest(adapter="al", alias="prod", version=4), INVALID, "version"),
        ("malformed alias", E.SetAliasRequest(adapter="al", alias="Prod!", version=1), INVALID, "alias"),
        ("empty alias", E.SetAliasRequest(adapter="al", alias="", version=1), INVALID, "alias"),
        ("unknown adapter", E.SetAliasRequest(adapter="ghost", alias="prod", version=1), NOT_FOUND, "adapter"),
        ("malformed adapter", E.SetAliasRequest(adapter="A", alias="prod", version=1), INVALID, "adapter"),
    ]
    for what, request, code, field in cases:
        with rpc_error(code, field) as caught:
            stub.SetAlias(request)
        assert caught.value.code() == code, what
    assert registry_state(stub, registry.settings) == before
    # Version 0 removes the alias; removing an absent alias is a no-op.
    assert dict(stub.SetAlias(E.SetAliasRequest(adapter="al", alias="prod", version=0)).adapter.aliases) == {}
    stub.SetAlias(E.SetAliasRequest(adapter="al", alias="prod", version=0))
    with rpc_error(NOT_FOUND, "ref.alias"):
        stub.GetVersion(E.GetVersionRequest(ref=ref("al", alias="prod")))
    alias_events = [(e.version, e.alias) for e in all_events(stub, adapter="al") if e.type == E.EVENT_TYPE_ALIAS_SET]
    assert alias_events == [(1, "prod"), (2, "prod"), (0, "prod")]


def test_keep_last_retention_keeps_alias_targets_and_collects_blobs(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "ret", keep_last=2)
    blobs = [blob_of(400 + i) for i in range(5)]
    publish(stub, "ret", blobs[0], aliases=["golden"])
    state = publish(stub, "ret", blob_of(31, kind=STATE), kind=STATE).version.version  # training states are not counted
    for blob in blobs[1:]:
        publish(stub, "ret", blob)
    # Weights versions 1,3,4,5,6: the newest two stay, v1 stays for its alias, the training state is untouched.
    assert versions_of(stub, "ret") == [1, state, 5, 6]
    objects = bucket_objects(registry.settings)
    assert f"blobs/sha256/{sha256_hex(blobs[1])}" not in objects
    assert f"blobs/sha256/{sha256_hex(blobs[0])}" in objects
    deleted = [e.version for e in all_events(stub, adapter="ret") if e.type == E.EVENT_TYPE_VERSION_DELETED]
    assert deleted == [3, 4]
    # Removing the alias lets retention drop the old version.
    stub.SetAlias(E.SetAliasRequest(adapter="ret", alias="golden", version=0))
    assert versions_of(stub, "ret") == [state, 5, 6]
    assert f"blobs/sha256/{sha256_hex(blobs[0])}" not in bucket_objects(registry.settings)


# ---------------------------------------------------------------------------------------------------- download

def test_download_whole_resumed_and_by_alias(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "dl")
    blob = blob_of(3 * 1024 * 1024 + 12345)
    publish(stub, "dl", blob, aliases=["prod"])
    small = blob_of(10)
    publish(stub, "dl", small)

    header, data = download(stub, "dl", version=1)
    assert data == blob and header.offset == 0
    assert (header.version.size_bytes, header.version.sha256) == (len(blob), sha256_hex(blob))
    assert download(stub, "dl", alias="prod")[1] == blob
    assert download(stub, "dl")[1] == small  # latest
    cut = 1024 * 1024 + 7
    header, rest = download(stub, "dl", version=1, offset=cut, chunk_size=100_000)
    assert header.offset == cut and blob[:cut] + rest == blob
    header, rest = download(stub, "dl", version=1, offset=len(blob))
    assert header.version.version == 1 and rest == b""
    chunks = [r.chunk for r in stub.DownloadVersion(E.DownloadVersionRequest(ref=ref("dl", 1), chunk_size=4 << 20))
              if not r.HasField("header")]
    assert [len(c) for c in chunks] == [len(blob)]  # one 4 MiB-capped chunk holds the ~3 MiB blob

    before = registry_state(stub, registry.settings)
    cases = [
        ("offset past the end", E.DownloadVersionRequest(ref=ref("dl", 1), offset=len(blob) + 1), INVALID, "offset"),
        ("chunk size over 4 MiB", E.DownloadVersionRequest(ref=ref("dl", 1), chunk_size=(4 << 20) + 1), INVALID,
         "chunk_size"),
        ("unknown version", E.DownloadVersionRequest(ref=ref("dl", 5)), NOT_FOUND, "ref.version"),
        ("unknown alias", E.DownloadVersionRequest(ref=ref("dl", alias="nope")), NOT_FOUND, "ref.alias"),
        ("unknown adapter", E.DownloadVersionRequest(ref=ref("ghost")), NOT_FOUND, "ref.name"),
        ("malformed adapter", E.DownloadVersionRequest(ref=ref("GHOST")), INVALID, "ref.name"),
    ]
    for what, request, code, field in cases:
        with rpc_error(code, field) as caught:
            list(stub.DownloadVersion(request))
        assert caught.value.code() == code, what
    assert registry_state(stub, registry.settings) == before


def test_download_of_a_corrupted_blob_is_data_loss(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "rot")
    blob = blob_of(200_000)
    publish(stub, "rot", blob)
    # Real corruption: overwrite the stored object with other bytes of the same length, behind the registry's back.
    s3_client(registry.settings).put_object(registry.settings.s3_bucket, f"blobs/sha256/{sha256_hex(blob)}",
                                            io.BytesIO(b"\0" * len(blob)), len(blob))
    with rpc_error(grpc.StatusCode.DATA_LOSS, "corrupt"):
        download(stub, "rot")


def test_a_direct_download_hands_out_the_blobs_s3_address_and_only_when_allowed(registry, registry_stub,
                                                                                 isolated_settings, background_loop):
    """`direct`: the header carries a presigned URL of exactly the stored blob and no chunk follows; a registry
    with s3_direct_downloads off streams the bytes instead. A corrupted object behind the URL is the caller's to
    catch: the client turns it into DataLoss as the streamed path does (tests/contract/test_registry_client.py)."""
    stub = registry_stub
    create_adapter(stub, "direct")
    blob = blob_of(3 * 1024 * 1024 + 5)
    publish(stub, "direct", blob, aliases=["prod"])
    replies = list(stub.DownloadVersion(E.DownloadVersionRequest(ref=ref("direct", alias="prod"), direct=True)))
    assert len(replies) == 1 and replies[0].HasField("header")
    header = replies[0].header
    assert (header.version.version, header.version.sha256) == (1, sha256_hex(blob))
    assert header.direct_url.startswith(registry.settings.s3_endpoint.join(("http://", "/")))
    with urllib.request.urlopen(header.direct_url, timeout=30) as reply:
        assert reply.read() == blob
    # Signed for that one object: the same query string on another key is refused by S3.
    other = header.direct_url.replace(sha256_hex(blob), sha256_hex(blob_of(10)))
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(other, timeout=30)
    assert refused.value.code == 403
    # Bad refs are refused exactly as for a streamed download.
    with rpc_error(NOT_FOUND, "ref.version"):
        list(stub.DownloadVersion(E.DownloadVersionRequest(ref=ref("direct", 7), direct=True)))

    streaming = start_live_registry(isolated_settings.model_copy(update={"s3_direct_downloads": False}),
                                    background_loop)
    try:
        replies = list(streaming.stub().DownloadVersion(E.DownloadVersionRequest(ref=ref("direct", 1), direct=True)))
        assert replies[0].header.direct_url == ""
        assert b"".join(r.chunk for r in replies[1:]) == blob
    finally:
        streaming.close(drop_data=False)  # the test's own registry shares the data and drops it


# ---------------------------------------------------------------------------------------------------- events

def test_watch_events_replay_filters_and_cursor(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "t1/a")
    create_adapter(stub, "t2/b")
    publish(stub, "t1/a", blob_of(10), aliases=["x"])
    publish(stub, "t2/b", blob_of(11))
    everything = all_events(stub)
    assert [(e.type, e.adapter) for e in everything] == [
        (E.EVENT_TYPE_ADAPTER_CREATED, "t1/a"), (E.EVENT_TYPE_ADAPTER_CREATED, "t2/b"),
        (E.EVENT_TYPE_VERSION_PUBLISHED, "t1/a"), (E.EVENT_TYPE_ALIAS_SET, "t1/a"),
        (E.EVENT_TYPE_VERSION_PUBLISHED, "t2/b")]
    assert all(e.time.seconds > 0 and e.cursor for e in everything)
    assert [e.cursor for e in all_events(stub, after_cursor=everything[1].cursor)] == \
        [e.cursor for e in everything[2:]]
    assert [e.adapter for e in all_events(stub, adapter="t2/b")] == ["t2/b", "t2/b"]
    assert [e.type for e in all_events(stub, prefix="t1/")] == [
        E.EVENT_TYPE_ADAPTER_CREATED, E.EVENT_TYPE_VERSION_PUBLISHED, E.EVENT_TYPE_ALIAS_SET]
    published = everything[2]
    assert published.sha256 and published.version == 1 and published.kind == WEIGHTS

    before = registry_state(stub, registry.settings)
    for what, request, field in [
        ("malformed cursor", E.WatchEventsRequest(after_cursor="yesterday"), "after_cursor"),
        ("malformed adapter filter", E.WatchEventsRequest(adapter="T1/A"), "adapter"),
        ("overlong prefix", E.WatchEventsRequest(prefix="p" * 300), "prefix"),
    ]:
        with rpc_error(INVALID, field) as caught:
            next(iter(stub.WatchEvents(request, timeout=10)))
        assert caught.value.code() == INVALID, what
    assert registry_state(stub, registry.settings) == before


def test_watch_blocks_for_new_events_and_start_at_end_skips_the_backlog(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "live")
    publish(stub, "live", blob_of(5))
    call = stub.WatchEvents(E.WatchEventsRequest(start_at_end=True), timeout=30)
    replies = iter(call)
    publisher = threading.Timer(0.3, lambda: publish(stub, "live", blob_of(6)))
    publisher.start()
    started = time.monotonic()
    event = next(replies).event
    assert (event.type, event.version) == (E.EVENT_TYPE_VERSION_PUBLISHED, 2)
    assert time.monotonic() - started >= 0.25  # it waited for the new event instead of replaying the backlog
    call.cancel()
    publisher.join(30)


# ---------------------------------------------------------------------------------------------------- garbage

def test_collect_garbage_removes_only_unreferenced_blobs(registry, registry_stub):
    stub = registry_stub
    create_adapter(stub, "gc")
    kept = blob_of(1234)
    publish(stub, "gc", kept)
    # An orphan, as a registry crash between the blob upload and the metadata commit would leave it.
    orphan = blob_of(4321)
    s3_client(registry.settings).put_object(registry.settings.s3_bucket, f"blobs/sha256/{sha256_hex(orphan)}",
                                            io.BytesIO(orphan), len(orphan))
    dry = stub.CollectGarbage(E.CollectGarbageRequest(dry_run=True))
    assert list(dry.deleted_blobs) == [sha256_hex(orphan)] and dry.freed_bytes == len(orphan)
    assert len(bucket_objects(registry.settings)) == 2
    done = stub.CollectGarbage(E.CollectGarbageRequest())
    assert list(done.deleted_blobs) == [sha256_hex(orphan)] and done.freed_bytes == len(orphan)
    assert list(bucket_objects(registry.settings)) == [f"blobs/sha256/{sha256_hex(kept)}"]
    assert download(stub, "gc")[1] == kept
    assert list(stub.CollectGarbage(E.CollectGarbageRequest()).deleted_blobs) == []


def test_collect_garbage_aborts_multipart_uploads_left_by_a_crashed_registry(isolated_settings, background_loop):
    from registry_svc.store import RegistryLimits
    from tests.fixtures.registry import start_live_registry

    live = start_live_registry(isolated_settings, background_loop, limits=RegistryLimits(stale_upload_seconds=0))
    try:
        stub = live.stub()
        # What a registry killed mid-publish leaves: an open multipart upload with a part in it.
        client = s3_client(isolated_settings)
        key = f"blobs/sha256/{'ab' * 32}"
        upload_id = client._create_multipart_upload(isolated_settings.s3_bucket, key, {})
        client._upload_part(isolated_settings.s3_bucket, key, b"x" * 1000, None, upload_id, 1)
        assert multipart_uploads(isolated_settings) == [key]
        stub.CollectGarbage(E.CollectGarbageRequest(dry_run=True))
        assert multipart_uploads(isolated_settings) == [key]  # a dry run changes nothing
        stub.CollectGarbage(E.CollectGarbageRequest())
        assert multipart_uploads(isolated_settings) == []
    finally:
        live.close()
