"""``python -m spectoolkit.report DIR``: write the report of a finished run or of a sweep directory.

A run directory holds summary.json (report.md + plots/ are written beside it); any other directory
is read as a sweep whose runs lie up to three levels below it (Hydra multirun layout), and gets
sweep_report.md. User mistakes print one ``error:`` line and exit 1, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spectoolkit.bench.sweep.report import report_path_for
from spectoolkit.errors import SpecToolkitError, run_cli
from spectoolkit.path_checks import REPORT_DIR, check_path

HINT = REPORT_DIR.fix


def main(argv: list[str] | None = None) -> int:
    """Write the report for ``DIR``, print its path; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m spectoolkit.report", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="run directory (summary.json) or sweep directory")
    args = parser.parse_args(argv)
    return run_cli(lambda: print(_report(args.directory)))


def _report(directory: Path) -> Path:
    """The report written for ``directory``."""
    check_path("DIR", directory, REPORT_DIR)  # names what DIR must be
    try:
        return report_path_for(directory)
    except SpecToolkitError as exc:
        raise SpecToolkitError(f"{exc} ({HINT})") from None


if __name__ == "__main__":
    sys.exit(main())
