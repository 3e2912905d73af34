"""h100-f32: the H100 plan with quantization switched off (float32 weights, activations and KV
pools through the kernels' `_f32` entries), which must match the transformers oracle within
float32 rounding.

CPU (the plan on the reference executor, through the normal build path):
- every oracle case: teacher-forced logits of 3 sequences x 40 tokens within F32_BOUND of the
  oracle (the xla-f32 standard, tests/test_oracle.py), greedy tokens equal to the oracle's, and
  greedy decode (chunked prefill + paged decode) equal to the argmax of the plan's own logits;
- the schedule launches only float32 entries and keeps float32 pools; 26B-A4B and E4B lower.
Measured max abs logit error against the oracle (3 x 40 tokens; oracle logits up to ~7):
    dense 9.7e-06   k_eq_v 8.1e-06   kv_shared 1.3e-05   ple 8.7e-06   moe 7.5e-06   all 2.2e-05
GPU (skipped without one; not yet run on a GPU):
- each launch of an `_f32` entry against its numpy reference on the same arena state (the model's
  real activations, fresh per launch: the GPU arena is reset to the reference's before each);
- the whole h100-f32 artifact on the GPU against the reference executor (logits, greedy tokens);
- each `_f32` entry on fresh random inputs at real shapes (31B, E4B, 26B-A4B dims, head dims
  256/512, windows wrapped) and the tiny models', outputs NaN-poisoned, against its reference.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest
from h100_helpers import h100_context, reference_executor
from oracle import ORACLE_CASES, oracle_greedy, oracle_logits, random_token_ids

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.executors.scheduled import ScheduledExecutor
from rvcompile.runtime.model import Model
from rvcompile.targets.h100.reference_executor import ReferenceDevice

OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "max_seqs": 3}
F32_BOUND = 1e-4  # as test_oracle.F32_BOUND: float32 rounding, amplified through 6 layers
SEQ = 40
CASES = sorted(ORACLE_CASES)
# Entries of the quantized plan that read or write bf16/e4m3 values; none may appear here.
NARROW_ENTRIES = ("gemv_fp8_rowscale", "gemv_bf16", "rmsnorm_bf16", "residual_rmsnorm",
                  "gelu_mul", "embed_rows_bf16", "embed_rows_fp8", "select_rows_bf16", "to_bf16",
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


@pytest.mark.parametrize("preset", ["gemma-4-26B-A4B", "gemma-4-E4B"])
def test_released_models_lower_to_f32(preset):
    """MoE and per-layer inputs at real dims fit the f32 entries' limits (no weights needed)."""
    from rvcompile.build import lower_model
    from rvcompile.sources.checkpoint import load_model_source
    from rvcompile.targets.h100.lower import lower_to_h100

    source = load_model_source(preset, random_weights=True)
    ir = lower_model(source, BuildOptions("h100-f32", max_context=2048, prefill_buckets=(16, 64)),
                     log=lambda s: None)
    lowering = lower_to_h100(ir, max_seqs=4, prefill_buckets=(16, 64))
    kernels = {x.kernel for e in lowering.schedule.entries.values() for x in e.launches}
    assert lowering.schedule.kv.kv_dtype == "float32"
    assert not kernels & set(NARROW_ENTRIES)


# ---------------------------------------------------------------- GPU

