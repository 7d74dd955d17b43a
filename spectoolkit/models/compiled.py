"""Compiled decode and verify steps over static KV (``runtime.compile=true``): :class:`CachedModel`'s contract.

A decode step of the embedded model in eager transformers is mostly per-operator overhead (mask
building, cache bookkeeping, ~20 dispatches per layer) on top of reading the weights. Here the
model's forward is :class:`~spectoolkit.models.static_decoder.StaticDecoder`'s plain tensor code,
compiled by inductor (C++ through gcc on CPU) into one graph per step width:

- **Bucketed shapes, bounded recompiles.** A call of n ≤ :data:`MAX_ROW_TOKENS` tokens runs at the
  smallest width in :data:`WIDTHS` that holds it (after :meth:`CompiledModel.warm`, in the widths it
  compiled: one decode step and one verify bucket), padded with repeats of its last token at the
  following positions (their KV lands in slots past the real ones, which the real rows never attend
  and the next write overwrites). The KV buffers have a fixed capacity, doubled only when a sequence
  outgrows it. So the graphs are at most ``len(WIDTHS)`` per capacity; :attr:`CompiledModel.compile_stats`
  counts them and the seconds spent compiling, which warm-up absorbs and the conditions report.
- **Exact.** Decode and verify rows go through row-invariant kernels, so a verify row equals the
  decode step at its position bit for bit, and the speculative output equals this target alone.
  Longer calls (prompts) are prefills: BLAS and SDPA, uncompiled, identical in every arm.
- **Reference.** ``runtime.compile=false`` keeps :class:`CachedModel` (eager transformers); tests
  compare the two: same greedy tokens, logits within :data:`LOGIT_TOLERANCE`.

KV rule (DESIGN §2): ``num_computed`` slots are valid; :meth:`truncate` only lowers it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.row_linear import load_row_linear
from spectoolkit.models.static_decoder import StaticDecoder

WIDTHS = (1, 2, 4, 8, 16, 32)  # step widths compiled on demand; a verify window pads to the next one
MAX_ROW_TOKENS = WIDTHS[-1]  # longer calls are prefills
INITIAL_CAPACITY = 2048  # KV slots per layer before the first doubling
RECOMPILE_LIMIT = 64  # dynamo's per-code-object graph limit (default 8); past it a fullgraph compile fails
LOGIT_TOLERANCE = 1e-3  # |compiled - eager| logits, fp32 (different summation orders, same math)


@dataclass
class CompileStats:
    """What compiling cost: graphs built (one per width and KV capacity) and the seconds they took."""

    built: set[tuple[int, int]] = field(default_factory=set)  # (width, KV capacity) of every graph compiled
    compile_seconds: float = 0.0
    graphs_at_warm_up: int | None = None  # graphs when warm-up ended (None: not marked)

    @property
    def graphs(self) -> int:
        return len(self.built)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted({width for width, _ in self.built}))

    def mark_warm(self) -> None:
        """Warm-up is over: any graph compiled from now on was compiled inside measured time."""
        self.graphs_at_warm_up = self.graphs

    def as_dict(self) -> dict:
        after = None if self.graphs_at_warm_up is None else self.graphs - self.graphs_at_warm_up
        return {"graphs": self.graphs, "compile_seconds": round(self.compile_seconds, 2), "widths": list(self.widths),
                "compiled_after_warm_up": after}  # fmt: skip


class StaticKV:
    """Per-layer key/value buffers [Hkv, capacity, D] in the model's dtype; slots [0, length) valid."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int):
        self.shape = (kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.shape[1]

    def grow(self, needed: int) -> None:
        """Double the capacity until ``needed`` slots fit, keeping slots [0, length)."""
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        self.shape = (self.shape[0], capacity, self.shape[2])
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                buffers[i] = old.new_zeros(self.shape)
                buffers[i][:, : self.length] = old[:, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def widths_for(max_tokens: int) -> tuple[int, ...]:
    """The step widths :meth:`CompiledModel.warm` compiles for calls of 1..``max_tokens`` tokens: the decode
    step and one bucket for every longer call (a shorter verify window pads up to it; one graph costs
    ~50 s of compiling for the embedded model on 2 cores, a padded row far less)."""
    top = next((w for w in WIDTHS if w >= max_tokens), WIDTHS[-1])
    return (1,) if top == 1 else (1, top)


class CompiledModel:
    """Incremental forward passes of a Llama-family causal LM through compiled static-KV steps (batch 1)."""

    def __init__(self, model: torch.nn.Module, kv_precision: str = "auto", capacity: int = INITIAL_CAPACITY) -> None:
        if kv_precision != "auto":
            raise SpecToolkitError(
                f"runtime.compile=true keeps KV in the model's dtype, not kv={kv_precision}: "
                "use kv=auto (kv.target=auto kv.draft=auto) or runtime.compile=false"
            )
        if next(model.parameters()).device.type != "cpu":
            raise SpecToolkitError(
                "runtime.compile=true runs the CPU row-invariant kernels; on CUDA it is not built yet: "
                "use runtime.compile=false"
            )
        load_row_linear()
        # Every model's graphs are entries of one code object (StaticDecoder.rows): room for many models × widths.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.model = model
        self.device = next(model.parameters()).device
        self.kv_precision = kv_precision
        self.decoder = StaticDecoder(model)
        self.num_layers = len(self.decoder.layers)
        dec = self.decoder
        self.cache = StaticKV(self.num_layers, dec.kv_heads, dec.head_dim, dec.dtype, self.device, capacity)
        self._step = torch.compile(dec.rows, dynamic=False, fullgraph=True)
        self.compile_stats = CompileStats()
        self.widths = WIDTHS  # step widths a call may take (warm() narrows them); longer calls are prefills

    @property
    def num_computed(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.length = 0

    def truncate(self, length: int) -> None:
        self.cache.length = min(self.cache.length, length)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` at positions [num_computed, num_computed+n); logits [n, V] or [V] (``last_only``)."""
        count, start = len(token_ids), self.cache.length
        width = next((w for w in self.widths if w >= count), None)
        needed = start + (width or count)
        if needed > self.cache.capacity:
            self.cache.grow(needed)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        positions = torch.arange(start, start + count, device=self.device)
        if width is None:
            logits = self.decoder.prefill(ids, positions, self.cache.keys, self.cache.values, last_only, start)
        else:
            logits = self._rows(ids, positions, None, start, width)[:count]
        self.cache.length = start + count
        return logits[-1] if last_only else logits

    @torch.inference_mode()
    def forward_masked(self, token_ids: list[int], positions: list[int], visible: torch.Tensor) -> torch.Tensor:
        """:meth:`CachedModel.forward_masked`: ``token_ids`` at slots [num_computed, +n), rotary ``positions``,
        attending the slots ``visible`` [n, num_computed+n] sets; logits [n, V]."""
        count, start = len(token_ids), self.cache.length
        width = next((w for w in self.widths if w >= count), None)
        needed = start + (width or count)
        if needed > self.cache.capacity:
            self.cache.grow(needed)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        where = torch.tensor(positions, dtype=torch.long, device=self.device)  # [n]
        visible = visible.to(self.device, torch.bool)
        if width is None:
            logits = self.decoder.prefill(ids, where, self.cache.keys, self.cache.values, False, start, visible)
        else:
            logits = self._rows(ids, where, visible, start, width)[:count]
        self.cache.length = start + count
        return logits

    @torch.inference_mode()
    def commit_slots(self, start: int, slots: list[int]) -> None:
        """Keep slots [0, start) and then ``slots`` (ascending, >= start) moved to [start, start+len(slots))."""
        if slots != list(range(start, start + len(slots))):
            index = torch.tensor(slots, dtype=torch.long, device=self.device)
            for buffers in (self.cache.keys, self.cache.values):
                for layer in buffers:  # [Hkv, cap, D]
                    layer[:, start : start + len(slots)] = layer.index_select(1, index)
        self.truncate(start + len(slots))

    def warm(self, max_tokens: int, sizes: tuple[int, ...] = ()) -> None:
        """Compile now (outside measured time) every width a call of 1..``max_tokens`` tokens takes; resets the KV.

        ``sizes``: calls of these sizes get a bucket of their own too (a run comparing several verify widths
        measures each at its own bucket, not padded to the widest)."""
        self.widths = tuple(sorted({*widths_for(max_tokens), *(widths_for(size)[-1] for size in sizes)}))
        for width in self.widths:
            self.reset()
            self.forward([0] * width)
        self.reset()

    def _rows(
        self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None, start: int, width: int
    ) -> torch.Tensor:
        """ids/positions [n <= width] at slots [start, start+n), attending ``visible`` [n, start+n] (None: causal),
        padded to ``width`` rows (the last token repeated at the next slots, seeing only the real rows' prefix
        and itself) -> logits [width, V]. Chains and trees share one graph per width."""
        count, capacity = ids.shape[0], self.cache.capacity
        slots = torch.arange(start, start + width, device=self.device)  # [width]
        causal = torch.arange(capacity, device=self.device)[None] <= slots[:, None]  # [width, cap]
        if visible is not None:
            causal[:count, : start + count] &= visible
            causal[:count, start + count :] = False
        if count < width:
            pad = width - count
            ids = torch.cat([ids, ids[-1:].repeat(pad)])
            positions = torch.cat([positions, positions[-1:] + torch.arange(1, pad + 1, device=self.device)])
        key, stats = (width, capacity), self.compile_stats
        args = (ids, positions, slots, causal, self.cache.keys, self.cache.values)
        if key in stats.built:
            return self._step(*args)
        began = time.perf_counter()
        logits = self._step(*args)
        stats.built.add(key)
        stats.compile_seconds += time.perf_counter() - began
        return logits


def make_runner(model: torch.nn.Module, kv_precision: str, compiled: bool) -> CachedModel | CompiledModel:
    """The runner ``runtime.compile`` asks for: compiled static-KV steps, or eager transformers (the reference)."""
    return CompiledModel(model, kv_precision) if compiled else CachedModel(model, kv_precision)


def compiled_runners(engines) -> dict[str, CompiledModel]:
    """The compiled runners behind ``engines`` (targets, and draft models' runners), by role, each once."""
    found: dict[str, CompiledModel] = {}
    for engine in engines:
        target = getattr(engine, "target", None)
        runner = getattr(getattr(engine, "drafter", None), "runner", None)
        for role, candidate in (("target", target), ("draft", runner)):
            if isinstance(candidate, CompiledModel) and all(candidate is not seen for seen in found.values()):
                found[role if role not in found else f"{role}{len(found)}"] = candidate
    return found
