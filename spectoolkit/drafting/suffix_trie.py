"""A suffix trie of token sequences with occurrence counts: the index suffix decoding drafts from.

The trie holds every substring of its sequences up to ``depth`` tokens, each node counting how many times
its substring occurs (over all sequences, with multiplicity). That is a suffix tree truncated at ``depth``
(SuffixDecoding, Oliaro et al. 2024; ArcticInference), kept as plain nodes: appending one token to a
sequence extends each of its last ``depth`` open suffixes by one node (``O(depth)``), so a request's
trie grows with its output at no more than that per token; removing a sequence decrements the same
nodes and drops those that reach zero, so the trie after a removal equals one built without it.

A continuation of a context is read from the node of its longest suffix that occurs *with* a following
token (an occurrence at the very end of a sequence has none): the child of count c under a node of
count n has probability c / n, and a draft scores the sum of its tokens' path probabilities, the
expected number of tokens it gets accepted if the counts were the truth.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


class Node:
    """A substring's occurrence count and its one-token extensions (a plain slotted class: a request's prompt
    creates thousands at once, and these are cheaper to make than a dataclass's: with the heap frozen a 400-token
    prompt indexed 32 deep took 5.2-5.9 ms against 6.1-10.2)."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


@dataclass
class Continuation:
    """What a trie proposes: a tree (``parents`` -1 for the root's children) and its score."""

    token_ids: list[int]
    parents: list[int]
    score: float  # sum of the drafted tokens' path probabilities


class SuffixTrie:
    """Substrings (up to ``depth`` tokens) of the sequences added to it, with their counts."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.root = Node()
        self._open: list[Node] = []  # extend(): the nodes of the grown sequence's suffixes, by length 1, 2, ...

    def add(self, tokens: list[int]) -> None:
        """Count every substring of ``tokens`` (one more occurrence each)."""
        self._walk(tokens, +1)

    def remove(self, tokens: list[int]) -> None:
        """Undo :meth:`add` of the same ``tokens``: the trie becomes what it would be without them."""
        self._walk(tokens, -1)

    def _walk(self, tokens: list[int], sign: int) -> None:
        for start in range(len(tokens)):
            node = self.root
            node.count += sign
            for token in tokens[start : start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += sign
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the one sequence this trie grows (a request's prompt and output): each new token
        extends the open suffixes (lengths 1 .. depth - 1) that end before it, ``O(depth)`` per token. The counts
        are those :meth:`add` of the whole sequence gives."""
        root, opened, keep = self.root, self._open, self.depth - 1
        for token in tokens:
            root.count += 1
            grown = []
            for node in (root, *opened):
                children = node.children
                child = children.get(token)
                if child is None:
                    child = children[token] = Node()
                child.count += 1
                grown.append(child)
            opened = grown[:keep]
        self._open = opened

    def node(self, tokens: list[int]) -> Node | None:
        """The node of substring ``tokens`` (None: it does not occur)."""
        node = self.root
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def match(self, context: list[int], max_len: int) -> tuple[Node | None, int]:
        """(node, length) of the longest suffix of ``context`` (at most ``max_len`` and ``depth - 1`` tokens)
        that occurs followed by a token; (None, 0) if even its last token never does. Such suffixes nest (a
        shorter one occurs wherever a longer one does), so lengths are tried upward until one fails."""
        best, length = None, 0
        for size in range(1, min(max_len, self.depth - 1, len(context)) + 1):
            node = self.node(context[len(context) - size :])
            if node is None or not node.children:
                break
            best, length = node, size
        return best, length

    def match_end(self, max_len: int) -> tuple[Node | None, int]:
        """:meth:`match` of the sequence this trie grows (:meth:`extend`), read off its open suffixes' nodes instead
        of walking each suffix from the root (a hybrid asks every request every step: 16 walks of up to 16 tokens
        took most of its 70 µs a request at c16). For a trie grown by :meth:`extend` only (a removal may drop them)."""
        best, length = None, 0
        for size, node in enumerate(self._open[: max(0, min(max_len, self.depth - 1))], start=1):
            if not node.children:
                break
            best, length = node, size
        return best, length

    def continuation(self, node: Node, max_tokens: int, min_prob: float, tree_nodes: int = 0) -> Continuation:
        """Draft from ``node``: a chain of most frequent children (``tree_nodes`` 0) or, best first by path
        probability, a tree of up to ``tree_nodes`` nodes; tokens ``max_tokens`` deep at most, each child's
        probability given its parent at least ``min_prob``. Ties go to the smaller token id."""
        token_ids: list[int] = []
        parents: list[int] = []
        score = 0.0
        if not tree_nodes:
            prob = 1.0
            while len(token_ids) < max_tokens and node.children:
                token, child = min(node.children.items(), key=lambda item: (-item[1].count, item[0]))
                if child.count / node.count < min_prob:
                    break
                prob *= child.count / node.count
                parents.append(len(token_ids) - 1)
                token_ids.append(token)
                score += prob
                node = child
            return Continuation(token_ids, parents, score)
        frontier: list[tuple[float, int, int, int, Node, int]] = []  # (-prob, depth, token, tie, node, parent)
        order = 0

        def push(parent_node: Node, prob: float, depth: int, parent: int) -> None:
            nonlocal order
            if depth >= max_tokens:
                return
            for token, child in parent_node.children.items():
                step = child.count / parent_node.count
                if step >= min_prob:
                    order += 1
                    heapq.heappush(frontier, (-prob * step, depth, token, order, child, parent))

        push(node, 1.0, 0, -1)
        while frontier and len(token_ids) < tree_nodes:
            neg_prob, depth, token, _, child, parent = heapq.heappop(frontier)
            parents.append(parent)
            token_ids.append(token)
            score += -neg_prob
            push(child, -neg_prob, depth + 1, len(token_ids) - 1)
        return Continuation(token_ids, parents, score)
