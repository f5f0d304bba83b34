"""The coordinator's parts: the worker registry (phases, refusals, silence), the step loop every
engine runs, the coordinator's phase deadlines against a scripted worker on real sockets, and the
in-process engine running the same loop with several microbatches in flight."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import pytest
import zmq
import zmq.asyncio

from coordinator.registry import Phase, WorkerRegistry
from coordinator.server import Coordinator
from coordinator.step_loop import StepLoop
from moemesh.protocol import (PROTOCOL_VERSION, Assignment, Codec, CoordinatorMessage, CoordinatorReply, Heartbeat,
                              Ping, ProtocolError, Register, Start, StatusRequest)
from moemesh.sampling import SamplingParams
from moemesh.settings import CoordinatorSettings, EngineSettings
from test_core import FakeLastStage, make_core, prompt


def reg(p, t):
    return Register(p, t, f"tcp://127.0.0.1:{7000 + 10 * p + t}", "cpu", 1, "tcp://127.0.0.1:1",
                    protocol=PROTOCOL_VERSION)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# -- registry -----------------------------------------------------------------------------------

def test_registry_moves_through_its_phases_and_names_the_missing():
    r = WorkerRegistry(pp=2, tp=2)
    for key in [(0, 0), (1, 1), (0, 1)]:
        r.register(f"w{key}".encode(), reg(*key))
    assert r.missing() == [(1, 0)] and not r.all_registered.is_set()
    r.register(b"w10", reg(1, 0))
    assert r.all_registered.is_set() and r.phase is Phase.REGISTERING
    r.enter(Phase.LOADING)
    for w in r.workers.values():
        r.assigned(w)
    for key, blocks in [((0, 0), 30), ((0, 1), 20), ((1, 0), 40)]:
        r.ready(r.workers[key], blocks)
    assert not r.all_ready.is_set() and r.not_ready() == [(1, 1)]
    r.ready(r.workers[(1, 1)], 50)
    assert r.all_ready.is_set() and r.num_blocks() == 20
    assert r.get(b"w10").rank == (1, 0)


def test_registry_refuses_ranks_outside_the_layout_and_late_registrations():
    r = WorkerRegistry(pp=2, tp=1)
    with pytest.raises(ProtocolError, match="outside pp=2 tp=1"):
        r.register(b"x", reg(2, 0))
    with pytest.raises(ProtocolError, match="outside"):
        r.register(b"x", reg(0, 1))
    r.register(b"a", reg(0, 0))
    r.register(b"b", reg(0, 0))  # while registering, a rank may come again (a restarted worker)
    assert r.get(b"a") is None and r.get(b"b").rank == (0, 0)
    r.enter(Phase.LOADING)
    with pytest.raises(ProtocolError, match="while the pipeline is loading"):
        r.register(b"c", reg(1, 0))


def test_registry_finds_the_silent_worker_and_when_to_look_next():
    clock = Clock()
    r = WorkerRegistry(pp=2, tp=1, clock=clock)
    a, b = r.register(b"a", reg(0, 0)), r.register(b"b", reg(1, 0))
    clock.now += 3
    r.seen(a)
    assert r.silent(5.0) is None and r.next_silence(5.0) == pytest.approx(2.0)  # b was last heard at 100
    clock.now += 2.5
    assert r.silent(5.0) is b
    r.down(b)
    assert b.phase is Phase.DOWN and r.phase is Phase.DOWN and r.went_down.is_set()


# -- the step loop ------------------------------------------------------------------------------

def test_step_loop_fills_the_pipeline_and_shares_the_sequences():
    core = make_core(budget=64, max_seqs=16)
    loop = StepLoop(core, limit=2)
    for i in range(4):
        core.add(f"r{i}", prompt(3, base=10 + i), SamplingParams(max_tokens=4, ignore_eos=True))
    first = list(loop.issue())
    assert len(first) == 2 and [len(s.seqs) for s in first] == [2, 2]  # ceil(4 active / 2 in flight)
    assert list(loop.issue()) == []  # the pipeline is full
    stage = FakeLastStage(first=100)
    loop.take(stage(first[0]))
    assert len(list(loop.issue())) == 1 and loop.steps == 3 and loop.step_seconds > 0


def test_step_loop_refuses_a_result_not_in_flight():
    core = make_core()
    loop = StepLoop(core, limit=1)
    core.add("r", prompt(3), SamplingParams(max_tokens=2))
    (sched,) = loop.issue()
    result = FakeLastStage(first=100)(sched)
    loop.take(result)
    with pytest.raises(ValueError, match="not in flight"):
        loop.take(result)


# -- the coordinator's deadlines, against a scripted worker ------------------------------------

async def _status(address: str):
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    try:
        await sock.send_multipart(Codec.encode(StatusRequest()))
        frames = await asyncio.wait_for(sock.recv_multipart(), 5)
        return Codec(CoordinatorReply).decode(frames)[0]
    finally:
        sock.close(linger=0)


async def _next_message(sock):
    """The coordinator's next message to a played worker that is not a Ping (its pings may come first)."""
    while True:
        msg, _ = Codec(CoordinatorMessage).decode(await asyncio.wait_for(sock.recv_multipart(), 5))
        if not isinstance(msg, Ping):
            return msg


