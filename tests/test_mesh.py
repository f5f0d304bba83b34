"""The whole mesh end to end: a coordinator and stage workers as real processes on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from hf_models import build_hf_model, hf_greedy
from moemesh.client import CoordinatorClient
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.entrypoints.launcher import LocalMesh
from moemesh.netutil import run
from moemesh.sampling import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 300 + 4 for j in range(1 + (5 * i) % 23)] for i in range(16)]
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
KV = 16 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("mesh-model")
    hf = build_hf_model("mixtral", path)
    return path, hf


@pytest.fixture(scope="module")
def reference(model):
    path, hf = model
    engine = LLMEngine(EngineSettings(model=str(path), num_kv_blocks=256), progress=False)
    in_process = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    transformers = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert in_process == transformers
    return in_process


_meshes: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_meshes():
    yield
    for mesh in _meshes.values():
        mesh.stop()
    _meshes.clear()


def keys_for(model_dir) -> str:
    """The mesh keys beside a test model (made once): every mesh of these tests runs CurveZMQ, as a
    deployment does."""
    from moemesh.mesh_security import make_keys

    keys = Path(model_dir).parent / f"{Path(model_dir).name}-mesh-keys"
    if not (keys / "server.key_secret").is_file():
        make_keys(keys)
    return str(keys)


def mesh_for(model_dir, **kw) -> LocalMesh:
    """One running mesh per layout, shared by the tests of this module."""
    key = tuple(sorted(kw.items()))
    if key not in _meshes:
        mesh = LocalMesh.of(EngineSettings(model=str(model_dir), kv_memory=kw.pop("kv_memory", KV),
                                           mesh_keys=keys_for(model_dir), **kw))
        mesh.start()
        _meshes[key] = mesh
    return _meshes[key]


async def collect(client: CoordinatorClient, prompt, params):
    tokens, last = [], None
    async for out in client.generate(prompt, params):
        tokens += out.token_ids
        last = out
    return tokens, last


def stream_all(client: CoordinatorClient, prompts, params):
    """Starts a stream per prompt; -> (tasks, tokens received so far per stream). A stream that
    ends with an error fails its task."""
    got = [[] for _ in prompts]

    async def drain(i, stream):
        async for out in stream:
            assert not out.error, out.error
            got[i] += out.token_ids

    streams = [client.generate(p, sp) for p, sp in zip(prompts, params)]
    return [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)], got


async def generate_all(mesh: LocalMesh, prompts, params):
    client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
    try:
        await client.wait_serving(timeout=120)
        params = params if isinstance(params, list) else [params] * len(prompts)
        results = await asyncio.gather(*(collect(client, p, sp) for p, sp in zip(prompts, params)))
        status = await client.status()
        return results, status
    finally:
        await client.close()


@pytest.mark.parametrize("layout", [dict(pp=1), dict(pp=2), dict(pp=4),
                                    dict(pp=2, layer_partition=(1, 3), max_batched_tokens=8),
                                    dict(pp=1, num_scheduler_steps=4),
                                    dict(pp=2, num_speculative_tokens=3, ngram_prompt_lookup_min=1,
                                         speculative_disable_by_batch_size=16)],
                         ids=["pp1", "pp2", "pp4", "pp2-uneven-chunked", "pp1-multi-step", "pp2-speculative"])
def test_greedy_through_the_mesh_matches_in_process_and_transformers(model, reference, layout):
    results, status = run(generate_all(mesh_for(model[0], **layout), PROMPTS, GREEDY))
    assert [tokens for tokens, _ in results] == reference
    if layout.get("num_speculative_tokens"):
        assert status.spec_draft_tokens > 0 and status.spec_drafts > 0
    assert all(last.finish_reason == "length" for _, last in results)
    assert status.num_free_blocks == status.num_blocks and status.num_running == 0
    assert status.recoveries == 0 and status.step_resets == 0  # (a recomputation would hide a stage's error)


def test_prompt_chunks_hand_their_mlp_to_the_next_stage_and_the_tokens_stay(model, reference):
    """A split that leaves the first stage three layers to one: the coordinator hands the third
    layer's MLP of every chunk of prompt tokens to the last stage (which holds it too), not decodes."""
    mesh = mesh_for(model[0], pp=2, layer_partition=(3, 1), max_batched_tokens=8)
    results, status = run(generate_all(mesh, PROMPTS, GREEDY))
    assert [tokens for tokens, _ in results] == reference
    assert 0 < status.mlp_handoff_steps < status.steps
    assert status.recoveries == 0 and status.step_resets == 0

    async def timeline():
        client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
        try:
            for _ in range(40):  # (the workers' spans come with their heartbeats, twice a second)
                reply = await client.status(timeline=True)
                if sum(len(s) for s in reply.stage_spans) >= 2 * reply.steps:
                    return reply
                await asyncio.sleep(0.25)
            raise AssertionError(f"the stages' spans of {reply.steps} steps did not all come in 10 s")
        finally:
            await client.close()

    reply = run(timeline())
    # both workers took the hand-off the schedules asked for (the first stage's span lists the layer
    # it stopped before the MLP, the last stage's the MLP it ran); the tokens above show it computed
    asked = {s.step_id for s in reply.coordinator_spans if s.mlp_handoff == [2]}
    assert len(asked) == reply.mlp_handoff_steps
    for spans in reply.stage_spans:
        assert {s.step_id for s in spans if s.mlp_handoff == [2]} == asked


