"""The local launcher leaves no orphan process and no hung parent: on Ctrl-C, on the parent's
own death, and on a child's death."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=2, hidden_size=64, intermediate_size=64,
                                          num_experts=4, vocab_size=384, max_position_embeddings=4096),
                            tmp_path_factory.mktemp("launch") / "m")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_generate(model, max_tokens=3000) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moemesh", "generate", "--model", str(model), "--pp", "2", "--prompt-ids", "1,2,3",
         "--max-tokens", str(max_tokens), "--ignore-eos", "--temperature", "0", "--kv-memory", str(8 << 20)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for_children(proc, n=3, timeout=60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = children(proc.pid)
        if len(kids) >= n:
            time.sleep(3)  # let the mesh start generating
            return children(proc.pid)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("the mesh did not start")


def wait_gone(pids, timeout=10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_ctrl_c_stops_everything(model):
    proc = start_generate(model)
    kids = wait_for_children(proc)
    assert len(kids) == 3  # coordinator and two stage workers
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert b"Traceback" not in err
    assert wait_gone(kids) == []


def test_the_parent_killed_outright_takes_its_children_along(model):
    proc = start_generate(model)
    kids = wait_for_children(proc)
    proc.kill()  # no chance to clean up: the kernel's parent-death signal must do it
    proc.wait()
    assert wait_gone(kids) == []


def test_a_dead_coordinator_ends_the_parent_with_a_clear_error(model):
    proc = start_generate(model)
    kids = wait_for_children(proc)
    os.kill(min(kids), signal.SIGKILL)  # the first started: the coordinator
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert b"moemesh: error:" in err and b"Traceback" not in err
    assert wait_gone(kids) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_stage_worker_is_restarted_and_generate_completes(model, sig):
    """The launcher starts the killed worker again; the coordinator recovers; the output is what
    an undisturbed run prints. A stopped worker (alive, silent) is counted lost by the coordinator,
    which tells the launcher: it kills the process and starts it again."""
    undisturbed = subprocess.run(
        [sys.executable, "-m", "moemesh", "generate", "--model", str(model), "--prompt-ids", "1,2,3",
         "--max-tokens", "1500", "--ignore-eos", "--temperature", "0", "--json"], cwd=REPO, capture_output=True,
        timeout=120)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moemesh", "generate", "--model", str(model), "--pp", "2", "--prompt-ids", "1,2,3",
         "--max-tokens", "1500", "--ignore-eos", "--temperature", "0", "--json", "--kv-memory", str(8 << 20),
         "--log-level", "info"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    kids = wait_for_children(proc, timeout=60)
    # a worker killed before the pipeline serves fails its start (as it should): kill one once it serves
    deadline, seen = time.monotonic() + 120, b""
    while b"logger=moemesh.coordinator msg='serving'" not in seen and time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, (seen, proc.communicate())
        seen += line
    time.sleep(0.5)  # (into the run: 1,500 tokens take several seconds)
    victim = max(children(proc.pid))  # the last started: a stage worker
    os.kill(victim, sig)
    out, err = proc.communicate(timeout=120)
    err = seen + err
    assert proc.returncode == 0, err
    assert json.loads(out)["token_ids"] == json.loads(undisturbed.stdout)["token_ids"]
    assert len(json.loads(out)["token_ids"]) == 1500 and b"restarting" in err  # killed mid-run
    if sig == signal.SIGSTOP:
        assert b"killing a worker the coordinator counted lost" in err and f"pid={victim}".encode() in err
    assert not alive(victim)


def test_serve_and_generate_give_their_coordinator_its_timeouts(model):
    """--worker-timeout, --step-timeout, --recovery-timeout (and the start's) on serve and generate
    reach the coordinator they start (its MOEMESH_* variables do not: a child gets flags)."""
    from moemesh.entrypoints.cli import build_parser
    from moemesh.entrypoints.generate import engine_settings_from_args
    from moemesh.entrypoints.launcher import LocalMesh

    for command in ("serve", "generate"):
        extra = ["--prompt-ids", "5,6"] if command == "generate" else []
        args = build_parser().parse_args([command, "--model", str(model), "--pp", "2", "--worker-timeout", "3",
                                          "--step-timeout", "7", "--recovery-timeout", "300", *extra])
        mesh = LocalMesh.of(engine_settings_from_args(args))
        c = mesh.coordinator
        assert (c.worker_timeout, c.step_timeout, c.recovery_timeout) == (3, 7, 300), command
        argv = c.to_argv()
        assert "--step-timeout=7.0" in argv and "--recovery-timeout=300.0" in argv


def test_serve_and_generate_take_their_stages_from_the_layer_partition(model, monkeypatch):
    """--layer-partition 1,1 without --pp: two stages, on serve as on generate; --pp, or MOEMESH_PP,
    that disagrees is refused naming both flags; neither flag: one stage."""
    from moemesh.entrypoints.cli import build_parser
    from moemesh.entrypoints.generate import engine_settings_from_args
    from moemesh.errors import CLIError

    for command in ("serve", "generate"):
        extra = ["--prompt-ids", "5,6"] if command == "generate" else []
        settings = engine_settings_from_args(build_parser().parse_args(
            [command, "--model", str(model), "--layer-partition", "1,1", *extra]))
        assert (settings.pp, settings.layer_partition) == (2, (1, 1)), command
        assert engine_settings_from_args(build_parser().parse_args([command, "--model", str(model), *extra])).pp == 1
        with pytest.raises(CLIError, match="--layer-partition has 2 stages but --pp is 1"):
            engine_settings_from_args(build_parser().parse_args(
                [command, "--model", str(model), "--layer-partition", "1,1", "--pp", "1", *extra]))
    monkeypatch.setenv("MOEMESH_PP", "1")
    with pytest.raises(CLIError, match="--layer-partition has 2 stages but --pp is 1"):
        engine_settings_from_args(build_parser().parse_args(["serve", "--model", str(model), "--layer-partition", "1,1"]))


def _two_free_ports_in_a_row() -> int:
    """P with P and P + 1 both free now (each bound once to see: a port the system handed out for P
    says nothing of P + 1, which another process may hold)."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65000:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free ports in a row")


