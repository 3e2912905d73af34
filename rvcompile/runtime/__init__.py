"""rvrun's runtime: `load(path)` checks and maps an artifact and returns a Model whose API
(generate, generate_stream, logits) is the same whatever target built it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.signature import TrustedKey, load_trusted_key
from rvcompile.runtime.model import GenerationResult, Model

__all__ = ["load", "Model", "GenerationResult", "ArtifactError"]


def load(path: str | os.PathLike[str], *, verify: bool = True,
         kv_blocks: dict[str, int] | None = None, max_num_seqs: int | None = None,
         max_model_len: int | None = None,
         trusted_keys: Sequence[TrustedKey | str | os.PathLike[str]] | None = None,
         trust_executables: bool = False) -> Model:
    """Open `path`, check its header and (by default) every section's sha256, then load it on
    this machine. Raises ArtifactError with a one-line message when it doesn't fit.
    `trusted_keys` (TrustedKeys or PEM public key files): refuse the artifact, before reading
    anything past its header block and digest table, unless one of them signed it (see
    rvcompile.artifacts.signature); the sections are then verified against the signed digests,
    so `verify=False` is refused with it.
    `kv_blocks` sizes the KV pools by kind (XLA artifacts; default: a whole sequence per decode
    slot); `max_num_seqs` and `max_model_len` cap the engine (default: the artifact's).
    `trust_executables`: load the artifact's precompiled XLA executables, which XLA runs
    unchecked like a program (runtime/executors/precompiled.py), so only from a file one of
    `trusted_keys` signed; by default the StableHLO is compiled."""
    if trust_executables and trusted_keys is None:
        raise ArtifactError(f"{Path(path).name}: trust_executables needs trusted_keys: XLA runs "
                            "an executable unchecked, so only a signer you trust may supply one")
    keys = None
    if trusted_keys is not None:
        if not verify:
            raise ArtifactError(f"{Path(path).name}: trusted_keys needs verify: a signature "
                                "vouches for the sections only through their digests")
        keys = [k if isinstance(k, TrustedKey) else load_trusted_key(k) for k in trusted_keys]
    art = Artifact.open(Path(path), trusted_keys=keys)
    runtime = art.header.requirements.get("runtime")
    if runtime == "h100":
        from rvcompile.runtime.executors.h100 import h100_executor, open_context

        ctx = open_context(art)  # refuses a machine that doesn't fit before reading weights
        if verify:
            art.verify()
        if kv_blocks:
            raise ArtifactError(f"{Path(path).name}: the KV pools of h100 artifacts are sized "
                                "at build; kv_blocks applies to XLA artifacts")
        return Model(art, h100_executor(art, ctx), max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len)
    if runtime != "xla":
        raise ArtifactError(f"{Path(path).name}: needs runtime {runtime!r}, which this rvrun "
                            "does not have")
    from rvcompile.runtime.engine import engine_limits
    from rvcompile.runtime.executors.xla import XlaExecutor, check_fits, kv_kinds

    check_fits(art, kv_blocks)
    xla = art.manifest["xla"]  # refuse impossible limits before compiling anything
    try:
        engine_limits(kv_kinds(art, kv_blocks), xla["kv"]["block_size"], xla["slots"],
                      xla["max_context"], max_num_seqs, max_model_len)
    except ValueError as e:
        raise ArtifactError(f"{Path(path).name}: {e}") from None
    if verify:
        art.verify()
    return Model(art, XlaExecutor(art, kv_blocks, trust_executables=trust_executables),
                 max_num_seqs=max_num_seqs, max_model_len=max_model_len)
