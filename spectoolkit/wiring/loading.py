"""Load causal LMs and tokenizers from a local directory, a hub id, or the embedded default.

A model is given as a :class:`~spectoolkit.checkpoints.Checkpoint` a run resolved once
(:mod:`spectoolkit.wiring.resolve`), or, from plain Python, as a spec resolved here by
:mod:`spectoolkit.checkpoints` (``None`` means the embedded SmolLM2-135M-Instruct; a missing model is a clear
:class:`SpecToolkitError`, never a traceback). :func:`load_model` chooses between the float loader
(:mod:`spectoolkit.models.float_model`) and the quantization backends
(:func:`spectoolkit.quant.registry.load_quantized`), none of which imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spectoolkit.checkpoints import Checkpoint, checkpoint_of
from spectoolkit.config_checks import HEAD_PRUNING
from spectoolkit.errors import SpecToolkitError, first_line
from spectoolkit.kernels.kernel_choice import choose_kernels
from spectoolkit.kernels.layer_wrapper import leaf_linears
from spectoolkit.models.eagle3_head import draft_vocabulary
from spectoolkit.models.float_model import DTYPES, load_float_model
from spectoolkit.precisions import precision_label, resolve_activations
from spectoolkit.quant import QUANT_PRECISIONS
from spectoolkit.quant.bnb_scales import scale_bytes
from spectoolkit.quant.packing import pack_model
from spectoolkit.quant.registry import HEAD_QUANTIZING, load_quantized
from spectoolkit.runtime.lone import model_step


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with what the engine needs to know about it."""

    model: torch.nn.Module
    path: str
    precision: str
    vocab_size: int  # rows of the output embedding (may exceed len(tokenizer): tail padding)
    kernels: dict[str, str] = field(default_factory=dict)  # linear kind/shape -> "packed" or its kernel variant
    shared: bool = False  # its weights are another loaded model's (a layer-skip draft): no extra bytes
    activations: str = "float"  # "int8": its integer layers run integer dot products (precisions.ACTIVATIONS)
    vocab_ids: torch.Tensor | None = None  # the target id of each output row, where its head was cut; None: row i is i
    checkpoint: Checkpoint | None = None  # what it was loaded from (``path`` is its location)

    @property
    def label(self) -> str:
        """The precision with its activations, as runs name it (``gguf+a8``)."""
        return precision_label(self.precision, self.activations)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def weight_bytes(self) -> int:
        """Bytes of parameters and buffers (tied weights counted once), plus bitsandbytes scales; 0 when
        ``shared`` (the bytes are the other model's)."""
        if self.shared:
            return 0
        return self._bytes([*self.model.parameters(), *self.model.buffers()])

    def streamed_bytes(self) -> int:
        """Bytes of weights one decode step reads: every linear layer's, packed or not, the output head included (the
        input embedding gives one row a token, not counted); 0 when ``shared``."""
        if self.shared:
            return 0
        return self._bytes([t for _, m in leaf_linears(self.model) for t in (*m.parameters(), *m.buffers())])

    def _bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of ``tensors`` (one storage counted once), plus bitsandbytes scales."""
        seen: set[int] = set()
        total = 0
        for tensor in tensors:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
        if self.precision in ("int8", "nf4"):  # bitsandbytes keeps its scales outside params/buffers
            total += scale_bytes(self.model)
        return total


def frequent_tokens(tokenizer, size: int, vocab_size: int, keep: frozenset[int]) -> torch.Tensor:
    """The ``size`` token ids most frequent in the workload calibration text (the texts GPTQ calibrates on: ShareGPT
    chats and HumanEval solutions, disjoint from the prompts runs read; ties: the smaller id), with ``keep`` (the end
    ids) added, ascending: what a draft head cut to ``draft.head_vocab`` tokens keeps (FR-Spec's frequency ranking)."""
    from spectoolkit.quant.gptq import MAX_CALIBRATION_SAMPLES, calibration_texts

    texts = calibration_texts(MAX_CALIBRATION_SAMPLES)
    ids = draft_vocabulary([tokenizer(text)["input_ids"] for text in texts], min(size, vocab_size), vocab_size)
    return torch.tensor(sorted(set(ids.tolist()) | {token for token in keep if token < vocab_size}))


def load_tokenizer(model: Checkpoint | str | None):
    """The tokenizer of ``model`` (a resolved checkpoint, or a spec resolved here: a library caller's door)."""
    from transformers import AutoTokenizer

    location = checkpoint_of(model).location
    try:
        return AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError) as exc:
        raise SpecToolkitError(f"cannot load the tokenizer of '{location}': {first_line(exc)}") from None


