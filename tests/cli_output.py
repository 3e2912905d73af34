"""What a CLI wrote to stderr, less its progress: with stderr not a terminal, `rvcompile` and
`rvrun` print one line per finished phase (`PROG: PHASE done in 1.2 s`, rvcompile/progress.py)
and, while a countable phase runs long (a slow or loaded machine), `PROG: PHASE 3/6 (info)` every
10 s, before any error; a first XLA start's note that it compiles, and once loaded the two lines
of its load report. Tests of the one-line error rule set all of them aside with
`without_progress`."""

from __future__ import annotations

import re


def is_progress(line: str) -> bool:
    """A phase line (finished or running), one of the two lines of rvrun's load report
    (runtime/load_report.py), or the note of a first start that compiles
    (runtime/executors/compile_estimate.py)."""
    done = r"(rvcompile|rvrun): [\w /+.-]+ done in \d+\.\d s( \(.*\))?"
    running = r"(rvcompile|rvrun): [\w /+.-]+ [\d,.]+( MiB)?/[\d,.]+( MiB)?( \(.*\))?"
    load = re.match(r"rvrun: (load \d+\.\d\d s \(|weights \d|first start here: )", line)
    return (re.fullmatch(done, line) is not None or re.fullmatch(running, line) is not None
            or load is not None)


def without_progress(stderr: str) -> list[str]:
    """stderr's lines (stripped of surrounding blank space), phase lines left out."""
    return [line for line in stderr.strip().splitlines() if not is_progress(line)]