async def _scripted_worker(address: str, ready: asyncio.Event):
    """Registers as the only rank, heartbeats, takes its assignment, and never reports Ready."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(address)

    async def beat():
        while True:
            await sock.send_multipart(Codec.encode(Heartbeat(0, 0, 0.0)))
            await asyncio.sleep(0.1)

    beats = None
    try:
        await sock.send_multipart(Codec.encode(reg(0, 0)))
        beats = asyncio.ensure_future(beat())
        msg = await _next_message(sock)
        assert isinstance(msg, Assignment) and (msg.layer_start, msg.layer_end) == (0, 2)
        ready.set()
        await asyncio.sleep(3600)
    finally:
        if beats is not None:
            beats.cancel()
        sock.close(linger=0)


def _coordinator(model_dir, **kw) -> Coordinator:
    return Coordinator(CoordinatorSettings(model=str(model_dir), **kw))


async def _with_a_hand_played_worker(model_dir, **kw):
    """A coordinator running, and a DEALER on its workers' port for the test to play a worker with."""
    coord = _coordinator(model_dir, **kw)
    task = asyncio.ensure_future(coord.run(announce=None))
    await asyncio.sleep(0.1)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(coord.addresses["workers"])
    return coord, task, sock


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=2, vocab_size=384),
                            tmp_path_factory.mktemp("m"))


def test_the_mesh_listens_and_connects_on_ipv6_loopback(tiny):
    """--host ::1 (or [::1]) and tcp://[::1]:PORT: libzmq takes IPv6 only on a socket told so ("No such
    device" before); the coordinator announces its addresses in brackets, a worker advertises its own
    so, and ::1 is loopback (no keys needed)."""
    from moemesh.client import CoordinatorClient
    from moemesh.mesh_security import check_exposure
    from stage_worker.worker import advertised_host

    async def scenario():
        coord = _coordinator(tiny, host="::1")
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.1)
        client = CoordinatorClient(coord.addresses["clients"])
        try:
            return coord.addresses, await client.status(timeout=5)
        finally:
            await client.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    addresses, status = asyncio.run(scenario())
    assert addresses["clients"].startswith("tcp://[::1]:") and status.phase == "registering"
    assert advertised_host("::1", "tcp://[::1]:1") == advertised_host("[::1]", "tcp://[::1]:1") == "[::1]"
    check_exposure(None, False, host="[::1]", coordinator="tcp://[::1]:5")  # (loopback: no error)


def test_a_worker_that_never_loads_brings_the_pipeline_down_at_the_ready_deadline(tiny):
    async def scenario():
        coord = _coordinator(tiny, ready_timeout=0.6, worker_timeout=30)
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.1)
        assigned = asyncio.Event()
        worker = asyncio.ensure_future(_scripted_worker(coord.addresses["workers"], assigned))
        await asyncio.wait_for(assigned.wait(), 5)
        assert coord.registry.phase is Phase.LOADING
        before = await _status(coord.addresses["clients"])
        await asyncio.sleep(1.0)
        after = await _status(coord.addresses["clients"])
        worker.cancel()
        task.cancel()
        await asyncio.gather(task, worker, return_exceptions=True)
        return before, after, coord.registry.phase

    before, after, phase = asyncio.run(scenario())
    assert before.failure is None and not before.serving
    assert "(0, 0)" in after.failure and "--ready-timeout" in after.failure and phase is Phase.DOWN


def test_nobody_registering_brings_the_pipeline_down_at_the_register_deadline(tiny):
    async def scenario():
        coord = _coordinator(tiny, pp=2, register_timeout=0.3)
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.6)
        status = await _status(coord.addresses["clients"])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return status

    status = asyncio.run(scenario())
    assert "(0, 0), (1, 0)" in status.failure and "register" in status.failure


def test_a_coordinator_whose_pipeline_went_down_exits_after_saying_why(tiny):
    """A down pipeline never comes back in the process, so `moemesh coordinator` exits (status 1,
    the reason on stderr) once clients have had `down_linger` seconds to read it: a restart policy
    (compose's, serve's launcher) then starts it afresh, where a live but down process would look
    healthy forever."""
    import subprocess
    import sys
    import time

    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "moemesh", "coordinator", "--model", str(tiny), "--port", "0",
                          "--client-port", "0", "--register-timeout", "0.5"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and time.monotonic() - started > 5
    assert "the pipeline went down: timed out waiting for stage workers" in out.stderr
    assert "Traceback" not in out.stderr