def load_model(
    model: Checkpoint | str | None,
    precision: str,
    device: torch.device,
    group_size: int = 64,
    kernels: str | None = "auto",
    widths: tuple[int, ...] = (1, 5),
    quantize_head: bool = False,
    activations: str | None = None,
    head_rows: torch.Tensor | None = None,
) -> LoadedModel:
    """Load ``model`` (a resolved checkpoint, or a spec resolved here) at ``precision`` onto ``device``, in eval mode.

    Float precisions (fp32/bf16/fp16) load directly; quantized ones (int8, nf4, int4, rtn-int8, rtn-int4, and
    gguf: a GGUF checkpoint's own quantization, always on our kernel) go through their backend in
    :mod:`spectoolkit.quant` (``group_size`` for the group-wise ones). With ``kernels="auto"`` every CPU linear
    our kernel takes is packed for it (:mod:`spectoolkit.quant.packing`), and the others run the variant
    :mod:`spectoolkit.kernels.kernel_choice` picks for their shape, timed at ``widths`` (a decode step and the
    run's verify width); ``"reference"`` runs every linear as loaded, through its reference variant (stock
    numerics, no packing); ``None`` leaves the model as loaded (the compiled runner packs it itself). A gguf
    layer kept in float is named so by its source (``"gguf Q5_1 kept float (<why>)"``) in the returned ``kernels``.
    ``quantize_head``: quantize the output projection too (``rtn-int8``/``rtn-int4`` only). ``activations``:
    ``int8`` runs every integer layer with integer dot products (packed whatever ``kernels`` says: only our kernel
    computes them), ``float`` or None the precision's default (:func:`~spectoolkit.precisions.resolve_activations`).
    ``head_rows`` (ascending token ids; float and ``rtn-*`` only): the output projection keeps only those rows, cut
    before it is quantized (:func:`~spectoolkit.models.float_model.load_float_model`); the model's logits are then
    those tokens' (``vocab_ids``).
    """
    if quantize_head and precision not in HEAD_QUANTIZING:
        raise SpecToolkitError(
            f"quantize_head applies to {', '.join(HEAD_QUANTIZING)} (their lm_head is quantized like the other "
            f"linears), not to precision '{precision}': drop draft.quantize_head or use +draft=rtn-int4"
        )
    if precision not in DTYPES and precision not in QUANT_PRECISIONS:
        raise SpecToolkitError(f"precision '{precision}' is not one of {', '.join((*DTYPES, *QUANT_PRECISIONS))}")
    if head_rows is not None and precision not in HEAD_PRUNING:
        raise SpecToolkitError(f"a draft head cut to fewer tokens needs a float or rtn-* draft, not '{precision}'")
    checkpoint = checkpoint_of(model)
    location = checkpoint.location
    if precision in QUANT_PRECISIONS:
        model = load_quantized(checkpoint, precision, device, group_size, quantize_head, head_rows)
    else:
        model = load_float_model(location, precision, device, head_rows)
    activations = resolve_activations(precision, activations)
    if activations == "int8" and torch.device(device).type != "cpu":
        raise SpecToolkitError(f"int8 activations run on our CPU kernels, not on {torch.device(device).type}: use "
                               "device=cpu or target/draft.activations=float")  # fmt: skip
    chosen: dict[str, str] = {}
    if activations == "int8" or (kernels == "auto" and torch.device(device).type == "cpu"):
        chosen = pack_model(model, activations)
    if kernels is not None:
        chosen |= choose_kernels(model, kernels, widths, step=model_step(model))
    vocab = model.get_output_embeddings().out_features
    return LoadedModel(model, location, precision, vocab, chosen, activations=activations, vocab_ids=head_rows,
                       checkpoint=checkpoint)  # fmt: skip
