"""The compiled runner (``runtime.compile=true``): the static decoder over the paged pool, one graph per width.

A decode step of the embedded model in eager PyTorch is mostly per-operator overhead on top of reading
the weights. Here a step is :class:`~spectoolkit.kernels.static_decoder.StaticDecoder`'s plain tensor
code compiled by inductor (C++ through gcc on CPU) into one graph per row width:

- **Our kernels, so every row is computed by itself.** Linears are our packed kernel
  (:mod:`spectoolkit.quant.packing`; a model with layers it does not take is refused) and attention is
  ``spectoolkit::paged_attention``: a row attends exactly the pool slots its sequence lists for it (its
  positions [0, own], or a tree row's prefix and ancestors), in position order. So a row's result never
  depends on the other rows of the call, on the call's width or on how the step was chunked: a verify
  row equals the decode step at its position, a batched step equals each sequence stepped alone, and a
  prompt's KV is the same bits however the scheduler chunks it. The row mode changes nothing.
- **Bounded compiles.** A call of n rows runs at the smallest width in :data:`WIDTHS` that holds it,
  padded with rows that write nothing and read one slot; longer steps (prompts) run in chunks of the
  widest. The flat key-slot list is the only input whose size changes, and it is marked dynamic, so
  graphs are at most ``len(WIDTHS)`` per runner. :attr:`CompiledRunner.compile_stats` counts them and
  the seconds spent compiling.
- **The pool as the eager runner sees it.** New keys/values are stored in the pool's own format (the
  kernel writes the rows it is handed: cast, or int8/fp8 codes plus the per-row scale that
  :mod:`spectoolkit.kvcache.formats` computes), so the pool's moves, gathers and slot accounting work
  unchanged. int4 KV (grouped scales) runs eager only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels import cpu_ops
from spectoolkit.kernels.static_decoder import StaticDecoder
from spectoolkit.quant.packing import pack_model
from spectoolkit.runtime.attention import KERNEL_KV, row_key_lists
from spectoolkit.runtime.decoder_rows import decoder_rows, layer_stores
from spectoolkit.runtime.paged_kv import PagedKVPool
from spectoolkit.runtime.step import StepBatch

WIDTHS = (1, 2, 4, 8, 16, 32)  # row widths compiled on demand; a call pads to the next one, longer steps chunk
RECOMPILE_LIMIT = 64  # dynamo's per-code-object graph limit (default 8): room for many runners × widths


@dataclass
class CompileStats:
    """What compiling cost: the widths compiled and the seconds they took."""

    keys: set[tuple] = field(default_factory=set)  # (width, captured layers) of each graph compiled
    compile_seconds: float = 0.0
    graphs_at_warm_up: int | None = None  # graphs when warm-up ended (None: not marked)

    @property
    def built(self) -> set[int]:
        """The widths compiled (with any captured layers)."""
        return {width for width, _ in self.keys}

    @property
    def graphs(self) -> int:
        return len(self.keys)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted(self.built))

    def mark_warm(self) -> None:
        """Warm-up is over: any graph compiled from now on was compiled inside measured time."""
        self.graphs_at_warm_up = self.graphs

    def as_dict(self) -> dict:
        after = None if self.graphs_at_warm_up is None else self.graphs - self.graphs_at_warm_up
        return {"graphs": self.graphs, "compile_seconds": round(self.compile_seconds, 2), "widths": list(self.widths),
                "compiled_after_warm_up": after}  # fmt: skip


class CompiledRunner:
    """``forward(batch)`` of a Llama-family model (float or rtn-* weights, on CPU) through compiled graphs."""

    def __init__(self, model: torch.nn.Module, pool: PagedKVPool, widths: tuple[int, ...] = WIDTHS) -> None:
        """``widths``: the row widths a call may take (each one graph); steps wider than the widest are chunked."""
        if next(model.parameters()).device.type != "cpu":
            raise SpecToolkitError(
                "runtime.compile=true runs the CPU row-invariant kernels; on CUDA it is not built yet: "
                "use runtime.compile=false"
            )
        if pool.precision not in KERNEL_KV:
            raise SpecToolkitError(
                f"runtime.compile=true stores KV as {', '.join(KERNEL_KV)}, not {pool.precision}: "
                "pick another kv precision or runtime.compile=false"
            )
        unpacked = {kind: why for kind, why in pack_model(model).items() if why.startswith("own path")}
        if unpacked:
            kind, why = next(iter(unpacked.items()))
            raise SpecToolkitError(
                f"runtime.compile=true runs our packed kernels; layer {kind} keeps its own path "
                f"({why.removeprefix('own path: ')}): use runtime.compile=false, or a float/rtn-* precision"
            )
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # A bf16 value rounded in eager code is rounded in the graph too (no fused upcast skips it): the eager bits.
        torch._inductor.config.emulate_precision_casts = True
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        self.isa = cpu_ops.best_isa()
        self.decoder = StaticDecoder(model, self.isa)  # refuses what our kernels do not take (head dims included)
        self.row_exact = True  # our linears and attention: every row computed by itself
        self.stores = layer_stores(pool)
        self.widths = tuple(sorted(widths))
        self.compile_stats = CompileStats()
        self._capture: tuple[int, ...] = ()  # the layers whose input states the next graph call returns
        self._step = torch.compile(self._rows, dynamic=False, fullgraph=True)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's KV to the pool; logits [R, V] of ``batch.logit_rows`` (in chunks of the widest width)."""
        return self.forward_states(batch, ())[0]

    @torch.inference_mode()
    def forward_states(self, batch: StepBatch, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits and the residual stream entering each of ``layers``, [T, len(layers) * E] (a graph
        per width and set of layers)."""
        total, hidden, captured, chunk = batch.token_ids.shape[0], [], [], self.widths[-1]
        keys = row_key_lists(batch)  # T lists of slots
        self._capture = tuple(layers)
        for first in range(0, total, chunk):
            last = min(total, first + chunk)
            rows, states = self._call(batch, keys[first:last], first, last)
            hidden.append(rows)
            captured.append(states)
        return self.decoder.head(torch.cat(hidden)[batch.logit_rows]), torch.cat(captured)  # [R, V], [T, n*E]

    @torch.inference_mode()  # as forward runs: grad mode and tensor dispatch keys are part of a graph's guards
    def warm(self, widths: tuple[int, ...] | None = None, capture: tuple[int, ...] = ()) -> None:
        """Compile the graph of every width now (outside measured time), narrowed to ``widths`` when given (a
        call pads up to the smallest of them that holds it), returning the states entering the layers of
        ``capture`` (:meth:`forward_states`); writes nothing to the pool."""
        self.widths = tuple(sorted(set(widths))) if widths else self.widths
        self._capture = tuple(capture)
        for width in self.widths:  # every row reads two slots: a key list of one would be specialized to size 1
            ids = torch.zeros(width, dtype=torch.long, device=self.device)
            cos, sin = self.decoder.rope.rows(ids)
            keys = torch.zeros(2 * width, dtype=torch.long, device=self.device)
            write = torch.full((width,), -1, dtype=torch.long, device=self.device)
            starts = torch.arange(0, 2 * width + 1, 2, dtype=torch.long, device=self.device)
            self._timed(width, ids, cos, sin, write, keys, starts)

    def _call(self, batch: StepBatch, keys: list[torch.Tensor], first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of ``batch`` padded to a width: their final hidden states [last-first, E]."""
        count = last - first
        width = next(w for w in self.widths if w >= count)
        pad = width - count
        # Copies made here, under inference mode: a graph's guards include its inputs' dispatch keys.
        ids, positions = batch.token_ids[first:last].clone(), batch.positions[first:last].clone()
        write = batch.slots[first:last].clone()
        if pad:
            zeros = torch.zeros(pad, dtype=torch.long, device=self.device)
            ids, positions = torch.cat([ids, zeros]), torch.cat([positions, zeros])
            write = torch.cat([write, zeros - 1])  # padding rows write nothing
            keys = keys + [keys[0][:1]] * pad  # ... and read one slot (their output is dropped)
        lengths = torch.tensor([0] + [len(k) for k in keys], dtype=torch.long, device=self.device)
        cos, sin = self.decoder.rope.rows(positions)  # [W, D] each, gathered outside the graph
        hidden, states = self._timed(width, ids, cos, sin, write, torch.cat(keys), lengths.cumsum(0))
        return hidden[:count], states[:count]

    def _timed(self, width: int, *args: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(args[4], 0)  # the flat key-slot list: its length changes every step
        graph = (width, self._capture)
        if graph in self.compile_stats.keys:
            return self._step(*args)
        began = time.perf_counter()
        out = self._step(*args)
        self.compile_stats.keys.add(graph)
        self.compile_stats.compile_seconds += time.perf_counter() - began
        return out

    def _rows(self, ids, cos, sin, write, key_slots, starts) -> tuple[torch.Tensor, torch.Tensor]:
        """ids/write [W], cos/sin [W, D], key_slots [N] (row i: [starts[i], starts[i+1])) -> hidden [W, E] and the
        states entering the layers of ``_capture`` (a constant of the graph) [W, n*E]."""
        return decoder_rows(self.decoder, self.stores, ids, cos, sin, write, key_slots, starts, self._capture)


def bucket(rows: int) -> int:
    """The width a call of ``rows`` rows pads to among :data:`WIDTHS` (wider calls are chunked at the widest)."""
    return next((width for width in WIDTHS if width >= rows), WIDTHS[-1])


def compiled_runners(engines) -> dict[str, CompiledRunner]:
    """The compiled runners ``engines`` drive (each ``runners()`` by role), each once: "target", "draft", "target2"…"""
    found: dict[str, CompiledRunner] = {}
    for engine in engines:
        for role, runner in engine.runners().items():
            if isinstance(runner, CompiledRunner) and all(runner is not seen for seen in found.values()):
                found[role if role not in found else f"{role}{len(found)}"] = runner
    return found
