"""Report sections on output quality: the greedy exactness verdict and what quantization cost.

Read together they say "quantization cost X; speculation added nothing" — or show where it did.
"""

from __future__ import annotations

from pathlib import Path

from spectoolkit.bench.report.load import Records, Summary, as_dict, as_list, fmt, md_table


def exactness_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    """Greedy verdict per drafting arm and every divergence with its margin and class."""
    section = as_dict(summary.get("exactness"))
    if not section.get("verdict"):
        return []
    lines = ["## Exactness", "", f"**Verdict: {section['verdict']}** — each drafting arm against the target alone at "
             "the same precision; a divergence is a near-tie when the reference's top-2 logit margin there is within "
             "the stated numerical threshold, else unexplained (fails the verdict).", ""]  # fmt: skip
    arms = as_dict(section.get("arms"))
    keys = ("pairs", "identical", "near_ties", "unexplained")
    rows = [[arm, *(s.get(k) for k in keys), fmt(s.get("threshold"), ".3g"), s.get("verdict")]
            for arm, s in arms.items() if isinstance(s, dict)]  # fmt: skip
    lines += md_table(["arm", "pairs", "identical", "near-tie", "unexplained", "near-tie threshold", "verdict"], rows)
    divergences = [d for d in as_list(section.get("divergences")) if isinstance(d, dict)]
    if divergences:
        headers = ["arm", "case", "repeat", "position", "reference token", "spec token", "top-2 margin",
                   "target flips at width", "class"]  # fmt: skip
        keys = ("arm", "case_id", "repeat_idx", "position", "reference_token", "spec_token")
        lines += md_table(headers, [[*(d.get(k) for k in keys), fmt(d.get("margin"), ".4g"),
                                     d.get("flip_width") or "—", d.get("classification")]
                                    for d in divergences])  # fmt: skip
        lines += [
            "A width is the k-token forward in which the target alone, at the same precision, emits the "
            "spec token there: the rounding difference of a verify round, shown rather than assumed.",
            "",
        ]
    return lines


def quality_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    """quant_quality: the quantized target against its float reference."""
    quality = summary.get("quant_quality")
    if not isinstance(quality, dict):
        return []
    quantized, reference = quality.get("quantized", "quantized"), quality.get("reference", "the reference")
    note = f"Loss of the {quantized} target against {reference}: what quantization costs (speculation adds none)."
    lines = ["## Quantization quality", "", note, ""]
    keys = ("kl_mean", "top1_agreement", "ppl_ref", "ppl_quant", "ppl_delta", "positions", "texts")
    return lines + md_table(["metric", "value"], [[key, fmt(quality.get(key), ".4g")] for key in keys])
