"""Is our baseline as fast as stock transformers? Time both on the same checkpoint, precision and prompts.

Every speedup of a run is measured against our target-alone arm ("baseline", DESIGN §3). A slow
baseline inflates every speedup, and no same-run comparison catches it, so during calibration a
*fresh, stock* copy of the baseline's checkpoint at its precision (:mod:`.stock_models`: plain
``AutoModelForCausalLM.from_pretrained``, default attention, stock linears — bitsandbytes, GPTQ through
transformers' own loading, torchao weight-only for our ``rtn-*`` formats) decodes a few of the run's
prompts interleaved with our baseline engine. A missing library skips it, with the reason; so does a stock
path that would run past the check's bound — a quarter of the run's estimated time (every arm decoding every
prompt at the baseline's measured time per token; at least 30 s): a stock ``generate`` stops at the deadline
(a stopping criterion), the record says how fast it was going, and fewer prompts are timed where only some
fit. A progress bar shows the check with its bound.

A run with a draft model adds two sides to the same interleaving: stock *assisted generation*
(``generate(assistant_model=...)`` with a stock copy of the draft at its precision, transformers' own
speculative decoding) and our primary speculative arm, so "our pair against the stock pair" is measured
like "our baseline against stock". An assisted side that does not fit the bound is dropped with the reason;
the plain check stands.

Throughput on every side is output tokens / wall time of the call, prefill included, summed over
the timed passes. Per prompt: one untimed warm-up of each, then ``PASSES`` timed passes of each,
alternating the order. Stock decodes greedily with ``min_new_tokens = max_new_tokens =`` the number of
tokens our warm-up produced, so every side decodes the same count (ours stops at EOS).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from spectoolkit.bench.protocol.stock_models import RTN, StockUnavailable, load_stock
from spectoolkit.config import RunConfig
from spectoolkit.errors import first_line
from spectoolkit.runtime.runner import synchronize
from spectoolkit.wiring.setup import Arm, RunSetup

MAX_PROMPTS = 3  # runnable prompts of the run that are timed
MAX_NEW_TOKENS = 32  # at most this many tokens per generation (the run's max_new_tokens if smaller)
PASSES = 2  # timed passes of each side per prompt, after one untimed warm-up of each
RUN_SHARE = 0.25  # the check may take at most this share of the run's estimated time ...
MIN_BOUND_S = 30.0  # ... or this many seconds, whichever is more (a short run still gets a check)
# A stock path that is not what a user of that precision would run on this device, timed only while it is a
# comparator: torchao's eager weight-only CPU kernels for our rtn-* formats ran 20-40x slower than ours (1.9
# against 77 tok/s), and a side that slow cannot show whether our baseline is slow. Its warm-up decides.
FAR_SLOWER = 3.0
FAR_SLOWER_SKIPS = RTN


class _Deadline(StoppingCriteria):
    """Stops stock ``generate`` once ``time.perf_counter()`` passes ``deadline`` (a slow stock path cannot run on)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), time.perf_counter() > self.deadline, dtype=torch.bool)


class _Skip(Exception):
    """The stock side would run past the check's bound, or is too slow to be a comparator; the message says so."""


def run_estimate_s(cfg: RunConfig, setup: RunSetup, num_prompts: int, seconds_per_token: float) -> float:
    """The measured part of the run, estimated: every arm decodes every prompt's max_new_tokens in every repeat at
    the baseline's measured time per token (speculative arms are faster, so "about")."""
    tokens = num_prompts * len(setup.arm_set.arms) * cfg.bench.repeat * cfg.workload.max_new_tokens
    return tokens * seconds_per_token


