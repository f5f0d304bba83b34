"""The client link: which client asked for which request, and replies routed back to it.

A request is known inside the coordinator by `<client identity hex>:<client's request id>`, so two
clients may use the same ids. Outputs of one step go back as one message per client. Requests that
arrive before the pipeline serves are held here (in arrival order) until it does, or until it is down.
"""

from __future__ import annotations

import msgspec

from moemesh.protocol import Codec, GenerateRequest, OutputBatch, RequestOutput


class ClientRouter:
    def __init__(self, sock):
        self.sock = sock  # the coordinator's client ROUTER
        self.owners: dict[str, tuple[bytes, str]] = {}  # internal request id -> (client, client's id)
        self.held: list[tuple[bytes, GenerateRequest]] = []

    @staticmethod
    def key(identity: bytes, request_id: str) -> str:
        return f"{identity.hex()}:{request_id}"

    def own(self, identity: bytes, request_id: str) -> str:
        key = self.key(identity, request_id)
        self.owners[key] = (identity, request_id)
        return key

    def hold(self, identity: bytes, req: GenerateRequest) -> None:
        self.held.append((identity, req))

    def release(self) -> list[tuple[bytes, GenerateRequest]]:
        held, self.held = self.held, []
        return held

    def forget_held(self, identity: bytes, request_id: str) -> None:
        self.held = [(i, r) for i, r in self.held if (i, r.request_id) != (identity, request_id)]

    async def reply(self, identity: bytes, msg) -> None:
        await self.sock.send_multipart([identity, *Codec.encode(msg)], copy=False)

    async def refuse(self, identity: bytes, req: GenerateRequest, error: str, status: int) -> None:
        await self.reply(identity, RequestOutput(req.request_id, [], finish_reason="error", error=error,
                                                 error_status=status, num_prompt_tokens=len(req.prompt_ids)))

    async def deliver(self, outputs: list[RequestOutput]) -> None:
        """One message per client with all of its outputs (a step's worth), not one per request."""
        by_client: dict[bytes, list[RequestOutput]] = {}
        for out in outputs:
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue
            identity, client_id = owner
            if out.finish_reason is not None:
                del self.owners[out.request_id]
            by_client.setdefault(identity, []).append(msgspec.structs.replace(out, request_id=client_id))
        for identity, outs in by_client.items():
            await self.reply(identity, outs[0] if len(outs) == 1 else OutputBatch(outs))
