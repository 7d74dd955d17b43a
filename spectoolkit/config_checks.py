"""Settings that would do nothing, or less than asked, stop the run before it starts.

Two checks over a validated :class:`~spectoolkit.config.RunConfig`, run once by each entry point:

- **Dead keys** (:data:`RULES`): a key someone set that no code path of this run reads, e.g.
  ``speculate.tree.branching`` without ``speculate.tree.kind=static``. Each row of the table names a key
  (or a section: every key below it), when the key takes effect, and the switch that turns it on; a key
  set while a covering row says it has no effect is an error naming the key and that switch.
- **Cut trees**: a static tree larger than ``speculate.tree.max_nodes`` (cut breadth first), or a
  ``speculate.tree.max_depth`` deeper than a tree of ``max_nodes`` nodes can be, is an error; under
  ``bench.arms=tree_chain``, where each arm's node budget is meant to cut the tree, a warning, which
  :func:`config_warnings` returns for the run's conditions.

Who set a key: the Hydra entry points pass the command line's task overrides (:func:`override_keys`:
a key given there counts even when equal to its default; a value from an ``experiment=`` or config
group file does not); library callers pass nothing, and the keys whose values differ from the
dataclass defaults count (:func:`changed_keys`). The entry point matters: ``python -m spectoolkit``
(``run``) and the HTTP server ``python -m spectoolkit.serve`` (``serve``) read different keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from spectoolkit.config import MAX_TREE_NODES, RunConfig, drafter_kinds
from spectoolkit.errors import SpecToolkitError
from spectoolkit.precisions import FLOAT_PRECISIONS, QUANT_PRECISIONS

Entry = Literal["run", "serve"]  # python -m spectoolkit | python -m spectoolkit.serve
GROUPWISE = ("rtn-int8", "rtn-int4", "int4")  # precisions that quantize in groups of group_size (quant backends)
HEAD_QUANTIZING = ("rtn-int8", "rtn-int4")  # draft models whose lm_head draft.quantize_head can quantize
HEAD_PRUNING = (*FLOAT_PRECISIONS, *HEAD_QUANTIZING)  # draft models whose lm_head draft.head_vocab can cut
HYDRA_GROUPS = ("experiment", "hydra")  # undotted override keys that choose files, besides the config sections
SERVE_LOAD = ("enabled", "rate", "requests_per_level", "warmup_requests", "slo_ttft_ms", "slo_tpot_ms", "step_log")
SERVE_ENGINE = ("concurrency", "max_num_tokens", "max_num_seqs", "max_kv_tokens", "block_size", "spec_max_batch",
                "max_draft_tokens", "batch_invariant")  # fmt: skip
SERVING_UNUSED_BENCH = ("warmup", "calibrate", "baseline_check", "reference_precision")
SERVING_ARM_SETS = ("standard", "gamma_sweep")  # what bench.arms a serving run measures (spectoolkit.serving.assemble)
CLIENT_KEYS = ("model", "api_key", "connect_timeout_s", "read_timeout_s", "request_timeout_s", "allow_remote")
MANAGED_KEYS = ("host", "port", "startup_timeout_s")  # servers this run starts: vLLM or llama.cpp
VLLM_KEYS = ("vllm_env", "eagle_path", "vllm_args", "vllm_kv_cache_gib", "vllm_threads_bind")
LLAMACPP_KEYS = ("llamacpp_dir", "llamacpp_spec_type", "llamacpp_slots", "llamacpp_ctx_per_slot", "llamacpp_args")
EXACTNESS_KEYS = ("stochastic_temperature", "analytic_positions", "samples", "length", "significance")
LMEVAL_KEYS = ("tasks", "limit", "allow_code_execution")
TREE_DRAFTER = (
    "use a draft model (+draft=<precision>), +draft=skip or +draft=eagle (prompt lookup grows a trie of its matches)"
)

Effective = Callable[[RunConfig, Entry], bool]


@dataclass(frozen=True)
class Rule:
    """``key`` (a dotted key, or a section covering every key below it) has an effect only where
    ``effective`` holds; otherwise it has no effect ``needs`` (may name ``{cfg}``), and ``fix`` turns it on
    ("": nothing in this run does)."""

    key: str
    effective: Effective
    needs: str
    fix: str = ""

    def covers(self, key: str) -> bool:
        return key == self.key or key.startswith(self.key + ".")

    def message(self, key: str, cfg: RunConfig) -> str:
        fix = f"{self.fix}, or drop the override" if self.fix else "drop the override"
        return f"{key} has no effect {self.needs.format(cfg=cfg)}: {fix}"


def _batch1(cfg: RunConfig, entry: Entry) -> bool:
    """``python -m spectoolkit`` running the timed batch-1 protocol (no quality job, no load levels)."""
    return entry == "run" and cfg.eval.kind == "none" and not cfg.serve.enabled


def _drafts(cfg: RunConfig, entry: Entry) -> bool:
    """A drafter runs: ours, or a server's (backend=endpoint/vllm records speculate.gamma, an EAGLE head uses it)."""
    return cfg.draft.kind != "none" or (entry == "run" and cfg.backend.kind != "local")


