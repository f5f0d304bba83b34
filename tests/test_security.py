"""The authenticated mesh: CurveZMQ keys on every mesh socket, strangers refused at every port
(never reaching a decoder), the exposure rule, message-size limits, and hostile messages fed to a
live mesh's every socket (hypothesis, bounded, derandomized)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_models import build_hf_model
from moemesh.client import CoordinatorClient
from moemesh.entrypoints.engine import LLMEngine
from moemesh.entrypoints.launcher import LocalMesh
from moemesh.errors import ConfigError
from moemesh.mesh_security import MeshKeys, address_host, check_exposure, is_loopback, make_keys
from moemesh.netutil import run
from moemesh.protocol import Codec, StatusRequest
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings

PROMPTS = [[(5 * i + 2 * j) % 300 + 4 for j in range(2 + (3 * i) % 11)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
DEMO_MODEL = str(Path(__file__).resolve().parents[1] / "moemesh" / "demo_model")
FUZZ = settings(max_examples=60, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# -- keys and the exposure rule -----------------------------------------------------------------

def test_keys_have_zmq_auths_layout_and_are_never_overwritten(tmp_path):
    d = make_keys(tmp_path / "k")
    names = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert names == ["client.key", "client.key_secret", "clients/client.key", "server.key", "server.key_secret",
                     "worker.key", "worker.key_secret", "workers/worker.key"]
    for role in ("server", "worker", "client"):
        public, secret = zmq.auth.load_certificate(d / f"{role}.key_secret")
        assert secret and zmq.auth.load_certificate(d / f"{role}.key")[0] == public
        assert (d / f"{role}.key_secret").stat().st_mode & 0o077 == 0  # the owner's alone
    assert set(zmq.auth.load_certificates(d / "workers")) == {zmq.auth.load_certificate(d / "worker.key")[0]}
    with pytest.raises(ConfigError, match="already holds mesh keys"):
        make_keys(d)
    out = subprocess.run([sys.executable, "-m", "moemesh", "keys", "--out", str(d)], capture_output=True, text=True)
    assert out.returncode == 2 and "already holds mesh keys" in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(ConfigError, match="--mesh-keys .*no such directory"):
        MeshKeys(tmp_path / "missing")
    (d / "worker.key_secret").unlink()  # left out of a copy to another host: named, with where to get it
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        with pytest.raises(ConfigError, match="no worker.key_secret there; copy it from the directory"):
            MeshKeys(d).connect(sock, "worker")
        gateway_host = make_keys(tmp_path / "g")  # a gateway's host: server.key and client.key_secret
        (gateway_host / "server.key").unlink()
        (gateway_host / "server.key_secret").unlink()
        with pytest.raises(ConfigError, match="no server.key there") as refused:  # (not its secret: no need)
            MeshKeys(gateway_host).connect(sock, "client")
        assert "key_secret" not in str(refused.value)
    finally:
        sock.close(linger=0)


def test_an_allowed_set_others_can_write_to_is_refused_and_a_readable_secret_is_named(tmp_path, caplog):
    """Whoever can write to DIR, DIR/workers or DIR/clients (or a key in them) could let their own key
    in: a listening process refuses to start, naming the path and the flag; a secret key others can
    read is said once, with the chmod that mends it. make_keys gives safe modes whatever the umask."""
    old = os.umask(0o002)
    try:
        d = make_keys(tmp_path / "k")
    finally:
        os.umask(old)
    MeshKeys(d).check_allowed_sets()
    for path in (d, d / "workers", d / "clients" / "client.key"):
        path.chmod(path.stat().st_mode | 0o020)
        with pytest.raises(ConfigError, match=f"--mesh-keys .*{path} is writable by group or others"):
            MeshKeys(d).check_allowed_sets()
        path.chmod(path.stat().st_mode & ~0o022)
    (d / "worker.key_secret").chmod(0o644)
    keys = MeshKeys(d)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        keys.connect(sock, "worker")
        keys.connect(sock, "worker")
    finally:
        sock.close(linger=0)
    warned = [r for r in caplog.records if r.getMessage() == "secret mesh key readable by others"]
    assert len(warned) == 1 and warned[0].fields["hint"] == f"chmod 600 {d / 'worker.key_secret'}"
    (d / "clients").chmod(0o777)
    out = subprocess.run([sys.executable, "-m", "moemesh", "coordinator", "--model", DEMO_MODEL, "--mesh-keys",
                          str(d), "--port", "0", "--client-port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "clients is writable by group or others" in out.stderr
    assert "Traceback" not in out.stderr

def test_each_host_works_with_only_the_key_files_deploy_readme_gives_it(tmp_path):
    """`moemesh keys --gateway-out --stage-out` (deploy/README.md, the compose files) hands a stage host
    server.key, server.key_secret, worker.key_secret and workers/, and a gateway host server.key and
    client.key_secret, nothing more: with only those, a stage host's activation socket takes a worker's
    message and a gateway host's client connects (and its client key is refused on a workers socket).
    Run again, the copies follow the allowed sets."""
    import shutil
    import stat

    from moemesh.entrypoints.cli import main
    from moemesh.mesh_security import MeshGuard

    full, stage_host, gateway_host = tmp_path / "full", tmp_path / "stage-host", tmp_path / "gateway-host"
    argv = ["keys", "--out", str(full), "--gateway-out", str(gateway_host), "--stage-out", str(stage_host)]
    assert main(argv) == 0

    def files(d):
        return {str(p.relative_to(d)): stat.S_IMODE(p.stat().st_mode) for p in d.rglob("*")}

    assert files(gateway_host) == {"server.key": 0o644, "client.key_secret": 0o600}
    assert files(stage_host) == {"server.key": 0o644, "server.key_secret": 0o600, "worker.key_secret": 0o600,
                                 "workers": 0o755, "workers/worker.key": 0o644}
    with pytest.raises(ConfigError, match="no worker.key_secret"):
        MeshKeys(gateway_host).connect(zmq.Context.instance().socket(zmq.DEALER), "worker")
    with pytest.raises(ConfigError, match="no client.key_secret"):
        MeshKeys(stage_host).connect(zmq.Context.instance().socket(zmq.DEALER), "client")
    old_umask = os.umask(0)  # (a copy is born with its own mode, whatever the umask; a directory's mode stays)
    try:
        gateway_host.chmod(0o700)
        (gateway_host / "client.key_secret.tmp").write_text("left by a run cut short")
        assert main([*argv, "--if-missing"]) == 0
    finally:
        os.umask(old_umask)
    assert files(gateway_host) == {"server.key": 0o644, "client.key_secret": 0o600}
    assert stat.S_IMODE(gateway_host.stat().st_mode) == 0o700
    shutil.copyfile(full / "workers" / "worker.key", full / "workers" / "worker-2.key")  # a key allowed, then not
    assert main([*argv, "--if-missing"]) == 0 and (stage_host / "workers" / "worker-2.key").is_file()
    (full / "workers" / "worker-2.key").unlink()
    assert main([*argv, "--if-missing"]) == 0 and not (stage_host / "workers" / "worker-2.key").exists()
    with pytest.raises(SystemExit):  # (without --if-missing: keys there are not overwritten)
        main(argv)

    async def scenario():
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        guard = MeshGuard(ctx, str(stage_host))  # a stage host: its activation socket
        pull = ctx.socket(zmq.PULL)
        guard.serve(pull, "workers")
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        guard.connect(push, "worker")  # the previous stage, from its own copy of the same files
        push.connect(f"tcp://127.0.0.1:{port}")
        await push.send_multipart([b"activations"])
        got = await asyncio.wait_for(pull.recv_multipart(), 10)
        client_side = ctx.socket(zmq.PUSH)  # a gateway host's key on a workers socket: refused
        MeshKeys(gateway_host).connect(client_side, "client")
        client_side.connect(f"tcp://127.0.0.1:{port}")
        await client_side.send_multipart([b"injected"])
        await asyncio.sleep(1.0)
        assert await pull.poll(100) == 0  # nothing of it arrived
        refused = guard.refused
        guard.close()
        ctx.destroy(linger=0)
        return got, refused

    got, refused = asyncio.run(scenario())
    assert got == [b"activations"] and refused >= 1
    # a stage host given no workers/ would refuse every handshake on its activation socket: it does not start
    shutil.rmtree(stage_host / "workers")

    async def without_allowed_keys():
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        guard = MeshGuard(ctx, str(stage_host))
        try:
            with pytest.raises(ConfigError, match="no workers/ directory"):
                guard.serve(ctx.socket(zmq.PULL), "workers")
        finally:
            guard.close()
            ctx.destroy(linger=0)

    asyncio.run(without_allowed_keys())


def test_only_loopback_is_allowed_without_keys():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("*") and not is_loopback("10.0.0.2")
    assert address_host("tcp://[::1]:5") == "::1" and address_host("tcp://coordinator:5555") == "coordinator"
    check_exposure(None, False, host="127.0.0.1", coordinator="tcp://127.0.0.1:5555")
    check_exposure("/keys", False, host="0.0.0.0")
    check_exposure(None, True, host="0.0.0.0")
    with pytest.raises(ConfigError, match="--coordinator tcp://10.0.0.1:5555 is not loopback.*--mesh-keys.*--insecure-mesh"):
        check_exposure(None, False, host="127.0.0.1", coordinator="tcp://10.0.0.1:5555")


def test_a_mesh_exposed_without_keys_on_purpose_says_so_at_start(caplog):
    """--insecure-mesh lets a mesh socket beyond loopback go without keys, and warns, naming the flag
    (loopback, or keys, say nothing)."""
    import logging

    with caplog.at_level(logging.WARNING):
        check_exposure(None, True, host="127.0.0.1", coordinator="tcp://127.0.0.1:5555")
        check_exposure("/keys", False, host="0.0.0.0")
        assert "insecure-mesh" not in caplog.text
        check_exposure(None, True, warn=False, data_address="tcp://10.0.0.2:5")  # (a check that repeats)
        assert "insecure-mesh" not in caplog.text
        check_exposure(None, True, host="127.0.0.1", coordinator="tcp://10.0.0.1:5555")
    [record] = [r for r in caplog.records if "--insecure-mesh" in r.getMessage()]
    assert record.fields == {"flag": "--coordinator", "address": "tcp://10.0.0.1:5555"}


@pytest.mark.parametrize("argv", [
    ["coordinator", "--model", "{model}", "--host", "0.0.0.0", "--port", "0", "--client-port", "0"],
    ["stage-worker", "--coordinator", "tcp://127.0.0.1:1", "--pp-rank", "0", "--host", "0.0.0.0"],
    ["gateway", "--coordinator", "tcp://192.0.2.1:5556"],
], ids=["coordinator", "stage-worker", "gateway"])
def test_a_process_exposed_without_keys_refuses_to_start_naming_both_flags(argv, tmp_path):
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

    model = write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=2), tmp_path / "m")
    out = subprocess.run([sys.executable, "-m", "moemesh", *[a.format(model=model) for a in argv]],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "MOEMESH_LOG_LEVEL": "error"})
    assert out.returncode == 2, out.stderr
    assert "--mesh-keys" in out.stderr and "--insecure-mesh" in out.stderr and "Traceback" not in out.stderr


# -- a mesh with keys ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("secure-model")
    build_hf_model("mixtral", path)
    return path


@pytest.fixture(scope="module")
def reference(model):
    engine = LLMEngine(EngineSettings(model=str(model), num_kv_blocks=128), progress=False)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("mesh") / "keys")


@pytest.fixture(scope="module")
def mesh(model, keys):
    with LocalMesh.of(EngineSettings(model=str(model), pp=2, kv_memory=16 << 20, mesh_keys=str(keys))) as m:
        yield m


async def _greedy_tokens(client: CoordinatorClient, prompt: list[int]) -> list[int]:
    tokens = []
    async for out in client.generate(prompt, GREEDY):
        assert not out.error, out.error
        tokens += out.token_ids
    return tokens


async def _generate(mesh, keys, prompts=PROMPTS):
    client = CoordinatorClient(mesh.client_address, mesh_keys=str(keys))
    try:
        await client.wait_serving(timeout=120)
        results = await asyncio.gather(*(_greedy_tokens(client, p) for p in prompts))
        return results, await client.status()
    finally:
        await client.close()


def _activation_port(mesh: LocalMesh, stage: int) -> int:
    """The port a stage worker's activation socket listens on (its one listening TCP socket)."""
    pid = mesh.procs[f"stage-worker pp={stage} tp=0"].pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = [int(line.split()[1].split(":")[1], 16) for line in open("/proc/net/tcp").read().splitlines()[1:]
             if line.split()[3] == "0A" and line.split()[9] in inodes]
    assert len(ports) == 1, ports
    return ports[0]


