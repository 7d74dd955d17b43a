"""The EAGLE-3 draft head (Li et al. 2025) as vLLM's ``LlamaForCausalLMEagle3`` reads it, and its export.

The head drafts from the target's own states: the residual stream entering three target layers (low, mid,
high: vLLM's default ``(2, L // 2, L - 3)``), concatenated [3H] and projected by ``fc`` to H. One decoder
layer then reads, per position, the RMS-normed embedding of the token there (the target's embeddings,
shared, not exported) beside the RMS-normed projected state ([2H] into q/k/v), with the projected state as
its residual; a final norm and a reduced-vocabulary head (the ``draft_vocab`` most frequent target tokens)
give the draft logits, scattered to target ids by ``d2t`` (target id = draft id + d2t[draft id]). A second
draft step feeds the layer's pre-norm output (``aux``) in place of the projected state.

:meth:`Eagle3Head.save` writes ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``) and ``model.safetensors`` with vLLM's names (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``); :meth:`Eagle3Head.load` reads them back. The forward follows vLLM's
``llama_eagle3.py`` op for op, so ``backend=vllm backend.eagle_path=DIR`` serves the same head.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


@dataclass(frozen=True)
class HeadShape:
    """The head's sizes; attention, MLP and rotary as the target's (a Llama-family config)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    aux_layers: tuple[int, int, int]  # target layers whose input states the head reads

    @classmethod
    def of_target(cls, config, draft_vocab_size: int) -> HeadShape:
        """The head for a transformers Llama-family ``config`` (its text config)."""
        text = config.get_text_config()
        layers = text.num_hidden_layers
        heads = text.num_attention_heads
        rope = getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
        return cls(
            hidden_size=text.hidden_size, intermediate_size=text.intermediate_size, num_attention_heads=heads,
            num_key_value_heads=text.num_key_value_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab_size=text.vocab_size,
            draft_vocab_size=draft_vocab_size, rms_norm_eps=text.rms_norm_eps, rope_theta=float(rope or 10000.0),
            max_position_embeddings=text.max_position_embeddings, aux_layers=(2, layers // 2, layers - 3),
        )  # fmt: skip


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        angles = torch.cat([angles, angles], -1)[:, None]  # [B, 1, T, D]
        cos, sin = angles.cos(), angles.sin()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2H], positions [B, T] -> rotated q [B, Hq, T, D], rotated k and v [B, Hkv, T, D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return self._rotate(q, positions), self._rotate(k, positions), v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """[B, Hq, T, D] -> [B, T, H]."""
        b, _, t, _ = attended.shape
        return self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, 2H], positions [B, T], mask [B or 1, 1, T, S] bool (None: causal over T) -> [B, T, H]."""
        q, k, v = self.qkv(x, positions)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.output(out)


class _MidLayer(nn.Module):
    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        h = shape.hidden_size
        self.input_layernorm = _RMSNorm(h, shape.rms_norm_eps)
        self.hidden_norm = _RMSNorm(h, shape.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(h, shape.rms_norm_eps)
        self.self_attn = _Attention(shape)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, shape.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, shape.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(shape.intermediate_size, h, bias=False)


class Eagle3Head(nn.Module):
    """fc, one decoder layer, norm, reduced-vocabulary head, and the draft→target map (module docstring)."""

    def __init__(self, shape: HeadShape, draft_to_target: torch.Tensor) -> None:
        """``draft_to_target`` int64 [draft_vocab_size]: the target id of each draft id (ascending, distinct)."""
        super().__init__()
        ids = draft_to_target.long()
        if ids.shape != (shape.draft_vocab_size,) or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"draft_to_target must be {shape.draft_vocab_size} ascending distinct target ids")
        if int(ids.min()) < 0 or int(ids.max()) >= shape.vocab_size:
            raise ValueError(f"draft_to_target ids must lie in [0, {shape.vocab_size})")
        self.shape = shape
        h = shape.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = _MidLayer(shape)
        self.norm = _RMSNorm(h, shape.rms_norm_eps)
        self.lm_head = nn.Linear(h, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", ids - torch.arange(len(ids)))  # vLLM's offsets: target = draft + d2t[draft]
        t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.shape.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [B, T, H] (hidden: ``fc`` of the target's states, or a previous step's ``aux``),
        positions [B, T] -> (normed states [B, T, H], aux: the pre-norm states a next step feeds)."""
        return self.layer_out(self.midlayer.self_attn(self.layer_in(embeds, hidden), positions, mask), hidden)

    def layer_in(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The attention's input [.., 2H]: the normed embedding beside the normed state."""
        return torch.cat([self.midlayer.input_layernorm(embeds), self.midlayer.hidden_norm(hidden)], dim=-1)

    def layer_out(self, attn: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output [.., H] and the state it started from (the residual) -> (normed states, aux)."""
        layer = self.midlayer
        residual = attn + hidden
        h = layer.post_attention_layernorm(residual)
        h = layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        aux = h + residual
        return self.norm(aux), aux

    def draft_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab] logits."""
        return self.lm_head(states)

    def target_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., vocab] logits: the draft ones at their target ids, -inf elsewhere (vLLM's scatter)."""
        return self.scattered(self.draft_logits(states))

    def scattered(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., draft_vocab] -> [..., vocab]: at their target ids, -inf elsewhere."""
        full = logits.new_full((*logits.shape[:-1], self.shape.vocab_size), float("-inf"))
        full[..., self.draft_to_target] = logits
        return full

    def save(self, directory: Path | str) -> Path:
        """config.json + model.safetensors in the layout vLLM's eagle3 loader reads (module docstring)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        s = self.shape
        config = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim, "vocab_size": s.vocab_size, "draft_vocab_size": s.draft_vocab_size,
            "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta, "hidden_act": "silu",
            "max_position_embeddings": s.max_position_embeddings, "tie_word_embeddings": False,
            "target_hidden_size": s.hidden_size, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(s.aux_layers)},
            "spectoolkit": {"shape": asdict(s)},
        }  # fmt: skip
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_FILE))
        return out

    @classmethod
    def load(cls, directory: Path | str) -> Eagle3Head:
        """A head written by :meth:`save`."""
        from safetensors.torch import load_file

        directory = Path(directory).expanduser()
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        values = dict(config["spectoolkit"]["shape"])
        shape = HeadShape(**{**values, "aux_layers": tuple(values["aux_layers"])})
        tensors = load_file(str(directory / WEIGHTS_FILE))
        ids = torch.arange(shape.draft_vocab_size) + tensors["d2t"]
        head = cls(shape, ids)
        head.load_state_dict(tensors)
        return head.eval()


def draft_vocabulary(token_ids: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids in ``token_ids`` (ties: the smaller id; ids never seen fill up by id
    order), ascending: the draft→target map."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in token_ids:
        counts.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids), dtype=torch.long))
    order = sorted(range(vocab_size), key=lambda token: (-int(counts[token]), token))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def capture_states(model, input_ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The residual stream entering each of ``layers`` of a transformers Llama-family ``model``, concatenated:
    input_ids [B, T] -> [B, T, len(layers) * H] (what vLLM hands an EAGLE-3 head)."""
    return aux_states(model(input_ids=input_ids, output_hidden_states=True).hidden_states, layers)


def aux_states(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """A transformers forward's ``hidden_states`` (entry i: the input of layer i) -> those of ``layers``,
    concatenated on the last dimension."""
    return torch.cat([hidden_states[layer] for layer in layers], dim=-1)
