"""A transformers ``Cache`` whose layers are preallocated buffers written by position.

gpt-fast style: keys/values for position ``i`` live in slot ``i``; ``length`` says how many slots
are valid (``num_computed`` of DESIGN §2). Rolling back after a rejection only lowers ``length``:
the rejected slots are never read again and are overwritten by the next write. Unlike
``DynamicCache`` there is no ``torch.cat`` per step (that copies the whole history every token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

_INITIAL_CAPACITY = 256


class PositionalKVLayer(DynamicLayer):
    """One attention layer's KV: buffers [B, H_kv, capacity, D]; slots [0, length) are valid.

    Subclasses change how a slot is stored (a dtype cast, a quantized format) through three hooks:
    ``_allocate`` creates every buffer named in ``_buffer_names`` (capacity along dim 2), ``_write``
    stores new tokens and ``_read`` returns slots [0, end) as attention consumes them. Growth, rollback
    and byte counts are shared and work on any such buffers.
    """

    _buffer_names: tuple[str, ...] = ("_key_buf", "_value_buf")

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._compute_dtype: torch.dtype | None = None  # dtype of the states last written (what reads return)
        self._key_buf: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self._value_buf: torch.Tensor | None = None  # [B, H_kv, capacity, D]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._allocate(key_states, value_states, _INITIAL_CAPACITY)
        self.is_initialized = True

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """Create the storage for ``capacity`` slots, shaped like key/value_states [B, H_kv, n, D]."""
        self._key_buf = key_states.new_empty(_with_len(key_states, capacity))
        self._value_buf = value_states.new_empty(_with_len(value_states, capacity))

    def _write(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store key/value_states [B, H_kv, n, D] at slots [start, start+n)."""
        end = start + key_states.shape[-2]
        self._key_buf[:, :, start:end] = key_states
        self._value_buf[:, :, start:end] = value_states

    def _read(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H_kv, end, D] of slots [0, end) in ``dtype`` (here: views, already in it)."""
        return self._key_buf[:, :, :end], self._value_buf[:, :, :end]

    @property
    def capacity(self) -> int:
        return getattr(self, self._buffer_names[0]).shape[2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value_states [B, H_kv, n, D] at slots [length, length+n); return all valid slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._write(self.length, key_states, value_states)
        self.length = end
        self._compute_dtype = key_states.dtype
        self.keys, self.values = self._read(end, key_states.dtype)  # [B, H_kv, end, D]
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        for name in self._buffer_names:
            old = getattr(self, name)  # [B, H_kv, capacity, ...]
            new = old.new_empty((*old.shape[:2], capacity, *old.shape[3:]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        """Keep slots [0, length): everything after is dropped (never read again)."""
        self.length = min(self.length, max(length, 0))

    def keep_slots(self, start: int, slots: list[int]) -> None:
        """Keep [0, start) then ``slots`` (ascending, >= start) moved to [start, start+len(slots)); drop the rest.

        Every stored buffer (codes, scales, zeros) moves as stored, so a kept slot is bit-identical after.
        """
        if slots != list(range(start, start + len(slots))) and self.is_initialized:
            index = torch.tensor(slots, dtype=torch.long, device=self.device)
            for name in self._buffer_names:
                buf = getattr(self, name)  # [B, H_kv, capacity, ...]
                buf[:, :, start : start + len(slots)] = buf.index_select(2, index)
        self.truncate(start + len(slots))

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: ``-n`` removes n tokens (``crop(0)`` is a no-op); a positive value is a length."""
        self.truncate(self.length + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def allocated_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(buf.numel() * buf.element_size() for buf in self._buffers())

    def used_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.length * sum(buf[:, :, :1].numel() * buf.element_size() for buf in self._buffers())

    def _buffers(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._buffer_names]

    def storage(self) -> dict[str, torch.Tensor]:
        """The stored tensors of the valid slots, by buffer name: [B, H_kv, length, ...] views."""
        return {name: getattr(self, name)[:, :, : self.length] for name in self._buffer_names}

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys and values [B, H_kv, length, D] as attention reads them (for tests and kernels)."""
        return self._read(self.length, self._compute_dtype)


def _with_len(states: torch.Tensor, length: int) -> tuple[int, ...]:
    batch, heads, _, dim = states.shape
    return (batch, heads, length, dim)


class PositionalKVCache(Cache):
    """A ``Cache`` of :class:`PositionalKVLayer` (or ``make_layer()``) for ``num_layers`` attention layers."""

    def __init__(self, num_layers: int, make_layer: Callable[[], PositionalKVLayer] = PositionalKVLayer) -> None:
        super().__init__(layers=[make_layer() for _ in range(num_layers)])

    def truncate(self, length: int) -> None:
        """Roll every layer back to ``length`` committed positions."""
        for layer in self.layers:
            layer.truncate(length)

    def keep_slots(self, start: int, slots: list[int]) -> None:
        """Every layer keeps [0, start) + ``slots`` (see :meth:`PositionalKVLayer.keep_slots`)."""
        for layer in self.layers:
            layer.keep_slots(start, slots)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def used_bytes(self) -> int:
        return sum(layer.used_bytes() for layer in self.layers)
