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

    @property
    def pp(self) -> int:
        return len(self.stage_layers)

    @property
    def stages(self) -> list[range]:
        starts = list(itertools.accumulate(self.stage_layers, initial=0))
        return [range(a, b) for a, b in zip(starts, starts[1:])]


def resolve_layout(model: ModelConfig, pp: int = 1, tp: int = 1, partition=None, expert_parallel: bool = False,
                   quantization: str | None = None, costs: "StepCosts | None" = None,
                   handoff: bool = False) -> Layout:
    """Flags -> a Layout the model can take, or a ConfigError naming the flag. `partition` is None
    (even split, earlier stages taking the remainder), "auto" or "auto:PROMPT:OUTPUT" (`balanced_partition`
    for that token mix, 1:1 by default, of `costs`: measured ones or, by default, the weights, with
    the MLP hand-off where `handoff`) or layers per stage."""
    n = model.num_layers
    if not 1 <= pp <= n:
        raise ConfigError(f"--pp {pp} must be between 1 and the model's {n} layers")
    if partition is None:
        counts = even_partition(n, pp)
    elif isinstance(partition, str):  # auto[:PROMPT:OUTPUT]
        prompt, output = auto_mix(partition)
        counts = balanced_partition(model, pp, output / (prompt + output), costs, handoff)
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
    return Layout(counts, tp, expert_parallel, check_quantization(model, quantization))


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
    attn, mlps = _attention_cost(model), mlp_costs(model)
    return [attn + mlp for mlp in mlps], float(model.vocab_size * model.hidden_size)


def _attention_cost(model: ModelConfig) -> float:
    """A decoder layer's attention projections, per token (`decode_costs`' unit)."""
    H = model.hidden_size
    return float(H * (model.q_size + 2 * model.kv_size) + model.q_size * H)


def mlp_costs(model: ModelConfig) -> list[float]:
    """Each decoder layer's MLP per token, in `decode_costs`' unit: its K routed experts plus any
    shared expert and the router (sparse), or its dense MLP."""
    H = model.hidden_size
    costs = []
    for i in range(model.num_layers):
        if model.is_sparse_layer(i):
            mlp = model.top_k * 3 * H * model.moe_intermediate_size + model.num_experts * H
            if model.shared_expert_intermediate_size:
                mlp += 3 * H * model.shared_expert_intermediate_size + H
        else:
            mlp = 3 * H * model.intermediate_size
        costs.append(float(mlp))
    return costs


@dataclass(frozen=True)
class StepCosts:
    """What a token costs each decoder layer, as a prompt token and as a generated one, and what the
    head (final norm, lm_head, sampling) costs per row it samples, all in one unit: multiply-adds of
    the weights used (`of_weights`, `decode_costs`) or seconds measured on this machine
    (`measured`: stage_worker/costs.py times the stages' own kernels, moemesh/step_costs.py keeps it)."""
    prompt: tuple[float, ...]
    decode: tuple[float, ...]
    head: float
    measured: bool = False

    @classmethod
    def of_weights(cls, model: ModelConfig) -> "StepCosts":
        layers, head = decode_costs(model)
        return cls(tuple(layers), tuple(layers), head)

    @classmethod
    def from_measurement(cls, model: ModelConfig, m: dict) -> "StepCosts":
        """stage_worker/costs.py's seconds per token of each layer kind ("sparse", "dense") and of the head."""
        kind = lambda i: "sparse" if model.is_sparse_layer(i) else "dense"  # noqa: E731
        layers = range(model.num_layers)
        per_layer = lambda part: tuple(float(m[part][kind(i)]) for i in layers)  # noqa: E731
        return cls(per_layer("prompt"), per_layer("decode"), float(m["head"]), measured=True)


def balanced_partition(model: ModelConfig, pp: int, sampled_share: float = 1.0,
                       costs: StepCosts | None = None, handoff: bool = False) -> tuple[int, ...]:
    """`--layer-partition auto`: layers per stage (contiguous, at least one each) that minimise the
    largest stage's cost per token of the workload, so that the stages of a pipeline are equally busy.
    Every token, prompt or generated, goes through every layer; only the tokens sampled after pay
    the head, on the last stage: `sampled_share` of them (output / (prompt + output) tokens of the
    workload: 1 for pure decode). Balancing decode alone overloads the first stages with prefill
    wherever the head is large beside a layer (docs/benchmarks.md). `costs`: each layer's cost as a
    prompt token and as a generated one, and the head's (default: `StepCosts.of_weights`, where the
    two are the same).

    `handoff`: the pipeline runs the MLP hand-off (`MlpHandoff`), which evens prompt steps by moving
    a stage's last MLP to the next stage: `_handoff_partition` prices that, where the splits are few
    enough to try each (HANDOFF_SPLITS; more, and the hand-off is left out of the price)."""
    if not 0 <= sampled_share <= 1:
        raise ValueError(f"sampled_share {sampled_share} is outside [0, 1]")
    costs = costs or StepCosts.of_weights(model)
    n = len(costs.decode)
    if handoff and 1 < pp <= n and math.comb(n - 1, pp - 1) <= HANDOFF_SPLITS:
        counts = _handoff_partition(model, pp, sampled_share, costs)
        if counts is not None:  # (None: costs that compare with nothing, NaN; the price below then)
            return counts
    layers = [(1 - sampled_share) * p + sampled_share * d for p, d in zip(costs.prompt, costs.decode)]
    head = costs.head * sampled_share
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


