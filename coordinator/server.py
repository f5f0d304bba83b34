"""The coordinator process: the pipeline's lifecycle, the client link and the scheduling loop, as parts.

    WorkerRegistry (registry.py)  who is in the pipeline; a phase per worker and for the pipeline
    ClientRouter (router.py)      the client link: requests in, outputs back to the client that asked
    StepLoop (step_loop.py)       schedules out through the ZeroMQ pipeline, step results in

Sockets (all on one asyncio loop): a worker ROUTER (registration, assignments, schedules down;
heartbeats, Ready and the last stage's step results up) and a client ROUTER (gateways and the local
driver). The lifecycle runs on events: every rank registered (within `--register-timeout`) ->
assignments -> every worker Ready (within `--ready-timeout`) -> Start -> serving.

A worker that stops heartbeating for `worker_timeout` seconds, or reports a failure, is lost. A
serving pipeline then recovers (`_recover`): a new epoch; the survivors drop every step not yet
run (`Reset`); every unfinished sequence goes back to the waiting queue to be recomputed as prompt
+ output (its stream continues with the next token); a replacement that registers for the missing
rank (the launcher restarts the dead process) is assigned its layers, the previous stage is pointed
at it (`Repoint`), and once it is Ready scheduling resumes. Requests that arrive meanwhile wait.
With tensor parallelism every worker is told to exit and is replaced (fresh rendezvous per stage).
Only if no replacement is Ready within `--recovery-timeout` does the pipeline go down: every
request ends with an error (503) and new ones are refused, so nothing hangs. A lost worker before
the pipeline first serves takes it down at once.

A stop (SIGTERM: `docker stop`, a pod's deletion, systemd) drains: new requests are refused (503,
and the status says `stopping`, so gateways refuse them first and /ready turns false), the requests
in flight run to their end for up to `--drain-timeout` seconds (the rest then end with a 503, so no
stream waits on a coordinator that is gone), and then the coordinator ends, its
workers told to exit. A second SIGTERM ends it at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from coordinator.core import EngineCore
from coordinator.registry import Phase, WorkerRegistry
from coordinator.router import ClientRouter
from coordinator.scheduler import SchedulerConfig
from coordinator.step_loop import StepLoop, check_num_steps, in_flight_limit, make_core
from moemesh.config import ModelConfig
from moemesh.errors import ConfigError
from moemesh.layout import MlpHandoff, resolve_layout
from moemesh.log import get_logger
from moemesh.mesh_security import MeshGuard, check_exposure
from moemesh.netutil import BadMessages, bind, receive, set_heartbeats, url_host
from moemesh.protocol import (MAX_KV_BLOCKS, MAX_REQUEST_ID, PROTOCOL_VERSION, TIMELINE_SPANS, AbortRequest,
                              Assignment, ClientMessage, Codec, GenerateRequest, Heartbeat, Ping, ProtocolError,
                              Ready, Register, Repoint, RequestOutput, ResendRequest, Reset, Schedule, Shutdown,
                              Start, StatusReply, StatusRequest, StepResult, StepSpan, UNKNOWN_REQUEST, WorkerFailed,
                              WorkerMessage, max_activation_bytes, max_client_message_bytes, max_result_bytes,
                              worker_message_bytes)
from moemesh.settings import CoordinatorSettings

log = get_logger("coordinator")
STOPPING = "the coordinator is stopping (SIGTERM)"

LOST_AFTER = 2.0  # seconds a computed step's result may take to arrive before it counts as lost
STALL = 1.0  # seconds the watchdog may wake late before the delay counts as this process's own stall
# seconds a link between stages may take to connect for the first time before the status names it
# (connecting on a network takes milliseconds; one that never connects fails every step)
UNREACHED_AFTER = 3.0
# seconds since a rank's worker was last heard (it heartbeats every half second) within which another
# process's claim on that rank is refused: a second worker started for the rank, not a restart (a
# restarted one starts Python first; refused anyway, it is started again and taken)
LIVE_HOLDER = 1.5


class ZmqPipeline:
    """The mesh side of the pipeline interface: each schedule, encoded once, to every worker."""

    def __init__(self, sock, registry: WorkerRegistry):
        self.sock, self.registry = sock, registry
        self.schedule_bytes = 0
        self.encode_seconds = 0.0

    async def send(self, sched: Schedule) -> None:
        started = time.thread_time()
        reg = self.registry
        frames = Codec.encode(msgspec.structs.replace(sched, epoch=reg.epoch, first_step=reg.first_step))
        self.encode_seconds += time.thread_time() - started
        self.schedule_bytes += sum(len(f) for f in frames)
        for w in reg.workers.values():
            await self.sock.send_multipart([w.identity, *frames], copy=False)


class Coordinator:
    def __init__(self, cfg: CoordinatorSettings):
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model)
        # refuse before any worker loads
        # (`auto` here balances the weights: a coordinator does not know where its stages run; `serve`
        # and `generate` resolve a measured split before they start one, moemesh/step_costs.py)
        self.layout = resolve_layout(self.model_config, cfg.pp, cfg.tp, cfg.layer_partition, cfg.expert_parallel,
                                     cfg.quantization, handoff=not cfg.no_mlp_handoff)
        check_num_steps(cfg, cfg.pp, cfg.tp)
        # the MLP hand-off (moemesh.layout.MlpHandoff): None where off or where no step could use it
        self.handoff = None if cfg.no_mlp_handoff else MlpHandoff.for_layout(self.model_config, self.layout.stages)
        check_exposure(cfg.mesh_keys, cfg.insecure_mesh, host=cfg.host)
        self.ctx = zmq.asyncio.Context()
        self.guard = MeshGuard(self.ctx, cfg.mesh_keys)
        self.announce = None  # where a launcher reads this process's lines (`run`'s announce)
        self.workers_sock = self.ctx.socket(zmq.ROUTER)
        self.clients_sock = self.ctx.socket(zmq.ROUTER)
        for s in (self.workers_sock, self.clients_sock):
            set_heartbeats(s)
            s.setsockopt(zmq.ROUTER_MANDATORY, 0)
            # a peer that reconnects (its heartbeats timed out while this process stalled, or the link
            # dropped) comes back with its identity: the new connection takes it over, where libzmq would
            # otherwise refuse it while the old one lingers, and route nothing to that peer again. (Client
            # and worker identities are unguessable and never told to another peer, so no other peer can
            # take one over.)
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # a gateway that reads slowly is never dropped an output (ZeroMQ drops at the high-water mark on a
        # ROUTER): what it has not read waits here, bounded by its requests' tokens (its --max-pending);
        # the gateway cuts off its own slow HTTP readers (--stream-timeout)
        self.clients_sock.setsockopt(zmq.SNDHWM, 0)
        # a peer that sends more than the largest legitimate message is cut off by libzmq
        max_len = SchedulerConfig.for_model(cfg.max_batched_tokens, cfg.max_seqs, cfg.max_model_len,
                                            self.model_config.max_position_embeddings).max_model_len
        self.workers_sock.setsockopt(zmq.MAXMSGSIZE, max_result_bytes(cfg.max_batched_tokens, cfg.max_seqs,
                                                                        cfg.num_scheduler_steps))
        self.activation_bytes = max_activation_bytes(self.model_config.hidden_size, cfg.max_batched_tokens)
        self.worker_message_bytes = worker_message_bytes(self.model_config.hidden_size, cfg.max_batched_tokens,
                                                         cfg.max_seqs, max_len, cfg.block_size)
        self.clients_sock.setsockopt(zmq.MAXMSGSIZE, max_client_message_bytes(max_len))
        self.worker_codec, self.client_codec = Codec(WorkerMessage), Codec(ClientMessage)
        self.bad_worker = BadMessages(log, "worker")
        self.bad_client = BadMessages(log, "client")
        self.registry = WorkerRegistry(cfg.pp, cfg.tp)
        self.router = ClientRouter(self.clients_sock)
        self.pipeline = ZmqPipeline(self.workers_sock, self.registry)
        self.core: EngineCore | None = None
        self.loop: StepLoop | None = None
        self.failure: str | None = None
        self.unreached = ""  # a link between stages that never connected, named (registry.unreached)
        self._unreached_rank: tuple[int, int] | None = None  # the worker whose link it is
        self._connected_late_at: float | None = None  # when a link made again after a refusal connected
        self.down_linger = 5.0  # seconds a down pipeline keeps answering status before `run` returns
        self.wake = asyncio.Event()  # work may be schedulable: a request, a result, an abort
        self.started = time.monotonic()
        self.instance = os.urandom(8).hex()  # tells clients this process from one restarted on the same ports
        self.recovering: asyncio.Task | None = None
        self.abandoned: set[int] = set()  # steps in flight when a worker was lost: their results are void
        self.recoveries, self.recovery_seconds, self.requests_resumed, self.tokens_recomputed = 0, 0.0, 0, 0
        self.workers_replaced = 0
        self.issued: dict[int, float] = {}  # step id -> when it went out (--step-timeout)
        # each stage's most recent steps, from its rank 0's heartbeats (StatusRequest(timeline=True))
        self.stage_spans: list[deque[StepSpan]] = [deque(maxlen=TIMELINE_SPANS) for _ in range(cfg.pp)]
        self.results_taken = 0
        self.step_resets, self._results_at_reset, self._resetting = 0, None, False
        self._computed_at: dict[int, float] = {}  # step in flight -> when the last stage said it had computed it
        self._stalled_until = 0.0  # until then no message counts as lost (this process just stalled)
        self._recovery_started = 0.0
        self.stopping = False  # a stop (SIGTERM) drains: no new requests, the ones in flight finish
        self.drained = asyncio.Event()

    @property
    def serving(self) -> bool:
        return self.registry.phase is Phase.SERVING

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self, announce=sys.stdout) -> None:
        cfg = self.cfg
        self.guard.serve(self.workers_sock, "workers")
        self.guard.serve(self.clients_sock, "clients")
        try:
            worker_port = bind(self.workers_sock, cfg.host, cfg.port)
            client_port = bind(self.clients_sock, cfg.host, cfg.client_port, "--host/--client-port")
        except OSError:  # (its sockets closed: a context left open would block whoever collects it)
            self.guard.close()
            self.ctx.destroy(linger=0)
            raise
        host = url_host(cfg.host)
        self.addresses = {"workers": f"tcp://{host}:{worker_port}", "clients": f"tcp://{host}:{client_port}"}
        # SIGTERM drains from here on (before the announcement: a launcher may stop it as soon as it reads it)
        on_sigterm = threading.current_thread() is threading.main_thread()  # (loop signal handlers: main thread)
        if on_sigterm:
            before = signal.getsignal(signal.SIGTERM)
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.stop)
        self.announce = announce
        if announce is not None:  # one line for a launcher to read
            print("MOEMESH_COORDINATOR " + json.dumps(self.addresses), file=announce, flush=True)
        log.info("listening", extra={"fields": self.addresses})
        tasks = [asyncio.ensure_future(c) for c in (self._worker_loop(), self._client_loop(), self._step_loop(),
                                                    self._watchdog(), self._lifecycle(), self._ping(),
                                                    self._step_deadline())]
        down = asyncio.ensure_future(self._end_when_down())
        drained = asyncio.ensure_future(self.drained.wait())
        try:
            pending = {*tasks, down, drained}
            while down in pending and drained in pending:  # (the lifecycle task ends once serving; the others
                # run until the end)
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t not in (down, drained) and not t.cancelled() and t.exception() is not None:
                        raise t.exception()
        finally:
            if on_sigterm:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
                if before is not None:  # (the handler of a container's first process, `cli.main`)
                    signal.signal(signal.SIGTERM, before)
            down.cancel()
            drained.cancel()
            for t in tasks:
                t.cancel()
            await self._broadcast(Shutdown())
            self.guard.close()
            # (a drained coordinator's last outputs may still be on their way to slow clients: up to 2 s)
            self.clients_sock.setsockopt(zmq.LINGER, 2000 if self.stopping else 100)
            self.workers_sock.setsockopt(zmq.LINGER, 100)
            self.ctx.destroy()

    def stop(self) -> None:
        """SIGTERM: drain (the module's docstring); a second one ends the process at once."""
        if self.stopping:
            os._exit(128 + signal.SIGTERM)
        self.stopping = True
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """Refuse new requests, let the ones in flight finish within --drain-timeout, then end `run`:
        requests still held (the pipeline not serving yet) are refused at once, and the ones unfinished
        at the deadline end with a 503, so that no stream waits on a coordinator that is gone."""
        deadline = time.monotonic() + self.cfg.drain_timeout
        log.info("stopping on SIGTERM: the requests in flight finish, new ones are refused", extra={"fields": {
            "requests": self._in_flight(), "seconds": self.cfg.drain_timeout}})
        for identity, req in self.router.release():
            await self.router.refuse(identity, req, STOPPING, 503)
        while self._in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._in_flight():
            log.warning("stopping with requests unfinished (--drain-timeout)", extra={"fields": {
                "requests": self._in_flight()}})
            await self.router.deliver(self.core.abort_all(f"{STOPPING}: the request did not finish within "
                                                          f"--drain-timeout ({self.cfg.drain_timeout:g} s)"))
        self.drained.set()

    def _in_flight(self) -> int:
        return (len(self.core.requests) if self.core is not None else 0) + len(self.router.held)

    async def _end_when_down(self) -> None:
        """A pipeline that went down never comes back in this process (workers that never came, or
        failed to load, or could not be replaced): `down_linger` seconds after it, for clients to
        learn the reason from their status, `run` returns, and the process exits with status 1, to be
        started afresh by whatever started it (compose's restart policy, `serve`'s launcher), with its
        workers registering again."""
        await self.registry.went_down.wait()
        log.error("exiting: the pipeline is down", extra={"fields": {"reason": self.failure,
                                                                      "seconds": self.down_linger}})
        await asyncio.sleep(self.down_linger)

    async def _lifecycle(self) -> None:
        """REGISTERING -> LOADING -> SERVING, each wait bounded by its deadline."""
        cfg, reg = self.cfg, self.registry
        if not await self._until(reg.all_registered, cfg.register_timeout):
            return self._fail(f"timed out waiting for stage workers (pp rank, tp rank) {reg.missing()} to register")
        reg.enter(Phase.LOADING)
        await self._assign(list(reg.workers.values()))
        if not await self._until(reg.all_ready, cfg.ready_timeout):
            return self._fail(f"timed out waiting for stage workers (pp rank, tp rank) {reg.not_ready()} to load "
                              f"their layers ({cfg.ready_timeout:g} s, --ready-timeout)")
        num_blocks = reg.num_blocks()
        try:
            self.core = make_core(cfg, self.model_config, num_blocks, cfg.pp, cfg.tp,
                                   handoff=self.handoff)
        except (ValueError, MemoryError) as e:
            return self._fail(f"the pipeline's KV pool of {num_blocks} blocks could not be set up: {e}")
        self.loop = StepLoop(self.core, in_flight_limit(cfg, cfg.pp))
        await self._broadcast(Start(num_blocks))
        if self.failure:  # a worker failed while Start went out
            return
        reg.enter(Phase.SERVING)
        log.info("serving", extra={"fields": {"stages": cfg.pp, "tp": cfg.tp, "blocks": num_blocks,
                                              "mlp_handoff": sorted(self.handoff.layers) if self.handoff else []}})
        for identity, req in self.router.release():
            await self._add(identity, req)
        self.wake.set()

    async def _assign(self, workers) -> None:
        """Sends each worker its layers and the address of the next stage's worker of its tensor rank."""
        cfg, reg, stages = self.cfg, self.registry, self.layout.stages
        for w in sorted(workers, key=lambda w: w.rank):
            p, t = w.rank
            nxt = reg.workers.get((p + 1, t))
            reg.assigned(w)  # before the send: its Ready may be handled while the send awaits
            await self._send_worker(w.identity, Assignment(
                cfg.model, stages[p].start, stages[p].stop, cfg.pp, cfg.tp, nxt.data_address if nxt else None,
                cfg.dtype, cfg.block_size,
                tp_rendezvous=reg.workers[(p, 0)].rendezvous_address if cfg.tp > 1 else None,
                expert_parallel=cfg.expert_parallel, quantization=cfg.quantization, moe_backend=cfg.moe_backend,
                mlp_handoff=self.handoff is not None and self.handoff.holds(stages[p])))

    async def _until(self, event: asyncio.Event, timeout: float, also: asyncio.Event | None = None) -> bool:
        """Waits for `event` (or `also`) until `timeout` or the pipeline goes down; whether `event` came."""
        waits = [asyncio.ensure_future(e.wait()) for e in (event, self.registry.went_down, also) if e is not None]
        try:
            await asyncio.wait(waits, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
        return event.is_set() and self.failure is None

    def _lost(self, w, reason: str) -> None:
        """A worker is gone. A serving (or already recovering) pipeline recovers without it (before
        it first serves, the pipeline goes down). With tensor parallelism every worker goes: the lost
        one's stage peers because their process group cannot take a new member, the other stages
        because a Reset could leave a stage's ranks one step apart in their collectives. They are
        told to exit, their launchers start them again, and each stage meets at a fresh rendezvous."""
        if self.failure:
            return
        if self.registry.phase not in (Phase.SERVING, Phase.RECOVERING):
            return self._fail(reason, w)
        recovering = self.registry.phase is Phase.RECOVERING
        log.warning("worker lost, recovering", extra={"fields": {"reason": reason, "epoch": self.registry.epoch
                                                                  + (0 if recovering else 1)}})
        self.registry.lose(w)
        self._tell_launcher(w, reason)
        if self.cfg.tp > 1:
            for peer in list(self.registry.workers.values()):
                self.registry.lose(peer)
                self._tell_launcher(peer, f"a peer of its stage was lost: {reason}")
                asyncio.ensure_future(self._send_worker(peer.identity, Shutdown(
                    reason=f"its stage starts over at a fresh rendezvous: {reason}")))
        self._requeue_all()
        self._check_links()  # (a link of a worker gone is no longer waited for)
        if not recovering:
            self.recoveries += 1
            # now, with the epoch: a Ping sent before _recover runs must not pair it with the old first step
            self.registry.first_step = self.core.next_step_id
            self.recovering = asyncio.ensure_future(self._recover_or_fail())

    def _tell_launcher(self, w, reason: str) -> None:
        """One line for the launcher that reads this process's announcements: a worker counted lost,
        which it kills if the process is still there LOST_GRACE seconds later (stopped, or stuck where
        it cannot hear its Shutdown), so that it is started again."""
        if self.announce is None:
            return
        try:
            print("MOEMESH_LOST " + json.dumps({"pp": w.pp_rank, "tp": w.tp_rank, "pid": w.pid, "reason": reason}),
                  file=self.announce, flush=True)
        except (OSError, ValueError):  # (nobody reads any more: the launcher is gone, and this process with it)
            pass

    def _requeue_all(self) -> None:
        """The steps in flight are void (their results dropped when they come); every unfinished
        sequence goes back to be recomputed as prompt + output."""
        self.abandoned.update(self.core.in_flight)
        resumed, tokens = self.core.requeue_all()
        self.requests_resumed += resumed
        self.tokens_recomputed += tokens

    async def _recover_or_fail(self) -> None:
        try:
            await self._recover()
        except Exception as e:  # the deadline lives in there: an error must not leave it recovering
            log.error("recovery failed", exc_info=True)
            self._fail(f"recovery failed: {type(e).__name__}: {e}")

    async def _recover(self) -> None:
        """RECOVERING -> SERVING once every lost rank has a replacement that is Ready, or DOWN."""
        cfg, reg = self.cfg, self.registry
        started = self._recovery_started = time.monotonic()
        deadline = started + cfg.recovery_timeout
        reg.first_step = self.core.next_step_id
        # the survivors (not a replacement already in)
        await self._broadcast(Reset(reg.epoch, reg.first_step), only=Phase.SERVING)
        replacements, told = [], set()
        while True:
            reg.lost.clear()
            if not await self._until(reg.all_registered, deadline - time.monotonic()):
                return self._fail(f"no replacement registered for stage workers (pp rank, tp rank) {reg.missing()} "
                                  f"within {cfg.recovery_timeout:g} s (--recovery-timeout)")
            new = [w for w in reg.workers.values() if w.phase is Phase.REGISTERING]
            replacements += new
            self.workers_replaced += len(new)
            await self._assign(new)
            for w in new:  # the previous stage's worker of the same tensor rank sends to the replacement now
                prev = reg.workers.get((w.pp_rank - 1, w.tp_rank))
                if prev is not None and prev not in new:  # (a new one got the address in its Assignment)
                    await self._send_worker(prev.identity, Repoint(w.data_address))
            if await self._until(reg.all_ready, deadline - time.monotonic(), also=reg.lost):
                num_blocks = reg.num_blocks()
                if num_blocks != self.core.blocks.num_blocks:  # (a replacement with another --kv-memory)
                    log.warning("the rebuilt pipeline's KV pool has another size", extra={"fields": {
                        "blocks": num_blocks, "before": self.core.blocks.num_blocks}})
                    await self.router.deliver(self.core.resize(num_blocks))  # nothing holds a block while recovering
                for w in replacements:
                    if reg.workers.get(w.rank) is w and id(w) not in told:  # (not one lost again meanwhile)
                        told.add(id(w))
                        await self._send_worker(w.identity, Start(num_blocks, reg.epoch))
                if not reg.lost.is_set():
                    break
                continue  # a worker was lost while these awaited: its replacement too, before serving
            if self.failure:
                return
            if not reg.lost.is_set():
                return self._fail(f"stage workers (pp rank, tp rank) {reg.not_ready()} did not load within "
                                  f"{cfg.recovery_timeout:g} s of the recovery (--recovery-timeout)")
        reg.enter(Phase.SERVING)
        self.recovery_seconds += time.monotonic() - started
        log.info("recovered", extra={"fields": {"epoch": reg.epoch, "blocks": num_blocks,
                                                 "seconds": round(time.monotonic() - started, 2)}})
        self.wake.set()

    def _fail(self, reason: str, worker=None) -> None:
        """The pipeline is down: end every request with the reason; refuse new ones."""
        if self.failure:
            return
        self.failure = reason
        self.registry.down(worker)
        log.error("pipeline down", extra={"fields": {"reason": reason}})
        outputs = []
        if self.core is not None:
            self.core.fail_in_flight()
            outputs = self.core.abort_all(reason)
        held = self.router.release()
        asyncio.ensure_future(self._tell_failed(outputs, held, reason))

    async def _tell_failed(self, outputs, held, reason: str) -> None:
        await self.router.deliver(outputs)
        for identity, req in held:
            await self.router.refuse(identity, req, reason, 503)

    # -- workers ------------------------------------------------------------------------------

    @staticmethod
    async def _messages(sock, codec: Codec, bad: BadMessages):
        """(sender identity, message) from a ROUTER socket; what does not decode is counted, skipped."""
        while True:
            identity, *frames = await receive(sock)
            identity = identity.bytes
            try:
                msg, _ = codec.decode(frames)
            except ProtocolError as e:
                bad(e, identity.hex())
                continue
            yield identity, msg

    async def _worker_loop(self) -> None:
        async for identity, msg in self._messages(self.workers_sock, self.worker_codec, self.bad_worker):
            try:
                await self._on_worker(identity, msg)
            except Exception as e:  # a bug in handling one message must not end the coordinator
                log.error("worker message failed", exc_info=True)
                self.bad_worker(ProtocolError(f"{type(msg).__name__} could not be handled: {e}"), repr(identity))

    async def _on_worker(self, identity: bytes, msg) -> None:
        reg = self.registry
        if isinstance(msg, Register):
            reason = held = None
            if msg.protocol != PROTOCOL_VERSION:  # it would misread schedules or send what this one misreads
                reason = (f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} speaks protocol {msg.protocol}, this "
                          f"coordinator {PROTOCOL_VERSION}: run the same moemesh version on every host")
            elif 0 < msg.max_message_bytes < self.worker_message_bytes:  # it would cut off its own traffic
                reason = (f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} takes messages up to "
                          f"{msg.max_message_bytes} bytes, but this model's activations or schedules at "
                          f"--max-batched-tokens {self.cfg.max_batched_tokens} need {self.worker_message_bytes}: "
                          f"start it with --max-message-bytes {self.worker_message_bytes}")
            elif 0 < msg.max_activation_bytes < self.activation_bytes:  # (the previous stage's would be dropped)
                reason = (f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} takes activations up to "
                          f"{msg.max_activation_bytes} bytes, but a step of this model at --max-batched-tokens "
                          f"{self.cfg.max_batched_tokens} sends {self.activation_bytes}: start it with "
                          f"--max-activation-bytes {self.activation_bytes} (or without the flag)")
            elif (held := self._live_holder(identity, msg)) is not None:
                reason = held
            else:  # no keys: the previous stage would send its activations (users' hidden states) there
                try:
                    check_exposure(self.cfg.mesh_keys, self.cfg.insecure_mesh, warn=False,  # (the worker said so)
                                   data_address=msg.data_address)
                except ConfigError:
                    reason = (f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} listens on {msg.data_address}, "
                              f"not loopback, and the mesh has no keys (--mesh-keys, or --insecure-mesh)")
            if reason is not None:
                log.error("worker refused", extra={"fields": {"reason": reason}})
                await self._send_worker(identity, Shutdown(refused=reason))
                if reg.phase is Phase.REGISTERING and held is None:  # a misconfiguration: say so now, not at a timeout
                    self._fail(reason)
                return
            old = reg.workers.get((msg.pp_rank, msg.tp_rank))
            if old is not None and reg.phase in (Phase.SERVING, Phase.RECOVERING):
                # a worker registers again for its rank: it was restarted, the old one is gone
                self._lost(old, f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} registered again (restarted)")
            try:
                w = reg.register(identity, msg)
            except ProtocolError as e:  # (a rank outside the layout, or one registering late: told why)
                self.bad_worker(e, repr(identity))
                await self._send_worker(identity, Shutdown(refused=f"the coordinator at this address refused "
                                                                   f"it: {e}"))
                return
            log.info("worker registered", extra={"fields": {"pp_rank": w.pp_rank, "tp_rank": w.tp_rank,
                                                             "address": w.data_address, "pid": msg.pid}})
            return
        w = reg.get(identity)
        if w is None and _handed_over(identity):  # what a connection replaced by its own reconnection had queued
            log.debug("message on a replaced connection", extra={"fields": {"type": type(msg).__name__}})
            return
        if w is None and isinstance(msg, WorkerFailed):  # (a launcher's report for a worker already dropped)
            log.info("failure report for a worker no longer in the pipeline", extra={"fields": {
                "pp_rank": msg.pp_rank, "tp_rank": msg.tp_rank, "error": msg.error}})
            return
        if w is None:  # (well-formed, and usual around a recovery or a restart: not counted as malformed)
            log.info("message from a worker not in the pipeline, told to exit", extra={"fields": {
                "type": type(msg).__name__, "identity": repr(identity)}})
            # a worker this pipeline dropped (silent too long, a stage peer), or one registered with a
            # coordinator that died before this one: it exits, is started again and registers afresh
            # (not once the pipeline is down: nothing would take it, it would only restart in a loop)
            if reg.phase is not Phase.DOWN:
                await self._send_worker(identity, Shutdown(reason=(
                    "the pipeline does not hold this worker: dropped after a silence, its rank taken by a worker "
                    "that registered since, or registered with a coordinator that has restarted")))
            return
        reg.seen(w)
        if isinstance(msg, Heartbeat):
            w.busy_seconds, w.comm_seconds, w.sent_bytes = msg.busy_seconds, msg.comm_seconds, msg.sent_bytes
            w.refused, w.malformed, w.last_step = msg.refused, msg.malformed, msg.last_step
            w.received_step, w.heard_at = msg.received_step, time.monotonic()
            w.next_unreached = msg.next_unreached
            if msg.relinks > w.relinks:  # (the activations it had queued for the next stage are gone)
                w.relinks, w.relinked = msg.relinks, True
            if w.relinked and not msg.next_unreached:  # connected at last: resend what was dropped
                w.relinked, self._connected_late_at = False, time.monotonic()
            self._check_links()
            if w.tp_rank == 0:
                self.stage_spans[w.pp_rank].extend(msg.spans)
        elif isinstance(msg, Ready):
            if w.phase is not Phase.LOADING or not 1 <= msg.num_blocks <= MAX_KV_BLOCKS:
                self.bad_worker(ProtocolError(f"Ready with {msg.num_blocks} KV blocks from pp={w.pp_rank} "
                                              f"tp={w.tp_rank} while {w.phase.value}"), repr(identity))
                return
            if msg.model_config:
                try:
                    differ = self.model_config.differences(msg.model_config)
                except ConfigError as e:
                    self.bad_worker(ProtocolError(f"Ready from pp={w.pp_rank} tp={w.tp_rank}: {e}"), repr(identity))
                    return
                if differ:  # (its shapes would not meet the other stages', or its numbers would differ)
                    reason = (f"stage worker pp={w.pp_rank} tp={w.tp_rank} loaded a checkpoint whose config.json "
                              f"differs from the coordinator's ({'; '.join(differ[:4])}"
                              f"{'; ...' if len(differ) > 4 else ''}): every host needs the same model at --model "
                              f"{self.cfg.model}")
                    log.error("worker refused", extra={"fields": {"reason": reason}})
                    await self._send_worker(identity, Shutdown(refused=reason))
                    self._lost(w, reason)
                    return
            reg.ready(w, msg.num_blocks)
        elif isinstance(msg, StepResult):
            if w.rank != (self.cfg.pp - 1, 0):
                self.bad_worker(ProtocolError(f"step result from pp={w.pp_rank} tp={w.tp_rank}, not the "
                                              f"last stage's rank 0"), repr(identity))
                return
            await self._on_result(msg)
        elif isinstance(msg, WorkerFailed):
            self._lost(w, f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} failed: {msg.error}")

    def _live_holder(self, identity: bytes, msg: Register) -> str | None:
        """Why `msg` is refused where another process holds its rank and was heard from within
        LIVE_HOLDER seconds (two workers started for one rank would otherwise take it from each other
        at every restart); None where the rank is free, its holder silent, or the claim its own."""
        old = self.registry.workers.get((msg.pp_rank, msg.tp_rank))
        if old is None or old.identity == identity or self.registry.clock() - old.last_seen > LIVE_HOLDER:
            return None
        # (not the holder's identity: with it, a connection would take over the holder's route)
        return (f"stage worker pp={msg.pp_rank} tp={msg.tp_rank} (pid {msg.pid}) claims a rank whose worker "
                f"(pid {old.pid}, at {old.data_address}) is alive: is a second worker "
                f"started with --pp-rank {msg.pp_rank} --tp-rank {msg.tp_rank}? (a restarted worker is taken once "
                f"the old one has been silent {LIVE_HOLDER:g} s)")

    def _check_links(self) -> None:
        """Logs a link between stages that never connected (a wrong --advertise-host, a key the next
        stage's host does not allow) once it is named, and when it connects at last; the status names
        it meanwhile. Called on heartbeats and when workers are lost (theirs go with them)."""
        rank, unreached = self.registry.unreached(UNREACHED_AFTER)
        if unreached and not self.unreached:
            log.error("link between stages not connected", extra={"fields": {"reason": unreached}})
        elif self.unreached and not unreached and self._unreached_rank in self.registry.workers:
            log.info("link between stages connected", extra={"fields": {
                "pp_rank": self._unreached_rank[0], "tp_rank": self._unreached_rank[1]}})
        self.unreached, self._unreached_rank = unreached, rank

    async def _on_result(self, result: StepResult) -> None:
        if result.step_id in self.abandoned:  # computed before a worker was lost; recomputed since
            self.abandoned.discard(result.step_id)
            return
        if self.loop is None:
            self.bad_worker(ProtocolError(f"result for step {result.step_id}, which is not in flight"), "last stage")
            return
        try:
            outputs = self.loop.take(result)
        except ValueError as e:
            self.bad_worker(ProtocolError(str(e)), "last stage")
            return
        self.results_taken += 1
        self._results_at_reset = None  # progress: a later stall is reset again first
        self.issued.pop(result.step_id, None)
        await self.router.deliver(outputs)
        self.wake.set()

    async def _step_deadline(self) -> None:
        """A step in flight past --step-timeout while every worker heartbeats: an activation or a
        result lost on a connection that dropped and came back, or a stage stuck in its compute. The
        first time, the pipeline is reset (a new epoch, the survivors drop their queued work, every
        sequence recomputed, as in a recovery, but nobody replaced); if no step has finished since the
        last reset, the first stage behind the overdue step is replaced."""
        timeout = self.cfg.step_timeout
        tick = min(0.5, timeout / 4)
        while True:
            started = time.monotonic()
            await asyncio.sleep(tick)
            if self.failure:
                return
            if not self.serving:
                continue
            now = time.monotonic()
            late = now - started - tick
            if late > STALL:  # (as the watchdog: the stall was this process's own, not the steps' time)
                self._stalled_until = now + 2 * LOST_AFTER
                self.issued = {s: t + late for s, t in self.issued.items()}
            self.issued = {s: t for s, t in self.issued.items() if s in self.core.in_flight}
            overdue = [s for s, t in self.issued.items() if now - t > timeout]
            lost = self._lost_on_a_link(now)
            relinked = self._late_link(now) if lost is None else None
            if lost is not None:
                step, why = lost
            elif relinked is not None:
                step, why = relinked
            elif overdue:
                step = min(overdue)
                why = f"step {step} overdue ({timeout:g} s, --step-timeout)"
            else:
                continue
            # with tensor parallelism a reset could leave a stage's ranks one step apart in their
            # collectives (as _lost says): replace instead
            # (or the last reset did not help: but a late link's steps were lost, not stuck)
            if self.cfg.tp > 1 or (relinked is None and self._results_at_reset == self.results_taken):
                workers = sorted(self.registry.workers.values(), key=lambda w: w.rank)
                behind = [w for w in workers if w.last_step < step]
                if behind or (self.cfg.tp > 1 and workers):
                    w = (behind or workers)[0]
                    await self._send_worker(w.identity, Shutdown(reason=f"{why}: replaced"))
                    self._lost(w, f"{why} at stage worker pp={w.pp_rank} tp={w.tp_rank}")
                    continue
            await self._reset_pipeline(why)

    def _late_link(self, now: float) -> tuple[int, str] | None:
        """(step, why) when a link between stages that a worker made again after a refused handshake
        (which dropped what it had queued) connected at last, and a step sent before that is still in
        flight LOST_AFTER seconds later: its activations are gone."""
        at = self._connected_late_at
        if at is None or now - at < LOST_AFTER:
            return None
        self._connected_late_at = None
        before = [step for step, issued in self.issued.items() if issued < at]
        if not before:
            return None
        return min(before), "a link between stages connected after a refusal dropped steps sent on it"

    def _lost_on_a_link(self, now: float) -> tuple[int, str] | None:
        """(step, why) when a message was lost on a link that dropped and came back (ZeroMQ drops what
        was queued on it), which the step deadline would notice only after --step-timeout: a worker
        whose heartbeat came well after a schedule went out has not taken it, or the last stage
        computed the oldest step in flight LOST_AFTER seconds ago (its heartbeat says) and its result
        never came."""
        if not self.issued or now < self._stalled_until:  # (right after a stall of its own, nothing is known)
            self._computed_at.clear()
            return None
        for w in self.registry.workers.values():
            missed = [s for s, sent in self.issued.items() if w.received_step < s and w.heard_at - sent > LOST_AFTER]
            if missed:
                return min(missed), (f"the schedule of step {min(missed)} was lost on its link to stage worker "
                                     f"pp={w.pp_rank} tp={w.tp_rank}")
        oldest = min(self.issued)
        last = self.registry.workers.get((self.cfg.pp - 1, 0))
        self._computed_at = {s: t for s, t in self._computed_at.items() if s in self.issued}
        if last is None or last.last_step < oldest:
            return None
        seen = self._computed_at.setdefault(oldest, now)
        if now - seen < LOST_AFTER:
            return None
        return oldest, f"the result of step {oldest} was lost on its link (computed {now - seen:.1f} s ago)"

    async def _reset_pipeline(self, reason: str) -> None:
        """Every worker drops the steps not yet run; every unfinished sequence is recomputed."""
        reg = self.registry
        reg.epoch += 1
        log.warning("pipeline reset", extra={"fields": {"reason": reason, "epoch": reg.epoch}})
        self.step_resets += 1
        self._results_at_reset = self.results_taken
        self._requeue_all()
        self.issued.clear()
        self._resetting = True  # nothing new goes out before every worker has the Reset
        try:
            reg.first_step = self.core.next_step_id
            await self._broadcast(Reset(reg.epoch, reg.first_step))
        finally:
            self._resetting = False
        self.wake.set()

    async def _watchdog(self) -> None:
        """Sleeps until the earliest worker could count as silent, then checks."""
        timeout = self.cfg.worker_timeout
        while True:
            planned = max(0.05, self.registry.next_silence(timeout))
            started = time.monotonic()
            await asyncio.sleep(planned)
            if self.failure:
                return  # down for good
            now = time.monotonic()
            late = now - started - planned
            if late > STALL:  # this process did not run (stopped, starved of CPU): that silence was its own
                log.warning("coordinator stalled", extra={"fields": {"seconds": round(late, 1)}})
                self._stalled_until = now + 2 * LOST_AFTER  # (and what it reads first may be from before it)
                for w in self.registry.workers.values():
                    w.last_seen = min(now, w.last_seen + late)
            w = self.registry.silent(timeout)
            if w is not None:
                self._lost(w, f"stage worker pp={w.pp_rank} tp={w.tp_rank} stopped responding "
                              f"(no heartbeat for {time.monotonic() - w.last_seen:.1f} s)")

    async def _ping(self) -> None:
        """Tells every registered worker, twice a second, that this coordinator is alive (a worker
        that stops hearing it exits to be started again, and registers with the one that answers)."""
        while True:
            await asyncio.sleep(0.5)
            await self._broadcast(Ping(self.registry.epoch, self.registry.first_step))

    async def _send_worker(self, identity: bytes, msg) -> None:
        await self.workers_sock.send_multipart([identity, *Codec.encode(msg)], copy=False)

    async def _broadcast(self, msg, only: Phase | None = None) -> None:
        frames = Codec.encode(msg)
        for w in list(self.registry.workers.values()):
            if only is None or w.phase is only:
                await self.workers_sock.send_multipart([w.identity, *frames], copy=False)

    # -- scheduling ---------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.serving and not self._resetting:
                for sched in self.loop.issue():
                    self.issued[sched.step_id] = time.monotonic()
                    await self.pipeline.send(sched)
                    if not self.serving or self._resetting:  # (a send that waited: a loss or reset came meanwhile,
                        break  # and put the sequences back; the next schedule waits for the pipeline again)
                # (a request the pool can never hold gets past the checks: a bug; not a queue a loss or reset
                # just refilled while a send waited)
                if self.serving and not self._resetting and self.loop.stalled():
                    seq = (self.core.scheduler.waiting or self.core.scheduler.running)[0]
                    log.error("no step can be scheduled; ending the oldest waiting request", extra={"fields": {
                        "request_id": seq.request_id, "tokens": seq.num_tokens, "max_tokens": seq.params.max_tokens,
                        "blocks": self.core.blocks.num_blocks}})
                    out = self.core.abort(seq.request_id, "error", "internal error: the KV cache cannot take "
                                                                   "this request")
                    if out is not None:
                        await self.router.deliver([out])
                        self.wake.set()

    # -- clients ------------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            identity, *frames = await receive(self.clients_sock)
            identity = identity.bytes
            try:
                msg, _ = self.client_codec.decode(frames)
            except ProtocolError as e:
                self.bad_client(e, identity.hex())
                request_id = _generate_request_id(frames[0])  # a request that fails validation still gets an answer
                if request_id is not None:
                    await self.router.reply(identity, RequestOutput(request_id, [], finish_reason="error",
                                                                    error=f"invalid request: {e}", error_status=400))
                continue
            try:
                await self._on_client(identity, msg)
            except Exception as e:  # a bug in handling one request fails that request, not the coordinator
                log.error("client message failed", exc_info=True)
                if isinstance(msg, GenerateRequest):
                    await self.router.refuse(identity, msg, f"internal error: {type(e).__name__}: {e}", 500)

    async def _on_client(self, identity: bytes, msg) -> None:
        if isinstance(msg, GenerateRequest):
            if self.failure:
                await self.router.refuse(identity, msg, f"pipeline is down: {self.failure}", 503)
            elif self.stopping:
                await self.router.refuse(identity, msg, f"{STOPPING}; retry shortly", 503)
            elif (queued := self.queued()) >= self.cfg.max_waiting:
                await self.router.refuse(identity, msg, f"{queued} requests are waiting to be scheduled "
                                                        f"(--max-waiting); retry shortly", 429)
            elif self.core is None:  # not serving yet: held until it does
                self.router.hold(identity, msg)
            else:  # serving, or recovering (it waits in the queue like the requests put back)
                await self._add(identity, msg)
        elif isinstance(msg, AbortRequest):
            await self._abort(identity, msg.request_id)
        elif isinstance(msg, StatusRequest):
            await self.router.reply(identity, self.status(msg.timeline, msg.nonce))
        elif isinstance(msg, ResendRequest):
            await self._resend(identity, msg)

    async def _resend(self, identity: bytes, msg: ResendRequest) -> None:
        """A client missed outputs (its link dropped while they were queued for it): they come again, or
        the request ends with an error when it is no longer known here. A request still held (not
        serving yet) has nothing to resend."""
        if any((i, r.request_id) == (identity, msg.request_id) for i, r in self.router.held):
            return
        key = self.router.key(identity, msg.request_id)
        out = self.core.resend(key, msg.start) if self.core is not None else None
        if out is not None:
            await self.router.reply(identity, msgspec.structs.replace(out, request_id=msg.request_id))
        elif self.core is None or key not in self.core.requests:  # (a live one with nothing new: no answer)
            # (a request that never arrived, lost on a link that dropped, is sent again by a client that has
            # had none of its tokens: a 404 here says so; a client that has some ends the stream with a 503)
            await self.router.reply(identity, RequestOutput(
                msg.request_id, [], finish_reason="error", error_status=UNKNOWN_REQUEST, start=msg.start,
                error="the request's outputs were lost on the link to the coordinator (it dropped, or the "
                      "coordinator was restarted) and it is no longer known there; retry it"))

    async def _add(self, identity: bytes, req: GenerateRequest) -> None:
        try:
            self.core.add(self.router.key(identity, req.request_id), req.prompt_ids, req.params)
        except ValueError as e:
            await self.router.refuse(identity, req, str(e), 400)
            return
        self.router.own(identity, req.request_id)
        self.wake.set()

    async def _abort(self, identity: bytes, request_id: str) -> None:
        """Every abort is answered with an end ("abort"), also for a request held, unknown or over: the
        client uses the id again only after it (moemesh.client)."""
        self.router.forget_held(identity, request_id)
        if self.core is not None and (out := self.core.abort(self.router.key(identity, request_id))) is not None:
            await self.router.deliver([out])
            self.wake.set()
        else:
            await self.router.reply(identity, RequestOutput(request_id, [], finish_reason="abort", start=-1))

    def waiting(self) -> int:
        """Requests not yet scheduled: queued in the core, or held until the pipeline serves."""
        return (len(self.core.scheduler.waiting) if self.core else 0) + len(self.router.held)

    def queued(self) -> int:
        """What --max-waiting bounds: requests never scheduled. Those a recovery or a preemption put back
        in the queue are not counted: they were admitted, and a recovery must not turn new requests
        away (docs/reliability.md: queued, not refused). (Counted one by one only at the bound.)"""
        n = self.waiting()
        if n < self.cfg.max_waiting or self.core is None:
            return n
        return sum(1 for seq in self.core.scheduler.waiting if seq.first_scheduled is None) + len(self.router.held)

    def status(self, timeline: bool = False, nonce: int = 0) -> StatusReply:
        core, loop, reg = self.core, self.loop, self.registry
        return StatusReply(
            nonce=nonce, protocol=PROTOCOL_VERSION,
            stage_spans=[list(d) for d in self.stage_spans] if timeline else [],
            coordinator_spans=list(loop.spans) if timeline and loop else [],
            serving=self.serving and not self.stopping, num_blocks=core.blocks.num_blocks if core else 0,
            num_free_blocks=core.blocks.num_free if core else 0,
            num_running=len(core.scheduler.running) if core else 0,
            num_waiting=self.waiting(),
            num_preemptions=core.scheduler.num_preemptions if core else 0,
            spec_drafts=core.scheduler.num_drafts if core else 0,
            spec_draft_tokens=core.scheduler.num_drafted if core else 0,
            spec_accepted_tokens=core.scheduler.num_accepted if core else 0,
            stage_busy_seconds=reg.stage_rank0("busy_seconds"), stage_comm_seconds=reg.stage_rank0("comm_seconds"),
            stage_sent_bytes=reg.stage_rank0("sent_bytes"), uptime_seconds=time.monotonic() - self.started,
            instance=self.instance, workers_replaced=self.workers_replaced, step_resets=self.step_resets,
            malformed_messages=self.bad_worker.count + self.bad_client.count + reg.malformed_gone
            + sum(w.malformed for w in reg.workers.values()), model=self.cfg.model,
            max_model_len=core.scheduler.config.max_model_len if core else 0, failure=self.failure,
            steps=loop.steps if loop else 0, mlp_handoff_steps=core.handoff_steps if core else 0,
            coordinator_step_seconds=(loop.step_seconds if loop else 0.0) + self.pipeline.encode_seconds,
            schedule_bytes=self.pipeline.schedule_bytes,
            phase="stopping" if self.stopping and not self.failure else reg.phase.value,
            recoveries=self.recoveries,
            recovery_seconds=self.recovery_seconds + (time.monotonic() - self._recovery_started
                                                      if reg.phase is Phase.RECOVERING else 0.0),
            requests_resumed=self.requests_resumed, tokens_recomputed=self.tokens_recomputed,
            prefix_cache_queries=core.blocks.queries if core else 0, prefix_cache_hits=core.blocks.hits if core else 0,
            mesh_refused=self.guard.refused + sum(w.refused for w in reg.workers.values()) + reg.refused_gone,
            max_waiting=self.cfg.max_waiting, unreached=self.unreached)


def _handed_over(identity: bytes) -> bool:
    """Whether a ROUTER identity is the one libzmq gives a connection that its peer's reconnection took
    over (ROUTER_HANDOVER): a zero byte and four more, which no worker's own identity looks like (a
    worker sets its own; a client need not, so on the client socket the two cannot be told apart)."""
    return len(identity) == 5 and identity[0] == 0


def _generate_request_id(header) -> str | None:
    """The request id of a generate request that did not validate, if its header says that much."""
    try:
        raw = msgspec.msgpack.decode(header.buffer if hasattr(header, "buffer") else header)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None
    if isinstance(raw, dict) and raw.get("type") == "generate" and isinstance(raw.get("request_id"), str):
        return raw["request_id"][:MAX_REQUEST_ID]
    return None
