"""The lm-evaluation-harness model ``spectoolkit``: generation by our engines, scoring by the target.

- ``generate_until`` decodes with one arm of :func:`spectoolkit.wiring.setup.build`: the
  speculative arm (target + drafter, exact verification, DESIGN §1) or, with ``draft=none``, the
  target alone. Stop strings end the generation at the first token whose text contains one, and
  the text is cut before it, so a greedy speculative run returns exactly the target-alone text.
- ``loglikelihood`` / ``loglikelihood_rolling`` score with a plain forward of the loaded target at
  its precision (no drafter): the distribution speculative decoding reproduces.

Registration: importing this module registers ``spectoolkit`` in lm-eval's model registry; the
package also declares it in the ``lm_eval.models`` entry-point group (lm-eval's plugin discovery,
newer than 0.4.13); :mod:`spectoolkit.eval.lmeval_cli` is lm-eval's own CLI with both in place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (the built-in models first: get_model only loads them into an empty registry)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from spectoolkit.config import RunConfig
from spectoolkit.eval.lmeval_args import CONFIG_KEYS, run_config_from_model_args
from spectoolkit.path_checks import check_run_paths
from spectoolkit.wiring.setup import RunSetup, build

TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # the shipped task YAMLs (spectoolkit_*)
MODEL_NAME = "spectoolkit"
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default when a task sets no max_gen_toks
# Config keys as model_args spell them (spectoolkit.eval.lmeval_args), for the path checks' messages.
PATH_ARGS = {key: f"model_args {arg}" for arg, key in CONFIG_KEYS.items()}


class _StopReached(Exception):
    """Raised from the engine's ``on_token`` stream once a stop string has appeared."""


@register_model(MODEL_NAME)
class SpecToolkitLM(TemplateLM):
    """One sequence at a time (batch size 1, like the engines); see the module docstring."""

    def __init__(self, **model_args: Any) -> None:
        """``model_args``: see :mod:`spectoolkit.eval.lmeval_args` (``device`` may also come from lm-eval)."""
        config, max_new_tokens = run_config_from_model_args(model_args)
        check_run_paths(config, "run", PATH_ARGS)  # before any model loads
        setup = build(config)
        self._attach(setup, setup.arm_set.primary or "baseline", config, max_new_tokens)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None):
        """lm-eval's constructor path; its ``--device``/``--batch_size`` give way to model_args of the same name."""
        extra = {key: value for key, value in (additional_config or {}).items() if value is not None}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def from_setup(
        cls, setup: RunSetup, arm: str, config: RunConfig, max_new_tokens: int | None = None
    ) -> SpecToolkitLM:
        """Wrap an already built run (the quality job scores two arms of one setup)."""
        lm = cls.__new__(cls)
        lm._attach(setup, arm, config, max_new_tokens)
        return lm

    def _attach(self, setup: RunSetup, arm: str, config: RunConfig, max_new_tokens: int | None) -> None:
        TemplateLM.__init__(self)
        self.models, self.arm, self.config = setup.models, setup.arm_set.arm(arm), config
        self.tokenizer = setup.models.tokenizer
        self.max_new_tokens = max_new_tokens
        self._device = setup.models.device

    # ---- lm-eval's tokenization hooks ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.models.target.path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # ---- scoring: the target alone ----------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ((context, continuation), context_ids, continuation_ids) → (sum log p, greedy?)."""
        results = []
        for key, context_ids, continuation_ids in requests:
            result = self._score(context_ids, continuation_ids)
            self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in disjoint windows of the target's context length."""
        results = []
        for (text,) in [request.args for request in requests]:
            windows = get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.models.max_positions, context_len=1
            )
            total = sum(self._score(*make_disjoint_window(window))[0] for window in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    @torch.inference_mode()
    def _score(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """Sum of the target's log-probs of ``continuation_ids`` after ``context_ids``, and whether
        each continuation token is the argmax (lm-eval's ``is_greedy``)."""
        input_ids = (context_ids + continuation_ids)[:-1][-self.models.max_positions :]  # the last is never an input
        ids = torch.tensor([input_ids], dtype=torch.long, device=self._device)  # [1, n]
        num_scored = len(continuation_ids)  # the last m positions predict the continuation
        logits = self.models.target.model(input_ids=ids, use_cache=False, logits_to_keep=num_scored).logits[0]  # [m, V]
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
        targets = torch.tensor(continuation_ids, dtype=torch.long, device=log_probs.device)  # [m]
        chosen = log_probs.gather(1, targets[:, None])[:, 0]  # [m]
        return float(chosen.sum()), bool((log_probs.argmax(dim=-1) == targets).all())

    # ---- generation: the engine of this arm -------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            text = self._generate(context, dict(gen_kwargs or {}), index)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        return results

    def _generate(self, context: str, gen_kwargs: dict[str, Any], index: int) -> str:
        """Decode after ``context`` until a stop string, EOS or the token budget; the text before the stop."""
        until = gen_kwargs.get("until") or []
        stops = [until] if isinstance(until, str) else list(until)
        budget = int(gen_kwargs.get("max_gen_toks") or DEFAULT_MAX_GEN_TOKS)
        budget = min(budget, self.max_new_tokens or budget)
        prompt_ids = self.tok_encode(context)[-max(1, self.models.max_positions - budget) :]
        output_ids: list[int] = []

        def on_token(token: int) -> None:
            output_ids.append(token)
            if stops and _first_stop(self._decode(output_ids), stops) is not None:
                raise _StopReached

        try:
            self.arm.engine.generate(prompt_ids, budget, self._generator(index), on_token=on_token)
        except _StopReached:
            pass
        text = self._decode(output_ids)
        cut = _first_stop(text, stops)
        return text if cut is None else text[:cut]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _generator(self, index: int) -> torch.Generator | None:
        """Greedy needs none; sampling gets a recorded seed per request (seed + request index)."""
        if self.config.sampling.greedy:
            return None
        return torch.Generator(device=self._device).manual_seed(self.config.sampling.seed + index)


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Character index of the earliest stop string in ``text`` (None: no stop string occurs)."""
    found = [text.find(stop) for stop in stops if stop and stop in text]
    return min(found) if found else None
