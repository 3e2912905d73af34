"""Executables precompiled for named TPU topologies, built on a machine without a TPU.

With `libtpu` installed, JAX describes a TPU slice it does not have
(`jax.experimental.topologies.get_topology_desc`) and XLA compiles for it. `precompile` compiles
every exported entry point (the artifact's own StableHLO, called through `Exported.call`) for the
first `tp` devices of a topology, in device-id order (the order the runtime puts its mesh in),
with the KV pools at the manifest's default block counts.

What is stored per entry (encoding EXECUTABLES_ENCODING): the bytes XLA serializes the
executable to (`LoadedExecutable.serialize`, the PJRT format; no Python pickle, unlike
`jax.experimental.serialize_executable`, whose payload is a pickle that runs code when loaded)
and `operands`, our JSON description of its flat inputs (shape, dtype, PartitionSpec, donated)
and outputs (shape, dtype, PartitionSpec); the pytrees around them are the Exported's. The record
says what a runtime must match to load them: platform, device kind, device ids and coordinates,
jax, jaxlib and libtpu versions, and the pools' block counts. A compiled entry the operands
cannot describe (constants, effect tokens, dropped arguments, shardings that are not a
PartitionSpec over the mesh) is refused here, not stored.

`compile_entries` works on any devices (CPU ones too), so the load path is tested without a TPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import re
from dataclasses import dataclass

import jax
import jaxlib
import numpy as np
from jax import export
from jax._src import compilation_cache  # reset_cache: jax decides "cache used" once a process
from jax._src import config as jax_config  # enable_compilation_cache: no public context manager
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rvcompile.artifacts.format import EXECUTABLES_ENCODING
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


def default_blocks(xla_manifest: dict) -> dict[str, int]:
    return {k: v["default_blocks"] for k, v in xla_manifest["kv"]["kinds"].items()}


def _entry_args(exp: export.Exported, blocks: dict[str, int], mesh: Mesh) -> tuple:
    """(args, kwargs) of ShapeDtypeStructs: the Exported's avals with the pools' symbolic block
    counts made concrete, each placed as the Exported says over `mesh` (whole when unsharded)."""
    whole = NamedSharding(mesh, PartitionSpec())
    shardings = (exp.in_shardings_jax(mesh) if exp.nr_devices > 1
                 else (None,) * len(exp.in_avals))

    def concrete(dim):
        return dim if isinstance(dim, int) else blocks[str(dim).removeprefix("blocks_")]

    flat = [jax.ShapeDtypeStruct(tuple(concrete(d) for d in a.shape), a.dtype,
                                 sharding=s or whole)
            for a, s in zip(exp.in_avals, shardings, strict=True)]
    return jax.tree.unflatten(exp.in_tree, flat)


@contextlib.contextmanager
def _without_persistent_cache():
    """Compile without jax's persistent compilation cache (which rvrun turns on in its process):
    an executable loaded from it serializes without its compiled code (an XLA:CPU one to half the
    bytes, then "Function ... not found" when run). jax decides whether the cache is used once
    per process and remembers it, so turning the flag off is not enough: the decision is reset
    on the way in (made again with the flag off) and on the way out (made again as configured)."""
    with jax_config.enable_compilation_cache(False):
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            compilation_cache.reset_cache()


def compile_entries(programs: dict[str, bytes], xla_manifest: dict, devices: list,
                    names: tuple[str, ...] | None = None) -> dict[str, object]:
    """Compile the exported `programs` (all, or `names`) for `devices`, as the runtime would:
    jit of Exported.call with the pools donated, pools at the default block counts."""
    mesh_info = xla_manifest.get("mesh") or {"axis": "tp", "size": 1}
    mesh = Mesh(np.array(devices[:mesh_info["size"]]), (mesh_info["axis"],))
    blocks = default_blocks(xla_manifest)
    out = {}
    with _without_persistent_cache():
        for name in names or sorted(programs):
            exp = export.deserialize(bytearray(programs[name]))
            args, kwargs = _entry_args(exp, blocks, mesh)
            out[name] = jax.jit(exp.call, donate_argnums=(1,)).lower(*args, **kwargs).compile()
    return out


def _spec(sharding, where: str) -> list:
    """A NamedSharding's PartitionSpec as JSON: per dimension null, an axis name or a list."""
    if not isinstance(sharding, NamedSharding) or sharding.memory_kind not in (None, "device"):
        raise PrecompileError(f"{where}: sharding {sharding} is not a PartitionSpec over the "
                              "mesh in device memory")
    return [p if p is None or isinstance(p, str) else list(p) for p in sharding.spec]


def operands(compiled, name: str) -> dict:
    """Our description of `compiled`'s flat inputs and outputs, from which the runtime rebuilds
    its calling convention; refuses what the description cannot carry."""
    exe = compiled.runtime_executable()
    args = jax.tree.leaves(compiled.args_info)
    in_shardings = jax.tree.leaves(compiled.input_shardings)
    outs = jax.tree.leaves(compiled.out_info)
    if compiled._params.const_args or len(exe.get_parameter_layouts()) != len(args) or \
            len(in_shardings) != len(args):
        raise PrecompileError(f"{name}: the executable takes other parameters than the "
                              f"{len(args)} arguments (constants, effects or dropped arguments)")
    inputs = [{"shape": list(a.shape), "dtype": str(a.dtype),
               "spec": _spec(s, f"{name} input {i}"), "donated": bool(a.donated)}
              for i, (a, s) in enumerate(zip(args, in_shardings, strict=True))]
    outputs = [{"shape": list(o.shape), "dtype": str(o.dtype),
                "spec": _spec(o.sharding, f"{name} output {i}")} for i, o in enumerate(outs)]
    return {"inputs": inputs, "outputs": outputs}


def serialize(compiled) -> bytes:
    """The executable as XLA serializes it (no pickle)."""
    return compiled.runtime_executable().serialize()


def device_record(devices: list, n: int) -> dict:
    """What identifies the first `n` devices: platform, kind, ids and coordinates."""
    used = devices[:n]
    return {"platform": used[0].platform, "device_kind": used[0].device_kind,
            "device_ids": [d.id for d in used],
            "coords": [list(getattr(d, "coords", ())) for d in used]}


def precompile_for(name: str, programs: dict[str, bytes], xla_manifest: dict,
                   devices: list, names: tuple[str, ...] | None = None) -> Precompiled:
    """Compile and serialize every entry point (or `names`) for `devices`; `name` keys the
    record."""
    n = (xla_manifest.get("mesh") or {"size": 1})["size"]
    compiled = compile_entries(programs, xla_manifest, devices, names)
    executables = {e: serialize(c) for e, c in compiled.items()}
    record = {
        "topology": name, "encoding": EXECUTABLES_ENCODING, **device_record(devices, n),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": libtpu_version(),
        "kv_blocks": default_blocks(xla_manifest),
        "entries": {e: {"sha256": hashlib.sha256(b).hexdigest(),
                        "operands": operands(compiled[e], e)}
                    for e, b in executables.items()},
    }
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
