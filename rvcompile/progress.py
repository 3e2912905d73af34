"""Phases of a long command, shown to the person running it: a build, rvrun's load, `rvrun ppl`,
a server's start. A leaf: imports nothing of rvcompile, so the compiler and the runtime share it.

    phases = Phases("rvcompile", Phases.mode_for(enabled=True))
    with phases.phase("quantize + write", total=nbytes, unit="B") as p:
        for t in tensors:
            ...
            p.advance(t.nbytes)
    with phases.phase("passes"):
        ...

Modes:
- "live" (stderr is a terminal): the running phase as one line redrawn in place, with a bar,
  its count and an ETA when it has a total, replaced when it ends by the line below (drawn
  here, not with rich: the slim runtime installs do not have it);
- "lines" (stderr is a file or a pipe: CI logs, journald): `PREFIX: NAME done in 1.2 s` for
  every finished phase and, while a phase with a total runs, `PREFIX: NAME 3/40 (info)` at most
  every `every_s` seconds;
- "off": nothing.
Lines go to `write` (default: stderr), one call per line. A phase that raises prints nothing
more: the error that follows says what happened. `done` lists (name, seconds) of the finished
phases.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, TextIO

Mode = Literal["live", "lines", "off"]
BAR = 24  # characters of the live bar


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _amount(n: float, unit: str) -> str:
    return f"{n / 2**20:,.1f} MiB" if unit == "B" else f"{n:,.0f}"


class Phase:
    """The running phase: advance(n) as its countable work gets done."""

    def __init__(self, phases: Phases, name: str, total: float | None, unit: str) -> None:
        self._phases, self.name, self.total, self.unit = phases, name, total, unit
        self.completed = 0.0
        self.info = ""
        self.started = self._last_line = phases.clock()
        self._drawn = -1.0  # when live mode last drew the line

    def advance(self, n: float = 1, info: str = "") -> None:
        """`n` more units done; `info` (e.g. a running perplexity) is shown beside the count."""
        self.completed += n
        self.info = info or self.info
        ph = self._phases
        if ph.mode == "live":
            ph._draw(self, ph.clock())
        elif ph.mode == "lines" and self.total is not None:
            now = ph.clock()
            if now - self._last_line >= ph.every_s and self.completed < self.total:
                self._last_line = now
                ph.write(f"{ph.prefix}: {self.status()}")

    def set_total(self, total: float) -> None:
        """The phase's total, once it is known."""
        self.total = total

    def status(self) -> str:
        """`NAME 3/40 (info)`: what the lines mode prints while the phase runs."""
        of = f"/{_amount(self.total, self.unit)}" if self.total is not None else ""
        info = f" ({self.info})" if self.info else ""
        return f"{self.name} {_amount(self.completed, self.unit)}{of}{info}"


class Phases:
    def __init__(self, prefix: str, mode: Mode, *, write: Callable[[str], None] = _stderr,
                 every_s: float = 10.0, clock: Callable[[], float] = time.perf_counter,
                 stream: TextIO | None = None) -> None:
        """`stream`: the live line's terminal (default stderr)."""
        if mode not in ("live", "lines", "off"):
            raise ValueError(f"progress mode {mode!r}: expected live, lines or off")
        self.prefix, self.mode, self.write = prefix, mode, write
        self.every_s, self.clock = every_s, clock
        self.stream = stream or sys.stderr
        self.width = shutil.get_terminal_size().columns
        self.done: list[tuple[str, float]] = []

    def note(self, text: str) -> None:
        """One line `PREFIX: text` (what is about to happen and why it takes long), in the live
        and lines modes; nothing when off."""
        if self.mode != "off":
            self.write(f"{self.prefix}: {text}")

    @staticmethod
    def mode_for(enabled: bool, stream=None) -> Mode:
        """"off" unless enabled; "live" when `stream` (default stderr) is a terminal."""
        if not enabled:
            return "off"
        stream = sys.stderr if stream is None else stream
        return "live" if stream.isatty() else "lines"

    @contextmanager
    def phase(self, name: str, total: float | None = None, unit: str = "") -> Iterator[Phase]:
        """Time the block as phase `name`; `total`: its countable work (a bar and ETA), in
        `unit` ("B": bytes, shown in MiB; "": a count)."""
        p = Phase(self, name, total, unit)
        t0 = p.started
        if self.mode == "live":
            self._draw(p, t0)
            try:
                yield p
            finally:
                self._clear()
        else:
            yield p
        seconds = self.clock() - t0
        self.done.append((name, seconds))
        if self.mode != "off":
            info = f" ({p.info})" if p.info else ""
            self.write(f"{self.prefix}: {name} done in {seconds:.1f} s{info}")

    def _draw(self, p: Phase, now: float) -> None:
        """Live mode: redraw the phase's line in place (at most 10 times a second)."""
        if now - p._drawn < 0.1 and p.completed < (p.total or 0):
            return
        p._drawn = now
        line = f"{self.prefix}: {p.name}"
        if p.total:
            frac = min(1.0, p.completed / p.total)
            eta = (now - p.started) * (1 - frac) / frac if frac > 0 else None
            rest = (f" {p.status()[len(p.name) + 1:]} ETA "
                    f"{'?' if eta is None else _clock_time(eta)}")
            width = min(BAR, self.width - 1 - len(line) - len(rest) - 3)  # the bar gives way
            if width >= 5:
                filled = int(frac * width)
                line += f" [{'#' * filled}{'.' * (width - filled)}]"
            line += rest
        else:
            line += " ..."
        self.stream.write(f"\r{line[:self.width - 1]}\x1b[K")
        self.stream.flush()

    def _clear(self) -> None:
        self.stream.write("\r\x1b[K")
        self.stream.flush()


def _clock_time(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"
