"""Suffix decoding (spectoolkit/drafting/suffix*.py): the trie against a brute-force substring counter, and the
drafter's own invariants (what it drafts occurs in the data, the global trie's bound and forgetting).

Greedy identity and the sampled distribution through the engine are in tests/serving (test_batch_exact,
test_serving_trees, test_batch_stochastic), beside n-gram lookup's.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import Budget, Lone, SuffixDrafter, SuffixSettings
from spectoolkit.drafting.suffix_trie import Node, SuffixTrie

DEPTH = 6


def _sequences(count: int, seed: int, vocab: int = 4, length: tuple[int, int] = (0, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length))] for _ in range(count)]


def _trie(sequences: list[list[int]], depth: int = DEPTH) -> SuffixTrie:
    trie = SuffixTrie(depth)
    for seq in sequences:
        trie.add(seq)
    return trie


def _brute(sequences: list[list[int]], depth: int) -> Counter:
    """Every substring of length 1..depth, with its number of occurrences over all sequences."""
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def _dump(trie: SuffixTrie) -> Counter:
    """The trie's (substring, count) pairs; a node of count 0 would show as a pair of count 0."""
    found: Counter = Counter()

    def walk(node: Node, prefix: tuple[int, ...]) -> None:
        for token, child in node.children.items():
            found[prefix + (token,)] = child.count
            walk(child, prefix + (token,))

    walk(trie.root, ())
    return found


def _followed(sequences: list[list[int]], pattern: list[int]) -> Counter:
    """Tokens that follow an occurrence of ``pattern``, with counts."""
    after: Counter = Counter()
    n = len(pattern)
    for seq in sequences:
        for start in range(len(seq) - n):
            if seq[start : start + n] == pattern:
                after[seq[start + n]] += 1
    return after


@pytest.mark.parametrize("seed", range(5))
def test_counts_equal_a_brute_force_counter(seed):
    sequences = _sequences(6, seed)
    trie = _trie(sequences)
    assert _dump(trie) == _brute(sequences, DEPTH)
    assert trie.root.count == sum(len(seq) for seq in sequences)


@pytest.mark.parametrize("seed", range(5))
def test_growing_a_sequence_in_pieces_equals_adding_it_whole(seed):
    (seq,) = _sequences(1, seed, length=(20, 60))
    grown, whole = SuffixTrie(DEPTH), SuffixTrie(DEPTH)
    rng, done = random.Random(seed), 0
    while done < len(seq):
        step = rng.randint(1, 5)
        grown.extend(seq[done : done + step])
        done += step
    whole.add(seq)
    assert _dump(grown) == _dump(whole) == _brute([seq], DEPTH)


@pytest.mark.parametrize("seed", range(5))
def test_removing_a_sequence_equals_a_rebuild_without_it(seed):
    sequences = _sequences(5, seed)
    trie = _trie(sequences)
    trie.remove(sequences[1])
    trie.remove(sequences[3])
    rebuilt = _trie([sequences[0], sequences[2], sequences[4]])
    assert _dump(trie) == _dump(rebuilt)  # no node of count 0 left behind
    assert trie.root.count == rebuilt.root.count


@pytest.mark.parametrize("seed", range(8))
def test_longest_match_equals_brute_force(seed):
    sequences = _sequences(4, seed)
    trie = _trie(sequences)
    (context,) = _sequences(1, seed + 100, length=(1, 12))
    for max_len in (1, 3, 16):
        node, length = trie.match(context, max_len)
        want = 0
        for size in range(1, min(max_len, DEPTH - 1, len(context)) + 1):
            if _followed(sequences, context[-size:]):
                want = size
        assert length == want, (context, max_len)
        if want:
            assert {t: c.count for t, c in node.children.items()} == _followed(sequences, context[-want:])


