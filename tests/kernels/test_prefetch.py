"""The linears' weight-stream prefetch (spectoolkit/kernels/prefetch.py, csrc ``stream_prefetch``): it changes no bit
on any path, format or row count, and the distance is chosen from measurements only where it pays."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels import cpu_ops, prefetch
from spectoolkit.kernels.cpu_linear import (
    linear,
    pack_float,
    pack_int4_codes,
    pack_int8_codes,
    pack_nf4,
    to_int8_activations,
)
from spectoolkit.quant import gguf_codes
from tests.quant.test_gguf_codes import COLUMNS, ROWS
from tests.quant.test_gguf_compact import KINDS, _kind, _paths

DISTANCES = (64, 1000, 4096, 65536)  # a line, not a line's multiple, the kind chosen, far past the weights' end


@pytest.fixture
def restored() -> Iterator[None]:
    """The process's distance and :func:`prefetch.tune`'s cache as they were before the test."""
    cpu_ops.load()
    before = torch.ops.spectoolkit.stream_prefetch()
    prefetch.tune.cache_clear()
    yield
    prefetch.tune.cache_clear()
    torch.ops.spectoolkit.set_stream_prefetch(before)


def _outputs(weights, x: torch.Tensor, distance: int) -> list[torch.Tensor]:
    torch.ops.spectoolkit.set_stream_prefetch(distance)
    return [linear(x[:count], packed, isa=path) for packed in weights for path in _paths() for count in (1, 5, 9)]


@pytest.mark.parametrize("qtype", KINDS, ids=lambda t: t.name)
def test_a_prefetch_changes_no_bit_on_any_path(qtype, restored) -> None:
    tensor = _kind(qtype, seed=4)
    weights = [gguf_codes.to_compact(tensor)]  # the format's records
    if qtype.name in ("Q4_0", "Q8_0"):
        weights.append(to_int8_activations(gguf_codes.to_packed(tensor)))  # the wide int4 / int8 layouts
    x = torch.randn(9, COLUMNS, generator=torch.Generator().manual_seed(4)) * 3
    expected = _outputs(weights, x, 0)
    for distance in DISTANCES:
        got = _outputs(weights, x, distance)
        assert torch.ops.spectoolkit.stream_prefetch() == distance
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), distance
    assert expected[0].shape == (1, ROWS)


def test_a_prefetch_changes_no_bit_on_the_float_activation_paths(restored) -> None:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(ROWS, COLUMNS, generator=generator)
    codes = torch.randint(0, 16, (ROWS, COLUMNS), generator=generator)
    scales, zeros = torch.rand(ROWS, COLUMNS // 32, generator=generator), torch.randn(ROWS, COLUMNS // 32)
    weights = [pack_float(weight), pack_float(weight.bfloat16()), pack_int8_codes(codes - 8, scales, 32),
               pack_int4_codes(codes, scales, zeros, 32), pack_nf4(codes, scales[:, ::2].contiguous(), 64)]  # fmt: skip
    x = torch.randn(9, COLUMNS, generator=generator)
    expected = _outputs(weights, x, 0)
    for distance in DISTANCES:
        assert all(torch.equal(a, b) for a, b in zip(_outputs(weights, x, distance), expected, strict=True)), distance


def test_the_op_refuses_a_distance_out_of_range(restored) -> None:
    for bad in (-1, (1 << 20) + 1):
        with pytest.raises(RuntimeError, match="0 to 1 MiB"):
            torch.ops.spectoolkit.set_stream_prefetch(bad)


def _times(speedups: dict[int, list[float]]) -> dict[int, list[float]]:
    """Seconds per round: no prefetch takes 1.0, each distance 1 / its speedup that round."""
    rounds = len(next(iter(speedups.values())))
    return {0: [1.0] * rounds} | {d: [1 / s for s in values] for d, values in speedups.items()}


def test_the_fastest_distance_by_its_median_speedup_is_chosen() -> None:
    times = _times({1024: [1.2, 1.3, 1.25], 4096: [1.5, 1.1, 1.45], 8192: [2.0, 1.0, 1.0]})
    choice = prefetch.choose(times)
    assert (choice.distance, choice.how) == (4096, "measured")
    assert choice.speedups[4096] == pytest.approx(1.45) and choice.speedups[0] == 1.0


def test_no_prefetch_unless_a_distance_beats_it_by_the_margin() -> None:
    assert prefetch.choose(_times({1024: [1.02, 1.03, 1.01], 4096: [0.9, 0.8, 0.95]})).distance == 0
    assert prefetch.choose(_times({1024: [1.04, 1.04, 1.04]})).distance == 1024
    assert prefetch.choose(_times({1024: [1.1, 1.1], 2048: [1.1, 1.1]})).distance == 1024  # a tie: the nearer


def test_the_pinned_distance_is_read_and_checked(monkeypatch) -> None:
    monkeypatch.delenv(prefetch.ENV, raising=False)
    assert prefetch.pinned() is None
    monkeypatch.setenv(prefetch.ENV, "2048")
    assert prefetch.pinned() == 2048
    for bad in ("-5", "4k", str((1 << 20) + 1)):
        monkeypatch.setenv(prefetch.ENV, bad)
        with pytest.raises(SpecToolkitError, match="SPECTOOLKIT_PREFETCH"):
            prefetch.pinned()


def test_weights_that_fit_in_cache_measure_nothing(monkeypatch, restored) -> None:
    monkeypatch.delenv(prefetch.ENV, raising=False)
    monkeypatch.setattr(prefetch, "measure", lambda: pytest.fail("measured for weights that stay in cache"))
    torch.ops.spectoolkit.set_stream_prefetch(0)
    assert prefetch.tune_for(prefetch.STREAMED - 1) == prefetch.PrefetchChoice(0, "not measured")
    assert torch.ops.spectoolkit.stream_prefetch() == 0


def test_streamed_weights_measure_once_and_set_the_choice(monkeypatch, restored) -> None:
    monkeypatch.delenv(prefetch.ENV, raising=False)
    calls = []
    monkeypatch.setattr(prefetch, "measure", lambda: calls.append(1) or _times({2048: [1.3, 1.3], 8192: [1.2, 1.2]}))
    for _ in range(2):
        choice = prefetch.tune_for(prefetch.STREAMED)
    assert (choice.distance, len(calls), torch.ops.spectoolkit.stream_prefetch()) == (2048, 1, 2048)
    assert prefetch.current() == choice
    assert choice.as_record() == {"bytes": 2048, "how": "measured", "speedups": {"0": 1.0, "2048": 1.3, "8192": 1.2}}


def test_a_pinned_distance_is_set_without_measuring(monkeypatch, restored) -> None:
    monkeypatch.setenv(prefetch.ENV, "0")
    monkeypatch.setattr(prefetch, "measure", lambda: pytest.fail("measured a pinned distance"))
    torch.ops.spectoolkit.set_stream_prefetch(4096)
    assert prefetch.tune_for(0) == prefetch.PrefetchChoice(0, "pinned")
    assert torch.ops.spectoolkit.stream_prefetch() == 0


def test_the_measurement_times_every_distance_and_leaves_the_setting(restored) -> None:
    torch.ops.spectoolkit.set_stream_prefetch(1024)
    times = prefetch.measure(rounds=2, mib=4)
    assert set(times) == set(prefetch.DISTANCES) and all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert torch.ops.spectoolkit.stream_prefetch() == 1024