def _looks_up(cfg: RunConfig, kind: str) -> bool:
    """A drafter of ``kind`` runs: as +draft=kind, as an arm of bench.arms=drafters, or inside the hybrid (suffix,
    eagle)."""
    return kind in drafter_kinds(cfg)


def _tree_drafter(cfg: RunConfig) -> bool:
    """Grows branching/dynamic trees; n-gram lookup builds a trie of its matches whatever the tree kind."""
    return cfg.draft.kind in ("model", "skip", "eagle", "hybrid")


def _static_tree(cfg: RunConfig) -> bool:
    return cfg.speculate.tree.kind == "static" and _tree_drafter(cfg)


def _quant_quality_on(cfg: RunConfig) -> bool:
    enabled = cfg.quant_quality.enabled
    return enabled if enabled is not None else cfg.target.precision in QUANT_PRECISIONS


def _draft_groupwise(cfg: RunConfig) -> bool:
    draft = cfg.draft
    if draft.kind == "skip":
        return draft.skip_precision is not None  # the kept layers of an rtn-* copy of the target
    return _drafts_with_model(cfg) and draft.precision in GROUPWISE


def _drafts_with_model(cfg: RunConfig) -> bool:
    """A draft model runs: +draft=<precision>, or the hybrid with draft.hybrid_with=model."""
    return "model" in drafter_kinds(cfg)


def _rows(keys: Iterable[str], effective: Effective, needs: str, fix: str = "") -> tuple[Rule, ...]:
    """One rule per key with the same condition."""
    return tuple(Rule(key, effective, needs, fix) for key in keys)


_SERVER = "in python -m spectoolkit.serve (it serves HTTP requests with the engine in process)"
_QUALITY_JOB = "in a quality job (+eval={cfg.eval.kind} runs its own protocol)"
_SERVING = "in a serving run (serve.enabled=true measures baseline and spec at load levels)"
_NO_DRAFT_MODEL = "without a draft model (draft.kind=model)"

