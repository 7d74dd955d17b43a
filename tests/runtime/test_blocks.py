"""Block allocation, reference counts and prefix sharing (spectoolkit.runtime.blocks, DESIGN §2, §6)."""

from __future__ import annotations

import pytest

from spectoolkit.errors import SpecToolkitError
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable

SIZE = 4


def _table(allocator: BlockAllocator, tokens: list[int], committed: int) -> BlockTable:
    """A table with slots for ``tokens`` whose first ``committed`` positions are committed and published."""
    table = BlockTable(allocator)
    table.ensure(len(tokens))
    table.publish_committed(tokens, committed)
    return table


def test_allocation_is_lowest_first():
    allocator = BlockAllocator(6, SIZE)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2]
    allocator.free(1)
    allocator.free(0)
    assert allocator.allocate() == 0
    assert allocator.allocate() == 1
    assert allocator.allocate() == 3
    assert allocator.num_free == 2


def test_lone_table_is_contiguous_and_slots_follow_blocks():
    allocator = BlockAllocator(8, SIZE)
    other = BlockTable(allocator)
    other.ensure(SIZE)  # block 0
    table = BlockTable(allocator)
    table.ensure(2 * SIZE)  # blocks 1, 2
    assert table.blocks == [1, 2]
    assert table.contiguous(2 * SIZE) == SIZE
    assert table.slots(SIZE - 1, SIZE + 2) == [2 * SIZE - 1, 2 * SIZE, 2 * SIZE + 1]
    other.ensure(2 * SIZE)  # block 3 for the other table
    table.ensure(3 * SIZE)  # block 4: table is now [1, 2, 4]
    assert table.blocks == [1, 2, 4]
    assert table.contiguous(3 * SIZE) is None
    assert table.slots(3 * SIZE - 1, 3 * SIZE) == [5 * SIZE - 1]


def test_refcounts_and_double_free():
    allocator = BlockAllocator(2, SIZE)
    block = allocator.allocate()
    assert allocator.refcount(block) == 1
    allocator.free(block)
    assert allocator.refcount(block) == 0
    with pytest.raises(RuntimeError, match="freed more often"):
        allocator.free(block)


def test_shared_block_survives_one_release_and_is_freed_by_the_second():
    allocator = BlockAllocator(8, SIZE)
    tokens = list(range(10, 10 + 2 * SIZE + 1))
    first = _table(allocator, tokens, 2 * SIZE)
    second = BlockTable(allocator)
    assert second.share_prefix(tokens, len(tokens) - 1) == 2 * SIZE
    assert second.blocks == first.blocks[:2]
    shared = list(second.blocks)
    assert [allocator.refcount(b) for b in shared] == [2, 2]
    free_before = allocator.num_free
    first.release()
    assert [allocator.refcount(b) for b in shared] == [1, 1]
    assert allocator.num_free == free_before + 1  # only first's unshared third block came back
    fresh = [allocator.allocate() for _ in range(allocator.num_free)]
    assert not set(fresh) & set(shared), "a block still referenced was handed out again"
    for block in fresh:
        allocator.free(block)
    third = BlockTable(allocator)  # the prefix is still live through the second table
    assert third.share_prefix(tokens, len(tokens) - 1) == 2 * SIZE
    third.release()
    second.release()
    assert [allocator.refcount(b) for b in shared] == [0, 0]
    assert allocator.num_free == allocator.num_blocks
    assert BlockTable(allocator).share_prefix(tokens, len(tokens) - 1) == 0, "a freed block is still published"


def test_prefix_matching_follows_the_hash_chain():
    allocator = BlockAllocator(16, SIZE)
    tokens = list(range(100, 100 + 3 * SIZE))
    _table(allocator, tokens, 3 * SIZE)
    same_second_block = [7] * SIZE + tokens[SIZE:]  # block 2 equal, block 1 different: no match at all
    assert BlockTable(allocator).share_prefix(same_second_block, len(tokens)) == 0
    diverges_in_second = tokens[:SIZE] + [7] * (2 * SIZE)
    partial = BlockTable(allocator)
    assert partial.share_prefix(diverges_in_second, len(tokens)) == SIZE
    assert partial.published == 1


def test_share_prefix_never_covers_the_limit_position():
    """The scheduler passes limit = len(prompt) - 1: the last prompt token is always recomputed (its logits)."""
    allocator = BlockAllocator(8, SIZE)
    tokens = list(range(50, 50 + 2 * SIZE))  # exactly two full blocks
    _table(allocator, tokens, 2 * SIZE)
    table = BlockTable(allocator)
    covered = table.share_prefix(tokens, len(tokens) - 1)
    assert covered == SIZE
    assert covered <= len(tokens) - 1
    assert BlockTable(allocator).share_prefix(tokens, len(tokens)) == 2 * SIZE


def test_only_full_committed_blocks_are_published():
    allocator = BlockAllocator(8, SIZE)
    tokens = list(range(3 * SIZE))
    table = _table(allocator, tokens, 2 * SIZE - 1)  # the second block is not fully committed
    assert table.published == 1
    assert BlockTable(allocator).share_prefix(tokens, len(tokens)) == SIZE
    table.publish_committed(tokens, 2 * SIZE)
    assert table.published == 2


def test_truncate_frees_blocks_past_the_length_but_never_a_published_one():
    allocator = BlockAllocator(8, SIZE)
    tokens = list(range(4 * SIZE))
    table = _table(allocator, tokens, 2 * SIZE)
    assert len(table.blocks) == 4 and table.published == 2
    table.truncate(3 * SIZE - 1)
    assert len(table.blocks) == 3
    table.truncate(1)  # below the published prefix: the published blocks stay
    assert len(table.blocks) == 2
    assert [allocator.refcount(b) for b in table.blocks] == [1, 1]
    assert allocator.num_free == 6
    table.truncate(0)
    assert len(table.blocks) == 2


def test_release_frees_everything_and_forgets_the_prefix():
    allocator = BlockAllocator(8, SIZE)
    tokens = list(range(3 * SIZE))
    table = _table(allocator, tokens, 2 * SIZE)
    table.release()
    assert table.blocks == [] and table.published == 0 and table.prefix_hash is None
    assert allocator.num_free == allocator.num_blocks
    table.ensure(SIZE)  # reusable: a preempted sequence starts again from nothing
    assert table.blocks == [0]


def test_exhaustion_raises_our_error():
    allocator = BlockAllocator(2, SIZE)
    table = BlockTable(allocator)
    assert table.missing(3 * SIZE) == 3
    table.ensure(2 * SIZE)
    assert allocator.num_free == 0
    with pytest.raises(SpecToolkitError, match="exhausted"):
        allocator.allocate()
    with pytest.raises(SpecToolkitError):
        table.ensure(2 * SIZE + 1)


def test_reset_returns_every_block_and_clears_the_index():
    allocator = BlockAllocator(4, SIZE)
    tokens = list(range(2 * SIZE))
    _table(allocator, tokens, 2 * SIZE)
    allocator.reset()
    assert allocator.num_free == 4
    assert BlockTable(allocator).share_prefix(tokens, len(tokens)) == 0


@pytest.mark.parametrize("blocks, size", [(0, 4), (4, 0)])
def test_empty_pool_is_refused(blocks, size):
    with pytest.raises(SpecToolkitError, match=">= 1 block"):
        BlockAllocator(blocks, size)