def test_seeded_sampling_is_the_same_in_any_layout_and_batch(model):
    seeded = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(6)]
    prompts = PROMPTS[:6]
    alone = [run(generate_all(mesh_for(model[0], pp=1), [p], [sp]))[0][0][0] for p, sp in zip(prompts[:2], seeded)]
    together_pp1 = [t for t, _ in run(generate_all(mesh_for(model[0], pp=1), prompts, seeded))[0]]
    # a different batch mix: greedy companions, reversed order, on two stages
    mixed = list(reversed(prompts)) + PROMPTS[6:10]
    mixed_params = list(reversed(seeded)) + [GREEDY] * 4
    together_pp2 = [t for t, _ in run(generate_all(mesh_for(model[0], pp=2), mixed, mixed_params))[0]][:6][::-1]
    assert together_pp1 == together_pp2
    assert together_pp1[:2] == alone
    assert len({tuple(t) for t in together_pp1}) > 1  # really sampled


def test_preemption_with_a_small_kv_pool(model, reference):
    # 64 requests; the pool holds far fewer at once: sequences are preempted and recomputed
    prompts = [PROMPTS[i % 16] for i in range(64)]
    mesh = mesh_for(model[0], pp=2, kv_memory=160 * 1024, block_size=4)
    results, status = run(generate_all(mesh, prompts, GREEDY))
    assert [t for t, _ in results] == [reference[i % 16] for i in range(64)]
    assert status.num_preemptions > 0
    assert status.prefix_cache_hits > 0  # the repeated prompts shared blocks, preempted or not
    assert status.num_free_blocks == status.num_blocks  # every block came back


def test_abort_frees_blocks_and_spares_the_others(model, reference):
    async def scenario():
        mesh = mesh_for(model[0], pp=2)
        client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
        try:
            await client.wait_serving(timeout=120)
            long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            victim = client.generate(PROMPTS[3], long, request_id="x")
            first = await victim.__anext__()  # it is running
            others = asyncio.gather(*(collect(client, p, GREEDY) for p in PROMPTS[:4]))
            await victim.aclose()  # leaving the stream aborts the request
            # its id at once again, for another prompt: none of the aborted request's outputs, nor its end
            # (they went to the new stream, which ended "abort" after a token, the old request running on)
            again = []
            async for out in client.generate(PROMPTS[1], GREEDY, request_id="x"):
                again += out.token_ids
            results = await others
            with pytest.raises(ValueError, match="at most 256"):  # (refused under an id cut short: it hung)
                await client.generate(PROMPTS[1], GREEDY, request_id="y" * 300).__anext__()
            # an abort the coordinator has no request for (over already, or never had) is answered too: the
            # id is free at once, not after the client's wait
            client.abort("never-sent")
            client.closing["never-sent"] = (time.monotonic() + 30, asyncio.Event())
            answered = await asyncio.wait_for(client.closing["never-sent"][1].wait(), 5)
            for _ in range(50):
                st = await client.status()
                if st.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            return first, again, results, st, answered
        finally:
            await client.close()

    first, again, results, status, answered = run(scenario())
    assert answered is True
    assert first.token_ids and first.finish_reason is None
    assert again == reference[1]
    assert [t for t, _ in results] == reference[:4]
    assert status.num_free_blocks == status.num_blocks and status.num_running == 0


