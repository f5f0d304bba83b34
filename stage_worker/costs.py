"""A decode step's measured cost on this machine, per decoder layer and for the head, and a prompt
chunk's per layer, for `--layer-partition auto` (moemesh/layout.py `StepCosts`).

Counting the multiply-adds of the weights a token uses (`decode_costs`) ranks the parts of a step
the way reading those weights does, but the kernels do not price them alike: the screened lm_head
(stage_worker/layers/vocab.py) reads a copy of a half or a quarter of its bytes or multiplies it
with AMX tiles, a float32 expert that 16 rows reach is bound by reading its weights where a
bfloat16 one is not, the last stage also samples, and the attention over the cache is no weight at
all. So this loads layers as the stages will (the same kernels, dtype, quantization and thread
count) and times what a stage worker runs (`measure`): decode steps of the rows and context a
microbatch of the workload has, of a middle stage of one layer and of two and of the last stage
with the head, and a prompt chunk of one layer; it prices each part in seconds per token. `python
-m stage_worker.costs` prints the result as one JSON line: the control plane asks for it in a
subprocess (moemesh/step_costs.py), so that it never imports torch itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from moemesh.config import ModelConfig, resolve_dtype
from moemesh.protocol import Schedule, SeqWork
from moemesh.sampling import SamplingParams
from moemesh_kernels import cpu_gemm
from stage_worker.executor import StageExecutor
from stage_worker.layers.fp8 import resolve_quantization
from stage_worker.runner import StageRunner, StepInput
from stage_worker.tensors import torch_dtype


def _step(lens: list[int], context: int, block_size: int, vocab: int, gen: torch.Generator) -> StepInput:
    """Sequences of these new tokens each (random ids) over `context` cached tokens, every one sampled."""
    per_seq = math.ceil((context + max(lens)) / block_size)
    tokens = torch.randint(0, vocab, (sum(lens),), generator=gen).tolist()
    ids = [tokens[a - n:a] for a, n in zip(itertools.accumulate(lens), lens)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(lens))]
    return StepInput(ids, [context] * len(lens), tables, [True] * len(lens))


def _cache_bytes() -> int:
    """The largest CPU cache here (sysfs), or 32 MiB where it cannot be read."""
    largest = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return largest or 32 << 20


class _Evict:
    """Reads a buffer of twice the largest cache (at most 1 GiB) between timed steps: a stage of
    several layers reads each from memory, where one layer timed again and again would stay in the
    cache (a float32 layer of the bench model: 3.7 ms a 64-row step cached, 6.7 ms in a stage of
    three on the Xeon with a 480 MB L3)."""

    def __init__(self):
        self.buffer = torch.ones(min(2 * _cache_bytes(), 1 << 30) // 4, dtype=torch.float32)

    def __call__(self) -> None:
        lib = cpu_gemm.native()
        if lib is not None:
            cpu_gemm.read_sum(self.buffer, lib)
        else:
            self.buffer.sum()


def _time(fn, repeats: int, evict=None) -> float:
    fn()  # (a first call builds what the kernels build once: oneDNN's, the screen's buffers)
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _decode_schedules(rows: int, context: int, block_size: int, vocab: int, gen: torch.Generator):
    """(a schedule admitting `rows` sequences of `context` cached tokens with their first decode,
    one of a decode step of them all after it): as the coordinator sends them."""
    per_seq = math.ceil((context + 1) / block_size)
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    tokens = torch.randint(0, vocab, (rows,), generator=gen).tolist()
    admit = Schedule(0, [SeqWork(i, [t], context, list(range(i * per_seq, (i + 1) * per_seq)), True, params,
                                 context + 1, None, [0] * context) for i, t in enumerate(tokens)])
    step = Schedule(1, [SeqWork(i, [t], context, [], True) for i, t in enumerate(tokens)])
    return admit, step


@torch.inference_mode()
def measure(model_dir: str, dtype: str = "auto", quantization: str | None = None, rows: int = 64,
            context: int = 64, prompt_len: int = 32, chunk: int = 512, moe_backend: str = "auto", repeats: int = 9,
            block_size: int = 16) -> dict:
    """Seconds per token of each layer kind ("sparse", "dense"): `decode`, in a step of `rows`
    sequences with `context` cached tokens each; `prompt`, in a prompt chunk of up to `chunk` tokens
    (prompts of `prompt_len`, none cached). `head`: seconds per sampled row that a last stage spends
    beyond a middle stage of as many layers in that decode step (the final norm, lm_head, greedy
    sampling and the sampled tokens' bookkeeping).

    A decode step runs as a stage worker runs it (`StageExecutor.run` of a schedule): a stage's cost
    is its layers' plus what each step costs any stage (small beside them, the same on every stage,
    so it moves no boundary) plus, on the last, the head. So a layer's decode cost is the difference
    between a middle stage of two layers and one of one (the next layer's kind), the head's the
    difference between the last stage (its one layer and the head) and a middle stage of one layer
    of the same kind, each pair timed in turn (`paired`). A model with no such middle layers (two
    layers) prices them on a stage alone."""
    config = ModelConfig.from_dir(model_dir)
    n = config.num_layers
    if n < 2:
        raise ValueError("a model of one layer has no stages to balance")
    tdtype = torch_dtype(resolve_dtype(dtype, config, "cpu"))
    quant = resolve_quantization(config, quantization)
    prompt_len = max(1, min(prompt_len, chunk))
    prompts = [prompt_len] * max(1, chunk // prompt_len)
    num_blocks = max(rows * math.ceil((context + 1) / block_size), len(prompts) * math.ceil(prompt_len / block_size))
    gen = torch.Generator().manual_seed(0)
    kind = lambda i: "sparse" if config.is_sparse_layer(i) else "dense"  # noqa: E731
    admit, step = _decode_schedules(rows, context, block_size, config.vocab_size, gen)
    evict = _Evict()
    stream = torch.randn(rows, config.hidden_size, generator=gen).to(tdtype)

    def runner(layers: range) -> StageRunner:
        return StageRunner(model_dir, config, layers, num_blocks, block_size, dtype=tdtype, quant=quant,
                           moe_backend=moe_backend, progress=False)

    one_layer = {}  # the middle stages of one layer, kept: two pairs may take the same one

    def decode_step(layers: range):
        """A decode step on the stage of these layers, as its worker runs it (admitted first)."""
        if len(layers) == 1 and layers.start in one_layer:
            return one_layer[layers.start]
        ex = StageExecutor(runner(layers), config.eos_token_ids)
        fed = None if layers.start == 0 else stream
        ex.run(admit, fed)
        fn = lambda: ex.run(step, fed)  # noqa: E731
        if len(layers) == 1 and 0 < layers.start < n - 1:
            one_layer[layers.start] = fn
        return fn

    def paired(minuend: range, subtrahend: range) -> float:
        """Seconds per row one stage's decode step takes beyond the other's: both timed in turn, the
        caches evicted before each, and the median of the differences (so that the machine's speed,
        which drifts by 10-20% over seconds on a shared host, cancels out of each; the order
        alternates from round to round)."""
        a, b = decode_step(minuend), decode_step(subtrahend)
        a(), b()  # (a first call builds what the kernels build once: oneDNN's, the screen's buffers)
        diffs = []
        for r in range(repeats):
            took = {}
            for fn in ((a, b) if r % 2 == 0 else (b, a)):
                evict()
                started = time.perf_counter()
                fn()
                took[fn] = time.perf_counter() - started
            diffs.append(took[a] - took[b])
        return statistics.median(diffs) / rows

    def prompt_seconds(layers: range) -> float:
        r = runner(layers)
        chunk_step = _step(prompts, 0, block_size, config.vocab_size, gen)
        fed = None if r.model.has_embedding else torch.randn(sum(prompts), config.hidden_size, generator=gen).to(tdtype)
        return _time(lambda: r.execute(chunk_step, fed, greedy=r.model.can_screen), repeats, evict)

    decode, prompt, middle = {}, {}, {}
    for k in dict.fromkeys(kind(i) for i in range(n - 1)):
        i = next(i for i in range(n - 1) if kind(i) == k)
        prompt[k] = prompt_seconds(range(i, i + 1)) / sum(prompts)
        middle[k] = next((j for j in range(1, n - 1) if kind(j) == k), i)  # a middle stage of one such layer
        a = next((a for a in range(1, n - 2) if kind(a + 1) == k), None)  # and one of two, the second such
        if a is None:  # (too few layers for two in the middle: priced with a stage's own cost)
            decode[k] = _time(decode_step(range(middle[k], middle[k] + 1)), repeats, evict) / rows
            continue
        decode[k] = max(paired(range(a, a + 2), range(a, a + 1)), 0.0)
    last = kind(n - 1)
    if last not in decode:
        raise ValueError(f"no {last} layer before the last one to price it by")  # (no model of ours is built so)
    j = middle[last]
    head = paired(range(n - 1, n), range(j, j + 1))
    return {"decode": decode, "prompt": prompt, "head": max(head, 0.0), "rows": rows, "context": context,
            "prompt_len": prompt_len, "chunk": sum(prompts), "dtype": str(tdtype).removeprefix("torch."),
            "quantization": quantization, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stage_worker.costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--moe-backend", default="auto")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.model, args.dtype, args.quantization, args.rows, args.context, args.prompt_len,
                             args.chunk, args.moe_backend, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
