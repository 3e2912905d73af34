"""Shared by the H100 tests: a CUDA context on a compute-capability-9.0 GPU, or a clean skip where
there is none (the CPU machine, CI); the schedule on the CPU reference device."""

from __future__ import annotations

import pytest


def h100_context():
    try:
        from rvcompile.runtime.executors.cuda_driver import CudaContext, CudaError

        ctx = CudaContext()
    except (ImportError, CudaError) as e:
        pytest.skip(f"needs an NVIDIA GPU and cuda-python ({e})")
    if ctx.compute_capability != (9, 0):
        pytest.skip(f"sm_90a kernels need compute capability 9.0, not {ctx.compute_capability}")
    return ctx


def reference_executor(art):
    """`art`'s kernel schedule on the CPU: the runtime's ScheduledExecutor over the target's
    ReferenceDevice, composed here because targets never import the runtime."""
    from rvcompile.runtime.executors.scheduled import ScheduledExecutor
    from rvcompile.targets.h100.reference_executor import reference_device

    device = reference_device(art)
    return ScheduledExecutor(device.schedule, device)


def own_tables(executor, i: int) -> dict[str, list[int]]:
    """Block tables giving sequence i its own blocks: [i * width, (i + 1) * width) per kind."""
    return {k.name: list(range(i * k.table_width, (i + 1) * k.table_width))
            for k in executor.kinds.values()}


def decode_three_together(model) -> tuple[list[list[int]], list[list[int]]]:
    """(tokens of three sequences prefilled and then decoded together in one decode call per
    step, the same three generated one at a time through `model.generate`), greedy, 6 each."""
    from oracle import random_token_ids

    from rvcompile.runtime.executor_api import SeqChunk

    ex = model.executor
    prompts = [random_token_ids(n, seed=s).tolist() for n, s in ((5, 1), (19, 2), (33, 3))]
    solo = [model.generate(p, max_tokens=6, ignore_eos=True).token_ids for p in prompts]
    together = []
    for i, p in enumerate(prompts):
        for s in range(0, len(p), ex.max_chunk):
            tok = ex.prefill(SeqChunk(p[s:s + ex.max_chunk], s, own_tables(ex, i)))
        together.append([tok])
    for step in range(5):
        lanes = [SeqChunk([seq[-1]], len(p) + step, own_tables(ex, i))
                 for i, (p, seq) in enumerate(zip(prompts, together, strict=True))]
        for seq, tok in zip(together, ex.decode(lanes), strict=True):
            seq.append(tok)
    return together, solo
