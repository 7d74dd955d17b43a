"""A causal LM plus its positional KV cache: feed tokens, get logits, roll back by length.

Both the target (baseline and verification) and a draft model use this. ``num_computed`` is the
number of positions whose KV is valid (DESIGN §2); ``truncate`` lowers it after a rejection.
"""

from __future__ import annotations

import inspect

import torch

from spectoolkit.models.kv_cache import make_kv_cache


class CachedModel:
    """Incremental forward passes of an HF causal LM over one sequence (batch size 1)."""

    def __init__(self, model: torch.nn.Module, kv_precision: str = "auto") -> None:
        """``kv_precision``: KV storage (``auto`` = the model's dtype; see :mod:`spectoolkit.models.kv_cache`)."""
        self.model = model
        self.device = next(model.parameters()).device
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.kv_precision = kv_precision
        self.cache = make_kv_cache(self.num_layers, kv_precision)
        # transformers renamed `past_key_values` to `cache` (5.24; the old name warns until 5.40).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def num_computed(self) -> int:
        return self.cache.get_seq_length()

    def reset(self) -> None:
        """Start a new sequence (buffers are kept and overwritten)."""
        self.cache.reset()

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` (n tokens) at positions [num_computed, num_computed+n).

        Returns fp32-or-model-dtype logits [n, V], or [V] for the last position when ``last_only``
        (the prefill: logits of earlier prompt positions are never needed).
        """
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        kwargs = {self._cache_kwarg: self.cache}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1 if last_only else 0, **kwargs)
        logits = out.logits[0]  # [n or 1, V]
        return logits[-1] if last_only else logits

    @torch.inference_mode()
    def forward_masked(self, token_ids: list[int], positions: list[int], visible: torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` (n tokens) at slots [num_computed, num_computed+n), at rotary ``positions``.

        ``visible`` [n, num_computed+n] bool: the slots each new token attends (a token tree's mask,
        :func:`~spectoolkit.models.tree_mask.verify_rows`). Returns logits [n, V].
        """
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)  # [1, n]
        mask = visible.to(self.device, torch.bool)[None, None]  # [1, 1, n, L]: used as given
        kwargs = {self._cache_kwarg: self.cache}
        out = self.model(input_ids=ids, position_ids=position_ids, attention_mask=mask, use_cache=True, **kwargs)
        return out.logits[0]  # [n, V]

    @torch.inference_mode()
    def commit_slots(self, start: int, slots: list[int]) -> None:
        """Keep slots [0, start) and then ``slots`` (ascending, each >= start), moved to [start, start+len(slots)).

        A tree's accepted path: its KV moves next to the prefix, stored bytes copied as they are (a
        quantized slot is not re-quantized), and the cache ends after it; the other tree slots are dropped.
        """
        self.cache.keep_slots(start, slots)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings are honest on CUDA (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
