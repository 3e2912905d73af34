"""h100-f32: the H100 plan with quantization switched off (float32 weights, activations and KV
pools through the kernels' `_f32` entries), which must match the transformers oracle within
float32 rounding.

CPU (the plan on the reference executor, through the normal build path):
- every oracle case: teacher-forced logits of 3 sequences x 40 tokens within F32_BOUND of the
  oracle (the xla-f32 standard, tests/test_oracle.py), greedy tokens equal to the oracle's, and
  greedy decode (chunked prefill + paged decode) equal to the argmax of the plan's own logits;
- the schedule launches only float32 entries and keeps float32 pools.
Measured max abs logit error against the oracle (3 x 40 tokens; oracle logits up to ~7):
    dense 9.7e-06   k_eq_v 8.1e-06   kv_shared 1.3e-05   ple 8.7e-06   moe 7.5e-06   all 2.2e-05
GPU (skipped without one; not yet run on a GPU):
- each launch of an `_f32` entry against its numpy reference on the same arena state (the model's
  real activations, fresh per launch: the GPU arena is reset to the reference's before each);
- the whole h100-f32 artifact on the GPU against the reference executor (logits, greedy tokens).
"""

from __future__ import annotations

import numpy as np
import pytest
from h100_helpers import h100_context
from oracle import ORACLE_CASES, oracle_greedy, oracle_logits, random_token_ids

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.model import Model
from rvcompile.runtime.scheduled_executor import ScheduledExecutor
from rvcompile.targets.h100.reference_executor import ReferenceDevice, reference_executor

OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "slots": 3}
F32_BOUND = 1e-4  # as test_oracle.F32_BOUND: float32 rounding, amplified through 6 layers
SEQ = 40
CASES = sorted(ORACLE_CASES)
# Entries of the quantized plan that read or write bf16/e4m3 values; none may appear here.
NARROW_ENTRIES = ("gemv_fp8_rowscale", "gemv_bf16", "rmsnorm_bf16", "residual_rmsnorm",
                  "gelu_mul", "embed_rows_bf16", "embed_rows_fp8", "select_row_bf16", "to_bf16",
                  "residual_rmsnorm_copy", "ple_combine", "ple_project", "ple_gelu_mul",
                  "qkv_post", "qkv_post_small", "moe_norms", "moe_gate_up", "moe_down",
                  "moe_router_rows")


