"""Tokenizer compatibility of a target/draft pair, checked before any speculative decoding.

Speculative decoding compares draft and target distributions id by id (DESIGN §1), so both models
must map every id the draft may propose to the same text, and must agree on the special tokens,
on how text and chat prompts become ids. We collect *every* mismatch, not just the first, so one
run tells the user everything to fix.

Model vocabularies (embedding rows, ``config.vocab_size``) may exceed ``len(tokenizer)``: the
tail is padding with no text. A pair with identical real vocabularies but different padding is
compatible; ids at or past ``shared_vocab_size`` are masked out of the draft distribution.

``python -m spectoolkit.compat TARGET DRAFT`` (each a local HF directory, a hub id, ``embedded``, a
``.gguf`` file or a model ``make pair`` assembles) prints ``compatible`` (exit 0) or the list of mismatches (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spectoolkit.checkpoints import Checkpoint, resolve_checkpoint
from spectoolkit.errors import SpecToolkitError, first_line, run_cli

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

MAX_LISTED = 5  # differing ids / extra tokens shown per mismatch line
SPECIAL_TOKEN_NAMES = ("bos", "eos", "pad", "unk")
PROBES: tuple[tuple[str, str], ...] = (
    ("code", 'def mean(values):\n    """Average of values."""\n    if not values:\n        return 0.0\n'),
    ("json", '{"name": "spec", "ids": [1, 2, 3], "nested": {"ok": true, "pi": 3.14, "s": null}}'),
    ("non-ascii", "naïve café 日本語 🙂 Ünïcödé — «quotes»"),
    ("whitespace", "a    b\n\n\t c  \n\n\n    d\t\t"),
)
CHAT_PROBE = (
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
)


@dataclass
class CompatReport:
    """Outcome of a compatibility check; empty ``mismatches`` means the pair may be used."""

    mismatches: list[str] = field(default_factory=list)  # one human-readable line each
    warnings: list[str] = field(default_factory=list)  # harmless differences worth knowing
    shared_vocab_size: int = 0  # the draft may propose ids [0, shared_vocab_size)

    @property
    def compatible(self) -> bool:
        return not self.mismatches

    def message(self) -> str:
        """A multi-line message: verdict, each mismatch, then each warning."""
        if self.compatible:
            lines = [f"compatible (shared vocabulary: ids 0..{self.shared_vocab_size - 1})"]
        else:
            count = len(self.mismatches)
            noun = "mismatch" if count == 1 else "mismatches"
            lines = [f"incompatible: {count} {noun} between target and draft:"]
            lines += [f"  - {line}" for line in self.mismatches]
        if self.warnings:
            lines.append("warnings:")
            lines += [f"  - {line}" for line in self.warnings]
        return "\n".join(lines)


def check_compat(
    target_tokenizer: Tokenizer,
    draft_tokenizer: Tokenizer,
    target_vocab_size: int,
    draft_vocab_size: int,
) -> CompatReport:
    """Compare two loaded tokenizers; ``*_vocab_size`` are the models' embedding rows.

    Checks vocabulary sizes, the text of every shared id, BOS/EOS/PAD/UNK, added tokens, the ids of
    probe strings (code, JSON, non-ASCII, whitespace runs) and the rendered chat template.
    """
    report = CompatReport(shared_vocab_size=min(target_vocab_size, draft_vocab_size))
    pair = (target_tokenizer, draft_tokenizer)
    _check_vocab_sizes(*pair, target_vocab_size, draft_vocab_size, report)
    _check_token_texts(*pair, report)
    _check_special_tokens(*pair, report)
    _check_added_tokens(*pair, report)
    _check_probes(*pair, report)
    _check_chat_template(*pair, report)
    return report


def _check_vocab_sizes(
    target: Tokenizer, draft: Tokenizer, target_rows: int, draft_rows: int, report: CompatReport
) -> None:
    target_len, draft_len = len(target), len(draft)
    for side, tokenizer_len, rows in (("target", target_len, target_rows), ("draft", draft_len, draft_rows)):
        if rows < tokenizer_len:
            report.mismatches.append(
                f"{side} model has {rows} embedding rows but its tokenizer has {tokenizer_len} tokens "
                f"(ids >= {rows} cannot be embedded)"
            )
    if target_len != draft_len:
        side, larger = ("target", target) if target_len > draft_len else ("draft", draft)
        extra_ids = list(range(min(target_len, draft_len), max(target_len, draft_len)))
        listed = _list_ids(extra_ids, larger.convert_ids_to_tokens(extra_ids[:MAX_LISTED]))
        report.mismatches.append(
            f"vocabulary size: target tokenizer has {target_len} tokens, draft has {draft_len}; "
            f"{_count(len(extra_ids), f'extra {side} id')}: {listed}"
        )
    elif target_rows != draft_rows:
        report.warnings.append(
            f"model vocabulary padded at the tail: target has {target_rows} embedding rows, draft "
            f"{draft_rows}, both tokenizers {target_len} tokens; ids >= {report.shared_vocab_size} "
            "are padding and are masked out of the draft distribution"
        )


def _check_token_texts(target: Tokenizer, draft: Tokenizer, report: CompatReport) -> None:
    num_shared = min(len(target), len(draft))
    ids = list(range(num_shared))
    target_texts = target.convert_ids_to_tokens(ids)
    draft_texts = draft.convert_ids_to_tokens(ids)
    differing = [i for i, (a, b) in enumerate(zip(target_texts, draft_texts, strict=True)) if a != b]
    if differing:
        shown = "; ".join(
            f"id {i}: {_text(target_texts[i])} vs {_text(draft_texts[i])}" for i in differing[:MAX_LISTED]
        )
        more = ", ..." if len(differing) > MAX_LISTED else ""
        report.mismatches.append(
            f"token text differs for {len(differing)} of {num_shared} shared ids (target vs draft): {shown}{more}"
        )


def _check_special_tokens(target: Tokenizer, draft: Tokenizer, report: CompatReport) -> None:
    for name in SPECIAL_TOKEN_NAMES:
        target_token, draft_token = _special_token(target, name), _special_token(draft, name)
        if target_token != draft_token:
            report.mismatches.append(
                f"{name} token ({name}_token): target {_describe_special(target_token)} "
                f"vs draft {_describe_special(draft_token)}"
            )


def _special_token(tokenizer: Tokenizer, name: str) -> tuple[int | None, str | None]:
    text = getattr(tokenizer, f"{name}_token", None)
    return getattr(tokenizer, f"{name}_token_id", None), None if text is None else str(text)


def _describe_special(token: tuple[int | None, str | None]) -> str:
    token_id, text = token
    return "none" if token_id is None and text is None else f"id {token_id} {_text(text)}"


def _check_added_tokens(target: Tokenizer, draft: Tokenizer, report: CompatReport) -> None:
    target_added, draft_added = _added_tokens(target), _added_tokens(draft)
    differing = sorted(i for i in target_added.keys() | draft_added.keys() if target_added.get(i) != draft_added.get(i))
    if differing:
        shown = "; ".join(
            f"id {i}: {_describe_added(target_added.get(i))} vs {_describe_added(draft_added.get(i))}"
            for i in differing[:MAX_LISTED]
        )
        more = ", ..." if len(differing) > MAX_LISTED else ""
        report.mismatches.append(
            f"added/special tokens differ at {_count(len(differing), 'id')} (target vs draft): {shown}{more}"
        )


def _added_tokens(tokenizer: Tokenizer) -> dict[int, tuple[str, bool]]:
    return {i: (str(token.content), bool(token.special)) for i, token in tokenizer.added_tokens_decoder.items()}


def _describe_added(entry: tuple[str, bool] | None) -> str:
    if entry is None:
        return "absent"
    content, special = entry
    return f"{_text(content)} (special)" if special else f"{_text(content)} (not special)"


def _check_probes(target: Tokenizer, draft: Tokenizer, report: CompatReport) -> None:
    cases = [(name, text, False) for name, text in PROBES]
    # One probe again with special tokens: catches a BOS/EOS that only one tokenizer adds.
    cases.append((f"{PROBES[0][0]}, special tokens added", PROBES[0][1], True))
    for name, text, add_special in cases:
        target_ids = target.encode(text, add_special_tokens=add_special)
        draft_ids = draft.encode(text, add_special_tokens=add_special)
        if target_ids != draft_ids:
            report.mismatches.append(f"probe {name!r}: {_describe_ids_diff(target, draft, target_ids, draft_ids)}")


def _check_chat_template(target: Tokenizer, draft: Tokenizer, report: CompatReport) -> None:
    has_target, has_draft = bool(target.chat_template), bool(draft.chat_template)
    if not (has_target or has_draft):
        return
    if has_target != has_draft:
        side = "target" if has_target else "draft"
        report.mismatches.append(f"chat template: only the {side} tokenizer has one")
        return
    target_text, draft_text = _render_chat(target), _render_chat(draft)
    if isinstance(target_text, Exception) or isinstance(draft_text, Exception):
        _report_chat_errors(target_text, draft_text, report)
    elif target_text != draft_text:
        pos = _first_difference(target_text, draft_text)
        window = slice(max(0, pos - 20), pos + 30)
        report.mismatches.append(
            f"chat template renders differently from character {pos}: "
            f"target ...{_text(target_text[window])} vs draft ...{_text(draft_text[window])}"
        )
    else:
        target_ids = target.encode(target_text, add_special_tokens=False)
        draft_ids = draft.encode(draft_text, add_special_tokens=False)
        if target_ids != draft_ids:
            diff = _describe_ids_diff(target, draft, target_ids, draft_ids)
            report.mismatches.append(f"chat template: the rendered prompt encodes differently: {diff}")


def _render_chat(tokenizer: Tokenizer) -> str | Exception:
    try:
        return tokenizer.apply_chat_template(list(CHAT_PROBE), tokenize=False)
    except Exception as exc:  # a chat template is arbitrary Jinja from the checkpoint; any failure is data
        return exc


def _report_chat_errors(target_text: str | Exception, draft_text: str | Exception, report: CompatReport) -> None:
    if isinstance(target_text, Exception) and isinstance(draft_text, Exception):
        report.warnings.append(f"chat template: neither tokenizer renders the probe conversation ({target_text})")
        return
    side, error = ("target", target_text) if isinstance(target_text, Exception) else ("draft", draft_text)
    report.mismatches.append(f"chat template: only the {side} tokenizer fails on the probe conversation: {error}")


def _describe_ids_diff(target: Tokenizer, draft: Tokenizer, target_ids: list[int], draft_ids: list[int]) -> str:
    pos = _first_difference(target_ids, draft_ids)
    target_part = target_ids[pos : pos + 3]
    draft_part = draft_ids[pos : pos + 3]
    return (
        f"ids differ from position {pos} ({len(target_ids)} vs {len(draft_ids)} tokens): "
        f"target [{_list_ids(target_part, target.convert_ids_to_tokens(target_part), limit=3)}] "
        f"vs draft [{_list_ids(draft_part, draft.convert_ids_to_tokens(draft_part), limit=3)}]"
    )


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _list_ids(ids: list[int], texts: list[str | None], limit: int = MAX_LISTED) -> str:
    shown = ", ".join(f"{i} {_text(text)}" for i, text in zip(ids[:limit], texts[:limit], strict=True))
    return shown + (", ..." if len(ids) > limit else "")


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _text(text: str | None, limit: int = 60) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def check_pair(target: Checkpoint, draft: Checkpoint) -> CompatReport:
    """Load both checkpoints' tokenizers and configs (resolved once: :func:`~spectoolkit.checkpoints.
    resolve_checkpoint`) and compare them."""
    target_tokenizer, target_vocab_size = _load(target, "target")
    draft_tokenizer, draft_vocab_size = _load(draft, "draft")
    return check_compat(target_tokenizer, draft_tokenizer, target_vocab_size, draft_vocab_size)


def _load(checkpoint: Checkpoint, role: str) -> tuple[Tokenizer, int]:
    """The tokenizer and vocabulary size of ``checkpoint`` (errors name its spec, as configured)."""
    from transformers import AutoConfig, AutoTokenizer

    source, spec = checkpoint.location, checkpoint.spec or "embedded"

    # Loading reads user files (or the hub); whatever fails there is a user problem, not a bug.
    try:
        config = AutoConfig.from_pretrained(source)
    except Exception as exc:
        raise SpecToolkitError(
            f"could not load the {role} config from {spec!r}: {first_line(exc, with_type=True)}"
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        raise SpecToolkitError(
            f"could not load the {role} tokenizer from {spec!r}: {first_line(exc, with_type=True)}"
        ) from exc
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab_size, int):
        raise SpecToolkitError(f"the {role} config from {spec!r} has no integer vocab_size")
    return tokenizer, vocab_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spectoolkit.compat",
        description="Check that a target and a draft model share a tokenizer.",
    )
    parser.add_argument("target", help="local HF directory, .gguf file, hub id, or 'embedded'")
    parser.add_argument("draft", help="local HF directory, .gguf file, hub id, or 'embedded'")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors: argparse already printed them
        return exc.code if isinstance(exc.code, int) else 1

    def work() -> int:
        report = check_pair(resolve_checkpoint(args.target), resolve_checkpoint(args.draft))
        print(report.message(), file=sys.stdout if report.compatible else sys.stderr)
        return 0 if report.compatible else 1

    return run_cli(work)


if __name__ == "__main__":
    sys.exit(main())
