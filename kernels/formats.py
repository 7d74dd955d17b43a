"""Weight formats held at their own size: a GGUF block type's, an rtn or GPTQ weight's codes and scales in the kernel's
records (issue 55).

The wide layouts (:mod:`spectoolkit.kernels.cpu_linear`) hold every code in a whole nibble or byte and every
scale and zero as fp32: 1.1-1.6x the bytes of a GGUF file's tensor or an rtn/GPTQ checkpoint's. A format here keeps
their bits per weight:
``data`` uint8 [P, K/B, REC], one record per panel of 16 output columns and block of B elements, its fields each
laid [...][16 columns] (csrc/ops.cpp ``FMT`` lists them):

| format | B   | record (per column)                                                          | bytes |
|--------|-----|------------------------------------------------------------------------------|-------|
| Q8_0   | 32  | d fp16, int8 codes in quads                                                  | 34    |
| Q4_0   | 32  | d, 4-bit codes                                                               | 18    |
| Q4_1   | 32  | d, m fp16, 4-bit codes                                                       | 20    |
| Q5_0   | 32  | d, the high bits (one uint32), low 4-bit codes                               | 22    |
| Q4_K   | 256 | d, dmin fp16, the file's 12 bytes of 6-bit scales/mins (3 words), 4-bit codes | 144   |
| Q5_K   | 256 | as Q4_K; per sub-block: a word of high bits, its low 4-bit codes             | 176   |
| Q6_K   | 256 | d; per sub-block: its int8 scale, a word of 2-bit high parts, low 4-bit codes | 210   |
| rtn-int4-g{g}  | g | s, z bf16, 4-bit codes (w = (u - 8) s + z)                              | 4 + g/2   |
| rtn-int8-g{g}  | g | s bf16, int8 codes in quads (w = q s)                                   | 2 + g     |
| gptq-int4-g{g} | g | s bf16, its 4-bit zero point z (two columns a byte), 4-bit codes (w = (u - z) s) | 2.5 + g/2 |

rtn and GPTQ take g = 32, 64, 128 (:func:`own_size`), one record per group, summed in sub-blocks of 32 as their wide
layouts are. GPTQ's scale is bf16 because GPTQModel holds it so on the CPU (the file's fp16 converted at load): the
record keeps what the layer computes with, in the file's 2 bytes.

Q5_K and Q6_K interleave each sub-block's fields in the order the kernel reads them, so a record streams as one
sequential run (three interleaved regions halved Q6_K's read rate from memory).

The kernel computes each sub-block's fp32 scale (and zero) from these fields as gguf's dequantization does (rtn:
bf16 -> fp32; GPTQ: (8 - z) * s, exact), so the integer sums and the fp32 epilogue are those of the wide layout the
same tensor had before: :func:`decode` is that
computation in torch; ``cpu_linear.widen`` packs the wide layout back from it (the tests compare both ways, and
the kernel's bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 16
Field = tuple[str, int, torch.dtype]  # a record field: name, count per column, dtype


@dataclass(frozen=True)
class Format:
    """One format's record (csrc ``FmtLayout``); ``fields`` the header's per-column fields in order: (name, count,
    dtype)."""

    name: str
    block: int  # elements per record (B)
    sub: int  # elements per sub-block (S): one exact integer sum
    bits: int  # code width (8: int8 codes in quads)
    offset: int  # w = (u - offset) * scale (+ zero)
    fields: tuple[Field, ...]
    zero: bool  # a zero per sub-block
    sub_fields: tuple[Field, ...] = ()  # interleaved formats: fields per sub-block, before its plane
    interleaved: bool = False  # each sub-block's fields, plane and codes together (csrc FMT's STRIDE)
    scale_group: int = 0  # elements per scale (0: sub); rtn and GPTQ: the record, one group
    zero_codes: bool = False  # after the fields: a 4-bit zero point per column, 8 bytes (column c: byte c % 8, c / 8)

    @property
    def group(self) -> int:
        """Elements per scale (and zero): the group of the wide layout this format widens to."""
        return self.scale_group or self.sub

    @property
    def subs(self) -> int:
        return self.block // self.sub

    @property
    def header_bytes(self) -> int:
        return sum(count * dtype.itemsize for _, count, dtype in self.fields) * PANEL + PANEL // 2 * self.zero_codes

    @property
    def sub_field_bytes(self) -> int:
        return sum(count * dtype.itemsize for _, count, dtype in self.sub_fields) * PANEL

    @property
    def plane_bytes(self) -> int:  # one uint32 per column and sub-block holding its codes' bits above the 4th
        return self.block // self.sub * 4 * PANEL if self.bits in (5, 6) else 0

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.sub_field_bytes * self.subs + self.plane_bytes + self.code_bytes

    @property
    def code_bytes(self) -> int:
        return self.block * PANEL if self.bits == 8 else self.block * PANEL // 2


_D, _S, _Z = ("d", 1, torch.float16), ("s", 1, torch.bfloat16), ("z", 1, torch.bfloat16)
_WORDS = ("words", 3, torch.int32)
OWN_GROUPS = (32, 64, 128)  # the group sizes rtn and GPTQ weights keep their own size at (one kernel each)
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("Q8_0", 32, 32, 8, 0, (_D,), False),
        Format("Q4_0", 32, 32, 4, 8, (_D,), True),
        Format("Q4_1", 32, 32, 4, 8, (_D, ("m", 1, torch.float16)), True),
        Format("Q5_0", 32, 32, 5, 16, (_D,), False),
        Format("Q4_K", 256, 32, 4, 8, (_D, ("dmin", 1, torch.float16), _WORDS), True),
        Format("Q5_K", 256, 32, 5, 0, (_D, ("dmin", 1, torch.float16), _WORDS), True, interleaved=True),
        Format("Q6_K", 256, 16, 6, 32, (_D,), False, (("sc", 1, torch.int8),), interleaved=True),
        *(Format(f"rtn-int4-g{g}", g, 32, 4, 8, (_S, _Z), True, scale_group=g) for g in OWN_GROUPS),
        *(Format(f"rtn-int8-g{g}", g, 32, 8, 0, (_S,), False, scale_group=g) for g in OWN_GROUPS),
        *(Format(f"gptq-int4-g{g}", g, 32, 4, 8, (_S,), True, scale_group=g, zero_codes=True) for g in OWN_GROUPS),
    )
}
FORMAT_IDS = {name: index + 1 for index, name in enumerate(FORMATS)}  # csrc Fmt; 0 is the wide layouts
# The wide layout each format had before it kept its own size (Q5_K had none: its zero does not fit int8 codes).
WIDE_KIND = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q5_0": "int8", "Q4_K": "int4", "Q6_K": "int8"} | {
    name: name.split("-")[1] for name in FORMATS if name.startswith(("rtn-", "gptq-"))
}


def own_size(family: str, group: int) -> str | None:
    """The format a ``family`` ("rtn-int4", "rtn-int8", "gptq-int4") weight of ``group`` elements per scale keeps its
    own size in; None where no kernel is built for that group (it stays in the wide layout)."""
    name = f"{family}-g{group}"
    return name if name in FORMATS else None


def _columns_last(values: torch.Tensor, count: int) -> torch.Tensor:
    """[N, ...] per output column -> [P, ..., 16], the last panel padded with zeros."""
    pad = -count % PANEL
    if pad:
        values = torch.cat([values, values.new_zeros(pad, *values.shape[1:])])
    panels = values.reshape(-1, PANEL, *values.shape[1:])
    return panels.movedim(1, -1).contiguous()


def _bytes(values: torch.Tensor, records: int) -> torch.Tensor:
    """[P, R, ...] any dtype -> uint8 [P, R, bytes]."""
    return values.contiguous().view(torch.uint8).reshape(values.shape[0], records, -1)


def records(name: str, codes: torch.Tensor, fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """A weight [N, K] in format ``name`` -> data uint8 [P, K/B, REC].

    ``codes`` [N, K]: int8 q (Q8_0, rtn-int8) or unsigned codes u in [0, 2^bits); ``fields`` each [N, K/B, count]
    (fp16 d, m, dmin as int16/uint16 bits; ``words`` int32; ``sc`` int8, one per sub-block; bf16 s, z; GPTQ's zero
    points ``zq`` uint8 in [0, 16))."""
    fmt = FORMATS[name]
    count, columns = codes.shape
    blocks = columns // fmt.block

    def laid(field: str) -> torch.Tensor:  # [P, R, n, 16]
        return _columns_last(fields[field].reshape(count, blocks, -1), count)

    head = [_bytes(laid(field), blocks) for field, _, _ in fmt.fields]
    if fmt.zero_codes:  # column c in byte c % 8, nibble c / 8
        zq = laid("zq").to(torch.uint8)
        head.append(_bytes(zq[..., : PANEL // 2] | (zq[..., PANEL // 2 :] << 4), blocks))
    panels = _columns_last(codes.reshape(count, blocks, fmt.block), count)  # [P, R, B, 16]
    P = panels.shape[0]
    if fmt.bits == 8:  # quads: byte (t, c, j) = code 4t + j
        quads = panels.view(torch.int8).reshape(P, blocks, -1, 4, PANEL).transpose(-1, -2)
        return torch.cat([*head, _bytes(quads, blocks)], dim=-1).contiguous()
    per_sub = [laid(field).view(torch.uint8).reshape(P, blocks, fmt.subs, -1) for field, _, _ in fmt.sub_fields]
    if fmt.bits in (5, 6):
        high = (panels >> 4).to(torch.int32).reshape(P, blocks, fmt.subs, -1, 4, PANEL)  # e = 4p + j
        step = 1 if fmt.bits == 5 else 2  # bits per element in a plane
        shifts = torch.arange(high.shape[3], dtype=torch.int32).view(-1, 1, 1) * step
        planes = (high << shifts).sum(dim=3, dtype=torch.int32)  # [P, R, NS, 4 (byte j), 16]
        words = planes[..., 0, :] | (planes[..., 1, :] << 8) | (planes[..., 2, :] << 16) | (planes[..., 3, :] << 24)
        per_sub.append(words.to(torch.int32).contiguous().view(torch.uint8).reshape(P, blocks, fmt.subs, -1))
    low = (panels & 15).reshape(P, blocks, -1, 2, 4, PANEL)  # element 8i + 4h + j
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).transpose(-1, -2).to(torch.uint8)  # [P, R, B/8, 16, 4]
    per_sub.append(nibbles.contiguous().reshape(P, blocks, fmt.subs, -1))
    if fmt.interleaved:  # sub-block by sub-block: its fields, plane, codes
        body = torch.cat(per_sub, dim=-1).reshape(P, blocks, -1)
    else:  # region by region
        body = torch.cat([part.reshape(P, blocks, -1) for part in per_sub], dim=-1)
    return torch.cat([*head, body], dim=-1).contiguous()


def _sub_regions(data: torch.Tensor, fmt: Format) -> torch.Tensor:
    """An interleaved format's sub-blocks: uint8 [P, R, NS, bytes per sub-block]."""
    return data[..., fmt.header_bytes :].contiguous().reshape(*data.shape[:2], fmt.subs, -1)


