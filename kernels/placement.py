"""Packed weights placed where a decode step streams them fastest: memory backed by transparent huge pages.

A decode step reads every packed weight once, front to back. On 4 KiB pages that stream takes a TLB miss every
4 KiB and the hardware prefetchers stop at each page's end; on 2 MiB pages neither happens (issue 55, measured on a
Zen 4 EPYC: 30 → 36 GB/s for the same read loop over the same bytes). Linux backs anonymous memory with huge pages
where it is asked to (``madvise(MADV_HUGEPAGE)``; ``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise`` or
``always``). :func:`place_packed` copies every packed layer's buffers into such memory once, after packing, keeping
each view's place in its storage (a fused call's parts stay views of it); :func:`streaming_buffer` gives the read
bandwidth measurement the same kind of memory, so the floor it prints is the one the weights can reach. Where huge
pages are not offered (another OS, ``never``), both leave memory as torch allocates it: the same bits either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from pathlib import Path

import torch

from spectoolkit.kernels.cpu_linear import PackedLinear

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # the arena maps memory in chunks of at least this (untouched pages cost nothing)
ALIGN = 64
TRIM_AT = 64 << 20  # bytes moved from which the originals' pages are handed back (a small model's are not worth it)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether this OS backs memory with transparent huge pages when asked (Linux, THP not ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not THP_SETTING.exists():
        return False
    return "[never]" not in THP_SETTING.read_text()


class HugePageArena:
    """A bump allocator over anonymous private mappings advised ``MADV_HUGEPAGE``, aligned to 2 MiB. A chunk is
    unmapped when the last tensor viewing it dies (``torch.frombuffer`` holds the mapping)."""

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None  # uint8 over the current chunk, from its first 2 MiB boundary
        self.used = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """Room for ``nbytes``: (the chunk as uint8, the 64-byte aligned byte offset of the room in it)."""
        if self.chunk is None or self.used + nbytes > self.chunk.numel():
            size = max(CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
            mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mapping.madvise(mmap.MADV_HUGEPAGE)
            whole = torch.frombuffer(mapping, dtype=torch.uint8)
            start = -whole.data_ptr() % HUGE_PAGE
            self.chunk, self.used = whole[start : start + size], 0
        offset = self.used
        self.used = -(-(offset + nbytes) // ALIGN) * ALIGN
        return self.chunk, offset


def streaming_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` (filled with ones) in the memory :func:`place_packed` puts weights in."""
    if not huge_pages_offered():
        return torch.ones(nbytes, dtype=torch.uint8)
    chunk, offset = HugePageArena().take(nbytes)
    return chunk[offset : offset + nbytes].fill_(1)


def place_packed(layers: list[PackedLinear]) -> int:
    """Copy the buffers of ``layers`` (packed linears, fused calls included) into huge-page memory, each storage
    once, every tensor keeping its dtype, shape, strides and offset in its storage; returns the bytes moved. A
    layer whose buffers were placed already (``placed``) is skipped, so packing a model again copies nothing."""
    if not huge_pages_offered():
        return 0
    moved = _move([layer for layer in layers if not layer.placed])
    for layer in layers:
        layer.placed = True
    if moved >= TRIM_AT:
        return_freed_memory()  # the originals are gone now (nothing here holds them)
    return moved


def _move(layers: list[PackedLinear]) -> int:
    views: dict[int, list[tuple[PackedLinear, str, torch.Tensor]]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    for layer in layers:
        for name, tensor in layer.named_buffers(recurse=False):
            if tensor.numel():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage
                views.setdefault(storage.data_ptr(), []).append((layer, name, tensor))
    arena, moved = HugePageArena(), 0
    for key, storage in storages.items():
        chunk, offset = arena.take(storage.nbytes())
        whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        chunk[offset : offset + storage.nbytes()].copy_(whole)
        for layer, name, tensor in views[key]:
            typed = chunk.view(tensor.dtype)  # a chunk starts on a page and is whole huge pages: any itemsize divides
            first = typed.storage_offset() + offset // tensor.element_size() + tensor.storage_offset()
            setattr(layer, name, typed.as_strided(tensor.shape, tensor.stride(), first))
        moved += storage.nbytes()
    return moved


def return_freed_memory() -> None:
    """Give the heap's free pages back to the OS: glibc keeps the pages of freed tensors for reuse, so the packed
    buffers :func:`place_packed` copied away from would stay resident (measured: +0.8 GB on the 1.5B). Where the C
    library has no ``malloc_trim`` (not glibc) nothing happens."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (AttributeError, OSError):
        pass
