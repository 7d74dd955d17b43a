"""GGUF blocks re-packed into our kernel's kinds (spectoolkit/quant/gguf_codes.py) against gguf's own dequantize.

Each type's packed weight, rounded to fp32, must equal ``gguf.quants.dequantize`` of the same bytes bit for bit;
a planted wrong code, scale or zero must break that equality (so the check can fail); the kernel's product must
stay within its fp32 rounding bound of the fp64 one; a zero that fp32 cannot hold, and types we do not take,
are refused with a reason. The real embedded GGUF is checked on a few tensors here, on every tensor in the slow
lane, which also checks the assembled Qwen pair when ``make pair`` has built it.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type

from spectoolkit.kernels.cpu_linear import PackedWeight, dequantized, linear, reference_linear
from spectoolkit.quant import gguf_codes
from tests.kernels.test_cpu_linear import UNIT, _magnitudes

ROWS, COLUMNS = 40, 512  # 40 rows: the last panel of 16 is padded
QUANTIZED = (Type.Q8_0, Type.Q4_0, Type.Q4_1, Type.Q5_0)  # gguf.quants.quantize writes these
RAW = (Type.Q4_K, Type.Q6_K)  # gguf only reads these: built from random bytes
TYPES = QUANTIZED + RAW
FIRST_CODE_BYTE = {Type.Q8_0: 2, Type.Q4_0: 2, Type.Q4_1: 4, Type.Q5_0: 6, Type.Q4_K: 16, Type.Q6_K: 0}


def _tensor(qtype: Type, data: np.ndarray, columns: int) -> gguf.ReaderTensor:
    """A tensor as GGUFReader gives it: ``shape`` [K, N] (reversed), ``data`` uint8 rows of blocks."""
    shape = np.array([columns, *data.shape[:-1]][: data.ndim], dtype=np.uint64)
    return gguf.ReaderTensor("w", qtype, shape, int(np.prod(shape)), data.nbytes, 0, data, None)


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype("<f2").view(np.uint8).reshape(*values.shape, 2)


def _blocks(qtype: Type, seed: int = 0, rows: int = ROWS, columns: int = COLUMNS) -> gguf.ReaderTensor:
    """A realistic tensor [rows, columns] of ``qtype``: quantized by gguf from Gaussian weights, or (K-quants)
    random codes and 6-/8-bit scales under fp16 d, dmin drawn in one binade, as llama.cpp's quantizer leaves them."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZED:
        weight = (rng.standard_normal((rows, columns)) * 0.02).astype(np.float32)
        return _tensor(qtype, gguf.quants.quantize(weight, qtype), columns)
    count = rows * columns // 256
    codes = rng.integers(0, 256, (count, 140 if qtype == Type.Q4_K else 208), dtype=np.uint8)
    halves = _fp16_bytes(rng.uniform(2**-10, 2**-9, (count, 2)))  # [count, 2, 2]: d, dmin
    if qtype == Type.Q4_K:  # d, dmin, 12 bytes of scales/mins, 128 of codes
        blocks = np.concatenate([halves.reshape(count, 4), codes], axis=1)
    else:  # 128 ql, 64 qh, 16 int8 scales, d
        blocks = np.concatenate([codes, halves[:, 0]], axis=1)
    return _tensor(qtype, blocks.reshape(rows, -1), columns)