def test_moemesh_stage_runs_a_stage_with_its_ranks_on_the_ports_asked_for(model):
    """`moemesh stage --tp 2 --port P` (a stage host's container command): its two workers register
    with a coordinator started alone, listen on P and P + 1, and the pipeline gives the in-process
    engine's greedy tokens; stopping `stage` stops both."""
    import socket

    from moemesh.client import CoordinatorClient
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.netutil import run
    from moemesh.sampling import SamplingParams
    from moemesh.settings import EngineSettings

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLMEngine(EngineSettings(model=str(model), num_kv_blocks=64), progress=False).generate([[5, 6, 7]], params)
    port = _two_free_ports_in_a_row()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOEMESH_")}
    coord = subprocess.Popen([sys.executable, "-m", "moemesh", "coordinator", "--model", str(model), "--tp", "2",
                              "--port", "0", "--client-port", "0"], stdout=subprocess.PIPE, env=env)
    stage = None
    try:
        addresses = json.loads(coord.stdout.readline().decode().split(" ", 1)[1])
        stage = subprocess.Popen([sys.executable, "-m", "moemesh", "stage", "--coordinator", addresses["workers"],
                                  "--pp-rank", "0", "--tp", "2", "--host", "127.0.0.1", "--port", str(port),
                                  "--kv-memory", str(4 << 20)], env=env)

        async def generate():
            client = CoordinatorClient(addresses["clients"])
            try:
                await client.wait_serving(timeout=120)
                return [t for out in [o async for o in client.generate([5, 6, 7], params)] for t in out.token_ids]
            finally:
                await client.close()

        assert run(generate()) == want[0].token_ids
        for p in (port, port + 1):  # the workers hold them
            with socket.socket() as s, pytest.raises(OSError):
                s.bind(("127.0.0.1", p))
        stage.terminate()
        assert stage.wait(timeout=30) is not None
    finally:
        for proc in (stage, coord):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_child_keeps_the_kernels_process_wide_variables_and_no_role_settings(monkeypatch):
    """MOEMESH_PREFETCH and MOEMESH_AMX set the CPU kernels of every process of a mesh; a role's
    settings (MOEMESH_PP) reach a child as flags, not through the environment."""
    from moemesh.entrypoints.launcher import child_environment

    for name, value in (("MOEMESH_PREFETCH", "0,4"), ("MOEMESH_AMX", "0"), ("MOEMESH_PP", "2")):
        monkeypatch.setenv(name, value)
    env = child_environment()
    assert env["MOEMESH_PREFETCH"] == "0,4" and env["MOEMESH_AMX"] == "0" and "MOEMESH_PP" not in env


