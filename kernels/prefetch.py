"""How far ahead our linears prefetch their weight stream: measured in this process, on this machine (issue 55).

At one row a decode step reads every packed weight once, front to back, and a core's own loads keep too few cache
lines in flight for the rate its memory can give: on a Zen 5 EPYC (2 cores) the Q4_K linear read 19 GB/s a core
from memory against 43 GB/s for a bare read loop, though from cache it runs at 67. A software prefetch some
kilobytes ahead of the reads (one per cache line of the stream, ``spectoolkit::set_stream_prefetch``) lets the
memory run ahead of the arithmetic. How far ahead pays depends on the machine's memory (on a Zen 4 EPYC an earlier
prefetch of 1-8 KB measured 2-12% slower), so it is measured, never assumed: :func:`tune` times one Q4_K linear at
one row over a buffer far larger than any cache at each distance of :data:`DISTANCES`, interleaved round by round,
and keeps the fastest only where it beats no prefetch by more than :data:`MIN_GAIN`. ``SPECTOOLKIT_PREFETCH=<bytes>``
pins a distance instead (0: none). A prefetch changes no bit; the choice moves time only, and the report records it
(``conditions.hardware.weight_prefetch``).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels import cpu_ops, formats
from spectoolkit.kernels.placement import streaming_buffer

DISTANCES = (0, 1024, 2048, 4096, 8192, 16384)  # bytes ahead; 0 (no prefetch) is the reference
MIN_GAIN = 0.03  # a distance must beat no prefetch by more than this share to be chosen
ROUNDS = 15  # ~0.6 s in all; fewer let one disturbed stretch of a shared machine's memory pick a distance
PROBE_MIB = 256  # the probe's weights: well past the last-level cache of any machine of this kind
PROBE_K = 2048  # the probe's in_features: 8 Q4_K records a panel
STREAMED = 64 << 20  # packed bytes from which a model's weights stream from memory (smaller ones stay in cache)
ENV = "SPECTOOLKIT_PREFETCH"


@dataclass(frozen=True)
class PrefetchChoice:
    """The distance the linears prefetch at, and how it was come by."""

    distance: int  # bytes ahead; 0: none
    how: str  # "measured", "pinned" (SPECTOOLKIT_PREFETCH) or "not measured" (no weights stream from memory)
    speedups: dict[int, float] = field(default_factory=dict)  # distance -> median over rounds of t(0) / t(distance)

    def as_record(self) -> dict[str, object]:
        speedups = {str(distance): round(speedup, 3) for distance, speedup in self.speedups.items()}
        return {"bytes": self.distance, "how": self.how, "speedups": speedups}


def choose(times: dict[int, list[float]]) -> PrefetchChoice:
    """The fastest distance by the median of its per-round speedups over no prefetch (``times[0]``), if that beats
    1 + :data:`MIN_GAIN`; else 0. ``times``: seconds per round for each distance, rounds aligned."""
    speedups = {
        distance: statistics.median(t0 / t for t0, t in zip(times[0], runs, strict=True))
        for distance, runs in times.items()
    }
    best = max(speedups, key=lambda distance: (speedups[distance], -distance))
    return PrefetchChoice(best if speedups[best] > 1 + MIN_GAIN else 0, "measured", speedups)


def measure(rounds: int = ROUNDS, mib: int = PROBE_MIB) -> dict[int, list[float]]:
    """Seconds of one Q4_K linear at one row over ``mib`` MiB of records, per distance of :data:`DISTANCES`, each
    round in a rotated order (what the machine does meanwhile falls on every distance alike)."""
    cpu_ops.load()
    kind = formats.FORMATS["Q4_K"]
    records = PROBE_K // kind.block  # a panel's records, of 16 columns each
    panels = (mib << 20) // (records * kind.record_bytes)
    weights = streaming_buffer(panels * records * kind.record_bytes).view(panels, records, kind.record_bytes)
    x, fmt = torch.randn(1, PROBE_K), formats.FORMAT_IDS[kind.name]
    empty = torch.empty(0)

    def once() -> float:
        began = time.perf_counter()
        torch.ops.spectoolkit.linear(x, weights, empty, empty, None, panels * formats.PANEL, kind.group, -1, fmt)
        return time.perf_counter() - began

    times: dict[int, list[float]] = {d: [] for d in DISTANCES}
    previous = torch.ops.spectoolkit.stream_prefetch()
    try:
        for distance in DISTANCES:  # warm-up: the thread pool, and each distance once
            torch.ops.spectoolkit.set_stream_prefetch(distance)
            once()
        for index in range(rounds):
            for distance in DISTANCES[index % len(DISTANCES) :] + DISTANCES[: index % len(DISTANCES)]:
                torch.ops.spectoolkit.set_stream_prefetch(distance)
                times[distance].append(once())
    finally:
        torch.ops.spectoolkit.set_stream_prefetch(previous)
    return times


def pinned() -> int | None:
    """``SPECTOOLKIT_PREFETCH``'s distance, or None when it is not set."""
    value = os.environ.get(ENV)
    if value is None:
        return None
    if not value.isdigit() or int(value) > 1 << 20:
        raise SpecToolkitError(f"{ENV}={value}: the bytes to prefetch ahead, 0 to {1 << 20} (0: none), or unset it")
    return int(value)


@functools.cache
def tune() -> PrefetchChoice:
    """Measure (once per process) and set the distance the linears prefetch at; :func:`pinned` wins."""
    distance = pinned()
    choice = PrefetchChoice(distance, "pinned") if distance is not None else choose(measure())
    cpu_ops.load()
    torch.ops.spectoolkit.set_stream_prefetch(choice.distance)
    return choice


def current() -> PrefetchChoice:
    """What the linears prefetch at now: :func:`tune`'s choice once it ran, else none."""
    if tune.cache_info().currsize:
        return tune()
    return PrefetchChoice(0, "not measured")


def tune_for(streamed_bytes: int) -> PrefetchChoice:
    """:func:`tune` when ``streamed_bytes`` of packed weights stream from memory (:data:`STREAMED`), else what is
    set now: a model that fits in cache has nothing to prefetch from memory."""
    return tune() if streamed_bytes >= STREAMED or pinned() is not None else current()
