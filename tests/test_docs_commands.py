"""Every command the README and the reference (docs/) show still composes against the shipped configs.

Each ``python -m spectoolkit``, ``python -m spectoolkit.serve`` and ``python -m spectoolkit.train_draft`` line
of a code block (continuation lines joined, comments and shell plumbing cut off) is composed with Hydra's
compose API — every value of a ``-m`` sweep in turn — then turned into the typed config and judged by the
checks the CLI runs on its command line (:func:`spectoolkit.config_checks.check_config`: a key with no effect
is an error). Paths are not checked (the examples name machines' paths) and no model is loaded.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from spectoolkit.__main__ import config_from_hydra
from spectoolkit.config_checks import check_config, override_keys
from spectoolkit.errors import SpecToolkitError
from spectoolkit.training.job import train_config_from_dict

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# program -> its primary config; spectoolkit.report, .compat, .embedded, .pair are argparse, not Hydra
PROGRAMS = {"spectoolkit": "config", "spectoolkit.serve": "config", "spectoolkit.train_draft": "train_draft"}
COMMAND = re.compile(r"python -m (spectoolkit(?:\.serve|\.train_draft)?)(?=\s|$)(.*)")
FENCE = re.compile(r"^```.*?$(.*?)^```", re.MULTILINE | re.DOTALL)
INDENTED = re.compile(r"(?:^(?: {4}|\t)\S.*\n?)+", re.MULTILINE)  # a Markdown indented code block
SHELL_END = re.compile(r"\s(?:#|&&|\|\||[|;&])(?:\s|$)|\s&$")  # a comment or the next command starts


def code_lines(text: str) -> list[str]:
    """The lines of ``text``'s code blocks, continuation lines (a trailing backslash) joined."""
    blocks = FENCE.findall(text) + INDENTED.findall(FENCE.sub("", text))
    return [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def commands_in(text: str) -> list[tuple[str, str, list[str]]]:
    """(line, program, overrides) of every Hydra command in ``text``'s code blocks."""
    found = []
    for line in code_lines(text):
        for match in COMMAND.finditer(line):
            rest = SHELL_END.split(f" {match.group(2)} ", maxsplit=1)[0]
            words = [word for word in shlex.split(rest) if word != "-m"]  # -m: multirun
            found.append((line, match.group(1), words))
    return found


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(where, program, overrides) of every Hydra command the pages show."""
    return [(f"{page.name}: {line}", program, words)
            for page in PAGES for line, program, words in commands_in(page.read_text(encoding="utf-8"))]  # fmt: skip


def single_runs(overrides: list[str]) -> list[list[str]]:
    """A sweep's command line as its single jobs (every combination of the swept values)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override, text in zip(parsed, overrides, strict=True):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(run) for run in itertools.product(*choices)]


COMMANDS = shown_commands()


def test_the_pages_show_commands() -> None:
    programs = {program for _, program, _ in COMMANDS}
    assert programs == set(PROGRAMS) and len(COMMANDS) > 40, programs
    assert any(where.startswith("README.md") for where, _, _ in COMMANDS)


@pytest.mark.parametrize(("where", "program", "overrides"), COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_a_shown_command_composes_and_passes_the_cli_checks(
    where: str, program: str, overrides: list[str], tmp_path: Path
) -> None:
    for run in single_runs(overrides):
        with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
            cfg = compose(config_name=PROGRAMS[program], overrides=[f"output_dir={tmp_path}", *run])
        values = OmegaConf.to_container(cfg, resolve=True)
        if program == "spectoolkit.train_draft":
            train_config_from_dict(values.pop("train"))
            config_from_hydra(OmegaConf.create(values))
            continue
        entry = "serve" if program == "spectoolkit.serve" else "run"
        check_config(config_from_hydra(cfg), override_keys(run), entry)


def test_the_extraction_joins_continuations_and_cuts_shell_plumbing() -> None:
    text = "```bash\nmake vllm && python -m spectoolkit -m a=1,2 \\\n    'b=[3]'  # note\n"
    text += "python -m spectoolkit.report x\n```\n"
    text += "\n    python -m spectoolkit.serve c=4 &\n"  # an indented code block
    assert [(program, words) for _, program, words in commands_in(text)] == [
        ("spectoolkit", ["a=1,2", "b=[3]"]), ("spectoolkit.serve", ["c=4"])]  # fmt: skip
    assert single_runs(["a=1,2", "b=3"]) == [["a=1", "b=3"], ["a=2", "b=3"]]


@pytest.mark.parametrize(
    ("program", "overrides"),
    [("spectoolkit", ["speculate.gama=4"]), ("spectoolkit", ["+target=int5"]),
     ("spectoolkit", ["serve.max_num_seqs=4"]), ("spectoolkit", ["server.port=8001"])],
)  # fmt: skip
def test_a_stale_command_fails(program: str, overrides: list[str], tmp_path: Path) -> None:
    """A renamed key, a missing option, and a key with no effect in that program (the CLI's own error)."""
    with pytest.raises((ConfigCompositionException, SpecToolkitError)):
        test_a_shown_command_composes_and_passes_the_cli_checks("stale", program, overrides, tmp_path)
