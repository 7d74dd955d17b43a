"""What a load sweep sends: the load levels in run order and the request sequence of each level.

Every arm of a (level, repeat) gets the same sequence: the workload's runnable prompts cycled to the
level's size, each request seeded from ``sampling.seed``, its case and the repeat (the seed the batch-1
protocol gives it too). With ``serve.sampling_mix`` the requests take its temperatures in turn (the rest of
``sampling``'s settings kept, each request's own rule in the one batch); without it they run under the engine's
``sampling``. A prompt that cannot run never reaches an engine: it is recorded as an error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import cycle, islice
from typing import Any

from spectoolkit.bench.protocol.runner import request_seed
from spectoolkit.config import SamplingConfig, ServeConfig
from spectoolkit.errors import SpecToolkitError
from spectoolkit.sampling import SamplingParams
from spectoolkit.serving.api import ServeRequest
from spectoolkit.workloads.prompts import Request

CLOSED, OPEN = "concurrency", "rate"
OPEN_LOOP_MIN_REQUESTS = 8  # an open-loop level sends at least this many (None: requests_per_level)
WARMUP_MAX_NEW_TOKENS = 16


@dataclass(frozen=True)
class Level:
    """One load level: ``kind`` "concurrency" (closed loop, ``value`` clients) or "rate" (requests/s)."""

    key: str  # "4" or "rate=0.5": the key of summary["serving"][arm] and of the records' load_level
    kind: str
    value: float

    @property
    def closed(self) -> bool:
        return self.kind == CLOSED

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "value": int(self.value) if self.closed else self.value}


def load_levels(serve: ServeConfig) -> list[Level]:
    """The levels of ``serve`` in run order: closed-loop concurrencies ascending, then open-loop rates."""
    closed = [Level(str(n), CLOSED, n) for n in serve.concurrency]
    return closed + [Level(f"rate={rate:g}", OPEN, rate) for rate in serve.rate]


@dataclass(frozen=True)
class Case:
    """A workload prompt: its token ids, or the reason it cannot run."""

    case_id: str
    task_type: str
    prompt_ids: list[int] | None  # [L]
    error: str | None = None


def cases_of(requests: list[Request], prompts: list[list[int] | str]) -> list[Case]:
    """Cases from the workload and its encoded prompts (a str is the reason a prompt cannot run)."""
    return [
        Case(r.case_id, r.task_type, None, ids) if isinstance(ids, str) else Case(r.case_id, r.task_type, ids)
        for r, ids in zip(requests, prompts, strict=True)
    ]


def runnable(cases: list[Case]) -> list[Case]:
    return [case for case in cases if case.prompt_ids is not None]


@dataclass(frozen=True)
class Sent:
    """A request of a level sequence and the case it was made from."""

    request: ServeRequest
    case: Case


def level_size(level: Level, num_prompts: int, requests_per_level: int | None) -> int:
    """Requests per run: ``requests_per_level``, else max(prompts, 2N) closed / max(prompts, 8) open."""
    if not num_prompts:
        return 0
    if requests_per_level is not None:
        return requests_per_level
    return max(num_prompts, 2 * int(level.value) if level.closed else OPEN_LOOP_MIN_REQUESTS)


def mixed_sampling(sampling: SamplingConfig, mix: tuple[float, ...], index: int) -> SamplingParams | None:
    """The rule of the ``index``-th request of a level: ``sampling`` at the mix's temperature in turn; None (the
    engine's own) without a mix."""
    if not mix:
        return None
    return dataclasses.replace(SamplingParams.of(sampling), temperature=mix[index % len(mix)])


def level_requests(
    cases: list[Case], level: Level, serve: ServeConfig, max_new_tokens: int, sampling: SamplingConfig, repeat_idx: int
) -> list[Sent]:
    """The request sequence of ``level`` in repeat ``repeat_idx`` (the same for every arm)."""
    prompts = runnable(cases)
    size = level_size(level, len(prompts), serve.requests_per_level)
    return [
        Sent(ServeRequest(f"{index}:{case.case_id}", case.prompt_ids, max_new_tokens,
                          request_seed(sampling.seed, case.case_id, repeat_idx),
                          sampling=mixed_sampling(sampling, serve.sampling_mix, index)), case)
        for index, case in enumerate(islice(cycle(prompts), size))
    ]  # fmt: skip


def warmup_requests(cases: list[Case], count: int, max_new_tokens: int) -> list[ServeRequest]:
    """Untimed requests sent before a level's timed runs (at most 16 new tokens each)."""
    prompts = runnable(cases)
    new_tokens = min(max_new_tokens, WARMUP_MAX_NEW_TOKENS)
    return [
        ServeRequest(f"warmup-{index}:{case.case_id}", case.prompt_ids, new_tokens, index)
        for index, case in enumerate(islice(cycle(prompts), count if prompts else 0))
    ]


def check_fits(cases: list[Case], serve: ServeConfig, max_new_tokens: int) -> None:
    """Raise when one request alone cannot fit ``serve.max_kv_tokens`` (no level could ever start it)."""
    if serve.max_kv_tokens is None:
        return
    for case in runnable(cases):
        blocks = math.ceil((len(case.prompt_ids) + max_new_tokens) / serve.block_size)
        needed = blocks * serve.block_size
        if needed > serve.max_kv_tokens:
            raise SpecToolkitError(
                f"serve.max_kv_tokens={serve.max_kv_tokens} cannot hold one request: {case.case_id} needs {needed} "
                f"KV slots (prompt {len(case.prompt_ids)} + max_new_tokens {max_new_tokens}, blocks of "
                f"{serve.block_size}); raise serve.max_kv_tokens to >= {needed} or lower workload.max_new_tokens"
            )
