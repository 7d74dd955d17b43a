"""One step of a decoder over the paged pool on our kernels: the body the eager runner runs op by op and the
compiled runner hands to ``torch.compile`` — the same code, so the two give the same bits (DESIGN §7). The layers
are one call, ``spectoolkit::decoder_layers``: per layer ``attn_in`` then ``layer_tail`` (which encodes the step's KV
rows to the pool's format), with no Python between them."""

from __future__ import annotations

import torch

from spectoolkit.kernels.static_decoder import StaticDecoder
from spectoolkit.runtime.attention import pool_stores
from spectoolkit.runtime.paged_kv import PagedKVPool


def decoder_rows(
    dec: StaticDecoder, stores: list[torch.Tensor], ids: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, write: torch.Tensor, key_slots: torch.Tensor, starts: torch.Tensor,
    capture: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """ids/write [W], cos/sin [W, D] (the rows' rotary rows), key_slots [N] with row i's slots at
    [starts[i], starts[i+1]) -> (final hidden states [W, E], the residual stream entering each layer of
    ``capture`` side by side [W, len(capture) * E]); row i's keys/values are stored at write[i] (-1: not) in
    ``stores``, each layer's pool tensors (k, v, k_scale, v_scale) in layer order (:func:`layer_stores`)."""
    hidden, captured = dec.decoder_layers(dec.embed(ids), cos, sin, stores, write, key_slots, starts, capture)
    return dec.rms_norm(dec.norm, hidden), captured


def layer_stores(pool: PagedKVPool) -> list[torch.Tensor]:
    """Every layer's pool tensors (k, v, k_scale, v_scale: :func:`~spectoolkit.runtime.attention.pool_stores`) in
    layer order, as :func:`decoder_rows` takes them."""
    return [tensor for index in range(len(pool.layers)) for tensor in pool_stores(pool, index)]


def side_by_side(captured: dict[int, torch.Tensor], capture: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The states ``captured`` by layer ([W, E] each), in ``capture``'s order (repeats repeated), concatenated:
    [W, len(capture) * E]; none asked: [W, 0] like ``like`` [W, E]."""
    if not capture:
        return like.new_empty(like.shape[0], 0)
    return torch.cat([captured[layer] for layer in capture], dim=-1)
