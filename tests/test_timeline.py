"""moemesh.timeline: a pipeline's step spans as a trace file, and each stage's idle time split by
the phase of the work it waited for."""

import json

import pytest

from moemesh.protocol import StatusReply, StepSpan
from moemesh.timeline import chrome_trace, idle_split


def status(stage_spans, coordinator_spans=()):
    return StatusReply(True, 8, 8, 0, 0, 0, [0.0] * len(stage_spans), [0.0] * len(stage_spans), 1.0, 0,
                       model="m", stage_spans=[list(s) for s in stage_spans], coordinator_spans=list(coordinator_spans))


def test_idle_split_names_what_each_gap_waited_for():
    spans = [StepSpan(0, 10.0, 1.0, 512, 16),  # a prompt step: 10-11
             StepSpan(1, 11.5, 0.5, 64, 64),   # a decode step after 0.5 s idle
             StepSpan(2, 12.25, 1.0, 96, 64),  # a step with prompt tokens after 0.25 s
             StepSpan(3, 13.25, 0.25, 64, 64)]  # a decode step right after
    got = idle_split(spans, start=9.5, end=14.0)
    assert got == {"busy": 2.75, "idle_before_prompt_steps": 0.75, "idle_before_decode_steps": 0.5,
                   "idle_at_end": 0.5}
    # the window cuts spans at its edges, and leaves out what lies outside
    got = idle_split(list(reversed(spans)), start=10.5, end=12.5)
    assert got == {"busy": 1.25, "idle_before_prompt_steps": 0.25, "idle_before_decode_steps": 0.5,
                   "idle_at_end": 0.0}
    assert idle_split([], 1.0, 3.0)["idle_at_end"] == 2.0
    # a span no clock gives (NaN, infinite, negative) is left out, not counted or written
    odd = [StepSpan(8, float("nan"), 1.0, 8, 8), StepSpan(9, 11.0, float("inf"), 8, 8), StepSpan(10, 11.0, -1.0, 8, 8)]
    assert idle_split(spans + odd, start=9.5, end=14.0)["busy"] == 2.75
    trace = chrome_trace(status([odd + spans[:1]]))
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["step 0"]
    json.dumps(trace, allow_nan=False)


def test_chrome_trace_has_a_row_per_stage_and_one_for_the_coordinator():
    trace = chrome_trace(status([[StepSpan(7, 100.0, 0.002, 512, 16)], [StepSpan(7, 100.0025, 0.001, 512, 16)]],
                                [StepSpan(7, 99.999, 0.004, 512, 16)]))
    json.dumps(trace)  # (what the endpoint and the bench write)
    rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert rows == {0: "stage 0", 1: "stage 1", 2: "coordinator (schedule out -> result taken)"}
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in boxes] == [
        (0, "step 7", "prompt", 100e6, 2000.0), (1, "step 7", "prompt", 100.0025e6, 1000.0),
        (2, "step 7", "prompt", 99.999e6, 4000.0)]
    assert boxes[0]["args"] == {"tokens": 512, "seqs": 16, "num_steps": 1}


def test_bench_splits_a_long_run_over_the_part_its_timeline_holds(tmp_path, monkeypatch):
    """A stage whose timeline is full lost its oldest steps: the split starts at the oldest it holds,
    not at the run's start (which would count the lost steps as idle)."""
    from moemesh.entrypoints.bench import throughput

    monkeypatch.setattr(throughput, "TIMELINE_SPANS", 3)
    full = [StepSpan(i, 10.0 + i, 1.0, 64, 64) for i in (5, 6, 7)]  # steps 0-4 were dropped
    r = {"status": status([full, full[1:]]), "window": (0.0, 18.5)}
    row = throughput._write_timeline(tmp_path, r, "run")
    assert row["timeline_seconds"] == 3.5  # from 15.0, stage 0's oldest step
    assert row["stage_idle_before_decode_steps_s"] == [0.0, 1.0]
    assert json.loads((tmp_path / "run.json").read_text())["traceEvents"]


def test_handovers_time_each_hand_over_of_the_decode_steps(tmp_path):
    """Two stages, two microbatches in flight: a stage waits on its input only from when it was free
    (counting from the input's leaving would count its own busy time); the ring's three legs come
    from the last stage's end, the coordinator's spans and the first stage's start."""
    from moemesh.timeline import handovers

    ms = 1e-3
    s0 = [StepSpan(0, 0.0, 10 * ms, 64, 64), StepSpan(1, 10 * ms, 10 * ms, 64, 64),
          StepSpan(2, 23 * ms, 10 * ms, 64, 64), StepSpan(3, 34 * ms, 10 * ms, 64, 64)]
    s1 = [StepSpan(0, 11 * ms, 10 * ms, 64, 64), StepSpan(1, 21.5 * ms, 10 * ms, 64, 64),
          StepSpan(2, 34.5 * ms, 9 * ms, 64, 64), StepSpan(3, 45 * ms, 10 * ms, 64, 64)]
    # two schedules issued at 0, then one right after each result is taken (1 ms after stage 1 ends it)
    coord = [StepSpan(0, 0.0, 22 * ms, 64, 64), StepSpan(1, 0.0, 32.5 * ms, 64, 64),
             StepSpan(2, 22.5 * ms, 22 * ms, 64, 64), StepSpan(3, 33 * ms, 23 * ms, 64, 64)]
    h = handovers(status([s0, s1], coord))
    # step 1 left stage 0 at 20, stage 1 free at 21 -> 21.5 (0.5); step 2 left at 33, stage 1 free since
    # 31.5 -> 34.5 (1.5); step 3 left at 44, free since 43.5 -> 45 (1). (Counting from the input's leaving
    # alone, or from the stage's being free alone, the median would be 1.5.)
    assert h["hops"] == [pytest.approx(1 * ms)]
    assert h["to_coordinator"] == pytest.approx(1 * ms)
    # results of 0 and 1 taken at 22 and 32.5 ms, the next schedules issued at 22.5 and 33 (none after 2, 3)
    assert h["coordinator"] == pytest.approx(0.5 * ms)
    # stage 0 free at 10 -> step 1 at 10; step 2 issued at 22.5 -> 23; step 3 issued at 33, free at 33 -> 34
    assert h["to_first_stage"] == pytest.approx(0.5 * ms)
    # a window leaves out what lies outside it; prompt steps are not decode hand-overs
    assert handovers(status([s0, s1], coord), start=100.0)["to_coordinator"] is None
    prompt = [StepSpan(s.step_id, s.start, s.seconds, 512, 16) for s in s1]
    assert handovers(status([s0, prompt], coord))["hops"] == [None]
    one = handovers(status([s0], coord))  # one stage: no hop, the ring alone
    assert one["hops"] == [] and one["to_coordinator"] is not None
    # what `bench throughput --timeline` prints of them, in ms
    from moemesh.entrypoints.bench import throughput

    row = throughput._write_timeline(tmp_path, {"status": status([s0, s1], coord), "window": (0.0, 1.0)}, "run")
    assert (row["decode_hop_ms"], row["decode_result_to_coordinator_ms"], row["decode_coordinator_turn_ms"],
            row["decode_schedule_to_first_stage_ms"]) == ([1.0], 1.0, 0.5, 0.5)
