"""Programmatic dependent launch (CPU only, no nvcc, no GPU): the runtime launches every kernel
with programmatic stream serialization, so a kernel may start while its predecessor still runs;
that is correct only if every kernel entry of the h100 modules opens with pdl_wait() (before any
global read or write) and then pdl_launch_dependents() (kernels/common.cuh). Checked on the
source, macro-made entries included; the GPU suite checks the results.
"""

from __future__ import annotations

import ctypes
import re
from types import SimpleNamespace

import pytest

from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100.nvcc import KERNEL_DIR

ENTRY = re.compile(r'extern\s+"C"\s+__global__\b')
PROLOGUE = "pdl_wait(); pdl_launch_dependents();"


def _entry_bodies(source: str) -> list[tuple[str, str]]:
    """(signature, the start of the body) of each extern "C" kernel, macro lines joined and
    whitespace collapsed."""
    text = re.sub(r"\s+", " ", source.replace("\\\n", " "))
    out = []
    for m in ENTRY.finditer(text):
        brace = text.index("{", m.end())
        out.append((text[m.start():brace], text[brace + 1:].lstrip()))
    return out


def _missing_prologue(source: str) -> list[str]:
    return [sig for sig, body in _entry_bodies(source) if not body.startswith(PROLOGUE)]


@pytest.mark.parametrize("module", sorted(p.name for p in KERNEL_DIR.glob("*.cu")))
def test_every_kernel_waits_first(module) -> None:
    source = (KERNEL_DIR / module).read_text()
    assert _entry_bodies(source), f"{module}: no extern \"C\" kernel found"
    assert _missing_prologue(source) == []


def test_check_catches_a_late_wait() -> None:
    good = ('extern "C" __global__ void k(float* y) {\n    pdl_wait();\n'
            '    pdl_launch_dependents();\n}')
    late = 'extern "C" __global__ void k(float* y) {\n    y[0] = 0.f;\n    pdl_wait();\n}'
    macro = ('#define E(N) \\\n    extern "C" __global__ void N(float* y) { \\\n'
             '        y[0] = 0.f; \\\n        pdl_wait(); \\\n    }\nE(a)')
    assert _missing_prologue(good) == []
    assert len(_missing_prologue(late)) == 1
    assert len(_missing_prologue(macro)) == 1


def test_common_header_emits_the_instructions() -> None:
    header = (KERNEL_DIR / "common.cuh").read_text()
    assert 'asm volatile("griddepcontrol.wait;\\n" ::: "memory")' in header
    assert 'asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory")' in header


class _FakeDriver:
    """The few cuda.bindings.driver names a launch uses; records cuLaunchKernelEx calls."""

    class CUlaunchAttribute:
        def __init__(self):
            self.id = None
            self.value = SimpleNamespace(programmaticStreamSerializationAllowed=0)

    class CUlaunchConfig:
        pass

    CUlaunchAttributeID = SimpleNamespace(
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION="PSS")

    def __init__(self):
        self.calls = []

    def cuLaunchKernelEx(self, config, fn, params, extra):
        self.calls.append((config, fn, params, extra))
        return (0,)


def test_every_launch_allows_programmatic_serialization() -> None:
    ctx = object.__new__(CudaContext)
    ctx.cu = _FakeDriver()
    ctx.launch("fn", (3, 2, 1), (128, 1, 1), 4096, [ctypes.c_uint64(7)], stream="s")
    (config, fn, params, extra), = ctx.cu.calls
    assert fn == "fn" and params != 0 and extra == 0
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (3, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (128, 1, 1)
    assert config.sharedMemBytes == 4096 and config.hStream == "s"
    assert config.numAttrs == 1 and len(config.attrs) == 1
    assert config.attrs[0].id == "PSS"
    assert config.attrs[0].value.programmaticStreamSerializationAllowed == 1
