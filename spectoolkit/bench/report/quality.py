"""Report sections on output quality: the greedy exactness verdict and what quantization cost.

Read together they say "quantization cost X; speculation added nothing" — or show where it did.
"""

from __future__ import annotations

from pathlib import Path

from spectoolkit.bench.report.load import Records, fmt, md_table
from spectoolkit.metrics.summary_schema import Summary

QUALITY_METRICS = ("kl_mean", "top1_agreement", "ppl_ref", "ppl_quant", "ppl_delta", "positions", "texts")


def exactness_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    """Greedy verdict per drafting arm and every divergence with its margin and class."""
    section = summary.exactness
    if section is None or not section.verdict:
        return []
    lines = ["## Exactness", "", f"**Verdict: {section.verdict}** — each drafting arm against the target alone at "
             "the same precision; a divergence is a near-tie when the reference's top-2 logit margin there is within "
             "the stated numerical threshold, else unexplained (fails the verdict).", ""]  # fmt: skip
    rows = [[arm, s.pairs, s.identical, s.near_ties, s.unexplained, fmt(s.threshold, ".3g"), s.verdict]
            for arm, s in section.arms.items()]  # fmt: skip
    lines += md_table(["arm", "pairs", "identical", "near-tie", "unexplained", "near-tie threshold", "verdict"], rows)
    if section.divergences:
        headers = ["arm", "case", "repeat", "position", "reference token", "spec token", "top-2 margin",
                   "target flips at width", "class"]  # fmt: skip
        lines += md_table(headers, [[d.arm, d.case_id, d.repeat_idx, d.position, d.reference_token, d.spec_token,
                                     fmt(d.margin, ".4g"), d.flip_width or "—", d.classification]
                                    for d in section.divergences])  # fmt: skip
        lines += [
            "A width is the k-token forward in which the target alone, at the same precision, emits the "
            "spec token there: the rounding difference of a verify round, shown rather than assumed.",
            "",
        ]
    return lines


def quality_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    """quant_quality: the quantized target against its float reference."""
    quality = summary.quant_quality
    if quality is None:
        return []
    quantized = quality.quantized if quality.quantized is not None else "quantized"
    reference = quality.reference if quality.reference is not None else "the reference"
    note = f"Loss of the {quantized} target against {reference}: what quantization costs (speculation adds none)."
    lines = ["## Quantization quality", "", note, ""]
    return lines + md_table(["metric", "value"], [[key, fmt(getattr(quality, key), ".4g")] for key in QUALITY_METRICS])
