"""Prefix caching: the hash chain, references, LRU eviction, sharing only what a finished step wrote,
and greedy output with the cache equal to without it (and to transformers) on every architecture,
with chunked prefill and preemption in the mix. The mesh layouts (pp=2, tp=2) are in test_mesh.py
and test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from coordinator.block_manager import BlockManager, block_hash
from coordinator.core import EngineCore
from coordinator.scheduler import SchedulerConfig
from coordinator.sequence import Sequence
from hf_models import build_hf_model, hf_greedy
from moemesh.sampling import SamplingParams
from test_core import FakeLastStage

B = 4
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def seq(i, tokens, **params):
    return Sequence(i, list(tokens), SamplingParams(max_tokens=3, ignore_eos=True, **params))


def computed(m: BlockManager, s: Sequence) -> None:
    """As if a step had computed all of the sequence's tokens and come back."""
    m.grow(s, s.num_tokens)
    s.num_computed = s.num_tokens
    m.cache_computed(s, s.num_tokens)


def core(num_blocks=32, budget=64):
    return EngineCore(SchedulerConfig(budget, 16, 512), num_blocks, B, (0,), 1000, prefix_caching=True)


def run_step(c: EngineCore, stage: FakeLastStage, max_seqs=None):
    sched = c.next_schedule(max_seqs)
    return sched, c.process_result(stage(sched))


def work(c: EngineCore, sched, request_id: str):
    """The request's share of a schedule."""
    return next(w for w in sched.seqs if w.seq_id == c.requests[request_id].seq_id)


# -- the hash chain -----------------------------------------------------------------------------

def test_a_block_hash_names_its_tokens_and_everything_before_them():
    m = BlockManager(8, B, enable_caching=True)
    a, b = seq(0, range(10, 22)), seq(1, [10, 11, 12, 13, 99, 15, 16, 17, 18, 19, 20, 21])
    ha, hb = m.hashes(a, 3), m.hashes(b, 3)
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # same third block, other history
    assert ha[0] == block_hash(None, (10, 11, 12, 13)) and ha[1] == block_hash(ha[0], (14, 15, 16, 17))
    assert m.hashes(a, 2) == ha[:2] and a.block_hashes == ha  # memoised on the sequence
    assert len(ha[0]) == 32  # SHA-256: a prefix cannot be crafted to collide with another's


# -- sharing ------------------------------------------------------------------------------------

def test_a_prefix_is_shared_only_after_the_step_that_wrote_it_came_back():
    """A block a step in flight is writing is never taken from the cache; a request whose next block
    it is waits for that step (rather than computing the block a second time) and then takes it."""
    c, stage = core(), FakeLastStage()
    prompt = list(range(10, 20))  # 10 tokens: blocks [10..13] [14..17] and 2 more
    c.add("a", prompt, PARAMS)
    sched_a = c.next_schedule()
    c.add("b", prompt, PARAMS)  # a's blocks are being written by a step in flight
    assert c.next_schedule() is None and c.requests["b"].block_ids == []  # b waits for them
    c.process_result(stage(sched_a))
    sched_b = c.next_schedule()
    w = work(c, sched_b, "b")
    a, b = c.requests["a"], c.requests["b"]
    assert w.context_len == 8 and w.token_ids == prompt[8:] and w.params is not None  # (9 of 10 at most)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert (c.blocks.queries, c.blocks.hits) == (20, 8) and b.num_cached_tokens == 8
    out = {o.request_id: o for o in c.process_result(stage(sched_b))}
    assert out["b"].num_cached_tokens == 8 and out["a"].num_cached_tokens == 0


def test_requests_arriving_together_compute_their_shared_prefix_once():
    """The choices of an n > 1 request (or requests with one system prompt) added at once: the first
    computes the prefix, the others wait a step and take it from the cache; one behind them with
    nothing to share is admitted meanwhile; and greedy tokens are what each would get alone."""
    c, stage = core(), FakeLastStage()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    for r in ("a", "b", "c"):
        c.add(r, prompt, PARAMS)
    c.add("x", list(range(50, 63)), PARAMS)
    first = c.next_schedule()
    assert {w.seq_id for w in first.seqs} == {c.requests[r].seq_id for r in ("a", "x")}
    c.process_result(stage(first))
    second = c.next_schedule()
    assert [work(c, second, r).context_len for r in ("b", "c")] == [12, 12]
    assert c.blocks.hits == 24 and c.requests["b"].block_ids[:3] == c.requests["a"].block_ids[:3]
    assert not c.scheduler._producing  # (a's blocks came back; b's and c's own last block is not full)


