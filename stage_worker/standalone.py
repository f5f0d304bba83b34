"""Debugging one stage without a mesh.

A live worker started with `--record DIR` writes, for its first steps, what it received (the
schedule and, past stage 0, the activations) and what it produced (activations, or on the last
stage the sampled tokens). `moemesh stage-worker --standalone --model M --layers A:B` then loads
just that slice in this process and runs either synthetic input or the recorded steps, in order
(the KV cache builds up as it did live), printing time per layer and output statistics, and for a
recording, how far its outputs are from the recorded ones.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moemesh.config import ModelConfig, resolve_dtype
from moemesh.errors import LoadError
from moemesh.protocol import Schedule, SeqWork, StepResult
from moemesh.sampling import SamplingParams
from stage_worker.executor import StageExecutor
from stage_worker.layers.fp8 import resolve_quantization
from stage_worker.runner import StageRunner
from stage_worker.tensors import torch_dtype

RUN_FILE = "run.json"  # how the recorded stage computed: a replay computes the same way


class Recorder:
    """Writes step-NNNNNN.schedule (msgpack), .inputs / .outputs (safetensors: the residual stream as
    "stream") or .result (msgpack), and run.json (the stage's layers, dtype, quantization, kernels,
    block size, and whether it holds the MLP before its layers: `mlp_handoff`)."""

    def __init__(self, directory: str | Path, max_steps: int):
        self.dir, self.max_steps, self.count = Path(directory), max_steps, 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"--record {directory}: {e.strerror}") from None

    def describe(self, **run) -> None:
        (self.dir / RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")

    def record(self, sched: Schedule, stream: torch.Tensor | None, out) -> None:
        if self.count >= self.max_steps:
            return
        self.count += 1
        stem = self.dir / f"step-{sched.step_id:06d}"
        stem.with_suffix(".schedule").write_bytes(msgspec.msgpack.encode(sched))
        if stream is not None:
            save_file({"stream": stream.contiguous()}, str(stem.with_suffix(".inputs")))
        if isinstance(out, StepResult):
            stem.with_suffix(".result").write_bytes(msgspec.msgpack.encode(out))
        else:
            save_file({"stream": out.contiguous()}, str(stem.with_suffix(".outputs")))


def recorded_run(directory: str | None) -> dict:
    """What a recording's run.json says (nothing for synthetic input, or a recording made before it)."""
    if directory and not Path(directory).is_dir():
        raise LoadError(f"--replay {directory}: no such directory (a --record directory)")
    path = Path(directory) / RUN_FILE if directory else None
    if path is None or not path.is_file():
        return {}
    try:
        run = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise LoadError(f"--replay {directory}: {RUN_FILE} cannot be read ({e})") from None
    if not isinstance(run, dict):
        raise LoadError(f"--replay {directory}: {RUN_FILE} is not a JSON object")
    return run


NUM_BLOCKS, BLOCK_SIZE = 4096, 16  # the standalone stage's KV pool (a recording may say another block size)


