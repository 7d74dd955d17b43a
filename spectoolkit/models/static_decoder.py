"""A Llama-family HF model's layers as plain tensor code: the body the compiled runner hands to ``torch.compile``.

No transformers ``Cache``, no mask construction, no Python per-layer objects between kernels — gpt-fast's
shape of a step, on the loaded model's own modules (weights, rotary embedding, norms are shared, not
copied). :meth:`StaticDecoder.qkv` and :meth:`StaticDecoder.mlp` call the model's linears, which the
compiled runner has packed for our kernel (:mod:`spectoolkit.quant.packing`), so a row of a k-row call
is bit-identical to the one-row step at that position. The step itself (KV writes and attention over
the paged pool) is :class:`~spectoolkit.runtime.compiled.CompiledRunner`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from spectoolkit.errors import SpecToolkitError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_decoder(model: nn.Module, what: str, remedy: str = "") -> None:
    """Refuse a model our decoder loops do not implement: outside the Llama family, or with sliding-window
    attention (``what`` names the feature that needs the loop, ``remedy`` ends the message)."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED_TYPES:
        raise SpecToolkitError(
            f"{what} runs Llama-family decoders ({', '.join(SUPPORTED_TYPES)}), not model_type '{kind}'{remedy}"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise SpecToolkitError(f"{what} does not implement sliding-window attention{remedy}")


class StaticDecoder:
    """The decoder of a Llama-family ``*ForCausalLM`` (embed → layers → norm → head), run functionally."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config.get_text_config()
        check_decoder(model, "runtime.compile=true", ": use runtime.compile=false")
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.head = model.get_output_embeddings()
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.layers[0].self_attn.scaling
        self.dtype = self.embed.weight.dtype

    def qkv(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [W, E] -> rotated q [W, Hq, D], k [W, Hkv, D] and v [W, Hkv, D]."""
        rows = x.shape[0]
        q = attn.q_proj(x).view(rows, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(rows, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(rows, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = cos[0][:, None], sin[0][:, None]  # [W, 1, D]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(act(gate(x)) * up(x)), x [W, E] -> [W, E]."""
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [-x2, x1] (the rotary pairing transformers' Llama uses)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
