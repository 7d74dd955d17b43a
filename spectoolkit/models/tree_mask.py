"""Positions and attention mask of a token-tree forward (SpecInfer's tree attention).

A tree forward writes its n new tokens at consecutive cache slots [start, start+n), but a token's
*position* is its depth: prefix length + number of ancestors. Each token attends the committed
prefix [0, base) (base <= start: slots in between hold earlier tree tokens), its ancestors' slots,
and itself — never a sibling or a cousin. A chain is the special case where every token's ancestors
are all the tokens before it.
"""

from __future__ import annotations

import torch


def tree_rows(ancestor_slots: list[list[int]], base: int, start: int) -> tuple[list[int], torch.Tensor]:
    """(positions [n], visible [n, start+n] bool) for n tokens written at slots [start, start+n).

    ``ancestor_slots[i]``: the cache slots (each in [base, start+i)) of token i's ancestors beyond the
    prefix [0, base), in any order.
    """
    count = len(ancestor_slots)
    visible = torch.zeros(count, start + count, dtype=torch.bool)
    visible[:, :base] = True
    positions = []
    for row, slots in enumerate(ancestor_slots):
        if any(not base <= slot < start + row for slot in slots):
            raise ValueError(f"row {row}: ancestor slots {slots} outside [{base}, {start + row})")
        visible[row, slots] = True
        visible[row, start + row] = True
        positions.append(base + len(slots))
    return positions, visible


def verify_rows(parents: list[int], start: int) -> tuple[list[int], torch.Tensor]:
    """Rows of a target verify forward over [root] + n nodes (parents as in a ``TokenTree``), root at ``start``."""
    ancestors: list[list[int]] = [[]]  # the root (pending token) sees the prefix and itself
    for parent in parents:
        ancestors.append([*ancestors[parent + 1], start + parent + 1])  # parent's row is parent + 1
    return tree_rows(ancestors, start, start)