def run_standalone(model: str, layers: range, recording: str | None, tokens: int, seqs: int,
                   block_size: int = BLOCK_SIZE, out=print, dtype: str | None = None, quantization: str | None = None,
                   moe_backend: str | None = None, device: str = "cpu") -> int:
    """`dtype`, `quantization`, `moe_backend`: as given, else as the recording's stage computed (its
    run.json), else the defaults; an FP8 checkpoint always runs as one. `device`: where the layers
    compute (the streams go to it as a stage's do)."""
    mc = ModelConfig.from_dir(model)
    run = recorded_run(recording)
    block_size = run.get("block_size", block_size)
    compute = resolve_dtype(dtype or run.get("dtype") or "auto", mc)
    quant = resolve_quantization(mc, quantization or run.get("quantization"))
    backend = moe_backend or run.get("moe_backend") or "auto"
    num_blocks = NUM_BLOCKS
    started = time.perf_counter()
    runner = StageRunner(model, mc, layers, num_blocks, block_size, dtype=torch_dtype(compute), progress=None,
                         quant=quant, moe_backend=backend, handoff=run.get("mlp_handoff", False), device=device)
    out(f"loaded layers {layers.start}:{layers.stop} of {mc.num_layers} in {time.perf_counter() - started:.2f} s "
        f"({runner.load_stats.bytes_read / 2**20:.1f} MiB read from {len(runner.load_stats.files_opened)} files; "
        f"{compute}, {type(quant).__name__ if quant else 'unquantized'}, --moe-backend {backend})")
    executor = StageExecutor(runner, mc.eos_token_ids)
    steps = list(_recorded(recording)) if recording else [_synthetic(mc, runner, tokens, seqs, block_size)]
    worst, unchecked = 0.0, []
    for sched, stream, expected in steps:
        if stream is not None:  # (as a stage receives it: in its compute dtype)
            _check_stream(stream, sched, mc, recording)
            stream = stream.to(torch_dtype(compute))
        started = time.perf_counter()
        got, per_layer = _timed_run(executor, sched, stream)
        seconds = time.perf_counter() - started
        n_tokens = sum(len(w.token_ids) for w in sched.seqs)
        if per_layer:
            out(f"step {sched.step_id}: {len(sched.seqs)} sequences, {n_tokens} tokens, "
                f"{sum(per_layer.values()) * 1000:.2f} ms in layers ({seconds * 1000:.2f} ms in all)")
        else:  # (a decode step on the native kernels runs each decoder layer as one call, unwrapped)
            out(f"step {sched.step_id}: {len(sched.seqs)} sequences, {n_tokens} tokens, {seconds * 1000:.2f} ms "
                f"(a fused decode step: no time per layer)")
        for name, layer_seconds in per_layer.items():
            out(f"  layer {name}: {layer_seconds * 1000:.3f} ms")
        if recording and expected is None:
            unchecked.append(sched.step_id)
            out("  (no recorded result or outputs for this step: not compared)")
        if isinstance(got, StepResult):
            out(f"  sampled: {[s.token_id for s in got.sampled]}")
            if expected is not None:
                same = [s.token_id for s in got.sampled] == [s.token_id for s in expected.sampled]
                out(f"  recorded: {[s.token_id for s in expected.sampled]} -> {'same' if same else 'DIFFERENT'}")
                worst = max(worst, 0.0 if same else float("inf"))
        else:
            out(f"  residual stream: shape {list(got.shape)} mean {got.mean():.4g} std {got.std():.4g} "
                f"absmax {got.abs().max():.4g}")
            if expected is not None:
                diff = (got.float().cpu() - expected.float()).abs().max().item()  # (a recording's on the CPU)
                worst = max(worst, diff)
                out(f"  max abs difference from the recording: {diff:.3g}")
    if recording:
        ok = worst <= 1e-4
        compared = len(steps) - len(unchecked)
        if not compared:
            out(f"nothing to compare: none of the {len(steps)} recorded steps has a result or outputs")
            return 1
        out(f"{'matches' if ok else 'DIFFERS FROM'} the recording (worst difference {worst:.3g}, {compared} of "
            f"{len(steps)} steps compared" + (f"; steps {unchecked} had nothing recorded to compare)" if unchecked
                                              else ")"))
        return 0 if ok else 1
    return 0


def _check_stream(stream: torch.Tensor, sched: Schedule, mc: ModelConfig, recording: str | None) -> None:
    """LoadError where a recorded residual stream cannot be this model's input for its step."""
    tokens = sum(len(w.token_ids) for w in sched.seqs)
    if tuple(stream.shape) != (tokens, mc.hidden_size):
        raise LoadError(f"--replay {recording}: step {sched.step_id}'s residual stream is {tuple(stream.shape)}, but "
                        f"its {tokens} tokens in this --model (hidden_size {mc.hidden_size}) need "
                        f"{(tokens, mc.hidden_size)}: a recording of another model?")


