"""Choosing and loading an artifact's precompiled executables (manifest `xla.precompiled`).

An artifact may carry, per named topology, executables compiled at build for that slice
(targets/xla/precompile.py). XLA loads an executable without checking it, and running it runs
what it holds (jaxlib's `Client.deserialize_executable`: "Even loading such an executable may
run arbitrary code on your machine. It is not safe to pass untrusted data here"). So a set is
loaded only when the operator trusts the artifact's executables as they would a program, and
its signer (`trusted`: rvrun's `--trust-executables`, which needs `--trusted-key`); otherwise
`choose` says in one line that it compiles the StableHLO.

`choose` picks the set this machine can load as it is: encoding EXECUTABLES_ENCODING (sets
written as jax's pickle, format v2, are never loaded), same platform, device kind, device ids
and coordinates of the first `num devices` local devices, the same jax, jaxlib and libtpu
versions, and the KV pools at the block counts they were compiled for. When none matches it says
why in one line, and the executor compiles the StableHLO.

`load` checks a chosen set at load, every entry's sha256 and its JSON `operands` against the
artifact's own exported program, and deserializes each entry on its first use (Executables),
with no compilation and no pickle: the PJRT bytes go to the backend's `deserialize_executable`,
the executable XLA loaded is checked against the operands (its parameter and result shapes), and
the calling convention (avals, shardings over the mesh, donation, layouts) is rebuilt from the
operands. Any mismatch is an ArtifactError, one line: at load, or from the entry's first call
(never a compile of the StableHLO instead).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass

import jax
import jaxlib
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rvcompile.artifacts import Artifact, ArtifactError
from rvcompile.artifacts.format import EXECUTABLES_ENCODING
from rvcompile.dtypes import numpy_dtype

log = logging.getLogger(__name__)


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


def mismatch(rec: dict, machine: Machine, blocks: dict[str, int]) -> str | None:
    """Why `rec` cannot run here as it is, or None when it can."""
    if rec.get("encoding") != EXECUTABLES_ENCODING:
        return "it is stored as jax's pickle, which rvrun does not load (rebuild the artifact)"
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


def choose(precompiled: dict[str, dict], machine: Machine, blocks: dict[str, int], *,
           trusted: bool) -> Choice:
    """The first set of `precompiled` (topology -> record) this machine can load; none unless
    the operator `trusted` the artifact's executables."""
    if precompiled and not trusted:
        sets = ", ".join(sorted(precompiled))
        return Choice(None, f"not loading the precompiled executables ({sets}): XLA runs an "
                            "executable unchecked, so rvrun loads one only when trusted "
                            "(--trust-executables --trusted-key); compiling StableHLO")
    reasons = []
    for name, rec in sorted(precompiled.items()):
        why = mismatch(rec, machine, blocks)
        if why is None:
            return Choice(name, f"precompiled executables for {name} (jaxlib {rec['jaxlib']}, "
                                f"libtpu {rec['libtpu']}); nothing compiled")
        reasons.append(f"{name}: {why}")
    n = max((len(r["device_ids"]) for r in precompiled.values()), default=1)
    have = "; ".join(reasons) if reasons else "the artifact has none"
    return Choice(None, f"no precompiled executable for {machine.describe(n)} ({have}); "
                        "compiling StableHLO")


