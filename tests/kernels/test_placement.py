"""Packed weights in huge-page memory (kernels/placement.py): the same values, views and bits, moved once."""

import pytest
import torch

from spectoolkit.kernels.packing import packed_layers
from spectoolkit.kernels.placement import huge_pages_offered, place_packed, streaming_buffer
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.quant.packing import pack_model


def _buffers(layer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in layer.named_buffers(recurse=False) if tensor is not None}


@torch.inference_mode()
def test_placing_keeps_values_views_and_outputs_and_moves_each_storage_once(monkeypatch):
    model = tiny_llama(vocab_size=96, seed=4)
    monkeypatch.setattr("spectoolkit.kernels.packing.place_packed", lambda layers: 0)  # packed where torch put it
    pack_model(model, "float")
    layers = packed_layers(model)
    before = [_buffers(layer) for layer in layers]
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    moved = place_packed(layers)
    if not huge_pages_offered():
        assert moved == 0 and not any(layer.placed for layer in layers)
        pytest.skip("this OS offers no transparent huge pages: nothing moves")
    assert moved > 0 and all(layer.placed for layer in layers)
    for layer, old in zip(layers, before, strict=True):
        new = _buffers(layer)
        assert new.keys() == old.keys() and all(torch.equal(new[name], old[name]) for name in old)
    attn = model.model.layers[0].self_attn
    fused = attn.qkv_fused
    start, end = fused.data.data_ptr(), fused.data.data_ptr() + fused.data.nbytes
    assert start <= attn.k_proj.data.data_ptr() < end  # a fused call's parts are still views of it, not copies
    assert attn.k_proj.data.untyped_storage().data_ptr() == fused.data.untyped_storage().data_ptr()
    assert torch.equal(model(ids).logits, logits)
    assert place_packed(layers) == 0  # placed once: packing again copies nothing


def test_the_bandwidth_buffer_is_ones_of_the_size_asked():
    buffer = streaming_buffer(3 << 20)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 << 20 and bool((buffer == 1).all())
