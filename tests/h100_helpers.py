"""Shared by the H100 kernel tests: a CUDA context on a compute-capability-9.0 GPU, or a clean
skip where there is none (the CPU machine, CI)."""

from __future__ import annotations

import pytest


def h100_context():
    try:
        from rvcompile.runtime.cuda_driver import CudaContext, CudaError

        ctx = CudaContext()
    except (ImportError, CudaError) as e:
        pytest.skip(f"needs an NVIDIA GPU and cuda-python ({e})")
    if ctx.compute_capability != (9, 0):
        pytest.skip(f"sm_90a kernels need compute capability 9.0, not {ctx.compute_capability}")
    return ctx


def own_tables(executor, i: int) -> dict[str, list[int]]:
    """Block tables giving sequence i its own blocks: [i * width, (i + 1) * width) per kind."""
    return {k.name: list(range(i * k.table_width, (i + 1) * k.table_width))
            for k in executor.kinds.values()}
