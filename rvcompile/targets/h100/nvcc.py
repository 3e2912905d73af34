"""Compile the target's CUDA sources to sm_90a cubins with nvcc, cached by content hash.

The cache key covers the module's bytes, the bytes of every header (`*.cuh`) in the kernel
directory, every flag and the nvcc version, so a rebuild with unchanged sources compiles nothing
and a change to a module or to any header it may include recompiles. Modules include headers by
name from the kernel directory (passed as `-I`); the key hashes all headers rather than parsing
includes, so it cannot miss one.

Sources compile from a fixed place, not from where rvcompile is installed: nvcc names a
translation unit's internal symbols after the real path of its source file, and CUTLASS's
device asserts keep the real paths of its headers, so the same sources compiled from two install
paths gave two different cubins (seen for sample.cu and the CUTLASS module). A compile copies
the module and the headers its key covers into STAGE/<module>-<key>/ (and, for a CUTLASS module,
the wheel's headers into STAGE/cutlass-<their digest>/) and compiles there: the path is a
function of the key, so a cached cubin and a fresh one agree, and a rebuild on another machine,
from another virtualenv, gets the same bytes from the same nvcc.

A module that includes CUTLASS (`#include "cutlass/..."` or `"cute/..."`) compiles against the
headers of the `nvidia-cutlass` wheel (the `build` extra) with CUTLASS_FLAGS, and its key also
covers the wheel's version and CUTLASS's own version header. Such a module may also hold a
host-side probe (compile_host_probe): the same source built as a host executable with one macro
defined, run at build time to learn what the runtime needs (e.g. a kernel's parameter layout).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
# Fixed on purpose (not tempfile.gettempdir(), which TMPDIR moves): the path is in the cubins.
STAGE = Path("/tmp/rvcompile-nvcc")
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a")
CUTLASS_FLAGS = ("--expt-relaxed-constexpr",)
# The probe links a stub in place of the driver's cuTensorMapEncodeTiled and needs no libcuda;
# static C++ runtime libraries let it run on the GPU machine's image too.
PROBE_FLAGS = ("-O1", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
               "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL",
               "-Xcompiler=-static-libstdc++,-static-libgcc")


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


def uses_cutlass(src: Path) -> bool:
    """Whether module `src` includes CUTLASS or CuTe headers."""
    return re.search(rb'#include\s+"(cutlass|cute)/', src.read_bytes()) is not None


def cutlass_include() -> Path:
    """The CUTLASS headers of the installed `nvidia-cutlass` wheel (found without importing
    it)."""
    spec = importlib.util.find_spec("cutlass_library")
    include = Path(spec.origin).parent / "source" / "include" if spec and spec.origin else None
    if include is None or not (include / "cutlass" / "version.h").exists():
        raise NvccError("CUTLASS headers not found: the FP8 tensor-core GEMM builds against the "
                        "nvidia-cutlass wheel (pip install 'rvcompile[build]')")
    return include


def cutlass_version() -> str:
    """What of CUTLASS a module's key covers: the wheel's version, the sha256 of CUTLASS's version
    header and CUTLASS_FLAGS."""
    header = hashlib.sha256((cutlass_include() / "cutlass" / "version.h").read_bytes())
    return (f"nvidia-cutlass {importlib.metadata.version('nvidia-cutlass')} "
            f"version.h {header.hexdigest()[:16]} {CUTLASS_FLAGS!r}")


def cache_key(src: Path, version: str, cutlass: str = "") -> str:
    """The cubin cache key of module `src`: its bytes, every `*.cuh` beside it (sorted by name),
    NVCC_FLAGS, the nvcc `version` line, STAGE and, for a CUTLASS module, `cutlass`
    (cutlass_version).
    Each part is hashed separately, so no two different inputs concatenate to the same bytes."""
    parts = [src.read_bytes()]
    for header in sorted(src.parent.glob("*.cuh")):
        parts += [header.name.encode(), header.read_bytes()]
    # STAGE: where it compiles is in the cubin (module docstring)
    parts += [repr(NVCC_FLAGS).encode(), version.encode(), str(STAGE).encode()]
    if cutlass:
        parts.append(cutlass.encode())
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:24]


def _cache_dir(cache_dir: Path | None) -> Path:
    return cache_dir or Path(os.environ.get("RVCOMPILE_CACHE",
                                            Path.home() / ".cache" / "rvcompile")) / "cubin"


def _staged(directory: Path, files: list[Path], name: str) -> Path:
    """`files` (under `directory`) copied to STAGE/<name>/ with their relative paths (made once,
    atomically: a copy under a temporary name, then a rename; a concurrent stager's finished
    copy is as good). `name` must identify the files' bytes."""
    final = STAGE / name
    if final.is_dir():
        return final
    try:
        STAGE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=STAGE))
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep other users' builds out
        for f in files:
            (tmp / f.relative_to(directory)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, tmp / f.relative_to(directory))
        try:
            tmp.rename(final)
        except OSError:  # another build staged the same files first
            shutil.rmtree(tmp)
            if not final.is_dir():
                raise
    except OSError as e:
        raise NvccError(f"cannot stage the kernel sources in {STAGE}: {e.strerror or e}") from e
    return final


