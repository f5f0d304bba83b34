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
"""

from __future__ import annotations

import math

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
