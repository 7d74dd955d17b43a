"""Tiny random Llama models for fast tests: same code path as a real checkpoint, milliseconds a step."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama(vocab_size: int = 512, seed: int = 0, num_layers: int = 2, hidden: int = 64, scale: float = 1.0):
    """A randomly initialised ``LlamaForCausalLM`` in eval mode (fp32).

    ``scale`` multiplies the output embedding: larger values sharpen next-token distributions so
    greedy decoding is not dominated by near-ties.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def save_tiny_llama(directory: Path, **kwargs) -> Path:
    """Save a :func:`tiny_llama` as an HF checkpoint directory (no tokenizer) and return it."""
    model = tiny_llama(**kwargs)
    model.save_pretrained(directory)
    return Path(directory)
