"""Continuous batching: which sequences run in the next step, and how many tokens of each.

Pure policy over `Sequence` objects (no sockets, no tensors):
- Running sequences go first, oldest first: a decode is one token; a prompt still being prefilled
  continues with its next chunk.
- Then waiting sequences are admitted, oldest first, while the step's token budget, the sequence
  limit and the free KV blocks allow. A prompt longer than the remaining budget is prefilled in
  chunks across steps (chunked prefill), so prefills and decodes share every step.
- Prefix caching: a waiting sequence whose first uncached block a running sequence is computing
  sits out until that step comes back, then takes the block from the cache (an `n > 1` request's
  choices, or requests with one system prompt, compute it once); those behind it may go first,
  into the blocks it will not need.
- A prefill chunk shrinks to fit the free blocks. When a running sequence cannot take even one
  token, the newest running sequence newer than it (or it, if it is the newest) is preempted: its
  blocks are freed and it goes back to the front of the queue, to be recomputed from its prompt and
  generated tokens in a later step (no waiting sequence is admitted in a step where the pool ran
  short). A sequence with a step in flight is never the one: where only such stand in the way, the
  sequence waits for them.
- A pipeline keeps several steps in flight. A sequence waiting for the token its step will sample
  has nothing to schedule until that step returns; but a long prompt's next chunk can go out right
  behind the previous one (every stage runs steps in order, so the earlier chunk's K/V is in place
  by the time the next one reads it). Sequences with a step in flight are never preempted.
- Several decode steps in one schedule (`num_steps` > 1, vLLM's multi-step scheduling; a pipeline
  of one stage): when nothing waits, nothing else is in flight and every running sequence decodes,
  the step runs min(num_steps, the fewest tokens any of them may still produce) decode steps, the
  stage feeding each sampled token back itself. Blocks for all of them are taken up front (else it
  is one step); the result is applied step by step, so a sequence that stops early (EOS, a stop
  token) ends where one step at a time would have ended it, its tokens past the stop dropped.
- Speculative decoding (`ngram`, coordinator/ngram.py): a decode of a sequence that samples greedily
  (or, with `ngram.sampled`, without a seed) with nothing that edits or reports its logits carries
  up to `num_tokens` draft tokens after its last one, as far as its record says they pay
  (`_draft_length`), the budget, its blocks, max_tokens and the context allow; the last stage keeps
  the drafts its argmax agrees with (or speculative sampling accepts) plus the token after them,
  and the sequence's cache is taken back to what those tokens computed (the K/V of refused drafts
  is written over later). Drafts stop while more than `max_batch` sequences run: a larger batch has
  less idle bandwidth to check them with.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from coordinator.block_manager import BlockManager
from coordinator.ngram import NgramConfig, NgramIndex
from coordinator.sequence import Sequence, Status
from moemesh.errors import ConfigError


MAX_PASSED = 32  # waiting sequences one schedule passes over while their next block is computed for another


# A draft token is worth its row while the chance that it is kept (every one before it kept too) is at least
# DRAFT_WORTH: on this project's CPU a decode row more costs 0.2-0.3 of a one-row step (docs/benchmarks.md).
# Each sequence's chance per token is what its drafts so far say, the older ones counting DRAFT_DECAY
# less a draft.
DRAFT_WORTH = 0.3
DRAFT_DECAY = 0.9


DRAFT_PROBE = 8  # decodes between drafts of one token where drafts are not worth their rows


def _draft_length(most: int, rate: float) -> int:
    """Draft tokens worth their rows where each is kept with chance `rate` if the one before it was: as
    many as keep rate^i at least DRAFT_WORTH (0 where even the first is not)."""
    k, chance = 0, rate
    while k < most and chance >= DRAFT_WORTH:
        chance *= rate
        k += 1
    return k


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 256
    max_model_len: int = 4096
    num_steps: int = 1  # decode steps one schedule may run (multi-step; a pipeline of one stage)
    ngram: NgramConfig | None = None  # speculative decoding by prompt lookup

    @classmethod
    def for_model(cls, max_num_batched_tokens: int, max_num_seqs: int, requested_len: int | None,
                  model_len: int) -> "SchedulerConfig":
        """The context limit: what was asked for (--max-model-len), else the model's positions; asking
        for more than its positions is a ConfigError (as vLLM refuses it: rotary positions past
        max_position_embeddings were never trained)."""
        if requested_len is not None and requested_len > model_len:
            raise ConfigError(f"--max-model-len {requested_len} is more than the model's {model_len} positions "
                              f"(max_position_embeddings)")
        return cls(max_num_batched_tokens, max_num_seqs, requested_len or model_len)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed in this step
    context_len: int  # tokens already in the cache before it
    sample: bool  # the step reaches the sequence's last token: sample the next one
    admitted: bool = False  # its first chunk since it was admitted (new, or recomputed after preemption)
    draft: tuple[int, ...] = ()  # speculative tokens after its last one (num_new counts them)

    @property
    def token_ids(self) -> list[int]:
        if self.draft:
            return [*self.seq.tokens(self.context_len, self.context_len + 1), *self.draft]
        return self.seq.tokens(self.context_len, self.context_len + self.num_new)


@dataclass
class Step:
    items: list[ScheduledSeq]
    num_steps: int = 1  # > 1: decodes only, each sequence's sampled tokens fed back (see the module)
    drafted: bool = False  # some item carries draft tokens (its result may hold several tokens of it)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.items)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, eos_token_ids: tuple[int, ...] = ()):
        self.config, self.blocks = config, blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.in_flight: Counter[int] = Counter()  # seq id -> its steps not yet returned
        self._producing: Counter[bytes] = Counter()  # hashes of full blocks running sequences are computing
        self.num_preemptions = 0
        self.num_drafts = 0  # decodes with draft tokens, of steps returned
        self.num_drafted = 0  # the draft tokens they carried
        self.num_accepted = 0  # and kept

    def add(self, seq: Sequence) -> None:
        need = len(seq.prompt_ids) + seq.params.max_tokens
        if need > self.config.max_model_len:
            raise ValueError(f"prompt ({len(seq.prompt_ids)} tokens) plus max_tokens ({seq.params.max_tokens}) "
                             f"exceeds the maximum context length of {self.config.max_model_len}")
        if self.blocks.blocks_needed(need - 1) > self.blocks.num_blocks:  # the last token is never cached
            raise ValueError(f"prompt plus max_tokens ({need} tokens) does not fit the KV cache "
                             f"({self.blocks.num_blocks * self.blocks.block_size} tokens)")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_seqs: int | None = None) -> Step:
        """max_seqs: a tighter limit on sequences for this step (to balance microbatches in flight)."""
        max_seqs = min(max_seqs or self.config.max_num_seqs, self.config.max_num_seqs)
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledSeq] = []
        scheduled: set[int] = set()

        short = False  # the pool ran out for a running sequence: nobody new is admitted in this step
        block_size = self.blocks.block_size
        ngram = self.config.ngram
        drafting = ngram is not None and (ngram.max_batch is None or len(self.running) <= ngram.max_batch)
        # (drafts leave a token of the budget to each running sequence after them with one to compute)
        behind = sum(s.num_pending > 0 for s in self.running) if drafting else 0
        drafted = False
        for seq in list(self.running):
            if budget == 0 or len(items) >= max_seqs:
                break
            pending = seq.num_pending
            behind -= pending > 0
            if pending == 0 or seq.status is not Status.RUNNING:
                continue  # awaiting its sampled token, or preempted just now to make room for an older one
            if pending == 1 and drafting and budget > 1 + behind and (draft := self._draft(seq, budget - 1 - behind)):
                items.append(self._take_draft(seq, draft))
                drafted = True
                scheduled.add(seq.seq_id)
                budget -= 1 + len(draft)
                continue
            if pending == 1 and seq.num_computed < len(seq.block_ids) * block_size:
                items.append(self._take(seq, 1))  # a decode with room in its last block (most steps' rows)
                scheduled.add(seq.seq_id)
                budget -= 1
                continue
            # a prefill chunk shrinks to the room left; only what cannot take one token preempts
            n = min(pending, budget, max(1, self.blocks.room(seq)))
            while not self.blocks.can_grow(seq, n):
                short = True
                victim = self._victim(seq, scheduled)
                if victim is None:
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING or not self.blocks.can_grow(seq, n):
                continue
            items.append(self._take(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n

        # after a preemption the pool is short: admit nobody new (nor the victim) in this step
        # waiting[:i] sit this step out, their next block being computed for another sequence; the blocks
        # they will need stay theirs (`held`): those behind them are admitted only into what is left
        i = held = passed = 0
        while not short and i < len(self.waiting) and budget > 0 and len(items) < max_seqs:
            seq = self.waiting[i]
            if seq.awaits is not None and seq.awaits[0] in self._producing:  # (still computed: no lookup)
                hits = None
            else:
                hits = self.blocks.lookup(seq)  # cached blocks of its prefix (it owns none while waiting)
                seq.awaits = self._computing_for_another(seq, hits)
            if seq.awaits is not None:
                held += seq.awaits[1]
                passed += 1
                if passed >= MAX_PASSED:  # (a burst of them: each looked up once, not every one every step)
                    break
                i += 1
                continue
            cached = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            need = self.blocks.blocks_needed(cached + n) - len(hits) + self.blocks.cost(hits)
            if need + held > self.blocks.num_free:
                break
            del self.waiting[i]
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.blocks.take(seq, hits)
            self._produce(seq)
            items.append(self._take(seq, n, admitted=True))
            scheduled.add(seq.seq_id)
            budget -= n
        num_steps = 1
        if self.config.num_steps > 1 and not short and not self.waiting and not self.in_flight:
            num_steps = self._num_steps(items)
        self.in_flight.update(scheduled)
        return Step(items, num_steps, drafted)

    # -- prompts computed once: a sequence whose next uncached block another is computing waits for it

    def _computing_for_another(self, seq: Sequence, hits: list[int]) -> tuple[bytes, int] | None:
        """Whether the first block of `seq` that the cache lacks is one a running sequence will compute
        (one of its full blocks past its cache hits, whose step has not come back, or has not gone out
        yet): then (that block's hash, the free blocks `seq` would take were nothing more of it
        shared). `seq` waits until that step has come back and takes the block from the cache instead
        of computing it a second time: the choices of an `n > 1` request, or requests arriving
        together with one long system prompt, compute their shared prefix once. (Blocks are shared
        only once the step that filled them has come back; BlockManager.) Never for a sequence that
        could not use the cache anyway."""
        if not self._producing or seq.prompt_logprobs is not None:
            return None
        k = len(hits)
        if k >= (seq.num_tokens - 1) // self.blocks.block_size:  # (lookup never takes the last token)
            return None
        h = self.blocks.hashes(seq, k + 1)[k]
        if h not in self._producing:
            return None
        return h, self.blocks.blocks_needed(seq.num_tokens) - k + self.blocks.cost(hits)

    def _produce(self, seq: Sequence) -> None:
        """A sequence just admitted will compute its full blocks past those it took from the cache."""
        if self.blocks.enable_caching:
            seq.producing = self.blocks.hashes(seq, seq.num_tokens // self.blocks.block_size)[seq.blocks_hashed:]
            self._producing.update(seq.producing)

    def _cache_computed(self, seq: Sequence, num_computed: int) -> None:
        """BlockManager.cache_computed, and the blocks it offered to the cache no longer being computed."""
        before = seq.blocks_hashed
        self.blocks.cache_computed(seq, num_computed)
        if seq.producing and seq.blocks_hashed > before:
            self._produced(seq, seq.blocks_hashed - before)

    def _produced(self, seq: Sequence, n: int) -> None:
        done, seq.producing = seq.producing[:n], seq.producing[n:]
        self._producing.subtract(done)
        for h in done:
            if self._producing[h] <= 0:
                del self._producing[h]

    def _free(self, seq: Sequence) -> None:
        """The sequence's blocks back to the pool; whatever it was computing, it computes no more."""
        if seq.producing:
            self._produced(seq, len(seq.producing))
        self.blocks.free(seq)

    def _victim(self, seq: Sequence, scheduled: set[int]) -> Sequence | None:
        """Whom `seq` preempts to grow: the newest running sequence newer than it with no step in flight
        (nor in this one); else `seq` itself if it is the newest that could go and has no step in flight
        (a step in flight would write, and its result mark as cached, blocks given away meanwhile). None
        when only sequences with a step in flight stand in the way: `seq` waits for one to return (to
        preempt it then), rather than an older sequence giving its cache up for a newer one."""
        newer_in_flight = False
        for s in reversed(self.running):
            if s is seq:
                return None if newer_in_flight or seq.seq_id in self.in_flight else seq
            if s.seq_id in self.in_flight:
                newer_in_flight = True
            elif s.seq_id not in scheduled:
                return s
        return None

    def _num_steps(self, items: list[ScheduledSeq]) -> int:
        """How many decode steps this step can run at once: 1 unless it holds every running sequence,
        each decoding; then up to num_steps, no more than any of them may still produce, with the
        blocks for them all taken now."""
        if not items or len(items) != len(self.running) or any(i.num_new != 1 or not i.sample or i.admitted for i in items):
            return 1
        k = min(self.config.num_steps, *(min(i.seq.params.max_tokens - len(i.seq.output_ids),
                                             self.config.max_model_len - i.seq.num_tokens) for i in items))
        if k > 1 and sum(self.blocks.extra_blocks(i.seq, k - 1) for i in items) <= self.blocks.num_free:
            for i in items:
                self.blocks.grow(i.seq, k - 1)
            return k
        return 1

    def _draft(self, seq: Sequence, most: int) -> list[int]:
        """The draft tokens for a decode of `seq`, at most `most`: none unless it samples greedily (its
        argmax alone decides, the same with a draft as without) or, with `ngram.sampled`, without a
        seed (each token kept is drawn from what its row gives it: StageExecutor), with nothing that
        edits or reports its logits, nor past its max_tokens or the context; as long as its record
        says its tokens are worth their rows (`_draft_length`). Drafts take free blocks only while more
        are free than sequences run (each may need one for its next token): a guess never costs
        another sequence its cache."""
        ngram, p = self.config.ngram, seq.params
        if seq.draft_pause:  # its last drafts were all refused: a few plain decodes first
            seq.draft_pause -= 1
            return []
        # (as StageExecutor._plain: a seeded sequence draws by token index, which drafts would change)
        if not ((p.greedy or (ngram.sampled and p.seed is None)) and not p.edits_logits and p.logprobs is None
                and p.grammar is None and len(seq.output_ids) >= p.min_tokens):
            return []
        spare = min(max(0, self.blocks.num_free - len(self.running)), self.blocks.blocks_needed(ngram.num_tokens + 1))
        room = (len(seq.block_ids) + spare) * self.blocks.block_size - seq.num_computed
        # the step samples 1 + len(draft) tokens at most, and writes the K/V of positions up to
        # num_tokens - 1 + len(draft)
        k = _draft_length(ngram.num_tokens, seq.draft_kept / seq.draft_checked)
        if k == 0:  # not worth its rows: one token, now and then, to learn whether that has changed
            k, seq.draft_pause = 1, DRAFT_PROBE
        k = min(k, most, p.max_tokens - len(seq.output_ids) - 1, self.config.max_model_len - seq.num_tokens, room - 1)
        if k <= 0:
            return []
        if seq.ngram is None:
            seq.ngram = NgramIndex(ngram.min_n, ngram.max_n)
        return seq.ngram.propose(seq, k)

    def _take_draft(self, seq: Sequence, draft: list[int]) -> ScheduledSeq:
        """A decode with draft tokens: blocks for all of them now; the sequence counts its last token
        as computed (as a decode does) until the result says how many drafts were right."""
        n = 1 + len(draft)
        self.blocks.grow(seq, n)
        item = ScheduledSeq(seq, n, seq.num_computed, sample=True, draft=tuple(draft))
        seq.num_computed += 1
        return item

    def _take(self, seq: Sequence, n: int, admitted: bool = False) -> ScheduledSeq:
        if seq.num_computed + n > len(seq.block_ids) * self.blocks.block_size:
            self.blocks.grow(seq, n)
        item = ScheduledSeq(seq, n, seq.num_computed, sample=seq.num_computed + n == seq.num_tokens, admitted=admitted)
        seq.num_computed += n  # the cache will hold them once the step has run
        return item

    def requeue_all(self) -> tuple[int, int]:
        """Every running sequence back to waiting (the cache that held them is gone); oldest first,
        ahead of those that were waiting already. Not counted as preemptions.
        -> (sequences, tokens they had in the cache)."""
        running, self.running = self.running, []
        tokens = sum(seq.num_computed for seq in running)
        for seq in running:
            self._free(seq)
            seq.num_computed = 0
            seq.status = Status.WAITING
        self.waiting.extendleft(reversed(running))
        return len(running), tokens

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def update(self, step: Step, sampled: list[int | list[int]]) -> list[Sequence]:
        """Records the tokens sampled for the step's sampling rows (in order; for a row with a draft,
        the list of its tokens kept: the drafts its check accepted and the one after them); returns
        the sequences that finished."""
        finished = []
        tokens = iter(sampled)
        for item in step.items:
            seq = item.seq
            self._returned(seq)
            if item.draft:
                self._accept(item, next(tokens), finished)
                continue
            if not seq.finished:  # its blocks now hold what this step wrote: shareable
                self._cache_computed(seq, item.context_len + item.num_new)
            if not item.sample:
                continue
            token = next(tokens)
            if seq.finished:  # aborted while its step was in flight
                continue
            self._append(seq, token, finished)
        return finished

    def _accept(self, item: ScheduledSeq, kept: list[int], finished: list[Sequence]) -> None:
        """A drafted decode's tokens, one by one (a stop among them ends it there); its cache then holds
        the step's input token and the drafts that were kept."""
        seq = item.seq
        if seq.finished:  # aborted while its step was in flight
            return
        reason, n = None, 0
        for token in kept:
            seq.output_ids.append(token)
            n += 1
            if reason := self._stop_reason(seq):
                break
        # the draft tokens among the n taken: all n where a stop came at a kept draft, else all but the last
        accepted = min(n, len(kept) - 1)
        self.num_drafts += 1
        self.num_drafted += len(item.draft)
        self.num_accepted += accepted
        # the sequence's record: each draft token checked (those kept, and the one refused) and kept
        checked = min(len(item.draft), n)
        seq.draft_checked = DRAFT_DECAY * seq.draft_checked + checked
        seq.draft_kept = DRAFT_DECAY * seq.draft_kept + accepted
        # drafts refused whole, time after time, pause it for 1, 2, 4 ... 16 decodes: where the text stops
        # repeating itself (or samples far from it) its steps stop paying for rows that are not kept
        seq.draft_misses = seq.draft_misses + 1 if accepted == 0 else 0
        # (a probe's pause, set as it went out, stands: nothing counts it down while the step is in flight)
        seq.draft_pause = max(seq.draft_pause, min(16, 1 << (seq.draft_misses - 1)) if seq.draft_misses else 0)
        # its blocks now hold the K/V of the input token and the n - 1 drafts kept: shareable, also where
        # the sequence ends here (its blocks go back to the pool with their hashes)
        seq.num_computed = item.context_len + n
        self._cache_computed(seq, seq.num_computed)
        if reason:
            self.finish(seq, reason)
            finished.append(seq)

    def update_steps(self, step: Step, sampled: list[list[tuple[int, object]]]) -> list[Sequence]:
        """`update` for a step of several decode steps: sampled[j][i], the (token, logprobs or None) of
        step.items[i] in decode step j. Applied step by step: a sequence that stops takes no more."""
        finished = []
        for item in step.items:
            self._returned(item.seq)
        for j, tokens in enumerate(sampled):
            for item, (token, logprobs) in zip(step.items, tokens):
                seq = item.seq
                if seq.finished:  # stopped at an earlier step, or aborted while in flight
                    continue
                if j:  # decode step j computed the token step j - 1 sampled
                    seq.num_computed += 1
                self._cache_computed(seq, seq.num_computed)
                if logprobs is not None:
                    seq.logprobs.append(logprobs)
                self._append(seq, token, finished)
        return finished

    def _returned(self, seq: Sequence) -> None:
        """One of the sequence's steps in flight came back."""
        self.in_flight[seq.seq_id] -= 1
        if self.in_flight[seq.seq_id] <= 0:
            del self.in_flight[seq.seq_id]

    def _append(self, seq: Sequence, token: int, finished: list[Sequence]) -> None:
        """A token sampled for the sequence; it ends (into `finished`) if the token stops it."""
        seq.output_ids.append(token)
        reason = self._stop_reason(seq)
        if reason:
            self.finish(seq, reason)
            finished.append(seq)

    def _stop_reason(self, seq: Sequence) -> str | None:
        p, token, n = seq.params, seq.output_ids[-1], len(seq.output_ids)
        if n >= p.min_tokens and ((token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids):
            return "stop"
        # a structured output's grammar allows EOS only where its text is whole (or where the constraint
        # cannot go on): that ends it whatever min_tokens and ignore_eos say
        if p.grammar is not None and token in self.eos_token_ids:
            return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (also for aborts and errors) and returns its blocks to the pool."""
        if seq.finished:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