def _exact(packed: PackedWeight, tensor: gguf.ReaderTensor, rows: torch.Tensor | None = None) -> bool:
    """Whether the packed weight, rounded to fp32, is gguf's dequantized weight bit for bit."""
    return torch.equal(dequantized(packed).float(), gguf_codes.dequantized_fp32(tensor, rows))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_repacks_to_exactly_ggufs_dequantized_weights(qtype: Type) -> None:
    tensor = _blocks(qtype)
    assert gguf_codes.unpackable(tensor) is None
    packed = gguf_codes.to_packed(tensor)
    expected = {Type.Q8_0: ("int8", 32), Type.Q5_0: ("int8", 32), Type.Q6_K: ("int8", 16)}.get(qtype, ("int4", 32))
    assert (packed.kind, packed.group) == expected
    assert (packed.out_features, packed.in_features) == (ROWS, COLUMNS)
    assert _exact(packed, tensor)
    assert gguf_codes.dequantized_fp32(tensor).abs().sum() > 0  # not an all-zero tensor matching by accident


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_planted_wrong_code_scale_or_zero_fails_the_comparison(qtype: Type) -> None:
    tensor = _blocks(qtype, seed=1)
    packed = gguf_codes.to_packed(tensor)
    plants = [("data", lambda v: v ^ 1)]  # one code (int4: the low nibble)
    plants.append(("scales", lambda v: torch.nextafter(v, torch.tensor(np.inf))))  # one ulp
    if qtype in (Type.Q4_1, Type.Q4_K):  # a zero of 0 (Q4_0) moved by one ulp is below fp32's rounding of w
        plants.append(("zeros", lambda v: torch.nextafter(v, torch.tensor(np.inf))))
    group = int(torch.nonzero(packed.scales[0, :, 0])[0])  # row 0's first group with a nonzero scale
    first = group * packed.group // (2 if packed.kind == "int4" else 1)  # the byte of its first column
    for field, change in plants:
        values = getattr(packed, field)
        at = (0, first if field == "data" else group, 0)
        original = values[at].clone()
        values[at] = change(original)
        assert not _exact(packed, tensor), field
        values[at] = original
    assert _exact(packed, tensor)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_wrong_byte_in_the_gguf_blocks_fails_the_comparison(qtype: Type) -> None:
    """The codes and scales are read from where gguf reads them: a changed code byte changes our weights too."""
    tensor = _blocks(qtype, seed=2)
    packed = gguf_codes.to_packed(tensor)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    tensor.data[3, size + FIRST_CODE_BYTE[qtype]] ^= 0x11  # row 3, block 1: two code bits
    assert not _exact(packed, tensor)
    assert _exact(gguf_codes.to_packed(tensor), tensor)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernel_multiplies_by_the_repacked_weights_within_its_rounding(qtype: Type) -> None:
    """|ours - exact| <= (K + 2G + 3) u · Σ|x||w| (tests/kernels/test_cpu_linear.py's bound)."""
    packed = gguf_codes.to_packed(_blocks(qtype, seed=3))
    x = torch.randn(7, COLUMNS, generator=torch.Generator().manual_seed(3))
    got, exact = linear(x, packed).double(), reference_linear(x, packed)
    bound = (COLUMNS + 2 * COLUMNS // packed.group + 3) * UNIT * (x.abs().double() @ _magnitudes(packed).t())
    assert torch.all((got - exact).abs() <= bound), (got - exact).abs().max()


def test_rows_are_taken_in_the_order_given() -> None:
    """A row index (e.g. undoing a converter's q/k permutation) picks and orders the packed rows."""
    tensor = _blocks(Type.Q4_K, seed=4)
    rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(4))[:33]
    packed = gguf_codes.to_packed(tensor, rows)
    assert packed.out_features == 33
    assert torch.equal(dequantized(packed).float(), gguf_codes.dequantized_fp32(tensor)[rows])


def _set_fp16(tensor: gguf.ReaderTensor, block: int, at: int, value: float) -> None:
    """Row 0, block ``block``: the fp16 at bytes at, at+1 := value."""
    size = gguf.GGML_QUANT_SIZES[tensor.tensor_type][1]
    tensor.data[0, block * size + at : block * size + at + 2] = _fp16_bytes(np.array([value]))[0]


def test_a_zero_fp32_cannot_hold_refuses_the_tensor() -> None:
    """Q4_1 with d = 1 and m = 2^-24: m + 8d needs 28 significant bits."""
    tensor = _blocks(Type.Q4_1, seed=5)
    _set_fp16(tensor, 2, 0, 1.0)
    _set_fp16(tensor, 2, 2, 2.0**-24)
    why = gguf_codes.unpackable(tensor)
    assert why is not None and "Q4_1" in why and "not exact in fp32" in why and "row 0, group 2" in why
    with pytest.raises(ValueError, match="not exact in fp32"):
        gguf_codes.to_packed(tensor)


