"""What a cubin says about its kernels, read from the ELF without the CUDA driver: each kernel's
parameter sizes in order and the most threads a block of it may have.

An sm_90 cubin is a little-endian ELF64 file. A kernel K has a code section `.text.K` and an
attribute section `.nv.info.K`: records of (format u8, attribute u8, u16 value or length, then
`length` bytes for format EIFMT_SVAL). Two attributes matter here:
    EIATTR_KPARAM_INFO (0x17): one per parameter: index u32, ordinal u16, offset u16, then a u32
                               whose bits 18..31 are the parameter's size in bytes;
    EIATTR_MAX_THREADS (0x05): the block limit from __launch_bounds__, as x, y, z u32.
The schedule's launches are checked against this (artifacts/contents.py), so a schedule that
passes the wrong number or size of arguments, names a kernel its module lacks, or launches more
threads than the kernel was compiled for is refused before anything reaches the GPU. Malformed
bytes give CubinError.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
SHT_NOBITS = 8
EIFMT_SVAL = 0x04
EIATTR_KPARAM_INFO = 0x17
EIATTR_MAX_THREADS = 0x05


class CubinError(ValueError):
    """Bytes that are not a cubin this reader understands; the message says where."""


@dataclass(frozen=True)
class Kernel:
    name: str
    param_sizes: tuple[int, ...]  # bytes of each parameter, in order
    max_threads: int | None  # per block, from __launch_bounds__; None when unbounded


def kernels(data: bytes | memoryview) -> dict[str, Kernel]:
    """The kernels of cubin `data` by name."""
    data = bytes(data)
    try:
        return _kernels(data)
    except CubinError:
        raise
    except (struct.error, ValueError, IndexError) as e:  # offsets past the end, bad names
        raise CubinError(f"malformed ELF ({e})") from None


def _kernels(data: bytes) -> dict[str, Kernel]:
    if len(data) < _ELF_HEADER.size or data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        raise CubinError("not a little-endian ELF64 file")
    fields = _ELF_HEADER.unpack_from(data)
    shoff, shentsize, shnum, shstrndx = fields[6], fields[11], fields[12], fields[13]
    if shentsize != _SECTION.size or shstrndx >= shnum:
        raise CubinError(f"bad section table (entry size {shentsize}, {shnum} sections)")
    sections = {}
    spans = []
    for i in range(shnum):
        name, kind, _, _, offset, size, *_ = _SECTION.unpack_from(data, shoff + i * shentsize)
        if kind == SHT_NOBITS:  # occupies no file bytes (shared memory sizes)
            size = 0
        if offset + size > len(data):
            raise CubinError(f"section {i} ends past the file")
        spans.append((name, offset, size))
    names_at = spans[shstrndx][1]
    for name, offset, size in spans:
        end = data.index(b"\0", names_at + name)
        sections[data[names_at + name:end].decode()] = (offset, size)
    out = {}
    for section, (offset, size) in sections.items():
        kernel = section.removeprefix(".nv.info.")
        if kernel != section and f".text.{kernel}" in sections:
            out[kernel] = _kernel(kernel, data[offset:offset + size])
    return out


def _kernel(name: str, info: bytes) -> Kernel:
    params: dict[int, int] = {}
    max_threads = None
    pos = 0
    while pos < len(info):
        fmt, attr, value = struct.unpack_from("<BBH", info, pos)
        pos += 4
        if fmt != EIFMT_SVAL:
            continue
        body = info[pos:pos + value]
        pos += value
        if len(body) != value:
            raise CubinError(f"kernel {name}: attribute 0x{attr:02x} ends past its section")
        if attr == EIATTR_KPARAM_INFO:
            _, ordinal, _, bits = struct.unpack_from("<IHHI", body)
            if ordinal in params:
                raise CubinError(f"kernel {name}: parameter {ordinal} described twice")
            params[ordinal] = (bits >> 18) & 0x3FFF
        elif attr == EIATTR_MAX_THREADS:
            max_threads = math.prod(struct.unpack_from("<III", body))
    if sorted(params) != list(range(len(params))):
        raise CubinError(f"kernel {name}: parameter ordinals {sorted(params)} have gaps")
    return Kernel(name, tuple(params[i] for i in range(len(params))), max_threads)
