"""Settings that do nothing, or less than asked, are one clear error (spectoolkit.config_checks).

Per rule: a context where the key takes effect (no error) and one where it does not (the error names the
key and the switch that turns it on); every row of RULES is the reason in at least one case. Then the
cut-tree checks, who counts as having set a key, and every command the README and the conf/ files show.
"""

from __future__ import annotations

import itertools
import re
import shlex
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_module

from spectoolkit.__main__ import config_from_hydra
from spectoolkit.config import run_config_from_dict
from spectoolkit.config_checks import (
    CLIENT_KEYS,
    EXACTNESS_KEYS,
    LLAMACPP_KEYS,
    LMEVAL_KEYS,
    MANAGED_KEYS,
    RULES,
    SERVE_ENGINE,
    SERVE_LOAD,
    SERVING_UNUSED_BENCH,
    VLLM_KEYS,
    changed_keys,
    check_config,
    config_warnings,
    dead_keys,
    override_keys,
    tree_nodes,
)
from spectoolkit.errors import SpecToolkitError
from spectoolkit.metrics.summary_schema import Summary

README = Path(__file__).resolve().parent.parent / "README.md"
OUT = "/tmp/spectoolkit-test-out"
URL = "http://127.0.0.1:8000/v1"

MODEL = {"draft": {"kind": "model", "precision": "bf16"}}
SERVING = {"serve": {"enabled": True}}
EXACTNESS, LMEVAL = {"eval": {"kind": "exactness"}}, {"eval": {"kind": "lmeval"}}
ENDPOINT = {"serve": {"enabled": True}, "backend": {"kind": "endpoint", "baseline_url": URL}}
VLLM = {"serve": {"enabled": True}, "backend": {"kind": "vllm"}}
LLAMACPP = {"serve": {"enabled": True}, "backend": {"kind": "llamacpp"}}


def _tree(kind: str, draft: str = "model", **tree: Any) -> dict[str, Any]:
    """A token tree of ``kind`` drafted by ``draft``; a static one of 8 nodes, [2,1,1,1], unless ``tree`` says."""
    tree = {"kind": kind, **({"branching": [2, 1, 1, 1]} if kind == "static" else {}), **tree}
    return {"draft": {"kind": draft}, "speculate": {"tree": tree}}


