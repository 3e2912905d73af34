"""Complete a kernel-parameter template (rvcompile/artifacts/kernel_params.py) for real device
addresses: each TMA descriptor encoded with the driver's cuTensorMapEncodeTiled (cuda-python),
each pointer written, into a copy of the template's bytes. Done once per set of addresses (at
load, once per arena address); the result is passed by value as the kernel's one parameter.
Nothing compiles and no kernel library's host code runs.

`cu` is cuda-python's `cuda.bindings.driver` (CudaContext.cu) or, in tests, a stand-in with the
same cuTensorMapEncodeTiled, CUtensorMap* enum and cuuint* names.
"""

from __future__ import annotations

import ctypes
import struct

from rvcompile.artifacts.kernel_params import DESCRIPTOR_ALIGN, DESCRIPTOR_BYTES, ParamsTemplate
from rvcompile.runtime.executors.cuda_driver import check

ADDRESS_ALIGN = 16  # TMA global addresses; the vectorized scale loads need the same


def fill(cu, template: ParamsTemplate, addresses: dict[str, int]) -> bytes:
    """The parameter bytes of `template` for the device `addresses` of its roles."""
    if set(addresses) != set(template.roles):
        raise ValueError(f"{template.kernel}: addresses for roles {sorted(addresses)}, the "
                         f"template needs {sorted(template.roles)}")
    out = bytearray(template.template)
    for p in template.pointers:
        out[p.offset:p.offset + 8] = struct.pack("<Q", _address(template, addresses, p))
    for d in template.descriptors:
        out[d.offset:d.offset + DESCRIPTOR_BYTES] = encode_tiled(
            cu, d, _address(template, addresses, d))
    return bytes(out)


def encode_tiled(cu, d, address: int) -> bytes:
    """The 128 bytes of the CUtensorMap that descriptor slot `d` describes at `address`."""
    tensor_map = check(cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType(d.dtype), d.rank, address,
        [cu.cuuint64_t(v) for v in d.dims], [cu.cuuint64_t(v) for v in d.strides],
        [cu.cuuint32_t(v) for v in d.box], [cu.cuuint32_t(v) for v in d.elem_strides],
        cu.CUtensorMapInterleave(d.interleave), cu.CUtensorMapSwizzle(d.swizzle),
        cu.CUtensorMapL2promotion(d.l2_promotion), cu.CUtensorMapFloatOOBfill(d.oob_fill)),
        f"cuTensorMapEncodeTiled({d.role})")
    raw = ctypes.string_at(int(tensor_map.getPtr()), DESCRIPTOR_BYTES)
    return raw


def _address(template: ParamsTemplate, addresses: dict[str, int], slot) -> int:
    address = int(addresses[slot.role]) + slot.delta
    if address <= 0 or address % ADDRESS_ALIGN:
        raise ValueError(f"{template.kernel}: address {address:#x} of {slot.role} (+{slot.delta})"
                         f" is not a {ADDRESS_ALIGN}-byte-aligned device address")
    return address


class KernelParams:
    """Parameter bytes as one kernel argument for CudaContext.launch / pack_args, in host memory
    aligned like the struct's descriptors."""

    def __init__(self, data: bytes):
        self._owner = (ctypes.c_uint8 * (len(data) + DESCRIPTOR_ALIGN))()
        start = -ctypes.addressof(self._owner) % DESCRIPTOR_ALIGN
        self.arg = (ctypes.c_uint8 * len(data)).from_buffer(self._owner, start)
        ctypes.memmove(self.arg, data, len(data))