def test_a_worker_is_known_by_a_secret_identity_its_launcher_reports_its_death_in(model, monkeypatch):
    """A stage worker's identity on the coordinator's link ends in a token nobody else can guess (the
    coordinator lets a reconnection with an identity take over its route): its launcher chooses it,
    hands it over in the environment (not the command line, which `ps` shows), and reports the
    worker's death in its name; a worker started otherwise draws its own."""
    import re
    import subprocess

    import zmq

    import moemesh.entrypoints.launcher as launcher
    from moemesh.entrypoints.launcher import LocalMesh
    from moemesh.protocol import WORKER_TOKEN, Codec, WorkerFailed, WorkerMessage
    from moemesh.settings import EngineSettings, WorkerSettings
    from stage_worker.worker import StageWorker

    class Proc:
        pid, returncode = 4242, -9

    spawned = []
    monkeypatch.setattr(subprocess, "Popen", lambda args, env, **kw: spawned.append((args, env)) or Proc())
    mesh = LocalMesh.of(EngineSettings(model=str(model), pp=2))
    name = "stage-worker pp=1 tp=0"
    mesh._spawn(name, ["stage-worker", "--pp-rank=1"])
    mesh._spawn("coordinator", ["coordinator"])
    (args, env), (_, coordinator_env) = spawned
    token = env[WORKER_TOKEN]
    assert re.fullmatch("[0-9a-f]{32}", token) and token not in " ".join(args)
    assert WORKER_TOKEN not in coordinator_env
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        mesh.worker_address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        mesh._report_death(name)
        assert router.poll(10_000)
        identity, *frames = router.recv_multipart()
        assert identity == f"w1.0.4242.{token}".encode()
        assert isinstance(Codec(WorkerMessage).decode(frames)[0], WorkerFailed)
    finally:
        ctx.destroy(linger=0)
    # the worker's side: the token from its launcher (taken out of its environment), or its own
    monkeypatch.setenv(WORKER_TOKEN, token)
    w = StageWorker(WorkerSettings(coordinator="tcp://127.0.0.1:9", pp_rank=1))
    w.ctx.destroy(linger=0)
    assert w.identity == f"w1.0.{os.getpid()}.{token}".encode() and WORKER_TOKEN not in os.environ
    other = StageWorker(WorkerSettings(coordinator="tcp://127.0.0.1:9", pp_rank=1))
    other.ctx.destroy(linger=0)
    assert re.fullmatch(rb"w1\.0\.\d+\.[0-9a-f]{32}", other.identity) and other.identity != w.identity