@dataclass(frozen=True)
class Operand:
    """One flat input or output of an executable, as the entry's `operands` describe it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    spec: PartitionSpec  # over the mesh's one axis
    donated: bool  # inputs: the executable may reuse its buffer; outputs: False


def _operands(items, where: str) -> list[Operand]:
    """A JSON list of operands, checked field by field."""
    if not isinstance(items, list):
        raise ArtifactError(f"{where}: expected a list of operands")
    out = []
    for i, op in enumerate(items):
        at = f"{where}[{i}]"
        shape, dtype, spec = (op.get(k) if isinstance(op, dict) else None
                              for k in ("shape", "dtype", "spec"))
        donated = op.get("donated", False) if isinstance(op, dict) else None
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ArtifactError(f"{at}.shape: expected a list of sizes, got {shape!r}")
        if not (isinstance(spec, list) and all(
                p is None or isinstance(p, str) or
                isinstance(p, list) and all(isinstance(a, str) for a in p) for p in spec)):
            raise ArtifactError(f"{at}.spec: expected a PartitionSpec as a list, got {spec!r}")
        if type(donated) is not bool:
            raise ArtifactError(f"{at}.donated: expected true or false, got {donated!r}")
        try:
            dt = numpy_dtype(dtype)
        except TypeError:
            raise ArtifactError(f"{at}.dtype: unknown dtype {dtype!r}") from None
        out.append(Operand(tuple(shape), dt, PartitionSpec(
            *(tuple(p) if isinstance(p, list) else p for p in spec)), donated))
    return out


def _check_against_program(where: str, ops: list[Operand], avals, shardings, blocks: dict,
                           mesh: Mesh, kind: str) -> None:
    """The described operands are the exported program's, with the pools' block counts
    concrete and each placed as the program says."""
    if len(ops) != len(avals):
        raise ArtifactError(f"{where}: {len(ops)} {kind}s, its program has {len(avals)}")
    for i, (op, aval, sharding) in enumerate(zip(ops, avals, shardings, strict=True)):
        shape = tuple(d if isinstance(d, int) else blocks.get(str(d).removeprefix("blocks_"))
                      for d in aval.shape)
        want = sharding or NamedSharding(mesh, PartitionSpec())
        if op.shape != shape or op.dtype != aval.dtype or not NamedSharding(
                mesh, op.spec).is_equivalent_to(want, len(shape)):
            raise ArtifactError(f"{where}: {kind} {i} is {op.dtype}{list(op.shape)} {op.spec}, "
                                f"its program's is {aval.dtype}{list(shape)} {want.spec}")


def _check_executable(where: str, xla_exe, inputs: list[Operand], outputs: list[Operand],
                      mesh: Mesh) -> None:
    """The executable XLA loaded takes and returns one shard of each operand."""
    from jax._src.lib import xla_client

    try:
        program = xla_client.XlaComputation(
            xla_exe.hlo_modules()[0].as_serialized_hlo_module_proto()).program_shape()
    except Exception as e:  # a backend that keeps no HLO with a loaded executable
        raise ArtifactError(f"{where}: XLA gives no program shape to check it against: "
                            f"{str(e).strip().splitlines()[0]}") from None
    result = program.result_shape()
    results = result.tuple_shapes() if result.is_tuple() else [result]
    for kind, ops, shapes in (("input", inputs, program.parameter_shapes()),
                              ("output", outputs, results)):
        if len(shapes) != len(ops):
            raise ArtifactError(f"{where}: the executable has {len(shapes)} {kind}s, its "
                                f"operands {len(ops)}")
        for i, (op, shape) in enumerate(zip(ops, shapes, strict=True)):
            shard = NamedSharding(mesh, op.spec).shard_shape(op.shape)
            if tuple(shape.dimensions()) != shard or shape.numpy_dtype() != op.dtype:
                raise ArtifactError(f"{where}: the executable's {kind} {i} is {shape}, its "
                                    f"operands' shard is {op.dtype}{list(shard)}")


def _compiled(xla_exe, exp, inputs: list[Operand], outputs: list[Operand], mesh: Mesh,
              name: str):
    """A jax.stages.Compiled around `xla_exe`, its calling convention rebuilt from the operands
    (what jax's deserialize_and_load unpickles: the same pxla objects, from our description)."""
    from jax._src import core
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client

    in_avals = [core.ShapedArray(op.shape, op.dtype) for op in inputs]
    out_avals = [core.ShapedArray(op.shape, op.dtype) for op in outputs]
    in_shardings = [NamedSharding(mesh, op.spec) for op in inputs]
    out_shardings = [NamedSharding(mesh, op.spec) for op in outputs]
    in_layouts, out_layouts = pxla._get_layouts_from_executable(
        xla_exe, [None] * len(inputs), [None] * len(outputs), 0, in_avals, out_avals)
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=xla_exe, device_list=xla_client.DeviceList(tuple(mesh.devices.flat)),
        backend=xla_exe.client, input_avals=in_avals, input_shardings=in_shardings,
        output_avals=out_avals, output_shardings=out_shardings, committed=True,
        name=f"precompiled {name}", unordered_effects=[], ordered_effects=[], keepalive=[],
        host_callbacks=[], kept_var_idx=set(range(len(inputs))), mut=None,
        xla_in_layouts=in_layouts,
        dispatch_in_layouts=pxla.get_dispatch_layouts(in_layouts, in_shardings, in_avals),
        xla_out_layouts=out_layouts, all_args_info=None, pgle_profiler=None)
    args_info = exp.in_tree.unflatten(
        [jax.stages.ArgInfo(a, op.donated) for a, op in zip(in_avals, inputs, strict=True)])
    return jax.stages.Compiled(unloaded.load(), [], args_info, exp.out_tree)