HANDOFF_SPLITS = 100_000  # splits `_handoff_partition` tries one by one (56 layers in 4 stages: 26,235)


def _handoff_partition(model: ModelConfig, pp: int, sampled_share: float,
                       costs: StepCosts) -> tuple[int, ...] | None:
    """`balanced_partition` of a pipeline that runs the MLP hand-off. A step is a prompt step or a
    decode step (the workload's prompts arrive in chunks, its decodes then step together), and a
    pipeline's step takes its busiest stage's time, so a split costs (1 - sampled_share) times the
    busiest stage of a prompt token plus sampled_share times the busiest of a generated one. A prompt
    step moves each boundary's MLP to the next stage where that lowers the larger of the two
    (`_hand_off`, as `MlpHandoff.choose`; the MLP's share of its layer from the weights, `mlp_costs`); a decode
    step moves nothing and pays the head on the last stage. So a split that leaves the first stage a
    layer heavier for prompts, which the hand-off evens, can beat an even one whose last stage
    carries the head (the bench model in float32, docs/benchmarks.md). Ties go to the first split
    in order (earlier cuts first); None where no split has a price that compares (NaN costs)."""
    n = len(costs.decode)
    weights, _ = decode_costs(model)
    share = [m / w if w else 0.0 for m, w in zip(mlp_costs(model), weights)]
    best, best_counts = float("inf"), None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        prompt = [sum(costs.prompt[a:b]) for a, b in zip(bounds, bounds[1:])]
        decode = [sum(costs.decode[a:b]) for a, b in zip(bounds, bounds[1:])]
        decode[-1] += costs.head
        _hand_off(prompt, [share[b - 1] * costs.prompt[b - 1] for b in cuts])
        value = (1 - sampled_share) * max(prompt) + sampled_share * max(decode)
        if value < best - 1e-12 * abs(best if best != float("inf") else 0.0):
            best, best_counts = value, tuple(b - a for a, b in zip(bounds, bounds[1:]))
    return best_counts


class MlpHandoff:
    """Which steps hand a stage's last MLP to the next stage (the MLP hand-off, on unless
    --no-mlp-handoff: the coordinator's choice per schedule, `Schedule.mlp_handoff`).

    A split that evens decode steps (`auto` for a decode-heavy mix) leaves prompt chunks heavier
    on the earlier stages: a prompt token pays every layer, as a decode token does, but not the
    head on the last stage. A stage after the first can also hold its previous stage's last MLP,
    so that a step can move that MLP's work across the boundary. For each step this estimates every
    stage's cost (`decode_costs`: per token, each layer for every token, the head for each row it
    computes logits of) and, boundary by boundary from the first, hands the MLP over where that
    lowers the larger of the two stages' costs. Steps of decodes alone are never handed off: their
    stages run every layer in one native call (stage_worker/fused_decode.py), which has no place
    to stop.

    A boundary is handed off for some steps or for none: every stage's cost but the last's grows
    with the step's tokens alone, and the last's also with its head rows, which only make a
    hand-off to it less likely. So `layers`, the choice for prompt tokens with no head row, holds
    every layer any step can hand off, and only the stages after those hold a copy of the MLP
    (`holds`): an even split of equal layers holds none (`for_layout` is None)."""

    def __init__(self, model: ModelConfig, stages: list[range]):
        if len(stages) < 2:
            raise ValueError("the MLP hand-off needs two stages or more")
        layers, self.head = decode_costs(model)
        mlps = mlp_costs(model)
        self.stage_costs = [sum(layers[i] for i in r) for r in stages]  # per token
        self.boundaries = [(r.stop - 1, mlps[r.stop - 1]) for r in stages[:-1]]  # (layer, its MLP's cost)
        self.layers = frozenset(self.choose([2], 0))  # every layer a step can hand off

    @classmethod
    def for_layout(cls, model: ModelConfig, stages: list[range]) -> "MlpHandoff | None":
        """The hand-off of a pipeline of these stages, or None where no step could hand anything off
        (one stage; no stage heavier than the next by more than its last MLP)."""
        if len(stages) < 2:
            return None
        handoff = cls(model, stages)
        return handoff if handoff.layers else None

    def holds(self, stage: range) -> bool:
        """Whether the stage of these layers holds the MLP of the layer before its own."""
        return stage.start - 1 in self.layers

    def choose(self, query_lens: list[int], head_rows: int) -> list[int]:
        """A step of these new tokens per sequence, the last stage computing logits of `head_rows`
        of them (sampled rows and prompt-logprob rows) -> the layers whose MLP the next stage runs
        (`Schedule.mlp_handoff`)."""
        if all(q == 1 for q in query_lens):
            return []
        tokens = sum(query_lens)
        cost = [c * tokens for c in self.stage_costs]
        cost[-1] += self.head * head_rows
        handed = _hand_off(cost, [mlp * tokens for _, mlp in self.boundaries])
        return [self.boundaries[s][0] for s in handed]


def _hand_off(cost: list[float], moved: list[float]) -> list[int]:
    """The MLP hand-off of one step: boundary by boundary from the first, `moved[s]` (stage s's last
    MLP) goes from stage s to stage s + 1 where that lowers the larger of the two `cost`s (updated in
    place). Returns the boundaries handed off."""
    handed = []
    for s, m in enumerate(moved):
        if max(cost[s] - m, cost[s + 1] + m) < max(cost[s], cost[s + 1]):
            cost[s] -= m
            cost[s + 1] += m
            handed.append(s)
    return handed
