"""What this machine does with N cores and no pipeline at all: N independent in-process engines
side by side (one process and one torch thread each), each with its share of the prompts, started
together. `bench throughput --ceiling` prints it beside the layouts with N workers, so that a
pipeline's speedup over one worker can be read against the speedup the cores themselves allow
(two busy cores of a small VM do not do twice the work of one: shared caches, memory bandwidth and
clocks). Each engine is a child process (`python -m moemesh.entrypoints.bench.ceiling`) that
loads its engine, says it is ready, waits for the word on its stdin, generates, and prints its
tokens and seconds as one JSON line; jobs and results travel as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings

READY = "ready"


def bench_ceiling(settings: EngineSettings, prompts: list[list[int]], params: SamplingParams, engines: int,
                  timeout: float = 60) -> dict:
    """Tokens generated and wall seconds, from the moment every engine was loaded and told to start
    until the last one reported. Engine i gets prompts i, i + engines, ...
    RuntimeError when an engine fails; `timeout`: seconds an engine may take to exit once done."""
    from moemesh.entrypoints.launcher import child_environment

    env = {**child_environment(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = EngineSettings.derive(settings, threads=1).to_argv()
    procs, files = [], []
    try:
        for i in range(engines):
            f = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="moemesh-ceiling-")
            json.dump({"settings": argv, "prompts": prompts[i::engines], "max_tokens": params.max_tokens}, f)
            f.flush()
            files.append(f)
            procs.append(subprocess.Popen([sys.executable, "-m", "moemesh.entrypoints.bench.ceiling", f.name],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        for i, p in enumerate(procs):
            line = p.stdout.readline().strip()
            if line != READY:
                raise RuntimeError(f"ceiling engine {i} did not start (status {p.wait()})")
        start = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for i, p in enumerate(procs):  # the clock stops at the last result, not at the processes' exits
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"ceiling engine {i} failed (status {p.wait()})")
            results.append(json.loads(line))
        seconds = time.perf_counter() - start
        for p in procs:
            p.wait(timeout=timeout)
        return {"tokens": sum(r["tokens"] for r in results), "seconds": seconds,
                "engine_seconds": [r["seconds"] for r in results]}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()


def _engine(job_path: str) -> int:
    import torch

    from moemesh.entrypoints.engine import LLMEngine

    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    engine = LLMEngine(EngineSettings.from_argv(job["settings"]), progress=None)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
    print(READY, flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start = time.perf_counter()
    outs = engine.generate(job["prompts"], params)
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens": sum(len(o.token_ids) for o in outs), "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(_engine(sys.argv[1]))
