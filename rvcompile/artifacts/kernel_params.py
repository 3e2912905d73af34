"""A kernel-parameter template: the by-value parameter block of a kernel that takes one large
struct (CUTLASS's `Params`), learned at build time (targets/h100/gemm_tc.py probes it) and
completed at load by the runtime (executors/tma.py), which never runs the kernel library's host
code. Written by the build, read by the runtime, so it imports nothing from the compiler.

The template holds the struct's bytes for one problem shape with every address zeroed, and where
the addresses go. Addresses come in roles (e.g. "a", "b", "d", "a_scale", "b_scale"), each one
device buffer the caller names at load. Two kinds of places:
- a pointer: 8 bytes at `offset`, the little-endian address of its role plus `delta`;
- a TMA descriptor (CUtensorMap): 128 bytes at a 64-byte-aligned `offset`, the output of
  cuTensorMapEncodeTiled with these arguments and globalAddress = the role's address + `delta`.
Every byte outside those places is passed as stored.

JSON form (ParamsTemplate.to_json): {"kernel", "grid", "block", "smem", "bytes" (hex),
"roles", "pointers": [{"offset", "role", "delta"}], "descriptors": [{"offset", "role", "delta",
"dtype", "rank", "dims", "strides", "box", "elem_strides", "interleave", "swizzle",
"l2_promotion", "oob_fill"}]}; from_json checks every field and names the first bad one.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PARAM_BYTES = 4096  # the classic kernel-parameter limit; CUTLASS's Params stay well under
DESCRIPTOR_BYTES = 128
DESCRIPTOR_ALIGN = 64


class ParamsTemplateError(ValueError):
    """A template that cannot be right; the message names the field."""


@dataclass(frozen=True)
class PointerSlot:
    offset: int  # byte offset in the struct, 8-aligned
    role: str
    delta: int  # bytes past the role's address


@dataclass(frozen=True)
class DescriptorSlot:
    offset: int  # byte offset in the struct, 64-aligned
    role: str
    delta: int  # globalAddress = the role's address + delta
    dtype: int  # CUtensorMapDataType
    rank: int  # 1..5
    dims: tuple[int, ...]  # globalDim, `rank` entries (elements)
    strides: tuple[int, ...]  # globalStrides, rank - 1 entries (bytes)
    box: tuple[int, ...]  # boxDim, `rank` entries
    elem_strides: tuple[int, ...]  # elementStrides, `rank` entries
    interleave: int  # CUtensorMapInterleave
    swizzle: int  # CUtensorMapSwizzle
    l2_promotion: int  # CUtensorMapL2promotion
    oob_fill: int  # CUtensorMapFloatOOBfill


@dataclass(frozen=True)
class ParamsTemplate:
    kernel: str  # the entry this block is passed to
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int  # dynamic shared memory bytes
    template: bytes  # the struct, every address place zeroed
    roles: tuple[str, ...]  # the buffers the caller must name
    pointers: tuple[PointerSlot, ...]
    descriptors: tuple[DescriptorSlot, ...]

    def __post_init__(self) -> None:
        _validate(self)

    def to_json(self) -> dict:
        return {
            "kernel": self.kernel, "grid": list(self.grid), "block": list(self.block),
            "smem": self.smem, "bytes": self.template.hex(), "roles": list(self.roles),
            "pointers": [{"offset": p.offset, "role": p.role, "delta": p.delta}
                         for p in self.pointers],
            "descriptors": [{"offset": d.offset, "role": d.role, "delta": d.delta,
                             "dtype": d.dtype, "rank": d.rank, "dims": list(d.dims),
                             "strides": list(d.strides), "box": list(d.box),
                             "elem_strides": list(d.elem_strides), "interleave": d.interleave,
                             "swizzle": d.swizzle, "l2_promotion": d.l2_promotion,
                             "oob_fill": d.oob_fill} for d in self.descriptors],
        }

    @classmethod
    def from_json(cls, d: dict) -> ParamsTemplate:
        try:
            return cls(
                kernel=_str(d["kernel"], "kernel"), grid=_ints(d["grid"], "grid", 3),
                block=_ints(d["block"], "block", 3), smem=_int(d["smem"], "smem"),
                template=_hex(d["bytes"]), roles=tuple(_str(r, "roles") for r in d["roles"]),
                pointers=tuple(PointerSlot(_int(p["offset"], "pointers.offset"),
                                           _str(p["role"], "pointers.role"),
                                           _int(p["delta"], "pointers.delta"))
                               for p in d["pointers"]),
                descriptors=tuple(_descriptor(x) for x in d["descriptors"]))
        except (KeyError, TypeError) as e:
            raise ParamsTemplateError(f"params template: missing or malformed field {e}") from None


def _descriptor(x: dict) -> DescriptorSlot:
    rank = _int(x["rank"], "descriptors.rank")
    return DescriptorSlot(
        offset=_int(x["offset"], "descriptors.offset"), role=_str(x["role"], "descriptors.role"),
        delta=_int(x["delta"], "descriptors.delta"), dtype=_int(x["dtype"], "descriptors.dtype"),
        rank=rank, dims=_ints(x["dims"], "descriptors.dims", rank),
        strides=_ints(x["strides"], "descriptors.strides", rank - 1),
        box=_ints(x["box"], "descriptors.box", rank),
        elem_strides=_ints(x["elem_strides"], "descriptors.elem_strides", rank),
        interleave=_int(x["interleave"], "descriptors.interleave"),
        swizzle=_int(x["swizzle"], "descriptors.swizzle"),
        l2_promotion=_int(x["l2_promotion"], "descriptors.l2_promotion"),
        oob_fill=_int(x["oob_fill"], "descriptors.oob_fill"))


def _int(v, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ParamsTemplateError(f"params template: {field} must be a non-negative integer, "
                                  f"not {v!r}")
    return v


def _ints(v, field: str, n: int) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or len(v) != n:
        raise ParamsTemplateError(f"params template: {field} must hold {n} integers, not {v!r}")
    return tuple(_int(x, field) for x in v)


def _str(v, field: str) -> str:
    if not isinstance(v, str) or not v:
        raise ParamsTemplateError(f"params template: {field} must be a non-empty string")
    return v


def _hex(v) -> bytes:
    try:
        return bytes.fromhex(v)
    except (TypeError, ValueError):
        raise ParamsTemplateError("params template: bytes must be a hex string") from None


def _validate(t: ParamsTemplate) -> None:
    size = len(t.template)
    if not 0 < size <= MAX_PARAM_BYTES:
        raise ParamsTemplateError(f"params template: {size} bytes, not 1..{MAX_PARAM_BYTES}")
    if len(set(t.roles)) != len(t.roles):
        raise ParamsTemplateError(f"params template: roles {t.roles} repeat a name")
    if any(v < 1 for v in (*t.grid, *t.block)):
        raise ParamsTemplateError(f"params template: grid {t.grid} / block {t.block} "
                                  "must be positive")
    places = [(p.offset, 8, 8, p.role, "pointer") for p in t.pointers]
    for d in t.descriptors:
        places.append((d.offset, DESCRIPTOR_BYTES, DESCRIPTOR_ALIGN, d.role, "descriptor"))
        if not 1 <= d.rank <= 5:
            raise ParamsTemplateError(f"params template: descriptor rank {d.rank}, not 1..5")
    end = 0
    for offset, length, align, role, kind in sorted(places):
        if role not in t.roles:
            raise ParamsTemplateError(f"params template: {kind} at {offset} has role {role!r}, "
                                      f"not one of {t.roles}")
        if offset % align or offset + length > size:
            raise ParamsTemplateError(f"params template: {kind} at {offset} is not "
                                      f"{align}-aligned inside the {size} bytes")
        if offset < end:
            raise ParamsTemplateError(f"params template: {kind} at {offset} overlaps another")
        end = offset + length
        if any(t.template[offset:offset + length]):
            raise ParamsTemplateError(f"params template: {kind} at {offset} is not zeroed")
