"""A Llama-family HF model's layers as plain tensor code over our kernels: the one body both runners run.

No transformers ``Cache``, no mask construction, no Python per-layer objects between kernels — gpt-fast's
shape of a step, on the loaded model's own weights (shared, not copied). Every operation is one of our
CPU kernels (DESIGN §7) or an exact one: a layer is ``spectoolkit::attn_in`` (the input norm, q/k/v on the packed
linear kernel of :mod:`spectoolkit.quant.packing`, rotary) then ``layer_tail`` (attention over the pool, o, the
post-attention norm, SwiGLU, the residuals), which run our norm, rotary, SwiGLU, linear and attention kernels with
ATen's casts and adds in between (csrc/layer.inc), and a step runs every layer so in one call
(``spectoolkit::decoder_layers``, :meth:`StaticDecoder.decoder_layers`). The rotary
tables come from :class:`RopeTable` (one row per position, computed once). So a row's result depends on
nothing but its own inputs, and the eager runner (this code run op by op) and the compiled runner (this
code compiled by inductor) give the same bits. :func:`exact_decoder_reason` says why a model cannot run it
(then the eager runner keeps the transformers modules).
"""

from __future__ import annotations

from dataclasses import dataclass

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
        return "linears our kernel does not take (bitsandbytes LLM.int8, act-order GPTQ or fp16 weights)"
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
        self.layer_args = [_layer_args(layer, self.norm_weights) for layer in self.layers]
        self.weights, self.meta, self.eps = _flat_layer_args(self.layer_args)  # decoder_layers' arguments

    def rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., E] -> RMSNorm(x) in x's dtype (``spectoolkit::rms_norm`` on fp32)."""
        weight = self.norm_weights[id(norm)]
        out = torch.ops.spectoolkit.rms_norm(x.float().contiguous(), weight, norm.variance_epsilon, self.isa)
        return out.to(x.dtype)

    def decoder_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stores: list[torch.Tensor],
        write: torch.Tensor, key_slots: torch.Tensor, starts: torch.Tensor, capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Every layer, each as :meth:`attn_in` then :meth:`layer_tail` (the same bits), in one call
        (``spectoolkit::decoder_layers``); ``stores``: each layer's pool tensors (k, v, k_scale, v_scale) in layer
        order -> (the last layer's hidden [W, E], the hidden entering each layer of ``capture`` side by side
        [W, len(capture) * E])."""
        return torch.ops.spectoolkit.decoder_layers(
            hidden, cos, sin, self.weights, self.meta, self.eps, stores, write, key_slots, starts, self.num_heads,
            self.kv_heads, self.head_dim, self.scale, list(capture), self.isa,
        )  # fmt: skip


@dataclass(frozen=True)
class LayerArgs:
    """A layer's weights as the layer ops take them (csrc/layer.inc): each packed linear is 4 tensors (data,
    scales, zeros, bias; no bias: 0 elements) and 2 ints (out features, group); norms as fp32 weights."""

    norm_in: torch.Tensor
    eps_in: float
    qkv: list[torch.Tensor]  # one fused q/k/v linear or q, k, v
    qkv_meta: list[int]
    q_norm: torch.Tensor  # qwen3's per-head norms (0 elements: none)
    k_norm: torch.Tensor
    qk_eps: float
    norm_post: torch.Tensor
    eps_post: float
    tail: list[torch.Tensor]  # o, then gate_up fused or gate and up, then down
    tail_meta: list[int]


def _linear_args(modules: list[nn.Module]) -> tuple[list[torch.Tensor], list[int]]:
    tensors, meta = [], []
    for m in modules:
        bias = m.bias if m.bias is not None else torch.empty(0)
        tensors += [m.data, m.scales, m.zeros, bias]
        meta += [m.out_features, m.group, m.fmt_id]
    return tensors, meta


def _layer_args(layer: nn.Module, norm_weights: dict[int, torch.Tensor]) -> LayerArgs:
    """``layer``'s LayerArgs; ``norm_weights``: the decoder's fp32 norm weights by module id."""
    attn, mlp = layer.self_attn, layer.mlp
    fused = getattr(attn, "qkv_fused", None)  # quant.packing's fused calls: the same bits as the parts
    qkv = _linear_args([fused] if fused is not None else [attn.q_proj, attn.k_proj, attn.v_proj])
    fused = getattr(mlp, "gate_up_fused", None)
    gate_up = [fused] if fused is not None else [mlp.gate_proj, mlp.up_proj]
    tail = _linear_args([attn.o_proj, *gate_up, mlp.down_proj])
    none = torch.empty(0)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # qwen3 only
    first, post = layer.input_layernorm, layer.post_attention_layernorm
    return LayerArgs(
        norm_weights[id(first)], first.variance_epsilon, *qkv,
        norm_weights.get(id(q_norm), none), norm_weights.get(id(k_norm), none),
        q_norm.variance_epsilon if q_norm is not None else 0.0,
        norm_weights[id(post)], post.variance_epsilon, *tail,
    )  # fmt: skip


def _flat_layer_args(layers: list[LayerArgs]) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """``decoder_layers``' weights, meta and eps (csrc/layer.inc says their order) of ``layers``."""
    weights, meta, eps = [], [], []
    for args in layers:
        weights += [args.norm_in, args.q_norm, args.k_norm, args.norm_post, *args.qkv, *args.tail]
        meta += [len(args.qkv) // 4, len(args.tail) // 4, *args.qkv_meta, *args.tail_meta]
        eps += [args.eps_in, args.qk_eps, args.eps_post]
    return weights, meta, eps


def _is_norm(module: nn.Module) -> bool:
    return hasattr(module, "variance_epsilon") and hasattr(module, "weight")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [-x2, x1] (the rotary pairing transformers' Llama uses)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
