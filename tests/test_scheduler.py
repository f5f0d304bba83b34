"""Scheduler, block manager and sequence: pure policy, driven by hand with fake sampled tokens.

No model and no tensors: each test calls `schedule()`, invents the tokens the last stage would have
sampled, and hands them back with `update()`.
"""

import itertools
import random

import pytest

from coordinator.block_manager import BlockManager
from coordinator.scheduler import Scheduler, SchedulerConfig, Step
from coordinator.sequence import Sequence, Status
from moemesh.sampling import SamplingParams

EOS = 0
PROMPT_BASE = 10  # prompt tokens are >= 10, so they never look like EOS or a stop token


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=16, max_model_len=512, eos=(EOS,)):
    blocks = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(budget, max_seqs, max_model_len), blocks, eos), blocks


def make_seq(seq_id, prompt_len, **params):
    params.setdefault("max_tokens", 8)
    return Sequence(seq_id, list(range(PROMPT_BASE, PROMPT_BASE + prompt_len)), SamplingParams(**params))


class FakeSampler:
    """Fresh, never-repeating tokens (>= 1000), so a recomputed sequence cannot fake its old output."""

    def __init__(self):
        self._next = itertools.count(1000)

    def __call__(self, step: Step) -> list[int]:
        return [next(self._next) for item in step.items if item.sample]


def check_step(sched: Scheduler, blocks: BlockManager, step: Step) -> None:
    """Invariants of every step: limits, no sequence twice, caches big enough, blocks owned once."""
    cfg = sched.config
    assert step.num_tokens <= cfg.max_num_batched_tokens
    assert len(step.items) <= cfg.max_num_seqs
    ids = [item.seq.seq_id for item in step.items]
    assert len(ids) == len(set(ids))
    for item in step.items:
        assert item.num_new >= 1
        assert item.seq.num_computed == item.context_len + item.num_new
        assert len(item.seq.block_ids) >= blocks.blocks_needed(item.context_len + item.num_new)
        assert item.sample == (item.context_len + item.num_new == item.seq.num_tokens)
    owned = [b for s in sched.running for b in s.block_ids]
    assert len(owned) == len(set(owned))
    assert len(owned) + blocks.num_free == blocks.num_blocks


def run_to_completion(sched, blocks, sampler=None, max_steps=10_000):
    sampler = sampler or FakeSampler()
    steps = 0
    while sched.has_work():
        step = sched.schedule()
        assert step.items, "no progress with work left"
        check_step(sched, blocks, step)
        sched.update(step, sampler(step))
        steps += 1
        assert steps < max_steps
    return steps


# ----------------------------------------------------------------------------------------------
# BlockManager


def test_block_manager_hands_out_low_ids_first_and_takes_them_back():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(0, 6), make_seq(1, 4)
    blocks.grow(a, 6)
    a.num_computed = 6
    assert a.block_ids == [0, 1] and blocks.num_free == 2
    blocks.grow(b, 4)
    b.num_computed = 4
    assert b.block_ids == [2] and blocks.num_free == 1
    blocks.free(a)
    assert a.block_ids == [] and blocks.num_free == 3
    c = make_seq(2, 12)
    blocks.grow(c, 12)
    assert sorted(c.block_ids) == [0, 1, 3]  # a's blocks come back into use
    assert set(c.block_ids).isdisjoint(b.block_ids)
    assert blocks.num_free == 0


def test_block_manager_grow_past_the_pool_raises_and_changes_nothing():
    blocks = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(0, 9)
    assert not blocks.can_grow(seq, 9)
    with pytest.raises(RuntimeError, match="need 3 blocks, 2 free"):
        blocks.grow(seq, 9)
    assert seq.block_ids == [] and blocks.num_free == 2
    assert blocks.can_grow(seq, 8)


