"""A transformers ``Cache`` whose layers are preallocated buffers written by position.

gpt-fast style: keys/values for position ``i`` live in slot ``i``; ``length`` says how many slots
are valid (``num_computed`` of DESIGN §2). Rolling back after a rejection only lowers ``length``:
the rejected slots are never read again and are overwritten by the next write. Unlike
``DynamicCache`` there is no ``torch.cat`` per step (that copies the whole history every token).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_INITIAL_CAPACITY = 256


class PositionalKVLayer(DynamicLayer):
    """One attention layer's KV: buffers [B, H_kv, capacity, D]; slots [0, length) are valid."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._key_buf: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self._value_buf: torch.Tensor | None = None  # [B, H_kv, capacity, D]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._key_buf = key_states.new_empty(_with_len(key_states, _INITIAL_CAPACITY))
        self._value_buf = value_states.new_empty(_with_len(value_states, _INITIAL_CAPACITY))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value_states [B, H_kv, n, D] at slots [length, length+n); return all valid slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._key_buf.shape[-2]:
            self._grow(end)
        self._key_buf[:, :, self.length : end] = key_states
        self._value_buf[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self._key_buf[:, :, :end]  # [B, H_kv, end, D] view
        self.values = self._value_buf[:, :, :end]
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._key_buf.shape[-2])
        for name in ("_key_buf", "_value_buf"):
            old = getattr(self, name)
            new = old.new_empty(_with_len(old, capacity))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        """Keep slots [0, length): everything after is dropped (never read again)."""
        self.length = min(self.length, max(length, 0))

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: ``-n`` removes n tokens (``crop(0)`` is a no-op); a positive value is a length."""
        self.truncate(self.length + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def allocated_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return 2 * self._key_buf.numel() * self._key_buf.element_size()

    def used_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        per_slot = self._key_buf[:, :, :1].numel() * self._key_buf.element_size()
        return 2 * per_slot * self.length

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys and values [B, H_kv, length, D] (for tests and kernels)."""
        return self._key_buf[:, :, : self.length], self._value_buf[:, :, : self.length]


def _with_len(states: torch.Tensor, length: int) -> tuple[int, ...]:
    batch, heads, _, dim = states.shape
    return (batch, heads, length, dim)


class PositionalKVCache(Cache):
    """A ``Cache`` of :class:`PositionalKVLayer` for a model with ``num_layers`` attention layers."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[PositionalKVLayer() for _ in range(num_layers)])

    def truncate(self, length: int) -> None:
        """Roll every layer back to ``length`` committed positions."""
        for layer in self.layers:
            layer.truncate(length)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def used_bytes(self) -> int:
        return sum(layer.used_bytes() for layer in self.layers)
