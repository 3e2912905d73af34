"""Mixture-of-experts layers on the H100 target (targets/h100/moe.py, kernels/moe.cu; issue 3).

CPU: the kernels' numpy references against the IR's ops (the MOE op, the router chain, the
branch sum); the whole h100-fp8 plan of the oracle's "moe" case (8 experts, top-2) run by the
reference executor against the transformers oracle; greedy decode equal to the teacher-forced
logits; the 26B-A4B preset lowering. GPU (skipped without one): each kernel against its
reference on fresh random inputs at 26B-A4B dims (H 2816, 128 experts, top-8, I 704) and at
the oracle's (H 64, 8 experts, top-2, I 32).

Measured against the oracle (4 sequences x 40 tokens; top-1, mean and max abs logit error;
oracle logits std 1.23): moe 0.694 / 0.209 / 2.35, asserted in MOE_BOUNDS. This is FP8 itself:
the IR interpreter on the same FP8 IR measures 0.75 / 0.222 / 2.01 and 0.675 / 0.229 / 2.72 on
two of those sequences. It is worse than the dense cases (test_h100_schedule) because a
quantized router input flips near-tied top-2 choices; the same flips put the plan within
mean 0.035 / max 2.9 of that interpreter (dense: 0.008 / 0.05), asserted separately. Not every
MoE slip shows in logits: rmsnorm(y) after the experts cancels a common scale of the routing
weights, so the route and down references are checked against ops.ref_moe directly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import zlib

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context
from oracle import agreement_with_oracle, random_token_ids

from rvcompile.ir import ops
from rvcompile.targets.h100 import moe

BF16 = ml_dtypes.bfloat16
OPTS = {"max_context": 128, "prefill_buckets": (8, 32), "max_seqs": 3}
MOE_BOUNDS = (0.62, 0.27, 3.2)  # min top-1, max mean abs, max max abs; measured above

# (hidden, experts, top_k, moe intermediate)
DIMS = {"26B-A4B": (2816, 128, 8, 704), "oracle": (64, 8, 2, 32)}


def random_fp8(rng, shape) -> np.ndarray:
    """e4m3 codes of weights ~N(0, 1) scaled to the format (NaN codes impossible)."""
    w = rng.normal(0, 100, shape).clip(-448, 448).astype(np.float32)
    return w.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def random_moe(rng, m: int, dims: tuple[int, int, int, int]) -> dict[str, np.ndarray]:
    h, e, _, i = dims
    return {"x": rng.normal(size=(m, h)).astype(BF16),
            "logits": rng.normal(0, 1.5, (m, e)).astype(np.float32),
            "pes": rng.uniform(0.5, 1.5, e).astype(np.float32),
            "gate_up": random_fp8(rng, (e, 2 * i, h)),
            "gate_up_scale": rng.uniform(1e-4, 1e-3, (e, 2 * i)).astype(np.float32) * 3 / h**0.5,
            "down": random_fp8(rng, (e, h, i)),
            "down_scale": rng.uniform(1e-4, 1e-3, (e, h)).astype(np.float32)}


# ---------------------------------------------------------------- CPU: references vs the IR

@pytest.mark.parametrize("dims", [DIMS["oracle"], (128, 128, 8, 64)])
def test_references_compose_to_the_moe_op(dims) -> None:
    rng = np.random.default_rng(dims[1])
    m, k = 3, dims[2]
    a = random_moe(rng, m, dims)
    ids, w = moe.route_reference(a["logits"], a["pes"], k)
    hid = moe.gate_up_reference(a["gate_up"], a["gate_up_scale"], a["x"], ids)
    got = moe.down_reference(a["down"], a["down_scale"], hid, ids, w)
    f8 = ml_dtypes.float8_e4m3fn
    want = ops.ref_moe(ops.MoEAttrs(k, True), a["x"].astype(np.float32), a["logits"], a["pes"],
                       a["gate_up"].view(f8), a["down"].view(f8), a["gate_up_scale"],
                       a["down_scale"])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the picks: descending probability, renormalised, times per_expert_scale
    p = np.exp(a["logits"] - a["logits"].max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert (np.diff(np.take_along_axis(p, ids, -1), axis=-1) <= 0).all()
    assert np.allclose((w / a["pes"][ids]).sum(-1), 1.0, rtol=1e-6)
    assert ids.dtype == np.int32 and hid.dtype == BF16 and got.dtype == np.float32


@pytest.mark.parametrize("dims", [DIMS["oracle"], (128, 128, 8, 64)])
def test_grouped_references_compose_to_the_moe_op(dims) -> None:
    """The prefill path: pairs sorted by expert, the grouped expert products, the ordered sum."""
    rng = np.random.default_rng(dims[1] + 1)
    m, k, e = 37, dims[2], dims[1]
    a = random_moe(rng, m, dims)
    ids, w = moe.route_reference(a["logits"], a["pes"], k)
    order, offsets = moe.sort_reference(ids, e)
    hid = moe.gate_up_grouped_reference(a["gate_up"], a["gate_up_scale"], a["x"], order, offsets,
                                        k)
    part = moe.down_grouped_reference(a["down"], a["down_scale"], hid, order, offsets, w)
    got = moe.sum_pairs_reference(part, k)
    f8 = ml_dtypes.float8_e4m3fn
    want = ops.ref_moe(ops.MoEAttrs(k, True), a["x"].astype(np.float32), a["logits"], a["pes"],
                       a["gate_up"].view(f8), a["down"].view(f8), a["gate_up_scale"],
                       a["down_scale"])
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    by_row = moe.gate_up_reference(a["gate_up"], a["gate_up_scale"], a["x"], ids)
    assert np.abs(hid.astype(np.float32) - by_row.reshape(m * k, -1).astype(np.float32)).max() \
        <= 2 ** -7 * np.abs(by_row.astype(np.float32)).max()


def test_router_rows_reference_is_the_router_linear() -> None:
    rng = np.random.default_rng(4)
    z = rng.normal(size=(9, 64)).astype(BF16)
    w = rng.normal(size=(8, 64)).astype(BF16)
    want = ops.ref_linear(ops.LinearAttrs(role="router"), z.astype(np.float32), w)
    assert np.abs(moe.router_rows_reference(z, w) - want).max() <= 1e-5 * np.abs(want).max()


def test_sort_reference_is_stable_by_expert() -> None:
    ids = np.array([[3, 0], [0, 2], [3, 1]], np.int32)
    order, offsets = moe.sort_reference(ids, 5)
    assert order.tolist() == [1, 2, 5, 3, 0, 4] and offsets.tolist() == [0, 2, 3, 4, 6, 6]


def test_route_ties_go_to_the_lower_expert() -> None:
    logits = np.array([[0.5, 2.0, 2.0, 1.0, 2.0]], np.float32)
    ids, w = moe.route_reference(logits, np.ones(5, np.float32), 2)
    assert ids.tolist() == [[1, 2]] and np.allclose(w, 0.5)


def test_norm_references_are_the_ir_ops() -> None:
    rng = np.random.default_rng(2)
    eps, hdim = 1e-6, 64
    a = ops.RMSNormAttrs(eps)
    r, f, y = rng.normal(0, 2, (3, 2, hdim)).astype(np.float32)
    rs, w1, w2 = rng.uniform(0.5, 1.5, (3, hdim)).astype(np.float32)
    z, x2 = moe.norms_reference(r, rs, hdim**-0.5, w2, eps)
    router_in = ops.OPS[ops.Op.SCALE].reference(
        ops.ScaleAttrs(hdim**-0.5), ops.ref_mul(None, ops.ref_rmsnorm(a, r), rs))
    assert np.array_equal(z.astype(np.float32), ops.to_bf16(router_in))
    assert np.array_equal(x2.astype(np.float32), ops.to_bf16(ops.ref_rmsnorm(a, r, w2)))
    both = ops.ref_add(None, ops.ref_rmsnorm(a, f, w1), ops.ref_rmsnorm(a, y, w2))
    assert np.array_equal(moe.branch_sum_reference(f, w1, y, w2, eps), both)


def test_geometry() -> None:
    h, e, k, i = DIMS["26B-A4B"]
    g = moe.gate_up_geometry(1, k, i, h, 132)
    assert g.grid == (528, 1, 1) and g.smem == h * 2  # 8 * 704 warp tasks; 4 blocks per SM
    d = moe.down_geometry(4, k, i, h, 132)
    assert d.grid == (528, 1, 1) and d.smem == 4 * k * i * 2  # persistent: 4 blocks per SM
    assert moe.route_geometry(5, e, k).grid == (5, 1, 1)
    with pytest.raises(ValueError, match="moe expert kernels need"):
        moe.gate_up_geometry(5, k, i, h, 132)
    with pytest.raises(ValueError, match="moe expert kernels need"):
        moe.down_geometry(1, k, 40, h, 132)
    with pytest.raises(ValueError, match="moe_route needs"):
        moe.route_geometry(1, 300, 8)
    assert moe.gate_up_grouped_geometry(e, i, h).grid == (22, 128, 1)  # 704 / 32 outputs
    assert moe.down_grouped_geometry(e, i, h).grid == (88, 128, 1)  # 2816 / 32
    assert moe.sum_pairs_geometry(37, h).grid == (3, 37, 1)
    assert moe.router_rows_geometry(37, e, h).grid == (5, 1, 1)
    with pytest.raises(ValueError, match="moe_sort needs"):
        moe.sort_geometry(16, 257)
    assert moe.chosen_expert_bytes(k, i, h) == (8 * (1408 * 2816 + 1408 * 4),
                                                8 * (2816 * 704 + 2816 * 4))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_compiles(tmp_path) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    cubin = compile_cubin(moe.SOURCE, cache_dir=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    for entry in (moe.NORMS_ENTRY, moe.ROUTE_ENTRY, moe.GATE_UP_ENTRY, moe.DOWN_ENTRY,
                  moe.BRANCH_SUM_ENTRY, moe.SORT_ENTRY, moe.GATE_UP_GROUPED_ENTRY,
                  moe.DOWN_GROUPED_ENTRY, moe.SUM_PAIRS_ENTRY, moe.ROUTER_ROWS_ENTRY):
        assert entry.encode() + b"\x00" in cubin


# ---------------------------------------------------------------- CPU: the plan

@pytest.fixture(scope="module")
def moe_model(oracle_dir, tmp_path_factory):
    from h100_helpers import reference_executor

    from rvcompile.artifacts import Artifact
    from rvcompile.build import BuildOptions, build_artifact
    from rvcompile.runtime.model import Model

    hf, ckpt = oracle_dir("moe")
    out = tmp_path_factory.mktemp("h100-moe") / "moe.rvp"
    build_artifact(str(ckpt), out, BuildOptions("h100-fp8", **OPTS), progress=False,
                   log=lambda s: None)
    art = Artifact.open(out)
    return hf, Model(art, reference_executor(art))


def test_fp8_moe_plan_close_to_oracle(moe_model) -> None:
    hf, m = moe_model
    a = agreement_with_oracle(m, hf, 40)
    assert a["finite"]
    print(f"\n[measured] moe h100-fp8 (reference executor): top-1 {a['top1']:.3f} "
          f"mean abs {a['mean']:.4f} max abs {a['max']:.3f} (oracle logits std "
          f"{a['ref_std']:.2f})")
    min_top1, max_mean, max_max = MOE_BOUNDS
    assert a["top1"] >= min_top1
    assert a["mean"] <= max_mean
    assert a["max"] <= max_max


def test_moe_plan_close_to_its_fp8_ir(moe_model, oracle_dir) -> None:
    """The plan against the IR interpreter on the same FP8 IR and weights (teacher-forced, 4 x 40
    tokens): what remains is the kernels' bf16 rounding (q, the router and expert inputs)
    where it flips a near-tied expert choice. Measured mean abs 0.035 (max 2.9); with the
    per-expert scale left out of the routing weights the mean is 0.225."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.ir.interpret import ReferenceModel
    from rvcompile.passes.weight_math import encode
    from rvcompile.sources.checkpoint import load_model_source

    _, m = moe_model
    source = load_model_source(str(oracle_dir("moe")[1]))
    raw = {t.name: t.load() for t in source.tensors}
    ir = lower_model(source, BuildOptions("h100-fp8", **OPTS), log=lambda s: None)
    weights = {p.name: encode(p.derive, raw[p.source]) for p in ir.params}
    errors = []
    for seed in (11, 12, 13, 14):
        ids = random_token_ids(40, seed=seed)
        ref = ReferenceModel(ir, weights)
        chunks = [ref.step(ids[None, s:s + 8].astype(np.int32), np.array([s]), np.array([8]))[0]
                  for s in range(0, 40, 8)]
        want = ops.OPS[ops.Op.SOFTCAP].reference(ops.SoftcapAttrs(30.0), np.concatenate(chunks))
        errors.append(np.abs(m.logits(ids) - want))
    err = np.concatenate(errors)
    print(f"\n[measured] moe plan vs its FP8 IR: mean abs {err.mean():.4f} max {err.max():.3f}")
    assert err.mean() <= 0.07


