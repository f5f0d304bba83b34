"""The MLP hand-off's balance: how many of a step's tokens each stage runs its last layer's MLP for.

With `--mlp-handoff`, a stage after the first also holds the MLP (dense or MoE) of the previous
stage's last layer (stage_worker/models/base.py). That MLP keeps no per-sequence state, so it can
run on either side of the boundary, token by token, step by step. The coordinator chooses, for each
schedule, the split that makes the stages equally busy on that step:

    stage i's time = scale_i x (fixed_i T + mlp_in_i (T - rows_{i-1}) + mlp_out_i rows_i + head S)

T: the step's tokens, S: the rows the last stage computes logits for, rows_i: the tokens stage i
runs its last MLP for. The per-token costs are the weights' multiply-adds (`layout.stage_costs`);
the scales are learnt from the stages' own compute time on each step (`StepResult.stage_seconds`),
one set for pure decode steps and one for steps with prompt tokens, since a stage's kernels run
the two at different speeds (and the head, which only sampled rows pay, is the larger share of a
decode step). A contiguous split of the layers cannot be even in both: where the head is worth
several layers, prompt chunks want the boundary earlier and decodes later. The hand-off moves up to
one MLP per boundary across it, every step.
"""

from __future__ import annotations

import math

from moemesh.config import ModelConfig
from moemesh.layout import Layout, StageCosts, split, stage_costs
from moemesh.protocol import Schedule


class HandoffBalancer:
    """Fills each schedule's `mlp_rows` and learns from each result's `stage_seconds`."""

    def __init__(self, costs: list[StageCosts], smoothing: float = 0.3):
        self.costs = costs
        self.smoothing = smoothing
        # measured time / modelled cost, per stage: for pure decode steps and for the others
        self.scales = {True: [1.0] * len(costs), False: [1.0] * len(costs)}
        self.learnt = {True: False, False: False}
        self.pending: dict[int, tuple[bool, int, int, list[int]]] = {}  # step id -> what it was split as
        self.handed = self.tokens = 0  # MLP tokens handed over to a later stage, and tokens, so far

    @classmethod
    def for_layout(cls, model: ModelConfig, layout: Layout) -> "HandoffBalancer | None":
        if not layout.mlp_handoff or layout.pp == 1:
            return None
        return cls(stage_costs(model, layout))

    def assign(self, sched: Schedule) -> list[int]:
        """The schedule's `mlp_rows`."""
        tokens = sum(len(w.token_ids) for w in sched.seqs)
        logit_rows = sum(1 for w in sched.seqs if w.sample)
        decode = tokens == len(sched.seqs)
        rows, _ = split(self.costs, self.scales[decode], tokens, logit_rows)
        self.pending[sched.step_id] = (decode, tokens, logit_rows, rows)
        self.handed += sum(tokens - r for r in rows)
        self.tokens += tokens * len(rows)
        return rows

    def observe(self, step_id: int, stage_seconds: list[float]) -> None:
        """A step's result came back with each stage's compute time on it."""
        for old in [s for s in self.pending if s < step_id]:  # results that never came (a reset)
            del self.pending[old]
        entry = self.pending.pop(step_id, None)
        if entry is None or len(stage_seconds) != len(self.costs):
            return
        decode, tokens, logit_rows, rows = entry
        ins, outs = [float(tokens), *rows], [*rows, 0]
        measured = []
        for i, (c, seconds) in enumerate(zip(self.costs, stage_seconds)):
            cost = c.time(tokens, logit_rows if i == len(self.costs) - 1 else 0, ins[i], outs[i])
            scale = seconds / cost if cost > 0 and math.isfinite(seconds) and 1e-7 < seconds < 3600 else 0.0
            if not (math.isfinite(scale) and scale > 0):
                return  # an empty step, or a time no stage can have taken: learn nothing from it
            measured.append(scale)
        scales = self.scales[decode]
        for i, scale in enumerate(measured):
            scales[i] = scale if not self.learnt[decode] else scales[i] + self.smoothing * (scale - scales[i])
        self.learnt[decode] = True

    @property
    def handed_share(self) -> float:
        """Of the boundary MLPs' tokens so far, the share the later stage ran."""
        return self.handed / self.tokens if self.tokens else 0.0
