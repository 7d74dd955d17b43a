"""Fixed-size KV blocks: allocation, reference counts, and sharing of full prefix blocks (prefix caching).

A block holds ``block_size`` consecutive positions of one sequence; a sequence's *block table* lists
its blocks in position order, so position ``p`` lives in slot ``table[p // block_size] * block_size +
p % block_size`` of the pool (vLLM's slot mapping). A block whose every position is committed can be
published under the hash of the whole token prefix it ends (a SHA-256 chain over blocks, as vLLM's
prefix caching): a later sequence with the same prefix takes a reference instead of recomputing it.
A published block is never written again — its positions lie below every sharer's committed length —
so sharing needs no copy-on-write. Freeing drops one reference; a block nothing references is free.

Without ``cache`` a freed block leaves the prefix index at once. With it (automatic prefix caching across
requests), a freed *published* block keeps its KV and its place in the index, evictable: it is handed out again
only when no never-published block is free, least recently freed first (a sequence frees its blocks last to first,
so a prefix's tail goes before its head), and leaves the index then. Cached blocks count as free: they never hold
a reservation back. Free blocks are handed out lowest first, so a lone sequence gets consecutive blocks (its KV is
then one slice of the pool, read without a gather).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from spectoolkit.errors import SpecToolkitError

PrefixHash = bytes


def chain_hash(previous: PrefixHash | None, block_tokens: Sequence[Hashable]) -> PrefixHash:
    """The hash of a prefix ending with ``block_tokens`` (token ids, or tuples of them), given the hash of the
    prefix before it: SHA-256, so two different prefixes never meet in practice (a collision would serve another
    prompt's KV)."""
    return hashlib.sha256((previous or b"") + repr(tuple(block_tokens)).encode()).digest()


class BlockAllocator:
    """``num_blocks`` blocks of ``block_size`` slots, reference-counted; ``cache``: freed published blocks stay
    findable until their slots are needed (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, cache: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise SpecToolkitError(f"a KV pool needs >= 1 block of >= 1 slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        self._free = list(range(num_blocks))  # a heap: lowest block first (never published, or evicted)
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced published blocks, least recent first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, PrefixHash] = {}  # published block -> prefix hash
        self._block_of: dict[PrefixHash, int] = {}  # prefix hash -> published block

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-published ones and cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a published prefix's KV."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self) -> int:
        """A fresh block with one reference (a cached one evicted, least recent first, when no other is free);
        raises when none is free (callers check ``num_free``)."""
        if self._free:
            block = heapq.heappop(self._free)
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise SpecToolkitError("KV blocks exhausted")  # the scheduler preempts before this happens
        self._refs[block] = 1
        return block

    def share(self, prefix: PrefixHash) -> int | None:
        """A reference to the published block ending ``prefix`` (live, or cached), or None if there is none."""
        block = self._block_of.get(prefix)
        if block is not None:
            self._cached.pop(block, None)
            self._refs[block] += 1
        return block

    def publish(self, block: int, prefix: PrefixHash) -> None:
        """Make a full, committed block findable by the hash of the prefix it ends (first one wins)."""
        if prefix not in self._block_of and block not in self._hash_of:
            self._block_of[prefix] = block
            self._hash_of[block] = prefix

    def free(self, block: int) -> None:
        """Drop one reference; with none left the block is free again (cached, if published and ``cache``)."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than referenced")
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if self.cache and block in self._hash_of:
            self._cached[block] = None
            return
        prefix = self._hash_of.pop(block, None)
        if prefix is not None:
            del self._block_of[prefix]
        heapq.heappush(self._free, block)

    def drop_cached(self) -> None:
        """Forget every cached block (an engine reset: no later run inherits this one's KV)."""
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            heapq.heappush(self._free, block)

    def reset(self) -> None:
        self.__init__(self.num_blocks, self.block_size, self.cache)


class BlockTable:
    """One sequence's blocks in position order, and how many of its leading blocks are published."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.blocks: list[int] = []
        self.published = 0  # blocks[:published] are full, committed and in the prefix index
        self.prefix_hash: PrefixHash | None = None  # hash of the prefix the published blocks cover

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.allocator.block_size)

    def missing(self, num_positions: int) -> int:
        """Blocks still to allocate so positions [0, num_positions) have slots."""
        return max(0, self.blocks_for(num_positions) - len(self.blocks))

    def ensure(self, num_positions: int) -> None:
        """Allocate blocks until positions [0, num_positions) have slots (check ``missing`` first)."""
        for _ in range(self.missing(num_positions)):
            self.blocks.append(self.allocator.allocate())

    def truncate(self, num_positions: int) -> None:
        """Free the blocks wholly past position ``num_positions`` (never a published one)."""
        keep = max(self.blocks_for(num_positions), self.published)
        while len(self.blocks) > keep:
            self.allocator.free(self.blocks.pop())

    def release(self) -> None:
        """Free every block (a finished or preempted sequence)."""
        while self.blocks:
            self.allocator.free(self.blocks.pop())
        self.published, self.prefix_hash = 0, None

    def share_prefix(self, tokens: list[int], limit: int) -> int:
        """Take references to published blocks matching ``tokens``' leading full blocks, covering at most
        ``limit`` positions; returns the positions covered (their KV is already computed)."""
        size = self.allocator.block_size
        while (len(self.blocks) + 1) * size <= limit:
            start = len(self.blocks) * size
            prefix = chain_hash(self.prefix_hash, tuple(tokens[start : start + size]))
            block = self.allocator.share(prefix)
            if block is None:
                break
            self.blocks.append(block)
            self.published, self.prefix_hash = len(self.blocks), prefix
        return len(self.blocks) * size

    def publish_committed(self, tokens: list[int], num_committed: int) -> None:
        """Publish the blocks that became full and committed (positions < ``num_committed``)."""
        size = self.allocator.block_size
        while (self.published + 1) * size <= num_committed and self.published < len(self.blocks):
            start = self.published * size
            self.prefix_hash = chain_hash(self.prefix_hash, tuple(tokens[start : start + size]))
            self.allocator.publish(self.blocks[self.published], self.prefix_hash)
            self.published += 1

    def slots(self, start: int, end: int) -> list[int]:
        """Pool slots of positions [start, end)."""
        size = self.allocator.block_size
        return [self.blocks[p // size] * size + p % size for p in range(start, end)]

    def slots_at(self, positions: list[int]) -> list[int]:
        """Pool slots of any ``positions`` (each below the covered length)."""
        size = self.allocator.block_size
        return [self.blocks[p // size] * size + p % size for p in positions]

    def contiguous(self, num_positions: int) -> int | None:
        """The first slot if positions [0, num_positions) lie in consecutive pool slots, else None."""
        count = self.blocks_for(num_positions)
        first = self.blocks[0] if count else 0
        if all(self.blocks[j] == first + j for j in range(count)):
            return first * self.allocator.block_size
        return None
