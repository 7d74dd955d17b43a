"""Report sections on output quality: the greedy exactness verdict and what quantization cost.

Read together they say "quantization cost X; speculation added nothing" — or show where it did.
"""

from __future__ import annotations

from pathlib import Path

from spectoolkit.bench.report.load import Records, fmt, md_table
from spectoolkit.metrics.summary_schema import Summary
from spectoolkit.metrics.summary_sections import DivergenceEntry

QUALITY_METRICS = ("kl_mean", "top1_agreement", "ppl_ref", "ppl_quant", "ppl_delta", "positions", "texts")


MARGIN_RULE = (
    "a divergence is a near-tie when the reference's top-2 logit margin there is within the stated "
    "numerical threshold, else unexplained (fails the verdict)."
)  # runs written before the replay rule
REPLAY_RULE = ("a divergence is a near-tie only when the target alone, replaying the spec run's round (same window "
               "start, width and KV precision), emits the spec token, else unexplained (fails the verdict). "
               'Reproduced divergences in more than {share:.0%} of the pairs fail as "diverges by rounding". The '
               "top-2 margin and its dtype threshold are shown for information.")  # fmt: skip

REPLAY_NOTE = ("A replay recomputes the spec run's schedule with the target alone — prefill, each round at its width "
               "with its KV truncation — and reads the row of the diverging token in its round (r, width k+1): the "
               "rounding difference of a verify round, shown rather than assumed. A width scan (records without "
               "rounds) scores the position in a k-token forward without the spec run's KV history.")  # fmt: skip
FLIP_NOTE = (
    "A width is the k-token forward in which the target alone, at the same precision, emits the "
    "spec token there: the rounding difference of a verify round, shown rather than assumed."
)


def exactness_section(summary: Summary, records: Records, plots: dict[str, Path]) -> list[str]:
    """Greedy verdict per drafting arm and every divergence with its margin, replay and class.

    A run written before divergences were replayed (no ``max_tie_share``) is rendered as it was, with
    the margin rule it was classified by.
    """
    section = summary.exactness
    if section is None or not section.verdict:
        return []
    replayed = section.max_tie_share is not None
    rule = REPLAY_RULE.format(share=section.max_tie_share) if replayed else MARGIN_RULE
    lines = ["## Exactness", "", f"**Verdict: {section.verdict}** — each drafting arm against the target alone at "
             f"the same precision; {rule}", ""]  # fmt: skip
    headers = ["arm", "pairs", "identical", "near-tie", "unexplained", "near-tie threshold", "verdict"]
    rows = [[arm, s.pairs, s.identical, s.near_ties, s.unexplained, fmt(s.threshold, ".3g"), s.verdict]
            for arm, s in section.arms.items()]  # fmt: skip
    if replayed:
        headers[3:6] = ["divergent", "near-tie (reproduced)", "unexplained", "margin threshold (info)"]
        for row, arm in zip(rows, section.arms.values(), strict=True):
            row.insert(3, _divergent(arm.divergent_pairs, arm.divergent_share))
    lines += md_table(headers, rows)
    if section.divergences:
        headers = ["arm", "case", "repeat", "position", "reference token", "spec token", "top-2 margin",
                   "target alone reproduces" if replayed else "target flips at width", "class"]  # fmt: skip
        how = replay_text if replayed else lambda d: d.flip_width or "—"
        lines += md_table(headers, [[d.arm, d.case_id, d.repeat_idx, d.position, d.reference_token, d.spec_token,
                                     fmt(d.margin, ".4g"), how(d), d.classification]
                                    for d in section.divergences])  # fmt: skip
        lines += [REPLAY_NOTE if replayed else FLIP_NOTE, ""]
    return lines


def replay_text(entry: DivergenceEntry) -> str:
    """How the target alone was made to reproduce a divergence, and what it emitted ("—": not examined)."""
    if entry.replay_round is not None:
        outcome = "yes" if entry.reproduced else "no"
        return f"{outcome}: round {entry.replay_round} (width {entry.replay_width}) → {entry.replayed_token}"
    if entry.flip_width:
        return f"yes: width scan {entry.flip_width}"
    return "—"


def _divergent(count: int | None, share: float | None) -> str:
    return "—" if count is None else f"{count} ({fmt(share, '.0%')})"


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