def _answered(address: str, kind: int, frames: list[bytes], curve: tuple | None = None, wait_ms: int = 800) -> bool:
    """Sends `frames` from a fresh socket (CURVE with (server key, public, secret) if given); whether
    anything came back."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(kind)
        s.linger = 0
        if curve:
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve
        s.connect(address)
        try:
            s.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        if kind == zmq.PUSH:  # nothing comes back on a PUSH: give the handshake time to be refused
            time.sleep(wait_ms / 1000)
            return False
        return bool(s.poll(wait_ms))
    finally:
        ctx.destroy(linger=0)


def test_a_mesh_with_keys_gives_the_same_tokens(mesh, keys, reference):
    results, status = run(_generate(mesh, keys))
    assert results == reference and status.serving


def test_strangers_get_no_answer_from_any_port_and_reach_no_decoder(mesh, keys, reference):
    run(_generate(mesh, keys, PROMPTS[:1]))
    before = run(_generate(mesh, keys, PROMPTS[:1]))[1]
    server_public = zmq.auth.load_certificate(keys / "server.key")[0]
    stranger = (server_public, *zmq.curve_keypair())  # a well-formed key nobody allowed
    worker_key = (server_public, *zmq.auth.load_certificate(keys / "worker.key_secret"))
    status_request = Codec.encode(StatusRequest())
    generate = [msgspec.msgpack.encode({"type": "generate", "request_id": "x", "prompt_ids": [5, 6],
                                        "params": {"max_tokens": 2}})]
    register = [msgspec.msgpack.encode({"type": "register", "pp_rank": 1, "tp_rank": 0, "data_address": "tcp://x:1",
                                        "device": "cpu", "pid": 1})]
    activations = [msgspec.msgpack.encode({"type": "activations", "step_id": 10 ** 9, "tensors": []})]
    act = f"tcp://127.0.0.1:{_activation_port(mesh, 1)}"
    client_key = (server_public, *zmq.auth.load_certificate(keys / "client.key_secret"))
    groups = {  # each port's probes, then that port's refusals counted
        "client port": [(mesh.client_address, zmq.DEALER, status_request, None),
                        (mesh.client_address, zmq.DEALER, generate, None),
                        (mesh.client_address, zmq.DEALER, status_request, stranger),
                        (mesh.client_address, zmq.DEALER, status_request, worker_key)],  # not a client's key
        "worker port": [(mesh.worker_address, zmq.DEALER, register, None),
                        (mesh.worker_address, zmq.DEALER, register, stranger),
                        (mesh.worker_address, zmq.DEALER, register, client_key)],  # not a worker's key
        "activation port": [(act, zmq.PUSH, activations, None), (act, zmq.PUSH, activations, stranger),
                            (act, zmq.PUSH, activations, client_key)],
    }
    for port, probes in groups.items():
        counted = run(_generate(mesh, keys, PROMPTS[:1]))[1].mesh_refused
        for address, kind, frames, curve in probes:
            assert not _answered(address, kind, frames, curve), (port, curve is not None)
        deadline = time.monotonic() + 10
        while True:  # (a worker reports its refusals with its heartbeat)
            status = run(_generate(mesh, keys, PROMPTS[:1]))[1]
            if status.mesh_refused >= counted + len(probes) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert status.mesh_refused >= counted + len(probes), port
    results, status = run(_generate(mesh, keys))
    assert results == reference and status.serving and mesh.died is None
    assert status.malformed_messages == before.malformed_messages  # nothing reached a decoder
    assert status.recoveries == before.recoveries  # the fake registration never reached the coordinator


def test_an_oversized_message_cuts_its_sender_off(mesh, keys, reference):
    client_key = (zmq.auth.load_certificate(keys / "server.key")[0],
                  *zmq.auth.load_certificate(keys / "client.key_secret"))
    huge = [msgspec.msgpack.encode({"type": "generate", "request_id": "big", "prompt_ids": [5] * (4 << 20),
                                    "params": {"max_tokens": 2}})]
    assert not _answered(mesh.client_address, zmq.DEALER, huge, client_key, wait_ms=1500)
    assert _answered(mesh.client_address, zmq.DEALER, Codec.encode(StatusRequest()), client_key, wait_ms=5000)
    assert run(_generate(mesh, keys))[0] == reference


# -- fuzzing a live mesh -------------------------------------------------------------------------

TAGS = ["generate", "abort", "status", "register", "ready", "heartbeat", "result", "worker_failed", "activations",
        "schedule", "output", "assignment", "nonsense"]
values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20)
messages = st.builds(
    lambda tag, fields, extra: {**({"type": tag} if tag else {}), **fields, **extra},
    st.sampled_from(TAGS) | st.none(),
    st.fixed_dictionaries({}, optional={
        "request_id": values, "prompt_ids": st.lists(st.integers(-5, 1 << 40), max_size=8), "params": values,
        "pp_rank": st.integers(-3, 1 << 40), "tp_rank": st.integers(-3, 1 << 40), "step_id": values,
        "sampled": values, "tensors": st.lists(st.lists(values, max_size=3), max_size=3), "num_blocks": values,
        "data_address": values, "device": values, "pid": values, "busy_seconds": values, "error": values}),
    st.dictionaries(st.text(max_size=8), values, max_size=3))


@FUZZ
@given(msg=messages, tail=st.lists(st.binary(max_size=64), max_size=3), cut=st.none() | st.integers(0, 40),
       raw=st.none() | st.binary(max_size=64))
def test_every_links_decoder_refuses_hostile_frames_with_a_protocol_error(msg, tail, cut, raw):
    from moemesh.protocol import Activations, ClientMessage, CoordinatorMessage, CoordinatorReply, ProtocolError, \
        WorkerMessage

    frames = [raw, *tail] if raw is not None else _frames(msg, tail, cut)
    for link in (ClientMessage, CoordinatorReply, WorkerMessage, CoordinatorMessage, Activations):
        try:
            Codec(link).decode(frames)
        except ProtocolError:
            pass


def _frames(msg: dict, tail: list[bytes], cut: int | None) -> list[bytes]:
    header = msgspec.msgpack.encode(msg)
    return [header[:cut] if cut is not None else header, *tail]


def _harmless(link: str, msg: dict) -> bool:
    """Messages an authenticated peer may legitimately send that change the pipeline (a registration
    for a real rank replaces that worker; a worker's own failure report starts a recovery) are left
    out: they are not malformed, and their handling is tested in the recovery tests."""
    if link == "workers" and msg.get("type") in ("register", "worker_failed"):
        return False
    if link == "activations" and isinstance(msg.get("step_id"), int) and 0 <= msg["step_id"] < 10 ** 6:
        return False  # a near step id from a worker key is an injected activation (the trust model allows it)
    return True


def _deep(tag: str) -> bytes:
    """A message of type `tag` whose unknown field nests 20,000 arrays deep (20 KB: under every link's size limit)."""
    return b"\x82" + msgspec.msgpack.encode({"type": tag})[1:] + b"\xa1x" + b"\x91" * 20_000 + b"\xc0"


def test_deeply_nested_frames_are_a_protocol_error_on_every_link():
    """msgspec raises RecursionError skipping a deeply nested unknown field: a refusal like any other."""
    from moemesh.protocol import Activations, ClientMessage, CoordinatorMessage, CoordinatorReply, ProtocolError, \
        WorkerMessage

    for link, tag in ((ClientMessage, "generate"), (CoordinatorReply, "output"), (WorkerMessage, "register"),
                      (CoordinatorMessage, "schedule"), (Activations, "activations")):
        with pytest.raises(ProtocolError, match="nested too deeply"):
            Codec(link).decode([_deep(tag)])


def test_deep_nesting_and_a_flood_of_activations_never_hurt_the_mesh(mesh, keys, reference):
    """A deeply nested message on the client, worker and activation sockets (it used to stop the
    coordinator or a stage), and 60 activations for steps far ahead (they used to be kept, all of
    them): counted as malformed, and the mesh goes on with the same tokens and no recovery."""
    from stage_worker.worker import EARLY_ACTIVATIONS

    server_public = zmq.auth.load_certificate(keys / "server.key")[0]
    before = run(_generate(mesh, keys, PROMPTS[:1]))[1]
    ctx = zmq.Context()
    try:
        act, kept = ctx.socket(zmq.PUSH), []
        for link, address, kind, role in [("clients", mesh.client_address, zmq.DEALER, "client"),
                                          ("workers", mesh.worker_address, zmq.DEALER, "worker"),
                                          ("activations", f"tcp://127.0.0.1:{_activation_port(mesh, 1)}", zmq.PUSH,
                                           "worker")]:
            s = act if link == "activations" else ctx.socket(kind)
            kept.append(s)  # (a socket collected now would close before its handshake)
            s.linger = 0
            s.curve_serverkey = server_public
            s.curve_publickey, s.curve_secretkey = zmq.auth.load_certificate(keys / f"{role}.key_secret")
            s.connect(address)
            s.send_multipart([_deep({"clients": "generate", "workers": "register"}.get(link, link))])
            if link == "clients":  # (a request that fails is also read for a request id to answer)
                s.send_multipart([b"\x91" * 20_000 + b"\xc0"])
        flood = [msgspec.msgpack.encode({"type": "activations", "step_id": 10 ** 9 + i,
                                         "tensors": [["float32", [4, 64]]]}) for i in range(60)]
        for header in flood:
            act.send_multipart([header, bytes(4 * 4 * 64)])
        expected = before.malformed_messages + 4 + 60 - EARLY_ACTIVATIONS
        deadline = time.monotonic() + 10
        while True:  # (a worker reports its count with its heartbeat)
            results, status = run(_generate(mesh, keys))
            if status.malformed_messages >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        ctx.destroy(linger=0)
    assert results == reference and status.serving and mesh.died is None
    assert status.recoveries == before.recoveries
    assert status.malformed_messages >= expected


def test_a_stage_holds_only_so_many_activations_ahead(tmp_path):
    """The previous stage's activations wait for their step's turn, but no more than the schedules
    queued plus EARLY_ACTIVATIONS: past that the furthest step goes (malformed); a stale step never
    stays."""
    import torch

    from moemesh.protocol import Schedule
    from moemesh.settings import WorkerSettings
    from stage_worker.worker import ACTIVATION_QUEUE, CANDIDATES, EARLY_ACTIVATIONS, StageWorker

    async def scenario():
        w = StageWorker(WorkerSettings(coordinator="tcp://127.0.0.1:9", pp_rank=1))
        try:
            w.current_step = 10
            t = torch.zeros(1, 4)
            w._keep_activations(9, t)  # stale: dropped at once
            assert not w.arrived and w.bad.count == 1
            w.schedules.put_nowait(Schedule(11, [], []))
            for step in range(11, 11 + 1000):
                w._keep_activations(step, t)
            assert sorted(w.arrived) == list(range(11, 11 + EARLY_ACTIVATIONS + 1))  # the nearest kept
            assert w.bad.count == 1 + 1000 - (EARLY_ACTIVATIONS + 1)
            w.current_step = 12  # step 11 was taken (and a duplicate of it came later)
            w._keep_activations(13, t)
            assert 11 not in w.arrived and w.arrived[13][0] is t
            # (step 13's stream came twice, in the loop and just now: both kept) a third time and more: dropped
            bad_count = w.bad.count
            for _ in range(3):
                w._keep_activations(13, t)
            assert len(w.arrived[13]) == CANDIDATES == 2 and w.bad.count == bad_count + 3
            # and libzmq queues few, each at most a step's activations, while nobody reads
            assert w.pull.getsockopt(zmq.RCVHWM) == ACTIVATION_QUEUE
            assert w.pull.getsockopt(zmq.MAXMSGSIZE) == w.cfg.max_message_bytes
        finally:
            w.ctx.destroy(linger=0)
        w = StageWorker(WorkerSettings(coordinator="tcp://127.0.0.1:9", pp_rank=1, max_activation_bytes=3 << 20))
        assert w.pull.getsockopt(zmq.MAXMSGSIZE) == 3 << 20
        w.ctx.destroy(linger=0)

    asyncio.run(scenario())

def test_a_misfit_stream_after_the_real_one_does_not_replace_it():
    """A stream that does not fit its step, sent after the step's real one (or before it), is refused
    when the step takes its stream, and the real one is what the step gets."""
    import types

    import torch

    from moemesh.settings import WorkerSettings
    from stage_worker.worker import StageWorker

    async def scenario():
        w = StageWorker(WorkerSettings(coordinator="tcp://127.0.0.1:9", pp_rank=1))
        try:
            w.executor = types.SimpleNamespace(runner=types.SimpleNamespace(
                config=types.SimpleNamespace(hidden_size=4), kv_cache=torch.zeros(1)))
            real, misfit = torch.ones(3, 4), torch.zeros(5, 4)
            w._keep_activations(1, real)
            w._keep_activations(1, misfit)
            assert await asyncio.wait_for(w._activations_for(1, 3), 1) is real and 1 not in w.arrived
            w._keep_activations(2, misfit)
            w._keep_activations(2, real)
            assert await asyncio.wait_for(w._activations_for(2, 3), 1) is real and w.bad.count == 1
        finally:
            w.ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_hostile_messages_on_every_socket_never_hurt_the_mesh(mesh, keys, reference):
    """Random and mutated messages, from peers holding valid keys, on the client socket, the worker
    socket and a stage's activation socket: counted as malformed, no crash, no hang, and the mesh
    still gives the same tokens afterwards."""
    server_public = zmq.auth.load_certificate(keys / "server.key")[0]
    ctx = zmq.Context()
    socks = {}
    for link, address, kind, role in [("clients", mesh.client_address, zmq.DEALER, "client"),
                                      ("workers", mesh.worker_address, zmq.DEALER, "worker"),
                                      ("activations", f"tcp://127.0.0.1:{_activation_port(mesh, 1)}", zmq.PUSH,
                                       "worker")]:
        s = ctx.socket(kind)
        s.linger = 0
        s.curve_serverkey = server_public
        s.curve_publickey, s.curve_secretkey = zmq.auth.load_certificate(keys / f"{role}.key_secret")
        s.connect(address)
        socks[link] = s
    before = run(_generate(mesh, keys, PROMPTS[:1]))[1]
    sent = 0

    @FUZZ
    @given(link=st.sampled_from(sorted(socks)), msg=messages,
           tail=st.lists(st.binary(max_size=64), max_size=3), cut=st.none() | st.integers(0, 40))
    def send(link, msg, tail, cut):
        nonlocal sent
        if _harmless(link, msg):
            socks[link].send_multipart(_frames(msg, tail, cut))
            sent += 1

    try:
        send()
        time.sleep(1.0)  # (and a worker's heartbeat reports its count)
        results, status = run(_generate(mesh, keys))
    finally:
        ctx.destroy(linger=0)
    assert sent > 30
    assert results == reference and status.serving and mesh.died is None
    assert status.malformed_messages > before.malformed_messages
    assert status.recoveries == before.recoveries


# -- the gateway: TLS, API-key files, limits, hostile bodies -------------------------------------

@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """`serve --pp 2` with keys it makes itself (the directory does not exist yet), two API keys from
    a file, and HTTPS with a self-signed certificate for 127.0.0.1."""
    import ssl

    from test_gateway import SPEC, free_port
    from moemesh.entrypoints.tiny_model import write_tiny_model

    d = tmp_path_factory.mktemp("gw-sec")
    model = write_tiny_model(SPEC, d / "tiny-mixtral")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    (d / "keys.txt").write_text("# the team's keys\nalpha-key\n\n  beta-key  \n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moemesh", "serve", "--model", str(model), "--pp", "2",
                             "--port", str(port), "--kv-memory", str(4 << 20), "--mesh-keys", str(d / "new-keys"),
                             "--api-key-file", str(d / "keys.txt"), "--ssl-certfile", str(cert),
                             "--ssl-keyfile", str(key)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    context = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if _https("GET", f"{url}/health", context)[0] == 200:
                break
        except OSError:
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.3)
    yield url, context, d
    import signal

    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=30)


def _https(method, url, context, body=None, headers=None, raw: bytes | None = None):
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_tls_keys_from_a_file_and_the_keys_serve_made(tls_server):
    import json

    url, context, d = tls_server
    assert (d / "new-keys" / "server.key_secret").is_file()  # made by serve, used by every process
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    for header in ("Bearer alpha-key", "Bearer beta-key", "bearer  alpha-key "):
        status, raw = _https("POST", f"{url}/v1/completions", context, body, {"Authorization": header})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    for header in ({}, {"Authorization": "Bearer alpha-ke"}, {"Authorization": "Bearer alpha-keyy"},
                   {"Authorization": "alpha-key"}, {"Authorization": "Bearer # the team's keys"}):
        status, raw = _https("POST", f"{url}/v1/completions", context, body, header)
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    with pytest.raises(OSError):  # plain HTTP on the TLS port gets nothing
        import urllib.request

        urllib.request.urlopen(url.replace("https", "http") + "/health", timeout=5)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop"), ({"prompt": "x", "stop": ["y" * 1001]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"), ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "n": 17}, "n"), ({"prompt": [[5]] * 257}, "prompt"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop_token_ids": list(range(1025))}, "stop_token_ids"),
])
def test_request_limits_are_400s_in_openais_shape(tls_server, body, param):
    import json

    url, context, _ = tls_server
    status, raw = _https("POST", f"{url}/v1/completions", context, {**body, "max_tokens": 2},
                         {"Authorization": "Bearer alpha-key"})
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and param in (error.get("param") or ""), error


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70) | st.floats()
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=15)
VALID = {"/v1/completions": {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": True,
                             "stop": ["\n"], "n": 1, "seed": 3, "stream": False},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_p": 0.5,
                                  "logprobs": True, "top_logprobs": 1, "stream": True},
         "/tokenize": {"prompt": "hello"}, "/detokenize": {"tokens": [5, 6]}}


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    kind = draw(st.sampled_from(["mutated", "random", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=200))
    if kind == "random":
        return path, msgspec.json.encode(draw(json_values))
    body = dict(VALID[path])
    for field in draw(st.lists(st.sampled_from(sorted(body) + ["n", "best_of", "max_tokens", "prompt", "stop",
                                                               "messages", "tokens", "logprobs"]), max_size=3)):
        body[field] = draw(json_values)
    for field, cap in (("max_tokens", 4), ("n", 2)):  # an accepted value stays cheap to serve
        if isinstance(body.get(field), int) and not isinstance(body[field], bool) and body[field] > cap:
            body[field] = draw(st.sampled_from([cap, body[field] if body[field] > 10 ** 6 else cap]))
    return path, msgspec.json.encode(body)


def test_hostile_bodies_never_get_a_5xx_or_a_traceback(tls_server):
    import json

    url, context, _ = tls_server
    auth = {"Authorization": "Bearer beta-key"}
    seen = set()

    @FUZZ
    @given(case=bodies())
    def post(case):
        path, raw = case
        status, out = _https("POST", url + path, context, headers=auth, raw=raw)
        seen.add(status)
        assert status < 500, (path, raw, out[:300])
        assert b"Traceback" not in out
        if status >= 400:
            assert json.loads(out)["error"]["code"] == status

    post()
    assert 400 in seen and 200 in seen
    deep = b"[" * 100_000 + b"]" * 100_000  # (msgspec raises RecursionError for it: a 400 all the same)
    for path, raw in (("/v1/completions", b'{"prompt": ' + deep + b"}"),
                      ("/v1/chat/completions", b'{"messages": [], "chat_template_kwargs": {"a": ' + deep + b"}}"),
                      ("/tokenize", b'{"prompt": "x", "extra": ' + deep + b"}")):
        status, out = _https("POST", url + path, context, headers=auth, raw=raw)
        assert status == 400 and b"nested too deeply" in out, (path, out[:300])
    status, raw = _https("POST", f"{url}/v1/completions", context, {"prompt": [5, 6, 7], "max_tokens": 3,
                                                                     "temperature": 0}, auth)
    assert status == 200 and _https("GET", f"{url}/ready", context)[0] == 200


def test_a_worker_no_coordinator_answers_suspects_its_keys_too(caplog):
    """With --mesh-keys, a coordinator that refuses the worker's handshake (keys not copied from its
    host) looks from the worker like no coordinator at that address: its hint names both."""
    import logging
    import types

    from moemesh.settings import WorkerSettings
    from stage_worker.worker import StageWorker

    async def hints(mesh_keys):
        async def unrefused():
            pass

        stand_in = types.SimpleNamespace(cfg=WorkerSettings(coordinator="tcp://127.0.0.1:9", mesh_keys=mesh_keys),
                                         last_heard=None, _register_again_if_refused=unrefused)
        task = asyncio.ensure_future(StageWorker._while_unassigned(stand_in, every=0.01))
        deadline = asyncio.get_running_loop().time() + 10
        while not any(r.getMessage() == "no layers assigned yet" for r in caplog.records):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.WARNING):
        asyncio.run(hints(None))
        plain = [r.fields["hint"] for r in caplog.records if r.getMessage() == "no layers assigned yet"]
        caplog.clear()
        asyncio.run(hints("/keys"))
        keyed = [r.fields["hint"] for r in caplog.records if r.getMessage() == "no layers assigned yet"]
    assert plain and "--coordinator" in plain[0] and "--mesh-keys" not in plain[0]
    assert keyed and "--coordinator" in keyed[0] and "--mesh-keys" in keyed[0] and "handshake refused" in keyed[0]


