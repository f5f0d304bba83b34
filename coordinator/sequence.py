"""A request's sequence as the coordinator tracks it: its tokens, how many are in the KV cache,
its blocks, and why it ended. The prompt and generated tokens are always kept, so a sequence can be
recomputed from scratch whenever its cache is lost (preemption, a restarted stage)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from coordinator.ngram import NgramIndex
from moemesh.protocol import TokenLogprobs
from moemesh.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    blocks_sent: int = 0  # leading block_ids the workers have been sent (schedules carry only the rest)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with "error": what the client is told (a structured output that failed)
    num_preemptions: int = 0
    request_id: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of output tokens, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt position, when asked
    num_streamed: int = 0  # output tokens already sent to the client
    arrival: float = 0.0  # time.monotonic() when added
    first_scheduled: float | None = None
    # prefix caching (BlockManager)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks, as far as known
    blocks_hashed: int = 0  # leading blocks of block_ids already offered to the cache
    # running: the hashes of its full blocks it is computing (from block blocks_hashed on); waiting: the
    # hash of its next block, which another is computing, and the free blocks it will need (Scheduler)
    producing: list[bytes] = field(default_factory=list)
    awaits: tuple[bytes, int] | None = None
    num_cached_tokens: int = 0  # prompt tokens found cached at its first admission
    cache_counted: bool = False  # its first admission went into the cache's query and hit counts
    lookup_memo: tuple | None = None  # ((cache generation, full blocks), hits) of its last lookup
    cache_salt: bytes = b""  # its request's cache_salt (UTF-8): hashed into its first block's name
    ngram: NgramIndex | None = None  # speculative decoding's index of its n-grams (coordinator.ngram)
    # its drafts' record (Scheduler._accept): draft tokens kept and checked, decayed (a prior of 3 in 4:
    # drafts of up to 4 tokens at first), drafts refused whole in a row, and decodes left before it drafts again
    draft_kept: float = 3.0
    draft_checked: float = 4.0
    draft_misses: int = 0
    draft_pause: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without copying the whole sequence."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache (the rest of the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
