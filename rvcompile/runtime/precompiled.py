"""Choosing and loading an artifact's precompiled executables (manifest `xla.precompiled`).

An artifact may carry, per named topology, executables compiled at build for that slice
(targets/xla/precompile.py). `choose` picks the set this machine can load as it is: same
platform, device kind, device ids and coordinates of the first `num devices` local devices, the
same jax, jaxlib and libtpu versions, and the KV pools at the block counts they were compiled
for. When none matches it says why in one line, and the executor compiles the StableHLO.
`load` deserializes a chosen set with no compilation.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass

import jax
import jaxlib

from rvcompile.artifacts import Artifact, ArtifactError


@dataclass(frozen=True)
class Machine:
    """What a precompiled set must match on this host."""

    platform: str
    device_kind: str
    devices: tuple[tuple[int, tuple[int, ...]], ...]  # (id, coords) of each local device
    jax: str
    jaxlib: str
    libtpu: str | None

    def describe(self, n: int) -> str:
        return f"{self.device_kind} x{n} / jaxlib {self.jaxlib} / libtpu {self.libtpu or 'none'}"


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def this_machine() -> Machine:
    devices = jax.local_devices()
    return Machine(devices[0].platform, devices[0].device_kind,
                   tuple((d.id, tuple(getattr(d, "coords", ()))) for d in devices),
                   jax.__version__, jaxlib.__version__, libtpu_version())


@dataclass(frozen=True)
class Choice:
    topology: str | None  # the precompiled set to load, None: compile the StableHLO
    note: str  # one line: what was chosen, or why nothing was


def _mismatch(rec: dict, machine: Machine, blocks: dict[str, int]) -> str | None:
    """Why `rec` cannot run here as it is, or None when it can."""
    n = len(rec["device_ids"])
    mine = machine.devices[:n]
    if rec["platform"] != machine.platform or rec["device_kind"] != machine.device_kind:
        return f"it is for {rec['device_kind']}"
    if len(mine) < n or [d for d, _ in mine] != rec["device_ids"] or \
            [list(c) for _, c in mine] != rec["coords"]:
        return f"it is for {n} devices at coords {rec['coords']}"
    for key in ("jax", "jaxlib", "libtpu"):
        if rec[key] != getattr(machine, key):
            return f"it was compiled with {key} {rec[key]}"
    if rec["kv_blocks"] != blocks:
        return f"it was compiled for KV blocks {rec['kv_blocks']}, not {blocks}"
    return None


def choose(precompiled: dict[str, dict], machine: Machine, blocks: dict[str, int]) -> Choice:
    """The first set of `precompiled` (topology -> record) this machine can load."""
    reasons = []
    for name, rec in sorted(precompiled.items()):
        why = _mismatch(rec, machine, blocks)
        if why is None:
            return Choice(name, f"precompiled executables for {name} (jaxlib {rec['jaxlib']}, "
                                f"libtpu {rec['libtpu']}); nothing compiled")
        reasons.append(f"{name}: {why}")
    n = max((len(r["device_ids"]) for r in precompiled.values()), default=1)
    have = "; ".join(reasons) if reasons else "the artifact has none"
    return Choice(None, f"no precompiled executable for {machine.describe(n)} ({have}); "
                        "compiling StableHLO")


def load(art: Artifact, topology: str, exported: dict, devices: list) -> dict:
    """Deserialize every entry of `topology`'s set onto `devices`; `exported` maps entry name
    to its jax.export.Exported (which holds the in/out pytrees). Checks each sha256. The record
    is the checked manifest's (artifacts/manifest.py)."""
    from jax.experimental import serialize_executable

    rec = art.manifest["xla"]["precompiled"][topology]
    blob = art.buffer("executables")
    by_id = {d.id: d for d in devices}
    run_on = [by_id[i] for i in rec["device_ids"]]
    out = {}
    for name, loc in rec["entries"].items():
        data = bytes(blob[loc["offset"]:loc["offset"] + loc["size"]])
        if hashlib.sha256(data).hexdigest() != loc["sha256"]:
            raise ArtifactError(f"{art.path.name}: precompiled {topology}/{name} is corrupt "
                                "(sha256 mismatch)")
        exp = exported[name]
        try:  # bytes from the file: any failure of the deserializer is the file's
            out[name] = serialize_executable.deserialize_and_load(
                data, exp.in_tree, exp.out_tree, backend=run_on[0].client,
                execution_devices=run_on)
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[0][:160]
            raise ArtifactError(f"{art.path.name}: precompiled {topology}/{name} cannot be "
                                f"loaded ({type(e).__name__}: {reason})") from None
    return out