class _LaunchByLaunch:
    """A schedule device that runs each launch on the reference and, for `_f32` entries, on the
    GPU from the same arena state, recording the largest relative difference per kernel. A split
    attention launch runs with its combine (the reference writes its partials in another form),
    and only the combine's output is compared."""

    def __init__(self, art: Artifact, schedule: KernelSchedule, ctx):
        from rvcompile.runtime.executors.h100 import CudaScheduleDevice

        self.ref = ReferenceDevice(schedule, art.buffer("weights"),
                                   bytes(art.buffer("constants")))
        self.gpu = CudaScheduleDevice(art, schedule, ctx, kv_blocks=self.ref.kv_blocks)
        self.kv_blocks = self.ref.kv_blocks  # the pools both devices hold (ScheduleDevice)
        self.ctx, self.schedule = ctx, schedule
        self.worst: dict[str, float] = {}

    def write(self, offset: int, data: bytes) -> None:
        self.ref.write(offset, data)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.ref.read(offset, nbytes)

    def run(self, entry: str) -> None:
        launches, prepared = self.schedule.entries[entry].launches, self.gpu.entries[entry]
        i = 0
        while i < len(launches):
            kernel = launches[i].kernel
            check = kernel.endswith("_f32")
            # a split kernel and its combine are checked together (their partials differ from
            # the reference's split 0); a lone split (one split, no combine) writes out itself
            combined = (i + 1 < len(launches)
                        and launches[i + 1].kernel == "attn_decode_combine")
            span = 2 if check and kernel.startswith("attn_decode") and combined else 1
            if check:
                before = self.ref.mem.copy()
                self.ctx.copy_to_device(self.gpu.arena.ptr, before, 0)
                for fn, config, packed in prepared[i:i + span]:
                    # on the device's stream, which waits for the copy on the legacy stream
                    self.ctx.launch_configured(fn, config, packed)
                self.ctx.synchronize()
            for launch in launches[i:i + span]:
                self.ref.launch(launch)
            if check:
                got = np.empty_like(before)
                self.ctx.copy_to_host(got, self.gpu.arena.ptr, 0)
                self.ctx.synchronize()
                words = np.unique(np.nonzero((got != before) | (self.ref.mem != before))[0] // 4)
                if span == 2:  # the combine's out [rows * heads, d]
                    combine = launches[i + 1]
                    args = {a.name: a.value for a in combine.args}
                    start = args["out"] // 4
                    count = combine.grid[0] * args["d"]
                    words = np.arange(start, start + count)
                self._compare(kernel, got.view(np.float32)[words],
                              self.ref.mem.view(np.float32)[words])
            i += span

    def _compare(self, kernel: str, got: np.ndarray, want: np.ndarray) -> None:
        finite = np.isfinite(want)
        assert np.array_equal(finite, np.isfinite(got)), kernel
        if not finite.any():
            return
        scale = max(1e-30, float(np.abs(want[finite]).max()))
        err = float(np.abs(got[finite] - want[finite]).max()) / scale
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


# ---------------------------------------------------------------- GPU: f32 entries, random inputs

def _run(ctx, source: str, entry: str, geometry, *args, outputs=(), poison=()):
    """One launch of `entry`: numpy arrays are uploaded (those at `poison` NaN-filled instead),
    None is a null pointer, floats are f32 and ints i32. The arrays at `outputs`, downloaded."""
    from rvcompile.targets.h100.nvcc import compile_cubin

    fn = ctx.load_function(compile_cubin(source), entry)
    if geometry.smem > 48 * 1024:
        ctx.set_max_dynamic_smem(fn, geometry.smem)
    bufs, cargs = {}, []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            bufs[i] = ctx.upload(np.full_like(a, np.nan) if i in poison else a)
            cargs.append(ctypes.c_uint64(bufs[i].ptr))
        elif a is None:
            cargs.append(ctypes.c_uint64(0))
        elif isinstance(a, float):
            cargs.append(ctypes.c_float(a))
        else:
            cargs.append(ctypes.c_int(int(a)))
    ctx.launch(fn, geometry.grid, geometry.block, geometry.smem, cargs)
    ctx.synchronize()
    got = [ctx.download(bufs[i], args[i].dtype, args[i].shape) for i in outputs]
    for b in bufs.values():
        ctx.free(b)
    return got


def _assert_close(got, want, rel: float = 2e-5) -> None:
    """Float32 results: the kernels' sum order and tanhf/sincosf/expf differ from numpy by a
    few ulp of the largest value."""
    assert np.isfinite(got).all()
    scale = max(1e-30, float(np.abs(want).max()))
    err = float(np.abs(np.asarray(got, np.float32) - want).max()) / scale
    assert err <= rel, err


def _f32(rng, shape, std=1.0) -> np.ndarray:
    return rng.normal(0, std, shape).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 5376, 5376), (4, 1024, 21504), (3, 8192, 2560),
                                   (2, 100, 16)])