def test_moe_decode_path_agrees_with_logits_path(moe_model) -> None:
    """Greedy tokens from chunked prefill (experts grouped) and decode (per row) equal the
    argmax of the teacher-forced logits entry over the same tokens."""
    _, m = moe_model
    prompt = random_token_ids(37, seed=3).tolist()
    got = m.generate(prompt, max_tokens=10, ignore_eos=True).token_ids
    teacher = m.logits(prompt + got).argmax(-1)
    assert got == teacher[len(prompt) - 1:-1].tolist()


def test_26b_a4b_lowers() -> None:
    """The 26B-A4B preset, cut to its first 6 layers (5 sliding, 1 full), lowers without
    weights: per layer the 10 dense launches plus moe_norms, the router GEMV, moe_route,
    moe_gate_up, moe_down and moe_branch_sum."""
    from rvcompile.ir.frontend import build_model_ir
    from rvcompile.ir.graph import check_model
    from rvcompile.model.presets import get_preset
    from rvcompile.targets import get_target
    from rvcompile.targets.h100.lower import lower_to_h100

    full = get_preset("gemma-4-26B-A4B")
    cfg = dataclasses.replace(full, num_layers=6, layer_kinds=full.layer_kinds[:6])
    ir = build_model_ir(cfg, max_context=2048, max_chunk=64)
    for _, run in get_target("h100-fp8").passes:
        ir = run(ir)
    check_model(ir)
    s = lower_to_h100(ir, max_seqs=4, prefill_buckets=(16, 64)).schedule
    decode = s.entries["decode_1"].launches
    assert len(decode) == 2 + 16 * 6 + 5  # head GEMV, 3 sampling kernels, decode_advance
    layer = [x.kernel for x in decode[2:18]]
    assert layer[9:] == ["moe_norms", "gemv_bf16", "moe_route", "moe_gate_up", "moe_down",
                         "moe_branch_sum", "residual_rmsnorm"]
    gate_up = decode[2 + 12]
    assert gate_up.block == (moe.WARPS * 32, 1, 1)
    assert {a.name: a.value for a in gate_up.args}["M"] == 1
    prefill = [x.kernel for x in s.entries["prefill_64"].launches]
    assert prefill.count("moe_gate_up_grouped") == 6 and "moe_gate_up" not in prefill
    assert prefill.count("moe_router_rows") == 6 and prefill.count("gemv_bf16") == 1  # the head
    assert [x.kernel for x in s.entries["prefill_16"].launches].count("moe_sort") == 6
    assert s.arena_bytes < 75e9


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_moe_model_matches_reference_executor(moe_model) -> None:
    """The oracle moe artifact on the H100 (decode graphs, device-side routing) against the
    reference executor. Not yet measured on a GPU: the bound is the one the plan meets against
    its FP8 IR (test_moe_plan_close_to_its_fp8_ir), whose bf16-rounding differences flip
    near-tied experts more than the f32 summation order of the kernels can."""
    from rvcompile import runtime

    h100_context()
    _, ref = moe_model
    gpu = runtime.load(ref.art.path)
    err = []
    for seed in (11, 12, 13, 14):
        ids = random_token_ids(40, seed=seed)
        a = gpu.logits(ids)
        assert np.isfinite(a).all()
        err.append(np.abs(a - ref.logits(ids)))
    err = np.concatenate(err)
    print(f"\n[measured] moe GPU vs reference executor: mean abs {err.mean():.2e} max "
          f"{err.max():.2e}")
    assert err.mean() <= 0.07
    prompt = random_token_ids(37, seed=6).tolist()
    got = gpu.generate(prompt, max_tokens=10, ignore_eos=True).token_ids
    teacher = gpu.logits(prompt + got).argmax(-1)
    assert got == teacher[len(prompt) - 1:-1].tolist()