def test_malformed_messages_do_not_crash_any_process(model, reference):
    mesh = mesh_for(model[0], pp=2)
    ctx = zmq.Context()
    try:
        run(generate_all(mesh, PROMPTS[:1], GREEDY))  # serving
        client_addr = mesh.client_address
        junk = [[b"\x00garbage"], [b"\x92\x01\x02"], [b""], [b"\x81\xa4type\xa8generate"], [b"\xc1"] * 3,
                [__import__("msgspec").msgpack.encode({"type": "generate", "request_id": "x", "prompt_ids": [1],
                                                        "params": {"top_p": 7.0}})]]
        keys = Path(mesh.coordinator.mesh_keys)  # hostile peers that hold keys: the decoders must hold
        server = zmq.auth.load_certificate(keys / "server.key")[0]

        def keyed(sock, role):
            sock.curve_serverkey = server
            sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(keys / f"{role}.key_secret")
            return sock
        for frames in junk:
            s = keyed(ctx.socket(zmq.DEALER), "client")
            s.connect(client_addr)
            s.send_multipart(frames)
            s.close(linger=1000)
        worker_addr = mesh.worker_address
        for frames in junk + [[__import__("msgspec").msgpack.encode({"type": "result", "step_id": 99999,
                                                                       "sampled": []})]]:
            s = keyed(ctx.socket(zmq.DEALER), "worker")
            s.setsockopt(zmq.IDENTITY, b"intruder")
            s.connect(worker_addr)
            s.send_multipart(frames)
            s.close(linger=1000)
        time.sleep(0.5)
        results, status = run(generate_all(mesh, PROMPTS, GREEDY))
        assert [t for t, _ in results] == reference
        assert status.malformed_messages >= len(junk)
        assert mesh.died is None
    finally:
        ctx.destroy(linger=0)