def test_gpu_gemv_f32(m, n, k):
    from rvcompile.targets.h100 import gemv_f32

    ctx = h100_context()
    rng = np.random.default_rng(m * n + k)
    w, x, y = _f32(rng, (n, k), 0.05), _f32(rng, (m, k)), np.zeros((m, n), np.float32)
    (got,) = _run(ctx, gemv_f32.SOURCE, gemv_f32.ENTRY, gemv_f32.launch_geometry(m, n, k, 132),
                  w, x, y, m, n, k, outputs=(2,), poison=(2,))
    _assert_close(got, gemv_f32.reference(w, x))


@pytest.mark.gpu
@pytest.mark.parametrize("hdim", [5376, 2560, 256, 64, 16])
def test_gpu_norms_f32(hdim):
    from rvcompile.targets.h100 import norms

    ctx = h100_context()
    rng = np.random.default_rng(hdim)
    m, eps = 3, 1e-6
    x, h = _f32(rng, (m, hdim), 3), _f32(rng, (m, hdim), 2)
    w, w_next = rng.uniform(0.5, 1.5, (2, hdim)).astype(np.float32)
    scalar = np.array([0.7], np.float32)
    y = np.zeros((m, hdim), np.float32)
    geometry = norms.launch_geometry(m, hdim)
    (got,) = _run(ctx, norms.SOURCE, norms.RMSNORM_F32_ENTRY, geometry, x, w, y, hdim, eps,
                  outputs=(2,), poison=(2,))
    _assert_close(got, norms.rmsnorm_f32(x, w, eps))
    got_h, got_y = _run(ctx, norms.SOURCE, norms.RESIDUAL_F32_ENTRY, geometry, h, x, w, scalar,
                        w_next, y, hdim, eps, outputs=(0, 5), poison=(5,))
    want_h, want_y = norms.residual_rmsnorm_f32(h, x, w, scalar, w_next, eps)
    _assert_close(got_h, want_h)
    _assert_close(got_y, want_y)


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [21504, 32])
def test_gpu_gelu_mul_select_embed_f32(inter):
    from rvcompile.targets.h100 import gelu_mul, head, rows

    ctx = h100_context()
    rng = np.random.default_rng(inter)
    m = 3
    gu, out = _f32(rng, (m, 2 * inter), 2), np.zeros((m, inter), np.float32)
    (got,) = _run(ctx, gelu_mul.SOURCE, gelu_mul.F32_ENTRY, gelu_mul.launch_geometry(m, inter),
                  gu, out, inter, outputs=(1,), poison=(1,))
    _assert_close(got, gelu_mul.reference_f32(gu))
    hdim = inter // 4
    table, ids = _f32(rng, (300, hdim)), rng.integers(0, 300, m).astype(np.int32)
    h = np.zeros((m, hdim), np.float32)
    (got,) = _run(ctx, head.SOURCE, head.EMBED_F32_ENTRY,
                  head.embed_geometry(m, hdim, False, f32=True), table, ids, 11.5, h, hdim,
                  outputs=(3,), poison=(3,))
    assert np.array_equal(got, head.embed_rows(table, ids, 11.5))
    row, dst = np.array([2, -1], np.int32), np.zeros((2, hdim), np.float32)
    (got,) = _run(ctx, rows.SOURCE, rows.SELECT_F32_ENTRY, rows.select_geometry(2, hdim),
                  table[:m], row, dst, 2, hdim, outputs=(2,), poison=(2,))
    assert np.array_equal(got[0], table[2]) and not got[1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("nh,kh,d,k_eq_v", [(32, 16, 256, False), (32, 4, 512, True),
                                            (4, 2, 32, False), (4, 1, 64, True)])
def test_gpu_qkv_post_f32(nh, kh, d, k_eq_v):
    from rvcompile.targets.h100 import qkv_post

    ctx = h100_context()
    rng = np.random.default_rng(nh * d + kh)
    m, ring, blocks, eps = 3, 4, 15, 1e-6
    ld = qkv_post.row_width(nh, kh, d, k_eq_v)
    qkv = _f32(rng, (m, ld), 2)
    wq, wk = rng.uniform(0.5, 1.5, (2, d)).astype(np.float32)
    positions = np.array([5, 37, -1], np.int32)  # the last row idle: no cache write
    inv_freq = (1e4 ** -(np.arange(d // 2) / (d // 2))).astype(np.float32)
    table = rng.permutation(blocks)[:m * ring].reshape(m, ring).astype(np.int32)
    k_pool = _f32(rng, (blocks, qkv_post.BLOCK, kh, d))
    v_pool = None if k_eq_v else _f32(rng, (blocks, qkv_post.BLOCK, kh, d))
    q_out = np.zeros((m, nh, d), np.float32)
    got = _run(ctx, qkv_post.SOURCE, qkv_post.entry(d, "float32"),
               qkv_post.launch_geometry(m, nh, kh, d), qkv, ld, nh, kh, d, int(k_eq_v), wq, wk,
               positions, inv_freq, eps, q_out, k_pool, v_pool, table, ring, ring,
               outputs=(11, 12) if k_eq_v else (11, 12, 13), poison=(11,))
    want_q, want_k, want_v = qkv_post.reference(
        qkv, nh, kh, d, k_eq_v, wq, wk, positions, inv_freq, eps, k_pool,
        k_pool if v_pool is None else v_pool, table, ring, store_once=k_eq_v)
    _assert_close(got[0], want_q)
    _assert_close(got[1], want_k)
    if not k_eq_v:
        _assert_close(got[2], want_v)


def _f32_case(rng, *case_args):
    """test_h100_attn's random case with float32 q and pools off the bf16 grid."""
    from test_h100_attn import make_case

    q, k, v, table, ring, lens = make_case(rng, *case_args)
    jitter = [_f32(rng, x.shape, 1e-3) for x in (q, k, v)]
    q, k, v = (x.astype(np.float32) + j for x, j in zip((q, k, v), jitter, strict=True))
    return q, k, v, table, ring, lens


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(11))
def test_gpu_attn_decode_f32(case):
    from test_h100_attn import CASES, run_kernel

    from rvcompile.targets.h100 import attn_decode as ad

    ctx = h100_context()
    name, batch, kv_heads, group, d, lens, window = CASES[case]
    rng = np.random.default_rng(zlib.crc32(f"f32 {name}".encode()))
    q, k, v, table, ring, lens_arr = _f32_case(rng, batch, kv_heads, group, d, lens, window)
    got = run_kernel(ctx, q, k, v, table, ring, lens_arr, window)  # str(k.dtype): _f32 entry
    want = ad.reference(q, k, v, table, ring, lens_arr, window)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(7))
def test_gpu_attn_decode_keqv_f32(case):
    from test_h100_attn import KEQV_CASES

    from rvcompile.model.config import RopeSpec
    from rvcompile.targets.h100 import attn_decode as ad

    ctx = h100_context()
    name, batch, kv_heads, group, d, lens = KEQV_CASES[case]
    rng = np.random.default_rng(zlib.crc32(f"f32 {name}".encode()))
    q, base, _, table, ring, lens_arr = _f32_case(rng, batch, kv_heads, group, d, lens, 0)
    wk = rng.uniform(0.5, 1.5, d).astype(np.float32)
    inv_freq = np.asarray(RopeSpec(1e6, 0.25).inv_freq(d), np.float32)
    nh = kv_heads * group
    splits = ad.num_splits(batch, kv_heads, max(lens), ctx.sm_count)
    acc = np.zeros((batch, nh, splits, d), np.float32)
    ml = np.zeros((batch, nh, splits, 2), np.float32)
    acc, ml = _run(ctx, ad.SOURCE, ad.entry_keqv(d, group, "float32"),
                   ad.split_geometry(batch, kv_heads, splits), q, base, table, table.shape[1],
                   ring, lens_arr, 0, kv_heads, wk, inv_freq, acc, ml, None, None,
                   outputs=(10, 11),
                   poison=(10, 11))
    out = np.zeros((batch, nh, d), np.float32)
    (got,) = _run(ctx, ad.SOURCE, ad.COMBINE_ENTRY, ad.combine_geometry(batch, nh, d, splits),
                  acc, ml, splits, d, out, None, outputs=(4,), poison=(4,))
    want = ad.reference_keqv(q, base, table, ring, lens_arr, 0, wk, inv_freq)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("hdim,layers,p,m", [(2560, 42, 256, 3), (2560, 42, 256, 9),
                                             (128, 8, 16, 5)])
def test_gpu_ple_f32(hdim, layers, p, m):
    from rvcompile.targets.h100 import ple

    ctx = h100_context()
    rng = np.random.default_rng(hdim + m)
    ctx_in, w = _f32(rng, (m, layers * p), 3), rng.uniform(0.5, 1.5, p).astype(np.float32)
    table, ids = _f32(rng, (50, layers * p)), rng.integers(0, 50, m).astype(np.int32)
    out = np.zeros((m, layers, p), np.float32)
    (got,) = _run(ctx, ple.SOURCE, ple.COMBINE_F32_ENTRY, ple.combine_geometry(m, layers, p),
                  ctx_in, table, ids, w, out, 0.06, 4.0, 0.7, 1e-6, m, layers, p,
                  outputs=(4,), poison=(4,))
    want_ple = ple.combine(ctx_in, table[ids], w, 0.06, 4.0, 0.7, 1e-6, layers)
    _assert_close(got, want_ple)
    gate, wp = _f32(rng, (m, p), 2), _f32(rng, (hdim, p), 0.1)
    y, layer = np.zeros((m, hdim), np.float32), layers - 1
    (got,) = _run(ctx, ple.SOURCE, ple.PROJECT_F32_ENTRY,
                  ple.project_geometry(m, hdim, p, 132, f32=True), gate, want_ple, layer, layers,
                  wp, y, m, hdim, p, outputs=(5,), poison=(5,))
    _assert_close(got, ple.project_f32(gate, want_ple[:, layer], wp))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5])