def _p(buf) -> ctypes.c_uint64:
    return ctypes.c_uint64(buf.ptr)


def _run(ctx, entry: str, launch, args) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    fn = ctx.load_function(compile_cubin(moe.SOURCE), entry)
    if launch.smem > 48 * 1024:
        ctx.set_max_dynamic_smem(fn, launch.smem)
    ctx.launch(fn, launch.grid, launch.block, launch.smem, args)
    ctx.synchronize()


def _poisoned(ctx, nbytes: int):
    buf = ctx.alloc(nbytes)
    ctx.memset(buf, 0xFF)  # NaN in f32 and bf16, -1 in int32
    return buf


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 37])
@pytest.mark.parametrize("model", sorted(DIMS))
def test_route_kernel(model: str, m: int) -> None:
    ctx = h100_context()
    _, e, k, _ = DIMS[model]
    rng = np.random.default_rng(zlib.crc32(f"route{model}{m}".encode()))
    logits = rng.normal(0, 1.5, (m, e)).astype(np.float32)
    pes = rng.uniform(0.5, 1.5, e).astype(np.float32)
    dl, dp = ctx.upload(logits), ctx.upload(pes)
    di, dw = _poisoned(ctx, m * k * 4), _poisoned(ctx, m * k * 4)
    _run(ctx, moe.ROUTE_ENTRY, moe.route_geometry(m, e, k),
         [_p(dl), _p(dp), _p(di), _p(dw), ctypes.c_int(e), ctypes.c_int(k)])
    ids, w = ctx.download(di, np.int32, (m, k)), ctx.download(dw, np.float32, (m, k))
    for b in (dl, dp, di, dw):
        ctx.free(b)
    want_ids, want_w = moe.route_reference(logits, pes, k)
    assert np.array_equal(ids, want_ids)  # random logits: no near-ties at f32 rounding
    assert np.abs(w - want_w).max() <= 1e-6 * np.abs(want_w).max()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("model", sorted(DIMS))
