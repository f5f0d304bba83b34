"""Paged KV-cache bookkeeping: which fixed-size blocks each sequence owns, and (prefix caching)
which full blocks already hold the K/V of a given token prefix. The workers hold the blocks; the
coordinator decides who uses which. Block ids are global across stages, so one decision here spares
every stage the prefix's computation.

Prefix caching. A full block is named by a SHA-256 digest chained over its tokens and its parent's:

    h_0 = sha256(tokens[0:B], extra)    h_i = sha256(h_{i-1}, tokens[iB:(i+1)B], extra)

A cryptographic hash, because the name is all a hit checks: with Python's `hash` (not seeded for
integers) a client could craft a prefix that collides with another's and be served its K/V, as in
vLLM's CVE-2025-25183. `extra` is the request's cache salt in its first block (vLLM's `cache_salt`,
so every block of a salted prompt is named apart from the same tokens' unsalted or otherwise salted
ones) and empty in the rest; LoRA adapters or multimodal inputs, which change the K/V of the same
tokens, would go there too. A block gets its hash once the step that filled it has come back, so a
block still being written by a step in flight is never shared (a sequence whose next block is
such a one waits for that step rather than computing it too: Scheduler). A sequence starts with
the longest run of cached blocks its tokens name (never its last token: its logits are needed),
taking a reference on each. A block whose last reference goes keeps its hash and K/V and waits in LRU order;
only when the free pool runs dry is the least recently used one evicted (its hash forgotten) and
handed out again. Two sequences that computed the same prefix side by side both keep their blocks'
hashes (as vLLM does): a lookup takes a copy some sequence holds if there is one, and when one copy
is evicted, another still running or waiting in the LRU serves the prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from coordinator.sequence import Sequence


def block_hash(parent: bytes | None, tokens, extra: bytes = b"") -> bytes:
    """The digest of a full block: its parent's digest, its token ids (8 bytes each), `extra`."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # never-cached blocks; pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, dict[int, None]] = {}  # hash -> the blocks holding it (first: a lookup's)
        self.generation = 0  # changes whenever a hash is added or forgotten (lookups memoise on it)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of which found cached (prefix_cache_hits)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (evicting cached ones if need be)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` must gain to hold `num_new` more tokens in its cache."""
        return max(0, self.blocks_needed(seq.num_computed + num_new) - len(seq.block_ids))

    def room(self, seq: Sequence) -> int:
        """How many more tokens `seq` could cache with its blocks plus every free one."""
        return (len(seq.block_ids) + self.num_free) * self.block_size - seq.num_computed

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.extra_blocks(seq, num_new) <= self.num_free

    def grow(self, seq: Sequence, num_new: int) -> None:
        n = self.extra_blocks(seq, num_new)
        if n > self.num_free:
            raise RuntimeError(f"KV cache exhausted: need {n} blocks, {self.num_free} free")
        seq.block_ids.extend(self._allocate() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        """Drops the sequence's references (its tail first, so that tail blocks are evicted first)."""
        for b in reversed(seq.block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        seq.block_ids = []
        seq.blocks_hashed = 0
        seq.blocks_sent = 0

    def _allocate(self) -> int:
        if self._free:
            b = self._free.pop()
        else:  # evict the least recently used cached block
            b, _ = self._evictable.popitem(last=False)
            copies = self._cached[self._hash[b]]
            del copies[b]
            if not copies:
                del self._cached[self._hash[b]]
            self._hash[b] = None
            self.generation += 1
        self._refs[b] = 1
        return b

    # -- prefix caching ---------------------------------------------------------------------

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of the sequence's first `num_blocks` full blocks (memoised on it)."""
        B, known = self.block_size, seq.block_hashes
        while len(known) < num_blocks:
            i = len(known)
            known.append(block_hash(known[-1] if known else None, seq.tokens(i * B, (i + 1) * B),
                                    b"" if known else seq.cache_salt))
        return known[:num_blocks]

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of the sequence's tokens, leaving its last token to
        compute; nothing is taken yet. Nothing for a sequence that asked for prompt logprobs (its
        whole prompt must run). Memoised on the sequence until the cache changes (a request that
        waits for memory is looked up on every step)."""
        if not self.enable_caching or seq.prompt_logprobs is not None:
            return []
        full = (seq.num_tokens - 1) // self.block_size
        memo = seq.lookup_memo
        if memo is not None and memo[0] == (self.generation, full):
            return list(memo[1])
        hits = []
        for h in self.hashes(seq, full):
            copies = self._cached.get(h)
            if copies is None:
                break
            # (a copy some sequence holds costs no free block; else the first)
            hits.append(next((b for b in copies if self._refs[b]), next(iter(copies))))
        seq.lookup_memo = ((self.generation, full), hits)
        return list(hits)

    def cost(self, hits: list[int]) -> int:
        """Free blocks that taking `hits` uses up (those waiting unreferenced in the LRU)."""
        return sum(1 for b in hits if self._refs[b] == 0)

    def take(self, seq: Sequence, hits: list[int]) -> None:
        """The sequence (owning no blocks yet) starts with `hits`, their tokens already computed."""
        assert not seq.block_ids and seq.num_computed == 0
        for b in hits:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        seq.block_ids = list(hits)
        seq.blocks_hashed = len(hits)
        seq.num_computed = len(hits) * self.block_size
        if self.enable_caching and not seq.cache_counted and seq.prompt_logprobs is None:
            seq.cache_counted = True  # a request's first admission (not a recomputation)
            seq.num_cached_tokens = seq.num_computed
            self.queries += seq.num_tokens
            self.hits += seq.num_computed

    def cache_computed(self, seq: Sequence, num_computed: int) -> None:
        """A step that brought the sequence's cache to `num_computed` tokens has come back: its blocks
        filled by then become shareable (a hash cached by another block too: both copies are kept)."""
        full = min(num_computed // self.block_size, len(seq.block_ids))
        if not self.enable_caching or full <= seq.blocks_hashed:
            return
        hashes = self.hashes(seq, full)
        for i in range(seq.blocks_hashed, full):
            b, h = seq.block_ids[i], hashes[i]
            if self._hash[b] is None:  # (a block taken from the cache has its hash already)
                self._hash[b] = h
                self._cached.setdefault(h, {})[b] = None
                self.generation += 1
        seq.blocks_hashed = full

    def resize(self, num_blocks: int) -> None:
        """A new pool size (the rebuilt pipeline's smallest); only while no sequence holds a block."""
        if any(self._refs):
            raise RuntimeError("the KV pool can change size only while no sequence holds a block")
        queries, hits, generation = self.queries, self.hits, self.generation
        self.__init__(num_blocks, self.block_size, self.enable_caching)
        self.queries, self.hits, self.generation = queries, hits, generation + 1  # (no stale lookup memo)

    def reset_cache(self) -> None:
        """Forgets every hash (the workers' K/V can no longer be trusted, e.g. a stage lost its state);
        unreferenced cached blocks become plain free blocks."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self.generation += 1
