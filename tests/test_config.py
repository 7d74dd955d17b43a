"""Hydra config tree → RunConfig: every group option composes and converts; bad values raise ours.

Composes through Hydra's compose API (no subprocess). ``output_dir`` is ``${hydra:runtime.output_dir}``
in the primary config, which only resolves under ``@hydra.main``; every compose here overrides it.
"""

from __future__ import annotations

import dataclasses
from importlib.resources import files

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from spectoolkit.__main__ import config_from_hydra
from spectoolkit.config import (
    BenchConfig,
    DraftConfig,
    RunConfig,
    SamplingConfig,
    SpeculateConfig,
    TargetConfig,
    WorkloadConfig,
    run_config_from_dict,
)
from spectoolkit.errors import SpecToolkitError

CONF_MODULE = "spectoolkit.conf"
OUT = "/tmp/spectoolkit-test-out"
PLACEHOLDER_PATH = "/data/prompts.jsonl"  # for mandatory (???) values such as workload.path
# Values an option needs that its dataclass checks (a ??? would not survive a base file's null: backend/local.yaml)
REQUIRED = {("backend", "endpoint"): ("backend.baseline_url=http://127.0.0.1:8000/v1",)}


def _compose(*overrides: str):
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        return compose(config_name="config", overrides=[f"output_dir={OUT}", *overrides])


def _run_config(*overrides: str) -> RunConfig:
    return config_from_hydra(_compose(*overrides))


TRAIN_GROUPS = ("train",)  # python -m spectoolkit.train_draft's groups (its primary config: train_draft.yaml)


def _group_options() -> list[tuple[str, str]]:
    """Every (group, option) shipped in the package's conf/ tree (new yaml files join automatically)."""
    root = files(CONF_MODULE)
    return sorted(
        (group.name, option.name.removesuffix(".yaml"))
        for group in root.iterdir()
        if group.is_dir() and not group.name.startswith(("_", ".")) and group.name not in TRAIN_GROUPS
        for option in group.iterdir()
        if option.name.endswith(".yaml")
    )


def _read(*parts: str) -> str:
    return files(CONF_MODULE).joinpath(*parts).read_text(encoding="utf-8")


def _option_values(group: str, option: str) -> dict:
    return OmegaConf.to_container(OmegaConf.create(_read(group, f"{option}.yaml"))) or {}


def _defaults_list() -> list:
    return OmegaConf.to_container(OmegaConf.create(_read("config.yaml")))["defaults"]


GROUP_OPTIONS = _group_options()
DEFAULT_GROUPS = {next(iter(entry)) for entry in _defaults_list() if isinstance(entry, dict)}


def test_conf_tree_is_found_in_the_package() -> None:
    found = set(GROUP_OPTIONS)
    expected = {
        *(("target", p) for p in ("fp32", "bf16", "fp16")),
        *(("draft", d) for d in ("fp32", "bf16", "fp16", "ngram", "none")),
        ("sampling", "greedy"), ("sampling", "random"), ("speculate", "default"), ("bench", "default"),
        *(("workload", w) for w in ("builtin", "jsonl", "humaneval", "sharegpt")),
        ("model", "smollm2-135m"),
    }  # fmt: skip
    assert expected <= found


def test_target_and_draft_are_appendable() -> None:
    # DESIGN §4: `+target=X +draft=Y` needs both groups absent from the defaults list, `_self_` first.
    defaults = _defaults_list()
    assert defaults[0] == "_self_"
    assert not {"target", "draft"} & DEFAULT_GROUPS


def _assert_matches(section: object, values: dict, where: str) -> None:
    """Every value of an option file arrives in the typed config (``???`` -> the placeholder)."""
    for key, value in values.items():
        if key == "defaults":
            continue
        actual = getattr(section, key)
        actual = list(actual) if isinstance(actual, tuple) else actual  # lists are stored as tuples
        if isinstance(value, dict):
            _assert_matches(actual, value, f"{where}{key}.")
        else:
            assert actual == (PLACEHOLDER_PATH if value == "???" else value), f"{where}{key}"


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_option_composes_and_converts(group: str, option: str) -> None:
    values = _option_values(group, option)
    mandatory = [f"{group}.{key}={PLACEHOLDER_PATH}" for key, value in values.items() if value == "???"]
    mandatory += REQUIRED.get((group, option), ())
    prefix = "" if group in DEFAULT_GROUPS else "+"  # groups outside the defaults list are appended
    cfg = _run_config(f"{prefix}{group}={option}", *mandatory)
    is_global = "@package _global_" in _read(group, f"{option}.yaml")  # experiment-style files
    _assert_matches(cfg if is_global else getattr(cfg, group), values, "" if is_global else f"{group}.")


def test_defaults_match_the_dataclass_defaults() -> None:
    # The library without Hydra and the CLI without overrides run the same experiment.
    assert _run_config() == RunConfig(output_dir=OUT)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_target_precision(precision: str) -> None:
    cfg = _run_config(f"+target={precision}")
    assert cfg.target == TargetConfig(precision=precision)
    assert cfg.draft.kind == "suffix"  # the inline default draft is untouched


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_draft_model_precision(precision: str) -> None:
    assert _run_config(f"+draft={precision}").draft == DraftConfig(kind="model", precision=precision)