@pytest.mark.parametrize("seed", range(8))
def test_the_match_at_a_grown_sequences_end_is_the_walked_match(seed):
    """match_end reads the open suffixes of a trie grown by extend: the node and length match() finds by walking the
    whole sequence's suffixes, after every piece it grows by, at every max_len (a repetitive alphabet: long
    matches)."""
    (seq,) = _sequences(1, seed, length=(30, 80))
    trie, rng, done = SuffixTrie(DEPTH), random.Random(seed), 0
    while done < len(seq):
        step = rng.randint(1, 4)
        trie.extend(seq[done : done + step])
        done += step
        for max_len in (1, 2, 3, DEPTH, 64):
            assert trie.match_end(max_len) == trie.match(seq[:done], max_len), (done, max_len)
    assert trie.match_end(0) == (None, 0)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_every_drafted_path_occurs_in_the_data_after_the_match(seed, tree_nodes):
    sequences = _sequences(5, seed, length=(10, 40))
    trie = _trie(sequences)
    context = sequences[seed % 5][: 7 + seed]
    node, length = trie.match(context, 4)
    if node is None:
        pytest.skip("no match for this context")
    found = trie.continuation(node, DEPTH - length, 0.0, tree_nodes)
    assert found.token_ids and (tree_nodes == 0 or len(found.token_ids) <= tree_nodes)
    text = [tuple(seq) for seq in sequences]
    for index in range(len(found.token_ids)):
        path, at = [], index
        while at >= 0:
            path.insert(0, found.token_ids[at])
            at = found.parents[at]
        pattern = tuple(context[-length:] + path)
        assert any(pattern == seq[i : i + len(pattern)] for seq in text for i in range(len(seq))), pattern
    if tree_nodes == 0:  # a chain takes the most frequent child each time (ties: the smaller token)
        after = _followed(sequences, context[-length:])
        assert found.token_ids[0] == min(after, key=lambda token: (-after[token], token))


def test_the_drafter_proposes_from_the_request_and_from_earlier_outputs():
    drafter = SuffixDrafter(SuffixSettings(depth=8, max_match=4, cache_tokens=100), 50, one_hot_probs=True)
    first = Lone([1, 2, 3, 9, 9, 4, 5, 6, 7, 1, 2, 3])
    first.prompt_len = 3  # what an engine sequence says; the rest is output
    (tree,) = drafter.propose([first], [Budget(4, 4)])
    assert tree.token_ids == [9, 9, 4]  # its own text: "1 2 3" was followed by "9 9 4 ..." (3 matched tokens)
    assert tree.draft_probs.shape == (3, 50) and tree.draft_probs.sum().item() == 3
    drafter.release(first)
    later = Lone([20, 21, 5, 6])
    (tree,) = drafter.propose([later], [Budget(4, 4)])
    assert tree.token_ids == [7, 1]  # only the global trie (earlier output) knows "5 6" -> "7 1 ..."
    again = Lone([1, 2, 3, 9])  # the first prompt again; its earlier output would continue "9" with "9 4 ..."
    again.prompt_len = 3
    (tree,) = drafter.propose([again], [Budget(4, 4)])
    assert tree.token_ids == [], "a request does not read an earlier answer to its own prompt"


def test_the_global_trie_keeps_the_newest_outputs_within_its_bound():
    settings = SuffixSettings(depth=6, max_match=4, cache_tokens=25)
    drafter = SuffixDrafter(settings, 50, one_hot_probs=False)
    outputs = _sequences(6, 7, vocab=5, length=(8, 10))
    for index, output in enumerate(outputs):
        seq = Lone([40 + index] + output)
        seq.prompt_len = 1
        drafter.propose([seq], [Budget(1, 1)])
        drafter.release(seq)
    kept, total = [], 0
    for output in reversed(outputs):
        if total + len(output) > 25:
            break
        kept.insert(0, output)
        total += len(output)
    assert _dump(drafter.cache) == _dump(_trie(kept, 6))


def test_a_tree_drafter_grows_trees_within_its_budget():
    drafter = SuffixDrafter(SuffixSettings(depth=8, max_match=4), 50, False, TreeConfig(kind="dynamic", max_nodes=8))
    seq = Lone([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3])
    (tree,) = drafter.propose([seq], [Budget(5, 3)])
    assert sorted(tree.token_ids[:3]) == [4, 5, 6] and tree.parents[:3] == [-1, -1, -1]  # three equal branches
    assert len(tree.token_ids) <= 5
