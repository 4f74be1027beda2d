"""Every RPC of the loraplane.v1 registry, trainer and sampler services, tried by tenant B (globex) against tenant
A's (acme's) adapters, versions, aliases, training states and loaded versions, with A's real names and with
never-created names of the same shape (both inside A's namespace).

The RPC list is read from the proto descriptors: an RPC added to a service without a case here fails
`test_every_rpc_has_a_case`. Calls are made generically from the descriptor (raw bytes back), so every byte of an
answer, the error details and trailing metadata included, is checked for A's names, sha256s, metadata values and
the cluster's addresses."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from loraplane.v1 import common_pb2, registry_pb2, sampler_pb2, trainer_pb2
from tests.fixtures.sampler import adapter_blob
from tests.security.conftest import ADAM, LORA, A, B, Secured, datum
from tests.security.isolation import leaked, missing_like, normalize

SERVICES = {"registry": registry_pb2, "trainer": trainer_pb2, "sampler": sampler_pb2}
OK, DENIED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
PARAMS = common_pb2.SamplingParams(max_tokens=2, seed=1)


@dataclass
class Case:
    """`make(ids, c)` builds the request (an iterator of requests for client streaming) from A's or missing ids.
    kind: scoped (B gets `code` for both, indistinguishably; then `owner(c)` or, by default, the same call with A's
    ids must succeed with A's key), own (touches nothing of A's: leak check only), admin (refused to every tenant,
    A included, the same way; the admin key succeeds)."""

    make: Callable[[dict, Secured], object]
    kind: str = "scoped"
    code: grpc.StatusCode = DENIED
    owner: Callable[[Secured], None] | None = None


def ref(name: str, version: int = 0) -> common_pb2.AdapterRef:
    return common_pb2.AdapterRef(name=name, version=version) if version else common_pb2.AdapterRef(name=name)


def blob_stream(adapter: str, seed: int, aliases=()) -> Iterator[registry_pb2.PublishVersionRequest]:
    blob = adapter_blob(seed)
    yield registry_pb2.PublishVersionRequest(header=registry_pb2.PublishVersionHeader(
        adapter=adapter, sha256=hashlib.sha256(blob).hexdigest(), size_bytes=len(blob), aliases=list(aliases)))
    yield registry_pb2.PublishVersionRequest(chunk=blob)


def push_stream(adapter: str, seed: int) -> Iterator[sampler_pb2.PushVersionRequest]:
    blob = adapter_blob(seed)
    yield sampler_pb2.PushVersionRequest(header=sampler_pb2.PushVersionHeader(
        adapter=adapter, sha256=hashlib.sha256(blob).hexdigest(), size_bytes=len(blob)))
    yield sampler_pb2.PushVersionRequest(chunk=blob)


def fresh(prefix: str = "acme/fresh") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def owner_delete_registry_adapter(c: Secured) -> None:
    name = fresh()
    c.registry_stub(A).CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name=name, lora_config=LORA, base_model="tiny")))
    c.registry_stub(A).DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name))


def owner_delete_version(c: Secured) -> None:
    name = fresh()
    stub = c.registry_stub(A)
    stub.CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
        name=name, lora_config=LORA, base_model="tiny")))
    version = stub.PublishVersion(blob_stream(name, 9)).version.version
    stub.DeleteVersion(registry_pb2.DeleteVersionRequest(adapter=name, version=version))


def owner_delete_trainer_adapter(c: Secured) -> None:
    name = fresh()
    stub = c.trainer_stub(A)
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=LORA, base_model="tiny"))
    stub.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name=name, delete_from_registry=True))


def owner_unload(c: Secured) -> None:
    stub = c.sampler_stub(A)
    stub.LoadAdapter(sampler_pb2.LoadAdapterRequest(adapter=ref(c.a["reg"], 1), pin=True))
    stub.UnloadAdapter(sampler_pb2.UnloadAdapterRequest(adapter=c.a["reg"], version=1))


def owner_watch(c: Secured) -> None:
    code, _details, payload = invoke(c, A, "registry", "WatchEvents",
                                     registry_pb2.WatchEventsRequest(adapter=c.a["reg"], after_cursor="0-0"))
    assert code == OK and c.a["reg"].encode() in payload


def owner_load_state(c: Secured) -> None:
    c.trainer_stub(A).LoadState(trainer_pb2.LoadStateRequest(
        adapter=c.a["train"], seq_id=seq(c), source=ref(c.a["train"], int(c.a["saved"]))))


def seq(c: Secured) -> int:
    return c.next_trainer_seq()


R = "/loraplane.v1.AdapterRegistryService/"
T = "/loraplane.v1.TrainerService/"
S = "/loraplane.v1.SamplerService/"
CASES: dict[str, list[Case]] = {
    R + "CreateAdapter": [Case(
        lambda x, c: registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
            name=x["reg"], lora_config=LORA, base_model="tiny")),
        owner=lambda c: c.registry_stub(A).CreateAdapter(registry_pb2.CreateAdapterRequest(
            adapter=registry_pb2.Adapter(name=fresh(), lora_config=LORA, base_model="tiny"))))],
    R + "GetAdapter": [Case(lambda x, c: registry_pb2.GetAdapterRequest(name=x["reg"]))],
    # Another tenant's prefix is an empty listing (the same for a name that exists and one that does not).
    R + "ListAdapters": [Case(lambda x, c: registry_pb2.ListAdaptersRequest(prefix=x["reg"]), code=OK),
                         Case(lambda x, c: registry_pb2.ListAdaptersRequest(prefix=""), "own")],
    R + "DeleteAdapter": [Case(lambda x, c: registry_pb2.DeleteAdapterRequest(name=x["reg"]),
                               owner=owner_delete_registry_adapter)],
    R + "PublishVersion": [Case(lambda x, c: blob_stream(x["reg"], 6, [x["alias"]]),
                                owner=lambda c: c.registry_stub(A).PublishVersion(blob_stream(c.a["reg"], 7)))],
    R + "GetVersion": [Case(lambda x, c: registry_pb2.GetVersionRequest(ref=ref(x["reg"], 1))),
                       Case(lambda x, c: registry_pb2.GetVersionRequest(
                           ref=common_pb2.AdapterRef(name=x["reg"], alias=x["alias"])))],
    R + "ListVersions": [Case(lambda x, c: registry_pb2.ListVersionsRequest(adapter=x["reg"]))],
    R + "DeleteVersion": [Case(lambda x, c: registry_pb2.DeleteVersionRequest(adapter=x["reg"], version=1),
                               owner=owner_delete_version)],
    R + "SetAlias": [Case(lambda x, c: registry_pb2.SetAliasRequest(adapter=x["reg"], alias=x["alias"], version=1))],
    R + "DownloadVersion": [Case(lambda x, c: registry_pb2.DownloadVersionRequest(ref=ref(x["reg"], 1))),
                            Case(lambda x, c: registry_pb2.DownloadVersionRequest(ref=ref(x["reg"], 1), direct=True))],
    R + "WatchEvents": [Case(lambda x, c: registry_pb2.WatchEventsRequest(adapter=x["reg"]), owner=owner_watch),
                        Case(lambda x, c: registry_pb2.WatchEventsRequest(after_cursor="0-0"), "own"),
                        Case(lambda x, c: registry_pb2.WatchEventsRequest(after_cursor="0-0", prefix="acme/"),
                             "own")],
    R + "CollectGarbage": [Case(lambda x, c: registry_pb2.CollectGarbageRequest(dry_run=True), "admin")],
    T + "CreateAdapter": [Case(
        lambda x, c: trainer_pb2.TrainerServiceCreateAdapterRequest(name=x["train"], lora_config=LORA,
                                                                    base_model="tiny"),
        owner=lambda c: c.trainer_stub(A).CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=fresh(), lora_config=LORA, base_model="tiny")))],
    T + "ForwardBackward": [Case(
        lambda x, c: trainer_pb2.ForwardBackwardRequest(adapter=x["train"], seq_id=1, data=[datum(2)],
                                                        loss_fn="cross_entropy"),
        owner=lambda c: c.trainer_stub(A).ForwardBackward(trainer_pb2.ForwardBackwardRequest(
            adapter=c.a["train"], seq_id=seq(c), data=[datum(2)], loss_fn="cross_entropy")))],
    T + "Forward": [Case(
        lambda x, c: trainer_pb2.ForwardRequest(adapter=x["train"], seq_id=1, data=[datum(3)],
                                                loss_fn="cross_entropy"),
        owner=lambda c: c.trainer_stub(A).Forward(trainer_pb2.ForwardRequest(
            adapter=c.a["train"], seq_id=seq(c), data=[datum(3)], loss_fn="cross_entropy")))],
    T + "OptimStep": [Case(
        lambda x, c: trainer_pb2.OptimStepRequest(adapter=x["train"], seq_id=1, adam_params=ADAM),
        owner=lambda c: c.trainer_stub(A).OptimStep(trainer_pb2.OptimStepRequest(
            adapter=c.a["train"], seq_id=seq(c), adam_params=ADAM)))],
    T + "PublishWeights": [Case(
        lambda x, c: trainer_pb2.PublishWeightsRequest(adapter=x["train"], seq_id=1),
        owner=lambda c: c.trainer_stub(A).PublishWeights(trainer_pb2.PublishWeightsRequest(
            adapter=c.a["train"], seq_id=seq(c))))],
    T + "SaveState": [Case(
        lambda x, c: trainer_pb2.SaveStateRequest(adapter=x["train"], seq_id=1),
        owner=lambda c: c.trainer_stub(A).SaveState(trainer_pb2.SaveStateRequest(
            adapter=c.a["train"], seq_id=seq(c))))],
    T + "LoadState": [
        # Into A's adapter, and from A's training state into B's own adapter.
        Case(lambda x, c: trainer_pb2.LoadStateRequest(adapter=x["train"], seq_id=1,
                                                       source=ref(x["b_train"], 1)), owner=owner_load_state),
        Case(lambda x, c: trainer_pb2.LoadStateRequest(adapter=x["b_train"], seq_id=1,
                                                       source=ref(x["train"], int(c.a["saved"]))),
             owner=owner_load_state),
    ],
    T + "DeleteAdapter": [Case(lambda x, c: trainer_pb2.TrainerServiceDeleteAdapterRequest(
        name=x["train"], delete_from_registry=True), owner=owner_delete_trainer_adapter)],
    T + "ListAdapters": [Case(lambda x, c: trainer_pb2.TrainerServiceListAdaptersRequest(), "own")],
    T + "GetInfo": [Case(lambda x, c: trainer_pb2.GetInfoRequest(include_tokenizer=False), "own")],
    S + "Sample": [Case(lambda x, c: sampler_pb2.SampleRequest(adapter=ref(x["reg"]), prompt_tokens=[5, 6],
                                                               num_samples=1, sampling_params=PARAMS)),
                   Case(lambda x, c: sampler_pb2.SampleRequest(
                       adapter=common_pb2.AdapterRef(name=x["reg"], alias=x["alias"]), prompt_tokens=[5, 6],
                       num_samples=1, sampling_params=PARAMS))],
    S + "SampleStream": [Case(lambda x, c: sampler_pb2.SampleStreamRequest(
        adapter=ref(x["reg"]), prompt_tokens=[5, 6], num_samples=1, sampling_params=PARAMS))],
    S + "ComputeLogprobs": [Case(lambda x, c: sampler_pb2.ComputeLogprobsRequest(adapter=ref(x["reg"]),
                                                                                 tokens=[5, 6, 7]))],
    S + "ListLoadedAdapters": [Case(lambda x, c: sampler_pb2.ListLoadedAdaptersRequest(adapter=x["reg"])),
                               Case(lambda x, c: sampler_pb2.ListLoadedAdaptersRequest(), "own")],
    S + "LoadAdapter": [Case(lambda x, c: sampler_pb2.LoadAdapterRequest(adapter=ref(x["reg"], 1), pin=True))],
    S + "UnloadAdapter": [Case(lambda x, c: sampler_pb2.UnloadAdapterRequest(adapter=x["reg"], version=1),
                               owner=owner_unload)],
    S + "GetStatus": [Case(lambda x, c: sampler_pb2.GetStatusRequest(), "own")],
    # Replica addresses and loads are the operator's: a tenant gets an empty list (test_list_replicas_... below).
    S + "ListReplicas": [Case(lambda x, c: sampler_pb2.ListReplicasRequest(), "own")],
    # The trainer's handoff to the samplers: between a deployment's services, refused to every tenant alike.
    S + "PushVersion": [Case(lambda x, c: push_stream(x["reg"], 5), "admin")],
}

if hasattr(trainer_pb2, "ResolveAdapterRequest"):  # the trainer fleet's lookup, as its proto lands
    # Where A's adapter lives is A's business: B learns neither the placement nor whether the adapter exists.
    CASES[T + "ResolveAdapter"] = [Case(lambda x, c: trainer_pb2.ResolveAdapterRequest(name=x["train"]))]


def rpc_table() -> dict[str, tuple[str, object]]:
    """Every RPC of the three services, from the protos: full method path -> (service, method descriptor)."""
    out = {}
    for service, module in SERVICES.items():
        for descriptor in module.DESCRIPTOR.services_by_name.values():
            for method in descriptor.methods:
                out[f"/{descriptor.full_name}/{method.name}"] = (service, method)
    return out


def test_every_rpc_has_a_case():
    """An RPC added to a service's proto without an isolation case (or a case for an RPC that is gone) fails."""
    rpcs = set(rpc_table())
    assert len(rpcs) >= 25, sorted(rpcs)
    assert rpcs - set(CASES) == set(), f"RPCs without an isolation case: {sorted(rpcs - set(CASES))}"
    assert set(CASES) - rpcs == set(), f"cases for RPCs that do not exist: {sorted(set(CASES) - rpcs)}"