def load(art: Artifact, topology: str, exported: dict, devices: list) -> Executables:
    """Check every entry of `topology`'s set for `devices` (load_set), to be deserialized on
    first use, without pickle; `exported` maps entry name to its jax.export.Exported (the in/out
    pytrees, and what each entry's operands must agree with)."""
    xla = art.manifest["xla"]
    return load_set(xla["precompiled"][topology], art.buffer("executables"),
                    f"{art.path.name}: precompiled {topology}", xla, exported, devices)


@dataclass(frozen=True)
class _Checked:
    """One entry whose bytes and operands passed load_set's checks, not yet given to XLA."""

    where: str  # begins its errors
    data: bytes  # XLA's serialized executable (its sha256 checked)
    exp: object  # the artifact's jax.export.Exported of this entry
    inputs: list[Operand]
    outputs: list[Operand]


class Executables(MutableMapping):
    """Entry name -> jax.stages.Compiled, each deserialized by XLA on its first use.

    load_set checked every entry's bytes (sha256) and operands (against the artifact's program)
    before this exists; what only XLA can do, parse the bytes and load the executable (about
    0.2 s an entry for the default model on XLA:CPU), and the check of that executable against
    the operands, wait for the entry's first call, so a load pays only for what it runs. A
    failure there raises ArtifactError (one line) from that call, and from every later call of
    the entry: never a compile. One entry is deserialized at a time (a lock): XLA:CPU crashes
    deserializing several at once. `loaded_s` says which were deserialized and what each
    took; `pending` which wait for their first use."""

    def __init__(self, checked: dict[str, _Checked], run_on: list, mesh: Mesh):
        self._checked = checked
        self._run_on, self._mesh = run_on, mesh
        self._loaded: dict[str, object] = {}
        self.loaded_s: dict[str, float] = {}  # entry -> seconds its deserialization took
        self._lock = threading.Lock()

    @property
    def pending(self) -> tuple[str, ...]:
        """The entries not deserialized yet, in name order."""
        return tuple(sorted(set(self._checked) - set(self._loaded)))

    def __getitem__(self, name: str):
        fn = self._loaded.get(name)
        if fn is not None:
            return fn
        entry = self._checked[name]  # KeyError: no such entry
        with self._lock:
            if name not in self._loaded:
                t0 = time.perf_counter()
                self._loaded[name] = _deserialize(entry, self._run_on, self._mesh, name)
                self.loaded_s[name] = time.perf_counter() - t0
                log.info("%s: deserialized on first use in %.2f s", entry.where,
                         self.loaded_s[name])
            return self._loaded[name]

    def __setitem__(self, name: str, fn) -> None:
        self._loaded[name] = fn

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self._loaded.pop(name, None)
        self._checked.pop(name, None)

    def __iter__(self):
        return iter(sorted(set(self._checked) | set(self._loaded)))

    def __len__(self) -> int:
        return len(set(self._checked) | set(self._loaded))


