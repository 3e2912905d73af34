"""rvrun's runtime: `load(path)` checks and maps an artifact and returns a Model whose API
(generate, generate_stream, logits) is the same whatever target built it. The executor comes
from the module of the artifact's runtime kind (RUNTIMES), which alone knows that kind's
manifest part, machine checks and devices; this module imports none of them."""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.signature import TrustedKey, load_trusted_key
from rvcompile.runtime.executor_api import Executor, LoadOptions
from rvcompile.runtime.model import GenerationResult, Model

__all__ = ["load", "Model", "GenerationResult", "ArtifactError", "RUNTIMES"]

# Runtime kind (an artifact's requirements["runtime"]) -> the executor module that opens its
# artifacts with `open_executor(art, LoadOptions) -> Executor`. The install extra of the same
# name brings what the module imports.
RUNTIMES = {
    "xla": "rvcompile.runtime.xla_executor",
    "h100": "rvcompile.runtime.h100_executor",
}


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
    unchecked like a program (runtime/precompiled.py), so only from a file one of
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
    try:
        executor = open_executor(art, LoadOptions(verify, kv_blocks, max_num_seqs, max_model_len,
                                                  trust_executables))
        return Model(art, executor, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    except BaseException:
        art.close()
        raise


def open_executor(art: Artifact, opts: LoadOptions) -> Executor:
    """The executor of the runtime kind `art` requires, from the module RUNTIMES names (imported
    only now: an h100 host never imports jax). ArtifactError for a kind this rvrun lacks, or one
    whose dependencies are not installed (naming the extra that brings them)."""
    kind = art.header.requirements.get("runtime")
    if kind not in RUNTIMES:
        raise ArtifactError(f"{art.path.name}: needs runtime {kind!r}, which this rvrun does not "
                            f"have (it has {', '.join(RUNTIMES)})")
    try:
        module = importlib.import_module(RUNTIMES[kind])
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "rvcompile":
            raise
        raise ArtifactError(f"{art.path.name}: the {kind} runtime needs {e.name}, which is not "
                            f"installed (pip install 'rvcompile[{kind}]')") from None
    return module.open_executor(art, opts)
