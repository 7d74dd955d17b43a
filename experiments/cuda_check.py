"""One prepared run of the Triton kernels and the one runner on a CUDA GPU (issue 29, "CUDA stays possible").

From the repo root, with a Python that has torch (a CUDA build), triton, transformers and the package's
other dependencies (a ``.venv`` from ``make install``, which also installs the package editable; on a GPU box
``make install TORCH=torch==2.13.0`` with a CUDA index configured)::

    python experiments/cuda_check.py --out DIR    # DIR defaults to $OUT; e.g. .venv/bin/python ...

Nothing is downloaded, and the package need not be installed: run from a bare checkout, the script maps
kernels/ and conf/ into ``spectoolkit`` itself (as pyproject's package-dir does), for its own parts and for
the pytest subprocess (``python -m pip install --no-deps --no-build-isolation -e .`` installs it offline).
Part (d) builds its model from a ``LlamaConfig`` with a fixed seed. About 3–6 minutes on an H200; the pytest
part runs last, with what is left of ``--budget`` seconds (default 420).

Writes ``DIR/cuda_check.json`` (rewritten after every part, so a killed run keeps what it finished) and
``DIR/cuda_check.txt`` (a short summary). Each part runs on its own: a failure is recorded with its traceback,
a part that cannot run here as ``"skipped: <reason>"``, and the others still run.

- ``invariance`` (b) — DESIGN §7: quant_matmul at Llama-3.1-8B shapes (int4 g=128, int8 per channel, bf16 x):
  rows 1..64 one call each against the same rows in one call (and the prefixes 2, 5, 16, 17, 33), counted
  by ``torch.equal`` per row; kv_attention: each of 8 requests of different lengths alone against the batch
  of 8 (int8/int4/fp8/bf16 KV, Q = 1 and 5), and decode steps against the rows of a verify window that
  crosses a split boundary.
- ``timing`` (c): quant_matmul against the torch bf16 path (``F.linear`` on the dequantized weight) at
  M = 1, 2, 4, 8, 16 (:func:`spectoolkit.kernels.bench.time_pair`): ms, GB/s, share of peak, V(M)/T(1).
- ``engine`` (d): a tiny random Llama on the one engine, greedy: the target alone against speculation with
  n-gram lookup and an rtn-int4 self-draft (its linears on the Triton kernel), and n-gram with four requests
  in flight (batch-invariant mode); every output must equal the target alone's, token for token.
- ``pytest`` (a): ``pytest tests/kernels -q`` in a subprocess (its conftest picks the GPU): pass/fail counts.

``--smoke`` runs (b)–(d) at toy shapes on the CPU, the kernels under ``TRITON_INTERPRET=1`` (set here before
triton is imported), so CI checks this script (tests/test_cuda_check.py); (a) is skipped there. Under the
interpreter ``tl.dot`` is numpy's matmul, so (b)'s bit checks count mismatches without judging them (the
summation order of a row within a tile is then the BLAS's) and every call is judged against its reference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE_QUANT_SHAPES = ((48, 256, "toy"),)  # (N, K, name)
SMOKE_KV = {"heads": (8, 2), "head_dim": 64, "contexts": (130, 6, 37, 200, 64, 65, 100, 7), "split_len": 64}
CUDA_KV = {"heads": (32, 8), "head_dim": 128, "contexts": (3000, 17, 700, 4100, 513, 64, 2048, 1500), "split_len": None}
TIMED_ROWS = (1, 2, 4, 8, 16)
# --smoke: the interpreter's tl.dot is numpy's matmul, so a row's summation order within a tile is the BLAS's
# (OPENBLAS_CORETYPE changes it), not the kernel's: the bit checks' counts are recorded, not judged, and each
# call is judged against the reference instead (tests/kernels/conftest.py).
INTERPRETER_BITS = "not judged: under the interpreter a row's order within a tile is numpy's BLAS's"
GPU_BITS = "judged: the GPU tile's summation order"
QUANT_REFERENCE_TOL = 2**-6  # max |kernel - reference| / max |reference|, bf16 output (8 significant bits)
KV_REFERENCE_TOL = {"torch.float32": 2e-5, "torch.bfloat16": 3e-2}  # as tests/kernels/test_kv_attention.py
# Makes `spectoolkit` importable from this checkout when it is not installed: kernels/ and conf/ sit at the repo
# root and map into the package (pyproject's package-dir), so the root joins the package's search path.
BOOTSTRAP = "import sys; sys.path.insert(0, {root!r}); import spectoolkit; spectoolkit.__path__.append({root!r})"


class Skipped(Exception):
    """A part that cannot run here (recorded as ``"skipped: <reason>"``)."""


# ---- (b) invariance ------------------------------------------------------------------------------------------


def quant_invariance(device, smoke: bool) -> dict:
    """Rows alone against rows together, per Llama shape and format; mismatching rows counted by torch.equal."""
    import torch

    from spectoolkit.kernels import quant_matmul as qm
    from spectoolkit.kernels.rtn_format import quantize_weight

    num_rows = 8 if smoke else 64
    widths = sorted({m for m in (2, 5, 16, 17, 33) if m < num_rows} | {num_rows})
    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    for out_features, in_features, name in SMOKE_QUANT_SHAPES if smoke else qm.LLAMA_8B_SHAPES:
        weight = torch.randn(out_features, in_features, generator=gen, device=device) * 0.02  # [N, K]
        for cfg, label in _quant_formats():
            q = quantize_weight(weight, cfg)
            packed = qm.pack_for_kernel(q)
            x = torch.randn(num_rows, in_features, generator=gen, device=device).to(torch.bfloat16)  # [M, K]
            alone = torch.cat([qm.quant_matmul(x[i : i + 1], packed) for i in range(num_rows)])  # [M, N]
            by_width = {m: int((qm.quant_matmul(x[:m], packed) != alone[:m]).any(1).sum()) for m in widths}
            reference = qm.reference_quant_matmul(x, q).float()
            error = ((alone.float() - reference).abs().max() / reference.abs().max()).item()
            cases.append({"shape": f"{name} N={out_features} K={in_features}", "format": label, "rows": num_rows,
                          "mismatched_rows": max(by_width.values()), "mismatched_rows_by_width": by_width,
                          "max_error_vs_reference": error})  # fmt: skip
        del weight
    return {"cases": cases, "mismatched_rows": sum(case["mismatched_rows"] for case in cases),
            "bits": INTERPRETER_BITS if smoke else GPU_BITS,
            "reference_ok": all(case["max_error_vs_reference"] <= QUANT_REFERENCE_TOL for case in cases)}  # fmt: skip


def _quant_formats():
    from spectoolkit.kernels.rtn_format import RtnConfig

    return ((RtnConfig(4, 128), "int4 g=128"), (RtnConfig(8, -1), "int8 per-channel"))


def kv_invariance(device, smoke: bool) -> dict:
    """Each request alone against the batch of 8; decode steps against a verify window's rows."""
    import torch

    from spectoolkit.kernels import kv_attention as kva

    shape = SMOKE_KV if smoke else CUDA_KV
    split_len = shape["split_len"] or kva.SPLIT_LEN
    formats = [fmt for fmt in ("int8", "int4", "fp8", "bf16") if kva.kernel_supports(shape["head_dim"], fmt, device)]
    dtypes = (torch.float32,) if smoke else (torch.bfloat16, torch.float32)
    checked = (0, 1) if smoke else range(len(shape["contexts"]))  # the interpreter is slow: two requests there
    cases = []
    for fmt in formats if not smoke else ("int8", "int4"):
        for dtype in dtypes:
            for q_len in (1, 5):
                query, keys, values, prefixes = _kv_case(fmt, shape, shape["contexts"], q_len, dtype, device)
                batched = kva.kv_attention(query, keys, values, fmt, prefixes, split_len=split_len)
                mismatched, errors = [], [_kv_error(kva, batched, query, keys, values, fmt, prefixes)]
                for b in checked:
                    own = [{name: t[b : b + 1] for name, t in fields.items()} for fields in (keys, values)]
                    alone = kva.kv_attention(query[b : b + 1], *own, fmt, prefixes[b], split_len=split_len)
                    mismatched += [] if torch.equal(alone, batched[b : b + 1]) else [b]
                    errors.append(_kv_error(kva, alone, query[b : b + 1], *own, fmt, [prefixes[b]]))
                cases.append({"check": "alone vs batched", "format": fmt, "dtype": str(dtype), "q_len": q_len,
                              "requests": len(checked), "mismatched": mismatched,
                              "max_error_vs_reference": max(errors)})  # fmt: skip
            prefix = split_len - 2  # the verify window crosses the first split boundary
            query, keys, values, _ = _kv_case(fmt, shape, (prefix + 5,), 5, dtype, device)
            window = kva.kv_attention(query, keys, values, fmt, prefix, split_len=split_len)  # [1, H, 5, D]
            steps = [kva.kv_attention(query[:, :, i : i + 1], keys, values, fmt, prefix + i, split_len=split_len)
                     for i in range(5)]  # fmt: skip
            mismatched = [i for i, step in enumerate(steps) if not torch.equal(step, window[:, :, i : i + 1])]
            errors = [_kv_error(kva, out, query, keys, values, fmt, [prefix]) for out in (window, torch.cat(steps, 2))]
            cases.append({"check": "decode vs verify row", "format": fmt, "dtype": str(dtype), "prefix": prefix,
                          "mismatched": mismatched, "max_error_vs_reference": max(errors)})  # fmt: skip
    return {
        "split_len": split_len,
        "cases": cases,
        "mismatches": sum(len(case["mismatched"]) for case in cases),
        "bits": INTERPRETER_BITS if smoke else GPU_BITS,
        "reference_ok": all(case["max_error_vs_reference"] <= KV_REFERENCE_TOL[case["dtype"]] for case in cases),
    }


