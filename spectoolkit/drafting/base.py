"""The one drafter interface: propose a token tree for each of a set of sequences, then commit what was kept.

Every proposer (n-gram lookup, a draft model, a test's oracle) implements :class:`Drafter`; the engine
never asks what kind of drafter it holds. A round's proposal is always a
:class:`~spectoolkit.drafting.tree.TokenTree` — a chain is the tree with one child per node, and the
engine verifies it on the chain fast path (the fused kernel). Proposers never import the verifier
(vLLM v1 layout): they return token ids and, when sampling, the distribution each was drawn from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.sampling import Chooser

BACKLOG_ROWS = 16  # a drafting round first feeds a sequence holding more unfed rows than this, in a forward of its own


@dataclass(frozen=True)
class Budget:
    """What one sequence may draft this round."""

    nodes: int  # drafted nodes at most (verify rows past the pending token); 0: nothing
    depth: int  # tree depth at most: the policy's, within the tokens the sequence may still emit less the target's


class Drafting(Protocol):
    """What a drafter reads of a sequence (the engine's ``Sequence``, or :class:`Lone`)."""

    tokens: list[int]  # prompt + output; the last token is pending (verified, no KV yet)
    generator: torch.Generator | None  # the sequence's own draws (sampling), else None
    prompt_len: int  # how many of ``tokens`` are its prompt
    chooser: Chooser | None  # its own token rule (a request's sampling settings); None: the drafter's


@dataclass(eq=False)
class Lone:
    """A sequence outside any engine (analytic proofs, tests): its tokens and generator; its prompt is the tokens it
    starts with unless told."""

    tokens: list[int]
    generator: torch.Generator | None = field(default=None, repr=False)
    prompt_len: int | None = None
    chooser: Chooser | None = None

    def __post_init__(self) -> None:
        if self.prompt_len is None:
            self.prompt_len = len(self.tokens)


@dataclass(frozen=True)
class Upkeep:
    """What a drafter spent so far feeding backlogs (a head catching up on rounds a request sat out): paid before
    it drafts again, not per draft forward, so the engine prices it apart."""

    seconds: float = 0.0
    rows: int = 0


class Drafter(Protocol):
    """A batched proposer. State is per sequence object; ``tree`` is the tree it grows (None: chains).

    Everything the engine may ask of a drafter is declared here, and the engine calls nothing else. The methods
    with bodies are defaults for what most drafters do not need (a lookup reads no target states, holds no
    backlog); a drafter subclasses this protocol to inherit them. How deep and how many nodes a round may draft
    come with each call (:class:`Budget`, from the draft-length policy): a drafter holds no draft length of its own.
    """

    name: str
    tree: TreeConfig | None
    capture: tuple[int, ...] = ()  # target layers whose input states it reads (an EAGLE head); (): none
    # Its proposal costs no forward and reads only the verified tokens (a lookup): the engine asks for it at the
    # round's cap before the policy chooses, and the policy plans within what was proposed (a token asked for and
    # not proposed costs nothing, so pricing it as a verify row undersold every lookup, issue 57).
    ahead: bool = False

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        """One tree per sequence within its budget (an empty tree: nothing to propose)."""
        ...

    def commit(self, seq: Drafting, num_prefix: int, path: list[int]) -> None:
        """``seq``'s first ``num_prefix`` tokens and the accepted ``path`` (node indices of the last proposal,
        root first; a chain's accepted prefix is ``range(K)``) are verified: forget everything else."""
        ...

    def release(self, seq: Drafting) -> None:
        """``seq`` left the engine: free what it held."""
        ...

    def reset(self) -> None:
        """Free every sequence's state."""
        ...

    def runners(self) -> dict:
        """The runners it drives, by role ("draft"); {} for a lookup."""
        ...

    def kv_bytes(self) -> int:
        """Bytes of KV cache it holds now (0 for a stateless one)."""
        ...

    def describe_tree(self) -> str | None:
        """Its tree for records (``static[3,2,1,1]/8``, ``trie/8``); None for chains."""
        ...

    def variant(self, stop_below: float | None, tree: TreeConfig | None) -> Drafter:
        """A drafter like this one on the same model and pool, with another stop rule or tree (another arm)."""
        ...

    # ---- defaults: what only some drafters need ---------------------------------------------------

    def keep_states(self, seq: Drafting, start: int, states: torch.Tensor) -> None:
        """The target verified positions [start, start + n) of ``seq``; ``states`` [n, len(capture) * H] are its
        states there (only called when ``capture`` is not empty)."""

    def backlog(self, seq: Drafting) -> int:
        """Rows a round drafting for ``seq`` first feeds apart (the policy prices them); 0: none."""
        return 0

    def upkeep(self) -> Upkeep:
        """Seconds and rows spent feeding backlogs so far (cumulative)."""
        return Upkeep()

    def observe_step(self, tokens: int, seconds: float, sequences: int) -> None:
        """A decode step's target forward, with the verifying and committing of its rows, took ``seconds`` for
        ``tokens`` rows of ``sequences`` sequences (a drafter that prices its choices by the step's cost learns it
        here: the seconds the draft-length policy prices the same rows by)."""


class OwnKV:
    """What the drafters with a KV cache of their own (a draft model, a draft head) share: a state per sequence
    (``_states``, by id) holding a block table of ``allocator`` over ``pool``; leaving frees its blocks. A round
    drafting for a sequence that holds more than :data:`BACKLOG_ROWS` unfed rows (its prompt, or rounds it sat out)
    first feeds them in a forward of its own, booked as :meth:`upkeep`: what the engine measures of a draft forward
    is then a draft forward, and the policy prices catch-up per row."""

    allocator: object  # a runtime.blocks.BlockAllocator
    pool: object  # a runtime.paged_kv.PagedKVPool
    _states: dict
    _upkeep: Upkeep = Upkeep()  # spent feeding backlogs so far (an instance rebinds it)
    carry: int | None = None  # unfed rows the first draft forward takes along (None: BACKLOG_ROWS)

    def upkeep(self) -> Upkeep:
        return self._upkeep

    def _carried(self) -> int:
        """The most unfed rows of a sequence its first draft forward takes along (:attr:`carry`)."""
        return BACKLOG_ROWS if self.carry is None else self.carry

    def _backlog(self, unfed: int) -> int:
        """The rows a round feeds apart for a sequence holding ``unfed`` (all but the last, the round's first draft
        row), if more than it carries (:meth:`_carried`); else 0 (the draft forward takes them along)."""
        return unfed - 1 if unfed > self._carried() else 0

    def _fed_backlogs(self, rows: int, began: float) -> None:
        """``rows`` backlog rows were fed since ``began`` (``time.perf_counter``): book them as upkeep."""
        if rows:
            self._upkeep = Upkeep(self._upkeep.seconds + time.perf_counter() - began, self._upkeep.rows + rows)

    def release(self, seq: Drafting) -> None:
        state = self._states.pop(id(seq), None)
        if state is not None:
            state.table.release()

    def reset(self) -> None:
        for state in self._states.values():
            state.table.release()
        self._states.clear()
        self.allocator.drop_cached()  # a prefix cache of its own (a head's rows) is not inherited either

    def kv_bytes(self) -> int:
        used = self.allocator.num_blocks - self.allocator.num_free
        return used * self.allocator.block_size * self.pool.slot_bytes()

    def _reserve(self, table, positions: int) -> bool:
        """Blocks of ``table`` (a runtime.blocks.BlockTable of ``allocator``) for its first ``positions``; False (and
        nothing reserved) when the pool cannot hold them."""
        if table.missing(positions) > self.allocator.num_free:
            return False
        table.ensure(positions)
        return True


class Lookup:
    """What the drafters without a model (n-gram, suffix) share: a proposal is deterministic, so when sampling
    its q is one-hot at each drafted token (which keeps the stochastic acceptance test exact); no runner, no KV
    cache, and nothing to commit (the next proposal reads the verified tokens, ``seq.tokens``). Whether a
    sequence samples is its own chooser's say where it has one, else ``one_hot_probs`` (the run's)."""

    target_vocab_size: int
    one_hot_probs: bool
    ahead = True  # proposed before the policy chooses (Drafter.ahead)

    def proposal(self, token_ids: list[int], parents: list[int], seq: Drafting | None = None) -> TokenTree:
        probs = None
        sampled = self.one_hot_probs if seq is None or seq.chooser is None else not seq.chooser.greedy
        if sampled:
            probs = torch.zeros(len(token_ids), self.target_vocab_size)  # [n, V]
            probs[torch.arange(len(token_ids)), token_ids] = 1.0
        return TokenTree(token_ids, parents, probs)

    def commit(self, seq: Drafting, num_prefix: int, path: list[int]) -> None:
        pass

    def runners(self) -> dict:
        return {}

    def kv_bytes(self) -> int:
        return 0