def _cutlass_staged() -> Path:
    """The wheel's CUTLASS headers in STAGE/cutlass-<digest of their names and bytes>/."""
    include = cutlass_include()
    files = sorted(f for f in include.rglob("*") if f.is_file())
    digest = hashlib.sha256()
    for f in files:
        digest.update(hashlib.sha256(str(f.relative_to(include)).encode()).digest())
        digest.update(hashlib.sha256(f.read_bytes()).digest())
    return _staged(include, files, f"cutlass-{digest.hexdigest()[:16]}")


def _run_nvcc(src: Path, key: str, out: Path, args: list[str], cutlass: bool) -> None:
    """nvcc `args` on module `src` staged under its cache `key` (with the CUTLASS headers when
    `cutlass`), writing `out` atomically (a temporary name, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    kernels = _staged(KERNEL_DIR, [src, *sorted(src.parent.glob("*.cuh"))],
                      f"{src.stem}-{key}")
    includes = ["-I", str(kernels)]
    if cutlass:
        includes = [*CUTLASS_FLAGS, "-I", str(_cutlass_staged()), *includes]
    p = subprocess.run([*args, *includes, "-o", str(tmp), str(kernels / src.name)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
        first = (errors or p.stderr.strip().splitlines() or ["(no output)"])[0]
        raise NvccError(f"{src.name}: nvcc failed: {first}")
    tmp.replace(out)


def compile_cubin(source: str, cache_dir: Path | None = None) -> bytes:
    """The sm_90a cubin of kernels/<source>."""
    src = KERNEL_DIR / source
    nvcc = nvcc_path()
    cutlass = uses_cutlass(src)
    key = cache_key(src, _nvcc_version(nvcc), cutlass_version() if cutlass else "")
    out = _cache_dir(cache_dir) / f"{src.stem}-{key}.cubin"
    if not out.exists():
        _run_nvcc(src, key, out, [nvcc, *NVCC_FLAGS], cutlass)
    return out.read_bytes()


def compile_host_probe(source: str, define: str, cache_dir: Path | None = None) -> Path:
    """kernels/<source> built as a host executable with macro `define` set (its probe section),
    cached beside the cubins under the module's key; returns the executable's path."""
    src = KERNEL_DIR / source
    nvcc = nvcc_path()
    cutlass = uses_cutlass(src)
    key = cache_key(src, _nvcc_version(nvcc), cutlass_version() if cutlass else "")
    flags_key = hashlib.sha256(repr((define, PROBE_FLAGS)).encode()).hexdigest()[:8]
    out = _cache_dir(cache_dir) / f"{src.stem}-{key}-probe-{flags_key}"
    if not out.exists():
        _run_nvcc(src, key, out, [nvcc, *PROBE_FLAGS, f"-D{define}"], cutlass)
    return out
