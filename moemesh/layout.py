"""The layout of a pipeline: how many stages, which layers each runs, how many tensor ranks per
stage, whether experts are split among them, and the quantization. `resolve_layout` is the one place
that decides and checks it (from flags, before any process starts or loads weights); the coordinator,
`generate`, the in-process engine and the benchmarks all call it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from moemesh.settings import auto_mix
from moemesh.config import ModelConfig, check_quantization
from moemesh.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    stage_layers: tuple[int, ...]  # decoder layers per pipeline stage, in order
    tp: int = 1
    expert_parallel: bool = False
    quantization: str | None = None  # the method the workers build: "fp8", "int8" or None
    mlp_handoff: bool = False  # each stage after the first also holds the MLP of the layer before its own

    @property
    def pp(self) -> int:
        return len(self.stage_layers)

    @property
    def stages(self) -> list[range]:
        starts = list(itertools.accumulate(self.stage_layers, initial=0))
        return [range(a, b) for a, b in zip(starts, starts[1:])]


def resolve_layout(model: ModelConfig, pp: int = 1, tp: int = 1, partition=None, expert_parallel: bool = False,
                   quantization: str | None = None, mlp_handoff: bool = False) -> Layout:
    """Flags -> a Layout the model can take, or a ConfigError naming the flag. `partition` is None
    (even split, earlier stages taking the remainder), "auto" or "auto:PROMPT:OUTPUT" (`balanced_partition`
    for that token mix; 1:1 by default; with `mlp_handoff`, `handoff_partition`) or layers per stage.
    mlp_handoff: the MLP hand-off (coordinator/balance.py); a no-op with one stage."""
    n = model.num_layers
    if not 1 <= pp <= n:
        raise ConfigError(f"--pp {pp} must be between 1 and the model's {n} layers")
    if partition is None:
        counts = even_partition(n, pp)
    elif isinstance(partition, str):  # auto[:PROMPT:OUTPUT]
        prompt, output = auto_mix(partition)
        share = output / (prompt + output)
        counts = handoff_partition(model, pp, share) if mlp_handoff and pp > 1 else \
            balanced_partition(model, pp, share)
    else:
        counts = tuple(partition)
        if len(counts) != pp:
            raise ConfigError(f"--layer-partition has {len(counts)} stages but --pp is {pp}")
        if sum(counts) != n or min(counts) < 1:
            raise ConfigError(f"--layer-partition {','.join(map(str, counts))} must be positive counts summing "
                              f"to the model's {n} layers")
    if tp < 1:
        raise ConfigError(f"--tp {tp} must be at least 1")
    if expert_parallel and tp == 1:
        raise ConfigError("--expert-parallel needs --tp above 1")
    check_layout(model, tp, expert_parallel)
    return Layout(counts, tp, expert_parallel, check_quantization(model, quantization), mlp_handoff and pp > 1)


def even_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


def check_layout(model: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Refuses a tensor-parallel layout the model cannot take, before anything loads weights."""
    problems = []
    if model.num_heads % tp:
        problems.append(f"{model.num_heads} attention heads")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        problems.append(f"{model.num_kv_heads} key/value heads (neither divides the other)")
    dense = [i for i in range(model.num_layers) if not model.is_sparse_layer(i)]
    if dense and model.intermediate_size % tp:
        problems.append(f"intermediate_size {model.intermediate_size}")
    if model.num_experts:
        if expert_parallel and model.num_experts % tp:
            problems.append(f"{model.num_experts} experts (with --expert-parallel)")
        if not expert_parallel and model.moe_intermediate_size % tp:
            problems.append(f"expert intermediate size {model.moe_intermediate_size}")
        if model.shared_expert_intermediate_size % tp:
            problems.append(f"shared expert intermediate size {model.shared_expert_intermediate_size}")
    elif expert_parallel:
        raise ConfigError(f"--expert-parallel needs a mixture-of-experts model; {model.architecture} is dense")
    if problems:
        raise ConfigError(f"--tp {tp} does not divide the model's " + ", ".join(problems))


