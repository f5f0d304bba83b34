"""A stage worker process: one (pipeline rank, tensor rank) of the mesh.

    register with the coordinator -> assignment (model, layers, next stage's address)
    load only those layers, allocate the KV cache -> ready (block count) -> start
    for each schedule, in order: [receive the previous stage's activations] -> forward ->
        send activations to the next stage, or (last stage, tensor rank 0) the sampled tokens

All sockets live on one asyncio event loop; the forward pass runs on a dedicated compute thread.
So while step k computes, the loop keeps receiving schedules and activations and heartbeating,
and the moment step k's activations are handed to ZeroMQ (its I/O thread sends them) the compute
thread starts step k + 1. Activations below COPY_BELOW bytes (a decode step's, for most models) are
copied into the message: pyzmq's zero-copy send has a thread of its own release each buffer once
sent, a wake-up and a turn at the GIL per step that costs more than the copy.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq
import zmq.asyncio

from moemesh.config import ModelConfig, resolve_dtype
from moemesh.errors import ConfigError
from moemesh.log import get_logger
from moemesh.mesh_security import MeshGuard, check_exposure
from moemesh.netutil import BadMessages, LinkState, bind, connect, receive, set_heartbeats, url_host
from moemesh.protocol import (PROTOCOL_VERSION, WORKER_TOKEN, Activations, Assignment, Codec, CoordinatorMessage, Heartbeat,
                              ProtocolError, Ping, Ready, Register, Repoint, Reset, Schedule, Shutdown, Start,
                              WorkerFailed, worker_identity)
from moemesh.settings import WorkerSettings
from moemesh_kernels.memory import use_huge_pages
from stage_worker.executor import StageExecutor
from stage_worker.layers.fp8 import resolve_quantization
from stage_worker.layers.parallel import TPGroup
from stage_worker.runner import StageRunner
from stage_worker.tensors import frames_of, from_frame, torch_dtype

log = get_logger("stage_worker")

COPY_BELOW = 4 << 20  # activations of fewer bytes are copied into their message, larger ones sent zero-copy
# seconds after a refused handshake on the link to the next stage, or to the coordinator before it
# answered, before the link is made again (libzmq does not try a refused handshake again: a worker key
# added to that host's allowed set late, in a rotation)
RELINK_AFTER = 2.0
EARLY_ACTIVATIONS = 16  # activations held beyond the schedules queued here (see StageWorker._keep_activations)
CANDIDATES = 2  # residual streams held for one step (the first that fits it is taken)
ACTIVATION_QUEUE = 2 * EARLY_ACTIVATIONS  # activations messages libzmq queues per connection before they are read


def advertised_host(host: str, coordinator: str) -> str:
    """The address other workers reach this one at, given none (--advertise-host): --host, or for a
    wildcard (0.0.0.0, ::, *) this host's address on the route to the coordinator, which the other
    stages reach it by too (a wildcard itself would send each of them to its own machine)."""
    if host not in ("0.0.0.0", "::", "[::]", "*", ""):
        return url_host(host)
    target = coordinator.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    # (an IPv4 wildcard listens on IPv4 only, `netutil.bind`: its address is an IPv4 one; :: is dual-stack)
    ipv4_only = ":" not in host
    try:
        family = socket.getaddrinfo(target, None, socket.AF_INET if ipv4_only else 0, socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # (a UDP connect sends nothing: it picks a route)
            probe.connect((target, 9))
            local = probe.getsockname()[0]
    except OSError:
        return "127.0.0.1" if ipv4_only else "[::1]"
    return f"[{local}]" if ":" in local else local


def received_stream(codec: Codec, frames) -> tuple[int, torch.Tensor]:
    """(step id, the residual stream) of an activations message from the previous stage: exactly one
    tensor (a view of its frame, no copy); ProtocolError for anything else."""
    msg, buffers = codec.decode(frames)
    if len(buffers) != 1:
        raise ProtocolError(f"activations carry {len(buffers)} tensors, expected 1 (the residual stream)")
    if len(msg.tensors[0].shape) != 2:
        raise ProtocolError(f"activations of {len(msg.tensors[0].shape)} dimensions, expected 2 (tokens, hidden)")
    try:
        return msg.step_id, from_frame(msg.tensors[0], buffers[0])
    except ProtocolError:
        raise
    except Exception as e:  # (one malformed message, never the end of the receive loop)
        raise ProtocolError(f"activations that make no tensor: {type(e).__name__}") from None


class StageWorker:
    def __init__(self, cfg: WorkerSettings):
        self.cfg = cfg
        use_huge_pages(not cfg.no_huge_pages)
        check_exposure(cfg.mesh_keys, cfg.insecure_mesh, host=cfg.host, coordinator=cfg.coordinator)
        self.ctx = zmq.asyncio.Context()
        self.guard = MeshGuard(self.ctx, cfg.mesh_keys)
        self.identity: bytes | None = None  # this process's on the coordinator's link (_control_socket)
        self.ctrl = self._control_socket()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        # (a step's activations at most; and few queued, unread before Start: a peer with the key can make
        # this process hold ACTIVATION_QUEUE of them per connection, not a thousand of the schedule's size)
        self.pull.setsockopt(zmq.MAXMSGSIZE, cfg.max_activation_bytes or cfg.max_message_bytes)
        self.pull.setsockopt(zmq.RCVHWM, ACTIVATION_QUEUE)
        self.registration: Register | None = None  # sent again with the control link, if it is made again
        self.ctrl_link: LinkState | None = None  # whether the coordinator's host took the handshake (until it did)
        self.reregistrations = 0  # control links made again after a refused handshake
        self.push: zmq.asyncio.Socket | None = None
        self.link: LinkState | None = None  # whether `push` has ever connected (heartbeats say)
        self.relinks = 0  # times `push` was made again after a refused handshake
        self.codec = Codec(CoordinatorMessage)
        self.act_codec = Codec(Activations)
        self.bad = BadMessages(log, "worker")
        self.schedules: asyncio.Queue = asyncio.Queue()
        # the previous stage's residual streams by step, until their step's turn (bounded: _keep_activations)
        # each step's residual streams as they came (at most CANDIDATES: the first that fits the step is taken)
        self.arrived: dict[int, list[torch.Tensor]] = {}
        self.arrival = asyncio.Event()  # set when one comes
        self.last_heard: float | None = None  # when the coordinator last sent anything
        self.next_address: str | None = None  # the next stage's worker of this tensor rank
        # torch's thread count is per calling thread under OpenMP: set it where the compute runs
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="compute",
                                          initializer=torch.set_num_threads, initargs=(cfg.threads or 1,))
        self.executor: StageExecutor | None = None
        self.stopping = asyncio.Event()
        self.refused = ""  # why the coordinator refused this worker's registration, if it did
        self.recorder = None
        self.sent_bytes = 0
        self.last_step = -1  # the last step computed (heartbeats report it)
        self.epoch = 0  # the pipeline's epoch this worker has reset to
        self.current_step = -1  # the step the stepper works on (or last took)
        # the step id the next schedule must have (None: any, until the first): every worker gets
        # every schedule, in order; a gap means one was lost with a connection, and the state the
        # later ones build on (block tables, K/V) is incomplete
        self.next_schedule: int | None = None
        self.schedule_gap = False  # one was lost: run nothing more until the next reset
        self.stepper: asyncio.Task | None = None  # runs the steps, once serving
        if cfg.record:
            from stage_worker.standalone import Recorder

            self.recorder = Recorder(cfg.record, cfg.record_steps)

    def _control_socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        # one identity per process: a replacement never takes over the identity of the one it replaces;
        # and one nobody else can guess (the coordinator lets a reconnection with it take over its route)
        if self.identity is None:
            token = os.environ.pop(WORKER_TOKEN, "") or secrets.token_hex(16)
            self.identity = worker_identity(self.cfg.pp_rank, self.cfg.tp_rank, os.getpid(), token)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        set_heartbeats(sock)
        # more than the largest schedule or activations: cut off
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        return sock

    def _connect_control(self) -> None:
        self.guard.connect(self.ctrl, "worker")
        self.ctrl_link = LinkState(self.ctrl)
        connect(self.ctrl, self.cfg.coordinator)  # zmq keeps retrying until the coordinator is up

    async def run(self) -> int:
        cfg = self.cfg
        torch.set_num_threads(cfg.threads or 1)
        self.guard.serve(self.pull, "workers")
        try:
            port = bind(self.pull, cfg.host, cfg.port)
        except OSError:  # (its sockets closed: a context left open would block whoever collects it)
            self.compute.shutdown(wait=False)
            self.guard.close()
            self.ctx.destroy(linger=0)
            raise
        host = url_host(cfg.advertise_host) if cfg.advertise_host else advertised_host(cfg.host, cfg.coordinator)
        address = f"tcp://{host}:{port}"
        # a stage's ranks share a host: their process group meets on loopback (it has no authentication
        # of its own; docs/security.md says what else to firewall)
        rendezvous = f"tcp://127.0.0.1:{_free_port('127.0.0.1')}"
        self._connect_control()
        self.registration = Register(cfg.pp_rank, cfg.tp_rank, address, cfg.device, os.getpid(), rendezvous,
                                     cfg.max_message_bytes, PROTOCOL_VERSION, cfg.max_activation_bytes)
        await self._send(self.registration)
        log.info("registering", extra={"fields": {"coordinator": cfg.coordinator, "address": address}})
        heartbeat = asyncio.ensure_future(self._heartbeat())  # alive while waiting for the others, too
        watch = asyncio.ensure_future(self._watch_coordinator())
        life = asyncio.ensure_future(self._life())
        try:
            await asyncio.wait([life, watch], return_when=asyncio.FIRST_COMPLETED)
            if life.done():
                return life.result()
            life.cancel()
            return 3  # the coordinator went silent: to be started again
        except Exception as e:
            if _peer_lost(e):  # a tensor-parallel peer died mid-collective: its loss, not this worker's bug
                log.warning("tensor-parallel peer lost", extra={"fields": {"error": str(e).splitlines()[0][:300]}})
                reason = f"a tensor-parallel peer of stage {cfg.pp_rank} was lost ({type(e).__name__})"
            elif isinstance(e, ConfigError):  # (what to change, said in one line: no traceback)
                log.error("stage worker failed", extra={"fields": {"error": str(e)}})
                reason = str(e)
            else:
                log.error("stage worker failed", exc_info=True)
                reason = f"{type(e).__name__}: {e}"
            await self._send(WorkerFailed(cfg.pp_rank, cfg.tp_rank, reason))
            await asyncio.sleep(0.1)  # let the message leave
            return 1
        finally:
            heartbeat.cancel()
            watch.cancel()
            self.compute.shutdown(wait=False, cancel_futures=True)
            self.guard.close()
            self.ctx.destroy(linger=0)
            if dist.is_initialized():  # (a collective stuck on a lost peer must not hold the exit)
                closer = threading.Thread(target=dist.destroy_process_group, daemon=True)
                closer.start()
                closer.join(timeout=5)

    async def _life(self) -> int:
        """Assignment -> load -> Ready -> Start -> serving, until Shutdown."""
        cfg = self.cfg
        notice = asyncio.ensure_future(self._while_unassigned())
        try:
            assignment = await self._expect(Assignment)
        finally:
            notice.cancel()
        if assignment is None:
            return 2 if self.refused else 0
        # the control link stays read while loading: a Repoint is applied, a Shutdown (a tensor-parallel
        # peer was lost: this stage starts over) stops the load at once
        load = asyncio.ensure_future(self._load(assignment))
        start = asyncio.ensure_future(self._expect(Start))
        await asyncio.wait([load, start], return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            load.cancel()
            return 0 if start.result() is None else 1  # (Start before Ready cannot come)
        if load.exception() is not None:
            start.cancel()
            raise load.exception()
        num_blocks, loaded = load.result()
        await self._send(Ready(cfg.pp_rank, cfg.tp_rank, num_blocks, loaded.to_json()))
        if await start is None:
            return 0
        start = start.result()
        self.epoch = max(self.epoch, start.epoch)
        log.info("serving", extra={"fields": {"blocks": start.num_blocks, "epoch": self.epoch}})
        self.stepper = asyncio.ensure_future(self._steps())
        tasks = [asyncio.ensure_future(c) for c in (self._recv_ctrl(), self._recv_activations())]
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            while True:
                done, _ = await asyncio.wait([*tasks, self.stepper, stop], return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not stop and not t.cancelled() and t.exception():
                        raise t.exception()
                if stop in done or any(t in done for t in tasks):
                    return 0
                if self.stepper.done():  # cancelled (a send on a socket that Repoint closed): go on
                    self.stepper = asyncio.ensure_future(self._steps())
        finally:
            for t in (*tasks, self.stepper, stop):
                t.cancel()

    async def _while_unassigned(self, every: float = 30.0) -> None:
        """Says, every half minute, that no layers came yet: from a coordinator that never answered, it
        may not be up at that address (ZeroMQ keeps trying); from one that did, it assigns them once
        every rank of its layout has registered, and refuses (in its own log) a rank outside that
        layout. A handshake the coordinator's host refused (this worker's key not yet among its allowed
        ones) is made again RELINK_AFTER seconds later, and the registration sent again: the key may be
        added while this worker waits."""
        waited, warned = 0.0, 0.0
        tick = min(every, RELINK_AFTER / 4)
        while True:
            await asyncio.sleep(tick)
            waited += tick
            await self._register_again_if_refused()
            if waited - warned < every:
                continue
            warned = waited
            if self.last_heard is None:
                hint = "no answer from the coordinator yet: is it up, at this address (--coordinator)?"
                if self.cfg.mesh_keys:  # (a handshake the coordinator refuses looks the same from here)
                    hint += (" Or are --mesh-keys not the coordinator's (copied from the directory `moemesh keys` "
                             "made)? Its log then says 'mesh handshake refused'")
            else:
                hint = ("the other ranks may not have registered yet, or this rank is outside the coordinator's "
                        "--pp/--tp (its log says so)")
            log.warning("no layers assigned yet", extra={"fields": {
                "coordinator": self.cfg.coordinator, "pp_rank": self.cfg.pp_rank, "tp_rank": self.cfg.tp_rank,
                "seconds": round(waited), "hint": hint}})

    async def _register_again_if_refused(self) -> None:
        if self.ctrl_link is None or self.ctrl_link.refused_for() < RELINK_AFTER:
            return
        self.reregistrations += 1
        if self.reregistrations <= 3 or self.reregistrations % 12 == 0:  # (then every half minute or so)
            log.warning("the coordinator's host refused the handshake, connecting again", extra={"fields": {
                "coordinator": self.cfg.coordinator, "attempts": self.reregistrations,
                "hint": "the coordinator's host must allow this worker's key (its --mesh-keys workers/ directory)"}})
        # a fresh socket (as the next stage's link): sends and receives waiting on the refused one move to
        # it (`_send`, `_recv_one`), after the registration, which goes first
        refused, self.ctrl = self.ctrl, self._control_socket()
        self.ctrl_link.close()
        self._connect_control()
        refused.close(linger=0)
        await self._send(self.registration)

    async def _load(self, a: Assignment) -> tuple[int, ModelConfig]:
        """Loads the assigned layers: (KV blocks, the config of the checkpoint found at the model path)."""
        cfg = self.cfg
        mc = ModelConfig.from_dir(a.model)
        dtype = torch_dtype(resolve_dtype(a.dtype, mc, cfg.device))
        layers = range(a.layer_start, a.layer_end)
        per_block = StageRunner.kv_bytes_per_block(mc, len(layers), a.block_size, TPGroup(cfg.tp_rank, a.tp_size),
                                                   dtype)
        num_blocks = cfg.kv_blocks(per_block)  # the same rule as the in-process engine

        def build():
            group = None
            if a.tp_size > 1:  # the stage's ranks meet at tp rank 0's rendezvous (gloo on CPU, NCCL on CUDA)
                backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback too
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # (NCCL's bootstrap; its data goes over NVLink/PCIe)
                dist.init_process_group(backend, init_method=a.tp_rendezvous, world_size=a.tp_size,
                                        rank=cfg.tp_rank, timeout=timedelta(seconds=600))
                group = dist.group.WORLD
            tp = TPGroup(cfg.tp_rank, a.tp_size, group, a.expert_parallel)
            runner = StageRunner(a.model, mc, layers, num_blocks, a.block_size, tp=tp, dtype=dtype,
                                 device=cfg.device, progress=False, quant=resolve_quantization(mc, a.quantization),
                                 moe_backend=a.moe_backend, handoff=a.mlp_handoff)
            return StageExecutor(runner, mc.eos_token_ids)

        started = time.perf_counter()
        self.executor = await asyncio.get_running_loop().run_in_executor(self.compute, build)
        if self.recorder is not None:  # (a replay computes as this stage does)
            self.recorder.describe(model=a.model, layers=[a.layer_start, a.layer_end], dtype=str(dtype).split(".")[-1],
                                   quantization=a.quantization, moe_backend=a.moe_backend, block_size=a.block_size,
                                   mlp_handoff=a.mlp_handoff)
        log.info("loaded", extra={"fields": {"layers": f"{a.layer_start}:{a.layer_end}", "blocks": num_blocks,
                                             "bytes": self.executor.runner.load_stats.bytes_read,
                                             "seconds": round(time.perf_counter() - started, 2)}})
        if self.next_address is None:
            self.next_address = a.next_address
        if self.next_address is not None:  # (a Repoint during the load wins over the assignment)
            self._connect_next(self.next_address)
        return num_blocks, mc

    def _reset(self, epoch: int, first_step: int, in_order: bool = True) -> None:
        """A new epoch: drops the steps below `first_step` not yet run and the activations waiting
        for them (activations of the new epoch that came before the Reset stay), and the block table
        and sampling state of every sequence admitted before `first_step` (each of the epoch's
        sequences is admitted afresh, with its whole table, at or after it); a step computing now
        finishes, and its output is not sent. (A worker that missed the Reset learns the epoch from
        the next Ping or schedule, before it runs any step of the epoch, so the late branch below is
        a guard: it lets a step of the new epoch finish and keeps what such steps admitted.)"""
        self.epoch = epoch
        # the epoch's schedules run from first_step on (past any the guarded late case already took)
        self.next_schedule = max(first_step, self.next_schedule or 0)
        self.schedule_gap = False
        # on the compute thread, after the step it may be running (which reads that state)
        asyncio.get_running_loop().run_in_executor(self.compute, self.executor.reset, first_step)
        if self.current_step >= first_step:  # (late: it already runs the new epoch's steps; let it)
            self._drop_older(first_step)
            log.info("reset", extra={"fields": {"epoch": epoch, "first_step": first_step, "late": True}})
            return
        self.stepper.cancel()  # it may wait for activations from a stage that is gone, or on a full socket
        self._drop_older(first_step)
        self.stepper = asyncio.ensure_future(self._steps())
        log.info("reset", extra={"fields": {"epoch": epoch, "first_step": first_step, "late": not in_order}})

    def _drop_older(self, first_step: int) -> None:
        """Drops the queued schedules and activations of steps below `first_step`."""
        kept = []
        while not self.schedules.empty():
            sched = self.schedules.get_nowait()
            if sched.step_id >= first_step:
                kept.append(sched)
        for sched in kept:
            self.schedules.put_nowait(sched)
        self.arrived = {s: t for s, t in self.arrived.items() if s >= first_step}

    def _connect_next(self, address: str, since: float | None = None) -> None:
        """`since`: when the link began connecting (made again after a refusal, it is the same link)."""
        if self.push is not None:
            self.link.close()
            self.push.close(linger=0)  # whatever it still held was for the lost worker, or never left
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.copy_threshold = COPY_BELOW  # (pyzmq copies a copy=False frame below it)
        self.push.setsockopt(zmq.LINGER, 0)
        set_heartbeats(self.push)
        self.guard.connect(self.push, "worker")
        self.link = LinkState(self.push, since)
        connect(self.push, address)

    async def _send(self, msg) -> None:
        while True:
            sock = self.ctrl
            try:
                return await sock.send_multipart(Codec.encode(msg), copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):  # (ENOTSOCK: closed between two tries)
                if not self._replaced(sock):
                    raise

    def _replaced(self, sock: zmq.asyncio.Socket) -> bool:
        """Whether a wait on the control socket `sock` ended because a refused link was made again
        (closing a socket cancels what waits on it, or fails the next try), not because the waiting
        task was cancelled."""
        return sock is not self.ctrl and not asyncio.current_task().cancelling()

    async def _expect(self, kind):
        """Waits for a control message of one kind (others before it are malformed here); None when
        the coordinator says Shutdown instead."""
        while True:
            msg = await self._recv_one()
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, Shutdown):
                if msg.refused:  # (its registration: a rank outside the layout, another version, ...)
                    log.error("refused by the coordinator", extra={"fields": {"reason": msg.refused}})
                    self.refused = msg.refused
                elif msg.reason:
                    log.warning("told to stop by the coordinator", extra={"fields": {"reason": msg.reason}})
                return None  # told to stop before serving
            if isinstance(msg, Repoint):  # the next stage was replaced while this one was starting
                self.next_address = msg.next_address
                if self.push is not None:  # (already connected to the one that is gone)
                    self._connect_next(msg.next_address)
                continue
            if isinstance(msg, Reset):  # nothing to drop yet
                self.epoch = max(self.epoch, msg.epoch)
                continue
            self.bad(ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}"), "coordinator")

    async def _recv_one(self):
        while True:
            sock = self.ctrl
            try:
                frames = await receive(sock)
            except (asyncio.CancelledError, zmq.ZMQError):  # (ENOTSOCK: closed between two tries)
                if not self._replaced(sock):
                    raise
                continue
            try:
                msg = self.codec.decode(frames)[0]
            except ProtocolError as e:
                self.bad(e, "coordinator")
                continue
            self.last_heard = time.monotonic()
            if not isinstance(msg, Ping):
                return msg
            if msg.epoch > self.epoch:  # an epoch this worker missed the Reset of
                if self.stepper is not None:
                    self._reset(msg.epoch, msg.first_step, in_order=False)
                else:  # (not serving yet: a replacement joining the current epoch)
                    self.epoch = msg.epoch

    async def _watch_coordinator(self) -> None:
        """Once the coordinator has spoken, a silence of --coordinator-timeout means it is gone (or
        no longer counts this worker in): exit, to be started again and register afresh."""
        timeout = self.cfg.coordinator_timeout
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            if self.last_heard is not None and time.monotonic() - self.last_heard > timeout:
                log.error("coordinator silent, exiting to register again",
                          extra={"fields": {"seconds": round(time.monotonic() - self.last_heard, 1)}})
                return

    async def _recv_ctrl(self) -> None:
        while True:
            msg = await self._recv_one()
            if isinstance(msg, Schedule):
                if msg.epoch > self.epoch:  # its epoch's Reset was lost (a dropped connection)
                    self._reset(msg.epoch, msg.first_step, in_order=False)
                # (a worker's first schedule is its epoch's first: a new or replacement worker misses one too)
                expected = msg.first_step if self.next_schedule is None else self.next_schedule
                if msg.step_id != expected and not self.schedule_gap:
                    # a schedule was lost: the pipeline's step deadline will reset it (its step never
                    # comes back); computing the later ones on incomplete state would be wrong
                    self.schedule_gap = True
                    log.warning("schedule lost, waiting for a reset",
                                extra={"fields": {"expected": expected, "got": msg.step_id}})
                if self.schedule_gap:
                    continue
                self.next_schedule = msg.step_id + 1
                self.schedules.put_nowait(msg)
            elif isinstance(msg, Reset):
                if msg.epoch > self.epoch:
                    self._reset(msg.epoch, msg.first_step)
            elif isinstance(msg, Repoint):
                self.next_address = msg.next_address
                self._connect_next(msg.next_address)
                log.info("next stage replaced", extra={"fields": {"address": msg.next_address}})
            elif isinstance(msg, Shutdown):
                if msg.reason or msg.refused:
                    log.warning("told to stop by the coordinator", extra={"fields": {
                        "reason": msg.reason or msg.refused}})
                self.stopping.set()
                return
            else:
                self.bad(ProtocolError(f"unexpected {type(msg).__name__} while serving"), "coordinator")

    async def _recv_activations(self) -> None:
        while True:
            frames = await receive(self.pull)
            try:
                step_id, stream = received_stream(self.act_codec, frames)
            except ProtocolError as e:
                self.bad(e, "previous stage")
                continue
            self._keep_activations(step_id, stream)

    def _keep_activations(self, step_id: int, stream: torch.Tensor) -> None:
        """Holds a step's residual stream until its turn. The previous stage sends its steps in order, at
        most a microbatch or two ahead of this stage: activations of a step this stage has passed are
        stale (a reset dropped it), and only so many wait at once (the schedules queued here, plus
        EARLY_ACTIVATIONS for those whose schedule has not come yet). Past that the furthest step is
        dropped, so a bad peer cannot fill this worker's memory; both count as malformed. A second
        stream for a step waits beside the first (one that does not fit the step must not have
        replaced one that does); past CANDIDATES a step's next are dropped."""
        if step_id < self.current_step:
            self.bad(ProtocolError(f"stale activations of step {step_id}"), "previous stage")
            return
        for passed in [s for s in self.arrived if s < self.current_step]:  # (a step's duplicate, never taken)
            del self.arrived[passed]
        held = self.arrived.setdefault(step_id, [])
        if len(held) >= CANDIDATES:
            self.bad(ProtocolError(f"activations of step {step_id} came {CANDIDATES + 1} times: dropped"),
                     "previous stage")
            return
        held.append(stream)
        while len(self.arrived) > EARLY_ACTIVATIONS + self.schedules.qsize():
            furthest = max(self.arrived)
            del self.arrived[furthest]
            self.bad(ProtocolError(f"activations of step {furthest}, too far ahead, dropped"), "previous stage")
        self.arrival.set()

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        first = self.cfg.pp_rank == 0
        while True:
            sched: Schedule = await self.schedules.get()
            self.current_step = sched.step_id
            stream = None
            if not first:
                stream = await self._activations_for(sched.step_id, sum(len(w.token_ids) for w in sched.seqs))
            out = await loop.run_in_executor(self.compute, self.executor.run, sched, stream)
            self.last_step = sched.step_id
            if self.recorder is not None:
                self.recorder.record(sched, stream, out)
            if self.push is not None:
                metas, buffers = frames_of([out])
                frames = Codec.encode(Activations(sched.step_id, metas), buffers)
                self.sent_bytes += sum(len(f) for f in frames)
                await self.push.send_multipart(frames, copy=False)
            elif self.cfg.tp_rank == 0:
                await self._send(out)

    async def _activations_for(self, step_id: int, num_tokens: int):
        """The previous stage's residual stream for `step_id`. Tensors that do not fit the step (shape,
        dtype) are refused, and the wait goes on."""
        while True:
            held = self.arrived.get(step_id)
            if not held:
                self.arrival.clear()
                await self.arrival.wait()
                continue
            stream = held.pop(0)
            if not held:
                del self.arrived[step_id]
            if self._fit(step_id, stream, num_tokens):
                self.arrived.pop(step_id, None)  # (any other is a duplicate)
                return stream

    def _fit(self, step_id: int, stream: torch.Tensor, num_tokens: int) -> bool:
        """Whether a step's residual stream is [num_tokens, hidden] in this stage's dtype."""
        want = (num_tokens, self.executor.runner.config.hidden_size)
        dtype = self.executor.runner.kv_cache.dtype
        if tuple(stream.shape) == want and stream.dtype == dtype:
            return True
        self.bad(ProtocolError(f"the residual stream of step {step_id} is {tuple(stream.shape)} of {stream.dtype}, "
                               f"the step needs {want} of {dtype}"), "previous stage")
        return False

    async def _heartbeat(self) -> None:
        speaks = self.cfg.tp_rank == 0  # (for the stage's timeline)
        while True:
            if self.link is not None and self.link.refused_for() >= RELINK_AFTER:
                log.warning("link to the next stage refused, connecting again", extra={"fields": {
                    "address": self.next_address, "hint": "the next stage's host must allow this worker's key "
                                                          "(its --mesh-keys workers/ directory)"}})
                self._connect_next(self.next_address, since=self.link.since)
                self.relinks += 1  # (what was queued on the refused socket is gone: heartbeats say so)
            ex = self.executor
            busy = ex.busy_seconds if ex else 0.0
            comm = ex.runner.tp.comm_seconds[0] if ex else 0.0
            spans = []  # every step finished since the last heartbeat (the executor keeps the newest)
            while ex and speaks and ex.spans:
                spans.append(ex.spans.popleft())
            await self._send(Heartbeat(self.cfg.pp_rank, self.cfg.tp_rank, busy, comm, self.sent_bytes,
                                       self.guard.refused, self.bad.count, self.last_step,
                                       -1 if self.next_schedule is None else self.next_schedule - 1, spans,
                                       self.link.unreached_for() if self.link is not None else 0.0,
                                       self.relinks))
            await asyncio.sleep(self.cfg.heartbeat_interval)


def _peer_lost(e: Exception) -> bool:
    """Whether an error is a collective failing because a peer of the stage's process group went away
    (gloo reports a closed or reset connection; NCCL a remote error) rather than a fault here."""
    if not dist.is_initialized() or not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return any(m in text for m in ("connection closed by peer", "connection reset by peer", "broken pipe",
                                   "remote process exited", "nccl communicator was aborted"))


def _free_port(host: str) -> int:
    """A port free right now (for the stage's process-group rendezvous, which rank 0 listens on)."""
    with socket.socket() as s:
        s.bind((host if host != "*" else "0.0.0.0", 0))
        return s.getsockname()[1]
