"""Draft-model proposer: another checkpoint, or the target checkpoint at another precision.

KV rule (DESIGN §2): the draft cache holds positions [0, num_computed). ``propose`` first feeds
every verified token it has not seen (the pending correction/bonus token, and after a fully
accepted round also the last draft token) in one forward, then drafts one token per forward.
``rollback`` truncates the cache to the accepted prefix. With ``stop_below`` (``speculate.policy=
confidence``) a round ends after the first token whose probability under the draft is below it.
"""

from __future__ import annotations

import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting.base import Proposal
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.drafting.tree_model import grow_tree
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.sampling import GreedyChooser, RandomChooser

_GREEDY = SamplingConfig(temperature=0.0)


class ModelDrafter:
    """Proposes tokens autoregressively with a (smaller or quantized) causal LM."""

    def __init__(
        self,
        model: torch.nn.Module,
        chooser: GreedyChooser | RandomChooser,
        target_vocab_size: int,
        shared_vocab_size: int,
        eos_ids: frozenset[int],
        name: str = "model",
        kv_precision: str = "auto",
        stop_below: float | None = None,
    ) -> None:
        self.runner = lone_sequence(model, kv_precision)
        self.chooser = chooser
        self.target_vocab_size = target_vocab_size
        self.shared_vocab_size = shared_vocab_size
        self.eos_ids = eos_ids
        self.name = name
        self.stop_below = stop_below
        self._tree_slots: list[int | None] = []  # draft cache slot of each node of the last tree (None: not fed)

    def begin(self, prompt_ids: list[int]) -> None:
        self.runner.reset()

    def propose(self, tokens: list[int], budget: int, generator: torch.Generator | None) -> Proposal:
        draft_ids: list[int] = []
        draft_probs: list[torch.Tensor] = []
        feed = tokens[self.runner.num_computed :]  # >= 1 token: at least the pending one
        while len(draft_ids) < budget:
            logits = self._aligned(self.runner.forward(feed, last_only=True))  # [V_target]
            token, probs = self.chooser.choose(logits, generator)
            draft_ids.append(token)
            if probs is not None:
                draft_probs.append(probs)
            if token in self.eos_ids or unsure(logits, probs, self.stop_below):  # nothing after EOS is emitted
                break
            feed = [token]
        stacked = torch.stack(draft_probs) if draft_probs else None  # [k, V_target]
        return Proposal(draft_ids, stacked)

    def rollback(self, num_kept: int) -> None:
        self.runner.truncate(num_kept)

    def propose_tree(
        self, tokens: list[int], tree: TreeConfig, budget: int, max_depth: int, generator: torch.Generator | None
    ) -> TokenTree:
        """A token tree of at most ``budget`` nodes and depth ``max_depth`` after ``tokens`` (:mod:`.tree_model`)."""
        feed = tokens[self.runner.num_computed :]  # >= 1 token: at least the pending one
        root = self._aligned(self.runner.forward(feed, last_only=True))  # [V_target]
        sampling = getattr(self.chooser, "sampling", _GREEDY)
        grown, self._tree_slots = grow_tree(
            self.runner, root, self._aligned, tree, sampling, max_depth, budget, self.eos_ids, generator
        )
        return grown

    def commit_path(self, num_prefix: int, path: list[int]) -> None:
        """Keep ``tokens[:num_prefix]`` and the accepted ``path``'s nodes that were inputs (a prefix of it)."""
        slots = [self._tree_slots[node] for node in path if self._tree_slots[node] is not None]
        self.runner.commit_slots(num_prefix, slots)

    def kv_bytes(self) -> int:
        return self.runner.kv_bytes()

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        return align_logits(logits, self.shared_vocab_size, self.target_vocab_size)


def unsure(logits: torch.Tensor, probs: torch.Tensor | None, stop_below: float | None) -> bool:
    """The draft's top probability (``probs`` [V] when sampling, else softmax(``logits`` [V])) < ``stop_below``."""
    if stop_below is None:
        return False
    top = probs.max() if probs is not None else torch.softmax(logits, dim=-1).max()
    return float(top) < stop_below


def align_logits(logits: torch.Tensor, shared: int, target: int) -> torch.Tensor:
    """Draft logits [V_draft] -> fp32 [V_target]: ids past the ``shared`` range can never be proposed."""
    logits = logits.float()
    if logits.shape[-1] == target and shared == target:
        return logits
    aligned = logits.new_full((target,), float("-inf"))
    aligned[:shared] = logits[:shared]
    return aligned