# (key, entry, context where it has no effect, words of the error, context where it takes effect, its entry)
Case = tuple[str, str, dict, str, dict, str]
# A table reads best one case per line.
# fmt: off
CASES: list[Case] = [
    ("server.port", "run", {}, "outside python -m spectoolkit.serve", {}, "serve"),
    ("bench.repeat", "serve", {}, "in python -m spectoolkit.serve", {}, "run"),
    ("workload.num_prompts", "serve", {}, "in python -m spectoolkit.serve", {}, "run"),
    ("eval.samples", "serve", EXACTNESS, "in python -m spectoolkit.serve", EXACTNESS, "run"),
    ("backend.baseline_url", "serve", ENDPOINT, "in python -m spectoolkit.serve", ENDPOINT, "run"),
    ("quant_quality.enabled", "serve", {}, "in python -m spectoolkit.serve", {}, "run"),
    *((f"serve.{key}", "serve", {}, "not load levels", SERVING, "run") for key in SERVE_LOAD),
    ("bench.warmup", "run", EXACTNESS, "+eval=exactness runs its own protocol", {}, "run"),
    ("backend.model", "run", EXACTNESS, "+eval=exactness runs its own protocol", ENDPOINT, "run"),
    ("serve.enabled", "run", LMEVAL, "+eval=lmeval runs its own protocol", {}, "run"),
    ("workload.max_new_tokens", "run", LMEVAL, "in +eval=lmeval", EXACTNESS, "run"),
    ("quant_quality.enabled", "run", LMEVAL, "in +eval=lmeval", EXACTNESS, "run"),
    *((f"serve.{key}", "run", {}, "set serve.enabled=true", SERVING, "run") for key in SERVE_LOAD[1:] + SERVE_ENGINE),
    ("serve.concurrency", "run", {}, "set serve.enabled=true", {}, "serve"),  # the server sizes its KV pool with it
    *((f"bench.{key}", "run", SERVING, "set serve.enabled=false",
       {"bench": {"arms": "gamma_sweep" if key == "gammas" else "four_groups"}}, "run")
      for key in SERVING_UNUSED_BENCH),
    ("quant_quality.enabled", "run", SERVING, "set serve.enabled=false", {}, "run"),
    ("bench.arms", "run", {**SERVING, "bench": {"arms": "four_groups"}}, "set bench.arms=gamma_sweep",
     {**SERVING, "bench": {"arms": "gamma_sweep"}}, "run"),  # a serving run measures the fixed γ arms and adaptive
    *((f"backend.{key}", "run", SERVING, "set backend=endpoint, vllm or llamacpp", ENDPOINT, "run")
      for key in CLIENT_KEYS),
    ("backend.request_timeout_s", "run", SERVING, "set backend=endpoint, vllm or llamacpp", VLLM, "run"),
    ("backend.request_timeout_s", "run", SERVING, "set backend=endpoint, vllm or llamacpp", LLAMACPP, "run"),
    *((f"backend.{key}", "run", VLLM, "set backend=endpoint", ENDPOINT, "run") for key in ("baseline_url", "spec_url")),
    *((f"backend.{key}", "run", ENDPOINT, "set backend=vllm or backend=llamacpp", VLLM, "run") for key in MANAGED_KEYS),
    *((f"backend.{key}", "run", ENDPOINT, "set backend=vllm or backend=llamacpp", LLAMACPP, "run")
      for key in MANAGED_KEYS),
    *((f"backend.{key}", "run", ENDPOINT, "set backend=vllm", VLLM, "run") for key in VLLM_KEYS),
    *((f"backend.{key}", "run", VLLM, "set backend=llamacpp", LLAMACPP, "run") for key in LLAMACPP_KEYS),
    ("bench.drafters", "run", {}, "without bench.arms=drafters: set bench.arms=drafters",
     {"bench": {"arms": "drafters"}}, "run"),
    ("bench.gammas", "run", {}, "set bench.arms=gamma_sweep (or tree_chain)", {"bench": {"arms": "gamma_sweep"}},
     "run"),
    ("bench.gammas", "run", {}, "set bench.arms=gamma_sweep",
     {**_tree("static"), "bench": {"arms": "tree_chain", "gammas": [8]}}, "run"),
    ("bench.reference_precision", "run", {}, "set bench.arms=four_groups", {"bench": {"arms": "four_groups"}}, "run"),
    *((f"eval.{key}", "run", LMEVAL, "set +eval=exactness", EXACTNESS, "run") for key in EXACTNESS_KEYS),
    ("eval.stochastic_temperature", "run", {**EXACTNESS, "sampling": {"temperature": 1.0}},
     "with sampling.temperature=1.0 (the stochastic checks use the run's own sampling)", EXACTNESS, "run"),
    *((f"eval.{key}", "run", EXACTNESS, "set +eval=lmeval", LMEVAL, "run") for key in LMEVAL_KEYS),
    *((f"quant_quality.{key}", "run", {}, "set quant_quality.enabled=true", {"target": {"precision": "rtn-int4"}},
       "run") for key in ("reference", "num_texts", "max_tokens")),
    ("quant_quality.num_texts", "run", {"target": {"precision": "int8"}, "quant_quality": {"enabled": False}},
     "while quantization quality is not measured", {"quant_quality": {"enabled": True}}, "run"),
    ("speculate.gamma", "run", {"draft": {"kind": "none"}}, "with +draft=none", {}, "run"),
    ("speculate.gamma", "run", {"draft": {"kind": "none"}}, "with +draft=none",
     {"draft": {"kind": "none"}, **ENDPOINT}, "run"),  # the endpoint's spec arm is recorded at speculate.gamma
    ("speculate.confidence", "run", MODEL, "set speculate.policy=confidence",
     {**MODEL, "speculate": {"policy": "confidence"}}, "run"),
    *((f"speculate.{key}", "run", {}, "set speculate.policy=adaptive", {"speculate": {"policy": "adaptive"}}, "run")
      for key in ("decay", "probe_every")),
    ("speculate.decay", "run", {}, "set speculate.policy=adaptive", {"bench": {"arms": "gamma_sweep"}}, "run"),
    *((f"speculate.tree.{key}", "run", MODEL, "set speculate.tree.kind=static or dynamic", _tree("dynamic"), "run")
      for key in ("max_nodes", "max_depth")),
    ("speculate.tree.branching", "run", _tree("dynamic"), "set speculate.tree.kind=static", _tree("static"), "run"),
    ("speculate.tree.top_k", "run", _tree("static"), "set speculate.tree.kind=dynamic", _tree("dynamic"), "run"),
    ("speculate.tree.branching", "run", _tree("static", "ngram"), "with draft.kind=ngram: use a draft model",
     _tree("static", "skip"), "run"),
    ("speculate.tree.top_k", "run", _tree("dynamic", "ngram"), "+draft=eagle (prompt lookup grows a trie",
     _tree("dynamic", "skip"), "run"),
    ("speculate.tree.max_depth", "run", _tree("static"),
     "on a static tree (its depth is len(speculate.tree.branching))", _tree("static", "ngram"), "run"),
    *((f"draft.{key}", "run", {}, "without a draft model (draft.kind=model): choose one with +draft=<precision>",
       MODEL, "run") for key in ("precision", "quantize_head", "head_vocab")),
    ("draft.head_vocab", "run", {"draft": {"kind": "model", "precision": "gguf", "head_vocab": 4096}},
     "on a gguf draft model (its lm_head comes quantized by its own backend): use a float or rtn-* draft",
     {"draft": {"kind": "model", "precision": "rtn-int4", "head_vocab": 4096}}, "run"),
    ("model.draft_path", "run", {"draft": {"kind": "skip"}}, "choose one with +draft=<precision>", MODEL, "run"),
    ("draft.quantize_head", "run", {"draft": {"kind": "model", "quantize_head": True}},
     "on a bf16 draft model (only rtn-* quantize their lm_head): use +draft=rtn-int8 or +draft=rtn-int4",
     {"draft": {"kind": "model", "precision": "rtn-int4", "quantize_head": True}}, "run"),
    *((f"draft.{key}", "run", MODEL, "without +draft=skip: set +draft=skip", {"draft": {"kind": "skip"}}, "run")
      for key in ("skip_every", "layers", "skip_precision")),
    ("draft.skip_every", "run", {"draft": {"kind": "skip", "layers": [0, 2]}},
     "with draft.layers given (exactly those layers run): drop draft.layers", {"draft": {"kind": "skip"}}, "run"),
    *((f"draft.{key}", "run", MODEL, "set +draft=ngram", {"draft": {"kind": "ngram"}}, "run")
      for key in ("ngram_max", "ngram_min")),
    *((f"draft.{key}", "run", MODEL, "set +draft=suffix", {"draft": {"kind": "suffix"}}, "run")
      for key in ("suffix_max_match", "suffix_min_match", "suffix_factor", "suffix_min_prob", "suffix_cache_tokens")),
    ("draft.suffix_min_prob", "run", {"draft": {"kind": "ngram"}, "bench": {"arms": "drafters", "drafters": ["ngram"]}},
     "set +draft=suffix", {"draft": {"kind": "ngram"}, "bench": {"arms": "drafters"}}, "run"),
    ("draft.ngram_max", "run", {"draft": {"kind": "suffix"}, "bench": {"arms": "drafters", "drafters": ["suffix"]}},
     "set +draft=ngram", {"draft": {"kind": "suffix"}, "bench": {"arms": "drafters"}}, "run"),
    ("draft.group_size", "run", MODEL, "without a group-wise quantized draft",
     {"draft": {"kind": "model", "precision": "int4"}}, "run"),
    ("draft.group_size", "run", {"draft": {"kind": "skip"}}, "quantize the draft group-wise",
     {"draft": {"kind": "skip", "skip_precision": "rtn-int4"}}, "run"),
    ("kv.draft", "run", {}, "with draft.kind=suffix (no draft model with a KV precision of its own)",
     {"draft": {"kind": "skip"}}, "run"),
    ("draft.eagle_path", "run", {}, "without +draft=eagle", {"draft": {"kind": "eagle"}}, "run"),
    ("draft.hybrid_with", "run", {}, "without +draft=hybrid", {"draft": {"kind": "hybrid", "hybrid_with": "model"}},
     "run"),
    ("draft.precision", "run", {"draft": {"kind": "hybrid"}}, "without a draft model",
     {"draft": {"kind": "hybrid", "hybrid_with": "model"}}, "run"),
    ("target.group_size", "run", {"target": {"precision": "nf4"}}, "with target.precision=nf4",
     {"target": {"precision": "rtn-int8"}}, "run"),
    *((f"sampling.{key}", "run", {}, "set sampling=random", {"sampling": {"temperature": 0.7}}, "run")
      for key in ("top_k", "top_p")),
    ("sampling.top_p", "run", {}, "with greedy decoding (sampling.temperature=0)", EXACTNESS, "run"),
    ("sampling.top_p", "run", {}, "with greedy decoding (sampling.temperature=0)", {}, "serve"),
    ("workload.path", "run", {}, "set workload=jsonl", {"workload": {"kind": "jsonl", "path": "/p.jsonl"}}, "run"),
    ("runtime.kernels", "run", {"runtime": {"compile": True}}, "set runtime.compile=false", {}, "run"),
]
# fmt: on


