"""The coordinator process: registration and assignment of stage workers, the request table, and
the scheduling loop that keeps up to `max_in_flight` microbatches of disjoint sequences in the
pipeline, streaming each request's new tokens back to the client that asked.

Sockets (all on one asyncio loop):
- worker ROUTER: workers register here, receive assignments and schedules, and send heartbeats
  and (last stage) step results;
- client ROUTER: gateways and the local driver send requests, aborts and status queries, and get
  `RequestOutput`s back.

A worker that stops heartbeating for `worker_timeout` seconds, or reports a failure, takes the
pipeline down: every request in the table ends with an error naming the stage, and new requests
are refused, so nothing hangs. (Recovery without losing requests builds on this: the table keeps
every request's prompt and generated tokens.)
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from coordinator.core import EngineCore
from coordinator.scheduler import SchedulerConfig
from moemesh.config import ModelConfig, check_layout
from moemesh.log import get_logger
from stage_worker.layers.fp8 import resolve_quantization
from moemesh.netutil import BadMessages, bind, set_heartbeats
from moemesh.protocol import (AbortRequest, Assignment, ClientMessage, Codec, GenerateRequest, Heartbeat,
                              OutputBatch, ProtocolError, Ready, Register, RequestOutput, Shutdown, Start,
                              StatusReply, StatusRequest, StepResult, WorkerFailed, WorkerMessage)

log = get_logger("coordinator")


@dataclass(frozen=True)
class CoordinatorConfig:
    model: str
    pp: int = 1
    tp: int = 1
    layer_partition: tuple[int, ...] | None = None
    host: str = "127.0.0.1"
    port: int = 0  # worker socket; 0: any free port
    client_port: int = 0  # client socket; 0: any free port
    dtype: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_in_flight: int | None = None  # microbatches in the pipeline at once; default pp
    max_model_len: int | None = None
    worker_timeout: float = 5.0
    register_timeout: float = 600.0
    expert_parallel: bool = False
    quantization: str | None = None
    moe_backend: str = "auto"

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or self.pp


@dataclass
class WorkerInfo:
    identity: bytes
    pp_rank: int
    tp_rank: int
    data_address: str
    rendezvous_address: str
    last_seen: float
    busy_seconds: float = 0.0
    comm_seconds: float = 0.0
    sent_bytes: int = 0
    num_blocks: int = 0


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig):
        from moemesh.engine import split_layers

        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.stages = split_layers(self.model_config.num_layers, cfg.layer_partition or _even(
            self.model_config.num_layers, cfg.pp))
        if len(self.stages) != cfg.pp:
            raise ValueError(f"--layer-partition has {len(self.stages)} stages but --pp is {cfg.pp}")
        check_layout(self.model_config, cfg.tp, cfg.expert_parallel)
        resolve_quantization(self.model_config, cfg.quantization)  # refuse before any worker loads
        self.ctx = zmq.asyncio.Context()
        self.workers_sock = self.ctx.socket(zmq.ROUTER)
        self.clients_sock = self.ctx.socket(zmq.ROUTER)
        for s in (self.workers_sock, self.clients_sock):
            set_heartbeats(s)
            s.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.worker_codec, self.client_codec = Codec(WorkerMessage), Codec(ClientMessage)
        self.bad_worker = BadMessages(log, "worker")
        self.bad_client = BadMessages(log, "client")
        self.workers: dict[tuple[int, int], WorkerInfo] = {}
        self.core: EngineCore | None = None
        self.serving = False
        self.failure: str | None = None
        self.owners: dict[str, tuple[bytes, str]] = {}  # internal request id -> (client, client's id)
        self.pending: list[tuple[bytes, GenerateRequest]] = []  # arrived before the pipeline was up
        self.wake = asyncio.Event()
        self.started = time.monotonic()
        self.ready = asyncio.Event()
        # what the coordinator itself costs: microbatches scheduled, its CPU time on them, schedule bytes
        self.steps, self.step_seconds, self.schedule_bytes = 0, 0.0, 0

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self, announce=sys.stdout) -> None:
        cfg = self.cfg
        worker_port = bind(self.workers_sock, cfg.host, cfg.port)
        client_port = bind(self.clients_sock, cfg.host, cfg.client_port)
        self.addresses = {"workers": f"tcp://{cfg.host}:{worker_port}", "clients": f"tcp://{cfg.host}:{client_port}"}
        if announce is not None:  # one line for a launcher to read
            print("MOEMESH_COORDINATOR " + json.dumps(self.addresses), file=announce, flush=True)
        log.info("listening", extra={"fields": self.addresses})
        tasks = [asyncio.ensure_future(c) for c in (self._worker_loop(), self._client_loop(), self._schedule_loop(),
                                                    self._watchdog(), self._startup())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await self._broadcast(Shutdown())
            self.ctx.destroy(linger=100)

    async def _startup(self) -> None:
        need = {(p, t) for p in range(self.cfg.pp) for t in range(self.cfg.tp)}
        deadline = time.monotonic() + self.cfg.register_timeout
        while set(self.workers) != need:
            if self.failure:
                return
            if time.monotonic() > deadline:
                missing = sorted(need - set(self.workers))
                self._fail(f"timed out waiting for stage workers (pp rank, tp rank) {missing} to register")
                return
            await asyncio.sleep(0.05)
        for (p, t), w in sorted(self.workers.items()):
            layers = self.stages[p]
            nxt = self.workers.get((p + 1, t))
            await self._send_worker(w.identity, Assignment(
                self.cfg.model, layers.start, layers.stop, self.cfg.pp, self.cfg.tp,
                nxt.data_address if nxt else None, self.cfg.dtype, self.cfg.block_size,
                tp_rendezvous=self.workers[(p, 0)].rendezvous_address if self.cfg.tp > 1 else None,
                expert_parallel=self.cfg.expert_parallel, quantization=self.cfg.quantization,
                moe_backend=self.cfg.moe_backend))
        while not self.failure and any(w.num_blocks == 0 for w in self.workers.values()):
            await asyncio.sleep(0.05)
        if self.failure:
            return
        num_blocks = min(w.num_blocks for w in self.workers.values())
        mc = self.model_config
        sched_cfg = SchedulerConfig.for_model(self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs,
                                              self.cfg.max_model_len, mc.max_position_embeddings)
        self.core = EngineCore(sched_cfg, num_blocks, self.cfg.block_size, mc.eos_token_ids, mc.vocab_size)
        await self._broadcast(Start(num_blocks))
        self.serving = True
        self.ready.set()
        log.info("serving", extra={"fields": {"stages": self.cfg.pp, "tp": self.cfg.tp, "blocks": num_blocks}})
        for identity, req in self.pending:
            await self._add(identity, req)
        self.pending.clear()
        self.wake.set()

    def _fail(self, reason: str) -> None:
        """The pipeline is down: end every request with the reason; refuse new ones."""
        if self.failure:
            return
        self.failure, self.serving = reason, False
        log.error("pipeline down", extra={"fields": {"reason": reason}})
        outputs = []
        if self.core is not None:
            self.core.fail_in_flight()
            outputs = self.core.abort_all(reason)
        pending, self.pending = self.pending, []
        asyncio.ensure_future(self._tell_failed(outputs, pending, reason))
        self.ready.set()

    async def _tell_failed(self, outputs: list[RequestOutput], pending, reason: str) -> None:
        await self._deliver(outputs)
        for identity, r in pending:
            await self._reply(identity, RequestOutput(r.request_id, [], finish_reason="error", error=reason,
                                                      error_status=503))

    # -- workers ------------------------------------------------------------------------------

    @staticmethod
    async def _messages(sock, codec: Codec, bad: BadMessages):
        """(sender identity, message) from a ROUTER socket; what does not decode is counted, skipped."""
        while True:
            identity, *frames = await sock.recv_multipart(copy=False)
            identity = identity.bytes
            try:
                msg, _ = codec.decode(frames)
            except ProtocolError as e:
                bad(e, identity.hex())
                continue
            yield identity, msg

    async def _worker_loop(self) -> None:
        async for identity, msg in self._messages(self.workers_sock, self.worker_codec, self.bad_worker):
            if isinstance(msg, Register):
                self._register(identity, msg)
                continue
            w = next((w for w in self.workers.values() if w.identity == identity), None)
            if w is None:
                self.bad_worker(ProtocolError(f"{type(msg).__name__} from an unregistered worker"), repr(identity))
                continue
            w.last_seen = time.monotonic()
            if isinstance(msg, Heartbeat):
                w.busy_seconds, w.comm_seconds, w.sent_bytes = msg.busy_seconds, msg.comm_seconds, msg.sent_bytes
            elif isinstance(msg, Ready):
                w.num_blocks = msg.num_blocks
            elif isinstance(msg, StepResult):
                if (w.pp_rank, w.tp_rank) != (self.cfg.pp - 1, 0):
                    self.bad_worker(ProtocolError(f"step result from pp={w.pp_rank} tp={w.tp_rank}, not the "
                                                  f"last stage's rank 0"), repr(identity))
                    continue
                await self._on_result(msg)
            elif isinstance(msg, WorkerFailed):
                self._fail(f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} failed: {msg.error}")

    def _register(self, identity: bytes, msg: Register) -> None:
        key = (msg.pp_rank, msg.tp_rank)
        if not (0 <= msg.pp_rank < self.cfg.pp and 0 <= msg.tp_rank < self.cfg.tp):
            self.bad_worker(ProtocolError(f"registration for rank {key} outside pp={self.cfg.pp} tp={self.cfg.tp}"),
                            repr(identity))
            return
        if key in self.workers and self.serving:
            self.bad_worker(ProtocolError(f"rank {key} registered again while serving"), repr(identity))
            return
        self.workers[key] = WorkerInfo(identity, msg.pp_rank, msg.tp_rank, msg.data_address,
                                       msg.rendezvous_address, time.monotonic())
        log.info("worker registered", extra={"fields": {"pp_rank": msg.pp_rank, "tp_rank": msg.tp_rank,
                                                         "address": msg.data_address, "pid": msg.pid}})

    async def _on_result(self, result: StepResult) -> None:
        if self.core is None or result.step_id not in self.core.in_flight:
            self.bad_worker(ProtocolError(f"result for step {result.step_id}, which is not in flight"), "last stage")
            return
        started = time.thread_time()
        try:
            outputs = self.core.process_result(result)
        except ValueError as e:
            self.bad_worker(ProtocolError(str(e)), "last stage")
            return
        self.step_seconds += time.thread_time() - started  # (before awaiting: other coroutines run then)
        await self._deliver(outputs)
        self.wake.set()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.cfg.worker_timeout / 4))
            if self.failure:
                continue
            now = time.monotonic()
            for (p, t), w in self.workers.items():
                if now - w.last_seen > self.cfg.worker_timeout:
                    self._fail(f"stage worker pp={p} tp={t} stopped responding "
                               f"(no heartbeat for {now - w.last_seen:.1f} s)")
                    break

    async def _send_worker(self, identity: bytes, msg) -> None:
        await self.workers_sock.send_multipart([identity, *Codec.encode(msg)], copy=False)

    async def _broadcast(self, msg) -> None:
        frames = Codec.encode(msg)
        for w in self.workers.values():
            await self.workers_sock.send_multipart([w.identity, *frames], copy=False)

    # -- scheduling ---------------------------------------------------------------------------

    async def _schedule_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            core = self.core
            if not self.serving or core is None:
                continue
            limit = self.cfg.in_flight_limit
            while len(core.in_flight) < limit and core.has_work():
                started = time.thread_time()
                # share the active sequences among the microbatches in flight, so every stage has work
                active = len(core.scheduler.running) + len(core.scheduler.waiting)
                sched = core.next_schedule(max_seqs=max(1, math.ceil(active / limit)))
                if sched is None:
                    break
                frames = Codec.encode(sched)
                self.steps += 1
                self.schedule_bytes += sum(len(f) for f in frames)
                self.step_seconds += time.thread_time() - started
                for w in self.workers.values():
                    await self.workers_sock.send_multipart([w.identity, *frames], copy=False)

    # -- clients ------------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        async for identity, msg in self._messages(self.clients_sock, self.client_codec, self.bad_client):
            if isinstance(msg, GenerateRequest):
                if self.failure:
                    await self._reply(identity, RequestOutput(msg.request_id, [], finish_reason="error",
                                                              error=f"pipeline is down: {self.failure}",
                                                              error_status=503))
                elif not self.serving:
                    self.pending.append((identity, msg))
                else:
                    await self._add(identity, msg)
            elif isinstance(msg, AbortRequest):
                await self._abort(identity, msg.request_id)
            elif isinstance(msg, StatusRequest):
                await self._reply(identity, self.status())

    async def _add(self, identity: bytes, req: GenerateRequest) -> None:
        key = f"{identity.hex()}:{req.request_id}"
        try:
            self.core.add(key, req.prompt_ids, req.params)
        except ValueError as e:
            await self._reply(identity, RequestOutput(req.request_id, [], finish_reason="error", error=str(e),
                                                      error_status=400, num_prompt_tokens=len(req.prompt_ids)))
            return
        self.owners[key] = (identity, req.request_id)
        self.wake.set()

    async def _abort(self, identity: bytes, request_id: str) -> None:
        key = f"{identity.hex()}:{request_id}"
        self.pending = [(i, r) for i, r in self.pending if (i, r.request_id) != (identity, request_id)]
        if self.core is not None and (out := self.core.abort(key)) is not None:
            await self._deliver([out])
            self.wake.set()

    async def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One message per client with all of its outputs (a step's worth), not one per request."""
        by_client: dict[bytes, list[RequestOutput]] = {}
        for out in outputs:
            owner = self.owners.get(out.request_id)
            if owner is None:
                continue
            identity, client_id = owner
            if out.finish_reason is not None:
                del self.owners[out.request_id]
            by_client.setdefault(identity, []).append(_with_id(out, client_id))
        for identity, outs in by_client.items():
            await self._reply(identity, outs[0] if len(outs) == 1 else OutputBatch(outs))

    async def _reply(self, identity: bytes, msg) -> None:
        await self.clients_sock.send_multipart([identity, *Codec.encode(msg)], copy=False)

    def status(self) -> StatusReply:
        core = self.core
        busy, comm, sent = [0.0] * self.cfg.pp, [0.0] * self.cfg.pp, [0] * self.cfg.pp
        for (p, t), w in self.workers.items():
            if t == 0:
                busy[p], comm[p], sent[p] = w.busy_seconds, w.comm_seconds, w.sent_bytes
        return StatusReply(
            serving=self.serving, num_blocks=core.blocks.num_blocks if core else 0,
            num_free_blocks=core.blocks.num_free if core else 0,
            num_running=len(core.scheduler.running) if core else 0,
            num_waiting=(len(core.scheduler.waiting) if core else 0) + len(self.pending),
            num_preemptions=core.scheduler.num_preemptions if core else 0, stage_busy_seconds=busy,
            stage_comm_seconds=comm, stage_sent_bytes=sent,
            uptime_seconds=time.monotonic() - self.started,
            malformed_messages=self.bad_worker.count + self.bad_client.count, model=self.cfg.model,
            max_model_len=core.scheduler.config.max_model_len if core else 0, failure=self.failure,
            steps=self.steps, coordinator_step_seconds=self.step_seconds, schedule_bytes=self.schedule_bytes)


def _with_id(out: RequestOutput, request_id: str) -> RequestOutput:
    return msgspec.structs.replace(out, request_id=request_id)


def _even(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible, earlier stages taking the remainder."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"--pp {pp} must be between 1 and the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))
