"""TrainerService servicer: protobuf <-> domain conversion only."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import grpc

from loraplane import metrics
from loraplane.auth import current_caller
from loraplane.registry_client import expert_layout_name, expert_layout_value, weights_dtype_name, weights_dtype_value
from loraplane.rpc import ClientSecurity, aio_channel, map_servicer_errors
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from trainer_svc.backends.base import ItemResult
from trainer_svc.optimizer import ADAM_FIELDS, AdamHyper
from trainer_svc.service import AdapterInfo, LoraConfig, SourceRef, TrainerService
from trainer_svc.validation import DatumPayload, validate_adapter_name

log = logging.getLogger(__name__)
# How long a fleet member waits for another's part of a listing before describing those adapters from the journal.
_PEER_LIST_TIMEOUT_S = 10.0


def payload_hash(request) -> bytes:
    """Identity of a sequenced request for retry dedup: the deterministic serialization of the whole request."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).digest()


def lora_config(message: common_pb2.LoraConfig) -> LoraConfig:
    return LoraConfig(rank=message.rank, alpha=message.alpha, target_modules=tuple(message.target_modules),
                      seed=message.seed, weights_dtype=weights_dtype_name(message.weights_dtype),
                      expert_layout=expert_layout_name(message.expert_layout))


def source_ref(message: common_pb2.AdapterRef) -> SourceRef:
    # The oneof's presence carries meaning: an alias that was set (even to "") is validated, not ignored.
    which = message.WhichOneof("selector")
    return SourceRef(name=message.name, version=message.version if which == "version" else 0,
                     alias=message.alias if which == "alias" else None)


def datum_payloads(data) -> list[DatumPayload]:
    return [DatumPayload(d.input_tokens, d.target_tokens, d.weights, d.logprobs, d.advantages, d.sequence_ratio_mask,
                         d.targets_per_position)
            for d in data]


def adapter_message(info: AdapterInfo) -> trainer_pb2.TrainerAdapter:
    return trainer_pb2.TrainerAdapter(
        name=info.name,
        lora_config=common_pb2.LoraConfig(rank=info.spec.rank, alpha=info.spec.effective_alpha,
                                          target_modules=list(info.spec.target_modules), seed=info.spec.seed,
                                          weights_dtype=weights_dtype_value(info.weights_dtype),
                                          expert_layout=expert_layout_value(
                                              info.spec.expert_layout if info.spec.has_experts else "")),
        base_model=info.base_model, step=info.step, last_seq_id=info.last_seq_id, resident=info.resident,
        parameter_count=info.parameter_count)


def _outputs(result: ItemResult) -> list[trainer_pb2.DatumOutput]:
    return [trainer_pb2.DatumOutput(logprobs=o.logprobs, elementwise_loss=o.elementwise_loss,
                                    targets_per_position=o.targets_per_position)
            for o in result.outputs]


def _count_tokens(request, kind: str) -> None:
    tokens = sum(len(d.input_tokens) for d in request.data)
    metrics.TRAINING_TOKENS.labels(metrics.tenant_of(request.adapter), kind).inc(tokens)


