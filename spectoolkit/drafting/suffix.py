"""Suffix decoding: draft the most frequent continuation of the context's longest matching suffix.

SuffixDecoding (Oliaro et al. 2024; ArcticInference, in vLLM as ``method: suffix``): every request has a
suffix trie over its prompt and output (:class:`~spectoolkit.drafting.suffix_trie.SuffixTrie`, grown as
tokens are verified), and one global trie holds the outputs of earlier requests (at most
``cache_tokens`` tokens, oldest evicted). Each round, for each trie, the longest suffix of the context
that occurs followed by a token (``min_match`` to ``max_match`` tokens) is found and continued by frequency: a
chain of most frequent children, or with a tree (``speculate.tree``, any kind) the best-first tree of
the most probable paths; a child is drafted only while its probability given its parent is at least
``min_prob``, and no deeper than ``factor`` × the match length (a short match is weak evidence). The
trie whose draft scores higher (the sum of its path probabilities: its expected accepted tokens)
proposes. A proposal is deterministic: when sampling, q is one-hot at each drafted token, which keeps the
stochastic acceptance test exact; the draft only proposes, so exactness never depends on it.

A request never reads an earlier answer to its own prompt: when a request with a prompt already in the
global trie starts, that entry leaves the trie (a benchmark's repeats would otherwise be served their
own previous output).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.base import Budget, Drafter, Drafting, Lookup
from spectoolkit.drafting.suffix_trie import Continuation, SuffixTrie
from spectoolkit.drafting.tree import TokenTree


@dataclass(frozen=True)
class SuffixSettings:
    """``depth``: longest substring indexed; ``max_match``: longest context suffix matched (< depth); ``min_match``:
    shortest match drafted from (a one-token match drafts often and is rejected often);
    ``factor``: draft tokens per matched token; ``min_prob``: least conditional probability drafted;
    ``cache_tokens``: the global trie's size in output tokens (0: no global trie)."""

    depth: int = 32
    max_match: int = 16
    min_match: int = 2
    factor: float = 1.0
    min_prob: float = 0.1
    cache_tokens: int = 65536


@dataclass(eq=False)
class _Request:
    seq: Drafting  # held so its id is not reused while the state lives
    trie: SuffixTrie
    indexed: int  # tokens of seq.tokens in the trie
    prompt_len: int


class SuffixDrafter(Lookup, Drafter):
    """Proposes continuations from each request's own suffix trie and a global trie of earlier outputs."""

    def __init__(
        self, settings: SuffixSettings, target_vocab_size: int, one_hot_probs: bool,
        tree: TreeConfig | None = None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.target_vocab_size, self.one_hot_probs = target_vocab_size, one_hot_probs
        self.name = "suffix"
        self.tree = tree if tree is not None and tree.enabled else None
        self._requests: dict[int, _Request] = {}
        self.cache = SuffixTrie(settings.depth)  # earlier requests' outputs
        self._entries: deque[tuple[tuple[int, ...], list[int]]] = deque()  # (prompt, output), oldest first
        self._cached = 0

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        return [self._one(seq, budget) for seq, budget in zip(seqs, budgets, strict=True)]

    def _one(self, seq: Drafting, budget: Budget) -> TokenTree:
        return self.scored(seq, budget)[0]

    def scored(self, seq: Drafting, budget: Budget) -> tuple[TokenTree, float]:
        """``seq``'s proposal and its score: the sum of its nodes' path probabilities (the tokens it expects kept)."""
        state = self._state(seq)
        if budget.nodes <= 0 or budget.depth <= 0:
            return TokenTree([], []), 0.0
        best: Continuation | None = None
        longest = self.settings.max_match
        own = state.trie.match_end(longest)  # grown to seq.tokens by _state: its open suffixes are the context's
        for trie, (node, length) in ((state.trie, own), (self.cache, self.cache.match(seq.tokens, longest))):
            if node is None or length < self.settings.min_match:
                continue
            deepest = min(budget.depth, max(1, int(self.settings.factor * length)))
            if self.tree is None:
                found = trie.continuation(node, min(deepest, budget.nodes), self.settings.min_prob)
            else:
                found = trie.continuation(node, min(deepest, budget.depth), self.settings.min_prob, budget.nodes)
            if found.token_ids and (best is None or found.score > best.score):
                best = found
        if best is None:
            return TokenTree([], []), 0.0
        return self.proposal(best.token_ids, best.parents, seq), best.score

    def _state(self, seq: Drafting) -> _Request:
        """The request's trie, grown to every verified token (its first sight: its prompt leaves the cache)."""
        state = self._requests.get(id(seq))
        if state is None:
            prompt_len = seq.prompt_len
            state = self._requests[id(seq)] = _Request(seq, SuffixTrie(self.settings.depth), 0, prompt_len)
            self._forget_prompt(tuple(seq.tokens[:prompt_len]))
        state.trie.extend(seq.tokens[state.indexed :])
        state.indexed = len(seq.tokens)
        return state

    def release(self, seq: Drafting) -> None:
        """``seq`` is done: its output joins the global trie (oldest outputs leave past ``cache_tokens``)."""
        state = self._requests.pop(id(seq), None)
        if state is None or not self.settings.cache_tokens:
            return
        prompt, output = tuple(seq.tokens[: state.prompt_len]), list(seq.tokens[state.prompt_len :])
        if not output:
            return
        self._forget_prompt(prompt)
        self.cache.add(output)
        self._entries.append((prompt, output))
        self._cached += len(output)
        while self._cached > self.settings.cache_tokens:
            _, oldest = self._entries.popleft()
            self.cache.remove(oldest)
            self._cached -= len(oldest)

    def _forget_prompt(self, prompt: tuple[int, ...]) -> None:
        """Drop every cached output of this very prompt."""
        kept = deque()
        for entry in self._entries:
            if entry[0] == prompt:
                self.cache.remove(entry[1])
                self._cached -= len(entry[1])
            else:
                kept.append(entry)
        self._entries = kept

    def reset(self) -> None:
        """Free every request's trie and the global one."""
        self._requests.clear()
        self._entries.clear()
        self._cached = 0
        self.cache = SuffixTrie(self.settings.depth)

    def describe_tree(self) -> str | None:
        return f"suffix/{self.tree.max_nodes}" if self.tree is not None else None

    def variant(self, stop_below: float | None, tree: TreeConfig | None) -> SuffixDrafter:
        """``stop_below`` is a draft model's rule: lookup has no probabilities to stop on."""
        if (tree if tree is not None and tree.enabled else None) == self.tree:
            return self
        return type(self)(self.settings, self.target_vocab_size, self.one_hot_probs, tree)
