"""``model_args`` of the lm-eval model ``spectoolkit`` → a validated :class:`RunConfig`, and back.

The keys (``lm_eval --model spectoolkit --model_args target=int4,draft=bf16,gamma=4``):

=================  ==========================================================  ============
key                meaning                                                     default
=================  ==========================================================  ============
target             target weight precision (fp32, bf16, fp16, int8, nf4, ...)  fp32
draft              a draft precision, ``ngram``, ``suffix``, ``eagle``,          none
                   ``hybrid`` or ``none``
gamma              draft length γ                                              4
target_path        target checkpoint: local directory or hub id                embedded
draft_path         draft checkpoint (a draft precision without it: self-draft) target's
eagle_path         eagle/hybrid: a trained head (python -m spectoolkit.train_draft)
kv                 KV-cache precision of target and draft                      auto
device             auto, cpu or cuda                                           auto
temperature        0 is greedy; top_p / top_k / seed apply when sampling       0
max_new_tokens     cap on the tokens generated per request                     the task's
=================  ==========================================================  ============

Building a :class:`RunConfig` and handing it to :func:`spectoolkit.wiring.setup.build` keeps
precisions, quantization and KV identical to the bench (DESIGN §4: one way to load a run). The config
goes through the command line's checks (:func:`spectoolkit.config_checks.check_config`), each model_arg
counted as the config key it sets: one that would do nothing (``gamma`` with ``draft=none``, ``top_p``
when greedy, ``draft_path`` without a draft model) is refused with ``python -m spectoolkit``'s message
for that key, after the model_arg's name.
"""

from __future__ import annotations

from typing import Any

from spectoolkit.config import DRAFT_KINDS, RunConfig, run_config_from_dict
from spectoolkit.config_checks import check_config, dead_keys
from spectoolkit.errors import SpecToolkitError
from spectoolkit.precisions import MODEL_PRECISIONS

MODEL_ARG_KEYS = (
    "target", "draft", "gamma", "target_path", "draft_path", "eagle_path", "kv", "device",
    "temperature", "top_p", "top_k", "seed", "max_new_tokens",
)  # fmt: skip
# Passed by lm-eval itself (create_from_arg_string's additional_config); batch size 1 is all we run.
HARNESS_KEYS = ("batch_size", "max_batch_size")
# The config key each model_arg sets, as its command-line override would. target, draft and kv choose config
# files there (+target=, +draft=, kv=), which set no key of the user's; max_new_tokens is lm-eval's alone.
CONFIG_KEYS = {
    "gamma": "speculate.gamma", "target_path": "model.target_path", "draft_path": "model.draft_path",
    "eagle_path": "draft.eagle_path", "device": "device", "temperature": "sampling.temperature",
    "top_p": "sampling.top_p", "top_k": "sampling.top_k", "seed": "sampling.seed",
}  # fmt: skip


def run_config_from_model_args(model_args: dict[str, Any]) -> tuple[RunConfig, int | None]:
    """``model_args`` (values as lm-eval parses them) → (RunConfig, max_new_tokens cap or None)."""
    args = {key: value for key, value in model_args.items() if key not in HARNESS_KEYS}
    unknown = sorted(set(args) - set(MODEL_ARG_KEYS))
    if unknown:
        raise SpecToolkitError(f"unknown spectoolkit model_args: {', '.join(unknown)}; use {', '.join(MODEL_ARG_KEYS)}")
    draft = "none" if args.get("draft") is None else str(args["draft"])
    if draft not in MODEL_PRECISIONS and draft not in DRAFT_KINDS:
        choices = ", ".join((*MODEL_PRECISIONS, *(kind for kind in DRAFT_KINDS if kind != "model")))
        raise SpecToolkitError(f"model_args draft={draft!r} is not supported; use one of {choices}")
    kv = str(args.get("kv") or "auto")
    drafter = {"kind": "model", "precision": draft} if draft in MODEL_PRECISIONS else {"kind": draft}
    values: dict[str, Any] = {
        "target": {"precision": str(args.get("target") or "fp32")},
        "draft": {**drafter, "eagle_path": _path(args.get("eagle_path"))},  # any drafter's: the checks judge it
        "model": {"target_path": _path(args.get("target_path")), "draft_path": _path(args.get("draft_path"))},
        "speculate": {"gamma": args.get("gamma", 4)},
        "kv": {"target": kv, "draft": kv},
        "sampling": {
            "temperature": float(args.get("temperature") or 0.0),
            "top_p": float(args.get("top_p", 1.0)),
            "top_k": int(args.get("top_k") or 0),
            "seed": int(args.get("seed") or 0),
        },
        "device": _device(args.get("device")),
    }
    max_new_tokens = args.get("max_new_tokens")
    if max_new_tokens is not None and (
        not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1
    ):
        raise SpecToolkitError(f"model_args max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    return _checked(run_config_from_dict(values), args), max_new_tokens


def _checked(config: RunConfig, args: dict[str, Any]) -> RunConfig:
    """``config`` through the command line's checks, judged by the keys ``args`` set; a key that would do
    nothing is one error naming its model_arg, with the message ``python -m spectoolkit`` gives for it."""
    named = [f"model_args {arg}={args[arg]}: {message}"
             for arg, key in CONFIG_KEYS.items() if arg in args for message in dead_keys(config, [key])]  # fmt: skip
    if named:
        raise SpecToolkitError("; ".join(named))
    check_config(config, [CONFIG_KEYS[arg] for arg in args if arg in CONFIG_KEYS])  # what else the CLI refuses
    return config


def model_args_of(config: RunConfig, max_new_tokens: int | None = None) -> dict[str, Any]:
    """``config``'s target, drafter, KV and sampling as model_args keys (``kv`` per model), for records."""
    draft = config.draft.precision if config.draft.kind == "model" else config.draft.kind
    args = {"target": config.target.precision, "draft": draft, "gamma": config.speculate.gamma}
    args.update(target_path=config.model.target_path, draft_path=config.model.draft_path)
    args["kv"] = {"target": config.kv.target, "draft": config.kv.draft}
    sampling = config.sampling
    args.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed)
    return {**args, "device": config.device, "max_new_tokens": max_new_tokens}


def _path(value: Any) -> str | None:
    return None if value in (None, "", "embedded") else str(value)


def _device(value: Any) -> str:
    """lm-eval spells devices ``cuda:0``; we run on one device chosen by kind."""
    device = str(value or "auto")
    return "cuda" if device.startswith("cuda") else device