def stock_baseline_check(
    cfg: RunConfig, setup: RunSetup, prompts: list[list[int] | str], progress: bool = False
) -> dict[str, Any] | None:
    """``summary.json["baseline_check"]``: stock vs our baseline tokens/s and their ratio (ours / stock); with a
    draft model also stock assisted generation and our primary speculative arm.

    ``prompts``: the run's prompt ids per request (a string: the reason it cannot run). Returns
    ``{"skipped": reason}`` where no honest stock counterpart exists or the stock side would run past the bound
    (:data:`RUN_SHARE` of the run's estimated time, at least :data:`MIN_BOUND_S`), ``{"error": ...}`` when the
    stock side fails (the run is kept), None without a runnable prompt.
    """
    arm = setup.arm_set.baseline  # four_groups: the reference-precision target, not the quantized one
    all_runnable = [ids for ids in prompts if isinstance(ids, list)]
    runnable = all_runnable[:MAX_PROMPTS]
    if not runnable:
        return None
    max_new_tokens = min(cfg.workload.max_new_tokens, MAX_NEW_TOKENS)
    stock, assistant, device, description = None, None, setup.models.device, None
    spec = _assisted_arm(cfg, setup)
    began = time.perf_counter()
    try:
        stock, description = load_stock(arm.target.checkpoint or arm.target.path, arm.target.precision,
                                        cfg.target.group_size, device)  # fmt: skip
        assisted: dict[str, Any] = {}
        if spec is not None:
            assistant, assisted = _load_assistant(spec, cfg, device)
        sides = 2 + 2 * (assistant is not None)
        with torch.inference_mode(), tqdm(total=len(runnable) * (1 + PASSES) * sides, disable=not progress,
                                          desc="stock check", unit="gen", leave=False) as bar:  # fmt: skip
            timer = _Interleaved(stock, arm, device, bar, assistant, spec)
            rates, timed = timer.run(runnable, max_new_tokens, began, cfg, setup, len(all_runnable))
    except StockUnavailable as exc:
        return {"skipped": str(exc)}
    except _Skip as exc:
        return {"skipped": str(exc), "stock": description, "seconds": round(time.perf_counter() - began, 1)}
    except Exception as exc:  # noqa: BLE001  a failing stock path (OOM, missing backend) must not lose the run
        return {"error": first_line(exc, with_type=True)}
    finally:
        del stock, assistant
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if timer.assisted_skipped:
        assisted["assisted_skipped"] = timer.assisted_skipped
    if "assisted" in rates:
        assisted |= {"spec_tokens_per_s": rates["spec"], "assisted_tokens_per_s": rates["assisted"]}
    return {
        "stock_tokens_per_s": rates["stock"], "baseline_tokens_per_s": rates["ours"],
        "ratio": rates["ours"] / rates["stock"], "prompts": timed, "max_new_tokens": max_new_tokens,
        "stock": description, "seconds": round(time.perf_counter() - began, 1), **assisted,
    }  # fmt: skip


def _assisted_arm(cfg: RunConfig, setup: RunSetup) -> Arm | None:
    """The primary speculative arm when it drafts with a draft model (assisted generation's counterpart)."""
    spec = setup.arm_set.spec
    if spec is None or spec.draft is None or cfg.draft.kind != "model" or spec.draft.shared:
        return None
    return spec


def _load_assistant(spec: Arm, cfg: RunConfig, device: torch.device) -> tuple[torch.nn.Module | None, dict]:
    """A stock copy of ``spec``'s draft at its precision (None and the reason when there is none)."""
    assert spec.draft is not None and spec.draft_precision is not None
    info: dict[str, Any] = {"spec_arm": spec.name}
    try:
        assistant, info["assisted"] = load_stock(spec.draft.checkpoint or spec.draft.path, spec.draft_precision,
                                                   cfg.draft.group_size, device)  # fmt: skip
    except StockUnavailable as exc:
        return None, info | {"assisted_skipped": f"no stock draft: {exc}"}
    except ValueError as exc:  # a draft precision with no stock counterpart
        return None, info | {"assisted_skipped": str(exc)}
    return assistant, info