def test_a_request_waiting_for_a_prefix_goes_on_when_its_computer_is_aborted():
    c, stage = core(budget=8), FakeLastStage()
    prompt = list(range(10, 30))  # 20 tokens: chunks of 8
    c.add("a", prompt, PARAMS)
    first = c.next_schedule()
    c.add("b", prompt, PARAMS)
    second = c.next_schedule()  # a's next chunk; b waits for the blocks a computes
    assert work(c, second, "a").context_len == 8 and c.requests["b"].block_ids == []
    c.abort("a")
    third = c.next_schedule()  # nobody computes them now: b does
    assert work(c, third, "b").context_len == 0
    assert set(c.scheduler._producing) == set(c.requests["b"].producing)  # (a's are gone)


def test_a_request_that_cannot_use_the_cache_does_not_wait_for_it():
    c, stage = core(), FakeLastStage()
    prompt = list(range(10, 20))
    c.add("a", prompt, PARAMS)
    c.next_schedule()
    c.add("b", prompt, PARAMS)
    c.add("p", prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0))
    sched = c.next_schedule()
    assert [w.seq_id for w in sched.seqs] == [c.requests["p"].seq_id]  # b waits; p computes it all anyway


def test_a_cache_salt_shares_a_prefix_only_with_requests_of_the_same_salt():
    """vLLM's cache_salt: the same prompt under another salt, or none, finds nothing cached; under the
    same salt it finds the salted blocks; and no schedule carries the salt to a worker."""
    c, stage = core(), FakeLastStage()
    prompt = list(range(10, 20))

    def cached(request_id, salt):
        c.add(request_id, prompt, SamplingParams(max_tokens=3, ignore_eos=True, cache_salt=salt))
        sched = c.next_schedule()
        w = work(c, sched, request_id)
        assert w.params is not None and w.params.cache_salt is None  # (the coordinator keeps it)
        c.process_result(stage(sched))
        return w.context_len

    assert cached("a", "tenant-1") == 0
    assert cached("b", "tenant-2") == 0  # another tenant's salt
    assert cached("c", None) == 0  # no salt: the unsalted blocks, of which there are none yet
    assert cached("d", "tenant-1") == 8  # the same salt: a's two full blocks
    assert cached("e", None) == 8  # c's
    with pytest.raises(ValueError, match="cache_salt must be 1 to 1024 characters"):
        SamplingParams(cache_salt="")


def test_a_chunk_still_in_flight_is_not_shared_though_an_earlier_one_came_back():
    c, stage = core(budget=8), FakeLastStage()
    prompt = list(range(10, 30))  # 20 tokens: chunks of 8
    c.add("a", prompt, PARAMS)
    first, second = c.next_schedule(), c.next_schedule()  # a's chunks [0, 8) and [8, 16) in flight
    assert [work(c, s, "a").context_len for s in (first, second)] == [0, 8]
    c.process_result(stage(first))
    c.add("b", prompt, PARAMS)
    third = c.next_schedule()  # a's last chunk; b waits: [8, 16) is still being written
    assert all(w.seq_id != c.requests["b"].seq_id for w in third.seqs)
    c.process_result(stage(second))
    assert work(c, c.next_schedule(), "b").context_len == 16


def test_admission_counts_the_cached_blocks_it_takes_from_the_free_pool():
    """The only free blocks are cached, unreferenced ones that the waiting request hits: taking them
    uses them up, so it can be admitted only if what it computes fits in what is left."""
    c, stage = core(num_blocks=6), FakeLastStage()
    c.add("a", list(range(10, 19)), SamplingParams(max_tokens=1, ignore_eos=True))  # 3 blocks
    c.add("x", list(range(50, 61)), SamplingParams(max_tokens=2, ignore_eos=True))  # 3 blocks, still running
    run_step(c, stage)
    assert "a" not in c.requests and c.blocks.num_free == 3 and c.blocks.num_cached >= 2
    c.add("b", list(range(10, 19)) + list(range(70, 78)), PARAMS)  # hits a's 2 blocks, needs 3 more
    sched = c.next_schedule()
    assert sched is None or all(w.seq_id != c.requests["b"].seq_id for w in sched.seqs)  # 2 + 3 > 3 free
    assert c.blocks.num_free + sum(len(s.block_ids) for s in c.scheduler.running) == 6