def test_a_q4_k_zero_fp32_cannot_hold_refuses_the_tensor() -> None:
    """d = 1, dmin = 2^-24, sub-block 0's sc = m = 1: 8·d·sc - dmin·m = 8 - 2^-24."""
    tensor = _blocks(Type.Q4_K, seed=6)
    assert gguf_codes.unpackable(tensor) is None
    _set_fp16(tensor, 0, 0, 1.0)
    _set_fp16(tensor, 0, 2, 2.0**-24)
    tensor.data[0, 4] = 1  # sc_0: low 6 bits of byte 0 of the scales
    tensor.data[0, 8] = 1  # m_0: low 6 bits of byte 4
    why = gguf_codes.unpackable(tensor)
    assert why is not None and "Q4_K" in why and "8·d·sc - dmin·m" in why and "row 0, group 0" in why


def test_types_without_an_exact_kind_are_refused_with_their_name() -> None:
    weight = np.random.default_rng(7).standard_normal((ROWS, COLUMNS)).astype(np.float32)
    q5_1 = _tensor(Type.Q5_1, gguf.quants.quantize(weight, Type.Q5_1), COLUMNS)
    assert "Q5_1 has no exact kernel kind" in gguf_codes.unpackable(q5_1)
    assert "float tensor" in gguf_codes.unpackable(_tensor(Type.F16, weight.astype(np.float16), COLUMNS))
    flat = _blocks(Type.Q8_0)
    flat = _tensor(Type.Q8_0, flat.data.reshape(-1), ROWS * COLUMNS)  # a 1-D tensor: no [N, K]
    assert "1 dimensions" in gguf_codes.unpackable(flat)
    with pytest.raises(ValueError, match="Q5_1"):
        gguf_codes.to_packed(q5_1)


# --- the real files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_reader() -> gguf.GGUFReader:
    from spectoolkit.embedded import gguf_path

    return gguf.GGUFReader(gguf_path())  # seconds: the tokenizer's metadata is parsed in Python


def _check_file(reader: gguf.GGUFReader, names: set[str] | None = None, row_cap: int | None = None) -> dict[str, int]:
    """Re-pack the quantized tensors (those in ``names``, or all; at most ``row_cap`` rows each) and assert each is
    bit-exact; returns how many of each type were checked."""
    checked: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = gguf_codes.gguf_type_name(tensor)
        if kind in ("F32", "F16") or (names is not None and tensor.name not in names):
            continue
        assert gguf_codes.unpackable(tensor) is None, tensor.name
        rows = None if row_cap is None else torch.arange(min(row_cap, int(tensor.shape[1])))
        assert _exact(gguf_codes.to_packed(tensor, rows), tensor, rows), tensor.name
        checked[kind] = checked.get(kind, 0) + 1
    return checked


def test_the_embedded_gguf_repacks_exactly(embedded_reader: gguf.GGUFReader) -> None:
    """Every tensor's zeros are exact (the cheap check, on all 211); the embedding and layer 0 re-pack bit-exactly."""
    quantized = [t for t in embedded_reader.tensors if gguf_codes.gguf_type_name(t) != "F32"]
    assert {gguf_codes.gguf_type_name(t) for t in quantized} == {"Q4_1", "Q8_0"}
    assert all(gguf_codes.unpackable(t) is None for t in quantized)
    names = {"token_embd.weight"} | {t.name for t in quantized if t.name.startswith("blk.0.")}
    assert _check_file(embedded_reader, names) == {"Q8_0": 1, "Q4_1": 7}


@pytest.mark.slow
def test_every_embedded_tensor_repacks_exactly(embedded_reader: gguf.GGUFReader) -> None:
    assert _check_file(embedded_reader) == {"Q8_0": 1, "Q4_1": 210}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"])
def test_the_pair_repacks_exactly(name: str) -> None:
    """Every quantized tensor's zeros exact; every tensor's first 1024 rows bit-exact (when ``make pair`` ran)."""
    from spectoolkit.pair import PAIR_MODELS, assembled_file, not_assembled

    if not_assembled(name) is not None:
        pytest.skip(f"{name} is not assembled (make pair)")
    checked = _check_file(gguf.GGUFReader(assembled_file(PAIR_MODELS[name])), row_cap=1024)
    assert set(checked) <= set(gguf_codes.PACKED_TYPES) and sum(checked.values()) > 100