def _kv_error(kva, out, query, keys, values, fmt: str, prefixes) -> float:
    """max |out - reference| elementwise, relative to 1 + |reference| (the kernel tests' atol = rtol bound)."""
    reference = kva.kv_attention_reference(query, keys, values, fmt, prefixes).float()
    return ((out.float() - reference).abs() / (1 + reference.abs())).max().item()


def _kv_case(fmt: str, shape: dict, contexts, q_len: int, dtype, device):
    """(query [B, H, Q, D], key fields, value fields, prefix lengths): random states, total lengths ``contexts``."""
    import torch

    from spectoolkit.kvcache.formats import KV_FORMATS

    gen = torch.Generator(device=device).manual_seed(len(contexts) * 10 + q_len)
    (num_heads, kv_heads), head_dim = shape["heads"], shape["head_dim"]
    states = [torch.randn(len(contexts), kv_heads, max(contexts) + 3, head_dim, generator=gen, device=device)
              for _ in range(2)]  # fmt: skip
    fields = [{"data": s.bfloat16()} if fmt == "bf16" else KV_FORMATS[fmt].quantize(s) for s in states]
    query = torch.randn(len(contexts), num_heads, q_len, head_dim, generator=gen, device=device).to(dtype)
    return query, fields[0], fields[1], [context - q_len for context in contexts]