def decode_costs(model: ModelConfig) -> tuple[list[float], float]:
    """(cost of each decoder layer, cost of the head) for one decode token, in multiply-adds of the
    weights that token uses: attention's projections and, per layer, its K routed experts plus any
    shared expert and router (sparse) or its dense MLP; the head is the final norm and lm_head. A
    decode step reads and multiplies these weights, so its time on a stage follows their sum (the
    attention over the cache is small beside them at the context lengths that serve decode)."""
    H = model.hidden_size
    attn = H * (model.q_size + 2 * model.kv_size) + model.q_size * H
    layers = []
    for i in range(model.num_layers):
        if model.is_sparse_layer(i):
            mlp = model.top_k * 3 * H * model.moe_intermediate_size + model.num_experts * H
            if model.shared_expert_intermediate_size:
                mlp += 3 * H * model.shared_expert_intermediate_size + H
        else:
            mlp = 3 * H * model.intermediate_size
        layers.append(float(attn + mlp))
    return layers, float(model.vocab_size * H)


def balanced_partition(model: ModelConfig, pp: int, sampled_share: float = 1.0) -> tuple[int, ...]:
    """`--layer-partition auto`: layers per stage (contiguous, at least one each) that minimise the
    largest stage's cost per token (`decode_costs`), so that the stages of a pipeline are equally busy.
    Every token, prompt or generated, goes through every layer; only the tokens sampled after pay
    the head, on the last stage: `sampled_share` of them (output / (prompt + output) tokens of the
    workload: 1 for pure decode). Balancing decode alone overloads the first stages with prefill
    wherever the head is large beside a layer (docs/benchmarks.md)."""
    if not 0 <= sampled_share <= 1:
        raise ValueError(f"sampled_share {sampled_share} is outside [0, 1]")
    layers, head = decode_costs(model)
    head *= sampled_share
    n = len(layers)
    if not 1 <= pp <= n:
        raise ConfigError(f"--pp {pp} must be between 1 and the model's {n} layers")
    prefix = [0.0]
    for c in layers:
        prefix.append(prefix[-1] + c)
    cost = lambda a, b, last: prefix[b] - prefix[a] + (head if last else 0.0)  # noqa: E731
    # best[s][j]: the least possible largest stage cost of layers 0..j-1 split into s stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(i, j, s == pp and j == n))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    counts, j = [], n
    for s in range(pp, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return tuple(reversed(counts))


def handoff_partition(model: ModelConfig, pp: int, sampled_share: float) -> tuple[int, ...]:
    """`--layer-partition auto` with the MLP hand-off: the split whose stages, with each step's MLP
    tokens split between them (coordinator/balance.py), take the least time on the workload's mix:
    prompt tokens (no head) and sampled tokens (the head on the last stage), each balanced on its
    own. It starts from the best of `balanced_partition`'s splits for head shares from 0 to 1 and
    moves one boundary by one layer at a time while that helps."""
    n = model.num_layers
    ones = [1.0] * pp

    def cost(counts: tuple[int, ...]) -> float:
        costs = stage_costs(model, Layout(counts, mlp_handoff=True))
        return (1 - sampled_share) * split(costs, ones, 64, 0)[1] + sampled_share * split(costs, ones, 64, 64)[1]

    best = min(dict.fromkeys(balanced_partition(model, pp, k / 20) for k in range(21)), key=cost)
    best_cost = cost(best)
    improved = True
    while improved:
        improved = False
        for i in range(pp - 1):
            for d in (-1, 1):
                c = list(best)
                c[i] += d
                c[i + 1] -= d
                if min(c) >= 1 and sum(c) == n and (v := cost(tuple(c))) < best_cost - 1e-9 * best_cost:
                    best, best_cost, improved = tuple(c), v, True
    return best


# -- the MLP hand-off's cost model (coordinator/balance.py splits each step by it) --------------------

@dataclass(frozen=True)
class StageCosts:
    """One stage's cost per token in the units of `decode_costs`."""
    fixed: float  # its layers, less its last MLP when that is handed off
    mlp_in: float = 0.0  # the previous stage's last MLP, for the tokens handed over
    mlp_out: float = 0.0  # its own last MLP, for the tokens it keeps
    head: float = 0.0  # per row of logits (the last stage)

    def time(self, tokens: int, logit_rows: int, rows_in: float, rows_out: float) -> float:
        return (self.fixed * tokens + self.mlp_in * (tokens - rows_in) + self.mlp_out * rows_out
                + self.head * logit_rows)


def stage_costs(model: ModelConfig, layout: Layout) -> list[StageCosts]:
    """Each stage's per-token costs under `layout` (with its MLP hand-off, if it has one)."""
    layers, head = decode_costs(model)
    mlps = mlp_costs(model)
    out = []
    for p, stage in enumerate(layout.stages):
        last = p == layout.pp - 1
        handoff_out = layout.mlp_handoff and not last
        fixed = sum(layers[i] for i in stage) - (mlps[stage.stop - 1] if handoff_out else 0.0)
        out.append(StageCosts(fixed, mlps[stage.start - 1] if layout.mlp_handoff and p > 0 else 0.0,
                              mlps[stage.stop - 1] if handoff_out else 0.0, head if last else 0.0))
    return out


def mlp_costs(model: ModelConfig) -> list[float]:
    """Each layer's MLP (its share of `decode_costs`: all but the attention's projections)."""
    layers, _ = decode_costs(model)
    H = model.hidden_size
    attn = H * (model.q_size + 2 * model.kv_size) + model.q_size * H
    return [c - attn for c in layers]


def split(costs: list[StageCosts], scales: list[float], tokens: int, logit_rows: int) -> tuple[list[int], float]:
    """(tokens each stage before a boundary runs its last MLP for, the largest stage time that
    leaves) for a step: the split that evens the stages' times as far as the hand-off reaches. The
    time no stage may exceed is found by bisection: given it, each stage in turn keeps as many of its
    MLP tokens as fit (what it keeps, the next stage need not run), and the split is feasible when
    every stage fits."""
    pp = len(costs)
    scales = [s if math.isfinite(s) and s > 0 else 1.0 for s in scales]
    if pp == 1 or all(c.mlp_out == 0 for c in costs[:-1]):
        rows = [tokens] * (pp - 1)
        return rows, _largest(costs, scales, tokens, logit_rows, rows)

    def walk(target: float) -> tuple[list[float], bool]:
        rows, prev, fits = [], float(tokens), True
        for c, s in zip(costs[:-1], scales):
            base = s * c.time(tokens, 0, prev, 0)
            keep = (target - base) / (s * c.mlp_out) if s * c.mlp_out > 0 else tokens
            prev = min(float(tokens), max(0.0, keep))
            fits = fits and base + s * c.mlp_out * prev <= target * (1 + 1e-12)
            rows.append(prev)
        return rows, fits and scales[-1] * costs[-1].time(tokens, logit_rows, prev, 0) <= target * (1 + 1e-12)

    if pp == 2:  # (the schedule's critical path: two stages solve in closed form)
        (a, b), (s0, s1) = costs, scales
        even = (s1 * b.time(tokens, logit_rows, 0, 0) - s0 * a.fixed * tokens) / (s0 * a.mlp_out + s1 * b.mlp_in)
        rows = [round(min(float(tokens), max(0.0, even)))]
        return rows, _largest(costs, scales, tokens, logit_rows, rows)
    lo, hi = 0.0, sum(s * c.time(tokens, logit_rows, 0, tokens) for c, s in zip(costs, scales))
    while hi - lo > 1e-6 * hi:  # (far finer than one token's MLP)
        mid = (lo + hi) / 2
        if walk(mid)[1]:
            hi = mid
        else:
            lo = mid
    rows = [round(r) for r in walk(hi)[0]]
    return rows, _largest(costs, scales, tokens, logit_rows, rows)


def _largest(costs, scales, tokens, logit_rows, rows) -> float:
    ins = [float(tokens), *rows]
    outs = [*rows, 0]
    return max(s * c.time(tokens, logit_rows if i == len(costs) - 1 else 0, ins[i], outs[i])
               for i, (c, s) in enumerate(zip(costs, scales)))