def test_a_message_lost_on_a_link_is_known_from_the_heartbeats(tiny):
    """A schedule a worker's heartbeat still lacks LOST_AFTER seconds after it went out, or a result the
    last stage computed LOST_AFTER ago that never came, counts as lost (the pipeline is then reset);
    a heartbeat older than that, a result still on its way, or anything right after the coordinator's
    own stall does not."""
    import time

    from coordinator.server import LOST_AFTER

    async def scenario():
        coord = _coordinator(tiny, pp=2)
        registry = coord.registry
        first, last = registry.register(b"w0", reg(0, 0)), registry.register(b"w1", reg(1, 0))
        now = time.monotonic()
        coord.issued = {10: now - 3 * LOST_AFTER, 11: now - 0.1}
        for w in (first, last):
            w.received_step, w.last_step, w.heard_at = 11, 9, now
        verdicts = [coord._lost_on_a_link(now)]  # every schedule taken, step 10 not computed yet: nothing
        first.received_step = 10  # step 11 went out 0.1 s ago: still on its way
        verdicts.append(coord._lost_on_a_link(now))
        first.received_step, first.heard_at = 9, now - 3 * LOST_AFTER + 0.5  # a heartbeat from before step 10 went out
        verdicts.append(coord._lost_on_a_link(now))
        first.heard_at = now  # a fresh heartbeat that still lacks step 10
        verdicts.append(coord._lost_on_a_link(now))
        first.received_step, last.last_step = 11, 10  # step 10 computed; its result not here
        verdicts.append(coord._lost_on_a_link(now))  # (first seen now)
        verdicts.append(coord._lost_on_a_link(now + LOST_AFTER / 2))
        verdicts.append(coord._lost_on_a_link(now + LOST_AFTER + 0.1))
        coord._stalled_until = now + 10
        verdicts.append(coord._lost_on_a_link(now + 5))
        return verdicts

    v = asyncio.run(scenario())
    assert v[:3] == [None, None, None] and v[4:6] == [None, None] and v[7] is None
    assert v[3][0] == 10 and "schedule of step 10 was lost on its link to stage worker pp=0" in v[3][1]
    assert v[6][0] == 10 and "result of step 10 was lost" in v[6][1]

# -- the in-process engine runs the same loop ------------------------------------------------

def test_in_process_engine_keeps_one_microbatch_per_stage_in_flight(tiny):
    from moemesh.entrypoints.engine import LLMEngine

    prompts = [prompt(5, base=20 + 7 * i) for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    whole = LLMEngine(EngineSettings(model=str(tiny), num_kv_blocks=64), progress=False)
    split = LLMEngine(EngineSettings(model=str(tiny), num_kv_blocks=64, layer_partition=(1, 1)), progress=False)
    assert whole.loop.limit == 1 and split.loop.limit == 2
    seen = []
    poll = split.pipeline.poll
    split.pipeline.poll = lambda: (seen.append(len(split.core.in_flight)), poll())[1]
    assert [o.token_ids for o in split.generate(prompts, params)] == \
        [o.token_ids for o in whole.generate(prompts, params)]
    assert max(seen) == 2


def test_unseeded_sampling_differs_between_engines_and_seeded_does_not(tiny):
    from moemesh.entrypoints.engine import LLMEngine

    engines = [LLMEngine(EngineSettings(model=str(tiny), num_kv_blocks=16), progress=False) for _ in range(2)]
    free = SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True, seed=7)
    a, b = ([e.generate([prompt(4)], p)[0].token_ids for e in engines] for p in (free, seeded))
    assert a[0] != a[1] and b[0] == b[1]


# -- nothing at the client link can hang a request or end the coordinator ---------------------

async def _client_exchange(address: str, frames: list) -> object:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    try:
        await sock.send_multipart(frames)
        reply = await asyncio.wait_for(sock.recv_multipart(), 5)
        return Codec(CoordinatorReply).decode(reply)[0]
    finally:
        sock.close(linger=0)


def test_a_request_that_fails_validation_gets_an_error_and_a_handler_bug_fails_one_request(tiny, monkeypatch):
    import msgspec

    async def scenario():
        coord = _coordinator(tiny)
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.1)
        bad = msgspec.msgpack.encode({"type": "generate", "request_id": "r1", "prompt_ids": [1, 2],
                                      "params": {"temperature": -3}})
        invalid = await _client_exchange(coord.addresses["clients"], [bad])
        long_id = msgspec.msgpack.encode({"type": "generate", "request_id": "x" * 300, "prompt_ids": [1, 2],
                                          "params": {}})
        too_long = await _client_exchange(coord.addresses["clients"], [long_id])

        def broken(*a, **k):
            raise KeyError("a bug")

        coord.router.hold = broken  # the coordinator is not serving yet, so a request would be held
        ok = msgspec.msgpack.encode({"type": "generate", "request_id": "r2", "prompt_ids": [1, 2], "params": {}})
        failed = await _client_exchange(coord.addresses["clients"], [ok])
        alive = await _status(coord.addresses["clients"])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return invalid, too_long, failed, alive

    invalid, too_long, failed, alive = asyncio.run(scenario())
    assert invalid.request_id == "r1" and invalid.error_status == 400 and "invalid request" in invalid.error
    # (ids past 256 characters are refused: ended requests keep theirs for a while)
    assert too_long.request_id == "x" * 256 and too_long.error_status == 400 and "length" in too_long.error
    assert failed.request_id == "r2" and failed.error_status == 500 and "KeyError" in failed.error
    assert alive.malformed_messages == 2 and alive.failure is None


def test_the_launcher_gives_up_on_a_silent_coordinator_at_its_deadline():
    import subprocess
    import sys
    import time

    from moemesh.entrypoints.launcher import LaunchError, LocalMesh

    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        started = time.monotonic()
        with pytest.raises(LaunchError, match="within 0.5 s"):
            LocalMesh(None, None)._read_announcement(silent, timeout=0.5)
        assert time.monotonic() - started < 5
    finally:
        silent.kill()
        silent.wait()