@pytest.fixture(scope="module")
def built(oracle_dir, tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            hf, ckpt = oracle_dir(case)
            out = tmp_path_factory.mktemp(f"h100f32-{case}") / f"{case}.rvp"
            build_artifact(str(ckpt), out, BuildOptions("h100-f32", **OPTS), progress=False,
                           log=lambda s: None)
            art = Artifact.open(out)
            cache[case] = (hf, out, Model(art, reference_executor(art)))
        return cache[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_f32_plan_matches_oracle(built, case):
    hf, path, m = built(case)
    worst = 0.0
    for seed in (11, 12, 13):
        ids = random_token_ids(SEQ, seed=seed)
        got, want = m.logits(ids), oracle_logits(hf, ids)
        assert np.isfinite(got).all()
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"\n[measured] {case} h100-f32 (reference executor) vs hf32: max abs {worst:.2e}")
    assert worst <= F32_BOUND
    prompt = random_token_ids(37, seed=3)  # longer than one 32-token chunk; windows are 8
    got = m.generate(prompt.tolist(), max_tokens=10, ignore_eos=True).token_ids
    assert got == oracle_greedy(hf, prompt, 10)
    teacher = m.logits(prompt.tolist() + got).argmax(-1)
    assert got == teacher[len(prompt) - 1:-1].tolist()


def test_f32_schedule_is_float32_throughout(built):
    _, path, _ = built("all")
    schedule = KernelSchedule.from_json(Artifact.open(path).manifest["h100"]["schedule"])
    kernels = {x.kernel for e in schedule.entries.values() for x in e.launches}
    assert schedule.kv.kv_dtype == "float32"
    assert not kernels & set(NARROW_ENTRIES)
    assert not any(k.startswith(("gemm_fp8w", "attn_prefill")) for k in kernels)
    assert all(k.endswith("_f32") for k in kernels if k.startswith(("attn_decode_d",
                                                                     "attn_decode_keqv")))
    assert {"gemv_f32", "qkv_post_small_f32", "moe_gate_up_f32", "ple_project_f32"} <= kernels


# ---------------------------------------------------------------- GPU

class _LaunchByLaunch:
    """A schedule device that runs each launch on the reference and, for `_f32` entries, on the
    GPU from the same arena state, recording the largest relative difference per kernel."""

    def __init__(self, art: Artifact, schedule: KernelSchedule, ctx):
        from rvcompile.runtime.h100_executor import CudaScheduleDevice

        self.ref = ReferenceDevice(schedule, art.buffer("weights"),
                                   bytes(art.buffer("constants")))
        self.gpu = CudaScheduleDevice(art, schedule, ctx)
        self.ctx, self.schedule = ctx, schedule
        self.worst: dict[str, float] = {}

    def write(self, offset: int, data: bytes) -> None:
        self.ref.write(offset, data)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.ref.read(offset, nbytes)

    def run(self, entry: str) -> None:
        from rvcompile.targets.h100.reference_executor import _kernel_ref

        launches = self.schedule.entries[entry].launches
        for launch, (fn, grid, block, smem, packed) in zip(launches, self.gpu.entries[entry],
                                                           strict=True):
            check = launch.kernel.endswith("_f32")
            if check:
                before = self.ref.mem.copy()
                self.ctx.copy_to_device(self.gpu.arena.ptr, before, 0)
                self.ctx.launch_packed(fn, grid, block, smem, packed, 0)
                self.ctx.synchronize()
            _kernel_ref(launch.kernel)(self.ref, launch, *[a.value for a in launch.args])
            if check:
                got = np.empty_like(before)
                self.ctx.copy_to_host(got, self.gpu.arena.ptr, 0)
                self.ctx.synchronize()
                self._compare(launch.kernel, got, before)

    def _compare(self, kernel: str, got: np.ndarray, before: np.ndarray) -> None:
        changed = (got != before) | (self.ref.mem != before)
        words = np.unique(np.nonzero(changed)[0] // 4)
        g = got.view(np.float32)[words]
        w = self.ref.mem.view(np.float32)[words]
        assert np.isfinite(g).all() == np.isfinite(w).all(), kernel
        scale = max(1e-30, float(np.abs(w).max())) if words.size else 1.0
        err = float(np.abs(g - w).max()) / scale if words.size else 0.0
        self.worst[kernel] = max(self.worst.get(kernel, 0.0), err)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "k_eq_v", "ple", "all"])
def test_gpu_each_f32_entry_matches_its_reference(built, case):
    ctx = h100_context()
    _, path, _ = built(case)
    art = Artifact.open(path)
    schedule = KernelSchedule.from_json(art.manifest["h100"]["schedule"])
    device = _LaunchByLaunch(art, schedule, ctx)
    m = Model(art, ScheduledExecutor(schedule, device))
    prompt = random_token_ids(19, seed=7).tolist()
    m.generate(prompt, max_tokens=3, ignore_eos=True)
    m.logits(random_token_ids(20, seed=8))
    print(f"\n[measured] {case}: worst relative difference per f32 entry "
          f"{ {k: f'{v:.1e}' for k, v in sorted(device.worst.items())} }")
    assert device.worst
    for kernel, err in device.worst.items():
        assert err <= 1e-5, kernel  # float32 sum order only (relative to the output's scale)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "k_eq_v", "kv_shared", "ple", "moe", "all"])
def test_gpu_f32_plan_matches_reference_executor(built, case):
    from rvcompile import runtime

    h100_context()
    _, path, ref = built(case)
    gpu = runtime.load(path)
    ids = random_token_ids(40, seed=5)
    a, b = gpu.logits(ids), ref.logits(ids)
    err = np.abs(a - b)
    print(f"\n[measured] {case} h100-f32: GPU vs reference executor max abs {err.max():.2e}")
    assert np.isfinite(a).all()
    assert err.max() <= F32_BOUND
    prompt = random_token_ids(37, seed=6).tolist()
    g = gpu.generate(prompt, max_tokens=16, ignore_eos=True).token_ids
    assert g == ref.generate(prompt, max_tokens=16, ignore_eos=True).token_ids