def test_expert_kernels(model: str, m: int) -> None:
    """gate_up then down on the GPU, each from the reference's own inputs; expert ids distinct
    per row, the rows sharing some experts."""
    ctx = h100_context()
    h, e, k, i = DIMS[model]
    rng = np.random.default_rng(zlib.crc32(f"experts{model}{m}".encode()))
    a = random_moe(rng, m, DIMS[model])
    pool = rng.permutation(e)[:max(k + 1, e // 2)]
    ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(m)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (m, k)).astype(np.float32)
    up = {n: ctx.upload(v) for n, v in (("gu", a["gate_up"]), ("sg", a["gate_up_scale"]),
                                        ("x", a["x"]), ("ids", ids), ("w", w),
                                        ("d", a["down"]), ("sd", a["down_scale"]))}
    hid, y = _poisoned(ctx, m * k * i * 2), _poisoned(ctx, m * h * 4)
    dims = [ctypes.c_int(v) for v in (m, k, i, h)]
    _run(ctx, moe.GATE_UP_ENTRY, moe.gate_up_geometry(m, k, i, h, ctx.sm_count),
         [_p(up["gu"]), _p(up["sg"]), _p(up["x"]), _p(up["ids"]), _p(hid), *dims])
    got_hid = ctx.download(hid, BF16, (m, k, i))
    want_hid = moe.gate_up_reference(a["gate_up"], a["gate_up_scale"], a["x"], ids)
    g, wh = got_hid.astype(np.float32), want_hid.astype(np.float32)
    assert np.isfinite(g).all()
    # f32 sums in another order: the bf16 outputs within one bf16 ulp (+ slack near zero)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(wh), 1e-30))) - 7)
    assert (np.abs(g - wh) <= ulp + 1e-5 * np.sqrt(np.mean(wh**2))).all()
    hid_ref = ctx.upload(want_hid)
    _run(ctx, moe.DOWN_ENTRY, moe.down_geometry(m, k, i, h, ctx.sm_count),
         [_p(up["d"]), _p(up["sd"]), _p(hid_ref), _p(up["ids"]), _p(up["w"]), _p(y), *dims])
    got_y = ctx.download(y, np.float32, (m, h))
    for b in (*up.values(), hid, y, hid_ref):
        ctx.free(b)
    want_y = moe.down_reference(a["down"], a["down_scale"], want_hid, ids, w)
    assert np.isfinite(got_y).all()
    assert np.linalg.norm(got_y - want_y) / np.linalg.norm(want_y) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("model", sorted(DIMS))
def test_norm_kernels(model: str, m: int) -> None:
    ctx = h100_context()
    h = DIMS[model][0]
    rng = np.random.default_rng(zlib.crc32(f"norms{model}{m}".encode()))
    r, f, y = rng.normal(0, 2, (3, m, h)).astype(np.float32)
    rs, w1, w2 = rng.uniform(0.5, 1.5, (3, h)).astype(np.float32)
    eps, mul = 1e-6, h**-0.5
    dr, df, dy, drs, dw1, dw2 = (ctx.upload(v) for v in (r, f, y, rs, w1, w2))
    dz, dx2, dout = _poisoned(ctx, m * h * 2), _poisoned(ctx, m * h * 2), _poisoned(ctx, m * h * 4)
    geometry = moe.norm_geometry(m, h)
    _run(ctx, moe.NORMS_ENTRY, geometry, [_p(dr), _p(drs), ctypes.c_float(mul), _p(dw2), _p(dz),
                                          _p(dx2), ctypes.c_int(h), ctypes.c_float(eps)])
    _run(ctx, moe.BRANCH_SUM_ENTRY, geometry, [_p(df), _p(dw1), _p(dy), _p(dw2), _p(dout),
                                               ctypes.c_int(h), ctypes.c_float(eps)])
    z, x2 = ctx.download(dz, BF16, (m, h)), ctx.download(dx2, BF16, (m, h))
    out = ctx.download(dout, np.float32, (m, h))
    for b in (dr, df, dy, drs, dw1, dw2, dz, dx2, dout):
        ctx.free(b)
    want_z, want_x2 = moe.norms_reference(r, rs, mul, w2, eps)
    for got, want in ((z, want_z), (x2, want_x2)):
        g, w = got.astype(np.float32), want.astype(np.float32)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 1e-30))) - 7)
        assert (np.abs(g - w) <= ulp).all()
        assert (g != w).sum() <= max(1, 0.01 * g.size)  # rounding ties flip, rarely
    want = moe.branch_sum_reference(f, w1, y, w2, eps)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 37])