def test_children_that_end_together_restart_together_and_a_spent_budget_still_reaps(model, monkeypatch):
    """The watcher sees every child that ends at once and waits out each backoff beside the others
    (two workers killed together come back together, not one backoff after the other); a child past
    its budget ends the watch (`died`), and the children that end after it are still reaped.
    (Stand-in processes: the watcher's bookkeeping, not a mesh.)"""
    import threading

    import moemesh.entrypoints.launcher as launcher
    from moemesh.entrypoints.launcher import LocalMesh
    from moemesh.settings import EngineSettings

    class Proc:
        def __init__(self):
            self.returncode, self.polls = None, 0

        def poll(self):
            self.polls += 1
            return self.returncode

    mesh = LocalMesh.of(EngineSettings(model=str(model), pp=2))
    names = ["stage-worker pp=0 tp=0", "stage-worker pp=1 tp=0"]
    mesh.procs = {n: Proc() for n in names}
    started = {n: [] for n in names}

    def respawn(name):
        started[name].append(time.monotonic())
        mesh.procs[name] = Proc()
        return True

    monkeypatch.setattr(mesh, "_report_death", lambda name: None)
    monkeypatch.setattr(mesh, "_respawn", respawn)
    monkeypatch.setattr(launcher, "RESTART_BACKOFF", (0.5, 0.5, 0.5, 0.5, 0.5))
    watcher = threading.Thread(target=mesh._watch, daemon=True)
    watcher.start()
    try:
        killed = time.monotonic()
        for n in names:
            mesh.procs[n].returncode = -9
        deadline = time.monotonic() + 10
        while not all(started.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        first, second = (started[n][0] - killed for n in names)
        # each after its own 0.5 s, together (one after the other's would set them 0.5 s apart and more)
        assert first >= 0.5 and second >= 0.5 and abs(first - second) < 0.4 and max(first, second) < 5
        deadline = time.monotonic() + 20
        while mesh.died is None and time.monotonic() < deadline:  # pp=0 dies again and again: past its budget
            mesh.procs[names[0]].returncode = 1  # (the one that ended, again, while it waits: no matter)
            time.sleep(0.05)
        assert mesh.died is not None and "pp=0" in mesh.died
        other = mesh.procs[names[1]]
        polls = other.polls
        other.returncode = 0  # ends after the mesh is down: reaped all the same
        time.sleep(1.2)
        assert other.polls > polls and watcher.is_alive()
    finally:
        mesh._stopping = True
        mesh._stop.set()
        watcher.join(timeout=5)
    assert not watcher.is_alive()


def test_a_fault_of_the_watch_itself_says_the_mesh_is_down(model, monkeypatch):
    """The watcher thread failing (a child it cannot poll or start) ends in `died` with the reason,
    not in a thread gone unnoticed while the mesh goes unwatched; a stop after it returns at once."""
    import threading

    from moemesh.entrypoints.launcher import LocalMesh
    from moemesh.settings import EngineSettings

    mesh = LocalMesh.of(EngineSettings(model=str(model), pp=2))

    def broken():
        raise OSError("no more processes")

    monkeypatch.setattr(mesh, "_check_children", broken)
    watcher = threading.Thread(target=mesh._watch, daemon=True)
    watcher.start()
    deadline = time.monotonic() + 10
    while mesh.died is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mesh.died is not None and "watch" in mesh.died and "no more processes" in mesh.died
    mesh._watcher = watcher
    started = time.monotonic()
    mesh.stop()
    assert not watcher.is_alive() and time.monotonic() - started < 5


def test_a_lost_line_kills_that_ranks_worker_only_if_it_is_that_process(monkeypatch):
    """MOEMESH_LOST names the ranks and the pid: a pid is one host's, so a worker of other ranks with
    the same pid (another host's, a Ray node's) is left alone, and so is a rank's worker already
    replaced by a new process."""
    import types

    from moemesh.entrypoints import launcher
    from moemesh.entrypoints.launcher import LocalMesh

    killed = []

    def proc(name, pid):
        return types.SimpleNamespace(pid=pid, poll=lambda: None, kill=lambda: killed.append(name), stdout=None)

    r, w = os.pipe()
    mesh = LocalMesh(None, None)
    coordinator = types.SimpleNamespace(stdout=os.fdopen(r, "rb", buffering=0))
    mesh.procs = {"coordinator": coordinator, "stage-worker pp=0 tp=0": proc("pp=0", 42),
                  "stage-worker pp=1 tp=0": proc("pp=1", 42), "stage-worker pp=2 tp=0": proc("pp=2", 43)}
    monkeypatch.setattr(launcher, "LOST_GRACE", 0.0)
    lines = [{"pp": 1, "tp": 0, "pid": 42, "reason": "silent"}, {"pp": 2, "tp": 0, "pid": 7, "reason": "old"}]
    os.write(w, b"a library's line\n" + b"".join(b"MOEMESH_LOST " + json.dumps(x).encode() + b"\n" for x in lines)
             + b"MOEMESH_LOST {\"pp\": 0, \"tp\"")  # (a line not finished yet: read when it is)
    mesh._heed_coordinator()
    assert killed == ["pp=1"] and not mesh.lost
    os.write(w, b": 0, \"pid\": 42, \"reason\": \"silent\"}\n")
    mesh._heed_coordinator()
    assert killed == ["pp=1", "pp=0"]
    os.close(w)
    coordinator.stdout.close()
