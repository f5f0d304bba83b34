"""What this machine does with N cores and no pipeline at all: N independent in-process engines
side by side (one process and one torch thread each), each with its share of the prompts, started
together. `bench throughput --ceiling` prints it beside the layouts with N workers, so that a
pipeline's speedup over one worker can be read against the speedup the cores themselves allow
(two busy cores of a small VM do not do twice the work of one: shared caches, memory bandwidth and
clocks). Each engine is a child process (`python -m moemesh.entrypoints.bench.ceiling JOB`) that
loads its engine, says it is ready, waits for the word on its stdin, generates, and prints its
tokens and seconds as one JSON line; jobs and results travel as JSON. Each child holds the whole
model, so N engines take N times its memory.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings

READY = "ready"


def bench_ceiling(settings: EngineSettings, prompts: list[list[int]], params: SamplingParams, engines: int,
                  load_timeout: float = 600, run_timeout: float = 3600) -> dict:
    """Tokens generated and wall seconds, from the moment every engine was loaded and told to start
    until the last one reported. Engine i gets prompts i, i + engines, ... all at once.
    RuntimeError when an engine fails, or is not loaded within `load_timeout` seconds, or has not
    reported `run_timeout` seconds after the start."""
    from moemesh.entrypoints.launcher import child_environment, die_with_parent

    env = {**child_environment(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = EngineSettings.derive(settings, threads=1).to_argv()
    procs: list[subprocess.Popen] = []
    lines: list[queue.Queue] = []
    readers: list[threading.Thread] = []
    with tempfile.TemporaryDirectory(prefix="moemesh-ceiling-") as jobs:
        try:
            for i in range(engines):
                job = os.path.join(jobs, f"engine-{i}.json")
                with open(job, "w") as f:
                    json.dump({"settings": argv, "prompts": prompts[i::engines], "max_tokens": params.max_tokens}, f)
                p = subprocess.Popen([sys.executable, "-m", "moemesh.entrypoints.bench.ceiling", job],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=die_with_parent)
                procs.append(p)
                q, reader = _reader(p)
                lines.append(q)
                readers.append(reader)
            deadline = time.monotonic() + load_timeout
            for i, (p, q) in enumerate(zip(procs, lines)):
                _expect(i, p, q, deadline, "load", lambda line: line == READY)
            start = time.perf_counter()
            for i, p in enumerate(procs):
                try:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                except OSError:
                    raise RuntimeError(f"ceiling engine {i} ended before it could run (status {p.wait()})") from None
            deadline = time.monotonic() + run_timeout
            results = [json.loads(_expect(i, p, q, deadline, "report", _is_result))
                       for i, (p, q) in enumerate(zip(procs, lines))]
            seconds = time.perf_counter() - start  # the clock stops at the last result, not at the exits
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for p, reader in zip(procs, readers):
                reader.join(timeout=10)  # it reads to the end of the dead child's stdout first
                for pipe in (p.stdin, p.stdout):
                    try:
                        pipe.close()
                    except OSError:
                        pass
    return {"tokens": sum(r["tokens"] for r in results), "seconds": seconds,
            "engine_seconds": [r["seconds"] for r in results]}


def _reader(p: subprocess.Popen) -> tuple[queue.Queue, threading.Thread]:
    """The child's stdout lines, then None at its end, read by a thread (so a wait can have a deadline)."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in p.stdout:
            q.put(line.strip())
        q.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return q, reader


def _expect(i: int, p: subprocess.Popen, q: queue.Queue, deadline: float, what: str, wanted) -> str:
    """The child's next line that `wanted` accepts (other lines are skipped: anything a library
    printed at start-up); RuntimeError when it ends first or the deadline passes."""
    while True:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"ceiling engine {i} did not {what} in time") from None
        if line is None:
            p.kill()  # its stdout closed: gone, or going
            raise RuntimeError(f"ceiling engine {i} ended before it could {what} (status {p.wait()})")
        if wanted(line):
            return line


def _is_result(line: str) -> bool:
    try:
        r = json.loads(line)
    except ValueError:
        return False
    return isinstance(r, dict) and isinstance(r.get("tokens"), int) and isinstance(r.get("seconds"), float)


def _engine(job_path: str) -> int:
    # the protocol gets its own copy of stdout; whatever else writes there goes to stderr
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import torch

    from moemesh.entrypoints.engine import LLMEngine

    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    engine = LLMEngine(EngineSettings.from_argv(job["settings"]), progress=None)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
    print(READY, file=protocol, flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start = time.perf_counter()
    outs = engine.generate(job["prompts"], params)
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds}), file=protocol, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_engine(sys.argv[1]))