def _field(data: torch.Tensor, fmt: Format, field: str) -> torch.Tensor:
    """Header field ``field`` of every record: [P, R, count, 16] in its dtype (a sub-block field: [P, R, NS, 16];
    ``zq``, the zero codes: uint8 [P, R, 1, 16])."""
    at = 0
    for name, count, dtype in fmt.sub_fields:
        if name == field:
            raw = _sub_regions(data, fmt)[..., at : at + count * dtype.itemsize * PANEL].contiguous()
            return raw.view(dtype).reshape(*data.shape[:2], fmt.subs, PANEL)
        at += count * dtype.itemsize * PANEL
    at = 0
    for name, count, dtype in fmt.fields:
        if name == field:
            raw = data[..., at : at + count * dtype.itemsize * PANEL].contiguous()
            return raw.view(dtype).reshape(*data.shape[:2], count, PANEL)
        at += count * dtype.itemsize * PANEL
    if field == "zq" and fmt.zero_codes:
        raw = data[..., at : at + PANEL // 2].unsqueeze(2)  # [P, R, 1, 8]
        return torch.cat([raw & 15, raw >> 4], dim=-1)
    raise KeyError(field)


def codes_of(data: torch.Tensor, name: str) -> torch.Tensor:
    """The unsigned codes u (int8 q for Q8_0) of format ``name``'s records: int16 [P, K, 16]."""
    fmt = FORMATS[name]
    P, R, _ = data.shape
    if fmt.interleaved:
        subs = _sub_regions(data, fmt)[..., fmt.sub_field_bytes :]  # [P, R, NS, plane + codes]
        plane_words = subs[..., : fmt.plane_bytes // fmt.subs].contiguous()
        raw = subs[..., fmt.plane_bytes // fmt.subs :].contiguous()
    else:
        start = fmt.header_bytes + fmt.plane_bytes
        plane_words = data[..., fmt.header_bytes : start].contiguous()
        raw = data[..., start:].contiguous()
    if fmt.bits == 8:
        quads = raw.view(torch.int8).reshape(P, R, -1, PANEL, 4).transpose(-1, -2)  # [P, R, B/4, 4 (j), 16]
        return quads.reshape(P, -1, PANEL).to(torch.int16)
    nib = raw.reshape(P, R, -1, PANEL, 4).transpose(-1, -2).to(torch.int16)  # [P, R, B/8, 4 (j), 16]
    codes = torch.stack([nib & 15, nib >> 4], dim=3).reshape(P, R, fmt.block, PANEL)  # element 8i + 4h + j
    if fmt.bits in (5, 6):
        words = plane_words.view(torch.int32).reshape(P, R, -1, 1, PANEL)
        step = 1 if fmt.bits == 5 else 2
        per = 8 // step  # elements per byte of a word
        shifts = torch.arange(4 * per, dtype=torch.int32).view(1, 1, 1, per, 4)  # element e = 4p + j
        byte, part = shifts % 4, shifts // 4
        high = (words.unsqueeze(3) >> (8 * byte + step * part).unsqueeze(-1)) & ((1 << step) - 1)
        codes = codes | (high.reshape(P, R, fmt.block, PANEL).to(torch.int16) << 4)
    return codes.reshape(P, -1, PANEL)


def decode(data: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Records -> (codes int16 [P, K, 16], scale fp32 [P, K/G, 16], zero fp32 [P, K/G, 16] or None; G the format's
    :attr:`~Format.group`), the scale and zero computed in fp32 as the kernel does (csrc int_body.inc
    ``fmt_params``): the weight is ``(u - offset) * scale (+ zero)``."""
    fmt = FORMATS[name]
    P, R, _ = data.shape
    scale, zero = _own_params(data, fmt) if fmt.scale_group else _gguf_params(data, fmt)
    scale = scale.expand(P, R, fmt.block // fmt.group, PANEL).reshape(P, -1, PANEL)
    if zero is not None:
        zero = zero.expand(P, R, fmt.block // fmt.group, PANEL).reshape(P, -1, PANEL)
    return codes_of(data, name), scale.contiguous(), None if zero is None else zero.contiguous()


def _own_params(data: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rtn and GPTQ: the bf16 scale s (and zero z) widened exactly; GPTQ's zero (8 - z) * s, exact in fp32. [P, R, 1,
    16] each."""
    scale = _field(data, fmt, "s").float()
    if fmt.zero_codes:
        return scale, (8 - _field(data, fmt, "zq").float()) * scale
    return scale, _field(data, fmt, "z").float() if fmt.zero else None


def _gguf_params(data: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GGUF block type's sub-block scales (and zeros) from d (dmin, m, the 6-bit scale words, Q6_K's sc): [P, R,
    1 or NS, 16] each."""
    name = fmt.name
    d = _field(data, fmt, "d").float()  # [P, R, 1, 16]
    zero = None
    if name in ("Q8_0", "Q5_0"):
        scale = d
    elif name == "Q4_0":
        scale, zero = d, torch.zeros_like(d)
    elif name == "Q4_1":
        scale, zero = d, _field(data, fmt, "m").float() + 8 * d
    elif name == "Q6_K":
        scale = d * _field(data, fmt, "sc").float()  # [P, R, 16, 16]
    else:
        w0, w1, w2 = (_field(data, fmt, "words")[:, :, i] for i in range(3))  # [P, R, 16]
        sc, mn = [], []
        for j in range(8):
            sh = 8 * (j & 3)
            if j < 4:
                sc.append((w0 >> sh) & 63)
                mn.append((w1 >> sh) & 63)
            else:
                sc.append(((w2 >> sh) & 15) | ((w0 >> (sh + 2)) & 48))
                mn.append(((w2 >> (sh + 4)) & 15) | ((w1 >> (sh + 2)) & 48))
        scale = d * torch.stack(sc, dim=2).float()
        dm = _field(data, fmt, "dmin").float() * torch.stack(mn, dim=2).float()
        zero = 8 * scale - dm if name == "Q4_K" else -dm
    return scale, zero
