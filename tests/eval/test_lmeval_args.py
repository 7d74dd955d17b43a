"""lm-eval ``model_args`` go through the command line's config checks: a model_arg that would do nothing is refused
with the message ``python -m spectoolkit`` gives for the same setting, after the model_arg's name.

The command line's message comes from composing the equivalent overrides through Hydra's compose API and
running :func:`spectoolkit.config_checks.check_config` on them, as ``python -m spectoolkit`` does.
"""

from __future__ import annotations

from functools import reduce

import pytest
from hydra import compose, initialize_config_module

from spectoolkit.__main__ import config_from_hydra
from spectoolkit.config import RunConfig
from spectoolkit.config_checks import check_config, override_keys
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.lmeval_args import CONFIG_KEYS, MODEL_ARG_KEYS, run_config_from_model_args

OUT = "/tmp/spectoolkit-test-out"

# (model_args, the model_arg refused, the same setting on the command line)
NO_EFFECT = [
    ({"draft": "none", "gamma": 4}, "gamma", ["+draft=none", "speculate.gamma=4"]),
    ({"gamma": 2}, "gamma", ["+draft=none", "speculate.gamma=2"]),  # draft defaults to none
    ({"draft": "ngram", "draft_path": "/ckpt/draft"}, "draft_path", ["+draft=ngram", "model.draft_path=/ckpt/draft"]),
    ({"draft": "bf16", "eagle_path": "/ckpt/head"}, "eagle_path", ["+draft=bf16", "draft.eagle_path=/ckpt/head"]),
    ({"draft": "ngram", "top_p": 0.9}, "top_p", ["+draft=ngram", "sampling.top_p=0.9"]),
    ({"draft": "ngram", "temperature": 0, "top_k": 5}, "top_k", ["+draft=ngram", "sampling.temperature=0",
                                                                  "sampling.top_k=5"]),
]  # fmt: skip
GOOD = [
    {"draft": "ngram", "gamma": 4},
    {"draft": "bf16", "gamma": 3, "draft_path": "/ckpt/draft", "kv": "int8"},
    {"draft": "eagle", "eagle_path": "/ckpt/head"},
    {"draft": "suffix", "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3},
    {"draft": "none", "temperature": 0.7, "top_p": 0.9, "seed": 3, "device": "cpu", "max_new_tokens": 8},
    {"draft": None, "batch_size": 1, "device": "cuda:0"},  # what lm-eval passes on its own
]


def _cli_error(overrides: list[str]) -> str:
    with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
        config = config_from_hydra(compose(config_name="config", overrides=[f"output_dir={OUT}", *overrides]))
    with pytest.raises(SpecToolkitError) as refused:
        check_config(config, override_keys(overrides), "run")
    return str(refused.value)


@pytest.mark.parametrize(("model_args", "arg", "overrides"), NO_EFFECT, ids=[f"{c[1]}-{c[2][0]}" for c in NO_EFFECT])
def test_a_model_arg_with_no_effect_gets_the_command_lines_message(model_args: dict, arg: str, overrides: list[str]):
    with pytest.raises(SpecToolkitError) as refused:
        run_config_from_model_args(model_args)
    assert str(refused.value) == f"model_args {arg}={model_args[arg]}: {_cli_error(overrides)}"


def test_every_model_arg_with_no_effect_is_named():
    with pytest.raises(SpecToolkitError) as refused:
        run_config_from_model_args({"draft": "none", "gamma": 4, "draft_path": "/d", "top_p": 0.5})
    message = str(refused.value)
    assert message.startswith("model_args gamma=4: speculate.gamma has no effect with +draft=none")
    assert "; model_args draft_path=/d: model.draft_path has no effect" in message
    assert "; model_args top_p=0.5: sampling.top_p has no effect with greedy decoding" in message


@pytest.mark.parametrize("model_args", GOOD)
def test_a_combination_that_takes_effect_passes(model_args: dict):
    config, _ = run_config_from_model_args(model_args)
    assert config.speculate.gamma == model_args.get("gamma", 4)


def test_every_config_key_names_a_model_arg_and_a_setting():
    assert set(CONFIG_KEYS) <= set(MODEL_ARG_KEYS)
    for key in CONFIG_KEYS.values():
        reduce(getattr, key.split("."), RunConfig())  # AttributeError: no such setting
