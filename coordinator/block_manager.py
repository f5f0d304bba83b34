"""Paged KV-cache bookkeeping: which fixed-size blocks each sequence owns. The workers hold the
blocks; the coordinator decides who uses which."""

from __future__ import annotations

from coordinator.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_new: int) -> int:
        """Blocks `seq` must gain to hold `num_new` more tokens in its cache."""
        return max(0, self.blocks_needed(seq.num_computed + num_new) - len(seq.block_ids))

    def room(self, seq: Sequence) -> int:
        """How many more tokens `seq` could cache with its blocks plus every free one."""
        return (len(seq.block_ids) + len(self._free)) * self.block_size - seq.num_computed

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.extra_blocks(seq, num_new) <= len(self._free)

    def grow(self, seq: Sequence, num_new: int) -> None:
        n = self.extra_blocks(seq, num_new)
        if n > len(self._free):
            raise RuntimeError(f"KV cache exhausted: need {n} blocks, {len(self._free)} free")
        seq.block_ids.extend(self._free.pop() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_ids))
        seq.block_ids = []