def _deserialize(entry: _Checked, run_on: list, mesh: Mesh, name: str):
    """XLA's executable from `entry`'s bytes, checked against its operands, as a Compiled."""
    from jax._src.lib import xla_client

    try:
        xla_exe = run_on[0].client.deserialize_executable(
            entry.data, xla_client.DeviceList(tuple(run_on)))
    except Exception as e:  # jaxlib's errors: parse failures, another platform's bytes
        raise ArtifactError(f"{entry.where}: XLA cannot load it: "
                            f"{str(e).strip().splitlines()[0]}") from None
    _check_executable(entry.where, xla_exe, entry.inputs, entry.outputs, mesh)
    return _compiled(xla_exe, entry.exp, entry.inputs, entry.outputs, mesh, name)


def load_set(rec: dict, blob: memoryview, where_set: str, xla: dict, exported: dict,
             devices: list) -> Executables:
    """`load` for any record `rec` (xla_executables.executable_set's) whose entries lie in
    `blob`: the artifact's precompiled sets, or a prepared cache (runtime/prepare.py);
    `where_set` begins every error; `xla`: the artifact's manifest part (its mesh). Checks
    each entry's sha256 and its operands against its program now, and copies its bytes out of
    `blob` (which may close); XLA deserializes each on first use (Executables)."""
    by_id = {d.id: d for d in devices}
    run_on = [by_id[i] for i in rec["device_ids"]]
    mesh = Mesh(np.array(run_on), ((xla.get("mesh") or {"axis": "tp"})["axis"],))
    reads_only = (xla.get("speculative") or {}).get("draft")  # the entry that donates nothing
    checked = {}
    for name, loc in rec["entries"].items():
        where = f"{where_set}/{name}"
        if not (isinstance(loc, dict) and all(type(loc.get(k)) is int and loc[k] >= 0
                                              for k in ("offset", "size"))
                and loc["offset"] + loc["size"] <= len(blob)):
            raise ArtifactError(f"{where}: offset and size must locate it in its section")
        data = bytes(blob[loc["offset"]:loc["offset"] + loc["size"]])
        if hashlib.sha256(data).hexdigest() != loc["sha256"]:
            raise ArtifactError(f"{where} is corrupt (sha256 mismatch)")
        exp = exported.get(name)
        if exp is None:
            raise ArtifactError(f"{where}: the artifact has no program {name!r}")
        ops = loc.get("operands")
        if not isinstance(ops, dict):
            raise ArtifactError(f"{where}: no operands")
        inputs = _operands(ops.get("inputs"), f"{where}: operands.inputs")
        outputs = _operands(ops.get("outputs"), f"{where}: operands.outputs")
        if any(op.donated for op in outputs):
            raise ArtifactError(f"{where}: operands.outputs: an output cannot be donated")
        if name == reads_only and any(op.donated for op in inputs):
            # what rvcompile compiled before it knew draft's pools are only read: the first
            # draft call would delete them
            raise ArtifactError(f"{where}: operands.inputs: draft only reads the KV pools but "
                                "this executable takes them donated (an older rvcompile's: run "
                                "rvrun prepare again, or rebuild)")
        sharded = exp.nr_devices > 1
        _check_against_program(where, inputs, exp.in_avals, exp.in_shardings_jax(mesh)
                               if sharded else [None] * len(exp.in_avals),
                               rec["kv_blocks"], mesh, "input")
        _check_against_program(where, outputs, exp.out_avals, exp.out_shardings_jax(mesh)
                               if sharded else [None] * len(exp.out_avals),
                               rec["kv_blocks"], mesh, "output")
        checked[name] = _Checked(where, data, exp, inputs, outputs)
    return Executables(checked, run_on, mesh)
