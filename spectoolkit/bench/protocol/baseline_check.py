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

Throughput on both sides is output tokens / wall time of the call, prefill included, summed over
the timed passes. Per prompt: one untimed warm-up of each, then ``PASSES`` timed passes of each,
alternating which side goes first. Stock decodes greedily with ``min_new_tokens = max_new_tokens =``
the number of tokens our warm-up produced, so both sides decode the same count (ours stops at EOS).
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
    """``summary.json["baseline_check"]``: stock vs our baseline tokens/s and their ratio (ours / stock).

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
    stock, device, description = None, setup.models.device, None
    began = time.perf_counter()
    try:
        stock, description = load_stock(arm.target.path, arm.target_precision, cfg.target.group_size, device)
        with torch.inference_mode(), tqdm(total=len(runnable) * (1 + PASSES) * 2, disable=not progress,
                                          desc="stock check", unit="gen", leave=False) as bar:  # fmt: skip
            timer = _Interleaved(stock, arm, device, bar)
            stock_rate, ours_rate, timed = timer.run(runnable, max_new_tokens, began, cfg, setup, len(all_runnable))
    except StockUnavailable as exc:
        return {"skipped": str(exc)}
    except _Skip as exc:
        return {"skipped": str(exc), "stock": description, "seconds": round(time.perf_counter() - began, 1)}
    except Exception as exc:  # noqa: BLE001  a failing stock path (OOM, missing backend) must not lose the run
        return {"error": first_line(exc, with_type=True)}
    finally:
        del stock
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "stock_tokens_per_s": stock_rate, "baseline_tokens_per_s": ours_rate, "ratio": ours_rate / stock_rate,
        "prompts": timed, "max_new_tokens": max_new_tokens, "stock": description,
        "seconds": round(time.perf_counter() - began, 1),
    }  # fmt: skip


class _Interleaved:
    """Both sides on the same prompts, alternating, within the check's bound (module docstring)."""

    def __init__(self, stock: torch.nn.Module, arm: Arm, device: torch.device, bar: tqdm) -> None:
        self.stock, self.arm, self.device, self.bar = stock, arm, device, bar
        self.tokens, self.seconds = {"stock": 0, "ours": 0}, {"stock": 0.0, "ours": 0.0}
        self.deadline = math.inf

    def run(
        self, prompts: list[list[int]], max_new_tokens: int, began: float, cfg: RunConfig, setup: RunSetup,
        run_prompts: int,
    ) -> tuple[float, float, int]:  # fmt: skip
        """(stock, ours) tokens/s over ``PASSES`` timed passes per prompt, and how many prompts were timed."""
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
            if self.arm.target_precision in FAR_SLOWER_SKIPS and slower > FAR_SLOWER:
                raise _Skip(
                    f"stock side {slower:.1f}x slower than ours on its warm-up ({stock_count / stock_s:.2f} against "
                    f"{count / ours_s:.2f} tok/s; a comparator for {self.arm.target_precision} must be within "
                    f"{FAR_SLOWER:g}x): too slow to show whether our baseline is slow"
                )
            if time.perf_counter() + PASSES * (stock_s + ours_s) > self.deadline:  # this prompt's passes do not fit
                if timed:
                    break
                raise _Skip(self._reason(stock_count, stock_s, count / ours_s, bound, estimate))
            for pass_idx in range(PASSES):
                for side in ("stock", "ours") if pass_idx % 2 == 0 else ("ours", "stock"):
                    self._timed(side, ids, count)
            timed += 1
        return self.tokens["stock"] / self.seconds["stock"], self.tokens["ours"] / self.seconds["ours"], timed

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
        out_ids = self._stock(ids, count) if side == "stock" else self._ours(ids, count)
        synchronize(self.device)
        self.tokens[side] += len(out_ids)
        self.seconds[side] += time.perf_counter() - start

    def _ours(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Our baseline engine's output ids (its own verifier: greedy in a greedy run)."""
        out = self.arm.engine.generate(ids, max_new_tokens, torch.Generator().manual_seed(0)).output_ids
        self.bar.update()
        return out

    def _stock(self, ids: list[int], count: int) -> list[int]:
        """``count`` new ids from stock greedy ``generate`` (EOS suppressed until then; fewer past the deadline)."""
        model = self.stock
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, L]
        pad = model.generation_config.pad_token_id
        pad = pad if pad is not None else model.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else pad
        greedy = {"do_sample": False, "max_new_tokens": count, "min_new_tokens": count, "pad_token_id": pad}
        stop = StoppingCriteriaList([_Deadline(self.deadline)])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), stopping_criteria=stop, **greedy)
        self.bar.update()
        return out[0, len(ids) :].tolist()  # [≤ count]