@map_servicer_errors
class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, service: TrainerService, *, trainer_id: str = "trainer", address: str = "",
                 peer_security: ClientSecurity | None = None):
        """`peer_security`: how this trainer calls the other members of its fleet (its service key, acting for the
        caller it serves, and TLS), for the fleet-wide ListAdapters."""
        self.service = service
        self.trainer_id = trainer_id
        # The address clients reach this trainer at (set once the server listens).
        self.address = address
        self.peer_security = peer_security or ClientSecurity()
        self._peers: dict[str, grpc.aio.Channel] = {}

    async def _close(self) -> None:
        """Closes the channels to the other members (private: every public coroutine here is an RPC)."""
        for channel in self._peers.values():
            await channel.close()
        self._peers.clear()

    def _peer(self, address: str) -> trainer_pb2_grpc.TrainerServiceStub:
        if address not in self._peers:
            self._peers[address] = aio_channel(address, self.peer_security)
        return trainer_pb2_grpc.TrainerServiceStub(self._peers[address])

    async def _peer_rows(self, address: str, names: list[str], page_token: str, page_size: int,
                         timeout: float) -> dict[str, trainer_pb2.TrainerAdapter]:
        """The rows of `names` from the member serving them (its own adapters only). The peer authorizes the call
        as the caller's tenant (the service key's acting-for), so it can only ever add what the caller may see.
        Asked for the whole page's range, its answer holds every name of it that it serves; one it no longer serves,
        or an unreachable peer, leaves those names out (the journal describes them then)."""
        request = trainer_pb2.TrainerServiceListAdaptersRequest(page_size=page_size, page_token=page_token,
                                                                this_trainer_only=True)
        try:
            reply = await self._peer(address).ListAdapters(request, timeout=timeout)
        except grpc.RpcError as exc:
            log.info("fleet listing: member %s did not answer (%s); its adapters come from the journal", address,
                     exc.code())
            return {}
        wanted = set(names)
        return {a.name: a for a in reply.adapters if a.name in wanted}

    async def CreateAdapter(self, request, context):
        info = await self.service.create_adapter(request.name, lora_config(request.lora_config), request.base_model,
                                                 request.keep_last, dict(request.metadata), caller=current_caller())
        return trainer_pb2.TrainerServiceCreateAdapterResponse(adapter=adapter_message(info))

    async def ForwardBackward(self, request, context):
        result = await self.service.forward_backward(request.adapter, request.seq_id, datum_payloads(request.data),
                                                     request.loss_fn, dict(request.loss_fn_config), payload_hash(request),
                                                     caller=current_caller())
        _count_tokens(request, "forward_backward")
        return trainer_pb2.ForwardBackwardResponse(outputs=_outputs(result), metrics=result.metrics)

    async def Forward(self, request, context):
        result = await self.service.forward_backward(request.adapter, request.seq_id, datum_payloads(request.data),
                                                     request.loss_fn, dict(request.loss_fn_config), payload_hash(request),
                                                     backward=False, caller=current_caller())
        _count_tokens(request, "forward")
        return trainer_pb2.ForwardResponse(outputs=_outputs(result), metrics=result.metrics)

    async def OptimStep(self, request, context):
        p = request.adam_params
        given = {name: getattr(p, name) for name in ADAM_FIELDS if p.HasField(name)}
        hyper = AdamHyper(**{"learning_rate": None, **given})
        outcome = await self.service.optim_step(request.adapter, request.seq_id, hyper, payload_hash(request),
                                                caller=current_caller())
        if not outcome.skipped:
            metrics.TRAINING_STEPS.labels(metrics.tenant_of(request.adapter)).inc()
        return trainer_pb2.OptimStepResponse(
            step=outcome.step, grad_norm=outcome.grad_norm, skipped=outcome.skipped,
            metrics={"grad_norm:mean": outcome.grad_norm, "skipped:sum": float(outcome.skipped)})

    async def PublishWeights(self, request, context):
        version = await self.service.publish_weights(request.adapter, request.seq_id, list(request.aliases),
                                                     dict(request.metadata), payload_hash(request),
                                                     caller=current_caller())
        return trainer_pb2.PublishWeightsResponse(version=version)

    async def SaveState(self, request, context):
        version = await self.service.save_state(request.adapter, request.seq_id, dict(request.metadata),
                                                payload_hash(request), caller=current_caller())
        return trainer_pb2.SaveStateResponse(version=version)

    async def LoadState(self, request, context):
        info = await self.service.load_state(request.adapter, request.seq_id, source_ref(request.source),
                                             request.with_optimizer, payload_hash(request), caller=current_caller())
        return trainer_pb2.LoadStateResponse(adapter=adapter_message(info))

    async def DeleteAdapter(self, request, context):
        await self.service.delete_adapter(request.name, request.delete_from_registry, caller=current_caller())
        return trainer_pb2.TrainerServiceDeleteAdapterResponse()

    async def ListAdapters(self, request, context):
        caller = current_caller()
        fleet = self.service.fleet
        if fleet is None or request.this_trainer_only:
            infos, token = await self.service.list_adapters(request.page_size, request.page_token, caller=caller)
            return trainer_pb2.TrainerServiceListAdaptersResponse(adapters=[adapter_message(i) for i in infos],
                                                                  next_page_token=token)
        # A fleet member lists the whole fleet: its own adapters, each other live member's (asked in parallel, for
        # exactly this page), and from the journal those no live member serves right now.
        page = await fleet.listing(request.page_size, request.page_token, caller)
        remaining = context.time_remaining() if context is not None else None
        timeout = min(_PEER_LIST_TIMEOUT_S, remaining) if remaining else _PEER_LIST_TIMEOUT_S
        rows = {name: adapter_message(info) for name, info in fleet.local_infos(page.here).items()}
        for answer in await asyncio.gather(*(self._peer_rows(address, names, request.page_token, len(page.names),
                                                             timeout)
                                             for address, names in page.elsewhere.items())):
            rows.update(answer)
        missing = [name for name in page.names if name not in rows]
        rows.update({name: adapter_message(info) for name, info in (await fleet.journal_infos(missing)).items()})
        return trainer_pb2.TrainerServiceListAdaptersResponse(
            adapters=[rows[name] for name in page.names if name in rows], next_page_token=page.next_token)

    async def GetInfo(self, request, context):
        info = self.service.info()
        d = info["description"]
        tokenizer = trainer_pb2.TokenizerInfo(
            name=d.tokenizer_name, vocab_size=d.vocab_size, eos_token_ids=d.eos_token_ids,
            bos_token_id=d.bos_token_id, pad_token_id=d.pad_token_id, chat_template=d.chat_template)
        if request.include_tokenizer:
            tokenizer.tokenizer_json = self.service.tokenizer_json()
        return trainer_pb2.GetInfoResponse(
            base_model=d.name, backend=info["backend"], device=info["device"], tokenizer=tokenizer,
            max_context_length=info["max_context_length"], max_lora_rank=info["max_lora_rank"],
            supported_target_modules=list(d.module_dims), supported_losses=info["supported_losses"],
            device_slots=info["device_slots"], max_batch_datums=info["max_batch_datums"],
            num_hidden_layers=d.num_layers, hidden_size=d.hidden_size)

    async def ResolveAdapter(self, request, context):
        validate_adapter_name(request.name)
        caller = current_caller()
        caller.authorize(request.name)
        fleet = self.service.fleet
        if fleet is None:  # a lone trainer serves every adapter it has: "" = the address you asked
            return trainer_pb2.ResolveAdapterResponse(trainer_id=self.trainer_id)
        address, trainer_id, epoch, live = await fleet.resolve(request.name)
        if caller.scope is not None:  # the fleet's member list is the operator's (as ListReplicas is)
            live = []
        return trainer_pb2.ResolveAdapterResponse(address=address, trainer_id=trainer_id, epoch=epoch,
                                                  trainer_addresses=live)
