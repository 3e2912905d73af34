"""What a CLI wrote to stderr, less its progress: with stderr not a terminal, `rvcompile` and
`rvrun` print one line per finished phase (`PROG: PHASE done in 1.2 s`, rvcompile/progress.py)
before any error, a first XLA start's note that it compiles, and once loaded the two lines of
its load report, which tests of the one-line error rule set aside with `without_progress`."""

from __future__ import annotations

import re


def is_progress(line: str) -> bool:
    """A phase line, one of the two lines of rvrun's load report (runtime/load_report.py), or
    the note of a first start that compiles (runtime/executors/compile_estimate.py)."""
    phase = re.fullmatch(r"(rvcompile|rvrun): [\w /+.-]+ done in \d+\.\d s( \(.*\))?", line)
    load = re.match(r"rvrun: (load \d+\.\d\d s \(|weights \d|first start here: )", line)
    return phase is not None or load is not None


def without_progress(stderr: str) -> list[str]:
    """stderr's lines (stripped of surrounding blank space), phase lines left out."""
    return [line for line in stderr.strip().splitlines() if not is_progress(line)]
