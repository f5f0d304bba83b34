"""`moemesh bench scheduler`: what the coordinator costs per decode step, without a model.

For each context length: `--seqs` sequences whose prompts have that many tokens are prefilled,
then `--steps` decode steps run through the coordinator's own code (`StepLoop`, `EngineCore`, the
schedule's encoding as the mesh sends it), each answered at once by a fabricated step result (a
token for every sampling row). Printed per context length: the coordinator's CPU time per step
(scheduling, encoding, taking the result) and the schedule's bytes, beside the bytes the same
schedules would have if each sequence carried its whole block table (as they did before block-table
deltas). Comparable figures are the ratios between context lengths in one run.
"""

from __future__ import annotations

import json
import time

from coordinator.core import EngineCore
from coordinator.scheduler import SchedulerConfig
from coordinator.step_loop import StepLoop
from moemesh.errors import CLIError
from moemesh.protocol import MAX_KV_BLOCKS, Codec, SampledToken, Schedule, SeqWork, StepResult
from moemesh.sampling import SamplingParams

# tokens the sequences of one measurement may hold: their prompts are lists in this process (about
# 40 bytes a token), and the pool's blocks a list of ids
MAX_TOKENS = 1 << 25
WARM_UP = (16, 20)  # (context, steps) of the run before the measured ones


def _answer(sched: Schedule) -> StepResult:
    return StepResult(sched.step_id, [SampledToken(w.seq_id, 7) for w in sched.seqs if w.sample])


def _full_tables(sched: Schedule, core: EngineCore) -> Schedule:
    """The schedule as it would be with every sequence's whole block table."""
    seqs = {seq.seq_id: seq for seq in core.scheduler.running}
    return Schedule(sched.step_id, [SeqWork(w.seq_id, w.token_ids, w.context_len, list(seqs[w.seq_id].block_ids),
                                            w.sample, w.params, w.prompt_len, w.prompt_ids, w.cached_ids)
                                    for w in sched.seqs], sched.forget)


def measure(num_seqs: int, context: int, steps: int, block_size: int, in_flight: int) -> dict:
    max_len = context + steps + 2
    num_blocks = num_seqs * -(-max_len // block_size)
    # a token budget that prefills every prompt in one step: decodes start together, at `context`
    core = EngineCore(SchedulerConfig(num_seqs * context, num_seqs, max_len), num_blocks, block_size, (), 1 << 20)
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(num_seqs):
        core.add(str(i), [(i * 7919 + t) % 50000 + 1 for t in range(context)], params)
    loop = StepLoop(core, in_flight)
    # prefill (not timed): until every sequence has its first token
    while any(not seq.output_ids for seq in core.scheduler.running) or core.scheduler.waiting:
        for sched in list(loop.issue()):
            loop.take(_answer(sched))
    assert len(core.scheduler.running) == num_seqs
    sent = full = 0
    issuing = taking = 0.0
    done = scheduled = 0
    pending: list[Schedule] = []
    while done < steps:
        started = time.thread_time()
        issued = list(loop.issue())
        frames = [Codec.encode(s) for s in issued]
        issuing += time.thread_time() - started
        scheduled += len(issued)
        sent += sum(len(f[0]) for f in frames)
        full += sum(len(Codec.encode(_full_tables(s, core))[0]) for s in issued)
        pending += issued
        sched = pending.pop(0)
        result = _answer(sched)
        started = time.thread_time()
        loop.take(result)
        taking += time.thread_time() - started
        done += 1
    # (per step: a schedule issued, and a result taken; with --in-flight N, N - 1 are issued and not taken)
    return {"seqs": num_seqs, "context": context, "in_flight": in_flight, "steps": done,
            "coordinator_ms_per_step": round(1e3 * (issuing / scheduled + taking / done), 3),
            "schedule_bytes_per_step": round(sent / scheduled), "whole_table_bytes_per_step": round(full / scheduled)}


def run_scheduler_bench(args) -> int:
    longest = max(args.context)
    per_seq = max(longest + args.steps, WARM_UP[0] + WARM_UP[1]) + 2  # (the warm-up's sequences too)
    tokens, blocks = args.seqs * per_seq, args.seqs * -(-per_seq // args.block_size)
    if tokens > MAX_TOKENS or blocks > MAX_KV_BLOCKS:
        raise CLIError(f"--seqs {args.seqs} --context {longest} --steps {args.steps} --block-size {args.block_size}: "
                       f"{tokens:,} tokens in {blocks:,} blocks, more than this bench holds in memory "
                       f"({MAX_TOKENS:,} tokens, {MAX_KV_BLOCKS:,} blocks)")
    measure(args.seqs, *WARM_UP, args.block_size, args.in_flight)
    rows = []
    for context in args.context:
        row = measure(args.seqs, context, args.steps, args.block_size, args.in_flight)
        if rows:
            row["ms_vs_first"] = round(row["coordinator_ms_per_step"] / rows[0]["coordinator_ms_per_step"], 2)
            row["bytes_vs_first"] = round(row["schedule_bytes_per_step"] / rows[0]["schedule_bytes_per_step"], 2)
        rows.append(row)
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0
