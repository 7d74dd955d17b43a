"""A Llama-family HF model's layers as plain tensor code over our kernels: the one body both runners run.

No transformers ``Cache``, no mask construction, no Python per-layer objects between kernels — gpt-fast's
shape of a step, on the loaded model's own weights (shared, not copied). Every operation is one of our
CPU kernels (DESIGN §7) or an exact one: linears are the packed kernel (:mod:`spectoolkit.quant.packing`),
RMSNorm, the rotary embedding and SwiGLU's ``silu(gate) * up`` are ``spectoolkit::rms_norm`` /
``rotary`` / ``silu_mul``, the rotary tables come from :class:`RopeTable` (one row per position, computed
once), and what is left is embedding gathers, residual adds and dtype casts. So a row's result depends
on nothing but its own inputs, and the eager runner (this code run op by op) and the compiled runner
(this code compiled by inductor) give the same bits. :func:`exact_decoder_reason` says why a model cannot
run it (then the eager runner keeps the transformers modules). The step itself (KV writes and attention
over the paged pool) is the runners'.
"""

from __future__ import annotations

import torch
from torch import nn

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.cpu_linear import fully_packed
from spectoolkit.kernels.cpu_ops import HEAD_DIMS

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def decoder_reason(model: nn.Module) -> str | None:
    """Why our decoder loops do not implement ``model`` (None: they do): outside the Llama family, or
    sliding-window attention."""
    config = model.config.get_text_config()
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED_TYPES:
        return f"runs Llama-family decoders ({', '.join(SUPPORTED_TYPES)}), not model_type '{kind}'"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "does not implement sliding-window attention"
    return None


def check_decoder(model: nn.Module, what: str, remedy: str = "") -> None:
    """Refuse a model our decoder loops do not implement (:func:`decoder_reason`; ``what`` names the feature that
    needs the loop, ``remedy`` ends the message)."""
    why = decoder_reason(model)
    if why is not None:
        raise SpecToolkitError(f"{what} {why}{remedy}")


def exact_decoder_reason(model: nn.Module) -> str | None:
    """Why ``model``'s decoder cannot run on our kernels throughout (None: it can)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    family = decoder_reason(model)
    if family is not None:
        return family
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act} (our SwiGLU kernel is silu)"
    if config.hidden_size % 16 or head_dim not in HEAD_DIMS:
        return (
            f"hidden size {config.hidden_size} / head dim {head_dim} (multiples of 16, head dim up to {HEAD_DIMS[-1]})"
        )
    rope = getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) == "dynamic":
        return "dynamic rope scaling"
    if next(model.parameters()).device.type != "cpu":
        return "not on the CPU"
    if not fully_packed(model):
        return "linears our kernel does not take (bitsandbytes, GPTQ or fp16 weights)"
    return None


class RopeTable:
    """The rotary cos/sin rows [P, D] fp32 of positions [0, P), grown on demand (``spectoolkit::rope_table``: each
    position's row computed once, by itself, so its bits never depend on when or with what it was computed)."""

    def __init__(self, rotary: nn.Module) -> None:
        self.inv_freq = rotary.inv_freq.detach().float().cpu().contiguous()  # [D/2]
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.cos = self.sin = torch.empty(0, 2 * self.inv_freq.numel())

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [W] -> their cos, sin [W, D] fp32 (gathers: exact)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            first, count = self.cos.shape[0], max(need, 2 * self.cos.shape[0], 256) - self.cos.shape[0]
            cos, sin = torch.ops.spectoolkit.rope_table(self.inv_freq, first, count, self.scaling)
            self.cos, self.sin = torch.cat([self.cos, cos]), torch.cat([self.sin, sin])
        return self.cos[positions], self.sin[positions]


class StaticDecoder:
    """The decoder of a Llama-family ``*ForCausalLM`` (embed → layers → norm → head) over our kernels."""

    def __init__(self, model: nn.Module, isa: int) -> None:
        """``isa``: our kernels' path (:func:`~spectoolkit.kernels.cpu_ops.best_isa`)."""
        config = model.config.get_text_config()
        why = exact_decoder_reason(model)
        if why is not None:
            raise SpecToolkitError(
                f"runtime.compile=true runs our decoder kernels, which do not take this model (it {why}): "
                "use runtime.compile=false"
            )
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rope = RopeTable(inner.rotary_emb)
        self.head = model.get_output_embeddings()
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.layers[0].self_attn.scaling
        self.dtype = self.embed.weight.dtype
        self.isa = isa
        self.norm_weights = {id(m): m.weight.detach().float().contiguous() for m in model.modules() if _is_norm(m)}

    def rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., E] -> RMSNorm(x) in x's dtype (``spectoolkit::rms_norm`` on fp32)."""
        weight = self.norm_weights[id(norm)]
        out = torch.ops.spectoolkit.rms_norm(x.float().contiguous(), weight, norm.variance_epsilon, self.isa)
        return out.to(x.dtype)

    def qkv(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [W, E], cos/sin [W, D] fp32 -> rotated q [W, Hq, D], k [W, Hkv, D] and v [W, Hkv, D] (fp32)."""
        rows = x.shape[0]
        fused = getattr(attn, "qkv_fused", None)  # q, k and v in one call (quant.packing): the same bits
        if fused is not None:
            q, k, v = fused(x).float().split(fused.splits, dim=-1)
        else:
            q, k, v = attn.q_proj(x).float(), attn.k_proj(x).float(), attn.v_proj(x).float()
        q = q.reshape(rows, self.num_heads, self.head_dim)
        k = k.reshape(rows, self.kv_heads, self.head_dim)
        v = v.reshape(rows, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = self.rms_norm(attn.q_norm, q), self.rms_norm(attn.k_norm, k)
        rotary = torch.ops.spectoolkit.rotary
        return rotary(q.contiguous(), cos, sin, self.isa), rotary(k.contiguous(), cos, sin, self.isa), v

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(silu(gate(x)) * up(x)), x [W, E] -> [W, E]."""
        fused = getattr(mlp, "gate_up_fused", None)
        if fused is not None:
            gate, up = (part.contiguous() for part in fused(x).float().split(fused.splits, dim=-1))
        else:
            gate, up = mlp.gate_proj(x).float().contiguous(), mlp.up_proj(x).float().contiguous()
        return mlp.down_proj(torch.ops.spectoolkit.silu_mul(gate, up, self.isa).to(x.dtype))


def _is_norm(module: nn.Module) -> bool:
    return hasattr(module, "variance_epsilon") and hasattr(module, "weight")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [-x2, x1] (the rotary pairing transformers' Llama uses)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