def _cfg(values: dict[str, Any]):
    return run_config_from_dict({"output_dir": OUT, **values})


def _first_dead_rule(key: str, values: dict[str, Any], entry: str):
    cfg = _cfg(values)
    return next((rule for rule in RULES if rule.covers(key) and not rule.effective(cfg, entry)), None)


@pytest.mark.parametrize(("key", "entry", "dead", "words", "live", "live_entry"), CASES, ids=[c[0] for c in CASES])
def test_a_key_with_no_effect_is_one_error_naming_it_and_its_switch(key, entry, dead, words, live, live_entry):
    with pytest.raises(SpecToolkitError) as info:
        check_config(_cfg(dead), [key], entry)
    message = str(info.value)
    assert message.startswith(f"{key} has no effect ") and words in message, message
    assert message.endswith("or drop the override") or message.endswith(": drop the override"), message
    assert "\n" not in message
    assert check_config(_cfg(live), [key], live_entry) == []


def test_every_rule_is_the_reason_in_some_case() -> None:
    reasons = {id(_first_dead_rule(key, dead, entry)) for key, entry, dead, *_ in CASES}
    missing = [f"{rule.key} {rule.needs}" for rule in RULES if id(rule) not in reasons]
    assert not missing, missing


def test_the_issue_example_names_the_switch() -> None:
    with pytest.raises(SpecToolkitError) as info:
        check_config(_cfg({}), ["speculate.tree.branching"])
    assert str(info.value) == (
        "speculate.tree.branching has no effect without speculate.tree.kind=static: set speculate.tree.kind=static, "
        "or drop the override"
    )


