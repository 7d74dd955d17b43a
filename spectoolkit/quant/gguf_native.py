"""GGUF at its own precision (``+target=gguf`` / ``+draft=gguf``): a GGUF checkpoint's linears run the file's own
quantized weights on our kernel (issue 46, item 3).

The model loads as any GGUF checkpoint does, from its converted fp32 directory (:func:`spectoolkit.embedded.
gguf_dir`): embeddings, norms and biases are F32 tensors in the file, so they are exact there. Then every linear
whose GGUF tensor :mod:`spectoolkit.quant.gguf_codes` takes becomes a
:class:`~spectoolkit.kernels.cpu_linear.PackedLinear` built from that tensor (source ``"gguf Q4_K"``), holding
exactly the weights ``gguf`` dequantizes — the very floats the conversion wrote, now read at the file's bit width.
The output head too: untied, from ``output.weight``; tied, from ``token_embd.weight``'s codes, the input embedding
staying the float table. A tensor we do not take (a float type, another quantization, a zero fp32 cannot hold)
keeps the converted float weights, packed as a float PackedLinear whose source says so and why
(``"gguf Q5_1 kept float (<why>)"``), which the loader's kernel report (a run's ``conditions.kernels``) lists.

HF module names map to GGUF tensor names through gguf's own map (:func:`gguf.get_tensor_name_map`), as
transformers' GGUF loader does (``modeling_gguf_pytorch_utils.get_gguf_hf_weights_map``). For ``llama`` files,
llama.cpp's converter permuted the q/k rows into its rotary layout and transformers undoes that on conversion
(``LlamaTensorProcessor``); we undo it as the row order passed to :func:`gguf_codes.to_packed` (:func:`hf_rows`).
This precision is its own kernel: ``runtime.kernels=reference`` does not unpack it (there is no other exact one).
"""

from __future__ import annotations

from collections import defaultdict

import gguf
import numpy as np
import torch
from torch import nn

from spectoolkit.checkpoints import Checkpoint
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.cpu_linear import PackedLinear, pack_float
from spectoolkit.quant import gguf_codes

PRECISION = "gguf"
PERMUTED_ARCHS = ("llama",)  # files whose q/k rows llama.cpp's converter permuted (transformers' LlamaTensorProcessor)
_ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}  # "llama" -> MODEL_ARCH.LLAMA
LinearTensors = dict[str, tuple[gguf.ReaderTensor, torch.Tensor | None]]  # module name -> tensor, HF row order


def load_quantized(checkpoint: Checkpoint, precision: str, device, group_size: int) -> nn.Module:
    """The GGUF-backed ``checkpoint`` (resolved once, its GGUF file found then) with its linears at the file's own
    quantization (module docstring); ``group_size`` is unused (the file fixes its blocks)."""
    from spectoolkit.models.float_model import load_float_model
    from spectoolkit.models.paths import resolve_device

    if precision != PRECISION:
        raise SpecToolkitError(f"precision '{precision}' is not the gguf precision")
    device = resolve_device(device) if isinstance(device, str) else device
    source = checkpoint.gguf
    if source is None:
        raise SpecToolkitError(
            f"precision gguf runs a GGUF checkpoint at its own quantization, but '{checkpoint.spec}' is not "
            "GGUF-backed: give model.target_path / model.draft_path a .gguf file, a `make pair` model name or the "
            "embedded model (unset), or choose another precision (fp32, bf16, rtn-int4, ...)"
        )
    if device.type != "cpu":
        raise SpecToolkitError(f"precision gguf runs on our CPU kernels, not on {device.type}: use device=cpu")
    model = load_float_model(checkpoint.location, "fp32", device)
    pack_gguf_linears(model, TensorReader(source))
    return model


