"""Is our baseline as fast as stock transformers? Time both on the same checkpoint, precision and prompts.

Every speedup of a run is measured against our target-alone arm ("baseline", DESIGN §3). A slow
baseline inflates every speedup, and no same-run comparison catches it, so during calibration a
*fresh, stock* copy of the baseline's checkpoint at its precision (:mod:`.stock_models`: plain
``AutoModelForCausalLM.from_pretrained``, default attention, stock linears — bitsandbytes, GPTQ through
transformers' own loading, torchao weight-only for our ``rtn-*`` formats) decodes a few of the run's
prompts interleaved with our baseline engine. Only a missing library skips it, with the reason.

Throughput on both sides is output tokens / wall time of the call, prefill included, summed over
the timed passes. Per prompt: one untimed warm-up of each, then ``PASSES`` timed passes of each,
alternating which side goes first. Stock decodes greedily with ``min_new_tokens = max_new_tokens =``
the number of tokens our warm-up produced, so both sides decode the same count (ours stops at EOS).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from spectoolkit.bench.protocol.stock_models import StockUnavailable, load_stock
from spectoolkit.config import RunConfig
from spectoolkit.errors import first_line
from spectoolkit.runtime.runner import synchronize
from spectoolkit.wiring.setup import Arm, RunSetup

MAX_PROMPTS = 3  # runnable prompts of the run that are timed
MAX_NEW_TOKENS = 32  # at most this many tokens per generation (the run's max_new_tokens if smaller)
PASSES = 2  # timed passes of each side per prompt, after one untimed warm-up of each


def stock_baseline_check(cfg: RunConfig, setup: RunSetup, prompts: list[list[int] | str]) -> dict[str, Any] | None:
    """``summary.json["baseline_check"]``: stock vs our baseline tokens/s and their ratio (ours / stock).

    ``prompts``: the run's prompt ids per request (a string: the reason it cannot run). Returns
    ``{"skipped": reason}`` where no honest stock counterpart exists, ``{"error": ...}`` when the stock
    side fails (the run is kept), None without a runnable prompt.
    """
    arm = setup.arm_set.baseline  # four_groups: the reference-precision target, not the quantized one
    runnable = [ids for ids in prompts if isinstance(ids, list)][:MAX_PROMPTS]
    if not runnable:
        return None
    max_new_tokens = min(cfg.workload.max_new_tokens, MAX_NEW_TOKENS)
    stock, device = None, setup.models.device
    try:
        stock, description = load_stock(arm.target.path, arm.target_precision, cfg.target.group_size, device)
        with torch.inference_mode():
            stock_rate, ours_rate = _time_interleaved(stock, arm, runnable, max_new_tokens, device)
    except StockUnavailable as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001  a failing stock path (OOM, missing backend) must not lose the run
        return {"error": first_line(exc, with_type=True)}
    finally:
        del stock
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "stock_tokens_per_s": stock_rate, "baseline_tokens_per_s": ours_rate, "ratio": ours_rate / stock_rate,
        "prompts": len(runnable), "max_new_tokens": max_new_tokens, "stock": description,
    }  # fmt: skip


def _time_interleaved(
    stock: torch.nn.Module, arm: Arm, prompts: list[list[int]], max_new_tokens: int, device: torch.device
) -> tuple[float, float]:
    """(stock, ours) tokens/s over ``PASSES`` timed passes per prompt, the two sides alternating."""
    tokens, seconds = {"stock": 0, "ours": 0}, {"stock": 0.0, "ours": 0.0}
    for ids in prompts:
        count = max(len(_ours(arm, ids, max_new_tokens)), 1)  # untimed warm-up; sets the token count
        _stock(stock, ids, count, device)  # untimed warm-up
        for pass_idx in range(PASSES):
            for side in ("stock", "ours") if pass_idx % 2 == 0 else ("ours", "stock"):
                synchronize(device)
                start = time.perf_counter()
                out_ids = _stock(stock, ids, count, device) if side == "stock" else _ours(arm, ids, count)
                synchronize(device)
                tokens[side] += len(out_ids)
                seconds[side] += time.perf_counter() - start
    return tokens["stock"] / seconds["stock"], tokens["ours"] / seconds["ours"]


def _ours(arm: Arm, ids: list[int], max_new_tokens: int) -> list[int]:
    """Our baseline engine's output ids (its own verifier: greedy in a greedy run)."""
    return arm.engine.generate(ids, max_new_tokens, torch.Generator().manual_seed(0)).output_ids


def _stock(model: torch.nn.Module, ids: list[int], count: int, device: torch.device) -> list[int]:
    """Exactly ``count`` new ids from stock greedy ``generate`` (EOS suppressed until then)."""
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, L]
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    greedy = {"do_sample": False, "max_new_tokens": count, "min_new_tokens": count, "pad_token_id": pad}
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **greedy)  # [1, L + count]
    return out[0, len(ids) :].tolist()