@pytest.mark.parametrize("model", sorted(DIMS))
def test_grouped_expert_kernels(model: str, m: int) -> None:
    """The prefill path on the GPU: sort, grouped gate_up, grouped down (each from the
    reference's own inputs), ordered sum, and the router linear of a chunk."""
    ctx = h100_context()
    h, e, k, i = DIMS[model]
    rng = np.random.default_rng(zlib.crc32(f"grouped{model}{m}".encode()))
    a = random_moe(rng, m, DIMS[model])
    ids, w = moe.route_reference(a["logits"], a["pes"], k)
    order, offsets = moe.sort_reference(ids, e)
    want_hid = moe.gate_up_grouped_reference(a["gate_up"], a["gate_up_scale"], a["x"], order,
                                             offsets, k)
    want_part = moe.down_grouped_reference(a["down"], a["down_scale"], want_hid, order, offsets,
                                           w)
    p = m * k
    up = {n: ctx.upload(v) for n, v in (("gu", a["gate_up"]), ("sg", a["gate_up_scale"]),
                                        ("x", a["x"]), ("ids", ids), ("w", w),
                                        ("d", a["down"]), ("sd", a["down_scale"]),
                                        ("hid_ref", want_hid), ("part_ref", want_part))}
    order_d, offsets_d = _poisoned(ctx, p * 4), _poisoned(ctx, (e + 1) * 4)
    hid, part, y = _poisoned(ctx, p * i * 2), _poisoned(ctx, p * h * 4), _poisoned(ctx, m * h * 4)
    _run(ctx, moe.SORT_ENTRY, moe.sort_geometry(p, e),
         [_p(up["ids"]), _p(order_d), _p(offsets_d), ctypes.c_int(p), ctypes.c_int(e)])
    assert np.array_equal(ctx.download(order_d, np.int32, (p,)), order)
    assert np.array_equal(ctx.download(offsets_d, np.int32, (e + 1,)), offsets)
    _run(ctx, moe.GATE_UP_GROUPED_ENTRY, moe.gate_up_grouped_geometry(e, i, h),
         [_p(up["gu"]), _p(up["sg"]), _p(up["x"]), _p(order_d), _p(offsets_d), _p(hid),
          ctypes.c_int(k), ctypes.c_int(i), ctypes.c_int(h)])
    _run(ctx, moe.DOWN_GROUPED_ENTRY, moe.down_grouped_geometry(e, i, h),
         [_p(up["d"]), _p(up["sd"]), _p(up["hid_ref"]), _p(order_d), _p(offsets_d), _p(up["w"]),
          _p(part), ctypes.c_int(i), ctypes.c_int(h)])
    _run(ctx, moe.SUM_PAIRS_ENTRY, moe.sum_pairs_geometry(m, h),
         [_p(up["part_ref"]), _p(y), ctypes.c_int(k), ctypes.c_int(h)])
    z = rng.normal(size=(m, h)).astype(BF16)
    wr = rng.normal(size=(e, h)).astype(BF16)
    dz, dwr, dlogits = ctx.upload(z), ctx.upload(wr), _poisoned(ctx, m * e * 4)
    _run(ctx, moe.ROUTER_ROWS_ENTRY, moe.router_rows_geometry(m, e, h),
         [_p(dz), _p(dwr), _p(dlogits), ctypes.c_int(m), ctypes.c_int(e), ctypes.c_int(h)])
    logits = ctx.download(dlogits, np.float32, (m, e))
    for b in (dz, dwr, dlogits):
        ctx.free(b)
    want_logits = moe.router_rows_reference(z, wr)
    assert np.linalg.norm(logits - want_logits) / np.linalg.norm(want_logits) < 1e-5
    got_hid = ctx.download(hid, BF16, (p, i)).astype(np.float32)
    got_part = ctx.download(part, np.float32, (p, h))
    got_y = ctx.download(y, np.float32, (m, h))
    for b in (*up.values(), order_d, offsets_d, hid, part, y):
        ctx.free(b)
    wh = want_hid.astype(np.float32)
    assert np.isfinite(got_hid).all()
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(wh), 1e-30))) - 7)
    assert (np.abs(got_hid - wh) <= ulp + 1e-5 * np.sqrt(np.mean(wh**2))).all()
    assert np.isfinite(got_part).all()
    assert np.linalg.norm(got_part - want_part) / np.linalg.norm(want_part) < 1e-5
    assert np.array_equal(got_y, moe.sum_pairs_reference(want_part, k))  # the same f32 adds
