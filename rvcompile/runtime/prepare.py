"""`rvrun prepare ART`: compile an XLA artifact's programs once on this machine and keep the
executables next to it (`ART.prepared`), so later starts load them instead of compiling.

The cache is itself a .rvp container (artifacts/container.py: header, piece digests, JSON
manifest) with one section, "executables", holding a set as artifacts/xla_executables.py
serializes it for the build's TPU topologies: XLA's own bytes and a JSON description of each
entry's operands, no pickle; runtime/executors/precompiled.py loads it the same way (no
compilation, operands checked against the artifact's exported programs and the loaded
executable). Its manifest:

    {"prepared": {"format": 1, "artifact": NAME, "artifact_id": HEX, "set": RECORD}}

`artifact_id` is the sha256 of the artifact's header block and piece-digest table, which
change with any byte of its sections or manifest: a cache prepared for another file, or for an
earlier build at the same path, never loads. RECORD is the set's record (platform, device kind,
device ids and coordinates, jax, jaxlib and libtpu versions, KV block counts, and per entry its
sha256, offset, size and operands).

XLA runs a loaded executable unchecked (as it does those in jax's persistent compilation
cache), so the file must be the operator's own: owned by this user and writable by no one else.
`find_prepared` refuses, in one line saying why, a cache that is not, or that does not match
the artifact, this machine (precompiled.mismatch: platform, device kind and ids, jax, jaxlib,
libtpu) or the KV pools the load asks for; the executor then compiles the StableHLO, as it
does without a cache. Prepared at the artifact's default KV block counts. A load that uses the
cache skips the check of what the StableHLO may call (executors/programs.py): nothing compiles
it, and `prepare` checked these very bytes before compiling them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.manifest import read_manifest

FORMAT = 1
SUFFIX = ".prepared"


def prepared_path(artifact: str | os.PathLike[str]) -> Path:
    """Where `rvrun prepare` keeps `artifact`'s executables: beside it, `.prepared` added."""
    p = Path(artifact)
    return p.with_name(p.name + SUFFIX)


def artifact_id(art: Artifact) -> str:
    """sha256 of the header block and the piece-digest table: names the artifact's bytes."""
    return hashlib.sha256(art.signable.header_block + art.signable.table).hexdigest()


@dataclass(frozen=True)
class Prepared:
    path: Path  # the cache written
    entries: int  # executables in it
    seconds: float  # compiling and writing them
    device: str  # what they were compiled for, in words


def prepare(path: str | os.PathLike[str]) -> Prepared:
    """Compile every entry point of the XLA artifact at `path` for this machine's devices
    (verified and checked as `runtime.load` does first) and write `prepared_path(path)`,
    replacing any earlier one. ArtifactError (one line) for anything that does not fit: an
    artifact of another runtime, or an install without jax (named as `runtime.load` names it).
    The compile is the XLA runtime's (executors/prepared_cache.py), imported only now."""
    from rvcompile.runtime import runtime_module

    with Artifact.open(path) as art:
        manifest = read_manifest(art)
        if manifest.runtime != "xla":
            raise ArtifactError(f"{art.path.name}: a {manifest.runtime} artifact compiles "
                                "nothing at load; prepare applies to XLA artifacts")
        return runtime_module(art, manifest).prepare_here(art, manifest)
