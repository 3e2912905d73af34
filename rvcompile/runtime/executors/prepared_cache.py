"""Compiling an XLA artifact's executables into its prepared cache, and finding that cache at
load (what runtime/prepare.py describes: format, checks, refusals). The XLA runtime's part of
`rvrun prepare`; executors/xla.py offers `prepare_here` and calls `find_prepared`."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

import jax

from rvcompile.artifacts import Artifact, ArtifactError, ArtifactHeader, ArtifactWriter
from rvcompile.artifacts.manifest import Manifest
from rvcompile.artifacts.xla_executables import compile_entries, executable_set
from rvcompile.runtime.executors.precompiled import libtpu_version, mismatch, this_machine
from rvcompile.runtime.executors.programs import load_programs
from rvcompile.runtime.prepare import FORMAT, Prepared, artifact_id, prepared_path


def prepare_here(art: Artifact, manifest: Manifest) -> Prepared:
    """runtime/prepare.py's `prepare` for the open XLA artifact `art` (`manifest` checked):
    verified, the machine and programs checked as a load checks them, then compiled and
    written beside it."""
    from rvcompile.runtime.executors.xla import check_fits

    t0 = time.perf_counter()
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
