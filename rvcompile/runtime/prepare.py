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
does without a cache. Prepared at the artifact's default KV block counts.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from rvcompile.artifacts import Artifact, ArtifactError, ArtifactHeader, ArtifactWriter
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
    replacing any earlier one. ArtifactError (one line) for anything that does not fit."""
    import jax

    from rvcompile.artifacts.xla_executables import compile_entries, executable_set
    from rvcompile.runtime.executors.precompiled import libtpu_version, this_machine
    from rvcompile.runtime.executors.programs import load_programs
    from rvcompile.runtime.executors.xla import check_fits

    t0 = time.perf_counter()
    with Artifact.open(path) as art:
        manifest = read_manifest(art)
        if manifest.runtime != "xla":
            raise ArtifactError(f"{art.path.name}: a {manifest.runtime} artifact compiles "
                                "nothing at load; prepare applies to XLA artifacts")
        art.verify()
        check_fits(art, manifest.xla)
        load_programs(art, manifest.xla)  # refuses a program that calls anything unsafe
        xla = art.manifest["xla"]
        blob = art.buffer("programs")
        programs = {n: bytes(blob[loc["offset"]:loc["offset"] + loc["size"]])
                    for n, loc in xla["programs"].items()}
        devices = jax.local_devices()
        compiled = compile_entries(programs, xla, devices)
        record, executables = executable_set("prepared", compiled, xla, devices,
                                             libtpu_version())
        offset = 0
        for name in sorted(executables):
            size = len(executables[name])
            record["entries"][name].update(offset=offset, size=size)
            offset += size
        out = prepared_path(art.path)
        # the header's compiler version is the artifact's: the runtime does not import the
        # compiler's package metadata (tests/test_layering.py)
        header = ArtifactHeader(art.header.compiler_version, "prepared-xla",
                                (record["platform"],))
        with ArtifactWriter(out, header) as w:
            w.add("executables", b"".join(executables[n] for n in sorted(executables)))
            w.commit({"prepared": {"format": FORMAT, "artifact": art.path.name,
                                   "artifact_id": artifact_id(art), "set": record}})
        # find_prepared loads it only if no one else may write it, whatever the umask was
        os.chmod(out, stat.S_IMODE(out.stat().st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    n = len(record["device_ids"])
    return Prepared(out, len(executables), time.perf_counter() - t0,
                    this_machine().describe(n))


@dataclass(frozen=True)
class Found:
    record: dict | None  # the set to load; None: compile (note says why, when there is a cache)
    cache: Artifact | None  # the open cache holding its "executables" section
    note: str  # "" when there is no cache at all


def find_prepared(art: Artifact, blocks: dict[str, int]) -> Found:
    """The prepared set for `art` on this machine with KV pools of `blocks` blocks per kind, or
    why not (one line). Never raises for the cache's sake: a bad cache is refused, not fatal."""
    from rvcompile.runtime.executors.precompiled import mismatch, this_machine

    path = prepared_path(art.path)
    if not path.exists():
        return Found(None, None, "")
    name = path.name

    def refuse(why: str) -> Found:
        return Found(None, None, f"not using {name}: {why}; run `rvrun prepare "
                                 f"{art.path.name}` again; compiling StableHLO")

    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        return refuse("not a regular file")
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return refuse("XLA runs its executables unchecked, so it must be owned by this user "
                      "and writable by no one else")
    try:
        cache = Artifact.open(path)
    except ArtifactError as e:
        return refuse(str(e).removeprefix(f"{name}: "))
    try:
        cache.verify()
        info = cache.manifest.get("prepared")
        if not isinstance(info, dict) or info.get("format") != FORMAT or \
                not isinstance(info.get("set"), dict) or "executables" not in cache.sections:
            raise ArtifactError(f"{name}: not a prepared cache of format {FORMAT}")
        if info.get("artifact_id") != artifact_id(art):
            raise ArtifactError(f"{name}: prepared for another artifact (or an earlier build "
                                f"of {art.path.name})")
        rec = info["set"]
        try:
            why = mismatch(rec, this_machine(), blocks)
        except (KeyError, TypeError):
            raise ArtifactError(f"{name}: its set's record is incomplete") from None
        if why is not None:
            raise ArtifactError(f"{name}: {why}")
        if not isinstance(rec.get("entries"), dict):
            raise ArtifactError(f"{name}: its set has no entries")
    except ArtifactError as e:
        cache.close()
        return refuse(str(e).removeprefix(f"{name}: "))
    return Found(rec, cache, f"prepared executables ({name})")