def test_a_worker_key_rotated_in_the_wrong_order_heals_without_losing_the_request(model, reference, tmp_path):
    """deploy/README.md's rotation done out of order: stage 0 restarted with a new worker key before
    stage 1's host allows it. Stage 1 refuses the handshake (libzmq never tries a refused one again on
    that socket), and a request in flight waits. The status names the link within seconds; once the key
    is added to stage 1's allowed set, stage 0's next attempt (a fresh socket every RELINK_AFTER
    seconds) connects, the steps that went out on the refused link are recomputed at once (not after
    --step-timeout, 120 s), and the request completes with the tokens of a mesh that never failed."""
    import shutil

    from stage_worker.worker import _free_port

    old = make_keys(tmp_path / "old")  # stage 1's host: allows the old worker key only
    new = make_keys(tmp_path / "new")  # (of which only the worker key pair is used)
    stage0 = tmp_path / "stage0"  # stage 0 restarted with the new worker key
    shutil.copytree(old, stage0)
    for name in ("worker.key", "worker.key_secret"):
        shutil.copy2(new / name, stage0 / name)
    coord_keys = tmp_path / "coordinator"  # the coordinator's host got the new key in time
    shutil.copytree(old, coord_keys)
    shutil.copy2(new / "worker.key", coord_keys / "workers" / "worker-2.key")

    port, client_port = _free_port("127.0.0.1"), _free_port("127.0.0.1")
    base = [sys.executable, "-m", "moemesh"]
    procs = [subprocess.Popen([*base, "coordinator", "--model", str(model), "--pp", "2", "--host", "127.0.0.1",
                               "--port", str(port), "--client-port", str(client_port), "--mesh-keys", str(coord_keys)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    for rank, keys_dir in ((0, stage0), (1, old)):
        procs.append(subprocess.Popen([*base, "stage-worker", "--coordinator", f"tcp://127.0.0.1:{port}", "--pp-rank",
                                       str(rank), "--host", "127.0.0.1", "--kv-memory", str(16 << 20),
                                       "--mesh-keys", str(keys_dir)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    async def scenario():
        client = CoordinatorClient(f"tcp://127.0.0.1:{client_port}", mesh_keys=str(coord_keys))
        try:
            await client.wait_serving(timeout=120)
            request = asyncio.ensure_future(_greedy_tokens(client, PROMPTS[0]))
            deadline = time.monotonic() + 30
            while not (status := await client.status()).unreached:
                assert time.monotonic() < deadline, "the refused link was never named"
                await asyncio.sleep(0.3)
            assert not request.done()
            shutil.copy2(new / "worker.key", old / "workers" / "worker-2.key")  # the rotation's missed step
            started = time.monotonic()
            tokens = await asyncio.wait_for(request, 60)
            return status, tokens, time.monotonic() - started, await client.status()
        finally:
            await client.close()

    try:
        named, tokens, seconds, after = run(scenario())
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert "stage 0 (tp rank 0) has not reached stage 1" in named.unreached and "--mesh-keys" in named.unreached
    assert tokens == reference[0]
    assert seconds < 30, seconds  # (well inside --step-timeout: the link's late connection reset it)
    assert after.unreached == "" and after.step_resets == 1 and after.mesh_refused >= 1


def test_a_worker_the_coordinator_refused_joins_once_its_key_is_allowed(model, reference, tmp_path):
    """A worker started with a key the coordinator's host does not allow yet: the coordinator refuses
    its handshake (libzmq never tries a refused one again on that connection). Once the key is added
    to the coordinator's allowed set, the worker's next attempt (every RELINK_AFTER seconds while no
    layers came) registers it, and the mesh serves the tokens of one that never refused it."""
    import shutil

    from stage_worker.worker import _free_port

    keys = make_keys(tmp_path / "keys")
    new = make_keys(tmp_path / "new")  # (of which only the worker key pair is used)
    worker_keys = tmp_path / "worker"
    shutil.copytree(keys, worker_keys)
    for name in ("worker.key", "worker.key_secret"):
        shutil.copy2(new / name, worker_keys / name)
    port, client_port = _free_port("127.0.0.1"), _free_port("127.0.0.1")
    base = [sys.executable, "-m", "moemesh"]
    procs = [subprocess.Popen([*base, "coordinator", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                               "--client-port", str(client_port), "--mesh-keys", str(keys)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
             subprocess.Popen([*base, "stage-worker", "--coordinator", f"tcp://127.0.0.1:{port}", "--pp-rank", "0",
                               "--host", "127.0.0.1", "--kv-memory", str(16 << 20), "--mesh-keys", str(worker_keys)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    async def scenario():
        client = CoordinatorClient(f"tcp://127.0.0.1:{client_port}", mesh_keys=str(keys))
        try:
            deadline = time.monotonic() + 60
            while not (status := await client.status()).mesh_refused:
                assert time.monotonic() < deadline, "the worker's handshake was never refused"
                await asyncio.sleep(0.3)
            assert not status.serving
            shutil.copy2(new / "worker.key", keys / "workers" / "worker-2.key")  # the rotation's late step
            await client.wait_serving(timeout=60)
            return await _greedy_tokens(client, PROMPTS[0])
        finally:
            await client.close()

    try:
        tokens = run(scenario())
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert tokens == reference[0]
