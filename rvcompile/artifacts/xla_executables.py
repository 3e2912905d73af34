"""XLA executables compiled from an artifact's exported programs, serialized without pickle
(encoding EXECUTABLES_ENCODING): what the build stores per TPU topology
(targets/xla/precompile.py) and what `rvrun prepare` stores next to an artifact for the machine
it runs on (runtime/prepare.py). Shared by both, which is why it lives with the format, like
xla_programs.py (the other artifacts module that needs jax); runtime/executors/precompiled.py
loads what this writes.

Per entry: the bytes XLA serializes the executable to (`LoadedExecutable.serialize`, the PJRT
format; no Python pickle, unlike `jax.experimental.serialize_executable`, whose payload is a
pickle that runs code when loaded) and `operands`, our JSON description of its flat inputs
(shape, dtype, PartitionSpec, donated) and outputs (shape, dtype, PartitionSpec); the pytrees
around them are the Exported's. A set's record says what a runtime must match to load it:
platform, device kind, device ids and coordinates, jax, jaxlib and libtpu versions, and the
pools' block counts. A compiled entry the operands cannot describe (constants, effect tokens,
dropped arguments, shardings that are not a PartitionSpec over the mesh) is refused
(ExecutableError), not stored.
"""

from __future__ import annotations

import contextlib
import hashlib

import jax
import jaxlib
import numpy as np
from jax import export
from jax._src import compilation_cache  # reset_cache: jax decides "cache used" once a process
from jax._src import config as jax_config  # enable_compilation_cache: no public context manager
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rvcompile.artifacts.format import EXECUTABLES_ENCODING, ArtifactError


class ExecutableError(ArtifactError):
    """A compiled entry that cannot be stored as described; the message is one line."""


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
    jit of Exported.call with the pools donated (but to draft, which only reads them and
    returns none), pools at the default block counts."""
    mesh_info = xla_manifest.get("mesh") or {"axis": "tp", "size": 1}
    mesh = Mesh(np.array(devices[:mesh_info["size"]]), (mesh_info["axis"],))
    blocks = default_blocks(xla_manifest)
    reads_only = (xla_manifest.get("speculative") or {}).get("draft")
    out = {}
    with _without_persistent_cache():
        for name in names or sorted(programs):
            exp = export.deserialize(bytearray(programs[name]))
            args, kwargs = _entry_args(exp, blocks, mesh)
            donate = () if name == reads_only else (1,)
            out[name] = jax.jit(exp.call, donate_argnums=donate).lower(*args, **kwargs).compile()
    return out


def _spec(sharding, where: str) -> list:
    """A NamedSharding's PartitionSpec as JSON: per dimension null, an axis name or a list."""
    if not isinstance(sharding, NamedSharding) or sharding.memory_kind not in (None, "device"):
        raise ExecutableError(f"{where}: sharding {sharding} is not a PartitionSpec over the "
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
        raise ExecutableError(f"{name}: the executable takes other parameters than the "
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


def executable_set(name: str, compiled: dict[str, object], xla_manifest: dict, devices: list,
                   libtpu: str | None) -> tuple[dict, dict[str, bytes]]:
    """(record, entry name -> serialized executable) of `compiled` (compile_entries' result for
    `devices`); `name` keys the record, `libtpu` is the libtpu version it was compiled with."""
    n = (xla_manifest.get("mesh") or {"size": 1})["size"]
    executables = {e: serialize(c) for e, c in compiled.items()}
    record = {
        "topology": name, "encoding": EXECUTABLES_ENCODING, **device_record(devices, n),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": libtpu,
        "kv_blocks": default_blocks(xla_manifest),
        "entries": {e: {"sha256": hashlib.sha256(b).hexdigest(),
                        "operands": operands(compiled[e], e)}
                    for e, b in executables.items()},
    }
    return record, executables
