"""Build what a run needs from its config: models, the compat check, drafter, verifier, engines.

Data flows one way (DESIGN §4): config → loaded models → compat check → engines. Each variant
(drafter kind, verifier) is chosen here once; the decode loops never branch on config strings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectoolkit.config import RunConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models import LoadedModel, load_model, load_tokenizer, resolve_device, resolve_path
from spectoolkit.models.cached import CachedModel
from spectoolkit.sampling import make_chooser
from spectoolkit.verify import make_verifier


@dataclass
class RunSetup:
    """Everything the protocol loop needs; ``spec`` is None for ``draft=none`` (baseline only)."""

    device: torch.device
    tokenizer: object
    target: LoadedModel
    draft: LoadedModel | None
    baseline: BaselineEngine
    spec: SpeculativeEngine | None
    drafter_name: str
    eos_ids: frozenset[int]
    max_positions: int
    compat_warnings: list[str]


def eos_ids_of(tokenizer, model: torch.nn.Module) -> frozenset[int]:
    """EOS ids from the tokenizer and the generation config (chat models often list several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return frozenset(ids)


def build(cfg: RunConfig) -> RunSetup:
    """Load and wire everything ``cfg`` asks for; user mistakes raise SpecToolkitError."""
    device = resolve_device(cfg.device)
    tokenizer = load_tokenizer(cfg.model.target_path)
    target = load_model(cfg.model.target_path, cfg.target.precision, device, group_size=cfg.target.group_size)
    eos_ids = eos_ids_of(tokenizer, target.model)
    verifier = make_verifier(cfg.sampling)
    runner = CachedModel(target.model, cfg.kv.target)
    baseline = BaselineEngine(runner, verifier, eos_ids)
    draft, warnings, drafter = None, [], None
    if cfg.draft.kind == "model":
        draft, warnings, shared = _load_draft(cfg, target, device)
        chooser = make_chooser(cfg.sampling)
        name = f"model-{cfg.draft.precision}"
        drafter = ModelDrafter(draft.model, chooser, target.vocab_size, shared, eos_ids, name, cfg.kv.draft)
    elif cfg.draft.kind == "ngram":
        one_hot = not cfg.sampling.greedy
        drafter = NgramDrafter(cfg.draft.ngram_max, cfg.draft.ngram_min, target.vocab_size, one_hot)
    spec = SpeculativeEngine(runner, drafter, verifier, cfg.speculate.gamma, eos_ids) if drafter else None
    max_positions = getattr(target.model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
    return RunSetup(
        device, tokenizer, target, draft, baseline, spec, drafter.name if drafter else "none",
        eos_ids, max_positions, warnings,
    )  # fmt: skip


def _load_draft(cfg: RunConfig, target: LoadedModel, device: torch.device):
    """Load the draft model; a different checkpoint must pass the compat check first."""
    from spectoolkit.compat import check_pair

    draft_path = cfg.model.draft_path or cfg.model.target_path
    warnings = []
    if cfg.model.draft_path and cfg.model.draft_path != cfg.model.target_path:
        report = check_pair(target.path, resolve_path(draft_path))
        if not report.compatible:
            raise SpecToolkitError(report.message())
        warnings = report.warnings
    draft = load_model(draft_path, cfg.draft.precision, device, group_size=cfg.draft.group_size)
    return draft, warnings, min(target.vocab_size, draft.vocab_size)