# The first row that covers a key and does not hold names why the key has no effect, so the broad rows
# (entry points, jobs, no drafter) come before the narrow ones. A table reads best one row per line.
# fmt: off
RULES: tuple[Rule, ...] = (
    # whole sections an entry point or a job never reads
    Rule("server", lambda c, e: e == "serve", "outside python -m spectoolkit.serve", "run python -m spectoolkit.serve"),
    *_rows(("bench", "eval", "workload", "backend", "quant_quality"), lambda c, e: e == "run", _SERVER),
    *_rows([f"serve.{key}" for key in SERVE_LOAD], lambda c, e: e == "run", f"{_SERVER[:-1]}, not load levels)"),
    *_rows(("bench", "serve", "backend"), lambda c, e: e == "serve" or c.eval.kind == "none", _QUALITY_JOB),
    *_rows(("workload", "quant_quality"), lambda c, e: c.eval.kind != "lmeval",
           "in +eval=lmeval (lm-eval's tasks give the prompts)"),
    # serving runs and their back-ends
    *_rows([f"serve.{key}" for key in SERVE_LOAD[1:] + SERVE_ENGINE], lambda c, e: e == "serve" or c.serve.enabled,
           "outside a serving run (serve.enabled=false)", "set serve.enabled=true (or experiment=concurrency_sweep)"),
    *_rows([f"bench.{key}" for key in SERVING_UNUSED_BENCH], lambda c, e: not c.serve.enabled, _SERVING,
           "set serve.enabled=false"),
    Rule("bench.arms", lambda c, e: not c.serve.enabled or c.bench.arms in SERVING_ARM_SETS,
         "in a serving run (it measures bench.arms=standard or gamma_sweep)", "set bench.arms=gamma_sweep"),
    Rule("quant_quality", lambda c, e: c.eval.kind != "none" or not c.serve.enabled, _SERVING,
         "set serve.enabled=false"),
    *_rows([f"backend.{key}" for key in CLIENT_KEYS], lambda c, e: c.backend.kind != "local",
           "with backend=local (our engine, in process)", "set backend=endpoint, vllm or llamacpp"),
    *_rows(("backend.baseline_url", "backend.spec_url"), lambda c, e: c.backend.kind == "endpoint",
           "without backend=endpoint (backend=vllm|llamacpp give the URLs of the servers they start)",
           "set backend=endpoint"),
    *_rows([f"backend.{key}" for key in MANAGED_KEYS], lambda c, e: c.backend.kind in ("vllm", "llamacpp"),
           "without servers to start (backend=vllm or llamacpp)", "set backend=vllm or backend=llamacpp"),
    *_rows([f"backend.{key}" for key in VLLM_KEYS], lambda c, e: c.backend.kind == "vllm", "without backend=vllm",
           "set backend=vllm"),
    *_rows([f"backend.{key}" for key in LLAMACPP_KEYS], lambda c, e: c.backend.kind == "llamacpp",
           "without backend=llamacpp", "set backend=llamacpp"),
    # the batch-1 protocol's arm sets
    Rule("bench.drafters", lambda c, e: c.bench.arms == "drafters", "without bench.arms=drafters",
         "set bench.arms=drafters"),
    Rule("bench.gammas", lambda c, e: c.bench.arms in ("gamma_sweep", "tree_chain"),
         "without bench.arms=gamma_sweep or tree_chain", "set bench.arms=gamma_sweep (or tree_chain)"),
    Rule("bench.reference_precision", lambda c, e: c.bench.arms == "four_groups", "without bench.arms=four_groups",
         "set bench.arms=four_groups (or experiment=four_groups)"),
    # quality jobs
    *_rows([f"eval.{key}" for key in EXACTNESS_KEYS], lambda c, e: c.eval.kind == "exactness",
           "without +eval=exactness", "set +eval=exactness"),
    Rule("eval.stochastic_temperature", lambda c, e: c.sampling.greedy,
         "with sampling.temperature={cfg.sampling.temperature} (the stochastic checks use the run's own sampling)"),
    *_rows([f"eval.{key}" for key in LMEVAL_KEYS], lambda c, e: c.eval.kind == "lmeval", "without +eval=lmeval",
           "set +eval=lmeval"),
    *_rows(("quant_quality.reference", "quant_quality.num_texts", "quant_quality.max_tokens"),
           lambda c, e: _quant_quality_on(c), "while quantization quality is not measured (quant_quality.enabled "
           "is false, or null with the unquantized target.precision={cfg.target.precision})",
           "set quant_quality.enabled=true"),
    # the drafter and its trees
    Rule("speculate", _drafts, "with +draft=none (nothing drafts)",
         "choose a drafter (+draft=ngram, +draft=suffix, +draft=eagle, +draft=<precision> or +draft=skip)"),
    Rule("speculate.confidence", lambda c, e: c.speculate.policy == "confidence",
         "without speculate.policy=confidence", "set speculate.policy=confidence"),
    *_rows(("speculate.decay", "speculate.probe_every"),
           lambda c, e: c.speculate.policy == "adaptive" or c.bench.arms == "gamma_sweep",
           "without speculate.policy=adaptive (or bench.arms=gamma_sweep, whose spec-adaptive arm uses it)",
           "set speculate.policy=adaptive"),
    *_rows(("speculate.tree.max_nodes", "speculate.tree.max_depth"), lambda c, e: c.speculate.tree.enabled,
           "without a token tree (speculate.tree.kind=none)", "set speculate.tree.kind=static or dynamic"),
    Rule("speculate.tree.branching", lambda c, e: c.speculate.tree.kind == "static",
         "without speculate.tree.kind=static", "set speculate.tree.kind=static"),
    Rule("speculate.tree.top_k", lambda c, e: c.speculate.tree.kind == "dynamic",
         "without speculate.tree.kind=dynamic", "set speculate.tree.kind=dynamic"),
    *_rows(("speculate.tree.branching", "speculate.tree.top_k"), lambda c, e: _tree_drafter(c),
           "with draft.kind={cfg.draft.kind}", TREE_DRAFTER),
    Rule("speculate.tree.max_depth", lambda c, e: not _static_tree(c),
         "on a static tree (its depth is len(speculate.tree.branching))",
         "shorten speculate.tree.branching, or set speculate.tree.kind=dynamic"),
    # the drafter's own keys
    *_rows(("draft.precision", "draft.quantize_head", "model.draft_path"), lambda c, e: _drafts_with_model(c),
           _NO_DRAFT_MODEL, "choose one with +draft=<precision>"),
    Rule("draft.head_vocab", lambda c, e: _drafts_with_model(c), _NO_DRAFT_MODEL, "choose one with +draft=<precision>"),
    Rule("draft.head_vocab", lambda c, e: c.draft.precision in HEAD_PRUNING,
         "on a {cfg.draft.precision} draft model (its lm_head comes quantized by its own backend)",
         "use a float or rtn-* draft (+draft=bf16, +draft=rtn-int4)"),
    Rule("draft.quantize_head", lambda c, e: c.draft.precision in HEAD_QUANTIZING or not c.draft.quantize_head,
         "on a {cfg.draft.precision} draft model (only rtn-* quantize their lm_head)",
         "use +draft=rtn-int8 or +draft=rtn-int4"),
    *_rows(("draft.skip_every", "draft.layers", "draft.skip_precision"), lambda c, e: c.draft.kind == "skip",
           "without +draft=skip", "set +draft=skip"),
    Rule("draft.skip_every", lambda c, e: not c.draft.layers, "with draft.layers given (exactly those layers run)",
         "drop draft.layers"),
    *_rows(("draft.ngram_max", "draft.ngram_min"), lambda c, e: _looks_up(c, "ngram"),
           "without +draft=ngram (or bench.arms=drafters with ngram)", "set +draft=ngram"),
    *_rows(("draft.suffix_max_match", "draft.suffix_min_match", "draft.suffix_factor", "draft.suffix_min_prob",
            "draft.suffix_cache_tokens"),
           lambda c, e: _looks_up(c, "suffix"), "without +draft=suffix (or bench.arms=drafters with suffix)",
           "set +draft=suffix"),
    Rule("draft.eagle_path", lambda c, e: _looks_up(c, "eagle"),
         "without +draft=eagle or +draft=hybrid (with draft.hybrid_with=eagle)", "set +draft=eagle"),
    Rule("draft.hybrid_with", lambda c, e: _looks_up(c, "hybrid"), "without +draft=hybrid",
         "set +draft=hybrid"),
    Rule("draft.group_size", lambda c, e: _draft_groupwise(c), "without a group-wise quantized draft "
         "(+draft=rtn-int8, rtn-int4 or int4, or +draft=skip with draft.skip_precision)",
         "quantize the draft group-wise"),
    Rule("kv.draft", lambda c, e: _drafts_with_model(c) or c.draft.kind == "skip",
         "with draft.kind={cfg.draft.kind} (no draft model with a KV precision of its own)",
         "use a draft model (+draft=<precision>) or +draft=skip"),
    # everything else
    Rule("target.group_size", lambda c, e: c.target.precision in GROUPWISE,
         "with target.precision={cfg.target.precision} (only rtn-int8, rtn-int4 and int4 quantize in groups)",
         "set +target=rtn-int8, rtn-int4 or int4"),
    *_rows(("sampling.top_k", "sampling.top_p"),
           lambda c, e: e != "run" or not c.sampling.greedy or c.eval.kind == "exactness",
           "with greedy decoding (sampling.temperature=0)", "set sampling=random (or sampling.temperature > 0)"),
    Rule("workload.path", lambda c, e: c.workload.kind == "jsonl", "without workload=jsonl", "set workload=jsonl"),
    Rule("runtime.kernels", lambda c, e: not c.runtime.compiled,
         "with runtime.compile=true (the compiled steps bring their own row-invariant kernels)",
         "set runtime.compile=false"),
)
# fmt: on


