"""A pipeline's recent steps as a timeline: when each stage computed which step, and what it waited
for in between.

Every stage worker records each step it runs (start on the wall clock, duration, tokens,
sequences) and its tensor rank 0 sends them with its heartbeats; the coordinator keeps the last
TIMELINE_SPANS of each stage, and of its own steps (from a schedule going out to its result being
taken), and returns them to `CoordinatorClient.status(timeline=True)`. Spans of processes on one
host share its clock; across hosts they are as far apart as the hosts' clocks are.

`chrome_trace` writes them in the Trace Event Format, which Perfetto (ui.perfetto.dev) and
chrome://tracing open: a row per stage and one for the coordinator, a box per step.
`idle_split` says, per stage, how long it sat idle before steps that carry prompt tokens and before
pure decode steps: in a pipeline, which phase of the workload each stage waits through.
`handovers` says how long each hand-over of a decode step takes: from one stage to the next, and
round the ring from the last stage through the coordinator back to the first.
"""

from __future__ import annotations

import bisect
import math
import statistics

from moemesh.protocol import StatusReply, StepSpan


def _sound(spans: list[StepSpan]) -> list[StepSpan]:
    """The spans with a finite start and a duration of at least 0 (what a worker's clock gives; a
    span that is not is left out rather than written as NaN, which no trace viewer reads)."""
    return [s for s in spans if math.isfinite(s.start) and math.isfinite(s.seconds) and s.seconds >= 0]


def is_decode(span: StepSpan) -> bool:
    """A step shaped as decodes: one token per sequence, as against one that carries prompt chunks.
    (A prompt's one last token to compute, after a prefix-cache hit, counts as a decode: it costs
    what a decode costs, on every stage.)"""
    return span.tokens == span.seqs


def chrome_trace(status: StatusReply) -> dict:
    """The spans of a StatusReply (asked with timeline=True) as a Trace Event Format object."""
    rows = [(f"stage {i}", spans) for i, spans in enumerate(status.stage_spans)]
    rows.append(("coordinator (schedule out -> result taken)", status.coordinator_spans))
    events = []
    for tid, (name, spans) in enumerate(rows):
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        for s in _sound(spans):
            events.append({"name": f"step {s.step_id}", "cat": "decode" if is_decode(s) else "prompt",
                           "ph": "X", "pid": 1, "tid": tid, "ts": round(s.start * 1e6, 1),
                           "dur": round(s.seconds * 1e6, 1),
                           "args": {"tokens": s.tokens, "seqs": s.seqs, "num_steps": s.num_steps,
                                    **({"mlp_handoff": s.mlp_handoff} if s.mlp_handoff else {})}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"model": status.model}}


def idle_split(spans: list[StepSpan], start: float, end: float) -> dict:
    """One stage's time between wall-clock `start` and `end`: busy, and idle split by what came next
    (a step with prompt tokens, a decode step, or nothing: the tail). Spans outside the window are
    left out; one that straddles an edge counts its part inside."""
    busy = before_prompt = before_decode = 0.0
    at = start  # where the stage's last step ended (or the window began)
    for s in sorted(_sound(spans), key=lambda s: s.start):
        lo, hi = max(s.start, start), min(s.start + s.seconds, end)
        if hi <= lo:
            continue
        gap = max(0.0, lo - at)
        if is_decode(s):
            before_decode += gap
        else:
            before_prompt += gap
        busy += hi - lo
        at = max(at, hi)
    return {"busy": busy, "idle_before_prompt_steps": before_prompt, "idle_before_decode_steps": before_decode,
            "idle_at_end": max(0.0, end - at)}


def handovers(status: StatusReply, start: float = -math.inf, end: float = math.inf) -> dict:
    """The median hand-over times of the decode steps within wall-clock `start` and `end`, in seconds
    (None where no step gives one; a schedule of several decode steps is one step here):
    - `hops`, one per stage boundary: from the later of (the earlier stage ending the step, the later
      stage ending its own previous step) to the later stage starting it. That is how long the later
      stage sat idle with the step's input on its way: a stage still busy when the input came did
      not wait for it.
    - `to_coordinator`: the last stage ending a step, to the coordinator having taken its result
      (with any time the coordinator was still busy with other work).
    - `coordinator`: a result taken, to the coordinator issuing its next schedule (made, not yet
      encoded and sent; with any wait for work to schedule).
    - `to_first_stage`: from the later of (a schedule issued, the first stage ending its previous
      step) to the first stage starting it: the coordinator's encoding and sending, the trip, and
      the stage's own hand-over to its compute thread.
    The first stage's idle time before a decode step is about the last three together, when it
    waits on the ring. Spans of one host share its clock; across hosts, clock skew enters
    `hops` and the ring's two trips. A stage's previous step is the one before it among the spans
    held: where a stage's spans were lost (a heartbeat with them), the next step's wait comes out
    too long."""
    def inside(spans):
        return [s for s in _sound(spans) if s.start >= start and s.start + s.seconds <= end]

    stages = [_by_step(inside(spans)) for spans in status.stage_spans]
    coord = {s.step_id: s for s in inside(status.coordinator_spans)}
    out: dict = {"hops": [], "to_coordinator": None, "coordinator": None, "to_first_stage": None}
    if not stages:
        return out
    for earlier, later in zip(stages, stages[1:]):
        out["hops"].append(_median([s.start - max(_end(earlier[k][0]), later[k][1])
                                    for k, (s, _) in later.items() if k in earlier and later[k][1] is not None]))
    first, last = stages[0], stages[-1]
    out["to_coordinator"] = _median([_end(coord[k]) - _end(s) for k, (s, _) in last.items() if k in coord])
    issued = sorted(c.start for c in coord.values())
    turns = []
    for k, (s, _) in last.items():  # each decode result taken -> the next schedule issued
        if k in coord and (i := bisect.bisect_left(issued, _end(coord[k]))) < len(issued):
            turns.append(issued[i] - _end(coord[k]))
    out["coordinator"] = _median(turns)
    out["to_first_stage"] = _median([s.start - max(coord[k].start, prev) for k, (s, prev) in first.items()
                                     if k in coord and prev is not None])
    return out


def _by_step(spans: list[StepSpan]) -> dict[int, tuple[StepSpan, float | None]]:
    """A stage's decode steps by id: (its span, when the stage ended the step it ran before it, or None)."""
    ordered = sorted(_sound(spans), key=lambda s: s.start)
    return {s.step_id: (s, _end(ordered[i - 1]) if i else None) for i, s in enumerate(ordered) if is_decode(s)}


def _end(span: StepSpan) -> float:
    return span.start + span.seconds


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
