"""EngineCore without a model: schedules out, fabricated step results in, request outputs out.

A `FakeLastStage` plays the last stage: for every sampling row it invents a fresh token (never EOS
unless told), with logprobs when the sequence's params ask for them, and prompt logprobs for the
prompt positions a chunk covers, exactly as the real StageExecutor lays them out.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest

from coordinator.core import ENDED_ENTRIES, EngineCore
from coordinator.scheduler import SchedulerConfig
from moemesh.protocol import PromptLogprobs, RequestOutput, SampledToken, Schedule, StepResult, TokenLogprobs
from moemesh.sampling import SamplingParams

EOS = 0
VOCAB = 1000


def make_core(num_blocks=64, block_size=4, budget=64, max_seqs=16, max_model_len=512):
    return EngineCore(SchedulerConfig(budget, max_seqs, max_model_len), num_blocks, block_size, (EOS,), VOCAB)


def prompt(n, base=10):
    return list(range(base, base + n))


def token_lp(token: int, n: int) -> TokenLogprobs:
    """A recognisable TokenLogprobs for `token` (logprob -token/1000) with n alternatives."""
    return TokenLogprobs(token, -token / 1000, [(token + i, -(token + i) / 1000) for i in range(n)])


def prompt_lp(seq_id: int, pos: int) -> TokenLogprobs:
    """A recognisable prompt logprob for (sequence, position)."""
    return TokenLogprobs(seq_id * 100 + pos, -float(pos), [])


class FakeLastStage:
    """Tracks what a last stage would know from the schedules (params, prompt) and answers them."""

    def __init__(self, first: int = 500):
        self.tokens = itertools.count(first)  # fresh, never EOS, inside the vocabulary
        self.state: dict[int, tuple[SamplingParams, int, list[int] | None]] = {}
        self.forgotten: list[int] = []
        self.next_token: dict[int, int] = {}  # seq id -> the token to sample next (e.g. EOS)

    def __call__(self, sched: Schedule) -> StepResult:
        for seq_id in sched.forget:
            assert seq_id in self.state or seq_id not in self.forgotten, "forgotten twice"
            self.state.pop(seq_id, None)
            self.forgotten.append(seq_id)
        sampled, plps = [], []
        for w in sched.seqs:
            if w.params is not None:
                self.state[w.seq_id] = (w.params, w.prompt_len, w.prompt_ids)
            params, prompt_len, prompt_ids = self.state[w.seq_id]  # KeyError: a chunk came without params
            if prompt_ids is not None:
                positions = range(w.context_len + 1, min(w.context_len + len(w.token_ids), prompt_len - 1) + 1)
                if len(positions):
                    plps.append(PromptLogprobs(w.seq_id, positions[0], [prompt_lp(w.seq_id, p) for p in positions]))
            if w.sample:
                t = self.next_token.pop(w.seq_id, None)
                t = next(self.tokens) if t is None else t
                lp = token_lp(t, params.logprobs) if params.logprobs is not None else None
                sampled.append(SampledToken(w.seq_id, t, lp))
        return StepResult(sched.step_id, sampled, plps)


def run(core: EngineCore, stage: FakeLastStage, max_steps=1000):
    """Drives the core to the end; -> (schedules, outputs per request id in order)."""
    schedules, outputs = [], {}
    for _ in range(max_steps):
        sched = core.next_schedule()
        if sched is None:
            break
        schedules.append(sched)
        for out in core.process_result(stage(sched)):
            outputs.setdefault(out.request_id, []).append(out)
    assert not core.has_work()
    return schedules, outputs


def pool_is_whole(core: EngineCore) -> bool:
    return core.blocks.num_free == core.blocks.num_blocks


# -- what a chunk carries -----------------------------------------------------------------------

def test_first_chunk_carries_params_and_prompt_len_later_chunks_do_not():
    core = make_core(budget=4)
    p_a = SamplingParams(max_tokens=3)
    p_b = SamplingParams(max_tokens=2, prompt_logprobs=1)
    a = core.add("a", prompt(10), p_a)
    b = core.add("b", prompt(3, base=40), p_b)
    stage = FakeLastStage()
    schedules, _ = run(core, stage)
    works = [(w, s.step_id) for s in schedules for w in s.seqs]
    a_works = [w for w, _ in works if w.seq_id == a.seq_id]
    b_works = [w for w, _ in works if w.seq_id == b.seq_id]
    # a: chunks of 4, 4, 2 then 2 decodes
    assert [(w.context_len, len(w.token_ids)) for w in a_works] == [(0, 4), (4, 4), (8, 2), (10, 1), (11, 1)]
    assert a_works[0].params == p_a and a_works[0].prompt_len == 10 and a_works[0].prompt_ids is None
    assert a_works[0].token_ids == prompt(10)[:4] and not a_works[0].sample
    for w in a_works[1:]:
        assert w.params is None and w.prompt_len == 0 and w.prompt_ids is None
    # b wants prompt logprobs: its first chunk also carries the whole prompt
    assert b_works[0].context_len == 0
    assert b_works[0].params == p_b and b_works[0].prompt_len == 3 and b_works[0].prompt_ids == prompt(3, base=40)
    for w in b_works[1:]:
        assert w.context_len > 0 and w.params is None and w.prompt_len == 0 and w.prompt_ids is None
    assert len(b_works) >= 2


def test_a_first_output_that_comes_twice_is_counted_once():
    """The client hands a stream the tokens it lacks: an output sent again from 0 (its link dropped and
    the original came after all) keeps none of the first output's once-only fields (queue time, cached
    tokens, prompt logprobs), which the gateway would count again."""
    from moemesh.client import CoordinatorClient, _Stream

    st = _Stream()
    first = RequestOutput("a", [5], None, [None], num_prompt_tokens=3, queue_seconds=0.5, num_cached_tokens=2, start=0)
    CoordinatorClient._hand_over(st, first)
    CoordinatorClient._hand_over(st, RequestOutput("a", [5, 6], None, [None], num_prompt_tokens=3, queue_seconds=0.5,
                                                   num_cached_tokens=2, start=0))
    got = [st.queue.get_nowait() for _ in range(st.queue.qsize())]
    assert got[0] is first and got[1].token_ids == [6] and got[1].start == 1
    assert (got[1].queue_seconds, got[1].num_cached_tokens, got[1].prompt_logprobs) == (None, 0, None)


def test_a_recomputed_sequence_carries_its_params_again():
    # 4 blocks of 2 tokens: two 3-token prompts fill the pool; the first decode past 4 tokens preempts
    core = make_core(num_blocks=4, block_size=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    a = core.add("a", prompt(3), params)
    b = core.add("b", prompt(3, base=20), params)
    stage = FakeLastStage()
    schedules, outputs = run(core, stage)
    assert core.scheduler.num_preemptions >= 1
    b_works = [(s, w) for s in schedules for w in s.seqs if w.seq_id == b.seq_id]
    recomputes = [(s, w) for s, w in b_works[1:] if w.context_len == 0]
    assert recomputes, "b was never recomputed"
    s, w = recomputes[0]
    assert w.params == params and w.prompt_len == 3 and w.prompt_ids == prompt(3, base=20)
    assert len(w.token_ids) > 3 and w.token_ids[:3] == prompt(3, base=20)  # prompt plus what it generated
    assert b.seq_id not in s.forget  # preempted, not ended
    for _, w in b_works:
        assert (w.params is not None) == (w.context_len == 0)
    assert len(a.output_ids) == len(b.output_ids) == 4
    assert [t for o in outputs["b"] for t in o.token_ids] == b.output_ids
    assert pool_is_whole(core)


# -- forget -------------------------------------------------------------------------------------

def test_finished_and_aborted_sequences_are_forgotten_exactly_once_in_the_next_schedule():
    core = make_core()
    short = core.add("short", prompt(3), SamplingParams(max_tokens=1))
    eos = core.add("eos", prompt(3, base=30), SamplingParams(max_tokens=8))
    gone = core.add("gone", prompt(3, base=60), SamplingParams(max_tokens=8))
    long = core.add("long", prompt(3, base=90), SamplingParams(max_tokens=8))
    stage = FakeLastStage()
    stage.next_token[eos.seq_id] = EOS

    s0 = core.next_schedule()
    assert s0.forget == []
    core.process_result(stage(s0))  # short: length, eos: stop
    assert short.finish_reason == "length" and eos.finish_reason == "stop"
    s1 = core.next_schedule()
    assert sorted(s1.forget) == sorted([short.seq_id, eos.seq_id])
    assert {w.seq_id for w in s1.seqs} == {gone.seq_id, long.seq_id}
    core.process_result(stage(s1))
    assert core.abort("gone").finish_reason == "abort"
    s2 = core.next_schedule()
    assert s2.forget == [gone.seq_id]
    assert [w.seq_id for w in s2.seqs] == [long.seq_id]
    core.process_result(stage(s2))
    schedules, _ = run(core, stage)
    assert long.finish_reason == "length"
    later = [i for s in [s2, *schedules] for i in s.forget]
    assert later.count(short.seq_id) == later.count(eos.seq_id) == 0
    assert later == [gone.seq_id]  # long's own end is told by a schedule that never comes: nothing is left


def test_a_sequence_aborted_in_flight_is_forgotten_once_and_its_result_is_dropped():
    core = make_core()
    a = core.add("a", prompt(5), SamplingParams(max_tokens=4))
    b = core.add("b", prompt(5, base=40), SamplingParams(max_tokens=4))
    stage = FakeLastStage()
    s0 = core.next_schedule()
    out = core.abort("a")
    assert out.finish_reason == "abort" and out.token_ids == []
    outs = core.process_result(stage(s0))
    assert [o.request_id for o in outs] == ["b"]
    assert a.output_ids == []
    schedules, _ = run(core, stage)
    forgets = [i for s in schedules for i in s.forget]
    assert forgets.count(a.seq_id) == 1
    assert all(w.seq_id != a.seq_id for s in schedules for w in s.seqs)
    assert b.finish_reason == "length" and pool_is_whole(core)


# -- streaming outputs --------------------------------------------------------------------------

def test_outputs_stream_only_new_tokens_and_the_last_has_the_finish_reason():
    core = make_core(budget=4)
    a = core.add("a", prompt(9), SamplingParams(max_tokens=5))
    stage = FakeLastStage()
    per_step = []
    while (sched := core.next_schedule()) is not None:
        per_step.append(core.process_result(stage(sched)))
    assert [len(o) for o in per_step] == [0, 0, 1, 1, 1, 1, 1]  # chunks 4, 4, 1 of the prompt, then decodes
    outs = [o for step in per_step for o in step]
    assert all(len(o.token_ids) == 1 for o in outs)
    assert [t for o in outs for t in o.token_ids] == a.output_ids and len(set(a.output_ids)) == 5
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert all(o.num_prompt_tokens == 9 for o in outs)
    assert a.num_streamed == 5


def test_logprobs_are_attached_when_asked_and_only_then():
    core = make_core()
    core.add("none", prompt(4), SamplingParams(max_tokens=3))
    core.add("zero", prompt(4, base=30), SamplingParams(max_tokens=3, logprobs=0))
    core.add("three", prompt(4, base=60), SamplingParams(max_tokens=3, logprobs=3))
    _, outputs = run(core, FakeLastStage())
    assert all(o.logprobs is None for o in outputs["none"])
    for rid, n in (("zero", 0), ("three", 3)):
        for o in outputs[rid]:
            assert o.logprobs == [token_lp(t, n) for t in o.token_ids]
        assert sum(len(o.logprobs) for o in outputs[rid]) == 3
    assert all(o.prompt_logprobs is None for outs in outputs.values() for o in outs)


def test_prompt_logprobs_are_assembled_from_chunks_and_come_with_the_first_output():
    core = make_core(budget=4)
    n = 10
    seq = core.add("a", prompt(n), SamplingParams(max_tokens=3, prompt_logprobs=2))
    stage = FakeLastStage()
    schedules, outputs = run(core, stage)
    chunks = [w for s in schedules for w in s.seqs if w.context_len < n]
    assert len(chunks) == 3  # 4 + 4 + 2
    first, *rest = outputs["a"]
    assert first.prompt_logprobs == [None] + [prompt_lp(seq.seq_id, p) for p in range(1, n)]
    assert all(o.prompt_logprobs is None for o in rest)
    assert len(rest) == 2


def test_prompt_logprobs_of_a_one_token_prompt():
    core = make_core()
    core.add("a", [7], SamplingParams(max_tokens=1, prompt_logprobs=1))
    _, outputs = run(core, FakeLastStage())
    assert outputs["a"][0].prompt_logprobs == [None]


def test_prompt_logprobs_come_with_an_output_that_finishes_at_once():
    core = make_core()
    seq = core.add("a", prompt(4), SamplingParams(max_tokens=1, prompt_logprobs=0))
    (out,), = run(core, FakeLastStage())[1].values()
    assert out.finish_reason == "length"
    assert out.prompt_logprobs == [None, *(prompt_lp(seq.seq_id, p) for p in (1, 2, 3))]


# -- abort, add, results ------------------------------------------------------------------------

def test_outputs_count_their_tokens_and_any_of_them_can_be_had_again():
    """Each output says where its tokens start among the request's; `resend` gives them again from any
    point, as they were sent (logprobs too, prompt logprobs from 0), while the request runs and for a
    while after it ended (its end with them); nothing for a request not known."""
    core = make_core()
    core.add("a", prompt(5), SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=0))
    stage = FakeLastStage()
    sent = []
    while core.has_work():
        sent += core.process_result(stage(core.next_schedule()))
        if len(sent) == 3:  # while it runs
            again = core.resend("a", 1)
            assert again.start == 1 and again.finish_reason is None
            assert again.token_ids == [t for o in sent for t in o.token_ids][1:]
    assert [o.start for o in sent] == [sum(len(p.token_ids) for p in sent[:i]) for i in range(len(sent))]
    tokens = [t for o in sent for t in o.token_ids]
    logprobs = [lp for o in sent for lp in o.logprobs]
    assert core.resend("a", 0) is None  # (its prompt logprobs are not kept: answered as for a request not known)
    whole = core.resend("a", 1)
    assert whole.token_ids == tokens[1:] and whole.logprobs == logprobs[1:] and whole.finish_reason == "length"
    assert whole.num_prompt_tokens == 5
    tail = core.resend("a", 4)
    assert tail.token_ids == tokens[4:] and tail.prompt_logprobs is None and tail.start == 4
    assert core.resend("a", 6).token_ids == [] and core.resend("a", 6).finish_reason == "length"
    assert core.resend("nobody", 0) is None
    core.add("b", prompt(5, base=40), SamplingParams(max_tokens=3))
    first = None
    while core.has_work():
        outs = core.process_result(stage(core.next_schedule()))
        first = first or next((o for o in outs if o.request_id == "b"), None)
        if first is not None and core.requests.get("b") is not None:  # the first output, sent again whole
            again = core.resend("b", 0)  # (its wait and what the prefix cache held, as the gateway counts them)
            assert (again.queue_seconds, again.num_cached_tokens) == (first.queue_seconds, first.num_cached_tokens)
            assert again.queue_seconds is not None
            assert core.requests["b"].num_streamed < 2 or core.resend("b", 1).queue_seconds is None  # (the first's)
    assert core.resend("b", 0).token_ids == core.ended["b"].output_ids
    assert core.resend("b", 0).queue_seconds == first.queue_seconds  # (and after it ended)
    for i in range(1025):  # only the last ENDED_KEPT ended requests are kept
        core._keep_ended(core.add(f"x{i}", prompt(2), SamplingParams(max_tokens=1)))
    assert core.resend("a", 1) is None and len(core.ended) == 1024 and "x1024" in core.ended
    big = core.add("big", prompt(2), SamplingParams(max_tokens=1, logprobs=20))
    big.output_ids, big.logprobs = [7] * 200_000, [token_lp(7, 20)] * 200_000  # 4.4M entries: over the bound
    core._keep_ended(big)  # (too big to keep: not at the cost of the others)
    assert "big" not in core.ended and len(core.ended) == 1024 and core.ended_entries <= ENDED_ENTRIES
    entries = core.ended_entries
    core._keep_ended(core.ended["x1024"] and core.requests["x1024"])  # an id that ends again: counted once
    assert core.ended_entries == entries

def test_abort_unknown_or_finished_request_returns_none():
    core = make_core()
    assert core.abort("nobody") is None
    core.add("a", prompt(3), SamplingParams(max_tokens=1))
    run(core, FakeLastStage())
    assert core.abort("a") is None


def test_abort_a_running_request_frees_its_blocks():
    core = make_core(num_blocks=16)
    seq = core.add("a", prompt(9), SamplingParams(max_tokens=8))
    stage = FakeLastStage()
    core.process_result(stage(core.next_schedule()))
    assert core.blocks.num_free < 16 and seq.block_ids
    out = core.abort("a")
    assert out.request_id == "a" and out.token_ids == [] and out.finish_reason == "abort"
    assert out.num_prompt_tokens == 9
    assert pool_is_whole(core) and seq.block_ids == []
    assert not core.has_work() and core.abort("a") is None


def test_abort_a_waiting_request():
    core = make_core(max_seqs=1)
    a = core.add("a", prompt(3), SamplingParams(max_tokens=2))
    b = core.add("b", prompt(3, base=40), SamplingParams(max_tokens=2))
    stage = FakeLastStage()
    sched = core.next_schedule()
    assert [w.seq_id for w in sched.seqs] == [a.seq_id]
    assert list(core.scheduler.waiting) == [b]
    assert core.abort("b").finish_reason == "abort"
    assert list(core.scheduler.waiting) == [] and b.finish_reason == "abort"
    core.process_result(stage(sched))
    schedules, outputs = run(core, stage)
    assert all(w.seq_id == a.seq_id for s in schedules for w in s.seqs)
    assert "b" not in outputs and b.output_ids == [] and pool_is_whole(core)


@pytest.mark.parametrize("prompt_ids,match", [
    ([], "empty"),
    ([1, 2, VOCAB], "outside the vocabulary"),
    ([-1, 2], "outside the vocabulary"),
])
def test_add_refuses_bad_prompts(prompt_ids, match):
    core = make_core()
    with pytest.raises(ValueError, match=match):
        core.add("a", prompt_ids, SamplingParams())
    assert "a" not in core.requests and not core.has_work()


@pytest.mark.parametrize("params,match", [
    (SamplingParams(allowed_token_ids=(VOCAB + 5,)), "allowed_token_ids: token id"),
    (SamplingParams(allowed_token_ids=(3, VOCAB)), "allowed_token_ids: token id"),
    (SamplingParams(logit_bias=((VOCAB, 5.0),)), "logit_bias: token id"),
])
def test_add_refuses_token_ids_past_the_vocabulary_in_sampling_options(params, match):
    """As the gateway does (a direct client of the coordinator too): allowed_token_ids of ids past the
    vocabulary alone would otherwise sample from all of it."""
    core = make_core()
    with pytest.raises(ValueError, match=match):
        core.add("a", prompt(3), params)
    assert "a" not in core.requests
    core.add("b", prompt(3), SamplingParams(allowed_token_ids=(VOCAB - 1,), logit_bias=((0, 1.0),)))


def test_add_refuses_a_duplicate_request_id():
    core = make_core()
    first = core.add("a", prompt(3), SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        core.add("a", prompt(4), SamplingParams())
    assert core.requests["a"] is first and len(core.scheduler.waiting) == 1


def test_the_last_vocabulary_id_is_accepted():
    core = make_core()
    assert core.add("a", [0, VOCAB - 1], SamplingParams()).prompt_ids == [0, VOCAB - 1]


def test_a_result_for_a_step_not_in_flight_raises():
    core = make_core()
    core.add("a", prompt(3), SamplingParams(max_tokens=4))
    stage = FakeLastStage()
    sched = core.next_schedule()
    result = stage(sched)
    with pytest.raises(ValueError, match="not in flight"):
        core.process_result(StepResult(sched.step_id + 1, result.sampled))
    assert len(core.process_result(result)) == 1
    with pytest.raises(ValueError, match="not in flight"):
        core.process_result(result)  # the same result twice


def test_a_result_missing_a_sampled_token_raises_value_error():
    core = make_core()
    core.add("a", prompt(3), SamplingParams(max_tokens=4))
    core.add("b", prompt(3, base=40), SamplingParams(max_tokens=4))
    sched = core.next_schedule()
    result = FakeLastStage()(sched)
    with pytest.raises(ValueError):
        core.process_result(StepResult(sched.step_id, result.sampled[:1]))


def test_fail_in_flight_and_abort_all_end_everything_with_error():
    core = make_core(num_blocks=8, budget=6)
    core.add("a", prompt(5), SamplingParams(max_tokens=4))
    core.add("b", prompt(5, base=40), SamplingParams(max_tokens=4))
    core.add("c", prompt(12, base=70), SamplingParams(max_tokens=4))  # waits: budget and pool
    stage = FakeLastStage()
    core.process_result(stage(core.next_schedule()))
    in_flight = core.next_schedule()
    assert in_flight is not None and core.in_flight
    core.fail_in_flight()
    assert core.in_flight == {} and not core.scheduler.in_flight
    outs = core.abort_all("stage 1 died")
    assert sorted(o.request_id for o in outs) == ["a", "b", "c"]
    assert all(o.finish_reason == "error" and o.error == "stage 1 died" and o.token_ids == [] for o in outs)
    assert pool_is_whole(core)
    assert core.requests == {} and not core.has_work()
    assert core.scheduler.running == [] and len(core.scheduler.waiting) == 0
    with pytest.raises(ValueError):
        core.process_result(stage(in_flight))  # the lost step's late result is refused
    assert core.abort_all("again") == []


def test_step_ids_are_unique_and_increasing():
    core = make_core(budget=2)
    core.add("a", prompt(9), SamplingParams(max_tokens=3))
    schedules, _ = run(core, FakeLastStage())
    ids = [s.step_id for s in schedules]
    assert ids == sorted(set(ids)) and len(ids) == 5 + 2


# -- block tables travel as deltas ---------------------------------------------------------------

def _replay_tables(core: EngineCore, schedules_in_flight: int, requeue_at: int | None = None, late: bool = False,
                   max_steps=2000):
    """Drives the core with up to `schedules_in_flight` schedules outstanding (a pipeline's
    microbatches), replaying every schedule into a worker's `BlockTables`; after each schedule the
    replayed table of every sequence in it must be the coordinator's. `requeue_at`: after that many
    schedules a stage 'loses its state' (requeue_all, and the worker resets; `late`: only after it
    ran the new epoch's first schedule). -> schedules."""
    from collections import deque

    from moemesh.protocol import BlockTables

    tables, stage = BlockTables(), FakeLastStage()
    seqs = {seq.seq_id: seq for seq in [*core.scheduler.waiting, *core.scheduler.running]}
    pending, schedules = deque(), []
    for _ in range(max_steps):
        while len(pending) < schedules_in_flight and (sched := core.next_schedule()) is not None:
            got = tables.apply(sched)
            for w, table in zip(sched.seqs, got):
                assert table == seqs[w.seq_id].block_ids, f"step {sched.step_id}: seq {w.seq_id}"
            schedules.append(sched)
            pending.append(sched)
            if requeue_at is not None and len(schedules) == requeue_at:
                core.requeue_all()
                pending.clear()
                if late:  # the worker runs the new epoch's first schedule before it learns of the reset
                    first = core.next_step_id
                    sched = core.next_schedule()
                    got = tables.apply(sched)
                    assert all(w.params is not None for w in sched.seqs)  # every one admitted afresh
                    tables.drop_admitted_before(first)
                    assert set(tables.tables) == {w.seq_id for w in sched.seqs}  # kept; the lost epoch's gone
                    assert all(t == seqs[w.seq_id].block_ids for w, t in zip(sched.seqs, got))
                    schedules.append(sched)
                    pending.append(sched)
                else:
                    assert tables.drop_admitted_before(core.next_step_id)
                    assert not tables.tables
        if not pending:
            break
        core.process_result(stage(pending.popleft()))
    assert not core.has_work()
    # every ended sequence was forgotten, but those whose end the next schedule (never sent) would tell
    assert set(tables.tables) <= set(core._forget)
    return schedules


@pytest.mark.parametrize("in_flight", [1, 3])
def test_block_table_deltas_rebuild_every_table_through_preemption_and_caching(in_flight):
    core = EngineCore(SchedulerConfig(12, 16, 512), 14, 2, (EOS,), VOCAB, prefix_caching=True)
    shared = prompt(9)
    for i in range(6):  # a shared prefix (cache hits), prompts longer than a step (chunks)
        core.add(f"r{i}", shared + prompt(i + 1, base=100 + 10 * i), SamplingParams(max_tokens=7, ignore_eos=True))
    schedules = _replay_tables(core, in_flight)
    assert core.scheduler.num_preemptions > 0  # the pool is small on purpose
    assert core.blocks.hits > 0
    decodes = [w for s in schedules for w in s.seqs if w.params is None]
    assert decodes and any(not w.new_blocks for w in decodes) and any(w.new_blocks for w in decodes)
    for w in decodes:  # a later chunk carries only the blocks its new tokens open
        assert len(w.new_blocks) <= -(-len(w.token_ids) // 2)


@pytest.mark.parametrize("late", [False, True])
def test_block_table_deltas_after_the_stages_lose_their_state(late):
    core = make_core(num_blocks=32, block_size=2, budget=8)
    for i in range(4):
        core.add(f"r{i}", prompt(5, base=10 * i + 10), SamplingParams(max_tokens=6, ignore_eos=True))
    core.add("short", prompt(3, base=90), SamplingParams(max_tokens=1))  # ends in the epoch that is lost
    schedules = _replay_tables(core, 2, requeue_at=5, late=late)
    assert len(schedules) > 5


def test_a_decode_schedule_does_not_grow_with_context_length():
    """The bytes of a decode step of 8 sequences are the same at 40 and at 400 tokens of context
    (only a step that opens a new block carries one more block id)."""
    from moemesh.protocol import Codec

    def decode_bytes(prompt_len):
        core = make_core(num_blocks=1024, block_size=16, budget=4096, max_model_len=1024)
        for i in range(8):
            core.add(f"r{i}", prompt(prompt_len, base=1), SamplingParams(max_tokens=8, ignore_eos=True))
        stage = FakeLastStage()
        core.process_result(stage(core.next_schedule()))  # the prompts
        sizes = []
        while (sched := core.next_schedule()) is not None:
            if not any(w.new_blocks for w in sched.seqs):
                sizes.append(len(Codec.encode(sched)[0]))
            core.process_result(stage(sched))
        return max(sizes)

    assert decode_bytes(400) <= decode_bytes(40) + 8 * 2  # (token ids and positions may take a byte more)


def test_the_context_limit_is_what_the_kv_cache_holds(caplog):
    """A context longer than the KV cache could never be served (a chat without max_tokens asks for all
    of it): the mesh's core limits requests to what the cache holds, and says so."""
    from types import SimpleNamespace

    from coordinator.step_loop import make_core as mesh_core
    from moemesh.settings import SchedulerSettings

    model = SimpleNamespace(max_position_embeddings=4096, eos_token_ids=(EOS,), vocab_size=VOCAB)
    settings = SchedulerSettings(block_size=16)
    core = mesh_core(settings, model, num_blocks=12)
    assert core.scheduler.config.max_model_len == 12 * 16 + 1 and "KV cache holds fewer" in caplog.text
    core.add("fits", prompt(100), SamplingParams(max_tokens=93))  # 193 tokens: its last is never cached
    with pytest.raises(ValueError, match="maximum context length of 193"):
        core.add("too long", prompt(100), SamplingParams(max_tokens=94))
    assert mesh_core(SchedulerSettings(block_size=16, max_model_len=64), model, 12).scheduler.config.max_model_len == 64
    assert mesh_core(settings, model, 1000).scheduler.config.max_model_len == 4096


def test_a_request_id_used_again_after_an_abort_in_flight_is_the_new_requests():
    """An aborted request's step comes back after a new request took its id: the new one gets none of
    the old one's outputs or its end, and runs to its own end."""
    core = make_core()
    stage = FakeLastStage()
    old = core.add("a", prompt(10), SamplingParams(max_tokens=5))
    s0 = core.next_schedule()
    assert core.abort("a").finish_reason == "abort"
    new = core.add("a", prompt(10, base=40), SamplingParams(max_tokens=5))
    assert core.process_result(stage(s0)) == [] and core.requests["a"] is new and not new.finished
    _, outputs = run(core, stage)
    assert [o.finish_reason for o in outputs["a"]][-1] == "length"
    assert sum(len(o.token_ids) for o in outputs["a"]) == 5 and old.output_ids == [] and pool_is_whole(core)


def test_a_pool_rebuilt_smaller_limits_the_context_and_ends_what_no_longer_fits():
    """A recovery's replacement with a smaller KV pool: the context limit follows the pool; a request
    that no longer fits ends with a 400, as it would if sent now (it could never be admitted, and would
    hold up the rest);
    the others finish; a pool grown back raises the limit up to the model's."""
    core = EngineCore(SchedulerConfig(64, 16, 65), 16, 4, (EOS,), VOCAB, context_limit=512)
    stage = FakeLastStage()
    core.add("big", prompt(40), SamplingParams(max_tokens=20))
    core.add("small", prompt(4, base=100), SamplingParams(max_tokens=4))
    core.process_result(stage(core.next_schedule()))
    assert core.requeue_all() == (2, 44)
    outs = core.resize(8)
    assert [(o.request_id, o.finish_reason, o.error_status) for o in outs] == [("big", "error", 400)]
    assert "holds 32 tokens" in outs[0].error and core.scheduler.config.max_model_len == 33
    with pytest.raises(ValueError, match="maximum context length of 33"):
        core.add("too big now", prompt(30), SamplingParams(max_tokens=4))
    _, outputs = run(core, stage)
    assert outputs["small"][-1].finish_reason == "length" and pool_is_whole(core)
    core.resize(200)
    assert core.scheduler.config.max_model_len == 512


def test_a_result_with_tokens_outside_the_vocabulary_or_prompt_logprobs_outside_the_prompt_is_refused():
    """Refused whole, before any state changes (an out-of-vocabulary token fed back would fail the
    first stage on every recompute); the step stays in flight and its right result is taken."""
    core = make_core()
    core.add("a", prompt(3), SamplingParams(max_tokens=2, prompt_logprobs=0))
    sched = core.next_schedule()
    good = FakeLastStage()(sched)
    for bad in (msgspec.structs.replace(good, sampled=[msgspec.structs.replace(good.sampled[0], token_id=VOCAB)]),
                msgspec.structs.replace(good, sampled=[msgspec.structs.replace(good.sampled[0], token_id=-1)]),
                msgspec.structs.replace(good, prompt_logprobs=[PromptLogprobs(sched.seqs[0].seq_id, 2,
                                                                              [prompt_lp(0, 2)] * 4)])):
        with pytest.raises(ValueError, match="outside"):
            core.process_result(bad)
        assert sched.step_id in core.in_flight and core.requests["a"].output_ids == []
    outs = core.process_result(good)
    assert len(outs[0].token_ids) == 1 and len(outs[0].prompt_logprobs) == 3