def invoke(c: Secured, label: str, service: str, name: str, request, *, stream_s: float = 1.5
           ) -> tuple[grpc.StatusCode, str, bytes]:
    """Calls `name` generically from its descriptor: (status, details, every byte the caller got back: the
    response messages, the error details and the trailing metadata)."""
    path = next(p for p, (s, m) in rpc_table().items() if s == service and m.name == name)
    method = rpc_table()[path][1]
    channel = c.channel(service, label)
    serialize = lambda m: m.SerializeToString()
    payload = b""
    try:
        if method.client_streaming:
            payload = channel.stream_unary(path, request_serializer=serialize)(request, timeout=30)
        elif method.server_streaming:
            call = channel.unary_stream(path, request_serializer=serialize)(request, timeout=stream_s)
            try:
                for message in call:
                    payload += message
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or not payload and name != "WatchEvents":
                    raise
        else:
            payload = channel.unary_unary(path, request_serializer=serialize)(request, timeout=30)
        return OK, "", payload
    except grpc.RpcError as exc:
        trailers = b"".join(v if isinstance(v, bytes) else v.encode() for _k, v in exc.trailing_metadata() or ())
        return exc.code(), exc.details() or "", (exc.details() or "").encode() + trailers


@pytest.fixture(scope="module")
def b_train(secured: Secured) -> str:
    """B's own trainer adapter (B may name its own things; only A's must be out of reach)."""
    name = fresh("globex/own")
    stub = secured.trainer_stub(B)
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(name=name, lora_config=LORA, base_model="tiny"))
    return name