def test_several_dead_keys_are_one_line() -> None:
    with pytest.raises(SpecToolkitError) as info:
        check_config(_cfg({}), ["server.port", "draft.layers"])
    assert str(info.value).count("has no effect") == 2 and "\n" not in str(info.value)


# ---- trees cut below what their settings ask ------------------------------------------------------


def test_tree_nodes_per_depth() -> None:
    assert tree_nodes((3, 2, 1, 1)) == [3, 6, 6, 6] and sum(tree_nodes((2, 2, 1))) == 10


def test_a_static_tree_larger_than_max_nodes_is_refused_with_both_fixes() -> None:
    values = {**MODEL, "speculate": {"tree": {"kind": "static", "branching": [3, 2, 1, 1]}}}
    with pytest.raises(SpecToolkitError) as info:
        check_config(_cfg(values), ["speculate.tree.kind", "speculate.tree.branching"])
    assert str(info.value) == (
        "speculate.tree.branching=[3,2,1,1] grows a tree of 21 nodes, but speculate.tree.max_nodes=8 keeps its first "
        "8 breadth first (a depth-2 tree): set speculate.tree.max_nodes=21, or shrink speculate.tree.branching"
    )
    assert check_config(_cfg({**MODEL, "speculate": {"tree": {"kind": "static"}}}), ["speculate.tree.kind"]) == []
    with pytest.raises(SpecToolkitError, match=r"\[2,1,1,1\] \(the default\) grows a tree of 8 nodes"):
        tree = {"kind": "static", "max_nodes": 6}  # the default branching, cut by a smaller budget
        check_config(_cfg({**MODEL, "speculate": {"tree": tree}}), ["speculate.tree.kind", "speculate.tree.max_nodes"])
    big = {**MODEL, "speculate": {"tree": {"kind": "static", "branching": [4, 4, 2], "max_nodes": 32}}}
    with pytest.raises(SpecToolkitError, match="52 nodes.*shrink speculate.tree.branching to at most 32 nodes"):
        check_config(_cfg(big))
    fits = {**MODEL, "speculate": {"tree": {"kind": "static", "branching": [3, 2, 1, 1], "max_nodes": 21}}}
    assert check_config(_cfg(fits)) == []
    ngram = {"speculate": {"tree": {"kind": "static"}}}  # a trie: branching plays no part
    assert check_config(_cfg(ngram), ["speculate.tree.kind"]) == []


