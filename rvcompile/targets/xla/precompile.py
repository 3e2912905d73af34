"""Executables precompiled for named TPU topologies, built on a machine without a TPU.

With `libtpu` installed, JAX describes a TPU slice it does not have
(`jax.experimental.topologies.get_topology_desc`) and XLA compiles for it. `precompile` compiles
every exported entry point (the artifact's own StableHLO, called through `Exported.call`) for the
first `tp` devices of a topology, in device-id order (the order the runtime puts its mesh in),
with the KV pools at the manifest's default block counts.

What is stored per entry (encoding EXECUTABLES_ENCODING: XLA's own bytes and a JSON description
of the operands, no pickle) and what a set's record holds: artifacts/xla_executables.py, shared
with `rvrun prepare`. A compiled entry the operands cannot describe is refused here, not stored.

`compile_entries` works on any devices (CPU ones too), so the load path is tested without a TPU.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

from rvcompile.artifacts.xla_executables import (
    ExecutableError,
    compile_entries,
    executable_set,
)
from rvcompile.model.config import ConfigError
from rvcompile.targets.xla.cost_report import CHIPS, ReadModel, cost_report

_TOPOLOGY = re.compile(r"^(v\d+[a-z]*):(\d+)x(\d+)$")
MAX_HOST_CHIPS = 8  # rvrun is one process: one TPU host, at most 8 chips


class PrecompileError(ConfigError):
    """A topology that cannot be precompiled here; the message is one line."""


@dataclass(frozen=True)
class Topology:
    name: str  # e.g. "v6e:2x2"
    generation: str  # key of cost_report.CHIPS
    shape: tuple[int, int]

    @property
    def chips(self) -> int:
        return self.shape[0] * self.shape[1]


def parse_topology(text: str) -> Topology:
    m = _TOPOLOGY.match(text.strip())
    if not m:
        raise PrecompileError(f"--topology {text!r}: expected GENERATION:AxB, e.g. v6e:2x2")
    gen, shape = m.group(1), (int(m.group(2)), int(m.group(3)))
    if gen not in CHIPS:
        raise PrecompileError(f"--topology {text!r}: unknown TPU generation {gen!r} "
                              f"(known: {', '.join(CHIPS)})")
    topo = Topology(f"{gen}:{shape[0]}x{shape[1]}", gen, shape)
    if not 1 <= topo.chips <= MAX_HOST_CHIPS:
        raise PrecompileError(f"--topology {text!r}: {topo.chips} chips; one host has 1 to "
                              f"{MAX_HOST_CHIPS}")
    return topo


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_topology(topo: Topology, tp: int) -> None:
    """Refuse, before any work, a topology this build cannot precompile for."""
    if topo.chips != tp:
        raise PrecompileError(f"--topology {topo.name} has {topo.chips} chips but the programs "
                              f"are sharded over --tp {tp}; give --tp {topo.chips} or another "
                              "topology")
    if libtpu_version() is None:
        raise PrecompileError(f"--topology {topo.name} needs libtpu on the build machine "
                              "(pip install 'rvcompile[tpu-aot]')")


def topology_devices(topo: Topology) -> list:
    """The compile-only devices of one host of `topo`, in device-id order."""
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(topo.name, "tpu",
                                        chips_per_host_bounds=[*topo.shape, 1])
    return sorted(desc.devices, key=lambda d: d.id)


@dataclass(frozen=True)
class Precompiled:
    record: dict  # manifest entry: what a runtime must match, and where each executable is
    executables: dict[str, bytes]  # entry name -> serialized executable
    compiled: dict[str, object]  # entry name -> jax.stages.Compiled (for the cost report)


def precompile_for(name: str, programs: dict[str, bytes], xla_manifest: dict,
                   devices: list, names: tuple[str, ...] | None = None) -> Precompiled:
    """Compile and serialize every entry point (or `names`) for `devices`; `name` keys the
    record."""
    try:
        compiled = compile_entries(programs, xla_manifest, devices, names)
        record, executables = executable_set(name, compiled, xla_manifest, devices,
                                             libtpu_version())
    except ExecutableError as e:
        raise PrecompileError(str(e)) from None
    return Precompiled(record, executables, compiled)


def precompile(topo: Topology, programs: dict[str, bytes], xla_manifest: dict) -> Precompiled:
    """Executables of every entry point for a TPU slice of shape `topo`, compiled here."""
    n = (xla_manifest.get("mesh") or {"size": 1})["size"]
    check_topology(topo, n)
    return precompile_for(topo.name, programs, xla_manifest, topology_devices(topo))


def executables_section(sets: list[Precompiled]) -> tuple[bytes, dict[str, dict]]:
    """One "executables" section holding every set, and the manifest's `xla.precompiled`
    (topology -> record, each entry located by offset and size in the section)."""
    parts, records, offset = [], {}, 0
    for pre in sets:
        rec = {**pre.record, "entries": {}}
        for entry in sorted(pre.executables):
            data = pre.executables[entry]
            rec["entries"][entry] = {**pre.record["entries"][entry], "offset": offset,
                                     "size": len(data)}
            parts.append(data)
            offset += len(data)
        records[pre.record["topology"]] = rec
    return b"".join(parts), records


def precompile_topologies(topologies: tuple[Topology, ...], programs: dict[str, bytes],
                          xla_manifest: dict, *, query_per_kv: int, reads: ReadModel,
                          log=print) -> tuple[bytes, dict[str, dict]]:
    """Precompile every topology and attach its cost report (from its decode program)."""
    sets = []
    for topo in topologies:
        log(f"precompiling {len(programs)} entry points for {topo.name}")
        pre = precompile(topo, programs, xla_manifest)
        decode = pre.compiled[f"decode_{xla_manifest['max_seqs']}"]
        pre.record["cost"] = cost_report(decode, xla_manifest["max_seqs"], CHIPS[topo.generation],
                                         query_per_kv, xla_manifest["max_context"], reads,
                                         tuple(g["count"] for g in xla_manifest["layer_groups"]))
        sets.append(pre)
    return executables_section(sets)
