"""Analytic exactness of token-tree verification on real logits (DESIGN §1; SpecInfer, Miao et al. 2024).

At a node with processed target distribution p and children x_1…x_c tried in order, the tree verifier
(:mod:`spectoolkit.verify.tree`) emits x with probability

    out(x) = Σ_j (Π_{i<j} ρ_i) · m_j(x) + (Π_j ρ_j) · p_{c+1}(x),   m_j = r_j · a_j,   ρ_j = 1 − Σ m_j

where r_j is what x_j is really drawn from (the parent's q for i.i.d. model siblings, one-hot for n-gram
continuations), a_j = min(1, p_j/q_j) (0 where p_j = 0), p_1 = p, p_{j+1} = the verifier's own
``residual_after(p_j, q_j)``. For i.i.d. siblings r_j does not depend on earlier draws, so the sum is
exact; for an exact verifier out == p at every node.

The rows are the real code's at real positions of a seeded target-alone continuation: the real tree
drafter proposes, the target runs the real verify forward (``verify_rows`` + ``forward_masked`` on a
:class:`~spectoolkit.runtime.lone.LoneSequence` holding the prefix, as the engine's tree rows do) and p
is ``processed_probs`` of a row. The
reference is a plain causal forward of the target alone over prefix + the node's path. Every node is
checked: the root, each expanded node and the leaves (out = p: the bonus token). ``accept_mask`` and
``residual_after`` are this module's names (the seams tests patch); ``accept_mask`` is probed just
inside and outside the acceptance threshold.

fp32 limit: each try tests p_j/q_j on rows whose sums are off 1 by up to ~1e-5, which moves the output
by at most Σ_j |Σp_j/Σq_j − 1| in TV (``normalization_gap`` per try). ``passed`` asks the TV beyond it
(``max_excess_tv``) to stay under 1e-6 at every node, with no ``accept_mask`` disagreement. Both runners
build the prefix with the same calls, so the tree rows differ from the reference only by the tree
forward (``max_forward_tv``: 0 with batch-invariant attention, ~1e-7 with packed SDPA at vocab 512).

Negative controls, each a known bug, must give a clearly non-zero TV: ``rank_siblings`` (top-c tokens
reported as i.i.d. from q: :func:`~spectoolkit.eval.tree_empirical.rank_siblings`), ``no_residual_update``
(p kept between siblings) and ``sibling_visible_mask`` (the verify forward lets each node see its
earlier siblings).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from spectoolkit.config import SamplingConfig, SpeculateConfig, TreeConfig
from spectoolkit.drafting import Budget, Lone, NgramDrafter, lone_drafter
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.stochastic_analytic import (
    _accept_probability,
    _probe_accept_mask,
    _summary,
    _target_positions,
    _vocab_size,
    normalization_gap,
    total_variation,
)
from spectoolkit.eval.tree_empirical import rank_siblings
from spectoolkit.models.tree_mask import verify_rows
from spectoolkit.policy import draft_depth
from spectoolkit.runtime.lone import LoneSequence, lone_sequence
from spectoolkit.sampling import RandomChooser, processed_probs
from spectoolkit.verify.rules import accept_mask, pad_vocab  # module-level names: the seams tests patch
from spectoolkit.verify.tree import children_of, residual_after

THRESHOLD = 1e-6
CONTROLS = ("rank_siblings", "no_residual_update", "sibling_visible_mask")


def tree_output_probs(
    proposals: list[torch.Tensor],
    draft_rows: list[torch.Tensor],
    target_probs: torch.Tensor,
    residual_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float, int]:
    """(distribution [V] float64 the verifier emits at a node, Σ normalization gaps, accept-rule mismatches).

    proposals[j] [V]: what child j is really drawn from (r_j); draft_rows[j] [V_draft]: the q_j handed to
    the verifier; target_probs [V]: p at the node, fp32 as the verifier sees it. ``residual_step``
    (default: the verifier's ``residual_after``) updates p after a rejected child.
    """
    step = residual_step or residual_after  # looked up per call: patching the module name reaches it
    vocab = target_probs.shape[-1]
    probs = target_probs.float()  # [V] p_j
    out = torch.zeros(vocab, dtype=torch.float64)
    reach, gap, mismatches = 1.0, 0.0, 0  # reach: Π ρ_i, the chance that child j is tried
    for proposal, draft_row in zip(proposals, draft_rows, strict=True):
        draft_row = pad_vocab(draft_row.float().unsqueeze(0), vocab)[0]  # [V]
        proposal = proposal.double() / proposal.double().sum()  # [V] sample_from normalizes
        accept = _accept_probability(draft_row.double(), probs.double())  # [V]
        mismatches += _probe_accept_mask(proposal > 0, accept, draft_row, probs, accept_mask)  # this module's seam
        emitted = proposal * accept  # [V] m_j
        out += reach * emitted
        reach *= max(0.0, 1.0 - float(emitted.sum()))
        gap += normalization_gap(probs, draft_row)
        probs = step(probs, draft_row)
    return out + reach * probs.double() / probs.double().sum(), gap, mismatches


def with_earlier_siblings(visible: torch.Tensor, parents: list[int], start: int) -> torch.Tensor:
    """BUG on purpose: ``visible`` [n+1, L] of a verify forward, each node also seeing its earlier siblings."""
    wrong = visible.clone()
    for kids in children_of(parents).values():
        for later, node in enumerate(kids):
            wrong[node + 1, [start + 1 + sibling for sibling in kids[:later]]] = True
    return wrong


def _decode_positions(runner: LoneSequence, prompt: list[int], sampling: SamplingConfig, count: int, generator):
    """The chain check's target-alone positions, with the prompt's last token fed as a decode step: the tree
    runner builds its prefix with the same calls (one prefill, then decode steps), so both hold bit-identical
    prefix KV."""
    return _target_positions(runner, prompt, sampling, count, generator, split_last=True)


def _verify_logits(runner: LoneSequence, tokens: list[int], tree: TokenTree, see_siblings: bool) -> torch.Tensor:
    """Logits [n+1, V] of the verify forward over [pending, nodes…], ``runner`` holding a prefix of tokens[:-1].

    The missing prefix is fed as :func:`_decode_positions` feeds it (one prefill, then decode steps).
    """
    start = len(tokens) - 1  # the pending token's slot
    if runner.num_computed < start:
        runner.forward(tokens[runner.num_computed : start])
    rows = [tokens[-1], *tree.token_ids]
    if tree.is_chain() and not see_siblings:  # tree_round's branch: a chain takes the plain causal forward
        logits = runner.forward(rows)
    else:
        positions, visible = verify_rows(tree.parents, start)
        if see_siblings:
            visible = with_earlier_siblings(visible, tree.parents, start)
        logits = runner.forward_masked(rows, positions, visible)
    runner.truncate(start)
    return logits.float()


def _chain_logits(runner: LoneSequence, tokens: list[int], tree: TokenTree, root_logits: torch.Tensor) -> list:
    """Reference logits [V] after tokens + each node's path (root first): plain causal forwards of the target."""
    references = [root_logits]
    for node in range(len(tree)):
        path = [tree.token_ids[i] for i in tree.path_to(node)]
        references.append(runner.forward(path, last_only=True).float())
        runner.truncate(len(tokens))  # ``runner`` holds ``tokens``: the target-alone continuation goes on from there
    return references


def _check_nodes(stats: dict[str, list], tree, references, real, wrong, sampling: SamplingConfig) -> None:
    """The real rule and each control at every node of ``tree``; rows [n+1, V] real / sibling-visible logits."""
    children, ranked = children_of(tree.parents), rank_siblings(tree)
    vocab = real.shape[-1]
    for node in range(-1, len(tree)):
        kids = children.get(node, [])
        reference = processed_probs(references[node + 1], sampling)  # [V] causal target alone
        target_probs = processed_probs(real[node + 1], sampling)  # [V] from the tree verify forward
        rows = [tree.draft_probs[kid] for kid in kids]
        out, gap, mismatches = tree_output_probs(rows, rows, target_probs)
        tv = total_variation(out, reference)
        stats["real"].append(tv)
        stats["excess"].append(max(0.0, tv - gap))
        stats["gap"].append(gap)
        stats["forward"].append(total_variation(target_probs, reference))
        stats["mismatches"].append(mismatches)
        one_hots = [F.one_hot(torch.tensor(ranked.token_ids[kid]), vocab).float() for kid in kids]
        controls = {
            "rank_siblings": tree_output_probs(one_hots, [ranked.draft_probs[kid] for kid in kids], target_probs),
            "no_residual_update": tree_output_probs(rows, rows, target_probs, lambda probs, _: probs),
            "sibling_visible_mask": tree_output_probs(rows, rows, processed_probs(wrong[node + 1], sampling)),
        }
        for name, (control_out, _, _) in controls.items():
            stats[name].append(total_variation(control_out, reference))


def tree_analytic_exactness(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    tree_cfg: TreeConfig,
    positions_per_prompt: int,
    seed: int,
    gamma: int = 4,
    draft_vocab_shared: int | None = None,
    ngram_max: int = 3,
    ngram_min: int = 2,
) -> dict:
    """TV between the tree verifier's output distribution and the target alone at every node of real trees.

    ``draft`` None means the n-gram trie (``ngram_max``/``ngram_min``); positions where it finds nothing
    count in ``positions_skipped``. Trees have at most ``tree_cfg.max_nodes`` nodes, as deep as the policy's
    :func:`~spectoolkit.policy.draft_depth` for γ = ``gamma``. Returns max_tv, mean_tv (raw, over nodes),
    max_excess_tv (beyond the fp32 normalization gap), max_forward_tv, positions, nodes, expanded_nodes,
    controls {name: {max_tv, mean_tv}}, passed (max_excess_tv < threshold, no rule mismatch), threshold, ….
    """
    if sampling.greedy:
        raise SpecToolkitError("analytic exactness needs sampling.temperature > 0 (greedy is checked token for token)")
    if not tree_cfg.enabled:
        raise SpecToolkitError("the tree analytic check needs speculate.tree.kind=static|dynamic")
    reference_runner, tree_runner = lone_sequence(target), lone_sequence(target)
    vocab = _vocab_size(target)
    if draft is not None:
        shared = draft_vocab_shared or min(vocab, _vocab_size(draft))
        positions = max(map(len, prompts), default=0) + positions_per_prompt + tree_cfg.max_nodes + 2
        drafter = lone_drafter(draft, RandomChooser(sampling), vocab, shared, frozenset(), positions, tree=tree_cfg)
    else:
        drafter = NgramDrafter(ngram_max, ngram_min, vocab, True, tree_cfg)
    budget = Budget(tree_cfg.max_nodes, draft_depth(SpeculateConfig(gamma=gamma, tree=tree_cfg)))
    stats, positions, skipped, expanded = defaultdict(list), 0, 0, 0
    target_gen, draft_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    for prompt in prompts:
        drafter.reset()  # one prompt at a time
        seq = Lone([], draft_gen)
        tree_runner.reset()
        for tokens, root_logits in _decode_positions(
            reference_runner, prompt, sampling, positions_per_prompt, target_gen
        ):
            seq.tokens = tokens
            (tree,) = drafter.propose([seq], [budget])
            drafter.commit(seq, len(tokens), [])  # the tree is never kept: the next position feeds the target's token
            if len(tree) == 0:
                skipped += 1
                continue
            references = _chain_logits(reference_runner, tokens, tree, root_logits)
            real = _verify_logits(tree_runner, tokens, tree, see_siblings=False)  # [n+1, V]
            wrong = _verify_logits(tree_runner, tokens, tree, see_siblings=True)  # [n+1, V]
            _check_nodes(stats, tree, references, real, wrong, sampling)
            positions += 1
            expanded += len(children_of(tree.parents))
    max_excess, mismatches = max(stats["excess"], default=0.0), sum(stats["mismatches"])
    return {
        **_summary(stats["real"]),
        "positions": positions,
        "positions_skipped": skipped,
        "nodes": len(stats["real"]),
        "expanded_nodes": expanded,
        "max_excess_tv": max_excess,
        "max_normalization_gap": max(stats["gap"], default=0.0),
        "max_forward_tv": max(stats["forward"], default=0.0),
        "accept_rule_mismatches": mismatches,
        "sampling": dataclasses.asdict(sampling),
        "tree": dataclasses.asdict(tree_cfg),
        "controls": {name: _summary(stats[name]) for name in CONTROLS},
        "passed": positions > 0 and max_excess < THRESHOLD and mismatches == 0,
        "threshold": THRESHOLD,
    }
