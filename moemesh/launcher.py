"""Starting a whole mesh on this machine: the coordinator and pp x tp stage workers as child
processes on free ports. `moemesh generate --pp N` and (later) `moemesh serve` use it.

No orphans: every child is in the launcher's care (terminated, then killed, on exit, on Ctrl-C
and when any one of them dies), and asks the kernel to send it SIGTERM if the launcher itself dies
(PR_SET_PDEATHSIG), so not even `kill -9` of the parent leaves one behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from moemesh.log import get_logger

log = get_logger("launcher")


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class MeshSpec:
    model: str
    pp: int = 1
    tp: int = 1
    layer_partition: tuple[int, ...] | None = None
    dtype: str = "auto"
    block_size: int = 16
    kv_memory_bytes: int = 1 << 30  # per worker
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_in_flight: int | None = None
    threads_per_worker: int = 1
    worker_timeout: float = 5.0
    expert_parallel: bool = False
    record_dir: str | None = None  # workers record their first steps under DIR/pp{p}-tp{t}
    quantization: str | None = None
    moe_backend: str = "auto"
    extra_env: dict = field(default_factory=dict)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_worker(args, workers: int) -> int:
    """--threads, or the cores this process may use shared evenly among `workers` processes."""
    return args.threads or max(1, available_cores() // workers)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # Ctrl-C reaches the whole process group; the launcher alone decides when children stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalMesh:
    """with LocalMesh(spec) as mesh: ... mesh.client_address ..."""

    def __init__(self, spec: MeshSpec, startup_timeout: float = 300.0):
        self.spec, self.startup_timeout = spec, startup_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.client_address: str | None = None
        self.worker_address: str | None = None
        self.died: str | None = None  # set by the watcher when a child exits on its own
        self._stopping = False
        self._watcher: threading.Thread | None = None

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
        threads = str(self.spec.threads_per_worker)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **self.spec.extra_env}
        proc = subprocess.Popen([sys.executable, "-m", "moemesh", *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE if name == "coordinator" else subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        s = self.spec
        args = ["coordinator", "--model", s.model, "--pp", str(s.pp), "--tp", str(s.tp), "--dtype", s.dtype,
                "--block-size", str(s.block_size), "--max-batched-tokens", str(s.max_num_batched_tokens),
                "--max-seqs", str(s.max_num_seqs), "--worker-timeout", str(s.worker_timeout),
                "--port", "0", "--client-port", "0"]
        if s.layer_partition:
            args += ["--layer-partition", ",".join(map(str, s.layer_partition))]
        if s.max_in_flight:
            args += ["--max-in-flight", str(s.max_in_flight)]
        if s.expert_parallel:
            args += ["--expert-parallel"]
        if s.quantization:
            args += ["--quantization", s.quantization]
        if s.moe_backend != "auto":
            args += ["--moe-backend", s.moe_backend]
        coord = self._spawn("coordinator", args)
        addresses = self._read_announcement(coord)
        self.client_address, self.worker_address = addresses["clients"], addresses["workers"]
        self._start_workers(addresses["workers"])
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _start_workers(self, coordinator: str) -> None:
        s = self.spec
        for p in range(s.pp):
            for t in range(s.tp):
                self._spawn(f"stage-worker pp={p} tp={t}", [
                    "stage-worker", "--coordinator", coordinator, "--pp-rank", str(p), "--tp-rank", str(t),
                    "--kv-memory", str(s.kv_memory_bytes), "--threads", str(s.threads_per_worker),
                    *(["--record", f"{s.record_dir}/pp{p}-tp{t}"] if s.record_dir else [])])

    def _read_announcement(self, coord: subprocess.Popen) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = coord.stdout.readline()
            if not line:
                raise LaunchError(f"the coordinator exited (status {coord.wait()}) before it was listening")
            if line.startswith(b"MOEMESH_COORDINATOR "):
                return json.loads(line.split(b" ", 1)[1])
        raise LaunchError("the coordinator did not start listening within 60 s")

    def _watch(self) -> None:
        while not self._stopping:
            died = self._check_children()
            if died and not self._stopping:
                self.died = died
                log.error("child died", extra={"fields": {"child": died}})
                return
            time.sleep(0.1)

    def _check_children(self) -> str | None:
        """A description of a child that ended, if one did."""
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is not None:
                return f"{name} exited with status {code}"
        return None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """For tests: kill one child as a crash would."""
        self.procs[name].send_signal(sig)

    def stop(self) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()


def run_stage(worker_args: list[str], pp_rank: int, tp: int, device: str) -> int:
    """`moemesh stage`: the tp workers of one pipeline stage on this host (a container's entry point),
    worker i on `cuda:i` when the device is cuda. Returns when any of them exits: its status (after
    stopping the others), so the container's restart policy takes over."""
    procs = []
    try:
        for t in range(tp):
            dev = f"cuda:{t}" if device == "cuda" else device
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "moemesh", "stage-worker", *worker_args, "--pp-rank", str(pp_rank),
                 "--tp-rank", str(t), "--device", dev], stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        while True:
            for proc in procs:
                code = proc.poll()
                if code is not None:
                    log.error("stage worker exited", extra={"fields": {"pp_rank": pp_rank, "status": code}})
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