@pytest.mark.parametrize("num_computed,held,num_new,extra", [
    (0, 0, 1, 1),  # first token opens a block
    (0, 0, 4, 1),  # exactly one full block
    (0, 0, 5, 2),  # one past the boundary
    (3, 1, 1, 0),  # fills the last slot of the held block
    (4, 1, 1, 1),  # first token of a new block
    (4, 1, 4, 1),
    (4, 1, 5, 2),
    (7, 2, 1, 0),
    (8, 2, 0, 0),  # nothing new
    (0, 3, 4, 0),  # holds more than it needs (never negative)
])
def test_extra_blocks_at_block_boundaries(num_computed, held, num_new, extra):
    blocks = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, 16)
    seq.num_computed, seq.block_ids = num_computed, list(range(held))
    assert blocks.extra_blocks(seq, num_new) == extra


def test_blocks_needed_rounds_up():
    blocks = BlockManager(num_blocks=8, block_size=16)
    assert [blocks.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0), (-1, 4)])
def test_block_manager_rejects_an_empty_pool(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


# ----------------------------------------------------------------------------------------------
# Sequence


def test_sequence_token_bookkeeping():
    seq = make_seq(0, 5)
    assert seq.token_ids == [10, 11, 12, 13, 14] and seq.num_tokens == 5 and seq.num_pending == 5
    seq.num_computed = 5
    seq.output_ids.append(99)
    assert seq.token_ids[-1] == 99 and seq.num_tokens == 6 and seq.num_pending == 1
    assert seq.prompt_ids == [10, 11, 12, 13, 14]  # the prompt is not touched by generation
    assert not seq.finished
    seq.status = Status.FINISHED
    assert seq.finished


# ----------------------------------------------------------------------------------------------
# Budget, limits, chunked prefill, ordering


def test_long_prompt_is_prefilled_in_chunks_and_sampled_only_at_its_end():
    sched, blocks = make_scheduler(budget=8, block_size=4)
    seq = make_seq(0, 21)
    sched.add(seq)
    got = []
    for _ in range(3):
        step = sched.schedule()
        check_step(sched, blocks, step)
        (item,) = step.items
        got.append((item.context_len, item.num_new, item.sample, item.token_ids))
        assert len(seq.block_ids) == blocks.blocks_needed(seq.num_computed)
        sched.update(step, [777] if item.sample else [])
    prompt = seq.prompt_ids
    assert got == [(0, 8, False, prompt[0:8]), (8, 8, False, prompt[8:16]), (16, 5, True, prompt[16:21])]
    assert seq.output_ids == [777]
    step = sched.schedule()  # now a decode of the sampled token
    assert [(i.context_len, i.num_new, i.sample, i.token_ids) for i in step.items] == [(21, 1, True, [777])]


def test_decodes_and_a_prefill_chunk_share_a_step_running_first():
    sched, blocks = make_scheduler(budget=8)
    a, b, c = make_seq(0, 7), make_seq(1, 20), make_seq(2, 3)
    sched.add(a)
    step = sched.schedule()
    assert [(i.seq, i.num_new) for i in step.items] == [(a, 7)]
    sched.update(step, [500])
    sched.add(b)
    sched.add(c)
    step = sched.schedule()
    check_step(sched, blocks, step)
    # the running decode first, then the oldest waiting prompt takes the rest of the budget
    assert [(i.seq, i.context_len, i.num_new, i.sample) for i in step.items] == [(a, 7, 1, True), (b, 0, 7, False)]
    assert step.num_tokens == 8
    assert list(sched.waiting) == [c]  # c waits: no budget left, although it would fit the cache
    sched.update(step, [501])
    step = sched.schedule()
    check_step(sched, blocks, step)
    assert [(i.seq, i.context_len, i.num_new) for i in step.items] == [(a, 8, 1), (b, 7, 7)]


def test_running_sequences_are_served_oldest_first_before_waiting_ones():
    sched, blocks = make_scheduler(budget=3, max_seqs=16)
    seqs = [make_seq(i, 1) for i in range(5)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [i.seq.seq_id for i in step.items] == [0, 1, 2]  # FCFS admission
    sched.update(step, FakeSampler()(step))
    step = sched.schedule()
    # three running decodes use the whole budget; 3 and 4 keep waiting
    assert [i.seq.seq_id for i in step.items] == [0, 1, 2]
    assert [s.seq_id for s in sched.waiting] == [3, 4]


def test_token_budget_and_sequence_limit_hold_on_every_step():
    sched, blocks = make_scheduler(num_blocks=512, budget=10, max_seqs=3)
    rng = random.Random(0)
    seqs = [make_seq(i, rng.randint(1, 25), max_tokens=rng.randint(1, 6), ignore_eos=True) for i in range(12)]
    for s in seqs:
        sched.add(s)
    sampler, sizes, tokens = FakeSampler(), [], []
    while sched.has_work():
        step = sched.schedule()
        check_step(sched, blocks, step)  # budget and max_num_seqs
        sizes.append(len(step.items))
        tokens.append(step.num_tokens)
        sched.update(step, sampler(step))
    assert max(sizes) == 3 and max(tokens) == 10  # both limits were reached, neither exceeded
    assert all(len(s.output_ids) == s.params.max_tokens and s.finish_reason == "length" for s in seqs)
    assert blocks.num_free == blocks.num_blocks


def test_max_num_seqs_stops_admission_even_with_budget_left():
    sched, blocks = make_scheduler(budget=100, max_seqs=2)
    for i in range(4):
        sched.add(make_seq(i, 2))
    step = sched.schedule()
    assert [i.seq.seq_id for i in step.items] == [0, 1] and step.num_tokens == 4
    assert len(sched.waiting) == 2


# ----------------------------------------------------------------------------------------------
# Preemption


def _fill_pool_with_two_decoders():
    """A and B (4-token prompts) in a 4-block pool of 4-token blocks; after 5 steps each holds
    2 blocks with 9 tokens (8 cached), so the next step needs a third block for each."""
    sched, blocks = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a = make_seq(0, 4, max_tokens=10, ignore_eos=True)
    b = make_seq(1, 4, max_tokens=10, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    sampler = FakeSampler()
    for _ in range(5):
        step = sched.schedule()
        check_step(sched, blocks, step)
        assert {i.seq.seq_id for i in step.items} == {0, 1}
        sched.update(step, sampler(step))
    assert blocks.num_free == 0 and a.num_tokens == b.num_tokens == 9
    return sched, blocks, a, b, sampler


def test_preemption_evicts_the_newest_running_sequence_to_the_front_of_the_queue():
    sched, blocks, a, b, sampler = _fill_pool_with_two_decoders()
    c = make_seq(2, 4, max_tokens=2)
    sched.add(c)  # waits behind the preempted sequence
    b_output = list(b.output_ids)
    step = sched.schedule()
    check_step(sched, blocks, step)
    assert [i.seq for i in step.items] == [a]
    assert b.status is Status.WAITING and b.block_ids == [] and b.num_computed == 0
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b, c]  # front of the queue, ahead of the older waiter
    assert sched.running == [a]
    assert blocks.num_free == 1  # b's two blocks back, one taken by a
    assert b.output_ids == b_output  # generated tokens are kept for the recompute
    sched.update(step, sampler(step))


def test_preempted_sequence_is_recomputed_from_prompt_and_output_and_keeps_its_tokens():
    sched, blocks, a, b, sampler = _fill_pool_with_two_decoders()
    b_output = list(b.output_ids)
    assert len(b_output) == 5
    recompute = None
    while sched.has_work():
        step = sched.schedule()
        check_step(sched, blocks, step)
        for item in step.items:
            if item.seq is b and recompute is None:
                recompute = item
        sched.update(step, sampler(step))
    # a finished first, then b came back: one prefill of its whole prompt + generated tokens
    assert recompute is not None
    assert (recompute.context_len, recompute.num_new, recompute.sample) == (0, 9, True)
    assert recompute.token_ids == b.prompt_ids + b_output
    assert a.finish_reason == b.finish_reason == "length"
    assert len(a.output_ids) == len(b.output_ids) == 10
    assert b.output_ids[:5] == b_output
    assert len(set(b.output_ids)) == 10  # the recompute sampled one new token, not a repeat
    assert blocks.num_free == blocks.num_blocks


def test_newest_sequence_preempts_itself_rather_than_an_older_one():
    sched, blocks = make_scheduler(num_blocks=2, block_size=4, budget=64)
    a = make_seq(0, 3, max_tokens=5, ignore_eos=True)  # grows into a 2nd block after 1 decode
    b = make_seq(1, 4, max_tokens=4, ignore_eos=True)  # grows into a 2nd block at its first decode
    sched.add(a)
    sched.add(b)
    sampler = FakeSampler()
    step = sched.schedule()
    sched.update(step, sampler(step))
    assert blocks.num_free == 0
    step = sched.schedule()
    check_step(sched, blocks, step)
    assert [i.seq for i in step.items] == [a]  # a needed nothing new; b needed a block and only itself to evict
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert list(sched.waiting) == [b]


def test_a_pool_too_small_for_everyone_still_finishes_everyone():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4, budget=16, max_seqs=8)
    rng = random.Random(1)
    seqs = []
    for i in range(20):
        prompt_len = rng.randint(1, 20)
        seqs.append(make_seq(i, prompt_len, max_tokens=rng.randint(1, 32 - prompt_len), ignore_eos=True))
        sched.add(seqs[-1])
    sampler = FakeSampler()
    outputs_seen: dict[int, list[int]] = {}
    while sched.has_work():
        step = sched.schedule()
        assert step.items
        check_step(sched, blocks, step)
        sched.update(step, sampler(step))
        for s in seqs:  # output only ever grows: preemption never drops generated tokens
            assert s.output_ids[:len(outputs_seen.get(s.seq_id, []))] == outputs_seen.get(s.seq_id, [])
            outputs_seen[s.seq_id] = list(s.output_ids)
    assert sched.num_preemptions > 0  # the pool really was too small
    assert all(len(s.output_ids) == s.params.max_tokens and s.finish_reason == "length" for s in seqs)
    assert blocks.num_free == blocks.num_blocks
    assert sched.running == [] and not sched.waiting


# ----------------------------------------------------------------------------------------------
# Steps in flight


def test_sequences_in_flight_are_not_scheduled_again_until_their_step_returns():
    sched, blocks = make_scheduler(budget=8)
    seqs = [make_seq(i, 4, max_tokens=3, ignore_eos=True) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step1 = sched.schedule()
    step2 = sched.schedule()  # step1 has not come back
    ids1 = {i.seq.seq_id for i in step1.items}
    ids2 = {i.seq.seq_id for i in step2.items}
    assert ids1 == {0, 1} and ids2 == {2, 3}
    assert set(sched.in_flight) == {0, 1, 2, 3}
    assert sched.schedule().items == []  # everyone is in flight
    sampler = FakeSampler()
    sched.update(step1, sampler(step1))
    assert set(sched.in_flight) == {2, 3}
    step3 = sched.schedule()
    assert {i.seq.seq_id for i in step3.items} == {0, 1}
    assert all(i.num_new == 1 for i in step3.items)


def test_a_long_prompt_flows_through_the_pipeline_chunk_after_chunk():
    sched, blocks = make_scheduler(num_blocks=64, budget=4)
    a = make_seq(0, 10, max_tokens=2, ignore_eos=True)
    sched.add(a)
    steps = [sched.schedule() for _ in range(4)]  # nothing has come back yet
    chunks = [(s.items[0].context_len, s.items[0].num_new, s.items[0].sample) for s in steps[:3]]
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert steps[3].items == []  # the next step needs the token the third will sample
    assert sched.in_flight[0] == 3
    sampler = FakeSampler()
    for s in steps[:3]:
        sched.update(s, sampler(s))
    assert len(a.output_ids) == 1 and not sched.in_flight
    run_to_completion(sched, blocks)
    assert blocks.num_free == blocks.num_blocks


def test_two_steps_in_flight_run_to_completion():
    sched, blocks = make_scheduler(num_blocks=64, budget=12, max_seqs=4)
    rng = random.Random(2)
    seqs = [make_seq(i, rng.randint(1, 15), max_tokens=rng.randint(1, 8), ignore_eos=True) for i in range(10)]
    for s in seqs:
        sched.add(s)
    sampler = FakeSampler()
    pending: list[tuple[Step, list[int]]] = []  # oldest first, at most two in flight
    rounds = 0
    while sched.has_work():
        step = sched.schedule()
        # a sequence may be in two steps at once only as consecutive chunks of its prompt
        for item in step.items:
            for earlier, _ in pending:
                for e in earlier.items:
                    if e.seq is item.seq:
                        assert not e.sample and e.context_len + e.num_new == item.context_len
        if step.items:
            check_step(sched, blocks, step)
            pending.append((step, sampler(step)))
        if len(pending) == 2 or (pending and not step.items):
            sched.update(*pending.pop(0))
        rounds += 1
        assert rounds < 1000
    assert all(len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert not sched.in_flight and blocks.num_free == blocks.num_blocks


# ----------------------------------------------------------------------------------------------
# Stop conditions


def _decode_tokens(sched, seq, tokens):
    """Feeds `tokens` one step at a time to a lone sequence; returns how many were consumed."""
    for n, token in enumerate(tokens, 1):
        step = sched.schedule()
        assert [i.seq for i in step.items] == [seq] and step.items[0].sample
        finished = sched.update(step, [token])
        if seq.finished:
            assert finished == [seq]
            return n
        assert finished == []
    return len(tokens)


def test_eos_stops_with_reason_stop_and_frees_blocks():
    sched, blocks = make_scheduler()
    seq = make_seq(0, 5, max_tokens=10)
    sched.add(seq)
    assert _decode_tokens(sched, seq, [100, 101, EOS, 102]) == 3
    assert seq.finish_reason == "stop" and seq.output_ids == [100, 101, EOS]
    assert blocks.num_free == blocks.num_blocks and not sched.has_work()


def test_ignore_eos_runs_through_eos_to_max_tokens():
    sched, blocks = make_scheduler()
    seq = make_seq(0, 5, max_tokens=4, ignore_eos=True)
    sched.add(seq)
    assert _decode_tokens(sched, seq, [EOS, EOS, 100, EOS, 101]) == 4
    assert seq.finish_reason == "length" and seq.output_ids == [EOS, EOS, 100, EOS]


def test_stop_token_ids_stop_even_with_ignore_eos():
    sched, blocks = make_scheduler()
    seq = make_seq(0, 5, max_tokens=10, ignore_eos=True, stop_token_ids=(7, 8))
    sched.add(seq)
    assert _decode_tokens(sched, seq, [100, EOS, 8, 101]) == 3
    assert seq.finish_reason == "stop" and seq.output_ids == [100, EOS, 8]


def test_several_eos_ids():
    sched, blocks = make_scheduler(eos=(0, 3))
    seq = make_seq(0, 5, max_tokens=10)
    sched.add(seq)
    assert _decode_tokens(sched, seq, [100, 3]) == 2
    assert seq.finish_reason == "stop"


def test_max_tokens_stops_with_reason_length():
    sched, blocks = make_scheduler()
    seq = make_seq(0, 5, max_tokens=3)
    sched.add(seq)
    assert _decode_tokens(sched, seq, [100, 101, 102, 103]) == 3
    assert seq.finish_reason == "length" and len(seq.output_ids) == 3


def test_min_tokens_delays_the_eos_and_stop_token_stop():
    sched, blocks = make_scheduler()
    seq = make_seq(0, 5, max_tokens=10, min_tokens=3, stop_token_ids=(7,))
    sched.add(seq)
    # EOS as the 1st and a stop token as the 2nd token do not stop; EOS as the 3rd does
    assert _decode_tokens(sched, seq, [EOS, 7, EOS, 100]) == 3
    assert seq.finish_reason == "stop" and seq.output_ids == [EOS, 7, EOS]


def test_max_model_len_stops_with_reason_length():
    sched, blocks = make_scheduler(max_model_len=8)
    seq = make_seq(0, 5, max_tokens=3)
    sched.add(seq)  # 5 + 3 == max_model_len: accepted
    assert _decode_tokens(sched, seq, [100, 101, 102, 103]) == 3
    assert seq.finish_reason == "length" and seq.num_tokens == 8


def test_max_model_len_stops_a_sequence_before_its_max_tokens():
    # add() refuses prompt + max_tokens > max_model_len, so this check is a backstop; it is reached
    # here by queueing the sequence directly.
    sched, blocks = make_scheduler(max_model_len=8)
    seq = make_seq(0, 5, max_tokens=100)
    sched.waiting.append(seq)
    assert _decode_tokens(sched, seq, [100, 101, 102, 103, 104]) == 3
    assert seq.finish_reason == "length" and seq.num_tokens == 8


# ----------------------------------------------------------------------------------------------
# Aborts


def test_abort_a_waiting_sequence():
    sched, blocks = make_scheduler(budget=4)
    a, b = make_seq(0, 4), make_seq(1, 4)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [i.seq for i in step.items] == [a]
    sched.finish(b, "abort")
    assert b.finished and b.finish_reason == "abort" and b not in sched.waiting
    sched.update(step, [100])
    step = sched.schedule()
    assert [i.seq for i in step.items] == [a]


def test_abort_a_preempted_sequence_waiting_for_recompute():
    sched, blocks, a, b, sampler = _fill_pool_with_two_decoders()
    step = sched.schedule()
    assert b.status is Status.WAITING
    sched.finish(b, "abort")
    assert b.finish_reason == "abort" and not sched.waiting
    sched.update(step, sampler(step))
    run_to_completion(sched, blocks, sampler)
    assert a.finish_reason == "length" and len(b.output_ids) == 5
    assert blocks.num_free == blocks.num_blocks


def test_abort_a_running_sequence_frees_its_blocks():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_seq(0, 9), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.update(step, [100, 101])
    assert blocks.num_free == 8 - 3 - 1
    sched.finish(a, "abort")
    assert a.block_ids == [] and blocks.num_free == 8 - 1
    assert a not in sched.running and a.finish_reason == "abort"
    step = sched.schedule()
    assert [i.seq for i in step.items] == [b]
    sched.finish(a, "error")  # a second finish changes nothing
    assert a.finish_reason == "abort" and blocks.num_free == 8 - 1


def test_abort_an_in_flight_sequence_then_its_step_returns():
    sched, blocks = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_seq(0, 5), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.finish(a, "abort")  # while its step is still running
    assert a.block_ids == [] and blocks.num_free == 8 - 1
    finished = sched.update(step, [EOS, 200])  # a's row sampled EOS; b's row gets 200, not EOS
    assert finished == []
    assert a.output_ids == [] and a.finish_reason == "abort"
    assert b.output_ids == [200] and not b.finished
    assert not sched.in_flight
    run_to_completion(sched, blocks)
    assert blocks.num_free == blocks.num_blocks


def test_abort_an_in_flight_prefill_chunk():
    sched, blocks = make_scheduler(budget=4)
    a = make_seq(0, 10)
    sched.add(a)
    step = sched.schedule()
    assert not step.items[0].sample
    sched.finish(a, "abort")
    assert sched.update(step, []) == []
    assert a.output_ids == [] and not sched.has_work() and not sched.in_flight
    assert blocks.num_free == blocks.num_blocks


# ----------------------------------------------------------------------------------------------
# Admission


def test_add_refuses_prompt_plus_max_tokens_over_max_model_len():
    sched, blocks = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match=r"prompt \(5 tokens\) plus max_tokens \(4\).* 8"):
        sched.add(make_seq(0, 5, max_tokens=4))
    assert not sched.has_work()


def test_add_refuses_a_request_larger_than_the_whole_kv_cache():
    sched, blocks = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"\(10 tokens\).*\(8 tokens\)"):
        sched.add(make_seq(0, 5, max_tokens=5))  # 9 tokens to cache (the last is only sampled)
    assert not sched.has_work()
    sched.add(make_seq(1, 5, max_tokens=4))  # 8 cached: exactly the pool
    assert len(sched.waiting) == 1


def test_a_sequence_preempted_in_a_step_is_not_readmitted_in_that_step():
    # A decodes for a long time; B's long prompt is chunked behind it. Whenever B's next chunk
    # needs more blocks than are free, B (the newest) is preempted; the waiting loop must not then
    # hand it a fresh chunk from context 0 in the same step, throwing its cache away each step.
    sched, blocks = make_scheduler(num_blocks=6, block_size=4, budget=8)
    a = make_seq(0, 4, max_tokens=20, ignore_eos=True)
    b = make_seq(1, 16, max_tokens=4, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    sampler = FakeSampler()
    while sched.has_work():
        before = {s.seq_id: s.num_preemptions for s in (a, b)}
        step = sched.schedule()
        check_step(sched, blocks, step)
        for item in step.items:
            assert item.seq.num_preemptions == before[item.seq.seq_id], \
                f"seq {item.seq.seq_id} preempted and rescheduled from {item.context_len} in one step"
        sched.update(step, sampler(step))
    assert a.finish_reason == b.finish_reason == "length"


def test_an_older_sequence_is_not_preempted_for_a_newer_ones_next_chunk():
    """A decoding sequence that needs a block while the only newer one has a prefill chunk in flight waits
    for that step to return and then preempts the newer one, rather than giving its own cache up."""
    sched, blocks = make_scheduler(num_blocks=6, block_size=4, budget=8, max_seqs=8, max_model_len=25)
    a = make_seq(0, 7, max_tokens=8, ignore_eos=True)
    sched.add(a)
    step = sched.schedule()
    sched.update(step, [1000])  # a: 7 cached, its token pending; its next decode fills the 2nd block
    b = make_seq(1, 20, max_tokens=1)
    sched.add(b)
    first = sched.schedule()  # a's decode and b's first chunk
    check_step(sched, blocks, first)
    second = sched.schedule()  # b's next chunk right behind it (a awaits its token)
    check_step(sched, blocks, second)
    assert [i.seq for i in second.items] == [b]
    sched.update(first, [1001])
    third = sched.schedule()  # a needs a block; b, newer, has a step in flight: a waits (b's chunk goes on)
    check_step(sched, blocks, third)
    assert a not in [i.seq for i in third.items] and a.num_preemptions == 0 and a.status is Status.RUNNING
    sched.update(second, [])
    sched.update(third, [])
    fourth = sched.schedule()  # b's steps are back: b, the newer, is the one preempted
    check_step(sched, blocks, fourth)
    assert [i.seq for i in fourth.items] == [a] and b.num_preemptions == 1 and a.num_preemptions == 0
    sched.update(fourth, FakeSampler()(fourth))
    run_to_completion(sched, blocks)
    assert a.finish_reason == b.finish_reason == "length" and blocks.num_free == blocks.num_blocks


def test_a_sequence_with_a_chunk_in_flight_is_never_preempted():
    """The newest sequence prefilling in pipelined chunks runs the pool dry with chunks in flight: it
    waits for them rather than preempting itself (its blocks would be handed out again while steps in
    flight write them, and a stale result would mark the new blocks cached: a later prompt with the same
    prefix would read K/V no step computed)."""
    sched, blocks = make_scheduler(num_blocks=6, block_size=4, budget=8, max_model_len=64)
    a = make_seq(0, 7, max_tokens=8, ignore_eos=True)
    sched.add(a)
    step = sched.schedule()
    sched.update(step, [1000])
    b = make_seq(1, 20, max_tokens=1)
    sched.add(b)
    steps = []
    for _ in range(4):  # pipelined: nothing returns in between
        steps.append(sched.schedule())
        check_step(sched, blocks, steps[-1])
    assert b.num_preemptions == 0 and a.num_preemptions == 0
    for s in steps:
        sched.update(s, FakeSampler()(s))
    run_to_completion(sched, blocks)
    assert a.finish_reason == "length" and b.finish_reason is not None and blocks.num_free == blocks.num_blocks
