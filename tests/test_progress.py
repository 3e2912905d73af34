"""progress.Phases: what a long command shows in each mode (fake clock: exact lines)."""

from __future__ import annotations

import io

import pytest

from rvcompile.progress import Phases


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _phases(mode: str, every_s: float = 10.0):
    lines: list[str] = []
    clock = Clock()
    return Phases("tool", mode, write=lines.append, every_s=every_s, clock=clock), lines, clock


def test_lines_mode_one_line_per_finished_phase():
    ph, lines, clock = _phases("lines")
    with ph.phase("read"):
        clock.t += 1.25
    with ph.phase("write", total=3 * 2**20, unit="B") as p:
        for _ in range(3):
            clock.t += 0.5
            p.advance(2**20)
    assert lines == ["tool: read done in 1.2 s", "tool: write done in 1.5 s"]
    assert ph.done == [("read", 1.25), ("write", 1.5)]


def test_lines_mode_reports_a_long_countable_phase_every_interval():
    ph, lines, clock = _phases("lines", every_s=10.0)
    with ph.phase("windows", total=4) as p:
        for i in range(4):
            clock.t += 6.0
            p.advance(1, info=f"perplexity {10 - i:.2f}")
    assert lines == ["tool: windows 2/4 (perplexity 9.00)",
                     "tool: windows done in 24.0 s (perplexity 7.00)"]


def test_bytes_shown_in_mib():
    ph, lines, clock = _phases("lines", every_s=0.0)
    with ph.phase("hash", total=4 * 2**20, unit="B") as p:
        clock.t += 1
        p.advance(2**20)
    assert lines[0] == "tool: hash 1.0 MiB/4.0 MiB"


def test_off_mode_prints_nothing_but_times():
    ph, lines, clock = _phases("off")
    with ph.phase("read", total=2) as p:
        clock.t += 2
        p.advance(2)
    assert lines == [] and ph.done == [("read", 2.0)]


def test_a_failed_phase_prints_no_done_line():
    ph, lines, _ = _phases("lines")
    with pytest.raises(RuntimeError), ph.phase("read"):
        raise RuntimeError("bad")
    assert lines == [] and ph.done == []


def test_live_mode_draws_a_bar_with_eta_then_the_done_line():
    lines: list[str] = []
    clock, term = Clock(), io.StringIO()
    ph = Phases("tool", "live", write=lines.append, clock=clock, stream=term)
    ph.width = 80  # whatever the terminal running the tests
    with ph.phase("compile", total=4) as p:
        clock.t += 3
        p.advance(1)
        clock.t += 3
        p.advance(1, info="x")
    assert lines == ["tool: compile done in 6.0 s (x)"]
    drawn = term.getvalue().split("\r")
    assert drawn[1] == "tool: compile [........................] 0/4 ETA ?\x1b[K"
    assert drawn[2] == "tool: compile [######..................] 1/4 ETA 0:09\x1b[K"
    assert drawn[3] == "tool: compile [############............] 2/4 (x) ETA 0:06\x1b[K"
    assert drawn[-1] == "\x1b[K"  # the line cleared before the done line
    ph.width = 40  # a narrow terminal: the bar gives way to the count and the ETA
    with ph.phase("compile", total=4) as p:
        p.advance(2)
    assert term.getvalue().split("\r")[-2] == f"tool: compile [{'.' * 13}] 0/4 ETA ?\x1b[K"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_mode_for():
    assert Phases.mode_for(False, _Tty()) == "off"
    assert Phases.mode_for(True, _Tty()) == "live"
    assert Phases.mode_for(True, io.StringIO()) == "lines"
    with pytest.raises(ValueError, match="progress mode"):
        Phases("x", "loud")