def _sent(request) -> bytes:
    if isinstance(request, list):
        return b"".join(r.SerializeToString() for r in request)
    return request.SerializeToString()


@pytest.mark.parametrize("path", sorted(CASES))
def test_tenant_b_cannot_reach_tenant_a_over_grpc(secured: Secured, b_train, path):
    c = secured
    service, method = rpc_table()[path]
    for case in CASES[path]:
        a_ids = {**c.a, "b_train": b_train}
        gone = {**missing_like(c.a), "b_train": b_train}
        before = c.snapshot()
        answers = []
        for ids in (a_ids, gone):
            request = case.make(ids, c)
            if method.client_streaming:
                request = list(request)
            code, details, payload = invoke(c, B, service, method.name,
                                            iter(request) if method.client_streaming else request)
            found = leaked(payload, _sent(request), c.secrets, c.addresses)
            assert not found, (path, found, details)
            answers.append((code, normalize(details + payload.decode("latin-1"), ids)))
        assert c.snapshot() == before, f"{path}: B's call changed A's state"
        if case.kind == "own":
            assert answers[0][0] in (OK, DENIED), answers[0]
            continue
        (code, text), (gone_code, gone_text) = answers
        assert code == case.code, (path, code, text)
        assert (code, text) == (gone_code, gone_text), (path, text, gone_text)
        if case.kind == "admin":
            own = invoke(c, A, service, method.name, case.make(a_ids, c))
            assert own[0] == case.code, own
            assert invoke(c, "admin", service, method.name, case.make(a_ids, c))[0] == OK
        elif case.owner is not None:
            case.owner(c)  # raises unless A's own call succeeds
        else:
            request = case.make(a_ids, c)
            code, details, _ = invoke(c, A, service, method.name,
                                      iter(list(request)) if method.client_streaming else request)
            assert code == OK, ("the owner's own call fails", path, code, details)


def test_list_replicas_shows_the_fleet_to_the_operator_and_nothing_to_a_tenant(secured: Secured):
    """The sampler fleet's replica list: addresses and loads for admin (and service) keys, an empty answer to every
    tenant, the replicas' own tenant included. The admin's answer carries the address, so the check can fail."""
    code, _details, payload = invoke(secured, "admin", "sampler", "ListReplicas", sampler_pb2.ListReplicasRequest())
    assert code == OK and secured.sampler.address.encode() in payload
    for label in (A, B):
        code, _details, payload = invoke(secured, label, "sampler", "ListReplicas", sampler_pb2.ListReplicasRequest())
        assert code == OK
        assert sampler_pb2.ListReplicasResponse.FromString(payload) == sampler_pb2.ListReplicasResponse()
