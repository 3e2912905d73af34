"""Saying, before it starts, that a start will compile XLA programs, and for about how long.

jax's persistent compilation cache (one directory per artifact's programs and jax version:
xla._cache_dir) holds an artifact's executables once it was compiled on this machine. A start
that finds fewer entries there than the artifact has programs is a first start: it says so in
one progress line with the expected time. The expectation is measured, not guessed: the
seconds per MiB of StableHLO of the last first start on this machine for the same platform and
jax version, kept in `first-compiles.json` beside the per-artifact directories; with none yet
the line says there is nothing to estimate from. After the compile its own rate is recorded
for the next artifact. The file is a cache like the directories: one that does not parse counts
as no record.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

LOG = "first-compiles.json"


@dataclass(frozen=True)
class Estimate:
    first: bool  # fewer cache entries than programs: this start compiles
    programs: int  # entry points the artifact has
    stablehlo_bytes: int  # of its programs section
    key: str  # platform and jax version: what a measured rate is valid for
    seconds: float | None  # expected compile time; None: nothing measured here yet
    basis: str  # what `seconds` rests on, in words
    log: Path  # where rates are kept

    def line(self) -> str:
        expect = (f"expected about {self.seconds:.0f} s ({self.basis})"
                  if self.seconds is not None else f"no estimate yet ({self.basis})")
        return (f"first start here: compiling {self.programs} XLA programs "
                f"({self.stablehlo_bytes / 2**20:.1f} MiB of StableHLO) for {self.key}, "
                f"{expect}; later starts load them from the cache")

    def record(self, seconds: float) -> None:
        """Keeps this compile's rate for the next first start (best effort: a cache)."""
        rates = _read(self.log)
        rates[self.key] = {"seconds": seconds, "stablehlo_bytes": self.stablehlo_bytes}
        tmp = self.log.with_name(f".{self.log.name}.tmp-{os.getpid()}")
        try:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(rates, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.log)
        except OSError:
            tmp.unlink(missing_ok=True)  # a read-only cache: the next start has no estimate


def _read(log: Path) -> dict:
    try:
        data = json.loads(log.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def compile_estimate(cache_dir: Path, stablehlo_bytes: int, programs: int,
                     key: str) -> Estimate:
    """Whether a start with `programs` programs of `stablehlo_bytes` compiles (by what
    `cache_dir` holds) and, if so, for about how long on this machine (`key`: platform and jax
    version)."""
    try:
        cached = sum(1 for p in cache_dir.iterdir() if p.name.endswith("-cache"))
    except OSError:
        cached = 0
    log = cache_dir.parent / LOG
    last = _read(log).get(key)
    seconds, basis = None, f"nothing compiled for {key} on this machine yet"
    if isinstance(last, dict) and isinstance(last.get("seconds"), (int, float)) and \
            isinstance(last.get("stablehlo_bytes"), int) and last["stablehlo_bytes"] > 0:
        rate = last["seconds"] / last["stablehlo_bytes"]
        seconds = rate * stablehlo_bytes
        basis = (f"measured: the last first start here compiled "
                 f"{last['stablehlo_bytes'] / 2**20:.1f} MiB in {last['seconds']:.0f} s")
    return Estimate(cached < programs, programs, stablehlo_bytes, key, seconds, basis, log)