def test_the_last_prompt_token_is_always_computed_and_prompt_logprobs_compute_everything():
    c = core()
    stage = FakeLastStage()
    c.add("a", list(range(10, 18)), PARAMS)  # exactly two full blocks
    run_step(c, stage)
    c.add("b", list(range(10, 18)), PARAMS)
    assert work(c, c.next_schedule(), "b").context_len == 4  # the second block holds the last token
    c.add("c", list(range(10, 18)), SamplingParams(max_tokens=3, prompt_logprobs=1))
    assert work(c, c.next_schedule(), "c").context_len == 0


def test_references_keep_a_shared_block_and_the_last_one_leaves_it_cached():
    m = BlockManager(6, B, enable_caching=True)
    a = seq(0, range(10, 19))
    computed(m, a)
    b = seq(1, range(10, 19))
    hits = m.lookup(b)
    assert hits == a.block_ids[:2] and m.cost(hits) == 0  # still referenced by a: no free block used
    m.take(b, hits)
    m.free(a)
    assert m.num_free == 6 - 2  # b holds two; a's third block went back
    c = seq(2, range(10, 19))
    assert m.lookup(c) == hits
    m.free(b)
    assert m.num_free == 6 and m.num_cached == 2
    assert m.cost(m.lookup(c)) == 2  # unreferenced: taking them uses up free blocks


def test_a_prefix_computed_twice_side_by_side_keeps_both_copies():
    """Two sequences that computed the same prefix at once (neither found the other's blocks cached):
    both copies are cached (as vLLM keeps them), so when the first copy is evicted the second, still
    running, serves the prefix; and once both are gone the hash is forgotten."""
    m = BlockManager(7, B, enable_caching=True)
    a, b = seq(0, range(10, 19)), seq(1, range(10, 19))
    for s in (a, b):
        m.grow(s, s.num_tokens)
    for s in (a, b):  # (both steps come back after both were scheduled)
        s.num_computed = s.num_tokens
        m.cache_computed(s, s.num_tokens)
    assert m.num_cached == 2 and m.lookup(seq(2, range(10, 19))) == a.block_ids[:2]
    m.free(a)  # a's blocks wait in the LRU: the next allocations evict them
    assert m.lookup(seq(7, range(10, 19))) == b.block_ids[:2]  # (the copy b holds: it costs no free block)
    filler = seq(3, range(500, 516))
    m.grow(filler, 16)  # one free block and a's three
    assert m.num_free == 0 and not set(filler.block_ids) & set(b.block_ids)
    c = seq(4, range(10, 19))
    assert m.lookup(c) == b.block_ids[:2] and m.cost(m.lookup(c)) == 0  # b's copy, still referenced
    m.take(c, m.lookup(c))
    m.free(b)
    m.free(c)
    m.free(filler)
    taker = seq(5, range(900, 928))
    m.grow(taker, 28)  # every block: both copies evicted
    assert m.num_cached == 0 and m.lookup(seq(6, range(10, 19))) == []


def test_eviction_takes_the_least_recently_released_block_first():
    m = BlockManager(6, B, enable_caching=True)
    seqs = [seq(i, [100 * (i + 1) + t for t in range(5)]) for i in range(3)]  # a full block and a partial each
    for s in seqs:
        computed(m, s)
    assert m.num_free == 0 and m.num_cached == 3
    for s in (seqs[1], seqs[0], seqs[2]):  # released in this order
        m.free(s)
    new = seq(9, range(500, 517))
    m.grow(new, 17)  # five blocks: the three never cached, then evicts seqs[1]'s and seqs[0]'s
    assert m.num_cached == 1
    assert [bool(m.lookup(seq(7, s.prompt_ids))) for s in seqs] == [False, False, True]


def test_a_preempted_sequence_recomputes_only_what_was_evicted():
    m = BlockManager(8, B, enable_caching=True)
    s = seq(0, range(10, 20))
    s.output_ids = [50, 51, 52]  # recomputed as prompt + output
    computed(m, s)
    m.free(s)
    s.num_computed, s.cache_counted = 0, True  # as preemption leaves a sequence admitted before
    hits = m.lookup(s)
    assert len(hits) == 3  # 12 of 13 tokens, across prompt and output
    m.take(s, hits)
    assert s.num_computed == 12 and s.num_cached_tokens == 0  # counted for a request's first admission only


def test_reset_forgets_every_hash():
    m = BlockManager(4, B, enable_caching=True)
    s = seq(0, range(10, 19))
    computed(m, s)
    m.free(s)
    m.reset_cache()
    assert m.num_cached == 0 and m.num_free == 4 and m.lookup(seq(1, range(10, 19))) == []


