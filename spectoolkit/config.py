"""Typed run configuration: one frozen dataclass per concern, validated on construction.

Hydra composes YAML at the edge (``spectoolkit/__main__.py``); the library only ever sees these
objects. :func:`run_config_from_dict` turns a plain nested dict (e.g. ``OmegaConf.to_container``)
into a :class:`RunConfig` and rejects unknown keys with a message that names them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field
from typing import Any

from spectoolkit.errors import SpecToolkitError
from spectoolkit.precisions import ACTIVATIONS, FLOAT_PRECISIONS, INT_CODE_PRECISIONS, KV_PRECISIONS, MODEL_PRECISIONS

DRAFT_KINDS = ("model", "skip", "ngram", "suffix", "eagle", "hybrid", "none")
WORKLOAD_KINDS = ("builtin", "jsonl", "humaneval", "sharegpt")
DEVICES = ("auto", "cpu", "cuda")
ARM_SETS = ("standard", "four_groups", "gamma_sweep", "tree_chain", "drafters")
LOOKUP_DRAFTERS = ("ngram", "suffix")  # drafters without a model
HEAD_DRAFTERS = ("eagle", "hybrid")  # drafters with a trained head (draft.eagle_path; hybrid: with hybrid_with=eagle)
HYBRID_WITH = ("eagle", "model")  # draft.hybrid_with: the model-backed drafter the hybrid pairs suffix decoding with
ARM_DRAFTERS = (*LOOKUP_DRAFTERS, *HEAD_DRAFTERS)  # what bench.arms=drafters pits against each other
DRAFT_POLICIES = ("fixed", "adaptive", "confidence")
TREE_KINDS = ("none", "static", "dynamic")
MAX_GAMMA = 64
MAX_TREE_NODES = 32  # verify rows = nodes + 1 stay within the row-invariant verify widths (<= 33)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecToolkitError(message)


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{name}={value!r} is not supported; use one of {', '.join(allowed)}")


def _number(value: Any, types) -> bool:
    """``value`` is of ``types`` and not a bool (YAML's true/false are ints to Python)."""
    return isinstance(value, types) and not isinstance(value, bool)


def _check_activations(name: str, activations: str | None, precision: str) -> None:
    """``activations``: None (the precision's default), float, or int8 where the weights are integer codes."""
    if activations is None:
        return
    _one_of(name, activations, ACTIVATIONS)
    _require(activations == "float" or precision in INT_CODE_PRECISIONS,
             f"{name}=int8 runs integer dot products with integer weight codes ({', '.join(INT_CODE_PRECISIONS)}), "
             f"not {precision} weights: drop it or pick one of those precisions")  # fmt: skip


def _check_group_size(name: str, group_size: int) -> None:
    _require(group_size >= 16 and group_size & (group_size - 1) == 0, f"{name}={group_size} must be a power of 2 >= 16")


@dataclass(frozen=True)
class TargetConfig:
    """The model whose output is the reference: its weight precision (float or a quantization backend).

    ``group_size`` applies to the group-wise backends (rtn-int8, rtn-int4, int4/GPTQ).
    """

    precision: str = "fp32"
    group_size: int = 64
    activations: str | None = None  # float | int8 (integer dot products); None: the precision's default

    def __post_init__(self) -> None:
        _one_of("target.precision", self.precision, MODEL_PRECISIONS)
        _check_group_size("target.group_size", self.group_size)
        _check_activations("target.activations", self.activations, self.precision)


SKIP_PRECISIONS = ("rtn-int8", "rtn-int4")  # a layer-skip draft's own quantized weights (draft.skip_precision)


@dataclass(frozen=True)
class DraftConfig:
    """What proposes tokens: a draft model (``model``), the target with layers left out (``skip``: its own
    weights, shared, and its own KV cache), prompt n-gram lookup, suffix decoding (``suffix``: frequency-scored
    continuations from per-request and global suffix tries, :mod:`spectoolkit.drafting.suffix`), a trained EAGLE-3
    draft head over the target's states (``eagle``, :mod:`spectoolkit.drafting.eagle`), per round and request the
    better buy of suffix decoding and a model-backed drafter (``hybrid``, :mod:`spectoolkit.drafting.hybrid`: the
    EAGLE head, or with ``hybrid_with=model`` the draft model, loaded as for ``kind=model``), or ``none``."""

    kind: str = "suffix"
    precision: str = "bf16"  # weight precision of a draft model (kind=model), float or quantized
    group_size: int = 64  # group size of a group-wise quantized draft
    activations: str | None = None  # kind=model: float | int8 (integer dot products); None: the precision's default
    ngram_max: int = 3  # longest suffix n-gram looked up in the context (kind=ngram)
    ngram_min: int = 2  # shortest suffix n-gram tried (1-gram matches are accepted ~10-20%: a net loss)
    layers: tuple[int, ...] = ()  # kind=skip: the target layers the draft runs (empty: from skip_every)
    skip_every: int = 2  # kind=skip: leave out every skip_every-th layer (first and last always kept)
    quantize_head: bool = False  # kind=model, rtn-*: quantize lm_head too (a float head dominates a small draft)
    skip_precision: str | None = None  # kind=skip: None shares the target weights; rtn-int4/-int8: a quantized copy
    suffix_max_match: int = 16  # kind=suffix: longest context suffix matched
    suffix_min_match: int = 2  # kind=suffix: shortest match drafted from
    suffix_factor: float = 1.0  # kind=suffix: draft tokens per matched token
    suffix_min_prob: float = 0.1  # kind=suffix: least probability of a drafted token given its parent
    suffix_cache_tokens: int = 65536  # kind=suffix: earlier outputs kept in the global trie (0: none)
    eagle_path: str | None = None  # kind=eagle/hybrid: a trained head's directory (None: train the default one, cached)
    hybrid_with: str = "eagle"  # kind=hybrid: suffix decoding beside eagle (the head) or model (the draft model)
    head_vocab: int | None = None  # draft model (float, rtn-*): its lm_head keeps the head_vocab tokens most frequent
    # in calibration text, so a draft step computes that many logits (FR-Spec); it never proposes the others. None: all

    def __post_init__(self) -> None:
        _one_of("draft.kind", self.kind, DRAFT_KINDS)
        if self.skip_precision is not None:
            _one_of("draft.skip_precision", self.skip_precision, SKIP_PRECISIONS)
        _require(
            self.hybrid_with in HYBRID_WITH,
            f"draft.hybrid_with={self.hybrid_with!r}: the hybrid pairs suffix decoding with eagle (the EAGLE-3 head of "
            "draft.eagle_path) or model (the draft model: model.draft_path at draft.precision)",
        )
        if self.kind == "model" or self.hybrid_with == "model":
            _one_of("draft.precision", self.precision, MODEL_PRECISIONS)
            _check_activations("draft.activations", self.activations, self.precision)
        _check_group_size("draft.group_size", self.group_size)
        _require(self.head_vocab is None or (_number(self.head_vocab, int) and self.head_vocab >= 1),
                 f"draft.head_vocab={self.head_vocab} must be a token count >= 1 (e.g. 32768) or null")  # fmt: skip
        _require(1 <= self.ngram_min <= self.ngram_max, "draft.ngram_min must be >= 1 and <= draft.ngram_max")
        _require(self.skip_every >= 2, f"draft.skip_every={self.skip_every} must be >= 2 (2: every other layer)")
        _require(
            isinstance(self.layers, (list, tuple)) and all(_number(i, int) and i >= 0 for i in self.layers),
            f"draft.layers={self.layers!r} must be a list of target layer indices, e.g. [0,2,4,...]",
        )
        object.__setattr__(self, "layers", tuple(self.layers))
        _require(_number(self.suffix_max_match, int) and 1 <= self.suffix_max_match <= 64,
                 f"draft.suffix_max_match={self.suffix_max_match} must be an integer in 1..64")  # fmt: skip
        _require(_number(self.suffix_min_match, int) and 1 <= self.suffix_min_match <= self.suffix_max_match,
                 f"draft.suffix_min_match={self.suffix_min_match} must be in 1..suffix_max_match")  # fmt: skip
        _require(_number(self.suffix_factor, (int, float)) and self.suffix_factor > 0,
                 f"draft.suffix_factor={self.suffix_factor} must be > 0")  # fmt: skip
        _require(_number(self.suffix_min_prob, (int, float)) and 0 <= self.suffix_min_prob <= 1,
                 f"draft.suffix_min_prob={self.suffix_min_prob} must be in [0, 1]")  # fmt: skip
        _require(_number(self.suffix_cache_tokens, int) and self.suffix_cache_tokens >= 0,
                 f"draft.suffix_cache_tokens={self.suffix_cache_tokens} must be an integer >= 0")  # fmt: skip

    @property
    def model_name(self) -> str:
        """The drafter's name for a draft model: ``model-rtn-int4`` (``+qhead``: its lm_head quantized too; ``+v32768``:
        its head kept to that many tokens)."""
        vocab = f"+v{self.head_vocab}" if self.head_vocab is not None else ""
        return f"model-{self.precision}" + ("+qhead" if self.quantize_head else "") + vocab


@dataclass(frozen=True)
class ModelConfig:
    """Checkpoints: a local directory or a hub id; ``None`` means the embedded SmolLM2-135M-Instruct.

    ``draft_path=None`` with ``draft.kind=model`` is a self-draft: the target checkpoint at the
    draft's precision.
    """

    name: str = "smollm2-135m"
    target_path: str | None = None
    draft_path: str | None = None


@dataclass(frozen=True)
class KVConfig:
    """KV-cache storage precision per model; quantized formats are written once per token."""

    target: str = "auto"
    draft: str = "auto"

    def __post_init__(self) -> None:
        _one_of("kv.target", self.target, KV_PRECISIONS)
        _one_of("kv.draft", self.draft, KV_PRECISIONS)


@dataclass(frozen=True)
class QuantQualityConfig:
    """What quantization costs: a quantized target against a float reference on held text.

    ``enabled=None`` measures it exactly when the target is quantized.
    """

    enabled: bool | None = None
    reference: str = "bf16"
    num_texts: int = 8
    max_tokens: int = 256  # response tokens scored per text

    def __post_init__(self) -> None:
        _one_of("quant_quality.reference", self.reference, FLOAT_PRECISIONS)
        _require(self.num_texts >= 1, "quant_quality.num_texts must be >= 1")
        _require(self.max_tokens >= 8, "quant_quality.max_tokens must be >= 8")


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling applied identically to target and draft. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    min_p: float = 0.0  # 0 disables min-p (keep tokens with probability >= min_p x the top one's)
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.temperature >= 0, "sampling.temperature must be >= 0 (0 means greedy)")
        _require(self.top_k >= 0, "sampling.top_k must be >= 0 (0 disables it)")
        _require(0 < self.top_p <= 1, "sampling.top_p must be in (0, 1]")
        _require(0 <= self.min_p <= 1, "sampling.min_p must be in [0, 1] (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TreeConfig:
    """Token-tree drafts (``speculate.tree``): verify several candidates per position in one forward.

    ``kind``: ``none`` (a chain of γ), ``static`` (``branching[d]`` children per node at depth d, e.g.
    [3, 2, 1, 1]) or ``dynamic`` (EAGLE-2 style: at each depth the ``top_k`` most probable frontier nodes
    get ``top_k`` children each, up to depth ``max_depth`` (default γ); then the ``max_nodes`` best nodes are
    kept). Either way at most ``max_nodes`` nodes are verified (verify width max_nodes + 1). n-gram and suffix
    drafts build a tree of the distinct continuations of the matched suffix, as deep as a model's tree of the same
    config (``max_nodes`` nodes). The depth is the draft-length policy's (:func:`spectoolkit.policy.draft_depth`).
    """

    kind: str = "none"
    branching: tuple[int, ...] = (2, 1, 1, 1)  # 8 nodes: fits the default max_nodes, depth 4 = the default γ
    max_nodes: int = 8
    top_k: int = 4
    max_depth: int | None = None  # dynamic and tries: depth cap (null: speculate.gamma); static: len(branching)

    def __post_init__(self) -> None:
        _one_of("speculate.tree.kind", self.kind, TREE_KINDS)
        branching = self.branching
        _require(
            isinstance(branching, (list, tuple))
            and bool(branching)
            and all(_number(b, int) and b >= 1 for b in branching),
            f"speculate.tree.branching={branching!r} must be a list of children per depth >= 1, e.g. [3,2,1,1]",
        )
        object.__setattr__(self, "branching", tuple(branching))
        _require(
            1 <= self.max_nodes <= MAX_TREE_NODES,
            f"speculate.tree.max_nodes={self.max_nodes} must be between 1 and {MAX_TREE_NODES}",
        )
        _require(self.top_k >= 1, f"speculate.tree.top_k={self.top_k} must be >= 1")
        _require(self.max_depth is None or self.max_depth >= 1, "speculate.tree.max_depth must be >= 1 or null")

    def describe(self, drafter_tree: str | None = None) -> str:
        """E.g. ``static[3,2,1,1]/8``, ``dynamic(top_k=4)/8`` or (``drafter_tree="trie"``, n-gram) ``trie/8``."""
        if drafter_tree:
            return f"{drafter_tree}/{self.max_nodes}"
        if self.kind == "static":
            return f"static[{','.join(map(str, self.branching))}]/{self.max_nodes}"
        return f"dynamic(top_k={self.top_k})/{self.max_nodes}" if self.kind == "dynamic" else "none"

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


@dataclass(frozen=True)
class SpeculateConfig:
    """Draft length: γ tokens proposed per verification round at most, and how each round's k is chosen.

    ``policy`` (:mod:`spectoolkit.policy`): ``fixed`` drafts γ every round; ``confidence`` lets a draft
    model stop when its top probability falls below ``confidence``; ``adaptive`` picks each request's
    k <= γ per round from its recent acceptance (counts decayed by ``decay`` per round) and the measured
    draft and verify costs, probing past its best k (at k = 0: one token) at most once per ``probe_every``
    rounds, its probes spaced to cost at most 1% of the time.
    """

    gamma: int = 4
    policy: str = "fixed"
    confidence: float = 0.4
    decay: float = 0.9
    probe_every: int = 8
    tree: TreeConfig = field(default_factory=TreeConfig)

    def __post_init__(self) -> None:
        _require(1 <= self.gamma <= MAX_GAMMA, f"speculate.gamma={self.gamma} must be between 1 and {MAX_GAMMA}")
        _one_of("speculate.policy", self.policy, DRAFT_POLICIES)
        _require(0 < self.confidence < 1, f"speculate.confidence={self.confidence} must be in (0, 1)")
        _require(0 < self.decay <= 1, f"speculate.decay={self.decay} must be in (0, 1] (1: never forget)")
        _require(self.probe_every >= 1, f"speculate.probe_every={self.probe_every} must be >= 1")
        _require(
            not self.tree.enabled or self.policy != "confidence",
            f"speculate.tree.kind={self.tree.kind} grows whole trees; speculate.policy=confidence stops a chain "
            "at an unsure token: use speculate.policy=fixed or adaptive (node budgets), or speculate.tree.kind=none",
        )


@dataclass(frozen=True)
class WorkloadConfig:
    """Which prompts to run. ``path`` is required for ``kind=jsonl``."""

    kind: str = "builtin"
    path: str | None = None
    max_new_tokens: int = 64
    num_prompts: int | None = None  # None: all prompts of the workload (builtin/jsonl) or 8 (datasets)
    chat_template: bool = True  # wrap each prompt as a user message in the tokenizer's chat template

    def __post_init__(self) -> None:
        _one_of("workload.kind", self.kind, WORKLOAD_KINDS)
        _require(self.max_new_tokens >= 1, f"workload.max_new_tokens={self.max_new_tokens} must be >= 1")
        _require(self.num_prompts is None or self.num_prompts >= 1, "workload.num_prompts must be >= 1")
        _require(self.kind != "jsonl" or bool(self.path), "workload=jsonl needs workload.path=FILE")


@dataclass(frozen=True)
class BenchConfig:
    """Protocol: untimed warm-up generations, then ``repeat`` timed passes over the workload.

    ``arms`` picks the arm set measured side by side (interleaved per request):
    - ``standard``: the target alone ("baseline") and target + drafter ("spec");
    - ``four_groups``: "baseline" (the target at ``reference_precision`` alone), "quant" (the
      quantized ``target.precision`` alone), "spec" (reference + drafter), "quant+spec";
    - ``gamma_sweep``: "baseline" and one drafting arm "spec-gN" per N in ``gammas`` (and "spec-adaptive"; under
      load too: a serving run takes ``standard`` or ``gamma_sweep``);
    - ``tree_chain``: "baseline", then per N in ``gammas`` "chain-gN" (γ = N) and "tree-nN" (``speculate.tree``
      with max_nodes = N): a token tree and a chain at the same verify width, N + 1 rows;
    - ``drafters``: "baseline", one arm "spec-<kind>" per lookup drafter in ``drafters`` (n-gram, suffix) and,
      with a draft model (+draft=<precision>, +draft=skip), its arm "spec": drafters against each other.
    ``calibrate`` times target forwards of every verify width for the cost model;
    ``baseline_check`` times stock transformers ``generate`` beside the baseline (is our baseline slow?).
    ``cost_per_hour``: the price of one hour of this machine (any currency); the report turns each arm's
    measured output throughput into a cost per 1M output tokens (None: not priced, the checklist says NOT SET).
    """

    warmup: int = 3
    repeat: int = 5
    arms: str = "standard"
    gammas: tuple[int, ...] = (1, 2, 4, 8)
    drafters: tuple[str, ...] = LOOKUP_DRAFTERS
    reference_precision: str = "bf16"
    calibrate: bool = True
    baseline_check: bool = True
    cost_per_hour: float | None = None

    def __post_init__(self) -> None:
        _require(self.warmup >= 0, "bench.warmup must be >= 0")
        cost = self.cost_per_hour
        _require(
            cost is None or (_number(cost, (int, float)) and math.isfinite(cost) and cost > 0),
            f"bench.cost_per_hour={cost!r} must be > 0: set it to the price of one hour of this machine "
            "(any currency), e.g. bench.cost_per_hour=2.5, or null to leave the run unpriced",
        )
        _require(self.repeat >= 1, "bench.repeat must be >= 1")
        _one_of("bench.arms", self.arms, ARM_SETS)
        _one_of("bench.reference_precision", self.reference_precision, FLOAT_PRECISIONS)
        gammas = self.gammas
        _require(
            isinstance(gammas, (list, tuple)) and len(gammas) > 0
            and all(isinstance(g, int) and not isinstance(g, bool) and 1 <= g <= MAX_GAMMA for g in gammas),
            f"bench.gammas={gammas!r} must be a non-empty list of draft lengths in 1..{MAX_GAMMA}, e.g. [1,2,4,8]",
        )  # fmt: skip
        object.__setattr__(self, "gammas", tuple(sorted(set(gammas))))
        drafters = self.drafters
        _require(
            isinstance(drafters, (list, tuple)) and len(drafters) > 0 and all(d in ARM_DRAFTERS for d in drafters),
            f"bench.drafters={drafters!r} must be a non-empty list of {', '.join(ARM_DRAFTERS)}",
        )
        object.__setattr__(self, "drafters", tuple(dict.fromkeys(drafters)))


KERNEL_MODES = ("auto", "reference")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the loaded models compute (DESIGN §7).

    ``kernels=auto``: on the CPU every linear our kernel takes (fp32/bf16 and rtn-* weights) is packed for
    it at load (:mod:`spectoolkit.quant.packing`), and attention over fp32/bf16/fp16/int8/fp8 KV is our
    kernel: every row is computed by itself, so outputs cannot depend on the batch. Other layers
    (LLM.int8, act-order GPTQ, fp16 weights, CUDA) get the fastest row-invariant variant measured on this
    machine (:mod:`spectoolkit.kernels.kernel_choice`, cached per machine fingerprint), and the load
    reports them. ``reference``: every linear as loaded, through its reference variant (stock numerics).
    ``compile``: true runs the steps compiled over the paged pool (:mod:`spectoolkit.runtime.compiled`,
    Llama-family models, KV other than int4), their own row-invariant kernels replacing ``kernels``; false
    the eager runner (:mod:`spectoolkit.runtime.eager`); ``auto`` (the default) the eager runner, for the
    reason :data:`AUTO_COMPILE` gives — the report records it (``conditions.compile``).
    """

    kernels: str = "auto"
    compile: bool | str = "auto"

    def __post_init__(self) -> None:
        _one_of("runtime.kernels", self.kernels, KERNEL_MODES)
        if self.compile is not True and self.compile is not False:
            _one_of("runtime.compile", self.compile, ("auto",))

    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled (``compile`` true; ``auto`` resolves to eager, :data:`AUTO_COMPILE`)."""
        return self.compile is True


# What runtime.compile=auto resolves to, and why (measured: experiments/kernel_bench.py, DESIGN §7).
AUTO_COMPILE = (
    "eager: the decoder layers already run as one call on our kernels (spectoolkit::decoder_layers), "
    "so compiling has little left to remove; compiled steps measured slower on an AMD EPYC Zen 4 "
    "(fp32 36.3 vs 39.6 tok/s, rtn-int4 69.9 vs 75.9) and cost ~45 s of compiling per run"
)


@dataclass(frozen=True)
class ServeConfig:
    """Serving under load (:mod:`spectoolkit.serving`): continuous batching, measured per load level.

    ``enabled``: the run measures load levels instead of one request at a time. Levels: closed loop
    (``concurrency``: N clients, each sends its next request when its previous one finishes) and open
    loop (``rate``: Poisson arrivals, requests/s, from ``sampling.seed``); either list may be empty,
    not both. ``requests_per_level``: requests sent per level and repeat (None: max(prompts, 2×N)).
    Scheduler: ``max_num_tokens`` tokens per step (decode + draft + prefill chunks), ``max_num_seqs``
    running sequences, ``max_kv_tokens`` KV slots (None: enough for ``max_num_seqs`` full sequences),
    KV in blocks of ``block_size`` slots. Load control: speculate only while at most ``spec_max_batch``
    sequences run (None: always), and at most ``max_draft_tokens`` candidate tokens per step (None: no
    cap). ``batch_invariant``: fixed per-row reductions (a request's output cannot depend on its batch);
    a no-op where our CPU kernels run every linear and attention (invariant by construction).
    ``prefix_caching``: finished requests' full KV blocks stay cached (LRU, within ``max_kv_tokens``) and a
    later request with the same prefix starts after them (vLLM's automatic prefix caching); it holds only
    where rows are batch-invariant (a cached prefix then has the bits a recompute would), and a run's
    engines drop the cache at every reset (no arm or level inherits another's). ``sampling_mix``: load runs
    send their requests at these temperatures in turn (e.g. [0, 0.7]: half greedy, half T=0.7; the rest of
    ``sampling``'s settings kept), and the report splits each level by sampling mode; empty: ``sampling``.
    ``slo_ttft_ms``/``slo_tpot_ms``: P99 targets checked in the report. ``step_log``: steps.jsonl.
    """

    enabled: bool = False
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    rate: tuple[float, ...] = ()
    requests_per_level: int | None = None
    warmup_requests: int = 2
    max_num_tokens: int = 256
    max_num_seqs: int = 64
    max_kv_tokens: int | None = None
    block_size: int = 16
    spec_max_batch: int | None = None
    max_draft_tokens: int | None = None
    batch_invariant: bool = False
    prefix_caching: bool = True
    sampling_mix: tuple[float, ...] = ()
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    step_log: bool = False

    def __post_init__(self) -> None:
        levels, rates = self.concurrency, self.rate
        _require(
            isinstance(levels, (list, tuple)) and all(_number(n, int) and n >= 1 for n in levels),
            f"serve.concurrency={levels!r} must be a list of client counts >= 1, e.g. [1,2,4,8,16]",
        )
        _require(
            isinstance(rates, (list, tuple)) and all(_number(r, (int, float)) and r > 0 for r in rates),
            f"serve.rate={rates!r} must be a list of arrival rates > 0 (requests/s), e.g. [0.5,1,2]",
        )
        _require(
            bool(levels) or bool(rates), "serve.concurrency and serve.rate are both empty: give at least one load level"
        )
        object.__setattr__(self, "concurrency", tuple(sorted(set(levels))))
        object.__setattr__(self, "rate", tuple(sorted({float(r) for r in rates})))
        _require(
            self.requests_per_level is None or self.requests_per_level >= 1, "serve.requests_per_level must be >= 1"
        )
        _require(self.warmup_requests >= 0, "serve.warmup_requests must be >= 0")
        _require(self.max_num_tokens >= 1, "serve.max_num_tokens must be >= 1")
        _require(self.max_num_seqs >= 1, "serve.max_num_seqs must be >= 1")
        _require(self.block_size >= 1, "serve.block_size must be >= 1")
        _require(
            self.max_kv_tokens is None or self.max_kv_tokens >= self.block_size,
            "serve.max_kv_tokens must be >= serve.block_size",
        )
        _require(self.spec_max_batch is None or self.spec_max_batch >= 0, "serve.spec_max_batch must be >= 0 or null")
        _require(
            self.max_draft_tokens is None or self.max_draft_tokens >= 0, "serve.max_draft_tokens must be >= 0 or null"
        )
        mix = self.sampling_mix
        _require(
            isinstance(mix, (list, tuple)) and all(_number(t, (int, float)) and t >= 0 for t in mix),
            f"serve.sampling_mix={mix!r} must be a list of temperatures >= 0 (0: greedy), e.g. [0,0.7]",
        )
        object.__setattr__(self, "sampling_mix", tuple(float(t) for t in mix))
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"serve.{name} must be > 0 (milliseconds) or null")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    """An address of this machine: 127.0.0.0/8, ::1 or localhost (a name merely starting "127." is not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass(frozen=True)
class ServerConfig:
    """``python -m spectoolkit.serve``: the OpenAI-compatible server on the serving engine (issue 17).

    ``model_name``: the id clients send as ``model`` (None: ``model.name``). ``request_timeout_s``: a
    request still running after this is cancelled (504). ``shutdown_timeout_s``: on Ctrl-C / SIGTERM,
    in-flight requests get this long to finish, then are cancelled. ``default_max_tokens``: completions
    without ``max_tokens`` (OpenAI's default 16). Binding beyond loopback needs ``allow_remote=true``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    request_timeout_s: float = 600.0
    shutdown_timeout_s: float = 30.0
    default_max_tokens: int = 16
    allow_remote: bool = False

    def __post_init__(self) -> None:
        _require(1 <= self.port <= 65535, f"server.port={self.port} must be in 1..65535")
        _require(self.request_timeout_s > 0, "server.request_timeout_s must be > 0 (seconds)")
        _require(self.shutdown_timeout_s >= 0, "server.shutdown_timeout_s must be >= 0 (seconds)")
        _require(self.default_max_tokens >= 1, "server.default_max_tokens must be >= 1")
        _require(
            self.allow_remote or is_loopback(self.host),
            f"server.host={self.host} is not a loopback address: set server.allow_remote=true to listen there",
        )


BACKEND_KINDS = ("local", "endpoint", "vllm", "llamacpp")


@dataclass(frozen=True)
class BackendConfig:
    """Where a serving run's arms run (issue 17).

    - ``local``: our engine, in process.
    - ``endpoint``: any OpenAI-compatible servers, given as base URLs (``http://127.0.0.1:8000/v1``):
      ``baseline_url`` (the target alone) and ``spec_url`` (speculative; null: baseline only). ``model``
      is the id to send (null: the first of each server's ``/v1/models``).
    - ``vllm``: vLLM servers started by us from this config (``make vllm`` installs vLLM in
      ``vllm_env``), on ``port`` (baseline) and ``port + 1`` (speculative); ``eagle_path``: an EAGLE head
      checkpoint for ``draft.kind=eagle``-style speculation; ``vllm_args``: extra server flags.
    - ``llamacpp``: llama-server processes started by us (``make llama-cpp`` builds them into
      ``llamacpp_dir/bin``) on the GGUF files of the target and draft, on ``port`` and ``port + 1`` like vLLM;
      ``llamacpp_spec_type``: llama.cpp's speculative type (null: from the drafter: draft-simple for a draft
      model, ngram-simple for +draft=ngram); ``llamacpp_slots``: parallel slots (null: the largest
      serve.concurrency); ``llamacpp_ctx_per_slot``: context tokens per slot; ``llamacpp_args``: extra flags.
    Timeouts (seconds): ``connect_timeout_s`` per connection, ``read_timeout_s`` between stream chunks,
    ``request_timeout_s`` per request, ``startup_timeout_s`` for a managed server to become healthy.
    Only loopback addresses are targeted unless ``allow_remote=true``.
    """

    kind: str = "local"
    baseline_url: str | None = None
    spec_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 900.0
    allow_remote: bool = False
    vllm_env: str = ".venv-vllm"
    host: str = "127.0.0.1"
    port: int = 8100
    eagle_path: str | None = None
    vllm_args: tuple[str, ...] = ()
    vllm_kv_cache_gib: int = 2
    vllm_threads_bind: str | None = None  # CPU build: null = every core (as our engine); "auto" = vLLM's choice
    llamacpp_dir: str = ".llama-cpp"
    llamacpp_spec_type: str | None = None
    llamacpp_slots: int | None = None
    llamacpp_ctx_per_slot: int = 4096
    llamacpp_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _one_of("backend.kind", self.kind, BACKEND_KINDS)
        for name in ("connect_timeout_s", "read_timeout_s", "request_timeout_s", "startup_timeout_s"):
            _require(getattr(self, name) > 0, f"backend.{name} must be > 0 (seconds)")
        _require(1 <= self.port <= 65534, f"backend.port={self.port} must be in 1..65534 (port + 1 is used too)")
        _require(self.vllm_kv_cache_gib >= 1, "backend.vllm_kv_cache_gib must be >= 1")
        _require(
            self.kind != "endpoint" or bool(self.baseline_url),
            "backend=endpoint needs backend.baseline_url=URL (an OpenAI base URL such as http://127.0.0.1:8000/v1)",
        )
        _require(self.llamacpp_slots is None or self.llamacpp_slots >= 1, "backend.llamacpp_slots must be >= 1")
        _require(self.llamacpp_ctx_per_slot >= 16, "backend.llamacpp_ctx_per_slot must be >= 16 (tokens)")
        object.__setattr__(self, "vllm_args", tuple(str(arg) for arg in self.vllm_args))
        object.__setattr__(self, "llamacpp_args", tuple(str(arg) for arg in self.llamacpp_args))


EVAL_KINDS = ("none", "exactness", "lmeval")


@dataclass(frozen=True)
class EvalConfig:
    """A quality job instead of (``exactness``: beside) the timed protocol; ``none`` runs only the bench.

    - ``exactness`` (``+eval=exactness``): the greedy exactness report with near-tie classification,
      the analytic total variation of the stochastic verifier (``max_tv``) and the empirical
      distribution test with its negative control; ``temperature`` etc. come from ``sampling``
      (a greedy run uses ``stochastic_temperature`` for the stochastic parts).
    - ``lmeval`` (``+eval=lmeval``): lm-eval ``tasks`` for the reference target and for the
      speculative configuration, scores side by side.
    """

    kind: str = "none"
    # exactness
    stochastic_temperature: float = 1.0  # for the stochastic tests when sampling is greedy
    analytic_positions: int = 16  # real positions per prompt scored by the analytic TV
    samples: int = 400  # empirical: continuations per sampler (target alone, spec, negative control)
    length: int = 3  # empirical: tokens per continuation (>= 3: the first comes from the prefill)
    significance: float = 0.01  # empirical: reject equality when the smallest p-value is below this
    # lmeval
    tasks: tuple[str, ...] = ()
    limit: int | None = None  # documents per task (None: all)
    allow_code_execution: bool = False  # HumanEval runs model-written code: opt in explicitly

    def __post_init__(self) -> None:
        _one_of("eval.kind", self.kind, EVAL_KINDS)
        _require(self.stochastic_temperature > 0, "eval.stochastic_temperature must be > 0")
        _require(self.analytic_positions >= 1, "eval.analytic_positions must be >= 1")
        _require(self.samples >= 20, "eval.samples must be >= 20 (the distribution test needs counts)")
        _require(self.length >= 3, "eval.length must be >= 3 (shorter continuations leave nothing to draft)")
        _require(0 < self.significance < 1, "eval.significance must be in (0, 1)")
        _require(self.limit is None or self.limit >= 1, "eval.limit must be >= 1 or null")
        tasks = self.tasks
        _require(
            isinstance(tasks, (list, tuple)) and all(isinstance(task, str) and task for task in tasks),
            f"eval.tasks={tasks!r} must be a list of lm-eval task names, e.g. [spectoolkit_shortqa]",
        )
        object.__setattr__(self, "tasks", tuple(tasks))


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs. ``output_dir`` receives records.jsonl and summary.json."""

    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    speculate: SpeculateConfig = field(default_factory=SpeculateConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    quant_quality: QuantQualityConfig = field(default_factory=QuantQualityConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    device: str = "auto"
    output_dir: str = "."
    resume: bool = True  # skip when output_dir holds a complete job of this config (spectoolkit.bench.sweep.jobs)

    def __post_init__(self) -> None:
        _one_of("device", self.device, DEVICES)


_SCALAR_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_type(name: str, value: Any, annotation: str) -> None:
    """Reject a value of the wrong type (``gamma=2.5``, ``warmup=1.5``) before it reaches the run."""
    options = [option.strip() for option in annotation.split("|")]
    if value is None and "None" in options:
        return
    allowed = tuple(t for option in options for t in _SCALAR_TYPES.get(option, ()))
    if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
        expected = " or ".join("null" if option == "None" else option for option in options)
        raise SpecToolkitError(f"{name}={value!r} must be of type {expected}")


def _build(cls: type, values: dict[str, Any] | None, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from ``values``, recursing into dataclass-typed fields."""
    _require(values is None or isinstance(values, dict), f"{prefix[:-1]} must be a section, got {values!r}")
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    _require(not unknown, f"unknown config option(s): {', '.join(prefix + k for k in unknown)}")
    kwargs = {}
    for name, value in values.items():
        sub = _SECTIONS.get(name) if cls is RunConfig else _NESTED.get((cls, name))
        if not sub:
            _check_type(prefix + name, value, str(fields[name].type))
        kwargs[name] = _build(sub, value, f"{prefix}{name}.") if sub else value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a scalar where a section was expected, etc.
        raise SpecToolkitError(f"bad config for {prefix or 'run'}: {exc}") from None


_SECTIONS = {
    "target": TargetConfig,
    "draft": DraftConfig,
    "model": ModelConfig,
    "sampling": SamplingConfig,
    "speculate": SpeculateConfig,
    "workload": WorkloadConfig,
    "bench": BenchConfig,
    "kv": KVConfig,
    "quant_quality": QuantQualityConfig,
    "eval": EvalConfig,
    "runtime": RuntimeConfig,
    "serve": ServeConfig,
    "server": ServerConfig,
    "backend": BackendConfig,
}


_NESTED = {(SpeculateConfig, "tree"): TreeConfig}  # sections inside sections


def drafter_kinds(cfg: RunConfig) -> set[str]:
    """The drafters a run of ``cfg`` builds: ``draft.kind``, ``bench.drafters`` under ``bench.arms=drafters``, and
    the hybrid's parts (suffix, and ``draft.hybrid_with``: eagle, or model, the draft model)."""
    kinds = {cfg.draft.kind} | (set(cfg.bench.drafters) if cfg.bench.arms == "drafters" else set())
    return kinds | {"suffix", cfg.draft.hybrid_with} if "hybrid" in kinds else kinds


def run_config_from_dict(values: dict[str, Any]) -> RunConfig:
    """Build a validated :class:`RunConfig` from a nested dict; unknown keys raise SpecToolkitError."""
    return _build(RunConfig, values, "")