def pack_gguf_linears(model: nn.Module, reader: gguf.GGUFReader) -> dict[str, str]:
    """Replace every linear of ``model`` by a PackedLinear of its GGUF tensor, in place, or of its converted float
    weight where we do not take the tensor (source ``"gguf <type> kept float (<why>)"``); returns the ones kept in
    float: ``{"gguf <type> <N>x<K> kept float": why}`` (empty when none)."""
    kept: dict[str, list[str]] = defaultdict(list)  # kind -> why, per tensor
    for name, (tensor, rows) in linear_tensors(model, reader).items():
        module = model.get_submodule(name)
        kind = f"gguf {gguf_codes.gguf_type_name(tensor)}"
        why = gguf_codes.unpackable(tensor)
        parent, _, leaf = name.rpartition(".")
        if why is not None:
            kept[f"{kind} {module.out_features}x{module.in_features} kept float"].append(f"{tensor.name}: {why}")
            floating = PackedLinear(pack_float(module.weight), module.bias, f"{kind} kept float ({why})")
            setattr(model.get_submodule(parent) if parent else model, leaf, floating)
            continue
        packed = gguf_codes.to_compact(tensor, rows)
        if (packed.out_features, packed.in_features) != (module.out_features, module.in_features):
            raise SpecToolkitError(
                f"gguf tensor {tensor.name} is {packed.out_features}x{packed.in_features}, but {name} is "
                f"{module.out_features}x{module.in_features}: the file and its converted directory disagree"
            )
        setattr(model.get_submodule(parent) if parent else model, leaf, PackedLinear(packed, module.bias, kind))
    return {kind: f"float path ({len(whys)} tensors; first {whys[0]})" for kind, whys in kept.items()}


def linear_tensors(model: nn.Module, reader: gguf.GGUFReader) -> LinearTensors:
    """Each ``nn.Linear`` of ``model`` (by module name) -> its GGUF tensor and the rows to take in HF order
    (None: all, in file order). A linear without a tensor in the file is an error: the file is not this model's."""
    arch = _architecture(reader)
    config = model.config.get_text_config()
    names = gguf.get_tensor_name_map(_ARCHS[arch], config.num_hidden_layers)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    head = model.get_output_embeddings()
    found: LinearTensors = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        base = names.get_name(name)
        tensor = tensors.get(f"{base}.weight") if base else None
        if tensor is None and module is head:  # tied: the file stores the head once, as the embedding
            tensor = tensors.get("token_embd.weight")
        if tensor is None:
            raise SpecToolkitError(f"the GGUF file has no tensor for {name} ({base or 'no gguf name'}.weight)")
        found[name] = (tensor, hf_rows(arch, tensor.name, config, module.out_features))
    return found


def hf_rows(arch: str, tensor_name: str, config, out_features: int) -> torch.Tensor | None:
    """The file rows of q/k tensor ``tensor_name`` in HF order (llama.cpp's converter interleaved each head's two
    rotary halves; transformers' ``_reverse_permute_weights`` as a row order), None for every other tensor."""
    part = tensor_name.split(".")[-2]  # blk.N.attn_q.weight -> attn_q
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(part)
    if arch not in PERMUTED_ARCHS or heads is None:
        return None
    half = out_features // heads // 2
    return torch.arange(out_features).reshape(heads, half, 2).transpose(1, 2).reshape(-1)  # int64 [N]


class TensorReader(gguf.GGUFReader):
    """:class:`gguf.GGUFReader` that steps over a metadata array instead of viewing each item: a tokenizer's
    vocabulary, token types and merges are 10^5 items each, seconds of numpy views, and we read the tensors. Such
    a field's ``parts`` is its bytes in one piece (its items are not listed)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        value = gguf.GGUFValueType
        if raw_type != value.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = value(int(self._get(orig_offs, np.uint32)[0]))
        count = int(self._get(orig_offs + 4, np.uint64)[0])
        offs = orig_offs + 12  # item type uint32, count uint64, then the items
        if item_type == value.STRING:
            raw = memoryview(self.data)
            for _ in range(count):  # each: its length uint64 (little-endian, the host's), then its bytes
                offs += 8 + int.from_bytes(raw[offs : offs + 8], "little")
        elif item_type in self.gguf_scalar_to_np:
            offs += count * np.dtype(self.gguf_scalar_to_np[item_type]).itemsize
        else:  # nested arrays: rare, small
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, [self.data[orig_offs:offs]], [], [value.ARRAY, item_type]


def _architecture(reader: gguf.GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in _ARCHS:
        raise SpecToolkitError(f"GGUF architecture {arch!r} has no tensor-name map in the gguf package")
    return arch