def test_without_caching_nothing_is_looked_up_or_kept():
    m = BlockManager(4, B)
    s = seq(0, range(10, 19))
    computed(m, s)
    m.free(s)
    assert m.num_cached == 0 and m.lookup(seq(1, range(10, 19))) == [] and m.queries == 0


# -- through the engine: the cache changes no token --------------------------------------------

SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]
SUFFIXES = [[30, 31], [40, 41, 42, 43, 44, 45], [50], [60, 61, 62, 63], [70, 71, 72, 73, 74, 75, 76, 77, 78]]


def test_penalties_see_the_cached_prefix(tmp_path):
    """The last stage never computes a cached prefix, so the first chunk brings its tokens along:
    repetition and frequency penalties give the same tokens with the cache as without it."""
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings

    build_hf_model("mixtral", tmp_path)
    prompts = [SHARED + s for s in SUFFIXES]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=1.5)
    outs = {}
    for caching in (True, False):
        engine = LLMEngine(EngineSettings(model=str(tmp_path), block_size=4, num_kv_blocks=128,
                                          no_prefix_caching=not caching), progress=False)
        outs[caching] = [o.token_ids for o in engine.generate(prompts[:1], params) + engine.generate(prompts, params)]
        assert (engine.blocks.hits > 0) == caching
    assert outs[True] == outs[False]


def test_prompt_logits_do_not_leave_a_poisoned_cache(tmp_path):
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings

    build_hf_model("llama", tmp_path)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)

    def logprobs(engine):  # of the top five at every step (the chosen token's is ~0 on this model)
        seq = engine.add_request(SHARED + [9], params)
        while engine.core.has_work():
            engine.step()
        return [lp for step in seq.logprobs for _, lp in step.top]

    engine = LLMEngine(EngineSettings(model=str(tmp_path), block_size=4, num_kv_blocks=64), progress=False)
    engine.generate([SHARED], params)
    engine.prompt_logits(list(range(40, 70)))  # scratch blocks 0.. (where SHARED's blocks were)
    fresh = LLMEngine(EngineSettings(model=str(tmp_path), block_size=4, num_kv_blocks=64, no_prefix_caching=True),
                      progress=False)
    assert logprobs(engine) == pytest.approx(logprobs(fresh), abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["plain", "chunked", "preempting"])
def test_greedy_with_the_prefix_cache_equals_without_and_transformers(tmp_path, arch, mode):
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings

    hf = build_hf_model(arch, tmp_path)
    kw = {"plain": dict(num_kv_blocks=128), "chunked": dict(num_kv_blocks=128, max_batched_tokens=7),
          "preempting": dict(num_kv_blocks=24)}[mode]
    prompts = [SHARED + s for s in SUFFIXES]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        engine = LLMEngine(EngineSettings(model=str(tmp_path), block_size=4, no_prefix_caching=not caching, **kw),
                           progress=False)
        first = engine.generate(prompts[:1], params)  # fills the cache with the shared prefix
        rest = engine.generate(prompts[1:] + prompts[:1], params)  # then every prompt again, together
        outs[caching] = [o.token_ids for o in first + rest]
        if caching:
            assert engine.blocks.hits >= 4 * 16  # the four other prompts found 4 blocks of the prefix
            if mode == "preempting":
                assert engine.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]
    want = [hf_greedy(hf, p, 10) for p in prompts]
    assert outs[True] == want[:1] + want[1:] + want[:1]


