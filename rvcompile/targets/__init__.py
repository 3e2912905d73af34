"""Build targets, as plugins of one interface (targets/api.py). Each family's module lists its
targets in `TARGETS`; the registry imports the families named in FAMILIES, and nothing else in
the compiler names a target. A family's heavy dependencies (jax, nvcc) load only when one of its
targets lowers or summarizes."""

from __future__ import annotations

import importlib

from rvcompile.sources.model_source import CheckpointError
from rvcompile.targets.api import Target

FAMILIES = ("rvcompile.targets.xla.target", "rvcompile.targets.h100.target")


def registry() -> dict[str, Target]:
    """Every target by name, in the families' order."""
    out: dict[str, Target] = {}
    for family in FAMILIES:
        for target in importlib.import_module(family).TARGETS:
            if target.name in out:
                raise RuntimeError(f"target {target.name} is registered twice ({family})")
            out[target.name] = target
    return out


def get_target(name: str) -> Target:
    """The target called `name`; CheckpointError (one line) naming the known ones otherwise."""
    targets = registry()
    if name not in targets:
        raise CheckpointError(f"unknown target {name!r} (known: {', '.join(targets)})")
    return targets[name]


def input_errors() -> tuple[type[Exception], ...]:
    """What the targets raise for input they refuse (a one-line message), beyond the build's
    own CheckpointError, ConfigError and SpecError."""
    return tuple({e: None for t in registry().values() for e in t.input_errors})