def test_gpu_moe_f32(m):
    from rvcompile.targets.h100 import moe

    ctx = h100_context()
    rng = np.random.default_rng(m)
    experts, k, inter, hdim, eps = 16, 8, 704, 2816, 1e-6
    r = _f32(rng, (m, hdim), 2)
    router_scale, w2 = rng.uniform(0.5, 1.5, (2, hdim)).astype(np.float32)
    z, x2 = np.zeros((2, m, hdim), np.float32)
    got_z, got_x2 = _run(ctx, moe.SOURCE, moe.NORMS_F32_ENTRY, moe.norm_geometry(m, hdim), r,
                         router_scale, 0.02, w2, z, x2, hdim, eps, outputs=(4, 5), poison=(4, 5))
    want_z, want_x2 = moe.norms_f32_reference(r, router_scale, 0.02, w2, eps)
    _assert_close(got_z, want_z)
    _assert_close(got_x2, want_x2)
    w, d = _f32(rng, (experts, 2 * inter, hdim), 0.03), _f32(rng, (experts, hdim, inter), 0.03)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(m)]).astype(np.int32)
    wts = rng.uniform(0, 0.5, (m, k)).astype(np.float32)
    hid, y = np.zeros((m, k, inter), np.float32), np.zeros((m, hdim), np.float32)
    dims = (m, k, inter, hdim)
    (got_hid,) = _run(ctx, moe.SOURCE, moe.GATE_UP_F32_ENTRY,
                      moe.expert_f32_geometry(*dims, 132, gate_up=True), w, want_x2, ids, hid,
                      *dims, outputs=(3,), poison=(3,))
    want_hid = moe.gate_up_f32_reference(w, want_x2, ids)
    _assert_close(got_hid, want_hid)
    (got_y,) = _run(ctx, moe.SOURCE, moe.DOWN_F32_ENTRY,
                    moe.expert_f32_geometry(*dims, 132, gate_up=False), d, want_hid, ids, wts, y,
                    *dims, outputs=(4,), poison=(4,))
    _assert_close(got_y, moe.down_f32_reference(d, want_hid, ids, wts))
