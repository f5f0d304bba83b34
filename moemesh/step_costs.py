"""The measured costs `--layer-partition auto` balances (`--partition-costs measured`, the default):
stage_worker/costs.py times, on this machine with the stages' kernels, dtype and quantization, a
decode step of a middle stage of one layer and of two, and of the last stage with the head, as a
stage worker runs them, and a prompt chunk of one layer; this runs it in a subprocess (the control
plane does not import torch) and keeps the answer under ~/.cache/moemesh/costs, keyed by the
checkpoint's files, the settings, the workload's shape, the CPU, torch's version, the kernels'
settings (MOEMESH_AMX, MOEMESH_PREFETCH) and the stage code's source, so that a mesh started again
decides at once. A measurement that failed is kept too (it is not tried again for the same key).

Measuring is skipped, and the weights' multiply-adds balanced instead (`StepCosts.of_weights`),
where it cannot stand for the stages: stages on a GPU, a model of one layer, a checkpoint whose
layers are too large to load and time within `TIMEOUT` (`MEASURE_LIMIT`), or a subprocess that
fails (logged). The measurement runs where the layout is decided (`serve`, `generate` and `bench
throughput` before they start anything, the in-process engine), with the stages' threads; a mesh of
unlike hosts should name its split. A standalone coordinator does not know where its stages run
and balances the weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from moemesh.config import ModelConfig
from moemesh.layout import StepCosts
from moemesh.log import get_logger
from moemesh.settings import auto_mix

log = get_logger("step_costs")

MEASURE_LIMIT = 1 << 30  # checkpoint bytes of four layers (the measurement holds up to three, and the head, at once)
TIMEOUT = 90.0  # seconds the measurement may take (8-9 s for the bench model's 265 MB of four layers)
BARE_AUTO_LENGTHS = (32, 32)  # prompt and output tokens a plain "auto" (a 1:1 mix) is measured with
_ROOT = Path(__file__).resolve().parent.parent
_SETTINGS_ENV = ("MOEMESH_AMX", "MOEMESH_PREFETCH")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moemesh" / "costs"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _source_folders() -> tuple[str, ...]:
    """The code whose change prices a layer anew: the stage's and the kernels', kernels/ in a checkout
    and moemesh_kernels/ where a wheel is installed (a `kernels` beside it there is HuggingFace's)."""
    return "stage_worker", "moemesh_kernels" if (_ROOT / "moemesh_kernels").is_dir() else "kernels"


def _key(model_dir: Path, args: dict) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors"))
    h.update(json.dumps([str(model_dir.resolve()), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
                         args, _cpu(), os.cpu_count(), sys.executable, _torch_version(),
                         {k: os.environ.get(k) for k in _SETTINGS_ENV}], sort_keys=True).encode())
    for folder in _source_folders():
        for path in sorted((_ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".c", ".cpp") and path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()[:32]


def checkpoint_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def _keep(path: Path, record: dict) -> None:
    """The answer on disk for the next start; a cache that cannot be written costs a measurement then."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError as e:
        log.info("layer costs not kept", extra={"fields": {"path": str(path), "error": str(e)}})


def measured_costs(model_dir: str | Path, model: ModelConfig, *, dtype: str = "auto", quantization: str | None = None,
                   moe_backend: str = "auto", rows: int = 64, context: int = 64, prompt_len: int = 32,
                   chunk: int = 512, threads: int = 1) -> StepCosts | None:
    """The model's costs per token measured here (kept), or None where they are not measured (logged)."""
    model_dir = Path(model_dir)
    if model.num_layers < 2:
        return None
    size = checkpoint_bytes(model_dir)
    if size == 0:
        log.info("layer costs not measured: no safetensors here; the weights' multiply-adds are balanced",
                 extra={"fields": {"model": str(model_dir)}})
        return None
    if size * 4 / model.num_layers > MEASURE_LIMIT:
        log.info("layer costs not measured: the checkpoint's layers are too large to load and time for it; the "
                 "weights' multiply-adds are balanced", extra={"fields": {"checkpoint_bytes": size}})
        return None
    args = {"dtype": dtype, "quantization": quantization, "moe_backend": moe_backend, "rows": max(1, rows),
            "context": max(0, context), "prompt_len": max(1, prompt_len), "chunk": max(1, chunk),
            "threads": max(1, threads)}
    path = cache_dir() / f"{_key(model_dir, args)}.json"
    try:
        kept = json.loads(path.read_text())
        if "failed" in kept:
            log.info("layer costs not measured: the measurement failed before; the weights' multiply-adds are "
                     "balanced", extra={"fields": {"error": kept["failed"], "path": str(path)}})
            return None
        return StepCosts.from_measurement(model, kept)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    argv = [sys.executable, "-m", "stage_worker.costs", "--model", str(model_dir)]
    for k, v in args.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args["threads"]), "MKL_NUM_THREADS": str(args["threads"])}
    log.info("measuring each layer's cost for --layer-partition auto (once per model, settings and machine)",
             extra={"fields": {"rows": args["rows"], "context": args["context"]}})
    started = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
                              cwd=_ROOT)
        if done.returncode != 0:
            raise RuntimeError((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        costs = StepCosts.from_measurement(model, measured)
    except (OSError, subprocess.TimeoutExpired, RuntimeError, ValueError, KeyError, IndexError, TypeError) as e:
        log.warning("layer costs could not be measured; the weights' multiply-adds are balanced instead",
                    extra={"fields": {"error": str(e)}})
        if not isinstance(e, OSError):  # (not a fault of this host's that may pass: kept, not tried again)
            _keep(path, {"failed": str(e)})
        return None
    _keep(path, measured)
    us = lambda c: round(c * 1e6, 1)  # noqa: E731
    log.info("layer costs measured", extra={"fields": {
        "seconds": round(time.monotonic() - started, 2), "decode_us_per_token": sorted(set(map(us, costs.decode))),
        "prompt_us_per_token": sorted(set(map(us, costs.prompt))), "head_us_per_row": us(costs.head)}})
    return costs


def partition_costs(settings, model_dir: str | Path, model: ModelConfig, pp: int, *, rows: int | None = None,
                    threads: int = 1, device: str = "cpu") -> StepCosts | None:
    """The costs `resolve_layout` should balance for these settings (a ModelSettings, LayoutSettings
    and SchedulerSettings): measured ones where --layer-partition is auto[:PROMPT:OUTPUT], --pp is
    above 1 (and not above the model's layers), --partition-costs is measured and the stages run on
    this CPU; else None (the weights'). `rows`: the sequences a decode microbatch holds (default:
    --max-seqs, within --max-batched-tokens, shared among the pp microbatches in flight). A plain
    "auto" is measured with `BARE_AUTO_LENGTHS`."""
    partition = settings.layer_partition
    if not isinstance(partition, str) or not 2 <= pp <= model.num_layers or settings.partition_costs != "measured":
        return None
    if not str(device).startswith("cpu"):
        return None
    prompt, output = BARE_AUTO_LENGTHS if partition == "auto" else auto_mix(partition)
    if rows is None:
        rows = math.ceil(min(settings.max_seqs, settings.max_batched_tokens) / pp)
    return measured_costs(model_dir, model, dtype=settings.dtype, quantization=settings.quantization,
                          moe_backend=settings.moe_backend, rows=rows, context=prompt + output // 2,
                          prompt_len=prompt or 1, chunk=settings.max_batched_tokens, threads=threads)