def override_keys(overrides: Iterable[str]) -> set[str]:
    """The config keys a Hydra command line sets (``HydraConfig.get().overrides.task``).

    ``speculate.gamma=8`` and ``+eval.samples=100`` set keys; ``+draft=bf16``, ``experiment=four_groups``
    and ``hydra/launcher=joblib`` choose config files (what those set is not the user's); ``~key`` deletes.
    """
    sections = {f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.default_factory)}
    keys = set()
    for override in overrides:
        if override.startswith("~"):
            continue
        key = override.lstrip("+").split("=", 1)[0].split("@", 1)[0].strip()
        if "/" in key or key.split(".")[0] == "hydra" or key in sections or key in HYDRA_GROUPS:
            continue
        keys.add(key)
    return keys


def changed_keys(cfg: RunConfig) -> set[str]:
    """The dotted keys of ``cfg`` whose values differ from the dataclass defaults (library callers)."""
    return set(_changed(cfg, RunConfig(), ""))


def _changed(value: Any, default: Any, prefix: str) -> Iterator[str]:
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _changed(getattr(value, f.name), getattr(default, f.name), f"{prefix}{f.name}.")
    elif value != default:
        yield prefix[:-1]


def dead_keys(cfg: RunConfig, keys: Iterable[str], entry: Entry = "run") -> list[str]:
    """One message per key in ``keys`` that has no effect in ``cfg`` (the first covering rule that says so)."""
    messages = []
    for key in sorted(keys):
        rule = next((r for r in RULES if r.covers(key) and not r.effective(cfg, entry)), None)
        if rule is not None:
            messages.append(rule.message(key, cfg))
    return messages