def test_activations_are_int8_only_for_integer_weights() -> None:
    cfg = _run_config("+target=rtn-int4", "target.activations=int8", "+draft=gguf", "draft.activations=float")
    assert (cfg.target.activations, cfg.draft.activations) == ("int8", "float")
    assert _run_config("+target=gguf").target.activations is None  # the precision's default (int8 for gguf)
    with pytest.raises(SpecToolkitError, match=r"target\.activations=int8 runs integer dot products .* not fp32"):
        _run_config("+target=fp32", "target.activations=int8")
    with pytest.raises(SpecToolkitError, match=r"draft\.activations=int8 .* not bf16"):
        _run_config("+draft=bf16", "draft.activations=int8")
    with pytest.raises(SpecToolkitError, match=r"target\.activations"):
        _run_config("+target=gguf", "target.activations=int4")


def test_draft_ngram_and_none() -> None:
    assert _run_config("+draft=ngram").draft == DraftConfig(kind="ngram", ngram_max=3, ngram_min=2)
    assert _run_config("+draft=none").draft.kind == "none"
    assert _run_config("+draft=suffix").draft == DraftConfig(kind="suffix")


def test_design_card_form() -> None:
    cfg = _run_config("+target=fp16", "+draft=bf16")
    assert cfg.target.precision == "fp16"
    assert (cfg.draft.kind, cfg.draft.precision) == ("model", "bf16")
    cfg = _run_config("+target=fp32", "+draft=bf16", "draft.precision=fp16")
    assert (cfg.target.precision, cfg.draft.precision) == ("fp32", "fp16")


def test_scalar_overrides() -> None:
    cfg = _run_config(
        "speculate.gamma=4", "sampling=random", "sampling.temperature=0.8", "sampling.top_p=0.9",
        "sampling.top_k=50", "sampling.seed=7", "bench.warmup=2", "bench.repeat=3", "device=cpu",
        "model.target_path=/ckpt/target", "model.draft_path=/ckpt/draft", "workload.max_new_tokens=16",
        "workload.num_prompts=3",
    )  # fmt: skip
    assert cfg.speculate == SpeculateConfig(gamma=4)
    assert cfg.sampling == SamplingConfig(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    assert not cfg.sampling.greedy
    assert cfg.bench == BenchConfig(warmup=2, repeat=3)
    assert cfg.device == "cpu"
    assert (cfg.model.target_path, cfg.model.draft_path) == ("/ckpt/target", "/ckpt/draft")
    assert (cfg.workload.max_new_tokens, cfg.workload.num_prompts) == (16, 3)
    assert cfg.output_dir == OUT


def test_sampling_random_is_not_greedy() -> None:
    assert _run_config("sampling=greedy").sampling.greedy
    assert _run_config("sampling=random").sampling.temperature == 1.0


def test_workload_options() -> None:
    assert _run_config("workload=jsonl", "workload.path=/p.jsonl").workload == WorkloadConfig(
        kind="jsonl", path="/p.jsonl"
    )
    humaneval = _run_config("workload=humaneval").workload
    assert (humaneval.kind, humaneval.num_prompts) == ("humaneval", 8)
    assert _run_config("workload=sharegpt").workload.kind == "sharegpt"


def test_jsonl_without_path_names_the_option() -> None:
    with pytest.raises(SpecToolkitError, match=r"workload\.path"):
        _run_config("workload=jsonl")


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("speculate.gamma=0", r"speculate\.gamma"),
        ("workload.max_new_tokens=0", r"workload\.max_new_tokens"),
        ("sampling.top_p=0", r"sampling\.top_p"),
        ("sampling.temperature=-1", r"sampling\.temperature"),
        ("bench.repeat=0", r"bench\.repeat"),
        ("target.precision=int3", r"target\.precision='int3'"),
        ("device=tpu", r"device='tpu'"),
        ("+foo=1", r"unknown config option\(s\): foo"),
        ("+speculate.gama=4", r"unknown config option\(s\): speculate\.gama"),
        ("speculate.gamma=2.5", r"speculate\.gamma=2\.5 must be of type int"),
        ("bench.warmup=1.5", r"bench\.warmup"),
        ("workload.num_prompts=2.5", r"workload\.num_prompts"),
        ("workload.chat_template=maybe", r"workload\.chat_template"),
    ],
)
def test_bad_values_raise_our_error(override: str, pattern: str) -> None:
    with pytest.raises(SpecToolkitError, match=pattern):
        _run_config(override)


def test_unknown_keys_are_all_named() -> None:
    with pytest.raises(SpecToolkitError) as info:
        run_config_from_dict({"colour": 1, "speculate": {"gama": 4}})
    assert "colour" in str(info.value)
    with pytest.raises(SpecToolkitError, match=r"speculate\.gama"):
        run_config_from_dict({"speculate": {"gama": 4}})
    with pytest.raises(SpecToolkitError, match=r"draft\.kind2, draft\.size"):
        run_config_from_dict({"draft": {"size": 1, "kind2": "x"}})


