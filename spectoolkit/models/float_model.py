"""Load an HF causal LM at a float precision (fp32/bf16/fp16), the base every loader starts from.

:func:`spectoolkit.wiring.loading.load_model` uses it for the float precisions and the RTN backend
(:mod:`spectoolkit.quant.rtn`) for the checkpoint it quantizes; a leaf, so that backend does not
import the loader that chooses it.
"""

from __future__ import annotations

import torch

from spectoolkit.errors import SpecToolkitError, first_line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_float_model(location: str, precision: str, device: torch.device, head_rows: torch.Tensor | None = None):
    """The HF causal LM at ``location`` in fp32/bf16/fp16 on ``device`` (eval); with ``head_rows`` (ascending token
    ids) its output projection cut to those rows (:func:`keep_output_rows`), before any backend quantizes it."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=DTYPES[precision])
    except (OSError, ValueError) as exc:
        raise SpecToolkitError(
            f"cannot load model '{location}': {first_line(exc)} "
            "(offline: pass a local directory with model.target_path=DIR / model.draft_path=DIR)"
        ) from None
    model.to(device).eval()
    if head_rows is not None:
        keep_output_rows(model, head_rows)
    return model


def keep_output_rows(model: torch.nn.Module, token_ids: torch.Tensor) -> None:
    """Cut ``model``'s output projection to the rows of ``token_ids`` [n] (ascending target ids): its logits are then
    those n tokens' (a draft that only proposes them computes n/V of the head). The new head is untied from the
    input embeddings, which stay whole."""
    head = model.get_output_embeddings()
    ids = token_ids.to(head.weight.device)
    if len(ids) and int(ids.max()) >= head.out_features:
        raise SpecToolkitError(f"token id {int(ids.max())} is past the draft's {head.out_features} output rows")
    kept = torch.nn.Linear(head.in_features, len(ids), bias=head.bias is not None, device=ids.device,
                           dtype=head.weight.dtype)  # fmt: skip
    with torch.no_grad():
        kept.weight.copy_(head.weight[ids])
        if head.bias is not None:
            kept.bias.copy_(head.bias[ids])
    model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(kept.eval())
