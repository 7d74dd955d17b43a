"""The eager runner: a Llama-family HF model's modules, our attention over the paged pool.

Embeddings, norms, rotary embedding and every linear are the loaded model's own modules (weights are
shared, nothing is copied); the decoder loop is ours, so the step metadata reaches the attention as an
argument (:class:`~spectoolkit.runtime.step.StepBatch`).

- **Our kernels throughout** (the CPU default: every linear packed, :mod:`spectoolkit.quant.packing`):
  the step is :func:`~spectoolkit.runtime.decoder_rows.decoder_rows`, the very body the compiled runner
  compiles, run op by op — every row computed by itself (the row mode changes nothing), and the same
  bits as the compiled runner.
- **Otherwise** (CUDA, LLM.int8/act-order GPTQ/fp16 layers, int4 KV): the transformers modules, op for op as
  the transformers Llama forward — same shapes ([1, T, ·] hidden states), same order of adds — with
  attention over the pool (our kernel where it reads the KV, else torch's), and linears that keep their
  own path run their measured row-invariant variant in the step's row mode
  (:mod:`spectoolkit.kernels.kernel_choice`).
"""

from __future__ import annotations

import torch
from torch import nn

from spectoolkit.kernels import cpu_ops
from spectoolkit.kernels.kernel_choice import ChunkedLinear
from spectoolkit.kernels.static_decoder import StaticDecoder, check_decoder, exact_decoder_reason, rotate_half
from spectoolkit.runtime.attention import (
    flat_key_slots,
    kernel_attends,
    kernel_attention,
    paged_attention,
    pool_stores,
    row_key_lists,
)
from spectoolkit.runtime.decoder_rows import decoder_rows, layer_stores, side_by_side
from spectoolkit.runtime.paged_kv import PagedKVPool
from spectoolkit.runtime.step import StepBatch


def run_linear(module: nn.Module, x: torch.Tensor, mode: str) -> torch.Tensor:
    """x [..., K] -> [..., N] through ``module``, its chosen variant run in row ``mode`` when it has one."""
    if isinstance(module, ChunkedLinear):
        return module.run(x, mode)
    return module(x)


class EagerRunner:
    """``forward(batch)`` of a Llama-family ``*ForCausalLM`` whose KV lives in ``pool``."""

    def __init__(self, model: nn.Module, pool: PagedKVPool) -> None:
        check_decoder(model, "the paged runner")
        inner = model.model
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        self.embed, self.layers, self.norm = inner.embed_tokens, list(inner.layers), inner.norm
        self.rotary = inner.rotary_emb
        self.head = model.get_output_embeddings()
        config = model.config.get_text_config()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.ours = kernel_attends(pool, self.head_dim)  # our attention kernel (else the torch path)
        self.isa = cpu_ops.best_isa() if self.ours else -1
        # Our kernels throughout (StaticDecoder): every row computed by itself, the compiled runner's bits.
        exact = self.ours and exact_decoder_reason(model) is None
        self.decoder = StaticDecoder(model, self.isa) if exact else None
        self.stores = layer_stores(pool) if exact else []
        self.row_exact = exact

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Write the batch's KV to the pool; logits [R, V] of ``batch.logit_rows``."""
        return self.forward_states(batch, ())[0]

    @torch.inference_mode()
    def forward_states(self, batch: StepBatch, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits and the residual stream entering each of ``layers``, [T, len(layers) * E]."""
        if self.decoder is not None:
            return self._exact_forward(batch, layers)
        mode = batch.mode
        keys = flat_key_slots(row_key_lists(batch)) if self.ours else None  # (key_slots, starts)
        hidden = self.embed(batch.token_ids[None])  # [1, T, E]
        cos, sin = self.rotary(hidden, batch.positions[None])  # [1, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, T, D]
        captured = {}
        for index, layer in enumerate(self.layers):
            if index in layers:
                captured[index] = hidden[0]
            x = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(layer.self_attn, x, cos, sin, index, batch, keys)
            x = layer.post_attention_layernorm(hidden)
            mlp = layer.mlp  # SwiGLU: down(act(gate(x)) * up(x))
            gated = mlp.act_fn(run_linear(mlp.gate_proj, x, mode)) * run_linear(mlp.up_proj, x, mode)
            hidden = hidden + run_linear(mlp.down_proj, gated, mode)
        states = side_by_side(captured, layers, hidden[0])
        hidden = self.norm(hidden)[:, batch.logit_rows]  # [1, R, E]
        return run_linear(self.head, hidden, mode)[0], states  # [R, V], [T, n*E]

    def _exact_forward(self, batch: StepBatch, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on our kernels throughout: the compiled runner's body, op by op (module docstring)."""
        dec = self.decoder
        key_slots, starts = flat_key_slots(row_key_lists(batch))
        cos, sin = dec.rope.rows(batch.positions)  # [T, D] each
        hidden, states = decoder_rows(dec, self.stores, batch.token_ids, cos, sin, batch.slots, key_slots, starts,
                                      layers)  # fmt: skip
        return dec.head(hidden[batch.logit_rows]), states  # [R, V], [T, n*E]

    def _attention(
        self, attn: nn.Module, x: torch.Tensor, cos, sin, index: int, batch: StepBatch, keys
    ) -> torch.Tensor:
        """x [1, T, E] -> the attention block's output [1, T, E]; this step's keys/values go to the pool
        (``keys``: the rows' (key_slots, starts) for our kernel, None for the torch path)."""
        mode, tokens = batch.mode, x.shape[1]
        shape = (1, tokens, -1, self.head_dim)
        q = run_linear(attn.q_proj, x, mode).view(shape)  # [1, T, Hq, D]
        k = run_linear(attn.k_proj, x, mode).view(shape)  # [1, T, Hkv, D]
        v = run_linear(attn.v_proj, x, mode).view(shape).transpose(1, 2)  # [1, Hkv, T, D]
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [1, H, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if keys is None:
            out = paged_attention(self.pool, index, batch, q[0], k[0], v[0], attn.scaling)  # [T, Hq, D]
        else:
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, H, D]
            stores = pool_stores(self.pool, index)
            out = kernel_attention(stores, q, k, v, batch.slots, *keys, attn.scaling, self.isa)
            out = out.to(x.dtype)
        return run_linear(attn.o_proj, out.reshape(1, tokens, -1).contiguous(), mode)
