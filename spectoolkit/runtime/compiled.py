"""The compiled runner (``runtime.compile=true``): the static decoder over the paged pool, one graph per width.

A decode step of the embedded model in eager PyTorch is mostly per-operator overhead on top of reading
the weights. Here a step is :class:`~spectoolkit.models.static_decoder.StaticDecoder`'s plain tensor
code compiled by inductor (C++ through gcc on CPU) into one graph per row width:

- **Every graph row is row-invariant.** Linears are the row-invariant C++ kernel and attention is
  ``spectoolkit::paged_attention``: a row attends exactly the pool slots its sequence lists for it (its
  positions [0, own], or a tree row's prefix and ancestors), in position order. So a row's result never
  depends on the other rows of the call, on the call's width or on how the step was chunked: a verify
  row equals the decode step at its position, a batched step equals each sequence stepped alone, and the
  row modes of :mod:`spectoolkit.runtime.step` hold by construction. Under ``invariant`` mode
  (``serve.batch_invariant``) prompts run the same way, in chunks of the widest width (slower than a BLAS
  prefill, but a prompt's KV is then the same bits however the scheduler chunks it).
- **BLAS prefill otherwise.** A lone sequence's prompt chunk longer than the widest width (one segment,
  at most its last row's logits, row mode not ``invariant``) runs the eager runner's forward over the
  same pool instead: BLAS and SDPA, as the stock model prefills. It is one call for a prompt at batch
  1, identical in every arm; decode steps and verifies (a logit row each) always run the graphs.
- **Bounded compiles.** A call of n rows runs at the smallest width in :data:`WIDTHS` that holds it,
  padded with rows that write nothing and read one slot; the flat key-slot list is the only input whose
  size changes, and it is marked dynamic, so graphs are at most ``len(WIDTHS)`` per runner.
  :attr:`CompiledRunner.compile_stats` counts them and the seconds spent compiling.
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
from spectoolkit.models.row_linear import load_row_linear
from spectoolkit.models.static_decoder import StaticDecoder, linear_rows
from spectoolkit.runtime.eager import EagerRunner
from spectoolkit.runtime.paged_kv import PagedKVPool
from spectoolkit.runtime.step import StepBatch

WIDTHS = (1, 2, 4, 8, 16, 32)  # row widths compiled on demand; a call pads to the next one, longer steps chunk
RECOMPILE_LIMIT = 64  # dynamo's per-code-object graph limit (default 8): room for many runners × widths
COMPILED_KV = ("auto", "fp32", "bf16", "fp16", "int8", "fp8")


@dataclass
class CompileStats:
    """What compiling cost: the widths compiled and the seconds they took."""

    built: set[int] = field(default_factory=set)  # widths of the graphs compiled
    compile_seconds: float = 0.0
    graphs_at_warm_up: int | None = None  # graphs when warm-up ended (None: not marked)

    @property
    def graphs(self) -> int:
        return len(self.built)

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
        if pool.precision not in COMPILED_KV:
            raise SpecToolkitError(
                f"runtime.compile=true stores KV as {', '.join(COMPILED_KV)}, not {pool.precision}: "
                "pick another kv precision or runtime.compile=false"
            )
        load_row_linear()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        self.decoder = StaticDecoder(model)
        self.stores = [_stores(layer) for layer in pool.layers]  # per layer: (k, v, k_scale, v_scale)
        self.widths = tuple(sorted(widths))
        self.compile_stats = CompileStats()
        self._step = torch.compile(self._rows, dynamic=False, fullgraph=True)
        self._prefill = EagerRunner(model, pool)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's KV to the pool; logits [R, V] of ``batch.logit_rows`` (in chunks of the widest width)."""
        total, hidden, chunk = batch.token_ids.shape[0], [], self.widths[-1]
        if total > chunk and batch.num_seqs == 1 and batch.mode != "invariant" and len(batch.logit_rows) <= 1:
            if batch.visible[0] is None:  # a lone prompt chunk: the BLAS prefill (module doc)
                return self._prefill.forward(batch)
        keys = _row_keys(batch)  # T lists of slots
        for first in range(0, total, chunk):
            last = min(total, first + chunk)
            hidden.append(self._call(batch, keys[first:last], first, last))
        states = torch.cat(hidden)[batch.logit_rows]  # [R, E]
        return linear_rows(self.decoder.head, states)  # [R, V]

    @torch.inference_mode()  # as forward runs: grad mode and tensor dispatch keys are part of a graph's guards
    def warm(self, widths: tuple[int, ...] | None = None) -> None:
        """Compile the graph of every width now (outside measured time), narrowed to ``widths`` when given (a
        call pads up to the smallest of them that holds it); writes nothing to the pool."""
        self.widths = tuple(sorted(set(widths))) if widths else self.widths
        for width in self.widths:  # every row reads two slots: a key list of one would be specialized to size 1
            ids, positions = (torch.zeros(width, dtype=torch.long, device=self.device) for _ in range(2))
            keys = torch.zeros(2 * width, dtype=torch.long, device=self.device)
            write = torch.full((width,), -1, dtype=torch.long, device=self.device)
            starts = torch.arange(0, 2 * width + 1, 2, dtype=torch.long, device=self.device)
            self._timed(width, ids, positions, write, keys, starts)

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
        return self._timed(width, ids, positions, write, torch.cat(keys), lengths.cumsum(0))[:count]

    def _timed(self, width: int, *args: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(args[3], 0)  # the flat key-slot list: its length changes every step
        if width in self.compile_stats.built:
            return self._step(*args)
        began = time.perf_counter()
        out = self._step(*args)
        self.compile_stats.built.add(width)
        self.compile_stats.compile_seconds += time.perf_counter() - began
        return out

    def _rows(self, ids, positions, write, key_slots, starts) -> torch.Tensor:
        """ids/positions/write [W], key_slots [N] with row i's slots at [starts[i], starts[i+1]) -> hidden [W, E]."""
        dec, encode = self.decoder, self.pool._encode
        hidden = dec.embed(ids)  # [W, E]
        cos, sin = dec.rotary(hidden[None], positions[None])  # [1, W, D] each
        for layer, (k_store, v_store, k_scales, v_scales) in zip(dec.layers, self.stores, strict=True):
            attn = layer.self_attn
            q, k, v = dec.qkv(attn, layer.input_layernorm(hidden), cos, sin)  # [W, Hq|Hkv, D]
            k_new, v_new = encode(k), encode(v)  # field -> [W, Hkv, width]
            k_scale, v_scale = _scale(k_new, k_scales), _scale(v_new, v_scales)
            out = torch.ops.spectoolkit.paged_attention(  # [W, Hq, D] fp32
                q.float(), k_new["data"], v_new["data"], k_scale, v_scale, k_store, v_store, k_scales, v_scales, write,
                key_slots, starts, dec.scale,
            )  # fmt: skip
            hidden = hidden + linear_rows(attn.o_proj, out.to(hidden.dtype).reshape(out.shape[0], -1))
            hidden = hidden + dec.mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        return dec.norm(hidden)


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


def _stores(layer: dict) -> tuple[torch.Tensor, ...]:
    """A pool layer's (keys, values, key scales, value scales) as the kernel reads them (no scales: empty)."""
    key, value = layer["key"], layer["value"]
    none = torch.empty(0, dtype=torch.float32, device=key["data"].device)
    return key["data"], value["data"], key.get("scale", none), value.get("scale", none)


def _scale(fresh: dict, store: torch.Tensor) -> torch.Tensor:
    """The new rows' scales [W, Hkv, 1], or an empty tensor for a store without scales."""
    return fresh["scale"] if store.numel() else store


def _row_keys(batch: StepBatch) -> list[torch.Tensor]:
    """The slots each of the batch's T rows attends, in position order: [0, own] of a chain, a tree row's
    prefix, ancestors and itself."""
    keys = []
    for b in range(batch.num_seqs):
        first, count = batch.rows_of(b)
        start, context = batch.start_of(b), batch.context_lens[b]
        span = batch.spans[b]
        slots = batch.key_slots[b] if span is None else torch.arange(span, span + context, device=batch.slots.device)
        tree = batch.visible[b]
        keys.extend(slots[: start + r + 1] if tree is None else slots[tree[r]] for r in range(count))
    return keys