def test_requests_past_max_waiting_get_429_and_the_client_socket_never_drops(tiny):
    """Requests held (the pipeline is not serving yet) count as waiting: past --max-waiting a new one
    is refused with 429 at once. The client socket keeps what a slow gateway has not read (no
    high-water mark drops) and refuses messages larger than the longest prompt allows."""
    from moemesh.protocol import GenerateRequest, max_client_message_bytes

    async def scenario():
        coord = _coordinator(tiny, max_waiting=2, register_timeout=30)
        assert coord.clients_sock.getsockopt(zmq.SNDHWM) == 0
        assert coord.clients_sock.getsockopt(zmq.MAXMSGSIZE) == max_client_message_bytes(
            coord.model_config.max_position_embeddings)
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.1)
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.connect(coord.addresses["clients"])
        try:
            for i in range(3):
                await sock.send_multipart(Codec.encode(GenerateRequest(f"r{i}", [5, 6], SamplingParams(max_tokens=2))))
            frames = await asyncio.wait_for(sock.recv_multipart(), 5)
            out = Codec(CoordinatorReply).decode(frames)[0]
            assert (out.request_id, out.finish_reason, out.error_status) == ("r2", "error", 429)
            assert "--max-waiting" in out.error
            assert (await _status(coord.addresses["clients"])).num_waiting == 2
        finally:
            sock.close(linger=0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_sequences_a_recovery_put_back_do_not_count_against_max_waiting(tiny):
    """--max-waiting bounds requests never scheduled: those a recovery (or a preemption) put back in
    the queue were admitted already, and new requests that come while it recovers are queued, not
    refused with a 429 (docs/reliability.md)."""
    coord = _coordinator(tiny, max_waiting=3, register_timeout=30)
    try:
        coord.core = make_core()
        for i in range(4):
            coord.core.add(f"r{i}", prompt(5), SamplingParams(max_tokens=8))
        assert coord.core.next_schedule() is not None  # the four run
        assert coord.queued() == coord.waiting() == 0
        coord.core.requeue_all()  # a stage was lost
        assert coord.waiting() == 4 and coord.queued() == 0
        for i in range(4, 7):
            coord.core.add(f"r{i}", prompt(5), SamplingParams(max_tokens=8))
        assert coord.waiting() == 7 and coord.queued() == 3  # (the bound: the next new one is a 429)
    finally:
        coord.ctx.destroy(linger=0)


def test_a_loss_while_a_send_waits_stops_the_issuing_and_ends_no_request(tiny):
    """A schedule's send that waits (a full queue) while a worker is lost: the step loop issues no more,
    and its check for a pool too small for any request does not end one the recovery just put back."""
    from coordinator.registry import Phase

    async def scenario():
        coord = _coordinator(tiny)
        coord.core = make_core()
        coord.loop = StepLoop(coord.core, 2)
        coord.registry.phase = Phase.SERVING
        for i in range(3):
            coord.core.add(f"r{i}", prompt(5), SamplingParams(max_tokens=8))
        delivered, sent = [], []

        async def deliver(outs):
            delivered.extend(outs)

        class Pipeline:
            async def send(self, sched):
                sent.append(sched.step_id)
                await asyncio.sleep(0)  # the send waited, and meanwhile a worker was lost (as _lost does)
                coord.registry.enter(Phase.RECOVERING)
                coord._requeue_all()

        coord.router.deliver, coord.pipeline = deliver, Pipeline()
        coord.wake.set()
        task = asyncio.ensure_future(coord._step_loop())
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        waiting = len(coord.core.scheduler.waiting)
        coord.ctx.destroy(linger=0)
        return delivered, sent, waiting

    delivered, sent, waiting = asyncio.run(scenario())
    assert delivered == [] and len(sent) == 1 and waiting == 3


async def _worker_that_drops(address: str, drop: int, log: list, answer: bool = True):
    """The only rank (pp=1): loads at once, heartbeats, and answers schedules like a last stage,
    except the first `drop` schedules, which it never sees (lost on a connection that dropped). With
    `answer` False it answers nothing after the first (a stage stuck in its compute). Logs what came."""
    from moemesh.protocol import Ready, Reset, Schedule, Shutdown, Start
    from test_core import FakeLastStage

    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    last = [-1]

    async def beat():
        while True:
            await sock.send_multipart(Codec.encode(Heartbeat(0, 0, 0.0, last_step=last[0])))
            await asyncio.sleep(0.1)

    beats = asyncio.ensure_future(beat())
    stage, seen = FakeLastStage(first=100), 0
    try:
        await sock.send_multipart(Codec.encode(reg(0, 0)))
        while True:
            msg, _ = Codec(CoordinatorMessage).decode(await sock.recv_multipart())
            if isinstance(msg, Ping):
                continue
            log.append(type(msg).__name__)
            if isinstance(msg, Assignment):
                await sock.send_multipart(Codec.encode(Ready(0, 0, 64)))
            elif isinstance(msg, Reset):
                stage = FakeLastStage(first=100)  # (a reset drops the sampling state)
            elif isinstance(msg, Schedule):
                log.append(msg.epoch)  # (the epoch each schedule belongs to)
                seen += 1
                if seen <= drop or (not answer and seen > 1):
                    continue
                await sock.send_multipart(Codec.encode(stage(msg)))
                last[0] = msg.step_id
            elif isinstance(msg, Shutdown):
                return
            elif not isinstance(msg, Start):
                raise AssertionError(msg)
    finally:
        beats.cancel()
        sock.close(linger=0)


def test_an_overdue_step_resets_the_pipeline_and_a_stuck_stage_is_replaced(tiny):
    """A schedule that never arrives (its connection dropped): past --step-timeout the pipeline is
    reset and the request completes, nobody replaced. A stage that stays stuck after the reset is
    told to exit and the pipeline recovers without it."""
    from moemesh.client import CoordinatorClient

    async def scenario(answer: bool):
        coord = _coordinator(tiny, step_timeout=0.5, worker_timeout=30, recovery_timeout=30)
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.1)
        log: list = []
        worker = asyncio.ensure_future(_worker_that_drops(coord.addresses["workers"], 1, log, answer))
        client = CoordinatorClient(coord.addresses["clients"])
        try:
            await client.wait_serving(10)

            async def one():
                tokens = []
                async for out in client.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)):
                    assert not out.error, out.error
                    tokens += out.token_ids
                return tokens
            if answer:
                tokens = await asyncio.wait_for(one(), 10)
                assert len(tokens) == 4
            else:
                request = asyncio.ensure_future(one())
                await asyncio.wait_for(worker, 10)  # told to exit
                await asyncio.sleep(0.2)
                request.cancel()
            return log, await client.status()
        finally:
            await client.close()
            for t in (task, worker):
                t.cancel()
            await asyncio.gather(task, worker, return_exceptions=True)

    log, status = asyncio.run(scenario(answer=True))
    assert log[:5] == ["Assignment", "Start", "Schedule", 0, "Reset"] and "Schedule" in log[5:]
    assert {e for e in log[5:] if isinstance(e, int)} == {1}  # every later schedule says its epoch
    assert (status.step_resets, status.recoveries, status.phase) == (1, 0, "serving")
    log, status = asyncio.run(scenario(answer=False))
    log = [e for e in log if isinstance(e, str)]
    assert log.count("Reset") == 1 and log[-1] == "Shutdown"
    assert (status.step_resets, status.recoveries, status.phase) == (1, 1, "recovering")