@pytest.mark.parametrize("seed", range(40))
def test_requests_waiting_for_shared_blocks_always_finish(seed):
    """Random requests over a few shared prefixes, arriving in bursts, with one or two steps in flight,
    small pools (preemption), chunked prefill and aborts: every request ends, no step is empty while
    nothing is in flight, every block the cache hands out was written by a step that came back, and
    nothing is left marked as being computed."""
    import random

    from coordinator.scheduler import Scheduler

    rng = random.Random(seed)
    blocks = BlockManager(rng.randint(12, 40), B, enable_caching=True)
    sched = Scheduler(SchedulerConfig(rng.choice([4, 8, 16, 64]), rng.randint(2, 8), 512), blocks, (0,))
    heads = [[100 * (h + 1) + t for t in range(rng.randint(4, 14))] for h in range(3)]
    todo = [seq(i, rng.choice(heads) + [5000 + 10 * i + t for t in range(rng.randint(0, 6))],
                ) for i in range(rng.randint(6, 16))]
    for s in todo:
        s.params = SamplingParams(max_tokens=rng.randint(1, 5), ignore_eos=True)
    written: dict[int, tuple] = {}  # block -> the tokens a returned step wrote into it
    in_flight, token, rounds, depth = [], 9000, 0, rng.choice([1, 2])
    while todo or sched.has_work():
        for _ in range(rng.randint(0, 3)):
            if todo:
                sched.add(todo.pop(0))
        if rng.random() < 0.05 and sched.running:
            sched.finish(rng.choice(sched.running), "abort")
        step = sched.schedule()
        for item in step.items:
            if item.admitted:  # what it took from the cache holds its tokens' K/V
                for i in range(item.context_len // B):
                    assert written.get(item.seq.block_ids[i]) == tuple(item.seq.tokens(0, (i + 1) * B))
        if step.items:
            in_flight.append((step, [t for t in range(token, token + len(step.items))]))
            token += len(step.items)
        else:
            assert in_flight or not sched.has_work(), "a request waits with nothing in flight"
        if len(in_flight) >= depth or (in_flight and not step.items):
            done, sampled = in_flight.pop(0)
            for item in done.items:  # the K/V of full blocks this step completed
                end = item.context_len + item.num_new
                for i in range(item.context_len // B, end // B):
                    if i < len(item.seq.block_ids) and not item.seq.finished:
                        written[item.seq.block_ids[i]] = tuple(item.seq.tokens(0, (i + 1) * B))
            sched.update(done, [t for item, t in zip(done.items, sampled) if item.sample])
        rounds += 1
        assert rounds < 2000
    assert not sched._producing and blocks.num_free == blocks.num_blocks


def test_a_request_waiting_for_a_prefix_keeps_its_place_in_the_pool():
    """W shares two blocks with P, whose step is in flight, and has a long prompt of its own: it sits out
    that step, but the blocks it needs stay its own, so the unrelated requests behind it (whose
    generations would fill the pool) are admitted only into what is left, and W starts as soon as P's
    step is back (it waited 48 steps for them when they could take its blocks)."""
    from coordinator.scheduler import Scheduler

    blocks = BlockManager(48, B, enable_caching=True)
    sched = Scheduler(SchedulerConfig(512, 256, 2048), blocks, (0,))
    shared = list(range(100, 108))
    p = Sequence(0, shared + [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    w = Sequence(1, shared + list(range(200, 264)), SamplingParams(max_tokens=2, ignore_eos=True))
    xs = [Sequence(2 + i, list(range(1000 * (i + 1), 1000 * (i + 1) + 32)), SamplingParams(max_tokens=24, ignore_eos=True))
          for i in range(4)]
    for s in (p, w, *xs):
        sched.add(s)
    in_flight, steps, first = [], 0, {}
    while sched.has_work() and steps < 500:
        step = sched.schedule()
        steps += 1
        if step.items:
            in_flight.append(step)
        if len(in_flight) >= 2 or (in_flight and not step.items):
            done = in_flight.pop(0)
            sched.update(done, [9 for item in done.items if item.sample])
        for s in (p, w, *xs):
            if s.output_ids:
                first.setdefault(s.seq_id, steps)
    assert first[w.seq_id] <= 4 and w.num_preemptions == 0 and w.num_cached_tokens == 8, first
    assert not sched._producing and blocks.num_free == blocks.num_blocks


def test_a_burst_waiting_for_one_prefix_is_looked_at_a_few_at_a_time():
    """A thousand requests on one long prefix, arriving while it is computed: a schedule passes over at
    most MAX_PASSED of them (each one's lookup hashes its whole prompt), and one it passed is not
    looked up again while the block it waits for is still being computed."""
    from coordinator.scheduler import MAX_PASSED, Scheduler

    blocks = BlockManager(4096, B, enable_caching=True)
    sched = Scheduler(SchedulerConfig(128, 256, 2048), blocks, (0,))
    prompt = list(range(100, 164))  # 16 blocks
    for i in range(200):
        sched.add(Sequence(i, prompt + [5000 + i], SamplingParams(max_tokens=1, ignore_eos=True)))
    first = sched.schedule()
    assert [item.seq.seq_id for item in first.items] == [0]  # (the others wait for its blocks)
    looked = [s for s in sched.waiting if s.block_hashes]
    assert len(looked) == MAX_PASSED
    memo = [s.lookup_memo for s in looked]
    sched.schedule()  # nothing new is hashed: nothing came back
    assert [s.lookup_memo for s in looked] == memo and len([s for s in sched.waiting if s.block_hashes]) == len(looked)
    sched.update(first, [9])
    third = sched.schedule()  # the prefix is cached: the budget's worth of them start, each with 64 tokens cached
    assert third.items and all(item.context_len == 64 for item in third.items)