# ---- (c) timing ----------------------------------------------------------------------------------------------


def timing(device, smoke: bool) -> dict:
    """quant_matmul against F.linear on the bf16 dequantized weight at M = 1..16; V(M)/T(1) per arm."""
    import torch
    import torch.nn.functional as F

    from spectoolkit.kernels import quant_matmul as qm
    from spectoolkit.kernels.bench import peak_gbps, time_pair
    from spectoolkit.kernels.rtn_format import dequantize_weight, quantize_weight

    peak = peak_gbps(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    timer = time_pair if device.type == "cuda" else _wall_time_pair
    repeat, warmup = (2, 1) if smoke else (50, 10)
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for out_features, in_features, name in SMOKE_QUANT_SHAPES if smoke else qm.LLAMA_8B_SHAPES:
        weight = torch.randn(out_features, in_features, generator=gen, device=device) * 0.02
        for cfg, label in _quant_formats():
            q = quantize_weight(weight, cfg)
            packed, dense = qm.pack_for_kernel(q), dequantize_weight(q).to(torch.bfloat16)  # dense [N, K]
            first = None
            for m in TIMED_ROWS[:2] if smoke else TIMED_ROWS:
                x = torch.randn(m, in_features, generator=gen, device=device).to(torch.bfloat16)  # [M, K]
                kernel_ms, torch_ms = _time(timer, qm.quant_matmul, F.linear, x, packed, dense, repeat, warmup)
                first = first or (kernel_ms, torch_ms)
                gbps = (packed.nbytes + 2 * m * (in_features + out_features)) / (kernel_ms * 1e-3) / 1e9
                rows.append({"shape": f"{name} N={out_features} K={in_features}", "format": label, "m": m,
                             "kernel_ms": kernel_ms, "torch_ms": torch_ms, "kernel_gbps": gbps,
                             "peak_fraction": gbps / peak if peak else None, "kernel_v_over_t1": kernel_ms / first[0],
                             "torch_v_over_t1": torch_ms / first[1]})  # fmt: skip
    return {"peak_gbps": peak, "rows": rows}


def _time(timer, kernel, linear, x, packed, dense, repeat: int, warmup: int) -> tuple[float, float]:
    """Median ms of the kernel on ``packed`` and of ``F.linear`` on ``dense``, for the same x."""
    return timer(lambda: kernel(x, packed), lambda: linear(x, dense), repeat, warmup)


def _wall_time_pair(first, second, repeat: int, warmup: int) -> tuple[float, float]:
    """time_pair's CPU stand-in (smoke mode): median wall milliseconds of two callables, alternated."""
    import statistics

    for _ in range(warmup):
        first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, out in ((first, times[0]), (second, times[1])):
            began = time.perf_counter()
            fn()
            out.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


# ---- (d) the one engine ----------------------------------------------------------------------------------------


def engine_check(device, smoke: bool, workdir: Path) -> dict:
    """Greedy target alone against speculation (n-gram, rtn-int4 self-draft, n-gram × 4 in flight) on the engine."""
    import torch

    from spectoolkit.drafting import NgramDrafter
    from spectoolkit.serving.one import OneRequestEngine
    from spectoolkit.wiring.loading import load_model

    path, vocab, eos = _tiny_llama(workdir, smoke)
    notes: dict = {}
    precision = "fp32" if smoke else "bf16"
    target = load_model(str(path), precision, device, kernels="reference")
    prompts, max_new, gamma = _prompts(vocab, 2 if smoke else 4), 12 if smoke else 32, 4
    baseline = OneRequestEngine(_engine(target.model, eos, None, 0), "baseline")
    references = [baseline.generate(list(p), max_new, None).output_ids for p in prompts]
    cases = {}

    def run(name: str, make_drafter) -> None:
        try:
            spec = OneRequestEngine(_engine(target.model, eos, make_drafter(), gamma), "spec")
            outs = [spec.generate(list(p), max_new, None) for p in prompts]
            cases[name] = _compare(references, [o.output_ids for o in outs])
            cases[name]["drafted"] = sum(o.drafted_tokens for o in outs)
            cases[name]["accepted"] = sum(o.accepted_tokens for o in outs)
        except Exception as exc:  # one drafter's failure keeps the others' results
            cases[name] = {"status": f"failed: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}

    run("ngram", lambda: NgramDrafter(3, 2, vocab, one_hot_probs=False))
    run("rtn-int4", lambda: _self_draft(path, device, vocab, eos, notes))
    try:
        cases["ngram-4-in-flight"] = _four_in_flight(target.model, eos, vocab, prompts, references, max_new, gamma)
    except Exception as exc:
        cases["ngram-4-in-flight"] = {"status": f"failed: {type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()}  # fmt: skip
    identical = all(case.get("identical") is True for case in cases.values())
    return {"target": precision, "prompts": len(prompts), "max_new": max_new, "gamma": gamma, "cases": cases,
            "identical": identical, "device": str(torch.device(device)), **notes}  # fmt: skip


def _tiny_llama(workdir: Path, smoke: bool) -> tuple[Path, int, frozenset[int]]:
    """A random Llama checkpoint (fixed seed) in ``workdir``: its path, vocabulary size and EOS ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, vocab = (64, 2, 512) if smoke else (256, 4, 2048)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper next-token distributions: greedy is not a string of near-ties
    path = workdir / "tiny-llama"
    model.save_pretrained(path)
    return path, vocab, frozenset({2})


def _prompts(vocab: int, count: int) -> list[list[int]]:
    """Random prompts with a repeated stretch, so n-gram lookup finds drafts."""
    import torch

    gen = torch.Generator().manual_seed(1)
    out = []
    for length in (8, 13, 6, 10)[:count]:
        base = torch.randint(3, vocab, (length,), generator=gen).tolist()
        out.append([1, *base, *base[:5], *base])
    return out


def _engine(model, eos: frozenset[int], drafter, gamma: int, max_seqs: int = 1, invariant: bool = False):
    """The one engine over ``model`` (its own pool), greedy, ``drafter`` with a fixed γ (or none)."""
    from spectoolkit.policy import FixedPolicy
    from spectoolkit.runtime.blocks import BlockAllocator
    from spectoolkit.runtime.eager import EagerRunner
    from spectoolkit.runtime.paged_kv import make_pool
    from spectoolkit.serving.engine import ContinuousEngine
    from spectoolkit.serving.scheduler import SchedulerLimits
    from spectoolkit.verify import GreedyVerifier

    slots, block = 4096, 16
    runner = EagerRunner(model, make_pool(model, "auto", slots))
    limits = SchedulerLimits(2048, max_seqs, None, None)
    return ContinuousEngine("cuda-check", runner, BlockAllocator(slots // block, block), GreedyVerifier(), limits,
                            eos, 1024, drafter, False, invariant, FixedPolicy(gamma))  # fmt: skip


def _self_draft(path: Path, device, vocab: int, eos: frozenset[int], notes: dict):
    """A ModelDrafter on the checkpoint quantized rtn-int4 (g=32); ``notes`` which linear class runs it."""
    from spectoolkit.drafting import ModelDrafter
    from spectoolkit.runtime.blocks import BlockAllocator
    from spectoolkit.runtime.eager import EagerRunner
    from spectoolkit.runtime.paged_kv import make_pool
    from spectoolkit.sampling import GreedyChooser
    from spectoolkit.wiring.loading import load_model

    draft = load_model(str(path), "rtn-int4", device, group_size=32, kernels="reference").model
    notes["draft_linear"] = type(draft.model.layers[0].mlp.up_proj).__name__  # _TritonCuda on CUDA
    runner = EagerRunner(draft, make_pool(draft, "auto", 4096))
    return ModelDrafter(runner, GreedyChooser(), BlockAllocator(256, 16), vocab, vocab, eos)


def _four_in_flight(model, eos, vocab: int, prompts, references, max_new: int, gamma: int) -> dict:
    """All prompts submitted at once to a speculating engine in batch-invariant mode."""
    from spectoolkit.drafting import NgramDrafter
    from spectoolkit.serving.api import ServeRequest

    drafter = NgramDrafter(3, 2, vocab, one_hot_probs=False)
    engine = _engine(model, eos, drafter, gamma, max_seqs=len(prompts), invariant=True)
    for index, prompt in enumerate(prompts):
        engine.submit(ServeRequest(str(index), list(prompt), max_new))
    done = {}
    while engine.has_work():
        done.update({result.request_id: result for result in engine.step()})
    return _compare(references, [done[str(i)].output_ids for i in range(len(prompts))])


def _compare(references: list[list[int]], outputs: list[list[int]]) -> dict:
    diverged = [i for i, (ref, out) in enumerate(zip(references, outputs, strict=True)) if ref != out]
    return {"status": "ok", "identical": not diverged, "diverged_prompts": diverged}


# ---- (a) pytest, and the driver --------------------------------------------------------------------------------


def pytest_part(smoke: bool, timeout_s: float, args: list[str], installed: bool) -> dict:
    """``pytest tests/kernels -q`` in a subprocess (killed after ``timeout_s``); the counts from its summary line."""
    if smoke:
        raise Skipped("smoke mode (CI runs tests/kernels itself)")
    pytest_args = [*args, "-q", "-p", "no:cacheprovider"]
    if installed:
        command = [sys.executable, "-m", "pytest", *pytest_args]
    else:
        run = BOOTSTRAP.format(root=str(ROOT)) + f"; import pytest; sys.exit(pytest.main({pytest_args!r}))"
        command = [sys.executable, "-c", run]
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(30.0, timeout_s))
        output, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, returncode = _text(exc.stdout) + _text(exc.stderr), "timeout"
    last = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed)", last)}
    failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"command": " ".join(command), "returncode": returncode, "counts": counts, "failed_tests": failed,
            "tail": output[-4000:]}  # fmt: skip


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def _import_package() -> bool:
    """Import ``spectoolkit.kernels``, from this checkout when the package is not installed; whether it was."""
    try:
        import spectoolkit.kernels  # noqa: F401

        return True
    except ImportError:
        exec(BOOTSTRAP.format(root=str(ROOT)))
        import spectoolkit.kernels  # noqa: F401

        return False


def _run_part(results: dict, name: str, out_dir: Path, fn, *args) -> None:
    began = time.perf_counter()
    try:
        results[name] = {"status": "ok", **fn(*args)}
    except Skipped as exc:
        results[name] = {"status": f"skipped: {exc}"}
    except Exception as exc:  # a part's failure must not lose the others' results
        results[name] = {"status": f"failed: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    results[name]["seconds"] = round(time.perf_counter() - began, 2)
    (out_dir / "cuda_check.json").write_text(json.dumps(results, indent=1, default=str))


def summary(results: dict) -> str:
    """A few lines a reader checks first: each part's status and its headline numbers."""
    lines = [f"cuda_check on {results['meta']['device']} (smoke={results['meta']['smoke']})"]
    for name in ("invariance_quant_matmul", "invariance_kv_attention", "timing", "engine", "pytest"):
        part = results.get(name, {"status": "not run"})
        line = f"{name}: {part['status']} ({part.get('seconds', 0)} s)"
        if name == "invariance_quant_matmul" and "mismatched_rows" in part:
            line += f"; mismatched rows {part['mismatched_rows']} over {len(part['cases'])} cases ({part['bits']})"
        if name == "invariance_kv_attention" and "mismatches" in part:
            line += f"; mismatches {part['mismatches']} over {len(part['cases'])} cases ({part['bits']})"
        if name == "engine" and "identical" in part:
            line += f"; identical to the target alone: {part['identical']}"
        if name == "pytest" and "counts" in part:
            line += f"; {part['counts']}"
        lines.append(line)
        if name == "timing" and "rows" in part:
            lines += [_timing_line(row) for row in part["rows"]]
    return "\n".join(lines) + "\n"


def _timing_line(row: dict) -> str:
    share = f" ({100 * row['peak_fraction']:.0f}% of peak)" if row["peak_fraction"] else ""
    return (f"  {row['format']} {row['shape']} M={row['m']}: {row['kernel_ms']:.4f} ms (torch {row['torch_ms']:.4f}),"
            f" {row['kernel_gbps']:.0f} GB/s{share}, V/T1 {row['kernel_v_over_t1']:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="output directory (default: $OUT)")
    parser.add_argument("--smoke", action="store_true", help="toy shapes on the CPU, Triton's interpreter")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (pytest gets the rest)")
    parser.add_argument("--pytest-args", nargs="*", default=["tests/kernels"], help="what part (a) passes to pytest")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is required when $OUT is not set")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated at import
    import torch

    installed = _import_package()

    began = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    results: dict = {"meta": {"device": torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)",
                              "smoke": args.smoke, "torch": torch.__version__, "started": time.ctime(),
                              "package": "installed" if installed else "from the checkout"}}  # fmt: skip
    if not cuda and not args.smoke:
        for name in ("invariance_quant_matmul", "invariance_kv_attention", "timing", "engine", "pytest"):
            results[name] = {"status": "skipped: no CUDA device (use --smoke to check the script on the CPU)"}
    else:
        with tempfile.TemporaryDirectory() as workdir:
            _run_part(results, "invariance_quant_matmul", out_dir, quant_invariance, device, args.smoke)
            _run_part(results, "invariance_kv_attention", out_dir, kv_invariance, device, args.smoke)
            _run_part(results, "timing", out_dir, timing, device, args.smoke)
            _run_part(results, "engine", out_dir, engine_check, device, args.smoke, Path(workdir))
        left = args.budget - (time.perf_counter() - began)
        _run_part(results, "pytest", out_dir, pytest_part, args.smoke, left, args.pytest_args, installed)
    results["meta"]["seconds"] = round(time.perf_counter() - began, 1)
    (out_dir / "cuda_check.json").write_text(json.dumps(results, indent=1, default=str))
    text = summary(results)
    (out_dir / "cuda_check.txt").write_text(text)
    print(text, end="")
    return 0 if _all_good(results, args.smoke) else 1


def _all_good(results: dict, smoke: bool) -> bool:
    """Every part ran (or was skipped), every call met its reference, and nothing differed (on the GPU: the bit
    checks; under the interpreter they are not evidence, see :data:`INTERPRETER_BITS`)."""
    parts = [part for name, part in results.items() if name != "meta"]
    ran = all(not part["status"].startswith("failed") for part in parts)
    quant_part, kv_part = (results.get(name, {}) for name in ("invariance_quant_matmul", "invariance_kv_attention"))
    quant = quant_part.get("reference_ok", True) and (smoke or quant_part.get("mismatched_rows", 0) == 0)
    kv = kv_part.get("reference_ok", True) and (smoke or kv_part.get("mismatches", 0) == 0)
    engine = results.get("engine", {}).get("identical", True)
    tests = results.get("pytest", {}).get("returncode", 0) in (0, None)
    return ran and quant and kv and engine and tests


if __name__ == "__main__":
    sys.exit(main())
