"""Activation memory planning: give every temporary buffer of an entry point's launch list an
offset so that buffers whose lifetimes overlap never share bytes, reusing memory otherwise.

A buffer lives from the first launch that touches it to the last. Buffers are placed largest
first at the lowest offset that conflicts with no already-placed, overlapping buffer (the
usual greedy-by-size heuristic); every offset is ALIGN-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 256


@dataclass(frozen=True)
class Lifetime:
    buffer: int
    nbytes: int
    first: int  # index of the first launch that uses it
    last: int  # index of the last


def align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def lifetimes(uses: list[tuple[int, ...]], sizes: dict[int, int]) -> list[Lifetime]:
    """uses[i]: the buffers launch i touches."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, bufs in enumerate(uses):
        for b in bufs:
            first.setdefault(b, i)
            last[b] = i
    return [Lifetime(b, sizes[b], first[b], last[b]) for b in first]


def plan(lives: list[Lifetime]) -> tuple[dict[int, int], int]:
    """(offset per buffer, total bytes)."""
    placed: list[tuple[int, int, Lifetime]] = []  # (start, end, lifetime)
    offsets: dict[int, int] = {}
    for life in sorted(lives, key=lambda x: (-x.nbytes, x.first, x.buffer)):
        size = align(life.nbytes)
        busy = sorted((s, e) for s, e, o in placed
                      if o.first <= life.last and life.first <= o.last)
        offset = 0
        for s, e in busy:
            if offset + size <= s:
                break
            offset = max(offset, e)
        offsets[life.buffer] = offset
        placed.append((offset, offset + size, life))
    total = max((e for _, e, _ in placed), default=0)
    return offsets, total


def check(lives: list[Lifetime], offsets: dict[int, int]) -> None:
    """Raise if two overlapping lifetimes share bytes (the planner's invariant)."""
    for i, a in enumerate(lives):
        for b in lives[i + 1:]:
            if a.first <= b.last and b.first <= a.last:
                a0, b0 = offsets[a.buffer], offsets[b.buffer]
                if a0 < b0 + b.nbytes and b0 < a0 + a.nbytes:
                    raise AssertionError(f"buffers {a.buffer} and {b.buffer} overlap")
