"""Load an HF causal LM at a float precision (fp32/bf16/fp16), the base every loader starts from.

:func:`spectoolkit.wiring.loading.load_model` uses it for the float precisions and the RTN backend
(:mod:`spectoolkit.quant.rtn`) for the checkpoint it quantizes; a leaf, so that backend does not
import the loader that chooses it.
"""

from __future__ import annotations

import torch

from spectoolkit.errors import SpecToolkitError, first_line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_float_model(location: str, precision: str, device: torch.device):
    """The HF causal LM at ``location`` in fp32/bf16/fp16 on ``device`` (eval)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=DTYPES[precision])
    except (OSError, ValueError) as exc:
        raise SpecToolkitError(
            f"cannot load model '{location}': {first_line(exc)} "
            "(offline: pass a local directory with model.target_path=DIR / model.draft_path=DIR)"
        ) from None
    model.to(device).eval()
    return model
