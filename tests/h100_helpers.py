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


def reference_model(path):
    """The artifact at `path` as a Model over its schedule on the CPU (reference_executor)."""
    from rvcompile.artifacts import Artifact
    from rvcompile.runtime.model import Model

    art = Artifact.open(path)
    return Model(art, reference_executor(art))


def prompt_ids(m, n: int = 24) -> list[int]:
    """The first n tokens of the default model's held-out sample, in m's tokenizer."""
    from pathlib import Path

    sample = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny" / \
        "heldout_sample.txt"
    return m.encode(sample.read_text()[:400])[:n]


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


# How far apart two call shapes of an h100-fp8 build may put the top two logits of a position
# and still disagree on which is first: a verify row and a decode lane (or the GPU and the numpy
# reference) sum the same bf16-activation products in different orders, and a row's rounding to
# bf16 between kernels can then land on either side. Measured gaps at the tiny model's
# divergences are in docs/BENCHMARKS.md; a real error puts the tokens far further apart.
TIE_GAP = 0.05


def assert_greedy_equal_or_tied(model, prompt, want: list[int], got: list[int]) -> None:
    """`got` == `want` token for token, or they part where `want`'s path has a near-tie: at the
    first position they differ, both tokens are its top two teacher-forced logits and those are
    within TIE_GAP (after it the paths continue different texts, so nothing more compares)."""
    import numpy as np

    i = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if i is None:
        assert len(got) == len(want)
        return
    logits = model.logits(list(prompt) + list(want[:i]))[-1]
    top2 = [int(t) for t in np.argsort(logits)[-2:]]
    gap = float(logits[top2[1]] - logits[top2[0]])
    print(f"\n[measured] greedy paths part at token {i}: {want[i]} / {got[i]}, top-2 logit gap "
          f"{gap:.4f}")
    assert {want[i], got[i]} == set(top2) and gap < TIE_GAP, (i, want[i], got[i], top2, gap)


def bare_engine(executor, **kw):
    """An Engine over `executor` that detokenizes nothing and knows no EOS (token ids only)."""
    from rvcompile.runtime.engine import Engine

    return Engine(executor, lambda ids: "", frozenset(), vocab_size=executor.schedule.vocab_size,
                  **kw)


def run_requests(eng, requests, max_steps: int = 400) -> dict[str, list[int]]:
    """Add `requests` to `eng` and step it until they all finish; each request's token ids."""
    for r in requests:
        eng.add(r)
    out: dict[str, list[int]] = {r.id: [] for r in requests}
    for _ in range(max_steps):
        for o in eng.step():
            out[o.id] += o.token_ids
        if not eng.has_work():
            return out
    raise AssertionError("the engine did not finish")


# what writes an FP8 GEMM's e4m3 activations: quant_fp8_rows, or the _q twin of the launch
# writing the rows (launches.EntryLowering.emit_quantizable)
QUANTIZERS = {"quant_fp8_rows_bf16", "rmsnorm_bf16_q", "residual_rmsnorm_q", "gelu_mul_q"}


def gemm_quantizer(launches, i: int):
    """The last launch before launches[i] (an FP8 tensor-core GEMM) writing its operand a, whose
    scales must be the GEMM's a_scale."""
    roles = {x.name: x.value for x in launches[i].args}["params"].roles
    for x in reversed(launches[:i]):
        args = {y.name: y.value for y in x.args}
        if args.get("q") == roles["a"]:
            assert args.get("scale", args.get("q_scale")) == roles["a_scale"], x.kernel
            return x
    raise AssertionError(f"nothing writes launch {i}'s operand a")