def test_tree_chain_cuts_the_tree_per_arm_with_a_warning() -> None:
    values = {**_tree("static", branching=[3, 2, 1, 1]), "bench": {"arms": "tree_chain", "gammas": [3, 7, 21]}}
    cfg = _cfg(values)
    expected = [
        "bench.arms=tree_chain cuts the static tree speculate.tree.branching=[3,2,1,1] (21 nodes) to each arm's node "
        "budget, breadth first: tree-n3 (depth 1), tree-n7 (depth 2)"
    ]
    assert check_config(cfg, ["speculate.tree.branching", "bench.gammas"]) == expected == config_warnings(cfg)
    with pytest.raises(SpecToolkitError, match="21 nodes"):  # the server has no per-arm budgets: refused there
        check_config(cfg, ["speculate.tree.branching"], "serve")


def test_a_max_depth_beyond_max_nodes_is_refused_and_warned_under_tree_chain() -> None:
    with pytest.raises(SpecToolkitError) as info:
        check_config(_cfg(_tree("dynamic", max_depth=10)), ["speculate.tree.max_depth"])
    assert str(info.value) == (
        "speculate.tree.max_depth=10 is out of reach: a tree of speculate.tree.max_nodes=8 nodes is at most 8 deep: "
        "set speculate.tree.max_depth=8, or set speculate.tree.max_nodes=10"
    )
    with pytest.raises(SpecToolkitError, match="max_depth=10 is out of reach"):  # the n-gram trie too
        check_config(_cfg(_tree("static", "ngram", max_depth=10)))
    assert check_config(_cfg(_tree("dynamic", max_depth=8))) == []
    chain = _cfg({**_tree("dynamic", max_depth=6), "bench": {"arms": "tree_chain", "gammas": [3, 7]}})
    assert check_config(chain) == [
        "bench.arms=tree_chain: speculate.tree.max_depth=6 is out of reach of tree-n3 (a tree of N nodes is at most N "
        "deep)"
    ]


# ---- who set a key -------------------------------------------------------------------------------


def test_override_keys_are_keys_not_group_choices() -> None:
    overrides = ["+draft=bf16", "experiment=four_groups", "hydra/launcher=joblib", "kv=int8", "speculate.gamma=4",
                 "+eval.samples=100", "++serve.enabled=true", "~serve.rate", "device=cpu", "draft@x=bf16"]  # fmt: skip
    assert override_keys(overrides) == {"speculate.gamma", "eval.samples", "serve.enabled", "device"}


