"""Starting a whole mesh on this machine: the coordinator and pp x tp stage workers as child
processes on free ports. `moemesh generate --pp N` and `moemesh serve` use it.

A stage worker that exits on its own is started again with the same flags (at most
`MAX_RESTARTS` in any minute, each after a short backoff), and the coordinator's recovery takes
the replacement in; the coordinator itself, or a worker past that budget, ends the mesh. A worker
the coordinator counts lost while its process lives on (stopped, or stuck where it cannot hear its
Shutdown) is killed `LOST_GRACE` seconds later, and so started again too: the coordinator says
which on its stdout, where the launcher read its announcement.

No orphans: every child is in the launcher's care (terminated, then killed, on exit, on Ctrl-C
and when any one of them dies), and asks the kernel to send it SIGTERM if the launcher itself dies
(PR_SET_PDEATHSIG), so not even `kill -9` of the parent leaves one behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import dataclasses

from moemesh.config import ModelConfig
from moemesh.errors import ConfigError
from moemesh.log import get_logger
from moemesh.protocol import WORKER_TOKEN, max_activation_bytes, worker_message_bytes
from moemesh.settings import (MAX_COUNT, CoordinatorSettings, EngineSettings, StageSettings, WorkerSettings,
                              host_memory)

log = get_logger("launcher")


class LaunchError(RuntimeError):
    pass


MAX_RESTARTS = 5  # restarts of one child in any 60 s
RESTART_BACKOFF = (0.5, 1.0, 2.0, 4.0, 8.0)  # seconds before the n-th restart within that minute
LOST_GRACE = 2.0  # seconds a worker the coordinator counted lost has to exit on its own before it is killed


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_worker(threads: int | None, workers: int) -> int:
    """--threads, or the cores this process may use shared evenly among `workers` processes."""
    return threads or max(1, available_cores() // workers)


def worker_message_limits(engine: EngineSettings) -> dict[str, int]:
    """The largest messages a stage worker of this engine's mesh can be sent (moemesh/protocol.py's
    limits), as its settings: any (a schedule, or a step's activations at the token budget), and the
    previous stage's activations."""
    from coordinator.scheduler import SchedulerConfig

    mc = ModelConfig.from_dir(engine.model)
    max_len = SchedulerConfig.for_model(engine.max_batched_tokens, engine.max_seqs, engine.max_model_len,
                                        mc.max_position_embeddings).max_model_len
    limits = {"max_message_bytes": worker_message_bytes(mc.hidden_size, engine.max_batched_tokens, engine.max_seqs,
                                                        max_len, engine.block_size),
              "max_activation_bytes": max_activation_bytes(mc.hidden_size, engine.max_batched_tokens)}
    if max(limits.values()) > MAX_COUNT:  # (what a worker's flags take: refused there, in a restart loop)
        raise ConfigError(f"--max-batched-tokens {engine.max_batched_tokens} with --max-seqs {engine.max_seqs}: a "
                          f"step's messages to a stage worker could be {max(limits.values()):,} bytes, more than "
                          f"the {MAX_COUNT:,} one takes")
    return limits


# not a role's settings: every process reads them (the last two: the CPU kernels' prefetch policy
# and AMX tiles, kernels/cpu_gemm.py, set by hand for a whole mesh)
_PROCESS_WIDE = ("MOEMESH_HOME", "MOEMESH_LOG_LEVEL", "MOEMESH_LOG_FORMAT", "MOEMESH_PREFETCH", "MOEMESH_AMX")


def child_environment() -> dict[str, str]:
    """This process's environment without the MOEMESH_* settings variables: a child gets its
    settings as flags (`Settings.to_argv`), not from whatever the launcher's environment holds."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MOEMESH_") or k in _PROCESS_WIDE}


try:  # (looked up here, not in the forked child: a dlopen there can deadlock a threaded parent's fork)
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def die_with_parent() -> None:  # runs in the child between fork and exec
    # Ctrl-C reaches the whole process group; the launcher alone decides when children stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalMesh:
    """with LocalMesh.of(EngineSettings(model=..., pp=2)) as mesh: ... mesh.client_address ...

    The children are `moemesh coordinator` and pp x tp `moemesh stage-worker` processes, each started
    with its settings rendered to flags (`Settings.to_argv`)."""

    def __init__(self, coordinator: CoordinatorSettings, worker: WorkerSettings, extra_env: dict | None = None,
                 startup_timeout: float = 300.0):
        self.coordinator, self.worker = coordinator, worker
        self.extra_env, self.startup_timeout = extra_env or {}, startup_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.client_address: str | None = None
        self.worker_address: str | None = None
        self.died: str | None = None  # set by the watcher when a child exits on its own
        self.argv: dict[str, list[str]] = {}  # each child's command line (a restart reuses it)
        self.tokens: dict[str, str] = {}  # each worker's secret part of its identity (WORKER_TOKEN)
        self.restarts: dict[str, list[float]] = {}  # child -> when it was restarted
        self._stop = threading.Event()  # wakes the watcher when the mesh stops
        self._waiting: set[str] = set()  # children that ended, waiting out their restart's backoff
        self.restart_coordinator = False  # `serve` sets it (its gateway reconnects); a driver's requests die with it
        self._stopping = False
        self._watcher: threading.Thread | None = None
        self._heard: tuple[subprocess.Popen | None, bytes] = (None, b"")  # (coordinator, its unfinished line)
        # (pp, tp, pid) -> (when to kill it, why the coordinator lost it): a pid is one host's, so the ranks too
        self.lost: dict[tuple[int, int, int], tuple[float, str]] = {}

    @classmethod
    def of(cls, engine: EngineSettings, extra_env: dict | None = None, **changes) -> "LocalMesh":
        """The mesh that runs `engine` (its model a directory; threads default to the cores shared
        among the workers): the coordinator on free ports, every worker on loopback. `changes` are
        further coordinator or worker settings (worker_timeout=2.0, record=DIR, ...)."""
        mine = {f.name for c in (CoordinatorSettings, WorkerSettings) for f in dataclasses.fields(c)}
        if set(changes) - mine:
            raise TypeError(f"neither coordinator nor worker settings have {', '.join(sorted(set(changes) - mine))}")
        pick = lambda c: {k: v for k, v in changes.items() if k in {f.name for f in dataclasses.fields(c)}}  # noqa: E731
        # (its coordinator drains nothing on SIGTERM: the mesh stops whole, its workers with it, after `serve`'s
        # gateway has drained the requests)
        coordinator = CoordinatorSettings.derive(engine, **{"port": 0, "client_port": 0, "drain_timeout": 0.05,
                                                            **pick(CoordinatorSettings)})
        threads = threads_per_worker(engine.threads, engine.pp * engine.tp)
        worker = WorkerSettings.derive(engine, **{"threads": threads, **worker_message_limits(engine),
                                                  **pick(WorkerSettings)})
        return cls(coordinator, worker, extra_env)

    def __enter__(self) -> "LocalMesh":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        threads = str(self.worker.threads or 1)
        env = {**child_environment(), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **self.extra_env}
        if name != "coordinator":  # (the secret part of its identity: its death is reported in its name)
            env[WORKER_TOKEN] = self.tokens[name] = secrets.token_hex(16)
        # (the coordinator's stdout unbuffered: the watch reads it with os.read once the announcement is in)
        proc = subprocess.Popen([sys.executable, "-m", "moemesh", *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if name == "coordinator" else subprocess.DEVNULL,
                                bufsize=0, preexec_fn=die_with_parent)
        self.procs[name], self.argv[name] = proc, args
        return proc

    def start(self) -> None:
        self._check_workers_can_run()
        coord = self._spawn("coordinator", ["coordinator", *self.coordinator.to_argv()])
        addresses = self._read_announcement(coord)
        self.client_address, self.worker_address = addresses["clients"], addresses["workers"]
        self._start_workers(addresses["workers"])
        watcher = threading.Thread(target=self._watch, daemon=True)
        watcher.start()
        self._watcher = watcher  # (stop joins only a watcher that started)

    def worker_settings(self, coordinator: str, pp_rank: int, tp_rank: int, **changes) -> WorkerSettings:
        record = self.worker.record and f"{self.worker.record}/pp{pp_rank}-tp{tp_rank}"
        return WorkerSettings.derive(self.worker, coordinator=coordinator, pp_rank=pp_rank, tp_rank=tp_rank,
                                     record=record, **changes)

    def worker_device(self, pp_rank: int, tp_rank: int) -> str:
        """cuda: one GPU a worker, stage by stage and tensor rank by tensor rank (worker i on cuda:i)."""
        if self.worker.device != "cuda":
            return self.worker.device
        return f"cuda:{pp_rank * self.coordinator.tp + tp_rank}"

    def _check_workers_can_run(self) -> None:
        """The workers run on this host: what they could not run (the device, the native kernels, the
        checkpoint's weight files) is one error now rather than a traceback in each of them."""
        from moemesh_kernels.backend import check_device, resolve_backend
        from stage_worker.loader import check_checkpoint

        workers = self.coordinator.pp * self.coordinator.tp
        # (cuda: one GPU a worker, worker i on cuda:i)
        if self.worker.device == "cuda":
            check_device(f"cuda:{workers - 1}", f"--device cuda, one GPU for each of the {workers} (--pp x --tp) "
                                                f"workers, needs")
        else:
            check_device(self.worker.device)
        if self.coordinator.moe_backend == "native":
            resolve_backend("native", self.worker.device)
        check_checkpoint(self.coordinator.model)
        memory = host_memory()
        if self.worker.device == "cpu" and self.worker.num_kv_blocks is None and self.worker.kv_memory * workers > memory:
            raise ConfigError(f"--kv-memory {self.worker.kv_memory} for each of the {workers} stage workers is "
                              f"{self.worker.kv_memory * workers / 2**30:.1f} GiB in all, more than this host's "
                              f"{memory / 2**30:.1f} GiB of memory")

    def _start_workers(self, coordinator: str) -> None:
        for p in range(self.coordinator.pp):
            for t in range(self.coordinator.tp):
                w = self.worker_settings(coordinator, p, t, device=self.worker_device(p, t))
                self._spawn(f"stage-worker pp={p} tp={t}", ["stage-worker", *w.to_argv()])

    def _read_announcement(self, coord: subprocess.Popen, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopping:
            # wait for a line with the deadline: a coordinator that hangs before printing must not hang
            # us (nor a stop while a restarted one starts: a step at a time)
            if not select.select([coord.stdout], [], [], min(0.2, max(0.0, deadline - time.monotonic())))[0]:
                continue
            line = coord.stdout.readline()
            if not line:
                raise LaunchError(f"the coordinator exited (status {coord.wait()}) before it was listening")
            if line.startswith(b"MOEMESH_COORDINATOR "):
                return json.loads(line.split(b" ", 1)[1])
        if self._stopping:
            raise LaunchError("stopping")
        raise LaunchError(f"the coordinator did not start listening within {timeout:g} s")

    def _watch(self) -> None:
        """Every child that ends is seen within 0.1 s (a worker's death reported to the coordinator)
        and started again after its backoff, which runs beside the others' (two deaths are two
        restarts in parallel, not one after the other's delay; only a coordinator's restart holds the
        watch, until it listens). A child past its restart budget ends the watch: the mesh is down
        (`died`); the children left are still reaped. So does a fault of the watch itself."""
        try:
            self._watch_children()
        except Exception as e:  # (a launcher that stops watching unnoticed would leave a dead mesh serving)
            if not self._stopping:
                log.error("the launcher's watch failed", exc_info=True)
                self._down(f"the launcher's watch of its children failed: {type(e).__name__}: {e}")

    def _watch_children(self) -> None:
        due: dict[str, tuple[float, str]] = {}  # child -> (when its restart is due, how it ended)
        while not self._stopping:
            self._heed_coordinator()
            ended = self._check_children()
            if ended is not None and not self._stopping:  # (children that `stop` ends are not deaths)
                name, died = ended
                if name is not None and name.startswith("stage-worker"):
                    self._report_death(name)
                backoff = self._restart_backoff(name, died) if name is not None else None
                if backoff is None:
                    return self._down(died)
                due[name] = (time.monotonic() + backoff, died)
                self._waiting.add(name)  # (not seen as ending again while it waits)
                continue  # (another may have ended too)
            for name, (at, died) in list(due.items()):
                if time.monotonic() >= at and not self._stopping:
                    del due[name]
                    self.restarts[name].append(time.monotonic())
                    if not self._respawn(name):
                        return None if self._stopping else self._down(died)
                    self._waiting.discard(name)
            self._stop.wait(0.1)

    def _heed_coordinator(self) -> None:
        """Reads the lines the coordinator printed since the last look (all of them: a pipe nobody
        reads would stop it once full) and kills each worker it counted lost that has not ended
        LOST_GRACE seconds later."""
        coord = self.procs.get("coordinator")
        if coord is not None and coord.stdout is not None and not coord.stdout.closed:
            heard, pending = self._heard
            if heard is not coord:  # (a restarted coordinator: what the last one left unfinished is void)
                pending = b""
            while select.select([coord.stdout], [], [], 0)[0]:
                chunk = os.read(coord.stdout.fileno(), 1 << 16)
                if not chunk:
                    break  # (it ended: the watch sees that)
                pending += chunk
            *lines, pending = pending.split(b"\n")
            self._heard = (coord, pending[-(1 << 16):])
            for line in lines:
                if line.startswith(b"MOEMESH_LOST "):
                    try:
                        lost = json.loads(line.split(b" ", 1)[1])
                        key = (int(lost["pp"]), int(lost["tp"]), int(lost["pid"]))
                        reason = str(lost["reason"])
                    except (ValueError, KeyError, TypeError):
                        continue
                    self.lost.setdefault(key, (time.monotonic() + LOST_GRACE, reason))
        now = time.monotonic()
        for (pp, tp, pid), (at, reason) in list(self.lost.items()):
            if now >= at:
                del self.lost[pp, tp, pid]
                self._kill_lost(pp, tp, pid, reason)

    def _kill_lost(self, pp: int, tp: int, pid: int, reason: str) -> None:
        """Kills this launcher's worker for rank (pp, tp) if it is process `pid` and still runs (the watch
        then restarts it)."""
        name = f"stage-worker pp={pp} tp={tp}"
        proc = self.procs.get(name)
        if proc is not None and proc.pid == pid and proc.poll() is None:
            log.warning("killing a worker the coordinator counted lost", extra={"fields": {
                "child": name, "pid": pid, "seconds_since": LOST_GRACE, "reason": reason}})
            proc.kill()

    def _down(self, died: str) -> None:
        """The mesh is down for good: say so (`died`), and reap the children that end from now on."""
        self.died = died
        log.error("child died", extra={"fields": {"child": died}})
        while not self._stopping:
            for proc in list(self.procs.values()):
                proc.poll()
            self._stop.wait(0.5)

    def _restart_backoff(self, name: str, why: str) -> float | None:
        """The seconds before a child that ended starts again, or None where it does not: not one to
        restart, or past its budget (MAX_RESTARTS within a minute). A coordinator comes back on the
        ports it had (the workers, told nothing for a while, exit and register with it again; clients
        reconnect to the same address); requests it held end with an error."""
        if not self._restartable(name):
            return None
        now = time.monotonic()
        recent = self.restarts[name] = [t for t in self.restarts.get(name, []) if now - t < 60]
        if len(recent) >= MAX_RESTARTS:
            log.error("restart budget spent", extra={"fields": {"child": why, "restarts_per_minute": MAX_RESTARTS}})
            return None
        backoff = RESTART_BACKOFF[len(recent)]
        log.warning("restarting", extra={"fields": {"child": why, "in_seconds": backoff}})
        return backoff

    def _restartable(self, name: str) -> bool:
        return name.startswith("stage-worker") or name == "coordinator" and self.restart_coordinator

    def _respawn(self, name: str) -> bool:
        """Starts child `name` again as it was started; whether it did."""
        if name == "coordinator":
            ports = {"--port": self.worker_address.rsplit(":", 1)[1], "--client-port": self.client_address.rsplit(":", 1)[1]}
            argv = [f"{flag}={ports[flag]}" if (flag := arg.split("=", 1)[0]) in ports else arg
                    for arg in self.argv[name]]
            try:
                self._read_announcement(self._spawn(name, argv))
            except LaunchError as e:
                if not self._stopping:  # (a stop while it started is no failure)
                    log.error("coordinator restart failed", extra={"fields": {"error": str(e)}})
                return False
            return True
        self._spawn(name, self.argv[name])
        return True

    def _report_death(self, name: str) -> None:
        """A worker killed by a signal could not say so: tell the coordinator in its name (its identity
        is its ranks, pid and the token it was started with), so the recovery starts now rather than at
        the heartbeat timeout."""
        proc = self.procs[name]
        if proc.returncode is None or proc.returncode >= 0 or self.worker_address is None:
            return  # (one that exited on its own has said why, or was told to)
        import zmq

        from moemesh.mesh_security import MeshKeys
        from moemesh.netutil import connect
        from moemesh.protocol import Codec, WorkerFailed, worker_identity

        ctx = zmq.Context()
        try:  # best effort: the heartbeat timeout and the replacement's registration tell it anyway
            p, t = (int(part.split("=")[1]) for part in name.split()[1:3])
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, worker_identity(p, t, proc.pid, self.tokens[name]))
            if self.worker.mesh_keys:
                MeshKeys(self.worker.mesh_keys).connect(sock, "worker")
            connect(sock, self.worker_address)
            sock.send_multipart(Codec.encode(WorkerFailed(p, t, f"killed by signal {-proc.returncode} (its launcher "
                                                                f"saw it)")))
            sock.close(linger=1000)
        except Exception as e:  # (the watcher must go on restarting children whatever happens here)
            log.warning("could not report a death", extra={"fields": {"child": name, "error": str(e)}})
        finally:
            ctx.destroy(linger=1000)  # (closes a socket an exception left open: term() would wait for it)

    def _check_children(self) -> tuple[str | None, str] | None:
        """(name, description) of a child that ended, if one did (one waiting to restart is not)."""
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is not None and name not in self._waiting:
                return name, f"{name} exited with status {code}"
        return None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """For tests: kill one child as a crash would."""
        self.procs[name].send_signal(sig)

    def _stop_watching(self) -> None:
        """Ends the watch first: no restart starts a child behind stop's back."""
        self._stopping = True
        self._stop.set()
        watcher, self._watcher = self._watcher, None  # (joined once: RayMesh.stop, then LocalMesh.stop)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=10)

    def stop(self) -> None:
        self._stop_watching()
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in list(self.procs.values()):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()


def run_stage(stage: StageSettings) -> int:
    """`moemesh stage`: the tp workers of one pipeline stage on this host (a container's entry point),
    worker i on `cuda:i` when the device is cuda. Returns when any of them exits: its status (after
    stopping the others), so the container's restart policy takes over."""
    procs = []
    try:
        for t in range(stage.tp):
            worker = WorkerSettings.derive(stage, tp_rank=t, port=stage.port + t if stage.port else 0,
                                           device=f"cuda:{t}" if stage.device == "cuda" else stage.device)
            procs.append(subprocess.Popen([sys.executable, "-m", "moemesh", "stage-worker", *worker.to_argv()],
                                          env=child_environment(), stdin=subprocess.DEVNULL,
                                          preexec_fn=die_with_parent))
        while True:
            for proc in procs:
                code = proc.poll()
                if code is not None:
                    log.error("stage worker exited", extra={"fields": {"pp_rank": stage.pp_rank, "status": code}})
                    return code or 1
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
