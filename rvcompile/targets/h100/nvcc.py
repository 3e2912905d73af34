"""Compile the target's CUDA sources to sm_90a cubins with nvcc, cached by content hash.

The cache key covers the module's bytes, the bytes of every header (`*.cuh`) in the kernel
directory, every flag and the nvcc version, so a rebuild with unchanged sources compiles nothing
and a change to a module or to any header it may include recompiles. Modules include headers by
name from the kernel directory (passed as `-I`); the key hashes all headers rather than parsing
includes, so it cannot miss one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a")


class NvccError(RuntimeError):
    """nvcc is missing or rejected a source; the message names the file."""


def nvcc_path() -> str:
    path = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(path).exists():
        raise NvccError("nvcc not found: the h100 target compiles its kernels at build time")
    return path


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


def nvcc_version() -> str:
    """e.g. "Build cuda_13.0.r13.0/compiler.36424714_0"."""
    return _nvcc_version(nvcc_path())


def min_driver() -> int:
    """The CUDA driver API version (cuDriverGetVersion, e.g. 13000) that loads these cubins:
    the toolkit's own major.minor."""
    release = re.search(r"cuda_(\d+)\.(\d+)", nvcc_version())
    if not release:
        raise NvccError(f"cannot read the CUDA release from {nvcc_version()!r}")
    return int(release.group(1)) * 1000 + int(release.group(2)) * 10


def cache_key(src: Path, version: str) -> str:
    """The cubin cache key of module `src`: its bytes, every `*.cuh` beside it (sorted by name),
    NVCC_FLAGS and the nvcc `version` line. Each part is hashed separately, so no two different
    inputs concatenate to the same bytes."""
    parts = [src.read_bytes()]
    for header in sorted(src.parent.glob("*.cuh")):
        parts += [header.name.encode(), header.read_bytes()]
    parts += [repr(NVCC_FLAGS).encode(), version.encode()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:24]


def compile_cubin(source: str, cache_dir: Path | None = None) -> bytes:
    """The sm_90a cubin of kernels/<source>."""
    src = KERNEL_DIR / source
    nvcc = nvcc_path()
    key = cache_key(src, _nvcc_version(nvcc))
    cache = cache_dir or Path(os.environ.get("RVCOMPILE_CACHE",
                                             Path.home() / ".cache" / "rvcompile")) / "cubin"
    out = cache / f"{src.stem}-{key}.cubin"
    if out.exists():
        return out.read_bytes()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    p = subprocess.run([nvcc, *NVCC_FLAGS, "-I", str(KERNEL_DIR), "-o", str(tmp), str(src)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = (p.stderr.strip().splitlines() or ["(no output)"])[0]
        raise NvccError(f"{src.name}: nvcc failed: {first}")
    tmp.replace(out)
    return out.read_bytes()
