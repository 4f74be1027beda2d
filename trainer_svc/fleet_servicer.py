"""The trainer's servicer with the fleet's lookup (ResolveAdapter): protobuf <-> domain conversion only."""

from __future__ import annotations

from loraplane.auth import current_caller
from loraplane.rpc import map_servicer_errors
from loraplane.v1 import trainer_pb2
from trainer_svc.servicer import TrainerServicer
from trainer_svc.validation import validate_adapter_name


@map_servicer_errors
class FleetTrainerServicer(TrainerServicer):
    def __init__(self, service, *, trainer_id: str, address: str = ""):
        super().__init__(service)
        self.trainer_id = trainer_id
        # The address clients reach this trainer at (set once the server listens).
        self.address = address

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
