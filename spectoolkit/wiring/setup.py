"""Build what a run needs from its config: models, the compat check, drafter, verifier, engines.

Data flows one way (DESIGN §4): config → resolved checkpoints and choices (:mod:`spectoolkit.wiring.resolve`, once,
first) → loaded models → compat check → engines. Each variant (drafter kind, verifier) is chosen here once; the
decode loops never branch on config strings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from spectoolkit.compat import check_pair
from spectoolkit.config import ARM_DRAFTERS, RunConfig, TreeConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.layer_skip import kept_layers, layer_skip_model
from spectoolkit.policy import DraftLengthPolicy, make_policy
from spectoolkit.precisions import QUANT_PRECISIONS
from spectoolkit.serving.api import ServingEngine
from spectoolkit.serving.one import Engine
from spectoolkit.wiring.loading import LoadedModel, frequent_tokens, load_model, load_tokenizer
from spectoolkit.wiring.one_engine import OneEngines
from spectoolkit.wiring.resolve import DRAFT_WIDTHS, ResolvedRun, kernel_mode, resolve_run


@dataclass
class Arm:
    """One way of decoding, measured side by side with the others in a run.

    ``reference`` names the target-alone arm with the same target: its output is what this arm's
    output must equal (greedy), and its decode step is the T₁ of this arm's cost model.
    """

    name: str
    engine: Engine | ServingEngine  # a serving run's arms are its continuous engines (memory and compile read them)
    target: LoadedModel
    target_precision: str
    drafter: str = "none"
    draft: LoadedModel | None = None
    draft_precision: str | None = None
    gamma: int = 0  # 0: the target alone; else the most a round drafts
    reference: str | None = None
    policy: str = "none"  # the draft-length policy (spectoolkit.policy) of a drafting arm

    def memory(self) -> dict[str, int]:
        """Weights + KV bytes (the most its requests held at once) of this arm's target and draft, and their total."""
        parts = {
            "target_weight_bytes": self.target.weight_bytes(),
            "draft_weight_bytes": self.draft.weight_bytes() if self.draft else 0,
            **self.engine.peak_kv_bytes(),
        }
        streamed = {
            "target_streamed_bytes": self.target.streamed_bytes(),
            "draft_streamed_bytes": self.draft.streamed_bytes() if self.draft else 0,
        }
        return {**parts, "total_bytes": sum(parts.values()), **streamed}


@dataclass
class LoadedModels:
    """The models of a run and what is known about them once loaded."""

    device: torch.device
    tokenizer: Any
    target: LoadedModel  # the configured target (quantized in four_groups)
    draft: LoadedModel | None
    eos_ids: frozenset[int]
    max_positions: int  # the target's context length


@dataclass
class ArmSet:
    """The arms of a run in run order. ``arms[0]`` is the "baseline"; ``primary`` the headline arm."""

    arms: list[Arm]
    primary: str | None

    @property
    def baseline(self) -> Arm:
        return self.arms[0]

    @property
    def spec(self) -> Arm | None:
        return self.arm(self.primary) if self.primary else None

    def arm(self, name: str) -> Arm:
        return next(arm for arm in self.arms if arm.name == name)

    def drafting(self) -> list[Arm]:
        """The arms with a drafter (γ > 0), in run order."""
        return [arm for arm in self.arms if arm.gamma]


@dataclass(frozen=True)
class RunFacts:
    """Facts about how a run was put together, recorded in its conditions."""

    drafter_name: str
    compat_warnings: list[str]
    compat_checked: bool = False  # a separate draft checkpoint passed check_pair


@dataclass
class RunSetup:
    """What :func:`build` returns: the loaded models, the arms to measure, the run facts, what was resolved."""

    models: LoadedModels
    arm_set: ArmSet
    facts: RunFacts
    resolved: ResolvedRun | None = None


