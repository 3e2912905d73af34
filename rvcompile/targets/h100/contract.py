"""The kernel contract of the H100 target: what each kernel entry takes and computes.

Every kernel module (gemv_fp8.py, norms.py, ...) declares ENTRIES, one `Entry` per
`extern "C" __global__` function of its .cu source: the parameters in the order of the C
signature, each named as there and typed (`Param`: a pointer to memory of some dtype that the
kernel reads, writes or updates, perhaps null; a 32- or 64-bit int; a float; or a parameter
struct passed by value), and the numpy reference of the entry, which does what the kernel does
to a launch's arguments (`Call`). tests/test_h100_contract.py parses every .cu signature and
checks it against the declaration, so the two cannot drift apart. registry.py collects them.

The lowering (launches.py) emits launches with named arguments; `Entry.bind` checks them
(LoweringError naming the kernel and the parameter for a missing, extra or mistyped one) and
puts them in the kernel's order. The kernel schedule stores them named, in that order, each with
its kind (artifacts/kernel_schedule.py), and the runtime packs each by its kind. The reference
executor (reference_executor.py) checks a schedule's launches against the entries and runs each
entry's reference over a numpy arena.

Launch geometry stays beside each module's entries, in its `*_geometry` functions (a GEMM's
picks the entry itself; sample's plans three launches at once); a reference reads the sizes the
kernel takes from its grid (gridDim) from `Call.grid`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from rvcompile.artifacts.kernel_params import ParamsTemplate

KINDS = ("ptr", "i32", "i64", "f32", "params")
ROLES = ("in", "out", "inout")  # read only (const), written only, read and written (in place)
# What a pointer's memory holds, as the reference views it; "bytes": untyped scratch.
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "int32": np.dtype(np.int32),
          "bytes": np.dtype(np.uint8)}
INT_RANGES = {"i32": (-(1 << 31), (1 << 31) - 1), "i64": (-(1 << 63), (1 << 63) - 1)}
FLOAT32_MAX = float(np.finfo(np.float32).max)


class ContractError(ValueError):
    """Arguments that do not fit an entry's parameters; the message names both."""


@dataclass(frozen=True)
class Param:
    name: str  # as in the C signature
    kind: str  # one of KINDS
    dtype: str = ""  # ptr: a key of DTYPES
    role: str = ""  # ptr: one of ROLES
    nullable: bool = False  # ptr: the kernel takes a null pointer (and then skips the buffer)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"param {self.name}: kind {self.kind!r} not one of {KINDS}")
        if (self.kind == "ptr") != (self.dtype in DTYPES and self.role in ROLES) or (
                self.nullable and self.kind != "ptr"):
            raise ValueError(f"param {self.name}: a pointer has a dtype of {sorted(DTYPES)} and "
                             f"a role of {ROLES} and may be nullable; nothing else is any")


def ptr(name: str, dtype: str, role: str = "in", nullable: bool = False) -> Param:
    return Param(name, "ptr", dtype, role, nullable)


def i32(name: str) -> Param:
    return Param(name, "i32")


def i64(name: str) -> Param:
    return Param(name, "i64")


def f32(name: str) -> Param:
    return Param(name, "f32")


@dataclass(frozen=True)
class ParamsValue:
    """The value of a "params" parameter: a struct passed by value, as a template (stored once
    per name in the schedule) and the buffer of each of its roles (the lowering's pointers, arena
    byte offsets once laid out)."""

    name: str  # the template's name in the schedule
    template: ParamsTemplate
    roles: tuple[tuple[str, object], ...]  # (role, pointer), every role of the template once


@dataclass(frozen=True)
class Bound:
    """One argument of a launch, checked against its parameter."""

    param: Param
    value: object  # ptr: a pointer (the lowering's layout.Ref) or None (null); else int/float


