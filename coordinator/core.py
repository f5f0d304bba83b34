"""The coordinator's logic without sockets: requests in, schedules out, step results in,
per-request outputs out. The mesh coordinator and the in-process engine both drive it.

    core.add(request_id, prompt_ids, params)
    sched = core.next_schedule()          a Schedule for every stage (None: nothing to run now)
    ... the stages run it; the last returns a StepResult ...
    outputs = core.process_result(result) new tokens per request, and their ends
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from coordinator.block_manager import BlockManager
from coordinator.scheduler import Scheduler, SchedulerConfig, Step
from coordinator.sequence import Sequence
from moemesh.layout import MlpHandoff
from moemesh.protocol import RequestOutput, SampledToken, Schedule, SeqWork, StepResult, TokenLogprobs
from moemesh.sampling import SamplingParams


# ended requests whose outputs a client may still ask to have again: at most this many, holding at most
# ENDED_ENTRIES tokens and logprob alternatives in all
ENDED_KEPT = 1024
ENDED_ENTRIES = 1 << 21


def _constraint_failed(seq: Sequence, s: SampledToken, finished: list[Sequence]) -> None:
    """A sequence that the token `s` ended, where its structured output's constraint failed and forced
    that end of sequence: it ends with an error, not as an answer (whatever its text so far)."""
    if s.error is not None and seq in finished and seq.finish_reason == "stop":
        seq.finish_reason = "error"
        seq.error = f"the structured output's constraint failed part way: {s.error}"


@dataclass(frozen=True)
class Ended:
    """What a client that missed a request's last outputs gets again (EngineCore.resend): not its prompt,
    nor its prompt logprobs (a resend that needs them is answered as for a request not known)."""
    output_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    had_prompt_logprobs: bool
    error: str | None = None
    queue_seconds: float | None = None

    @property
    def entries(self) -> int:
        return len(self.output_ids) + sum(1 + len(lp.top) for lp in self.logprobs or ())


def _queue_seconds(seq: Sequence) -> float | None:
    """What a request's first output says of its wait: from its arrival to its first schedule (and
    says again when that output is sent again: a client that missed it gets it whole)."""
    return seq.first_scheduled - seq.arrival if seq.first_scheduled is not None else None


def _kept(draft: tuple[int, ...], got: list[int]) -> bool:
    """Whether a sampling row's tokens in a result are what its step can give: one token, or for a decode
    with a draft, the draft tokens the last stage kept (a prefix of the draft) and one after them."""
    return 1 <= len(got) <= 1 + len(draft) and all(t == d for t, d in zip(got[:-1], draft))


class EngineCore:
    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 eos_token_ids: tuple[int, ...], vocab_size: int, prefix_caching: bool = False,
                 context_limit: int | None = None, handoff: MlpHandoff | None = None):
        """`context_limit`: the model's context (or --max-model-len) where `config` holds less because the KV
        cache does: a pool that changes size (`resize`) moves the limit up to it. `handoff`: the MLP
        hand-off's choice per step (moemesh.layout.MlpHandoff), or None."""
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=prefix_caching)
        self.context_limit = context_limit or config.max_model_len
        self.scheduler = Scheduler(config, self.blocks, eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[str, Sequence] = {}
        self.in_flight: dict[int, Step] = {}
        self.next_step_id = 0  # the id the next schedule gets
        self._seq_ids = itertools.count()
        self._forget: list[int] = []
        # requests that ended, newest last, for a client that missed their last outputs (ResendRequest)
        self.ended: OrderedDict[str, Ended] = OrderedDict()
        self.ended_entries = 0
        self.handoff = handoff
        self.handoff_steps = 0  # steps scheduled with a hand-off

    # -- requests -----------------------------------------------------------------------------

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Raises ValueError with a message for the client when the request cannot be served."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        # (as the gateway refuses them: the sampler leaves out ids past the vocabulary, and allowed_token_ids
        # of those alone would sample from all of it)
        for name, ids in (("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logit_bias", [t for t, _ in params.logit_bias])):
            if (bad := next((t for t in ids if t >= self.vocab_size), None)) is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        salt = params.cache_salt
        if salt is not None:  # (kept here: the workers' schedules never carry it)
            params = msgspec.structs.replace(params, cache_salt=None)
        seq = Sequence(next(self._seq_ids), list(prompt_ids), params, request_id=request_id,
                       arrival=time.monotonic(), cache_salt=salt.encode("utf-8", "surrogatepass") if salt else b"")
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(prompt_ids)
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        return seq

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None,
              status: int = 503) -> RequestOutput | None:
        """Ends a request now (its blocks go back to the pool); None if it is unknown or over. `error`:
        the client's, with its HTTP `status` (503 unless the request itself is to blame)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        self._forget.append(seq.seq_id)
        return RequestOutput(request_id, [], finish_reason=reason, error=error, error_status=status if error else 0,
                             num_prompt_tokens=len(seq.prompt_ids), start=seq.num_streamed)

    def abort_all(self, error: str) -> list[RequestOutput]:
        """Ends every request with an error the client sees as 'service unavailable'."""
        return [out for rid in list(self.requests) if (out := self.abort(rid, "error", error))]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- steps --------------------------------------------------------------------------------

    def next_schedule(self, max_seqs: int | None = None) -> Schedule | None:
        step = self.scheduler.schedule(max_seqs)
        if not step.items:
            return None
        step_id, self.next_step_id = self.next_step_id, self.next_step_id + 1
        self.in_flight[step_id] = step
        seqs = []
        now = time.monotonic()
        for item in step.items:
            seq = item.seq
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            first = item.admitted  # a new or recomputed sequence: its whole table, and its params for the last stage
            new_blocks = seq.block_ids if first else seq.block_ids[seq.blocks_sent:]
            seq.blocks_sent = len(seq.block_ids)
            seqs.append(SeqWork(
                seq.seq_id, item.token_ids, item.context_len, list(new_blocks), item.sample,
                params=seq.params if first else None, prompt_len=len(seq.prompt_ids) if first else 0,
                prompt_ids=seq.prompt_ids if first and seq.prompt_logprobs is not None else None,
                cached_ids=seq.tokens(0, item.context_len) if first and item.context_len else None,
                draft=len(item.draft)))
        forget, self._forget = self._forget, []
        handoff = []
        if self.handoff is not None and step.num_steps == 1:
            # the rows the last stage computes logits of: each sampled one, and the prompt positions of
            # a chunk whose prompt logprobs are wanted (as StageExecutor._sample counts them)
            head_rows = sum(w.sample + w.draft for w in seqs) + sum(
                max(0, min(i.context_len + len(i.token_ids), len(i.seq.prompt_ids) - 1) - i.context_len)
                for i in step.items if i.seq.prompt_logprobs is not None)
            # (a decode with drafts counts as a decode: its rows run as decode rows, and a step of decodes
            # hands no MLP over; in a step with prompt chunks its drafts' rows are left out of the cost)
            handoff = self.handoff.choose([1 if w.draft else len(w.token_ids) for w in seqs], head_rows)
            self.handoff_steps += bool(handoff)
        return Schedule(step_id, seqs, forget, num_steps=step.num_steps, mlp_handoff=handoff)

    def process_result(self, result: StepResult) -> list[RequestOutput]:
        step = self.in_flight.get(result.step_id)
        if step is None:
            raise ValueError(f"result for step {result.step_id}, which is not in flight")
        by_seq = {s.seq_id: s for s in result.sampled}  # (a sequence's last: a drafted one's may be several)
        missing = [item.seq.seq_id for item in step.items if item.sample and item.seq.seq_id not in by_seq]
        if missing:  # refuse before touching any state
            raise ValueError(f"result for step {result.step_id} lacks the tokens of sequences {missing}")
        kept: dict[int, list[int]] = {}  # a step with drafts: each sampling sequence's tokens, in order
        if step.drafted:
            for s in result.sampled:
                kept.setdefault(s.seq_id, []).append(s.token_id)
        if step.drafted and (bad := next((item.seq.seq_id for item in step.items if item.sample and not
                                          _kept(item.draft, kept[item.seq.seq_id])), None)) is not None:
            raise ValueError(f"result for step {result.step_id} holds tokens of sequence {bad} that its draft does not "
                             f"allow (one, or the draft tokens kept and one after them)")
        V = self.vocab_size
        bad = next((t for s in result.sampled for t in (s.token_id, *(a for a, _ in (s.logprobs.top if s.logprobs else ())))
                    if not 0 <= t < V), None)
        if bad is not None:  # (fed back to the first stage, it would fail it again on every recompute)
            raise ValueError(f"result for step {result.step_id} holds token id {bad}, outside the vocabulary")
        prompts = {i.seq.seq_id: len(i.seq.prompt_ids) for i in step.items}
        for pl in result.prompt_logprobs:
            if not 0 <= pl.start <= pl.start + len(pl.logprobs) <= prompts.get(pl.seq_id, -1):
                raise ValueError(f"result for step {result.step_id} holds prompt logprobs of sequence {pl.seq_id} "
                                 f"at positions {pl.start}..{pl.start + len(pl.logprobs)}, outside its prompt")
        if step.num_steps > 1:
            return self._process_steps(step, result)
        del self.in_flight[result.step_id]
        sampled = [by_seq[item.seq.seq_id] for item in step.items if item.sample]
        for item, s in zip((i for i in step.items if i.sample), sampled):
            if s.logprobs is not None and not item.seq.finished:  # (a drafted row reports none)
                item.seq.logprobs.append(s.logprobs)
        for p in result.prompt_logprobs:
            seq = next((i.seq for i in step.items if i.seq.seq_id == p.seq_id), None)
            if seq is not None and seq.prompt_logprobs is not None:
                seq.prompt_logprobs[p.start:p.start + len(p.logprobs)] = p.logprobs
        tokens = [s.token_id for s in sampled]
        if step.drafted:  # (a drafted sequence's tokens kept, as a list)
            tokens = [kept[item.seq.seq_id] if item.draft else t
                      for item, t in zip((i for i in step.items if i.sample), tokens)]
        finished = self.scheduler.update(step, tokens)
        for item, s in zip((i for i in step.items if i.sample), sampled):
            _constraint_failed(item.seq, s, finished)
        outputs = []
        for item in step.items:
            seq = item.seq
            if not self._current(seq) or (not item.sample and seq not in finished):
                continue
            outputs.append(self._output(seq))
        self._ended(finished)
        return outputs

    def _process_steps(self, step: Step, result: StepResult) -> list[RequestOutput]:
        """A result of several decode steps: num_steps x len(items) tokens, step by step."""
        n = len(step.items)
        if len(result.sampled) != step.num_steps * n or any(
                s.seq_id != step.items[i % n].seq.seq_id for i, s in enumerate(result.sampled)):
            raise ValueError(f"result for step {result.step_id} does not hold {step.num_steps} tokens of each of its "
                             f"{n} sequences in order")
        del self.in_flight[result.step_id]
        before = [len(item.seq.output_ids) for item in step.items]
        finished = self.scheduler.update_steps(step, [[(s.token_id, s.logprobs) for s in result.sampled[j * n:(j + 1) * n]]
                                                      for j in range(step.num_steps)])
        for i, item in enumerate(step.items):  # (the token that ended it: its decode step's)
            if (taken := len(item.seq.output_ids) - before[i]) > 0:
                _constraint_failed(item.seq, result.sampled[(taken - 1) * n + i], finished)
        outputs = [self._output(item.seq) for item in step.items if self._current(item.seq)]
        self._ended(finished)
        return outputs

    def _current(self, seq: Sequence) -> bool:
        """Whether `seq` is still its request's (not one aborted while its step was in flight, whose id a
        new request may have taken since)."""
        return self.requests.get(seq.request_id) is seq

    def _ended(self, finished: list[Sequence]) -> None:
        """Sequences a result finished: no longer requests, forgotten by the stages in the next
        schedule, their outputs kept for a resend."""
        for seq in finished:
            if self._current(seq):
                del self.requests[seq.request_id]
            self._forget.append(seq.seq_id)
            self._keep_ended(seq)

    def _keep_ended(self, seq: Sequence) -> None:
        """Keeps what a resend of an ended request needs (its outputs, not its prompt), for the last
        ENDED_KEPT requests."""
        ended = Ended(seq.output_ids, seq.logprobs if seq.params.logprobs is not None else None, seq.finish_reason,
                      len(seq.prompt_ids), seq.num_cached_tokens, seq.prompt_logprobs is not None, seq.error,
                      _queue_seconds(seq))
        if (old := self.ended.pop(seq.request_id, None)) is not None:  # (an id used again)
            self.ended_entries -= old.entries
        if ended.entries > ENDED_ENTRIES:  # (one too big to keep: not at the cost of all the others)
            return
        self.ended[seq.request_id] = ended
        self.ended_entries += ended.entries
        while len(self.ended) > ENDED_KEPT or self.ended_entries > ENDED_ENTRIES:
            self.ended_entries -= self.ended.popitem(last=False)[1].entries

    def resend(self, request_id: str, start: int) -> RequestOutput | None:
        """A request's outputs from token `start` on, as they were sent (a client missed some), and its end
        if it has ended; None for a request not known (ended long ago, or never) or nothing to resend."""
        start = max(0, start)
        if (seq := self.requests.get(request_id)) is not None:
            if start >= seq.num_streamed:
                return None
            wants = seq.params.logprobs is not None
            return RequestOutput(request_id, seq.output_ids[start:seq.num_streamed],
                                 seq.logprobs[start:seq.num_streamed] if wants else None,
                                 seq.prompt_logprobs if start == 0 else None, num_prompt_tokens=len(seq.prompt_ids),
                                 queue_seconds=_queue_seconds(seq) if start == 0 else None,
                                 num_cached_tokens=seq.num_cached_tokens if start == 0 else 0, start=start)
        if (ended := self.ended.get(request_id)) is not None and not (start == 0 and ended.had_prompt_logprobs):
            return RequestOutput(request_id, ended.output_ids[start:],
                                 ended.logprobs[start:] if ended.logprobs is not None else None,
                                 finish_reason=ended.finish_reason, error=ended.error,
                                 error_status=400 if ended.error else 0, num_prompt_tokens=ended.num_prompt_tokens,
                                 queue_seconds=ended.queue_seconds if start == 0 else None,
                                 num_cached_tokens=ended.num_cached_tokens if start == 0 else 0, start=start)
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_ids[seq.num_streamed:]
        logprobs = seq.logprobs[seq.num_streamed:] if seq.params.logprobs is not None else None
        first = seq.num_streamed == 0
        prompt_logprobs = seq.prompt_logprobs if first else None
        start, seq.num_streamed = seq.num_streamed, len(seq.output_ids)
        queue = _queue_seconds(seq) if first else None
        return RequestOutput(seq.request_id, new, logprobs, prompt_logprobs,
                             finish_reason=seq.finish_reason if seq.finished else None,
                             error=seq.error if seq.finished else None, error_status=400 if seq.error else 0,
                             num_prompt_tokens=len(seq.prompt_ids), queue_seconds=queue,
                             num_cached_tokens=seq.num_cached_tokens if first else 0, start=start)

    def fail_in_flight(self) -> None:
        """Forgets every step in flight (their stage died); the sequences stay as they were."""
        self.scheduler.in_flight.clear()
        self.in_flight.clear()

    def _limited(self, config: SchedulerConfig, num_blocks: int) -> SchedulerConfig:
        """A context the KV cache cannot hold could never be served (a chat without max_tokens asks for
        all of it): the limit is the smaller of the model's and what `num_blocks` hold."""
        capacity = num_blocks * self.blocks.block_size + 1  # (a sequence's last token is never cached)
        return dataclasses.replace(config, max_model_len=min(self.context_limit, capacity))

    def resize(self, num_blocks: int) -> list[RequestOutput]:
        """The rebuilt pipeline's pool (a recovery's, while no sequence holds a block): the context
        limit follows it, and a request that no longer fits ends with an error now (it could never be
        admitted, and would hold up every request behind it): a 400, as the same request sent now gets
        (a retry cannot help it). -> those requests' last outputs."""
        self.blocks.resize(num_blocks)
        self.scheduler.config = config = self._limited(self.scheduler.config, num_blocks)
        too_long = [seq.request_id for seq in self.scheduler.waiting if seq.request_id in self.requests and (
            len(seq.prompt_ids) + seq.params.max_tokens > config.max_model_len)]
        return [out for rid in too_long if (out := self.abort(
            rid, "error", f"the rebuilt pipeline's KV cache holds {config.max_model_len - 1} tokens, fewer than "
                          f"this request's prompt plus max_tokens", status=400))]

    def requeue_all(self) -> tuple[int, int]:
        """A stage lost its KV state: forget the steps in flight and every cached prefix, and put
        every running sequence back in the waiting queue (oldest first, ahead of the new ones) to be
        recomputed as prompt + output, as after a preemption; the tokens it already has are kept, so
        its stream goes on with the next one. -> (sequences put back, tokens of theirs that were in
        the cache)."""
        self.fail_in_flight()
        n = self.scheduler.requeue_all()
        self.blocks.reset_cache()
        self._forget.clear()  # the stages forget every sequence on the reset anyway
        return n