def eos_ids_of(tokenizer, model: torch.nn.Module) -> frozenset[int]:
    """EOS ids from the tokenizer and the generation config (chat models often list several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return frozenset(ids)


def shared_vocab_size(target: LoadedModel, draft: LoadedModel) -> int:
    """Token ids a draft model may propose: those both vocabularies have."""
    return min(target.vocab_size, draft.vocab_size)


@dataclass
class _Parts:
    """What the arm builders combine: the configured target, the one engine's arm builder and the draft."""

    cfg: RunConfig
    run: ResolvedRun
    target: LoadedModel
    one: OneEngines
    draft: LoadedModel | None

    @property
    def drafts(self) -> bool:
        return self.cfg.draft.kind != "none"

    def target_alone(self, name: str, target: LoadedModel, precision: str) -> Arm:
        return Arm(name, self.one.target_alone(name, target.model), target, precision)

    def drafting(
        self, name: str, target: LoadedModel, precision: str, ref: str, policy: DraftLengthPolicy,
        tree: TreeConfig | None = None, drafter=None,
    ) -> Arm:  # fmt: skip
        """A drafting arm; ``tree`` (default: ``speculate.tree``) makes it draft token trees; ``drafter`` (default:
        the run's) proposes."""
        tree = self.cfg.speculate.tree if tree is None else tree
        engine, drafter = self.one.drafting(name, target.model, policy, tree, drafter)
        gamma = engine.policy.max_gamma  # records' draft_len: the most a round drafts (a tree: its node budget)
        draft = self.draft if drafter.runners() else None  # a lookup arm of a run with a draft model has none
        draft_precision = draft.label if draft else None
        return Arm(name, engine, target, precision, drafter.name, draft, draft_precision, gamma, ref,
                   policy.name)  # fmt: skip