@dataclass(frozen=True)
class Entry:
    name: str  # the extern "C" function
    source: str  # the .cu module defining it
    params: tuple[Param, ...]
    reference: Callable[[Call], None] | None  # None: no CPU reference (the executor refuses it)

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: parameter names repeat: {names}")

    def bind(self, args: Mapping[str, object], pointer: type) -> tuple[Bound, ...]:
        """`args` (name -> value; pointers are instances of `pointer`) in the kernel's order,
        scalars as int or float; ContractError naming the kernel and the parameter if any is
        missing, extra or of the wrong kind."""
        extra = sorted(set(args) - {p.name for p in self.params})
        if extra:
            raise ContractError(f"kernel {self.name} has no parameter {extra[0]!r} (it takes "
                                f"{', '.join(p.name for p in self.params)})")
        out = []
        for p in self.params:
            if p.name not in args:
                raise ContractError(f"kernel {self.name}: missing argument {p.name!r}")
            out.append(Bound(p, _value(self.name, p, args[p.name], pointer)))
        return tuple(out)

    def check_stored(self, args: tuple[tuple[str, str], ...]) -> None:
        """That a stored launch's (name, kind) arguments are this entry's, in order; a null
        pointer has kind "null", a KV pool's base kind "pool"."""
        want = [(p.name, p.kind) for p in self.params]
        got = [(name, "ptr" if kind in ("null", "pool") else kind) for name, kind in args]
        if got != want:
            raise ContractError(f"kernel {self.name}: arguments {got}, the entry takes {want}")
        for p, (_, kind) in zip(self.params, args, strict=True):
            if kind == "null" and not p.nullable:
                raise ContractError(f"kernel {self.name}: {p.name} is null; it must not be")


def _value(kernel: str, p: Param, v: object, pointer: type):
    where = f"kernel {kernel}, parameter {p.name} ({p.kind})"
    if p.kind == "ptr":
        if v is None and not p.nullable:
            raise ContractError(f"{where}: null, but the kernel needs the buffer")
        if v is not None and not isinstance(v, pointer):
            raise ContractError(f"{where}: {v!r} is not a pointer")
        return v
    if p.kind in INT_RANGES:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ContractError(f"{where}: {v!r} is not an integer")
        lo, hi = INT_RANGES[p.kind]
        if not lo <= int(v) <= hi:
            raise ContractError(f"{where}: {v} out of range")
        return int(v)
    if p.kind == "f32":
        if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
            raise ContractError(f"{where}: {v!r} is not a number")
        if not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
            raise ContractError(f"{where}: {v} is not a finite float32")
        return float(v)
    if p.kind == "params":
        if not isinstance(v, ParamsValue) or v.template.kernel != kernel:
            raise ContractError(f"{where}: {v!r} is not a parameter block for this kernel")
        roles = [role for role, _ in v.roles]
        if sorted(roles) != sorted(v.template.roles) or len(set(roles)) != len(roles):
            raise ContractError(f"{where}: roles {roles}, the template has {v.template.roles}")
        if not all(isinstance(ref, pointer) for _, ref in v.roles):
            raise ContractError(f"{where}: every role must be a pointer")
        return v
    raise ContractError(f"{where}: the lowering emits no {p.kind} arguments")


class Call:
    """A launch as its entry's reference sees it: the grid, the scalar arguments by name and the
    pointer arguments as numpy views of the arena in their declared dtypes (read-only for
    role "in", so a reference cannot write what the kernel only reads)."""

    def __init__(self, entry: Entry, grid: tuple[int, int, int],
                 args: Mapping[str, int | float | None], arena: np.ndarray):
        self.entry, self.grid, self._args, self._arena = entry, grid, args, arena
        self._params = {p.name: p for p in entry.params}

    def __contains__(self, name: str) -> bool:
        return name in self._params

    def __getitem__(self, name: str) -> int | float:
        if self._params[name].kind == "ptr":
            raise KeyError(f"{self.entry.name}: {name} is a pointer; use array()")
        return self._args[name]

    def null(self, name: str) -> bool:
        return self._args[name] is None

    def region(self, offset: int, dtype: str, shape: tuple[int, ...],
               writable: bool = False) -> np.ndarray:
        """A [shape] view of the arena at byte `offset` (a parameter block's role, which has no
        parameter of its own), read-only unless `writable`."""
        dt = DTYPES[dtype]
        nbytes = math.prod(shape) * dt.itemsize
        if offset < 0 or offset + nbytes > self._arena.size:
            raise ContractError(f"{self.entry.name}: [{offset}, {offset + nbytes}) lies outside "
                                "the arena")
        view = self._arena[offset:offset + nbytes].view(dt).reshape(shape)
        view.flags.writeable = writable
        return view

    def dtype(self, name: str) -> np.dtype:
        return DTYPES[self._params[name].dtype]

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The buffer `name` as a [shape] array of its dtype; None for a null pointer."""
        offset = self._args[name]
        if offset is None:
            return None
        p, dtype = self._params[name], self.dtype(name)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset + nbytes > self._arena.size:
            raise ContractError(f"{self.entry.name}: {name} [{offset}, {offset + nbytes}) lies "
                                "outside the arena")
        view = self._arena[offset:offset + nbytes].view(dtype).reshape(shape)
        if p.role == "in":
            view.flags.writeable = False
        return view