SEEDED = [SamplingParams(max_tokens=40, temperature=0.8, seed=500 + i, ignore_eos=True) for i in range(16)]
LONG_GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("pp,victim", [(2, 1), (3, 1)], ids=["last-of-2", "middle-of-3"])
def test_a_killed_stage_worker_is_replaced_and_no_request_is_lost(model, pp, victim):
    """SIGKILL a stage worker during 32 streaming requests (16 greedy, 16 seeded at temperature 0.8):
    the launcher restarts it, the coordinator recovers, and every stream completes with the same
    tokens as an undisturbed run, none repeated or skipped."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    # 80 tokens: the kill below lands ~76 tokens (150-230 steps) before the streams end, so they are still running
    # (requests_resumed > 0) even when this process sees their tokens late on a loaded machine
    params = [msgspec.structs.replace(p, max_tokens=80) for p in [LONG_GREEDY] * 16 + SEEDED]

    async def scenario():
        mesh = LocalMesh.of(EngineSettings(model=str(model[0]), pp=pp, kv_memory=KV, mesh_keys=keys_for(model[0])),
                            worker_timeout=2.0)
        mesh.start()
        client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
        try:
            await client.wait_serving(timeout=120)
            undisturbed = await asyncio.gather(*(collect(client, p, sp) for p, sp in zip(prompts, params)))
            tasks, got = stream_all(client, prompts, params)
            while sum(map(len, got)) < 32 * 4:  # every stream is under way
                await asyncio.sleep(0.01)
            mesh.kill(f"stage-worker pp={victim} tp=0")
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
            status = await client.status()
            return [t for t, _ in undisturbed], got, status, time.monotonic() - killed, mesh.died, sum(map(len, mesh.restarts.values()))
        finally:
            await client.close()
            mesh.stop()

    want, got, status, seconds, died, restarts = run(scenario())
    assert got == want
    assert all(len(t) == 80 for t in got)
    assert status.recoveries == 1 and status.requests_resumed > 0 and status.phase == "serving"
    assert status.workers_replaced == 1
    assert died is None and restarts == 1
    assert status.num_free_blocks == status.num_blocks


def test_a_stalled_coordinator_loses_no_output(model):
    """The coordinator stopped (SIGSTOP) for longer than the links' heartbeat timeout (3 s) during 16
    greedy streams: its links to the client and the workers drop and come back (the returning peer
    takes its identity over), outputs queued on the dropped link are asked for again, and a lost
    schedule or result resets the pipeline at once rather than after --step-timeout. Every stream
    completes with the same tokens as an undisturbed run, none repeated or skipped, and no worker
    is replaced (the stall was the coordinator's own, not its workers' silence)."""
    import os
    import signal

    prompts, params = PROMPTS, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)

    async def scenario():
        mesh = LocalMesh.of(EngineSettings(model=str(model[0]), pp=2, kv_memory=KV, mesh_keys=keys_for(model[0])))
        mesh.start()
        client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
        try:
            await client.wait_serving(timeout=120)
            undisturbed = await asyncio.gather(*(collect(client, p, params) for p in prompts))
            tasks, got = stream_all(client, prompts, [params] * len(prompts))
            while sum(map(len, got)) < 16 * 4:
                await asyncio.sleep(0.005)
            pid = mesh.procs["coordinator"].pid
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(4.5)
            os.kill(pid, signal.SIGCONT)
            resumed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
            return [t for t, _ in undisturbed], got, await client.status(), time.monotonic() - resumed, client.resends
        finally:
            await client.close()
            mesh.stop()

    want, got, status, seconds, resends = run(scenario())
    assert got == want and all(len(t) == 120 for t in got)
    assert status.workers_replaced == 0 and status.phase == "serving"
    assert resends > 0  # (the client's link did drop)
    assert seconds < 60  # (nothing waited for the 120 s step deadline)
    assert status.num_free_blocks == status.num_blocks

def test_a_stopped_coordinator_lets_its_requests_finish_and_refuses_new_ones(model, reference):
    """SIGTERM to the coordinator mid-stream (a `docker stop`): the status says stopping, a new request
    is refused (503), the streams in flight finish with the tokens of an undisturbed run, and then
    the coordinator ends (status 0), well before --drain-timeout."""
    import signal

    prompts, params = PROMPTS[:4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def scenario():
        async with _serving_mesh(model, drain_timeout=60.0) as (mesh, client):
            tasks, got = stream_all(client, prompts, [params] * len(prompts))
            while min(map(len, got)) < 2:
                await asyncio.sleep(0.005)
            mesh.procs["coordinator"].send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            status = await client.status()
            while status.phase != "stopping":
                status = await client.status()
            refused = [out async for out in client.generate(prompts[0], params)]
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            code = await asyncio.to_thread(mesh.procs["coordinator"].wait, 30)
            return got, status, refused, code, time.monotonic() - stopped

    got, status, refused, code, seconds = run(scenario())
    assert all(len(t) == 40 for t in got)
    assert [t[:NEW] for t in got] == reference[:4]  # (greedy: the first tokens are the undisturbed run's)
    assert status.serving is False and status.phase == "stopping"
    (out,) = refused
    assert out.error_status == 503 and "stopping" in out.error
    assert code == 0 and seconds < 50


def test_a_drain_that_runs_out_ends_the_unfinished_requests_with_503(model):
    """Past --drain-timeout the requests still running end with a 503 that says why, before the
    coordinator ends: no stream is left waiting on a coordinator that is gone."""
    import signal

    params = SamplingParams(max_tokens=230, temperature=0, ignore_eos=True)

    async def scenario():
        async with _serving_mesh(model, drain_timeout=0.1) as (mesh, client):
            streams = [client.generate(p, params) for p in PROMPTS[:4]]
            first = [await s.__anext__() for s in streams]
            mesh.procs["coordinator"].send_signal(signal.SIGTERM)
            ends = [await asyncio.wait_for(_last(s), timeout=30) for s in streams]
            code = await asyncio.to_thread(mesh.procs["coordinator"].wait, 30)
            return first, ends, code

    first, ends, code = run(scenario())
    assert all(f.token_ids for f in first) and code == 0
    assert all(e.error_status == 503 and "--drain-timeout" in e.error for e in ends)


@contextlib.asynccontextmanager
async def _serving_mesh(model, **changes):
    """A pp=1 mesh of its own (stopped after) and a client of it, once it serves."""
    mesh = LocalMesh.of(EngineSettings(model=str(model[0]), kv_memory=KV, mesh_keys=keys_for(model[0])), **changes)
    mesh.start()
    client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
    try:
        await client.wait_serving(timeout=120)
        yield mesh, client
    finally:
        await client.close()
        mesh.stop()


async def _last(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_the_client_hands_over_outputs_in_order_each_token_once():
    """Outputs past a gap wait while the missing ones are asked for again (once per gap); repeats are
    trimmed; an error ends the stream at once; a coordinator that does not count (start -1) is
    taken as it comes; a request the coordinator never had is sent again while nothing of it was
    shown."""
    from moemesh.client import _Stream
    from moemesh.protocol import (UNKNOWN_REQUEST, ClientMessage, Codec, GenerateRequest, RequestOutput,
                                  ResendRequest, TokenLogprobs)

    async def scenario():
        ctx = zmq.asyncio.Context()
        peer = ctx.socket(zmq.ROUTER)
        port = peer.bind_to_random_port("tcp://127.0.0.1")
        client = CoordinatorClient(f"tcp://127.0.0.1:{port}", ctx=ctx)
        try:
            await client.status(timeout=0.2)
        except asyncio.TimeoutError:
            pass  # (it connected: the request reached the peer, which does not answer)
        await peer.recv_multipart()
        st = _Stream()

        def out(start, tokens, finish=None, error=None):
            lps = [TokenLogprobs(t, -1.0, []) for t in tokens]
            return RequestOutput("r", tokens, lps, finish_reason=finish, error=error, start=start)

        def taken():
            got = []
            while not st.queue.empty():
                got.append(st.queue.get_nowait())
            return got

        client._arrive("r", st, out(0, [1, 2]))
        client._arrive("r", st, out(4, [5, 6]))  # 3, 4 were lost
        client._arrive("r", st, out(6, [7]))
        assert [o.token_ids for o in taken()] == [[1, 2]] and st.asked
        ask, = [Codec(ResendRequest).decode((await peer.recv_multipart())[1:])[0]]
        assert ask == ResendRequest("r", 2)
        client._arrive("r", st, out(1, [2, 3, 4, 5]))  # the resend (overlapping both sides)
        got = taken()
        assert [t for o in got for t in o.token_ids] == [3, 4, 5, 6, 7] and not st.asked
        assert [lp.token_id for o in got for lp in o.logprobs] == [3, 4, 5, 6, 7]
        client._arrive("r", st, out(3, [4, 5]))  # a repeat: nothing
        client._arrive("r", st, out(7, [], finish="length"))
        assert [(o.token_ids, o.finish_reason) for o in taken()] == [([], "length")] and st.received == 7
        other = _Stream()
        client._arrive("s", other, out(5, [9]))
        client._arrive("s", other, msgspec.structs.replace(out(0, [], finish="error", error="down"), request_id="s"))
        assert [o.error for o in taken_of(other)] == ["down"]
        plain = _Stream()
        client._arrive("t", plain, out(-1, [8]))
        assert [o.token_ids for o in taken_of(plain)] == [[8]]
        # a request the coordinator never had (lost with a link), nothing of it shown: sent again, once;
        # it had been asked for twice (two links came back) before the first "not known" came
        request = GenerateRequest("u", [5, 6], SamplingParams(max_tokens=2))
        lost = _Stream(request=request, unanswered=2)
        unknown = RequestOutput("u", [], finish_reason="error", error="not known", error_status=UNKNOWN_REQUEST,
                                start=0)
        client._arrive("u", lost, unknown)
        assert taken_of(lost) == []
        sent = [Codec(ClientMessage).decode((await peer.recv_multipart())[1:])[0] for _ in range(2)]
        assert sent == [ResendRequest("s", 0), request]  # (the second stream's gap above, then this)
        client._arrive("u", lost, unknown)  # (the answer to an ask sent before it went again: it runs now)
        assert taken_of(lost) == []
        client._arrive("u", lost, unknown)  # after those, "not known" again: lost again, the stream ends
        assert [(o.error, o.error_status) for o in taken_of(lost)] == [("not known", 503)]
        shown = _Stream(request=GenerateRequest("v", [5], SamplingParams(max_tokens=2)), received=1)
        client._arrive("v", shown, msgspec.structs.replace(unknown, request_id="v"))  # some of it was shown
        assert [(o.error, o.error_status) for o in taken_of(shown)] == [("not known", 503)]
        await client.close()
        ctx.destroy(linger=0)

    def taken_of(stream):
        got = []
        while not stream.queue.empty():
            got.append(stream.queue.get_nowait())
        return got

    run(scenario())

def test_streams_left_open_at_close_end_quietly(caplog):
    """A stream still open when its client closes (its consumer cancelled with the event loop) has no
    link to send its abort on: it ends without a warning. Before close, a stream left early sends one."""
    from moemesh.protocol import AbortRequest, ClientMessage, Codec

    async def scenario():
        ctx = zmq.asyncio.Context()
        peer = ctx.socket(zmq.ROUTER)
        port = peer.bind_to_random_port("tcp://127.0.0.1")
        client = CoordinatorClient(f"tcp://127.0.0.1:{port}", ctx=ctx)
        left = client.generate([5, 6], GREEDY)
        first = asyncio.ensure_future(left.__anext__())
        await peer.recv_multipart()  # (the request)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await left.aclose()  # left early: the coordinator is asked to end it
        abort = Codec(ClientMessage).decode((await peer.recv_multipart())[1:])[0]
        assert isinstance(abort, AbortRequest)
        open_at_close = client.generate([7], GREEDY)
        pending = asyncio.ensure_future(open_at_close.__anext__())
        await peer.recv_multipart()
        await client.close()
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await open_at_close.aclose()
        peer.close(linger=0)
        ctx.destroy(linger=0)

    with caplog.at_level("WARNING", logger="moemesh.client"):
        run(scenario())
    assert not [r for r in caplog.records if r.name == "moemesh.client"]


# 460 tokens (+ 40 new: within the model's 512 positions), prefilled in chunks of what an 8-token
# budget leaves beside the seven short streams' decodes, with no prefix cache (the undisturbed run
# before would leave all but its last block cached, and its "prefill" would take two steps: how a
# CI run came to see it finished before the kill). Once every request is running (steps ~14-80), its
# prefill has 43-110 steps to go (its first token comes near step 123), so the kill lands in it even
# when this process sees the tokens late.
LONG_PROMPT = [5 + i % 290 for i in range(460)]


@pytest.mark.parametrize("scenario", ["first-stage-during-chunked-prefill", "two-kills-in-a-row"])
def test_more_kills_lose_no_request(model, scenario):
    """The first stage killed while a long prompt is being prefilled in chunks; or two stage
    workers killed one after the other (the second once the first recovery is done)."""
    if scenario == "two-kills-in-a-row":
        pp, settings, prompts = 3, dict(), [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    else:
        pp, prompts = 2, PROMPTS[:7] + [LONG_PROMPT]  # the long one last
        settings = dict(max_batched_tokens=8, no_prefix_caching=True)
    params = [SEEDED[i % 16] if i % 2 else LONG_GREEDY for i in range(len(prompts))]

    async def scenario_run():
        mesh = LocalMesh.of(EngineSettings(model=str(model[0]), pp=pp, kv_memory=KV, mesh_keys=keys_for(model[0]),
                                           **settings), worker_timeout=2.0)
        mesh.start()
        client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
        try:
            await client.wait_serving(timeout=120)
            undisturbed = await asyncio.gather(*(collect(client, p, sp) for p, sp in zip(prompts, params)))
            tasks, got = stream_all(client, prompts, params)
            while not any(got):
                await asyncio.sleep(0.005)
            if scenario == "two-kills-in-a-row":
                mesh.kill("stage-worker pp=1 tp=0")
                while (await client.status()).recoveries < 1 or not (await client.status()).serving:
                    await asyncio.sleep(0.05)
                mesh.kill("stage-worker pp=2 tp=0")
            else:
                while (await client.status()).num_running < len(prompts):  # the long one's prefill has begun
                    # (every request runs from about step 14 until the first short stream ends, near step 80)
                    assert not any(len(g) == 40 for g in got[:-1]), "a short stream ended before all were running"
                    await asyncio.sleep(0.005)
                assert not got[-1], "the long prompt was to be still in prefill"
                mesh.kill("stage-worker pp=0 tp=0")
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            return [t for t, _ in undisturbed], got, await client.status()
        finally:
            await client.close()
            mesh.stop()

    want, got, status = run(scenario_run())
    assert got == want and all(len(t) == 40 for t in got)
    assert status.recoveries == (2 if scenario == "two-kills-in-a-row" else 1)
    assert status.num_free_blocks == status.num_blocks


def test_a_request_lost_again_after_it_was_sent_again_ends_its_stream():
    """Asks a held request never answered, and a second loss after it went again: each "not known" that
    may be stale is followed by a fresh ask, so the stream ends (503) instead of waiting forever."""
    from moemesh.client import _Stream
    from moemesh.protocol import UNKNOWN_REQUEST, GenerateRequest, RequestOutput, ResendRequest

    async def scenario():
        client = CoordinatorClient("tcp://127.0.0.1:9")
        sent = []
        client._send_now = lambda msg: sent.append(msg) or True
        request = GenerateRequest("u", [5, 6], SamplingParams(max_tokens=2))
        st = _Stream(request=request)
        unknown = RequestOutput("u", [], finish_reason="error", error="not known", error_status=UNKNOWN_REQUEST,
                                start=0)
        client._ask_again("u", st)  # a link came back while the request was held: no answer comes
        client._ask_again("u", st)  # again; the coordinator restarted: "not known"
        client._arrive("u", st, unknown)
        assert sent[-1] == request and st.resubmitted and st.queue.empty()  # sent again
        client._ask_again("u", st)  # the coordinator restarted again: lost again, "not known"
        asks = len(sent)
        client._arrive("u", st, unknown)  # (may be stale: swallowed, and asked afresh)
        assert st.queue.empty() and sent[asks:] == [ResendRequest("u", 0)]
        client._arrive("u", st, unknown)  # the fresh ask's answer: the request is gone
        got = st.queue.get_nowait()
        await client.close()
        return got

    out = run(scenario())
    assert (out.error, out.error_status) == ("not known", 503)


def test_an_abort_sent_while_the_coordinator_is_away_reaches_it_when_it_is_back():
    """The gateway ends a silent coordinator's requests after COORDINATOR_LOST and aborts them: with
    the link down, ZeroMQ queues the aborts (the client's socket keeps its queue across reconnects), so
    a coordinator that comes back at that address does not go on computing them for nobody."""
    import zmq
    import zmq.asyncio

    from moemesh.protocol import AbortRequest, ClientMessage, Codec, StatusRequest

    async def scenario():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = CoordinatorClient(f"tcp://127.0.0.1:{port}", ctx=ctx)
        codec = Codec(ClientMessage)
        try:
            await client.sock.send_multipart(Codec.encode(StatusRequest(False, 1)))
            first = codec.decode((await asyncio.wait_for(router.recv_multipart(), 10))[1:])[0]
            router.close(linger=0)  # the coordinator goes away
            await asyncio.sleep(0.5)
            client.abort("r7")  # (while it is away)
            back = ctx.socket(zmq.ROUTER)
            back.bind(f"tcp://127.0.0.1:{port}")
            got = codec.decode((await asyncio.wait_for(back.recv_multipart(), 15))[1:])[0]
            back.close(linger=0)
            return first, got
        finally:
            await client.close()
            ctx.destroy(linger=0)

    first, got = asyncio.run(scenario())
    assert isinstance(first, StatusRequest) and got == AbortRequest("r7")