def test_library_callers_are_judged_by_what_differs_from_the_defaults() -> None:
    assert changed_keys(_cfg({})) == {"output_dir"}
    cfg = _cfg({"speculate": {"tree": {"branching": [2, 2]}}, "serve": {"concurrency": [1, 16, 2, 4, 8]}})
    assert changed_keys(cfg) == {"output_dir", "speculate.tree.branching"}  # the same levels, sorted: no change
    with pytest.raises(SpecToolkitError, match="speculate.tree.branching has no effect"):
        check_config(cfg)
    assert dead_keys(_cfg({}), ["speculate.tree.branching"]) and not dead_keys(_cfg({}), [])


# ---- what the README and conf/ show ---------------------------------------------------------------


def _commands(text: str) -> list[str]:
    """``python -m spectoolkit[.serve] ...`` lines (continuations joined, comments and `&` dropped)."""
    text = re.sub(r"\\\n\s*#?\s*", " ", text)  # continuation lines, in a YAML comment too
    found = []
    for line in text.splitlines():
        match = re.match(r"^\s*(?:#\s+)?(?:make vllm && )?(python -m spectoolkit(?:\.serve)?) (.*)$", line)
        if match:
            found.append(f"{match[1]} {match[2].split(' #')[0].rstrip(' &')}".strip())
        elif re.match(r"^\s*(?:#\s+)?python -m spectoolkit$", line):
            found.append("python -m spectoolkit")
    return found


def _jobs(command: str) -> list[tuple[str, list[str]]]:
    """(entry, overrides) per job of ``command`` (a ``-m`` sweep expands to every combination)."""
    words = shlex.split(command)
    entry = "serve" if words[2] == "spectoolkit.serve" else "run"
    overrides = [w for w in words[3:] if w != "-m" and not w.startswith("hydra") and "..." not in w]
    axes = [[f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] if "," in o and "[" not in o
            else [o] for o in overrides]  # fmt: skip
    return [(entry, list(job)) for job in itertools.product(*axes)]


def _shown_commands() -> list[str]:
    conf = files("spectoolkit.conf")
    texts = [README.read_text(encoding="utf-8")]  # the page, and the reference it points to (docs/)
    texts += [page.read_text(encoding="utf-8") for page in sorted((README.parent / "docs").glob("*.md"))]
    texts += [f.read_text(encoding="utf-8") for group in conf.iterdir() if group.is_dir()
              for f in group.iterdir() if f.name.endswith(".yaml")]  # fmt: skip
    return [c for text in texts for c in _commands(text) if c.split()[2] in ("spectoolkit", "spectoolkit.serve")]


SHOWN = _shown_commands()


def test_the_readme_shows_commands() -> None:
    assert len(SHOWN) > 25 and "python -m spectoolkit" in SHOWN


@pytest.mark.parametrize("command", SHOWN)
def test_every_shown_command_passes_the_check(command: str) -> None:
    for entry, overrides in _jobs(command):
        with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
            composed = compose(config_name="config", overrides=[f"output_dir={OUT}", *overrides])
        check_config(config_from_hydra(composed), override_keys(overrides), entry)  # raises if a key is dead


@pytest.mark.parametrize("name", sorted(f.name[:-5] for f in files("spectoolkit.conf").joinpath("experiment").iterdir()
                                        if f.name.endswith(".yaml")))  # fmt: skip
def test_experiment_files_set_nothing_dead(name: str) -> None:
    """What an experiment file sets is not the user's: alone, an experiment sets no key of the user's."""
    overrides = [f"experiment={name}"]
    with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
        cfg = config_from_hydra(compose(config_name="config", overrides=[f"output_dir={OUT}", *overrides]))
    assert check_config(cfg, override_keys(overrides)) == []
    assert override_keys(overrides) == set()


# ---- recorded warnings ---------------------------------------------------------------------------


def test_summaries_with_and_without_conditions_warnings_load() -> None:
    old = Summary.from_dict({"conditions": {"compat_warnings": []}})
    new = Summary.from_dict({"conditions": {"compat_warnings": [], "warnings": ["bench.arms=tree_chain cuts ..."]}})
    assert old.conditions.compat_warnings == new.conditions.compat_warnings == []