def tree_nodes(branching: Iterable[int]) -> list[int]:
    """Nodes of the full static tree at depths 1..len(branching): [3, 2, 1, 1] → [3, 6, 6, 6] (21 in all)."""
    level, counts = 1, []
    for children in branching:
        level *= children
        counts.append(level)
    return counts


def _cut_depth(branching: tuple[int, ...], budget: int) -> int:
    """Depth of the static tree kept when its first ``budget`` nodes are kept, breadth first."""
    total = 0
    for depth, count in enumerate(tree_nodes(branching), start=1):
        total += count
        if total >= budget:
            return depth
    return len(branching)


def _tree_chain(cfg: RunConfig, entry: Entry) -> bool:
    """``bench.arms=tree_chain`` runs: each arm's node budget (bench.gammas) is meant to cut the tree."""
    return _batch1(cfg, entry) and cfg.bench.arms == "tree_chain"


def _depth_cap(cfg: RunConfig) -> int | None:
    """An explicit ``speculate.tree.max_depth`` this run's trees use (dynamic trees, n-gram tries)."""
    tree = cfg.speculate.tree
    used = tree.enabled and cfg.draft.kind != "none" and not _static_tree(cfg)
    return tree.max_depth if used else None


def _cut_trees(cfg: RunConfig, entry: Entry, keys: set[str]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for trees cut below what their settings ask (see the module docstring)."""
    tree, errors, warnings = cfg.speculate.tree, [], []
    branching, depth = f"[{','.join(map(str, tree.branching))}]", _depth_cap(cfg)
    nodes = sum(tree_nodes(tree.branching)) if _static_tree(cfg) else 0
    if _tree_chain(cfg, entry):
        cut = [f"tree-n{n} (depth {_cut_depth(tree.branching, n)})" for n in cfg.bench.gammas if nodes > n]
        if cut:
            warnings.append(f"bench.arms=tree_chain cuts the static tree speculate.tree.branching={branching} "
                            f"({nodes} nodes) to each arm's node budget, breadth first: {', '.join(cut)}")  # fmt: skip
        short = [f"tree-n{n}" for n in cfg.bench.gammas if depth is not None and depth > n]
        if short:
            warnings.append(f"bench.arms=tree_chain: speculate.tree.max_depth={depth} is out of reach of "
                            f"{', '.join(short)} (a tree of N nodes is at most N deep)")  # fmt: skip
        return errors, warnings
    if nodes > tree.max_nodes:
        default = "" if "speculate.tree.branching" in keys else " (the default)"
        fix = f"set speculate.tree.max_nodes={nodes}, or shrink speculate.tree.branching"
        if nodes > MAX_TREE_NODES:
            fix = f"shrink speculate.tree.branching to at most {MAX_TREE_NODES} nodes (the most a tree verifies)"
        kept = f"{tree.max_nodes} breadth first (a depth-{_cut_depth(tree.branching, tree.max_nodes)} tree)"
        errors.append(
            f"speculate.tree.branching={branching}{default} grows a tree of {nodes} nodes, but "
            f"speculate.tree.max_nodes={tree.max_nodes} keeps its first {kept}: {fix}"
        )
    if depth is not None and depth > tree.max_nodes:
        raise_nodes = f", or set speculate.tree.max_nodes={depth}" if depth <= MAX_TREE_NODES else ""
        errors.append(
            f"speculate.tree.max_depth={depth} is out of reach: a tree of speculate.tree.max_nodes={tree.max_nodes} "
            f"nodes is at most {tree.max_nodes} deep: set speculate.tree.max_depth={tree.max_nodes}{raise_nodes}"
        )
    return errors, warnings


def config_warnings(cfg: RunConfig, entry: Entry = "run") -> list[str]:
    """What this run does less than its settings say, by design (recorded in the run's conditions)."""
    return _cut_trees(cfg, entry, set())[1]


def check_config(cfg: RunConfig, given: Iterable[str] | None = None, entry: Entry = "run") -> list[str]:
    """Raise one SpecToolkitError for every setting of ``cfg`` that has no effect or is cut; return the warnings.

    ``given``: the keys the user set (:func:`override_keys` of a command line); None: the keys whose
    values differ from the defaults (:func:`changed_keys`). ``entry``: which program runs ``cfg``.
    """
    keys = changed_keys(cfg) if given is None else set(given)
    cut_errors, warnings = _cut_trees(cfg, entry, keys)
    errors = dead_keys(cfg, keys, entry) + cut_errors
    if errors:
        raise SpecToolkitError("; ".join(errors))
    return warnings