class _Interleaved:
    """Every side on the same prompts, alternating, within the check's bound (module docstring)."""

    def __init__(
        self, stock: torch.nn.Module, arm: Arm, device: torch.device, bar: tqdm,
        assistant: torch.nn.Module | None = None, spec: Arm | None = None,
    ) -> None:  # fmt: skip
        self.stock, self.arm, self.device, self.bar = stock, arm, device, bar
        self.assistant, self.spec = assistant, spec
        self.sides = ["stock", "ours"] + (["assisted", "spec"] if assistant is not None else [])
        self.tokens = dict.fromkeys(self.sides, 0)
        self.seconds = dict.fromkeys(self.sides, 0.0)
        self.deadline = math.inf
        self.assisted_skipped: str | None = None

    def run(
        self, prompts: list[list[int]], max_new_tokens: int, began: float, cfg: RunConfig, setup: RunSetup,
        run_prompts: int,
    ) -> tuple[dict[str, float], int]:  # fmt: skip
        """Tokens/s of every side over ``PASSES`` timed passes per prompt, and how many prompts were timed."""
        timed = 0
        for index, ids in enumerate(prompts):
            start = time.perf_counter()
            count = max(len(self._ours(ids, max_new_tokens)), 1)  # untimed warm-up; sets the token count
            ours_s = time.perf_counter() - start
            if index == 0:  # our first warm-up prices the run, and so the bound
                estimate = run_estimate_s(cfg, setup, run_prompts, ours_s / count)
                bound = max(MIN_BOUND_S, RUN_SHARE * estimate)
                self.deadline = began + bound
                self.bar.set_postfix_str(f"bound {bound:.0f} s")
            start = time.perf_counter()
            stock_count = len(self._stock(ids, count))  # untimed warm-up
            stock_s = time.perf_counter() - start
            if stock_count < count:  # stopped at the deadline
                raise _Skip(self._reason(stock_count, stock_s, count / ours_s, bound, estimate))
            slower = (count / ours_s) / (stock_count / stock_s)
            if self.arm.target.precision in FAR_SLOWER_SKIPS and slower > FAR_SLOWER:
                raise _Skip(
                    f"stock side {slower:.1f}x slower than ours on its warm-up ({stock_count / stock_s:.2f} against "
                    f"{count / ours_s:.2f} tok/s; a comparator for {self.arm.target_precision} must be within "
                    f"{FAR_SLOWER:g}x): too slow to show whether our baseline is slow"
                )
            pass_s = stock_s + ours_s + self._warm_assisted(ids, count, bound)
            if time.perf_counter() + PASSES * pass_s > self.deadline:  # this prompt's passes do not fit
                if timed:
                    break
                if len(self.sides) > 2:  # drop the assisted sides before the plain check
                    self._drop_assisted(f"its passes do not fit the check's bound of {bound:.0f} s")
                    if time.perf_counter() + PASSES * (stock_s + ours_s) <= self.deadline:
                        self._passes(ids, count)
                        timed += 1
                        continue
                raise _Skip(self._reason(stock_count, stock_s, count / ours_s, bound, estimate))
            self._passes(ids, count)
            timed += 1
        return {side: self.tokens[side] / self.seconds[side] for side in self.sides}, timed

    def _passes(self, ids: list[int], count: int) -> None:
        for pass_idx in range(PASSES):
            for side in self.sides if pass_idx % 2 == 0 else reversed(self.sides):
                self._timed(side, ids, count)

    def _warm_assisted(self, ids: list[int], count: int, bound: float) -> float:
        """Warm up the assisted sides (untimed); their seconds, 0 when there are none or they were dropped."""
        if len(self.sides) == 2:
            return 0.0
        start = time.perf_counter()
        assisted = len(self._stock(ids, count, assisted=True))
        if assisted < count:
            self._drop_assisted(f"its warm-up ran past the check's bound of {bound:.0f} s ({assisted} of {count} "
                                "tokens)")  # fmt: skip
            return 0.0
        self._spec(ids, count)
        return time.perf_counter() - start

    def _drop_assisted(self, why: str) -> None:
        self.assisted_skipped = f"assisted generation not timed: {why}"
        self.sides = ["stock", "ours"]

    def _reason(self, stock_tokens: int, stock_s: float, ours_rate: float, bound: float, estimate: float) -> str:
        stock_rate = stock_tokens / stock_s if stock_s > 0 else 0.0
        slower = f" ({ours_rate / stock_rate:.1f}× slower than ours)" if stock_rate > 0 else ""
        return (
            f"stock side past the check's bound of {bound:.0f} s ({RUN_SHARE:.0%} of this run's estimated "
            f"{estimate:.0f} s, at least {MIN_BOUND_S:.0f} s): its warm-up decoded {stock_tokens} tokens at "
            f"{stock_rate:.2f} tok/s{slower}, ours {ours_rate:.2f} tok/s"
        )

    def _timed(self, side: str, ids: list[int], count: int) -> None:
        synchronize(self.device)
        start = time.perf_counter()
        if side in ("stock", "assisted"):
            out_ids = self._stock(ids, count, assisted=side == "assisted")
        else:
            out_ids = self._ours(ids, count) if side == "ours" else self._spec(ids, count)
        synchronize(self.device)
        self.tokens[side] += len(out_ids)
        self.seconds[side] += time.perf_counter() - start

    def _ours(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Our baseline engine's output ids (its own verifier: greedy in a greedy run)."""
        out = self.arm.engine.generate(ids, max_new_tokens, torch.Generator().manual_seed(0)).output_ids
        self.bar.update()
        return out

    def _spec(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Our primary speculative arm's output ids."""
        assert self.spec is not None
        out = self.spec.engine.generate(ids, max_new_tokens, torch.Generator().manual_seed(0)).output_ids
        self.bar.update()
        return out

    def _stock(self, ids: list[int], count: int, assisted: bool = False) -> list[int]:
        """``count`` new ids from stock greedy ``generate``, assisted by the stock draft when ``assisted`` (EOS
        suppressed until then; fewer past the deadline)."""
        model = self.stock
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, L]
        pad = model.generation_config.pad_token_id
        pad = pad if pad is not None else model.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else pad
        greedy = {"do_sample": False, "max_new_tokens": count, "min_new_tokens": count, "pad_token_id": pad}
        if assisted:
            greedy["assistant_model"] = self.assistant
        stop = StoppingCriteriaList([_Deadline(self.deadline)])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), stopping_criteria=stop, **greedy)
        self.bar.update()
        return out[0, len(ids) :].tolist()  # [≤ count]
