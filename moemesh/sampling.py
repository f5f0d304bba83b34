"""Sampling parameters of a request (they travel to the last stage with the sequence)."""

from __future__ import annotations

import msgspec


MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
MAX_GRAMMAR_CHARS = 1 << 17  # (moemesh/structured.py: the gateway refuses longer ones with a 400)
MAX_LOGIT_BIAS = 1024  # tokens a request may bias (logit_bias)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # (more than any vocabulary)
# bad words a request may give (twice that many token sequences), and tokens in each
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 256, 64
MAX_CACHE_SALT_CHARS = 1024  # (vLLM suggests 43: 256 random bits in base64)
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (dividing float32 logits by less overflows)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None  # same seed, same tokens, whatever else shares the batch
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logprobs: int | None = None  # logprob of each sampled token, with this many top alternatives
    prompt_logprobs: int | None = None  # logprob of each prompt token, with this many alternatives
    grammar: str | None = None  # structured output: an llguidance grammar the text must follow (moemesh/structured.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs added to its logit before sampling
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens are sampled (vLLM's allowed_token_ids)
    # vLLM's bad_words as token sequences: a sequence's last token is banned where the output ends with the
    # rest of it (a one-token word: always)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's cache_salt: the prefix cache shares a prompt's blocks only with requests of the same salt (a
    # tenant's prefixes cannot be probed by another's cached_tokens or latency). The coordinator keeps it:
    # a schedule never carries it to a worker.
    cache_salt: str | None = None

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0 <= self.temperature < float("inf"), "temperature must be a finite number >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.top_k < 1 << 31, "top_k must be in [0, 2^31) (0 turns it off; the HTTP API takes -1 too)"),
            (self.seed is None or 0 <= self.seed < 1 << 63, "seed must be in [0, 2^63)"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids"),
            (all(0 <= t < 1 << 31 for t in self.stop_token_ids), "stop_token_ids must be token ids (>= 0)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 10, "repetition_penalty must be in (0, 10]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.grammar is None or 0 < len(self.grammar) <= MAX_GRAMMAR_CHARS,
             f"grammar must be 1 to {MAX_GRAMMAR_CHARS} characters"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens"),
            (all(0 <= t < 1 << 31 and -100 <= b <= 100 for t, b in self.logit_bias),
             "logit_bias maps token ids (>= 0) to biases in [-100, 100]"),
            (self.allowed_token_ids is None or 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
             f"allowed_token_ids takes 1 to {MAX_ALLOWED_TOKEN_IDS} ids"),
            (self.allowed_token_ids is None or all(0 <= t < 1 << 31 for t in self.allowed_token_ids),
             "allowed_token_ids must be token ids (>= 0)"),
            (len(self.bad_words) <= 2 * MAX_BAD_WORDS
             and all(0 < len(w) <= MAX_BAD_WORD_TOKENS and all(0 <= t < 1 << 31 for t in w) for w in self.bad_words),
             f"bad_words takes at most {2 * MAX_BAD_WORDS} token sequences of 1 to {MAX_BAD_WORD_TOKENS} token ids"),
            (self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS,
             f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        """A temperature too small to sample with in float32 (as vLLM, below 1e-5) is greedy."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def edits_logits(self) -> bool:
        """Whether every step's logits are edited before sampling, whatever the sequence's state (its
        min_tokens and grammar aside): penalties, logit_bias, allowed_token_ids, bad_words."""
        return (self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))