@pytest.mark.parametrize("case", ["message-limit", "activation-limit", "protocol", "exposed"])
def test_a_worker_that_cannot_serve_this_pipeline_fails_the_start_saying_why(tiny, case):
    """A message limit below what the model needs (naming the flag), a worker of another protocol
    version (an older one says none), which could misread schedules without an error, or, on a
    mesh without keys, a worker whose activation socket is not on loopback (the previous stage would
    send users' hidden states there in the clear)."""
    from moemesh.protocol import Shutdown

    async def scenario():
        coord, task, sock = await _with_a_hand_played_worker(tiny, register_timeout=30)
        try:
            if case == "message-limit":
                bad = Register(0, 0, "tcp://127.0.0.1:7000", "cpu", 1, "tcp://127.0.0.1:1", max_message_bytes=1000,
                               protocol=PROTOCOL_VERSION)
            elif case == "activation-limit":  # (ZeroMQ would drop the previous stage's activations unsaid)
                bad = Register(0, 0, "tcp://127.0.0.1:7000", "cpu", 1, "tcp://127.0.0.1:1",
                               protocol=PROTOCOL_VERSION, max_activation_bytes=100)
            elif case == "protocol":
                bad = Register(0, 0, "tcp://127.0.0.1:7000", "cpu", 1, "tcp://127.0.0.1:1")
            else:
                bad = Register(0, 0, "tcp://10.1.2.3:7000", "cpu", 1, "tcp://127.0.0.1:1", protocol=PROTOCOL_VERSION)
            await sock.send_multipart(Codec.encode(bad))
            msg = await _next_message(sock)
            assert isinstance(msg, Shutdown)
            return await _status(coord.addresses["clients"])
        finally:
            sock.close(linger=0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    status = asyncio.run(scenario())
    assert status.phase == "down"
    if case == "message-limit":
        assert "--max-message-bytes" in status.failure and "takes messages up to 1000" in status.failure
    elif case == "activation-limit":
        assert "takes activations up to 100 bytes" in status.failure and "--max-activation-bytes" in status.failure
    elif case == "protocol":
        assert f"speaks protocol 0, this coordinator {PROTOCOL_VERSION}" in status.failure
    else:
        assert "listens on tcp://10.1.2.3:7000, not loopback, and the mesh has no keys" in status.failure


def test_a_worker_that_loaded_another_checkpoint_is_refused_naming_the_fields(tiny):
    """A stage host whose --model path holds another checkpoint (another hidden size) would register,
    load and then drop every activation as the wrong shape, each request hanging to --step-timeout: its
    Ready carries the config it loaded, and the start fails naming the fields that differ."""
    import dataclasses

    from moemesh.config import ModelConfig
    from moemesh.protocol import Ready, Shutdown

    ours = ModelConfig.from_dir(tiny)
    other = dataclasses.replace(ours, hidden_size=2 * ours.hidden_size).to_json()

    async def scenario():
        coord, task, sock = await _with_a_hand_played_worker(tiny, ready_timeout=30)
        try:
            await sock.send_multipart(Codec.encode(reg(0, 0)))
            while not isinstance(Codec(CoordinatorMessage).decode(await sock.recv_multipart())[0], Assignment):
                pass
            await sock.send_multipart(Codec.encode(Ready(0, 0, 64, other)))
            msg = await _next_message(sock)
            return msg, await _status(coord.addresses["clients"])
        finally:
            sock.close(linger=0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    msg, status = asyncio.run(scenario())
    differ = f"hidden_size: {2 * ours.hidden_size} there, {ours.hidden_size} here"
    assert isinstance(msg, Shutdown) and differ in msg.refused
    assert status.phase == "down" and f"differs from the coordinator's ({differ})" in status.failure


def test_a_second_worker_for_a_live_rank_is_refused_and_a_restarted_one_taken(tiny, monkeypatch):
    """Two workers started for one rank took it from each other at every restart, each leaving without
    a word: a claim on a rank whose worker was heard within LIVE_HOLDER seconds is refused naming the
    flags (the pipeline keeps its worker); once the holder has been silent that long, the claim is a
    restart and is taken."""
    import coordinator.server as server
    from moemesh.protocol import Shutdown

    monkeypatch.setattr(server, "LIVE_HOLDER", 1.0)

    async def scenario():
        coord, task, first = await _with_a_hand_played_worker(tiny, pp=2, register_timeout=30)
        second = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        second.connect(coord.addresses["workers"])
        try:
            await first.send_multipart(Codec.encode(reg(1, 0)))
            await asyncio.sleep(0.2)
            await second.send_multipart(Codec.encode(Register(1, 0, "tcp://127.0.0.1:7999", "cpu", 2,
                                                              "tcp://127.0.0.1:1", protocol=PROTOCOL_VERSION)))
            refused = await _next_message(second)
            holder = coord.registry.workers[(1, 0)].identity
            held = await _status(coord.addresses["clients"])
            await asyncio.sleep(1.3)  # (the first falls silent: it died, and this is its restart)
            await second.send_multipart(Codec.encode(Register(1, 0, "tcp://127.0.0.1:7999", "cpu", 3,
                                                              "tcp://127.0.0.1:1", protocol=PROTOCOL_VERSION)))
            await asyncio.sleep(0.3)
            return refused, held, coord.registry.workers[(1, 0)].data_address, holder
        finally:
            first.close(linger=0)
            second.close(linger=0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    refused, held, address, holder = asyncio.run(scenario())
    assert isinstance(refused, Shutdown) and "is a second worker started with --pp-rank 1 --tp-rank 0?" in refused.refused
    # (the holder named by its pid, not its identity: with that, a connection could take over its route)
    assert "(pid 1," in refused.refused and holder.decode(errors="replace") not in refused.refused
    assert held.phase == "registering" and held.failure is None
    assert address == "tcp://127.0.0.1:7999"


def test_a_worker_never_runs_a_schedule_after_a_lost_one(tiny):
    """A real stage worker against a scripted coordinator. A connection drop can lose a Reset, or
    schedules (those that re-admitted a sequence, say). The schedules after them carry their epoch
    and its first step id, so the worker knows: it resets to a newer epoch, and after a gap in the
    step ids it runs nothing (its block tables and K/V would be incomplete) until the next Reset,
    which the coordinator's step deadline sends (the lost step never comes back). Nothing fails."""
    from moemesh.config import ModelConfig
    from moemesh.protocol import Ready, Reset, Schedule, SeqWork, Start, StepResult, WorkerFailed, WorkerMessage
    from moemesh.settings import WorkerSettings
    from stage_worker.worker import StageWorker

    layers = ModelConfig.from_dir(tiny).num_layers
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def scenario(lost_reset: bool):
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        worker = StageWorker(WorkerSettings(coordinator=f"tcp://127.0.0.1:{port}", pp_rank=0, threads=1,
                                            kv_memory=1 << 20))
        task = asyncio.ensure_future(worker.run())
        codec = Codec(WorkerMessage)

        async def expect(kind):
            while True:
                identity, *frames = await asyncio.wait_for(sock.recv_multipart(), 60)
                msg, _ = codec.decode(frames)
                if isinstance(msg, (kind, WorkerFailed)):
                    return identity, msg

        async def send(identity, msg):
            await sock.send_multipart([identity, *Codec.encode(msg)])

        def admit(step, epoch, blocks):
            return Schedule(step, [SeqWork(1, [5, 6, 7], 0, blocks, True, greedy, 3)], epoch=epoch, first_step=step)

        try:
            identity, _ = await expect(Register)
            await send(identity, Assignment(str(tiny), 0, layers, 1, 1, None, "float32", 4))
            await expect(Ready)
            await send(identity, Start(16, epoch=0))
            await send(identity, admit(0, 0, [0]))
            _, first = await expect(StepResult)
            token = first.sampled[0].token_id
            if lost_reset:  # Reset(1, 7) and schedule 7 (sequence 1 re-admitted on blocks 2, 3) are lost
                await send(identity, Schedule(8, [SeqWork(1, [token], 3, [], True)], epoch=1, first_step=7))
            else:  # schedule 1 of epoch 0 is lost
                await send(identity, Schedule(2, [SeqWork(1, [9], 4, [1], True)], epoch=0, first_step=0))
            deadline = asyncio.get_running_loop().time() + 1.0  # the schedule after the loss is not run
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                if await sock.poll(int(left * 1000)):
                    msg, _ = codec.decode((await sock.recv_multipart())[1:])
                    assert not isinstance(msg, (StepResult, WorkerFailed)), msg
            # the coordinator's step deadline: a reset, every sequence re-admitted
            await send(identity, Reset(2, first_step=9))
            await send(identity, admit(9, 2, [4]))
            _, again = await expect(StepResult)
            return first, again
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sock.close(linger=0)

    for lost_reset in (True, False):
        first, again = asyncio.run(scenario(lost_reset))
        assert isinstance(again, StepResult), again  # not WorkerFailed
        assert again.step_id == 9 and again.sampled[0].token_id == first.sampled[0].token_id  # same prompt


@contextlib.asynccontextmanager
async def fake_coordinator():
    """A ROUTER socket standing in for a coordinator's client port, and a CoordinatorClient linked to it."""
    from moemesh.client import CoordinatorClient

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = CoordinatorClient(f"tcp://127.0.0.1:{port}", ctx)
    try:
        for _ in range(50):  # (until the DEALER has its peer: a send before would be refused)
            await asyncio.sleep(0.02)
            if client.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                break
        yield router, client
    finally:
        await client.close()
        router.close(linger=0)
        ctx.term()


def test_a_cancel_that_meets_a_status_reply_is_not_lost(monkeypatch):
    """Python 3.11's asyncio.wait_for returns a result that arrives with a cancel and drops the cancel:
    a loop around client.status (the gateway's poller; its shutdown waits for it) must still end."""
    from moemesh import client as client_module

    async def swallowing(fut, timeout):  # what 3.11 does when the reply and the cancel meet
        asyncio.current_task().cancel()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            fut.cancel()
            return "reply"

    async def main():
        async with fake_coordinator() as (_, client):
            monkeypatch.setattr(client_module.asyncio, "wait_for", swallowing)
            try:
                async def poll():
                    while True:
                        await client.status(timeout=1.0)
                        await asyncio.sleep(0)

                task = asyncio.ensure_future(poll())
                await asyncio.wait({task}, timeout=3)  # (not wait_for: that is the stand-in now)
                assert task.done() and task.cancelled()
            finally:
                monkeypatch.undo()

    asyncio.run(main())


def test_a_late_status_reply_goes_to_its_own_question_not_the_next():
    """Status replies carry their request's nonce: the answer to a question that timed out, arriving
    late, is dropped, and the next caller (here one asking for the timeline) gets its own answer; a
    reply without a nonce (an older coordinator) goes to the oldest question."""
    from moemesh.protocol import Codec, StatusReply, StatusRequest, StepSpan

    def reply(nonce, spans):
        return StatusReply(True, 8, 8, 0, 0, 0, [0.0], [0.0], 1.0, 0, stage_spans=spans, nonce=nonce)

    async def main():
        async with fake_coordinator() as (router, client):
            with pytest.raises(asyncio.TimeoutError):
                await client.status(timeout=0.2)  # unanswered for now
            ident, *frames = await router.recv_multipart()
            first, _ = Codec(StatusRequest).decode(frames)
            asked = asyncio.ensure_future(client.status(timeout=3.0, timeline=True))
            ident, *frames = await router.recv_multipart()
            second, _ = Codec(StatusRequest).decode(frames)
            assert second.timeline and not first.timeline and second.nonce != first.nonce
            late, own = reply(first.nonce, []), reply(second.nonce, [[StepSpan(4, 1.0, 0.5, 8, 8)]])
            for msg in (late, own):
                await router.send_multipart([ident, *Codec.encode(msg)])
            assert (await asyncio.wait_for(asked, 5)).stage_spans == own.stage_spans
            asked = asyncio.ensure_future(client.status(timeout=3.0))
            await router.recv_multipart()
            await router.send_multipart([ident, *Codec.encode(reply(0, [[]]))])
            assert (await asyncio.wait_for(asked, 5)).stage_spans == [[]]
            assert client.status_waiters == {}

    asyncio.run(main())


def test_a_worker_for_a_rank_outside_the_layout_is_told_and_exits_saying_why(tiny):
    """It used to wait, registered and unassigned, then exit 0 with nothing said (only the
    coordinator's log knew): now the coordinator's refusal reaches it, and it exits 2 naming it."""
    import sys

    async def scenario():
        coord = _coordinator(tiny, pp=2, register_timeout=60)
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.1)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "moemesh", "stage-worker", "--coordinator", coord.addresses["workers"],
            "--pp-rank", "5", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            return proc.returncode, err.decode(), await _status(coord.addresses["clients"])
        finally:
            if proc.returncode is None:
                proc.kill()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    code, err, status = asyncio.run(scenario())
    assert code == 2 and "refused by the coordinator" in err and "outside pp=2 tp=1" in err, err
    assert status.phase == "registering"  # (the pipeline waits for its real workers)


def test_a_ready_out_of_turn_or_with_no_blocks_is_refused_and_counted(tiny):
    """Ready before the worker's assignment (Start would go out while it loads) or with a KV pool of 0
    blocks (the coordinator could not build its core) is refused and counted; the right Ready serves."""
    from moemesh.protocol import Ready

    async def scenario():
        coord, task, sock = await _with_a_hand_played_worker(tiny, ready_timeout=30)
        try:
            await sock.send_multipart(Codec.encode(reg(0, 0)))
            await sock.send_multipart(Codec.encode(Ready(0, 0, 64)))  # before any assignment
            while not isinstance(Codec(CoordinatorMessage).decode(await sock.recv_multipart())[0], Assignment):
                pass
            await sock.send_multipart(Codec.encode(Ready(0, 0, 0)))
            await asyncio.sleep(0.3)
            early = await _status(coord.addresses["clients"])
            await sock.send_multipart(Codec.encode(Ready(0, 0, 64)))
            while not isinstance(Codec(CoordinatorMessage).decode(await sock.recv_multipart())[0], Start):
                pass
            return early, await _status(coord.addresses["clients"])
        finally:
            sock.close(linger=0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    early, serving = asyncio.run(scenario())
    assert early.malformed_messages == 2 and early.phase == "loading" and early.failure is None
    assert serving.phase == "serving" and serving.num_blocks == 64


def test_a_stage_the_previous_one_cannot_reach_is_named_and_the_gateway_refuses_requests(tiny):
    """A wrong --advertise-host (an address nothing listens at): the worker registers and the pipeline
    serves, but the previous stage never connects to it, and every step would wait --step-timeout.
    Within seconds the status names the link and the address, and the gateway answers 503 with that
    (/ready, /health, requests) instead of taking requests that hang."""
    import sys
    import time

    from gateway.server import Gateway, HTTPError
    from moemesh.settings import GatewaySettings

    async def scenario():
        coord = _coordinator(tiny, pp=2, register_timeout=120, ready_timeout=120)
        task = asyncio.ensure_future(coord.run(announce=None))
        await asyncio.sleep(0.1)
        procs = []
        try:
            for rank, extra in ((0, []), (1, ["--advertise-host", "127.0.0.2"])):  # (it listens on 127.0.0.1)
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "moemesh", "stage-worker", "--coordinator", coord.addresses["workers"],
                    "--pp-rank", str(rank), "--host", "127.0.0.1", "--kv-memory", str(4 << 20), *extra,
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                status = await _status(coord.addresses["clients"])
                if status.unreached:
                    return status
                await asyncio.sleep(0.3)
            return status
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    status = asyncio.run(scenario())
    assert status.phase == "serving" and status.serving, status
    assert "stage 0 (tp rank 0) has not reached stage 1 at tcp://127.0.0.2:" in status.unreached, status.unreached
    assert "--advertise-host" in status.unreached

    gateway = Gateway(GatewaySettings(model=str(tiny)))
    gateway.status = status
    ready = asyncio.run(gateway.ready(None))
    assert ready.status == 503 and "127.0.0.2" in ready.text
    with pytest.raises(HTTPError) as refused:
        asyncio.run(gateway.health(None))
    assert refused.value.status == 503 and status.unreached in refused.value.message
    gateway.status = msgspec.structs.replace(status, unreached="")  # (once it connects)
    assert asyncio.run(gateway.ready(None)).status == 200 and asyncio.run(gateway.health(None)).status == 200


def test_a_named_link_is_forgotten_with_its_worker(tiny):
    """A worker whose link to the next stage never connected is named in the status (the gateway
    answers 503 meanwhile); when that worker is lost, its link goes with it at once, so the gateway
    takes requests again for the recovery to serve, without waiting for a heartbeat of someone else."""
    from moemesh.protocol import Ready, Start, WorkerFailed

    async def scenario():
        coord, task, sock = await _with_a_hand_played_worker(tiny, pp=2, ready_timeout=30, recovery_timeout=60)
        other = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        other.connect(coord.addresses["workers"])
        try:
            for s, rank in ((sock, 0), (other, 1)):
                await s.send_multipart(Codec.encode(reg(rank, 0)))
            for s, rank in ((sock, 0), (other, 1)):
                while not isinstance(Codec(CoordinatorMessage).decode(await s.recv_multipart())[0], Assignment):
                    pass
                await s.send_multipart(Codec.encode(Ready(rank, 0, 64)))
            for s in (sock, other):
                while not isinstance(Codec(CoordinatorMessage).decode(await s.recv_multipart())[0], Start):
                    pass
            await sock.send_multipart(Codec.encode(Heartbeat(0, 0, 0.0, next_unreached=4.0)))
            await asyncio.sleep(0.3)
            named = await _status(coord.addresses["clients"])
            await sock.send_multipart(Codec.encode(WorkerFailed(0, 0, "killed")))
            await asyncio.sleep(0.3)
            return named, await _status(coord.addresses["clients"])
        finally:
            sock.close(linger=0)
            other.close(linger=0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    named, after = asyncio.run(scenario())
    assert named.unreached.startswith("stage 0 (tp rank 0) has not reached stage 1 at tcp://127.0.0.1:7010 in 4 s")
    assert after.phase == "recovering" and after.unreached == ""