def _timed_run(executor: StageExecutor, sched: Schedule, stream):
    """The executor's forward, one decoder layer at a time with a clock around each (and around the
    MLP handed over from the stage before, as "N (MLP)"); on a GPU each clock waits for the layer's
    kernels."""
    model = executor.runner.model
    device = executor.runner.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    per_layer: dict[str, float] = {}
    originals = {}
    handed = getattr(model.model, "handoff", {})  # (models/base.py: the MLP hand-off)
    timed_layers = {**model.model.layers, **{f"{i} (MLP)": m for i, m in handed.items()}}
    for name, layer in timed_layers.items():
        originals[name] = layer.forward

        def timed(*args, _f=layer.forward, _n=name, **kwargs):
            sync()
            t = time.perf_counter()
            result = _f(*args, **kwargs)
            sync()
            per_layer[_n] = per_layer.get(_n, 0.0) + time.perf_counter() - t
            return result
        layer.forward = timed
    try:
        return executor.run(sched, stream), per_layer
    finally:
        for name, layer in timed_layers.items():
            layer.forward = originals[name]


def _recorded(directory: str):
    d = Path(directory)
    schedules = sorted(d.glob("step-*.schedule"))
    if not schedules:
        raise FileNotFoundError(f"no recorded steps (step-*.schedule) in {directory}")
    for path in schedules:
        try:
            sched = msgspec.msgpack.decode(path.read_bytes(), type=Schedule)
            stream = None
            if path.with_suffix(".inputs").exists():
                stream = _stream(load_file(str(path.with_suffix(".inputs"))))
            expected = None
            if path.with_suffix(".result").exists():
                expected = msgspec.msgpack.decode(path.with_suffix(".result").read_bytes(), type=StepResult)
            elif path.with_suffix(".outputs").exists():
                expected = _stream(load_file(str(path.with_suffix(".outputs"))))
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, SafetensorError) as e:
            raise LoadError(f"--replay {directory}: step {path.stem} cannot be read ({e})") from None
        yield sched, stream, expected


def _stream(t: dict) -> torch.Tensor:
    """A recorded residual stream; recordings made before stages sent one tensor hold hidden and
    residual apart, whose sum it is."""
    return t["stream"] if "stream" in t else t["hidden"] + t["residual"]


def check_synthetic_step(tokens: int, seqs: int, positions: int, block_size: int = BLOCK_SIZE) -> None:
    """CLIError naming the flags where --tokens and --seqs make a step the standalone stage cannot run."""
    from moemesh.errors import CLIError

    if seqs > tokens:
        raise CLIError(f"--seqs {seqs} is more than --tokens {tokens}: each synthetic sequence needs a token")
    if -(-tokens // seqs) > positions:
        raise CLIError(f"--tokens {tokens} over --seqs {seqs} makes sequences of up to {-(-tokens // seqs)} tokens, "
                       f"more than the model's {positions} positions")
    lengths = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
    if sum(-(-n // block_size) for n in lengths) > NUM_BLOCKS:
        raise CLIError(f"--tokens {tokens} over --seqs {seqs} needs more than the standalone stage's {NUM_BLOCKS} "
                       f"KV blocks of {block_size} tokens")


def _synthetic(mc: ModelConfig, runner: StageRunner, tokens: int, seqs: int, block_size: int):
    """`seqs` prompts sharing `tokens` random tokens, as one prefill step (greedy, on the last stage)."""
    g = torch.Generator().manual_seed(0)
    lengths = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
    work, next_block = [], 0
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        ids = torch.randint(0, mc.vocab_size, (n,), generator=g).tolist()
        work.append(SeqWork(i, ids, 0, blocks, True, SamplingParams(temperature=0), n))
    stream = None
    if not runner.model.has_embedding:  # a residual stream as an earlier stage would send it
        stream = torch.randn(tokens, mc.hidden_size, generator=g)
    return Schedule(0, work), stream, None