@pytest.mark.parametrize(
    "values",
    [
        {"speculate": {"gamma": 0}},
        {"speculate": {"gamma": 65}},
        {"workload": {"max_new_tokens": 0}},
        {"workload": {"num_prompts": 0}},
        {"workload": {"kind": "jsonl", "path": None}},
        {"workload": {"kind": "csv"}},
        {"sampling": {"top_p": 0.0}},
        {"sampling": {"top_p": 1.5}},
        {"sampling": {"top_k": -1}},
        {"target": {"precision": "int3"}},
        {"draft": {"kind": "model", "precision": "fp8"}},
        {"draft": {"kind": "medusa"}},
        {"draft": {"ngram_min": 4, "ngram_max": 3}},
        {"draft": {"kind": "suffix", "suffix_max_match": 0}},
        {"draft": {"kind": "suffix", "suffix_min_match": 17}},
        {"draft": {"kind": "suffix", "suffix_factor": 0}},
        {"draft": {"kind": "suffix", "suffix_min_prob": 1.5}},
        {"draft": {"kind": "suffix", "suffix_cache_tokens": -1}},
        {"bench": {"warmup": -1}},
        {"speculate": 4},  # a scalar where a section belongs
        {"speculate": {"gamma": True}},
    ],
    ids=str,
)
def test_validation_errors(values: dict) -> None:
    with pytest.raises(SpecToolkitError):
        run_config_from_dict(values)


@pytest.mark.parametrize("price", [0, -1.5, float("nan"), float("inf"), True, "2 EUR"], ids=str)
def test_cost_per_hour_must_be_a_positive_price(price: object) -> None:
    with pytest.raises(SpecToolkitError, match=r"bench\.cost_per_hour=.*(must be > 0: set it to the price of one "
                       r"hour of this machine|must be of type float or null)"):  # fmt: skip
        run_config_from_dict({"bench": {"cost_per_hour": price}})


def test_cost_per_hour_defaults_to_null_and_takes_a_price() -> None:
    assert BenchConfig().cost_per_hour is None and _run_config().bench.cost_per_hour is None
    assert _run_config("bench.cost_per_hour=2.5").bench.cost_per_hour == 2.5
    assert run_config_from_dict({"bench": {"cost_per_hour": 3}}).bench.cost_per_hour == 3
    with pytest.raises(SpecToolkitError, match=r"bench\.cost_per_hour=0 must be > 0"):
        _run_config("bench.cost_per_hour=0")


def test_from_dict_round_trip() -> None:
    cfg = RunConfig(
        draft=DraftConfig(kind="model", precision="fp16"),
        sampling=SamplingConfig(temperature=0.7, top_k=5, top_p=0.95, seed=3),
        workload=WorkloadConfig(kind="jsonl", path="/x.jsonl", max_new_tokens=9),
        device="cpu",
        output_dir="/out",
    )
    assert run_config_from_dict(dataclasses.asdict(cfg)) == cfg


@pytest.mark.parametrize(("value", "compiled"), [(None, False), ("auto", False), ("true", True), ("false", False)])
def test_runtime_compile_is_auto_by_default_and_auto_runs_eager(value, compiled) -> None:
    cfg = _run_config(*([f"runtime.compile={value}"] if value else []))
    assert cfg.runtime.compile == {None: "auto", "true": True, "false": False}.get(value, value)
    assert cfg.runtime.compiled is compiled


def test_runtime_compile_refuses_other_words() -> None:
    with pytest.raises(SpecToolkitError, match="runtime.compile"):
        _run_config("runtime.compile=sometimes")


def test_the_train_group_composes_to_the_training_defaults() -> None:
    """``python -m spectoolkit.train_draft``'s primary config: a run's config plus train/eagle3.yaml, whose values
    are :class:`TrainConfig`'s defaults (the command and the library train the same head)."""
    from spectoolkit.training.job import TrainConfig, train_config_from_dict

    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        cfg = compose(config_name="train_draft", overrides=[f"output_dir={OUT}", "+target=bf16", "train.steps=5"])
    values = OmegaConf.to_container(cfg, resolve=True)
    assert train_config_from_dict(values.pop("train")) == dataclasses.replace(TrainConfig(), steps=5)
    assert config_from_hydra(OmegaConf.create(values)).target.precision == "bf16"


@pytest.mark.parametrize("kind", ["eagle", "hybrid"])
def test_head_drafters_default_to_the_adaptive_policy(kind: str) -> None:
    """A head's fixed γ 4 measured below the baseline where its own cost model said γ 1 (conf/draft/eagle.yaml)."""
    cfg = _run_config(f"+draft={kind}")
    assert (cfg.draft.kind, cfg.speculate.policy) == (kind, "adaptive")
    assert _run_config(f"+draft={kind}", "speculate.policy=fixed").speculate.policy == "fixed"
    assert _run_config("+draft=suffix").speculate.policy == _run_config().speculate.policy == "fixed"
