"""An asyncio client of the coordinator's client socket: what the gateway and the local
`generate` driver use to submit requests and stream their outputs."""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from moemesh.log import get_logger
from moemesh.mesh_security import MeshKeys
from moemesh.netutil import BadMessages, connect, receive, set_heartbeats
from moemesh.protocol import (MAX_REQUEST_ID, AbortRequest, Codec, CoordinatorReply, GenerateRequest, OutputBatch,
                              ProtocolError, RequestOutput, ResendRequest, StatusReply, StatusRequest,
                              UNKNOWN_REQUEST)
from moemesh.sampling import SamplingParams

log = get_logger("client")
CLOSING_WAIT = 10.0  # seconds a request id this client aborted may take to be ended before it is used again


class PipelineFailed(RuntimeError):
    """The coordinator's pipeline went down before it served (the reason is the message)."""


@dataclass
class _Stream:
    """One request's outputs on their way to its `generate` loop."""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    received: int = 0  # tokens handed over
    early: dict[int, RequestOutput] = field(default_factory=dict)  # outputs past a gap, by their start
    asked: bool = False  # the missing outputs were asked for again
    request: GenerateRequest | None = None  # sent again should the coordinator never have had it
    resubmitted: bool = False  # it was
    unanswered: int = 0  # asks sent while it had no token, not yet answered "not known"
    stale: int = 0  # of those, sent before it went again: their "not known" tells nothing of it now


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
        connect(self.sock, address)
        self.codec = Codec(CoordinatorReply)
        self.bad = BadMessages(log, "coordinator")
        self.streams: dict[str, _Stream] = {}
        # request ids this client aborted whose last output (the abort's answer) has not come: their
        # outputs are dropped, and the id is not used again before (a new stream would take them)
        # (an entry goes when the coordinator answers, or CLOSING_WAIT later: one that never will)
        self.closing: dict[str, tuple[float, asyncio.Event]] = {}
        self.status_waiters: dict[int, asyncio.Future] = {}  # StatusRequest.nonce -> its reply, to come
        self._nonces = itertools.count(1)
        self.resends = 0  # outputs asked for again (missed on a link that dropped)
        self._ids = itertools.count()
        self._reader = asyncio.ensure_future(self._read())
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._watcher = asyncio.ensure_future(self._watch_link(self._monitor))

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            task.cancel()
        await asyncio.gather(self._reader, self._watcher, return_exceptions=True)
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)

    async def _watch_link(self, monitor) -> None:
        """Once the link to the coordinator dropped and came back, outputs queued for this client on the
        old connection are gone (ZeroMQ drops them with it), among them perhaps a request's last: every
        open stream asks for its outputs again from where it is."""
        dropped = False
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                dropped = True
            elif dropped:
                dropped = False
                log.warning("link to the coordinator came back; asking for missed outputs",
                            extra={"fields": {"streams": len(self.streams)}})
                for rid, st in self.streams.items():
                    self._ask_again(rid, st)

    def _ask_again(self, rid: str, st: "_Stream") -> None:
        self.resends += 1
        st.asked = self._send_now(ResendRequest(rid, st.received))  # (no link now: asked when it comes back)
        if st.asked and st.received == 0:
            st.unanswered += 1

    def _send_now(self, msg) -> bool:
        """Sends without waiting; whether ZeroMQ took the message (the asyncio socket reports a refusal,
        no peer or a full queue, on the future it returns)."""
        sent = self.sock.send_multipart(Codec.encode(msg), flags=zmq.NOBLOCK)
        if sent.done():
            return sent.exception() is None
        sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its error, if any, is not lost)
        return True

    def heard(self, request_id: str) -> bool:
        """Whether an output of the request has reached this client (handed to its `generate` loop or
        waiting for it), or its stream is not open: what the coordinator said of it before the answer
        to a later status is here by the time that answer is, though a loop may not have taken it yet."""
        st = self.streams.get(request_id)
        return st is None or bool(st.received or st.early) or not st.queue.empty()

    def _arrive(self, rid: str, st: "_Stream", out: RequestOutput) -> None:
        """Hands a stream its outputs in order, each token once. An output past a gap (outputs lost on a
        link that dropped) waits while the missing ones are asked for again; one that repeats tokens
        already handed over is trimmed. An error ends the stream at once."""
        if out.error_status == UNKNOWN_REQUEST and st.received == 0:
            st.unanswered = max(0, st.unanswered - 1)
            if st.stale:  # (perhaps an answer to an ask the coordinator took before the request went again)
                st.stale -= 1
                # asked afresh: an ask counted as stale may have had no answer (a request held, or live with
                # nothing new, gets none) or lost its answer in a drop, and this "not known" may be the real
                # one. If the request is not known, the fresh ask's "not known" comes after every earlier
                # answer, so the count drains and the stream ends; if it runs, its tokens come instead
                self._ask_again(rid, st)
                return
            if not st.resubmitted and st.request is not None and self._send_now(st.request):
                # it never reached the coordinator (lost on a link that dropped): nothing of it was shown,
                # so it is sent again, once; the asks still unanswered were taken before it, and each will
                # be answered "not known" too. A "not known" after those: lost again, the stream ends (503)
                st.request, st.asked, st.resubmitted, st.stale = None, False, True, st.unanswered
                st.early.clear()  # (nothing of the first run is kept: the second starts from token 0)
                return
        if out.error_status == UNKNOWN_REQUEST:  # (to the consumer: the service could not finish it, retry)
            out = msgspec.structs.replace(out, error_status=503)
        if out.start < 0 or out.error:  # (a coordinator that does not count, or the end of the request)
            st.queue.put_nowait(out)
            return
        if out.start > st.received:
            st.early[out.start] = out
            if not st.asked:
                self._ask_again(rid, st)
            return
        self._hand_over(st, out)
        while (ready := [start for start in st.early if start <= st.received]):
            self._hand_over(st, st.early.pop(min(ready)))

    @staticmethod
    def _hand_over(st: "_Stream", out: RequestOutput) -> None:
        """An output that starts at or before what the stream has: the tokens it does not have yet."""
        skip = st.received - out.start
        if skip > 0 and skip >= len(out.token_ids) and out.finish_reason is None:
            return  # (all of it came already)
        if skip:  # (what the first output said, its queue time and prompt logprobs, came with it already)
            out = msgspec.structs.replace(out, token_ids=out.token_ids[skip:], start=st.received, prompt_logprobs=None,
                                          logprobs=out.logprobs[skip:] if out.logprobs is not None else None,
                                          queue_seconds=None, num_cached_tokens=0)
        st.received += len(out.token_ids)
        st.asked = False
        st.queue.put_nowait(out)

    async def _read(self) -> None:
        while True:
            frames = await receive(self.sock)
            try:
                msg, _ = self.codec.decode(frames)
            except ProtocolError as e:
                self.bad(e)
                continue
            if isinstance(msg, StatusReply):
                # the question it answers (one that timed out has gone: its late answer is dropped); a
                # coordinator that does not echo the nonce answers in order: the oldest question
                waiting = self.status_waiters
                fut = waiting.get(msg.nonce) if msg.nonce else next(iter(waiting.values()), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            for out in msg.outputs if isinstance(msg, OutputBatch) else (msg,):
                if (closed := self.closing.get(out.request_id)) is not None:
                    if out.finish_reason is not None:
                        del self.closing[out.request_id]
                        closed[1].set()
                elif (st := self.streams.get(out.request_id)) is not None:
                    self._arrive(out.request_id, st, out)

    async def status(self, timeout: float = 5.0, timeline: bool = False) -> StatusReply:
        """Raises asyncio.TimeoutError when the coordinator does not answer in time (or cannot be
        reached at all: with no connection, the request is not even queued). timeline: the reply also
        holds the recent steps of every stage and of the coordinator (moemesh.timeline)."""
        fut = asyncio.get_running_loop().create_future()
        nonce = next(self._nonces)
        self.status_waiters[nonce] = fut
        try:
            try:
                await self.sock.send_multipart(Codec.encode(StatusRequest(timeline, nonce)), flags=zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(min(timeout, 0.5))
                raise asyncio.TimeoutError from None
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            del self.status_waiters[nonce]
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # (Python 3.11's wait_for returns a result that meets a cancel
            raise asyncio.CancelledError            # and drops the cancel: a loop around it would never end)
        return reply

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
                pass
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
        if len(rid) > MAX_REQUEST_ID:  # (the coordinator refuses it, under an id cut short that no stream holds)
            raise ValueError(f"request id of {len(rid)} characters: at most {MAX_REQUEST_ID}")
        if (closed := self.closing.get(rid)) is not None:  # (aborted just now: its end is on its way)
            deadline, ended = closed
            try:
                await asyncio.wait_for(ended.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:  # (no answer: a coordinator gone, a link that dropped)
                if self.closing.get(rid) is closed:
                    del self.closing[rid]
            if rid in self.streams or rid in self.closing:
                raise ValueError(f"request id {rid!r} is already streaming")
        request = GenerateRequest(rid, list(prompt_ids), params)
        st = self.streams[rid] = _Stream(request=request)
        finished = False
        try:
            try:
                await self.sock.send_multipart(Codec.encode(request), flags=zmq.NOBLOCK)
            except zmq.Again:  # no connection to the coordinator: say so now rather than wait forever
                finished = True
                yield RequestOutput(rid, [], finish_reason="error", error="the coordinator cannot be reached",
                                    error_status=503)
                return
            while True:
                out = await st.queue.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            del self.streams[rid]
            if not finished and self.abort(rid):
                now = time.monotonic()
                while self.closing:  # (the oldest first: those past their wait will not be answered)
                    oldest = next(iter(self.closing))
                    if self.closing[oldest][0] > now:
                        break
                    self.closing.pop(oldest)[1].set()
                self.closing[rid] = (now + CLOSING_WAIT, asyncio.Event())

    def fail_all(self, error: str) -> None:
        """Ends every open stream with an error (the coordinator does not answer), and asks it to end
        the requests, which it would otherwise go on computing should it come back."""
        for rid, st in self.streams.items():
            st.queue.put_nowait(RequestOutput(rid, [], finish_reason="error", error=error, error_status=503))
            self.abort(rid)

    def abort(self, request_id: str) -> bool:
        """Asks the coordinator to end a request (no wait: safe from a closing generator); whether it was
        asked. After close() there is no link to ask on: streams still open then (cancelled with their
        event loop) end quietly."""
        if self.sock.closed:
            return False
        if not self._send_now(AbortRequest(request_id)):  # (no link, or its queue full: the coordinator is gone)
            log.warning("could not send abort", extra={"fields": {"request_id": request_id}})
            return False
        return True
