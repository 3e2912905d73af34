"""h100 artifacts without nvcc, for tests of what surrounds the kernels (packaging, inspect,
load up to the GPU): `build_h100(out, preset, opts)` builds as `rvcompile build` does, with each
cubin replaced by a stub ELF that declares the kernels the schedule launches (and the piece
hash's) and their parameter sizes (what artifacts/cubin.py reads and the build checks), and no
code. Such an artifact must never reach a GPU: the tests that use it stop at the machine check."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.build import BuildOptions, build_artifact

_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
EM_CUDA = 190
SHT_PROGBITS, SHT_STRTAB = 1, 3
EIFMT_SVAL, EIATTR_KPARAM_INFO = 0x04, 0x17
STUB_NVCC = "Build cuda_13.0.r13.0/compiler.stub_0 (tests/stub_cubins.py: no nvcc)"


def stub_cubin(kernels: dict[str, tuple[int, ...]]) -> bytes:
    """A little-endian ELF64 whose sections `.text.K` (empty) and `.nv.info.K` (one
    EIATTR_KPARAM_INFO record per parameter) declare each kernel K with its parameter sizes."""
    sections = [(".shstrtab", SHT_STRTAB, b"")]  # its bytes are filled in below
    for name, sizes in sorted(kernels.items()):
        info, offset = b"", 0
        for ordinal, size in enumerate(sizes):
            info += struct.pack("<BBH", EIFMT_SVAL, EIATTR_KPARAM_INFO, 12)
            info += struct.pack("<IHHI", 0, ordinal, offset, size << 18)
            offset += size
        sections += [(f".text.{name}", SHT_PROGBITS, b""), (f".nv.info.{name}", 0x70000000, info)]
    names = b"\0"
    name_at = []
    for name, _, _ in sections:
        name_at.append(len(names))
        names += name.encode() + b"\0"
    sections[0] = (".shstrtab", SHT_STRTAB, names)
    body, placed = b"", []
    for _, _, data in sections:
        placed.append(_ELF_HEADER.size + len(body))
        body += data
    shoff = _ELF_HEADER.size + len(body)
    table = _SECTION.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)  # section 0: SHN_UNDEF
    for (_, kind, data), name, at in zip(sections, name_at, placed, strict=True):
        table += _SECTION.pack(name, kind, 0, 0, at, len(data), 0, 0, 1, 0)
    header = _ELF_HEADER.pack(b"\x7fELF\x02\x01\x01" + bytes(9), 2, EM_CUDA, 1, 0, 0, shoff, 0,
                              _ELF_HEADER.size, 0, 0, _SECTION.size, len(sections) + 1, 1)
    return header + body + table


def _kernels_by_module(schedule: KernelSchedule) -> dict[str, dict[str, tuple[int, ...]]]:
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for entry in schedule.entries.values():
        for x in entry.launches:
            out.setdefault(x.module, {})[x.kernel] = tuple(schedule.arg_bytes(a) for a in x.args)
    return out


@contextmanager
def stub_nvcc() -> Iterator[None]:
    """Within the block, h100 builds (`build_artifact`, `rvcompile build` and `rebuild` run in
    this process) put stub cubins in place of nvcc's (the CUDA 13.0 driver is what the header
    then asks for)."""
    import pytest

    from rvcompile.artifacts.piece_hash import PARAM_BYTES
    from rvcompile.targets.h100 import lower, sha256, target

    kernels: dict[str, dict[str, tuple[int, ...]]] = {sha256.SOURCE: {sha256.ENTRY: PARAM_BYTES}}
    real_lower = lower.lower_to_h100

    def lower_and_note(*args, **kwargs):
        lowering = real_lower(*args, **kwargs)
        kernels.update(_kernels_by_module(lowering.schedule))
        return lowering

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lower, "lower_to_h100", lower_and_note)
        mp.setattr(target, "compile_cubin", lambda module: stub_cubin(kernels[module]))
        mp.setattr(target, "nvcc_version", lambda: STUB_NVCC)
        mp.setattr(target, "min_driver", lambda: 13000)
        yield


def build_h100(out: Path, model: str, opts: BuildOptions, random_weights: bool = True) -> Path:
    """`rvcompile build MODEL [--random-weights]` for an h100 target, stub cubins in place of
    nvcc's."""
    with stub_nvcc():
        build_artifact(model, out, opts, random_weights=random_weights, progress=False,
                       log=lambda s: None)
    return out
