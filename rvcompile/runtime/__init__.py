"""rvrun's runtime: `load(path)` checks and maps an artifact and returns a Model whose API
(generate, generate_stream, logits) is the same whatever target built it."""

from __future__ import annotations

import os
from pathlib import Path

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.runtime.model import GenerationResult, Model

__all__ = ["load", "Model", "GenerationResult", "ArtifactError"]


def load(path: str | os.PathLike[str], *, verify: bool = True) -> Model:
    """Open `path`, check its header and (by default) every section's sha256, then load it on
    this machine. Raises ArtifactError with a one-line message when it doesn't fit."""
    art = Artifact.open(Path(path))
    runtime = art.header.requirements.get("runtime")
    if runtime == "h100":
        from rvcompile.runtime.h100_executor import h100_executor, open_context

        ctx = open_context(art)  # refuses a machine that doesn't fit before reading weights
        if verify:
            art.verify()
        return Model(art, h100_executor(art, ctx))
    if runtime != "xla":
        raise ArtifactError(f"{Path(path).name}: needs runtime {runtime!r}, which this rvrun "
                            "does not have")
    from rvcompile.runtime.xla_executor import XlaExecutor, check_fits

    check_fits(art)
    if verify:
        art.verify()
    return Model(art, XlaExecutor(art))
