"""The client side of `SamplerService.PushVersion`: a trainer handing the bytes of a version it is publishing straight
to a sampler (trainer_svc/handoff.py decides which samplers and how; docs/architecture.md, "Which path a version
took"). Here, in the shared library, because the trainer's domain code never touches the wire."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from loraplane import errors
from loraplane.rpc import ClientSecurity, aio_channel, domain_error_from_rpc
from loraplane.v1 import sampler_pb2, sampler_pb2_grpc


class SamplerPushClient:
    def __init__(self, address: str, security: ClientSecurity | None = None, *, timeout: float = 60.0):
        self.address = address
        self.timeout = timeout
        self.channel = aio_channel(address, security)
        self.stub = sampler_pb2_grpc.SamplerServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def push(self, adapter: str, sha256: str, size: int, *, shared_memory_name: str = "",
                   pieces: AsyncIterator[bytes] | None = None) -> bool:
        """Pushes the blob: through the segment `shared_memory_name` of the sampler's host, or as `pieces`. True when
        the sampler staged it, False when it held those bytes already. Errors are domain errors (a sampler that
        cannot open the segment answers FailedPrecondition)."""
        header = sampler_pb2.PushVersionHeader(adapter=adapter, sha256=sha256, size_bytes=size,
                                               shared_memory_name=shared_memory_name)
        failed: list[BaseException] = []

        async def requests():
            yield sampler_pb2.PushVersionRequest(header=header)
            if pieces is None:
                return
            try:
                async for piece in pieces:
                    yield sampler_pb2.PushVersionRequest(chunk=piece)
            except Exception as exc:  # noqa: BLE001 - raised below; the sampler stages nothing from a short stream
                failed.append(exc)

        try:
            reply = await self.stub.PushVersion(requests(), timeout=self.timeout + size / 20e6)
        except grpc.RpcError as exc:
            if failed:
                raise failed[0] from None
            # Named by role, not address (the trainer may pass the message on to a tenant).
            raise domain_error_from_rpc(exc, "sampler: push") from None
        if failed:
            raise errors.Aborted(f"sampler: push of {adapter!r} stopped: {failed[0]}")
        return reply.staged
