"""An asyncio client of the coordinator's client socket: what the gateway and the local
`generate` driver use to submit requests and stream their outputs."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from moemesh.log import get_logger
from moemesh.mesh_security import MeshKeys
from moemesh.netutil import BadMessages, receive, set_heartbeats
from moemesh.protocol import (AbortRequest, Codec, CoordinatorReply, GenerateRequest, OutputBatch,
                              ProtocolError, RequestOutput, StatusReply, StatusRequest)
from moemesh.sampling import SamplingParams

log = get_logger("client")


class PipelineFailed(RuntimeError):
    """The coordinator's pipeline went down before it served (the reason is the message)."""


class CoordinatorClient:
    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None, mesh_keys: str | None = None):
        """`mesh_keys`: the mesh's key directory (its client key and the server's public key): CURVE."""
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        # unguessable: the coordinator routes a client's outputs by its identity, and another holder of a
        # client key that took this one's identity while it reconnects would read (and could abort) its requests
        self.sock.setsockopt(zmq.IDENTITY, f"c{os.getpid()}-{secrets.token_hex(8)}".encode())
        set_heartbeats(self.sock)
        if mesh_keys:
            MeshKeys(mesh_keys).connect(self.sock, "client")
        self.sock.connect(address)
        self.codec = Codec(CoordinatorReply)
        self.bad = BadMessages(log, "coordinator")
        self.streams: dict[str, asyncio.Queue] = {}
        self.status_waiters: list[asyncio.Future] = []
        self._ids = itertools.count()
        self._reader = asyncio.ensure_future(self._read())

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close(linger=0)

    async def _read(self) -> None:
        while True:
            frames = await receive(self.sock)
            try:
                msg, _ = self.codec.decode(frames)
            except ProtocolError as e:
                self.bad(e)
                continue
            if isinstance(msg, StatusReply):
                # the oldest query still waiting (one that timed out has been cancelled: skip it)
                while self.status_waiters and self.status_waiters[0].done():
                    self.status_waiters.pop(0)
                if self.status_waiters:
                    self.status_waiters.pop(0).set_result(msg)
                continue
            for out in msg.outputs if isinstance(msg, OutputBatch) else (msg,):
                if (q := self.streams.get(out.request_id)) is not None:
                    q.put_nowait(out)

    async def status(self, timeout: float = 5.0) -> StatusReply:
        """Raises asyncio.TimeoutError when the coordinator does not answer in time (or cannot be
        reached at all: with no connection, the request is not even queued)."""
        fut = asyncio.get_running_loop().create_future()
        self.status_waiters.append(fut)
        try:
            await self.sock.send_multipart(Codec.encode(StatusRequest()), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.status_waiters.remove(fut)
            await asyncio.sleep(min(timeout, 0.5))
            raise asyncio.TimeoutError from None
        return await asyncio.wait_for(fut, timeout)

    async def wait_serving(self, timeout: float) -> StatusReply:
        """Polls the coordinator until its pipeline serves; raises TimeoutError otherwise."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                st = await self.status(timeout=1.0)
                if st.serving:
                    return st
                if st.failure:
                    raise PipelineFailed(f"the pipeline failed to start: {st.failure}")
            except asyncio.TimeoutError:
                self.status_waiters.clear()
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the pipeline was not serving after {timeout:.0f} s")
            await asyncio.sleep(0.1)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs until the one with a finish_reason. Leaving the loop early
        (or being cancelled) aborts the request in the coordinator."""
        rid = request_id or f"r{next(self._ids)}"
        if rid in self.streams:
            raise ValueError(f"request id {rid!r} is already streaming")
        q = self.streams[rid] = asyncio.Queue()
        finished = False
        try:
            try:
                await self.sock.send_multipart(Codec.encode(GenerateRequest(rid, list(prompt_ids), params)),
                                               flags=zmq.NOBLOCK)
            except zmq.Again:  # no connection to the coordinator: say so now rather than wait forever
                finished = True
                yield RequestOutput(rid, [], finish_reason="error", error="the coordinator cannot be reached",
                                    error_status=503)
                return
            while True:
                out = await q.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            del self.streams[rid]
            if not finished:
                self.abort(rid)

    def fail_all(self, error: str) -> None:
        """Ends every open stream with an error (the coordinator is gone: nothing else will)."""
        for rid, q in self.streams.items():
            q.put_nowait(RequestOutput(rid, [], finish_reason="error", error=error, error_status=503))

    def abort(self, request_id: str) -> None:
        """Asks the coordinator to end a request (no wait: safe from a closing generator)."""
        try:
            self.sock.send_multipart(Codec.encode(AbortRequest(request_id)), flags=zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - the coordinator's queue is full: it is gone anyway
            log.warning("could not send abort", extra={"fields": {"request_id": request_id}})