def build(cfg: RunConfig, arms: bool = True, run: ResolvedRun | None = None) -> RunSetup:
    """Load and wire everything ``cfg`` asks for; user mistakes raise SpecToolkitError. ``arms=False``: the
    models only (a server or a serving run builds its own arms, :mod:`spectoolkit.serving.assemble`).

    The config is resolved first, once (:func:`~spectoolkit.wiring.resolve.resolve_run`; ``run``: a caller's own
    resolution of ``cfg``); everything after takes the resolved checkpoints and choices."""
    _check_arm_set(cfg)
    run = run or resolve_run(cfg)
    device = run.device
    tokenizer = load_tokenizer(run.target)
    target = load_model(run.target, cfg.target.precision, device, cfg.target.group_size, run.kernel_mode,
                        run.target_widths, activations=cfg.target.activations)  # fmt: skip
    eos_ids = eos_ids_of(tokenizer, target.model)
    draft, warnings = _load_draft(cfg, run, target, tokenizer, eos_ids) if run.model_drafts else (None, [])
    if cfg.draft.kind == "skip":
        draft = skip_draft(cfg, target, run.kernel_mode)
    max_positions = getattr(target.model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
    models = LoadedModels(device, tokenizer, target, draft, eos_ids, max_positions)
    verifier = make_verifier(cfg.sampling, device)
    checked = run.separate_draft and run.model_drafts
    if not arms:
        return RunSetup(models, ArmSet([], None), RunFacts("none", warnings, checked), run)
    one = OneEngines(cfg, models, verifier)
    drafter = one.drafter() if cfg.draft.kind != "none" else None
    arms, primary = _ARM_SETS[cfg.bench.arms](_Parts(cfg, run, target, one, draft))
    if cfg.runtime.compiled:  # every graph the arms can use, compiled before anything is measured
        one.warm_compiled(run.verify_sizes, cfg.bench.arms == "tree_chain")
    facts = RunFacts(drafter.name if drafter else "none", warnings, checked)
    return RunSetup(models, ArmSet(arms, primary), facts, run)


def _check_arm_set(cfg: RunConfig) -> None:
    """Arm sets that compare drafting arms need a drafter; four_groups needs a quantized target;
    the confidence policy needs a draft model (its probabilities)."""
    arms = cfg.bench.arms
    if cfg.speculate.policy == "confidence" and cfg.draft.kind != "model":
        raise SpecToolkitError(
            f"speculate.policy=confidence stops a draft model by its top probability, but draft.kind is "
            f"{cfg.draft.kind}: use +draft=<precision> (a draft model) or speculate.policy=adaptive"
        )
    if arms == "tree_chain" and not cfg.speculate.tree.enabled:
        raise SpecToolkitError(
            "bench.arms=tree_chain compares a token tree with a chain of the same verify width: "
            "set speculate.tree.kind=static or dynamic"
        )
    if arms not in ("standard", "drafters") and cfg.draft.kind == "none":
        raise SpecToolkitError(f"bench.arms={arms} compares drafting arms: set +draft=ngram or a draft model")
    if arms == "four_groups" and cfg.target.precision not in QUANT_PRECISIONS:
        raise SpecToolkitError(
            f"bench.arms=four_groups compares a quantized target with the {cfg.bench.reference_precision} reference: "
            f"set +target=<{'|'.join(QUANT_PRECISIONS)}> (target.precision is {cfg.target.precision})"
        )


def _standard(parts: _Parts) -> tuple[list[Arm], str | None]:
    precision = parts.target.label
    arms = [parts.target_alone("baseline", parts.target, precision)]
    if not parts.drafts:
        return arms, None
    policy = make_policy(parts.cfg.speculate)
    return arms + [parts.drafting("spec", parts.target, precision, "baseline", policy)], "spec"


def _gamma_sweep(parts: _Parts) -> tuple[list[Arm], str | None]:
    """One fixed-γ arm "spec-gN" per N in ``bench.gammas`` and "spec-adaptive" (at most max(gammas))."""
    cfg, precision = parts.cfg, parts.target.label
    arms = [parts.target_alone("baseline", parts.target, precision)]
    for gamma in cfg.bench.gammas:
        policy = make_policy(cfg.speculate, "fixed", gamma)
        arms.append(parts.drafting(f"spec-g{gamma}", parts.target, precision, "baseline", policy))
    adaptive = make_policy(cfg.speculate, "adaptive", max(cfg.bench.gammas))
    arms.append(parts.drafting("spec-adaptive", parts.target, precision, "baseline", adaptive))
    primary = f"spec-g{cfg.speculate.gamma}"
    return arms, primary if any(arm.name == primary for arm in arms) else None


def _four_groups(parts: _Parts) -> tuple[list[Arm], str | None]:
    """Baseline (reference precision), quantization only, speculation only, both (DESIGN §3)."""
    cfg, run = parts.cfg, parts.run
    ref_precision, quant = cfg.bench.reference_precision, parts.target.label
    reference = load_model(run.target, ref_precision, run.device, 64, run.kernel_mode, run.target_widths)
    arms = [
        parts.target_alone("baseline", reference, ref_precision),
        parts.target_alone("quant", parts.target, quant),
        parts.drafting("spec", reference, ref_precision, "baseline", make_policy(cfg.speculate)),
        parts.drafting("quant+spec", parts.target, quant, "quant", make_policy(cfg.speculate)),
    ]
    return arms, "quant+spec"


def _tree_chain(parts: _Parts) -> tuple[list[Arm], str | None]:
    """Baseline, then per N in ``bench.gammas`` "chain-gN" (γ = N) and "tree-nN" (``speculate.tree`` with
    max_nodes = N): pairs at the same verify width, N + 1 rows."""
    cfg, precision = parts.cfg, parts.target.label
    arms = [parts.target_alone("baseline", parts.target, precision)]
    for nodes in cfg.bench.gammas:
        chain = make_policy(cfg.speculate, "fixed", nodes)
        tree = dataclasses.replace(cfg.speculate.tree, max_nodes=nodes)
        arms.append(parts.drafting(f"chain-g{nodes}", parts.target, precision, "baseline", chain, TreeConfig()))
        arms.append(parts.drafting(f"tree-n{nodes}", parts.target, precision, "baseline", make_policy(cfg.speculate),
                                   tree))  # fmt: skip
    primary = f"tree-n{cfg.speculate.tree.max_nodes}"
    return arms, primary if any(arm.name == primary for arm in arms) else arms[-1].name


def _drafters(parts: _Parts) -> tuple[list[Arm], str | None]:
    """Baseline, one arm "spec-<kind>" per drafter in ``bench.drafters``, and a draft model's "spec": the
    drafters against each other, interleaved per request over one baseline."""
    cfg, precision = parts.cfg, parts.target.label
    arms = [parts.target_alone("baseline", parts.target, precision)]
    for kind in cfg.bench.drafters:
        drafter = parts.one.drafter_of(kind)
        arms.append(parts.drafting(f"spec-{kind}", parts.target, precision, "baseline", make_policy(cfg.speculate),
                                   drafter=drafter))  # fmt: skip
    if cfg.draft.kind not in (*ARM_DRAFTERS, "none"):
        arms.append(parts.drafting("spec", parts.target, precision, "baseline", make_policy(cfg.speculate)))
        return arms, "spec"
    primary = f"spec-{cfg.draft.kind}"
    return arms, primary if any(arm.name == primary for arm in arms) else arms[1].name


_ARM_SETS = {"standard": _standard, "gamma_sweep": _gamma_sweep, "four_groups": _four_groups, "tree_chain": _tree_chain,
             "drafters": _drafters}  # fmt: skip


def _load_draft(cfg: RunConfig, run: ResolvedRun, target: LoadedModel, tokenizer, eos_ids: frozenset[int]):
    """Load the draft model (``kind=model``, or the hybrid's with ``hybrid_with=model``: the same model at the same
    precision), its head cut to ``draft.head_vocab`` frequent tokens if asked; a different checkpoint must pass the
    compat check first."""
    warnings = []
    if run.separate_draft:
        report = check_pair(run.target, run.draft)
        if not report.compatible:
            raise SpecToolkitError(report.message())
        warnings = report.warnings
    vocab = cfg.draft.head_vocab
    rows = frequent_tokens(tokenizer, vocab, target.vocab_size, eos_ids) if vocab is not None else None
    draft = load_model(run.draft, cfg.draft.precision, run.device, cfg.draft.group_size, run.kernel_mode, DRAFT_WIDTHS,
                       cfg.draft.quantize_head, cfg.draft.activations, rows)  # fmt: skip
    return draft, warnings


def skip_draft(cfg: RunConfig, target: LoadedModel, kernels: str | None = None) -> LoadedModel:
    """The layer-skip self-draft of ``target`` (:mod:`spectoolkit.models.layer_skip`): its weights, shared,
    or with ``draft.skip_precision`` the same layers of a quantized copy (bytes of its own, its linears run as
    ``kernels`` says: the run's resolved kernel mode, by default ``cfg``'s)."""
    total = target.model.config.get_text_config().num_hidden_layers
    keep = kept_layers(total, cfg.draft.layers, cfg.draft.skip_every)
    precision = cfg.draft.skip_precision
    if precision is None:
        model = layer_skip_model(target.model, keep)
        return LoadedModel(model, target.path, target.precision, target.vocab_size, target.kernels, shared=True,
                           activations=target.activations, checkpoint=target.checkpoint)  # fmt: skip
    source = target.checkpoint or target.path
    kernels = kernels if kernels is not None else kernel_mode(cfg)
    copy = load_model(source, precision, target.device, cfg.draft.group_size, kernels, DRAFT_WIDTHS)
    return LoadedModel(layer_skip_model(copy.model, keep), target.path, precision, copy.vocab_size, copy.kernels,
                       activations=copy.activations, checkpoint=copy.checkpoint)  # fmt: skip


def freeze_heap() -> None:
    """Move everything loaded so far (libraries, models, engines) out of the cyclic garbage collector's reach
    (``gc.freeze``, as vLLM and SGLang do after start-up), garbage collected first. Otherwise a step that
    allocates many objects at once (a suffix trie indexing a prompt: thousands of nodes) sets off collections
    that walk every object the process holds (measured: 27 ms against 4 ms for a 400-token prompt's trie)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """:func:`freeze_heap` while measuring, the heap unfrozen after (the next job's collections see it again)."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()
