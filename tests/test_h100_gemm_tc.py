"""FP8 tensor-core GEMM and per-token activation quantization (targets/h100/gemm_tc.py,
kernels/gemm_tc.cu, kernels/quant_fp8_rows.cu, runtime/executors/tma.py).

CPU: the numpy references; the tile choice; the parameter template's parsing from a synthetic
probe report, its JSON round trip and refusals; filling a template through a stand-in driver;
where nvcc and the CUTLASS headers are present, the real probe of every entry. GPU, on fresh
random inputs, outputs NaN-poisoned with a guard past the end: every entry bit for bit against
the numpy reference on inputs the tensor cores sum exactly, at tiny shapes with M, N and K tails
and at a real shape; the default entry likewise at real 31B / E4B / 26B-A4B shapes for M from 16
to 2048; every entry's accumulation error on model-like data; the quantization kernel bit for
bit; quantization then GEMM chained.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context

from rvcompile.artifacts.kernel_params import ParamsTemplate, ParamsTemplateError
from rvcompile.runtime.executors import tma
from rvcompile.targets.h100 import gemm_tc

HAVE_BUILD = shutil.which("nvcc") is not None and importlib.util.find_spec(
    "cutlass_library") is not None
needs_build = pytest.mark.skipif(not HAVE_BUILD, reason="needs nvcc and nvidia-cutlass")


# ---------------------------------------------------------------- references (CPU)

def test_quantize_rows_reference_known_values() -> None:
    x = np.array([[448.0, -224.0, 1.0, 0.0] * 4,
                  [0.0] * 16,
                  [896.0, 1.0, -3.0, 0.5] * 4], np.float32)
    q, scale = gemm_tc.quantize_rows_reference(x)
    assert scale.dtype == np.float32 and q.dtype == np.uint8
    np.testing.assert_array_equal(scale, np.float32([1.0, 0.0, 2.0]))
    back = gemm_tc.e4m3_to_f32(q)
    np.testing.assert_array_equal(back[0], x[0])  # scale 1: every value is an e4m3
    assert not q[1].any()  # a zero row: zero codes, zero scale
    np.testing.assert_array_equal(back[2, :4], np.float32([448.0, 0.5, -1.5, 0.25]))


def test_quantize_rows_reference_rounds_to_nearest_even_and_clamps() -> None:
    # amax 448 -> inv 1: 17 lies between e4m3 16 and 18 -> 16 (even mantissa); 19 -> 20
    x = np.array([[17.0, 19.0, 448.0, -17.0] + [0.0] * 12], np.float32)
    q, _ = gemm_tc.quantize_rows_reference(x)
    np.testing.assert_array_equal(gemm_tc.e4m3_to_f32(q)[0, :4], [16.0, 20.0, 448.0, -16.0])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 64)).astype(ml_dtypes.bfloat16)
    q, scale = gemm_tc.quantize_rows_reference(x)
    back = gemm_tc.e4m3_to_f32(q) * scale[:, None]
    assert np.abs(gemm_tc.e4m3_to_f32(q)).max() == 448.0
    err = np.abs(back - x.astype(np.float32)) / np.abs(x.astype(np.float32)).max(axis=1)[:, None]
    assert err.max() < 2.0 ** -4  # e4m3 keeps 3 mantissa bits


def test_gemm_reference_matches_float64() -> None:
    rng = np.random.default_rng(2)
    a, b = random_fp8(rng, (5, 48)), random_fp8(rng, (24, 48))
    sa, sb = rng.uniform(0.5, 2, 5).astype(np.float32), rng.uniform(1e-3, 1e-2, 24).astype(
        np.float32)
    want = (gemm_tc.e4m3_to_f32(a).astype(np.float64)
            @ gemm_tc.e4m3_to_f32(b).astype(np.float64).T) * sb[None, :] * sa[:, None]
    got = gemm_tc.reference(a, sa, b, sb)
    assert got.dtype == np.float32
    # three float32 roundings (the sum, then each scale's multiply)
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2.0 ** -22 * np.abs(want) + 1e-30)


def test_shapes_and_default_entries() -> None:
    gemm_tc.check_shape(1, 8, 16)
    for m, n, k in [(0, 8, 16), (1, 12, 16), (1, 8, 24), (1, 0, 16)]:
        with pytest.raises(ValueError, match="gemm_tc needs"):
            gemm_tc.check_shape(m, n, k)
    pick = gemm_tc.default_entry
    assert pick(16, 43008, 132) == "gemm_fp8_tc_64x128"  # few rows: 64-row tiles
    assert pick(16, 18432, 132) == "gemm_fp8_tc_64x256"  # 72 tiles in one wave beat 144 in two
    assert pick(2048, 43008, 132) == "gemm_fp8_tc_128x256"
    # 5376 columns at 256 rows: 42 tiles of 128 x 256 leave 90 SMs idle, 84 of 128 x 128 fewer
    assert pick(256, 5376, 132) == "gemm_fp8_tc_128x128"
    # few rows of a narrow output: 84 tiles of 64 x 64 stream the weights on more SMs than 42
    # of 64 x 128 (the 31B's o and down), but not where 64 x 128 already fills the SMs
    assert pick(32, 5376, 132) == pick(64, 5376, 132) == "gemm_fp8_tc_64x64"
    assert pick(64, 16384, 132) == "gemm_fp8_tc_64x128"
    assert pick(128, 5376, 132) == "gemm_fp8_tc_64x128"
    assert pick(1, 8, 132) == "gemm_fp8_tc_64x64"
    launch = gemm_tc.quant_launch(3, 32, "float32")
    assert launch.entry == "quant_fp8_rows_f32" and launch.grid == (3, 1, 1)
    assert launch.smem == 128 and gemm_tc.quant_launch(3, 21504, "bfloat16").smem == 43008
    with pytest.raises(ValueError, match="dtype"):
        gemm_tc.quant_launch(3, 32, "float16")
    with pytest.raises(ValueError, match="K a positive multiple of 16"):
        gemm_tc.quant_launch(3, 40, "bfloat16")
    with pytest.raises(ValueError, match="at most"):
        gemm_tc.quant_launch(3, 60000, "float32")


# ---------------------------------------------------------------- parameter templates (CPU)

BASES = {"a": 0x00007A1100000000, "b": 0x00007B2200000000, "d": 0x00007D4400000000,
         "a_scale": 0x00007E5500000000, "b_scale": 0x00007F6600000000}
MARK = 0xD35C000000000000


def synthetic_probe(size: int = 1024) -> dict:
    """A probe report shaped like the real one: descriptors of a, b, d at 128, 384, 640 (marked),
    the two scale pointers at 904 and 920, the b pointer once more at 936 (+64), filler bytes."""
    raw = bytearray((i * 7 + 3) % 251 for i in range(size))
    for i, off in enumerate((128, 384, 640)):
        raw[off:off + 128] = b"".join(struct.pack("<Q", MARK | i << 8 | w) for w in range(16))
    for off, role, delta in ((904, "a_scale", 0), (920, "b_scale", 0), (936, "b", 64)):
        raw[off:off + 8] = struct.pack("<Q", BASES[role] + delta)
    enc = {"dtype": 0, "rank": 3, "dims": [64, 32, 1], "strides": [64, 2048],
           "box": [64, 32, 1], "elem_strides": [1, 1, 1], "interleave": 0, "swizzle": 3,
           "l2_promotion": 2, "oob_fill": 0}
    return {"size": size, "align": 128, "grid": [132, 1, 1], "block": [384, 1, 1],
            "smem": 200000, "cluster": [2, 1, 1],
            "known_descriptors": {"a": 128, "b": 384, "d": 640}, "roles": BASES,
            "descriptor_mark": MARK,
            "encodes": [dict(enc, address=BASES[r]) for r in ("a", "b", "d")],
            "bytes": raw.hex(), "bytes_alt": raw.hex()}


def set_bytes(out: dict, raw: bytearray) -> dict:
    out["bytes"] = out["bytes_alt"] = raw.hex()
    return out


def test_parse_probe_finds_every_place_and_zeroes_it() -> None:
    out = synthetic_probe()
    alt = bytearray.fromhex(out["bytes"])
    alt[3] ^= 0xFF  # undefined in one image of the second run: padding
    t = gemm_tc.parse_probe("gemm_fp8_tc_128x256_c2x1", [out, dict(out, bytes_alt=alt.hex())])
    assert [(d.offset, d.role, d.delta) for d in t.descriptors] == [
        (128, "a", 0), (384, "b", 0), (640, "d", 0)]
    assert [(p.offset, p.role, p.delta) for p in t.pointers] == [
        (904, "a_scale", 0), (920, "b_scale", 0), (936, "b", 64)]
    raw = bytes.fromhex(out["bytes"])
    places = [(d.offset, 128) for d in t.descriptors] + [(p.offset, 8) for p in t.pointers]
    for i in range(len(raw)):
        inside = any(o <= i < o + n for o, n in places) or i == 3
        assert t.template[i] == (0 if inside else raw[i])
    assert ParamsTemplate.from_json(t.to_json()) == t


def test_parse_probe_refuses_what_it_cannot_place() -> None:
    out = synthetic_probe()
    out["known_descriptors"] = {"a": 128, "b": 384, "d": 768}
    with pytest.raises(ValueError, match="struct's fields"):
        gemm_tc.parse_probe("e", [out])
    out = synthetic_probe()
    raw = bytearray.fromhex(out["bytes"])
    raw[900:908] = struct.pack("<Q", BASES["d"])  # an address at a 4-byte offset
    with pytest.raises(ValueError, match="unaligned"):
        gemm_tc.parse_probe("e", [set_bytes(out, raw)])
    out = synthetic_probe()
    raw = bytearray.fromhex(out["bytes"])
    raw[920:928] = bytes(8)  # no b_scale pointer
    with pytest.raises(ValueError, match="no b_scale pointer"):
        gemm_tc.parse_probe("e", [set_bytes(out, raw)])
    out = synthetic_probe()
    alt = bytearray.fromhex(out["bytes"])
    alt[200] ^= 1  # a's descriptor differs between the images
    with pytest.raises(ValueError, match="descriptor 0 found 0 times"):
        gemm_tc.parse_probe("e", [dict(out, bytes_alt=alt.hex())])
    out = synthetic_probe()
    out["encodes"][1]["address"] = 0x1234_0000_0000
    with pytest.raises(ValueError, match="no role's"):
        gemm_tc.parse_probe("e", [out])
    with pytest.raises(ValueError, match="disagree"):
        gemm_tc.parse_probe("e", [synthetic_probe(), dict(synthetic_probe(), smem=1)])


@pytest.mark.parametrize("field,value,match", [
    ("bytes", "zz", "hex"), ("grid", [1, 1], "grid"), ("smem", -1, "smem"),
    ("roles", ["a", "a", "b", "d", "a_scale", "b_scale"], "repeat"),
])
def test_template_json_refusals(field: str, value, match: str) -> None:
    d = gemm_tc.parse_probe("e", [synthetic_probe()]).to_json()
    d[field] = value
    with pytest.raises(ParamsTemplateError, match=match):
        ParamsTemplate.from_json(d)


def test_template_refuses_overlaps_and_unzeroed_places() -> None:
    d = gemm_tc.parse_probe("e", [synthetic_probe()]).to_json()
    d["pointers"][0]["offset"] = 136  # inside a's descriptor
    with pytest.raises(ParamsTemplateError, match="overlaps"):
        ParamsTemplate.from_json(d)
    d = gemm_tc.parse_probe("e", [synthetic_probe()]).to_json()
    d["descriptors"][0]["offset"] = 0  # free, but holds the filler bytes
    with pytest.raises(ParamsTemplateError, match="not zeroed"):
        ParamsTemplate.from_json(d)
    d = gemm_tc.parse_probe("e", [synthetic_probe()]).to_json()
    d["descriptors"][0]["offset"] = 130
    with pytest.raises(ParamsTemplateError, match="aligned"):
        ParamsTemplate.from_json(d)
    del d["pointers"]
    with pytest.raises(ParamsTemplateError, match="pointers"):
        ParamsTemplate.from_json(d)


class FakeDriver:
    """cuTensorMapEncodeTiled and the enum / integer wrappers tma.fill uses; the 'descriptor'
    is the call's arguments packed into 128 bytes, so a test can read them back."""

    def __init__(self):
        self.calls = []
        self.keep = []
        for name in ("CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle",
                     "CUtensorMapL2promotion", "CUtensorMapFloatOOBfill", "cuuint64_t",
                     "cuuint32_t"):
            setattr(self, name, int)

    def cuTensorMapEncodeTiled(self, dtype, rank, address, dims, strides, box, elem, interleave,
                               swizzle, l2, oob):
        self.calls.append((dtype, rank, address, dims, strides, box, elem))
        words = [address, dtype, rank, *dims, *strides, *box, swizzle, l2]
        buf = ctypes.create_string_buffer(struct.pack("<16Q", *(words + [0] * 16)[:16]), 128)
        self.keep.append(buf)
        tensor_map = type("Map", (), {"getPtr": lambda _self: ctypes.addressof(buf)})()
        return (0, tensor_map)


def test_fill_patches_descriptors_and_pointers() -> None:
    t = gemm_tc.parse_probe("e", [synthetic_probe()])
    cu = FakeDriver()
    addresses = {"a": 0x7F00_0000_1000, "b": 0x7F00_1000_0000, "d": 0x7F00_2000_0000,
                 "a_scale": 0x7F00_3000_0000, "b_scale": 0x7F00_3000_1000}
    data = tma.fill(cu, t, addresses)
    assert len(data) == len(t.template)
    for d in t.descriptors:
        words = struct.unpack_from("<16Q", data, d.offset)
        assert words[0] == addresses[d.role] + d.delta and words[1:3] == (0, 3)
    for p in t.pointers:
        assert struct.unpack_from("<Q", data, p.offset)[0] == addresses[p.role] + p.delta
    changed = {i for i in range(len(data)) if data[i] != t.template[i]}
    allowed = {i for d in t.descriptors for i in range(d.offset, d.offset + 128)}
    allowed |= {i for p in t.pointers for i in range(p.offset, p.offset + 8)}
    assert changed <= allowed
    params = tma.KernelParams(data)
    assert ctypes.addressof(params.arg) % 64 == 0 and bytes(params.arg) == data


def test_fill_refuses_missing_or_misaligned_addresses() -> None:
    t = gemm_tc.parse_probe("e", [synthetic_probe()])
    good = {"a": 1 << 20, "b": 2 << 20, "d": 3 << 20, "a_scale": 4 << 20, "b_scale": 5 << 20}
    with pytest.raises(ValueError, match="roles"):
        tma.fill(FakeDriver(), t, {k: v for k, v in good.items() if k != "d"})
    with pytest.raises(ValueError, match="16-byte-aligned"):
        tma.fill(FakeDriver(), t, dict(good, b_scale=(5 << 20) + 4))


@needs_build
@pytest.mark.parametrize("entry", sorted(gemm_tc.CONFIGS))
def test_probe_every_entry(entry: str) -> None:
    cfg = gemm_tc.CONFIGS[entry]
    t = gemm_tc.params_template(entry, 200, 43008, 5376, 132)
    assert t.kernel == entry and t.block == (384, 1, 1) and 100_000 < t.smem <= 227 * 1024
    assert {d.role for d in t.descriptors} == {"a", "b", "d"}
    assert {p.role for p in t.pointers} == {"a_scale", "b_scale"}
    a, b = ({d.role: d for d in t.descriptors}[r] for r in ("a", "b"))
    itemsize = 1 if cfg.element == "e4m3" else 2
    assert a.dims[:2] == (5376, 200) and a.strides[0] == 5376 * itemsize
    assert b.dims[:2] == (5376, 43008) and b.box[0] == cfg.tile[2]
    assert t.grid[0] * t.grid[1] <= 132 and t.grid[0] % cfg.cluster[0] == 0
    assert gemm_tc.params_template(entry, 200, 43008, 5376, 132) == t  # deterministic


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_quant_kernel_builds(tmp_path) -> None:
    """(The CUTLASS module takes minutes to compile on two cores: the GPU tests build it; its
    entries' names are checked by the probe above.)"""
    from rvcompile.targets.h100.nvcc import compile_cubin

    quant = compile_cubin(gemm_tc.QUANT_SOURCE, cache_dir=tmp_path)
    for entry in gemm_tc.QUANT_ENTRIES.values():
        assert entry.encode() + b"\0" in quant


# ---------------------------------------------------------------- GPU

FP8 = sorted(e for e, c in gemm_tc.CONFIGS.items() if c.element == "e4m3")
BF16 = sorted(e for e, c in gemm_tc.CONFIGS.items() if c.element == "bfloat16")

def random_fp8(rng, shape) -> np.ndarray:
    """Random e4m3 bit patterns (subnormals included) with the NaN codes (0x7f, 0xff) removed."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 0x01
    return b


def random_case(m: int, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    return (random_fp8(rng, (m, k)), rng.uniform(0.5, 2.0, m).astype(np.float32),
            random_fp8(rng, (n, k)), rng.uniform(1e-4, 1e-3, n).astype(np.float32))


def exact_case(m: int, n: int, k: int, seed: int):
    """Inputs whose sums the FP8 tensor cores add exactly: a and b from {0, +-1/2, +-1, +-2}, so
    every product lies on a 1/4 grid and every partial sum (a random walk, a few hundred at
    most at these K) needs far fewer than the accumulator's 13 mantissa bits. d must then equal
    the reference bit for bit."""
    rng = np.random.default_rng(seed)
    grid = np.float32([0, 0.5, -0.5, 1, -1, 2, -2]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return (grid[rng.integers(0, 7, (m, k))], rng.uniform(0.5, 2.0, m).astype(np.float32),
            grid[rng.integers(0, 7, (n, k))], rng.uniform(1e-4, 1e-3, n).astype(np.float32))


GUARD = 512  # bytes after d that must stay untouched


class Gpu:
    """A context with both modules loaded once for the whole test module."""

    def __init__(self):
        from rvcompile.targets.h100.nvcc import compile_cubin

        self.ctx = ctx = h100_context()
        gemm = ctx.load_module(compile_cubin(gemm_tc.SOURCE))
        quant = ctx.load_module(compile_cubin(gemm_tc.QUANT_SOURCE))
        self.fns = {e: ctx.get_function(gemm, e) for e in gemm_tc.CONFIGS}
        self.fns.update({e: ctx.get_function(quant, e)
                         for e in gemm_tc.QUANT_ENTRIES.values()})

    def gemm(self, entry: str, a, sa, b, sb) -> np.ndarray:
        ctx = self.ctx
        (m, k), n = a.shape, b.shape[0]
        t = gemm_tc.params_template(entry, m, n, k, ctx.sm_count)
        fn = self.fns[entry]
        ctx.set_max_dynamic_smem(fn, t.smem)
        bufs = {"a": ctx.upload(a), "a_scale": ctx.upload(sa), "b": ctx.upload(b),
                "b_scale": ctx.upload(sb), "d": ctx.alloc(m * n * 4 + GUARD)}
        try:
            ctx.memset(bufs["d"], 0xFF)  # float32 0xffffffff is a NaN: every output written
            params = tma.KernelParams(tma.fill(ctx.cu, t, {r: b.ptr for r, b in bufs.items()}))
            ctx.launch(fn, t.grid, t.block, t.smem, [params.arg])
            ctx.synchronize()
            out = ctx.download(bufs["d"], np.uint8, (m * n * 4 + GUARD,))
        finally:
            for buf in bufs.values():
                ctx.free(buf)
        assert (out[m * n * 4:] == 0xFF).all(), "wrote past the end of d"
        d = out[:m * n * 4].view(np.float32).reshape(m, n)
        assert np.isfinite(d).all(), "NaN or inf in d (unwritten?)"
        return d

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ctx = self.ctx
        m, k = x.shape
        launch = gemm_tc.quant_launch(m, k, np.dtype(x.dtype).name)
        ctx.set_max_dynamic_smem(self.fns[launch.entry], launch.smem)
        dx, dq, ds = ctx.upload(x), ctx.alloc(m * k + GUARD), ctx.alloc(m * 4 + GUARD)
        try:
            ctx.memset(dq, 0x7F)  # e4m3 NaN
            ctx.memset(ds, 0xFF)  # float32 NaN
            ctx.launch(self.fns[launch.entry], launch.grid, launch.block, launch.smem,
                       [ctypes.c_uint64(dx.ptr), ctypes.c_uint64(dq.ptr), ctypes.c_uint64(ds.ptr),
                        ctypes.c_int(m), ctypes.c_int(k)])
            ctx.synchronize()
            q = ctx.download(dq, np.uint8, (m * k + GUARD,))
            s = ctx.download(ds, np.uint8, (m * 4 + GUARD,))
        finally:
            for buf in (dx, dq, ds):
                ctx.free(buf)
        assert (q[m * k:] == 0x7F).all() and (s[m * 4:] == 0xFF).all(), "wrote past the end"
        return q[:m * k].reshape(m, k), s[:m * 4].view(np.float32)


@pytest.fixture(scope="module")
def gpu() -> Gpu:
    return Gpu()


def assert_exact(got, a, sa, b, sb, rows=None) -> None:
    """got (rows of d; all by default) equals the reference bit for bit."""
    rows = np.arange(a.shape[0]) if rows is None else rows
    want = gemm_tc.reference(a[rows], sa[rows], b, sb)
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), (
        f"{diff.sum()} of {diff.size} outputs differ from the reference, first at "
        f"{np.argwhere(diff)[0]}: {got[diff][:4]} != {want[diff][:4]}")


def sample_rows(m: int) -> np.ndarray:
    """Up to 96 rows, the first and last tiles' included: the exact reference of all N columns
    at real shapes stays a few seconds."""
    return np.unique(np.r_[0:min(m, 32), max(0, m - 32):m,
                           np.random.default_rng(m).integers(0, m, 32)])


TINY = [  # (M, N, K): M, N and K tails against every tile; K below and between tile depths
    (1, 8, 16), (5, 136, 48), (70, 264, 272), (129, 392, 400), (200, 1000, 2112), (300, 520, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("entry", FP8)
@pytest.mark.parametrize("m,n,k", TINY)
def test_gemm_tiny_is_exact(gpu: Gpu, entry: str, m: int, n: int, k: int) -> None:
    a, sa, b, sb = exact_case(m, n, k, seed=m * 7919 + n * 31 + k)
    assert_exact(gpu.gemm(entry, a, sa, b, sb), a, sa, b, sb)


REAL = [  # (M, N, K) at 31B, E4B and 26B-A4B linear shapes, ragged M, every default tile
    (16, 43008, 5376), (64, 16384, 5376), (100, 18432, 5376), (256, 5376, 21504),
    (333, 5376, 8192), (2048, 43008, 5376),  # 31B
    (40, 20480, 2560), (128, 3072, 2560), (700, 2560, 10240),  # E4B
    (129, 4224, 2816), (1000, 2816, 2112), (77, 9216, 2816),  # 26B-A4B: K = 2112 = 16.5 x 128
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", REAL)
def test_gemm_real_shapes_are_exact(gpu: Gpu, m: int, n: int, k: int) -> None:
    entry = gemm_tc.default_entry(m, n, gpu.ctx.sm_count)
    a, sa, b, sb = exact_case(m, n, k, seed=m + n + k)
    rows = sample_rows(m)
    assert_exact(gpu.gemm(entry, a, sa, b, sb)[rows], a, sa, b, sb, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", FP8)
def test_every_entry_at_a_real_shape_is_exact(gpu: Gpu, entry: str) -> None:
    m, n, k = 333, 18432, 5376
    a, sa, b, sb = exact_case(m, n, k, seed=5)
    rows = np.r_[0:16, 150:166, m - 16:m]
    assert_exact(gpu.gemm(entry, a, sa, b, sb)[rows], a, sa, b, sb, rows)


def normal_case(m: int, n: int, k: int, seed: int):
    """Activations and weights as a model has them: normal values, a quantized per row (token),
    b per row (channel), by the quantization reference."""
    rng = np.random.default_rng(seed)
    a, sa = gemm_tc.quantize_rows_reference(rng.normal(size=(m, k)).astype(np.float32))
    b, sb = gemm_tc.quantize_rows_reference(rng.normal(size=(n, k)).astype(np.float32))
    return a, sa, b, sb


# The accumulation's error on model-like data, measured on an H100 with a bf16 d (docs/
# BENCHMARKS.md, "FP8 tensor-core GEMM"; the same to three digits as torch._scaled_mm's, cuBLAS,
# in the same accumulation mode): with fast accumulation row-wise ||d - exact|| / ||exact|| up
# to 0.20 / 0.25 / 0.44 % at K = 2112 / 5376 / 21504 and |d - exact| beyond the bf16 rounding up
# to 2.6e-4 / 2.7e-4 / 5.3e-4 of sum_k |a b| (the 13-bit accumulator truncating over K);
# promoted 0.17 % (the bf16 rounding of d alone) and 2.1e-5 at most. Bounds: about twice those.
# d is float32 now (its rounding, 2^-24 relative, is what D_ROUNDING allows); the accumulation
# error is the same.
ROW_TOL = {True: 2.0 ** -7, False: 2.0 ** -8}
ACC_TOL = {True: 2.0 ** -10, False: 2.0 ** -14}
D_ROUNDING = 2.0 ** -22  # three float32 roundings: the sum, then each scale's multiply


@pytest.mark.gpu
@pytest.mark.parametrize("entry", FP8)
@pytest.mark.parametrize("k", [2112, 5376, 21504])
def test_accumulation_error_on_model_like_data(gpu: Gpu, entry: str, k: int) -> None:
    m, n = 200, 1024
    a, sa, b, sb = normal_case(m, n, k, seed=k)
    got = gpu.gemm(entry, a, sa, b, sb).astype(np.float64)
    af = gemm_tc.e4m3_to_f32(a).astype(np.float64)
    bf = gemm_tc.e4m3_to_f32(b).astype(np.float64)
    scales = sb.astype(np.float64)[None, :] * sa.astype(np.float64)[:, None]
    exact = (af @ bf.T) * scales
    magnitude = (np.abs(af) @ np.abs(bf).T) * scales
    fast = gemm_tc.CONFIGS[entry].fast_accum
    excess = (np.abs(got - exact) - D_ROUNDING * np.abs(exact)) / magnitude
    row_rel = np.linalg.norm(got - exact, axis=1) / np.linalg.norm(exact, axis=1)
    print(f"\n[measured] {entry} K={k}: excess {excess.max():.3g} of sum |a b|, row error "
          f"{row_rel.max():.3g}")
    assert excess.max() <= ACC_TOL[fast], f"{excess.max():.3g} of sum |a b| > {ACC_TOL[fast]:.3g}"
    assert row_rel.max() <= ROW_TOL[fast], f"row error {row_rel.max():.3g} > {ROW_TOL[fast]:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("m,k", [(1, 16), (7, 5376), (64, 21504), (300, 2816), (2048, 16384)])
def test_quantize_rows_bit_exact(gpu: Gpu, dtype: str, m: int, k: int) -> None:
    rng = np.random.default_rng(m * 13 + k)
    x = (rng.normal(size=(m, k)) * np.exp(rng.uniform(-20, 20, (m, 1)))).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    x[m // 2] = 0  # a zero row
    if k > 16:
        x[-1, :16] = 1e-30  # values far below the row's amax: e4m3 subnormals and zeros
    q, scale = gpu.quantize(x)
    want_q, want_scale = gemm_tc.quantize_rows_reference(x)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(q, want_q)


@pytest.mark.gpu
def test_quantize_then_gemm(gpu: Gpu) -> None:
    """The two kernels chained. x's rows are the exact grid times a per-row factor, so the codes
    are {0, +-112, +-224, +-448} whatever the factor, every partial sum stays a multiple of 8
    below 2^17 (13 mantissa bits: exact) and d must equal the reference of the reference's
    quantization bit for bit."""
    m, n, k = 300, 4224, 2816
    grid_a, _, b, sb = exact_case(m, n, k, seed=12)
    rng = np.random.default_rng(13)
    grid_a[:, 0] = 0x40  # every row reaches 2: amax 2 x factor
    x = (gemm_tc.e4m3_to_f32(grid_a) * rng.uniform(1e-3, 1e3, (m, 1))).astype(
        ml_dtypes.bfloat16)
    a, sa = gpu.quantize(x)
    want_a, want_sa = gemm_tc.quantize_rows_reference(x)
    np.testing.assert_array_equal(a, want_a)
    np.testing.assert_array_equal(sa, want_sa)
    assert set(np.unique(gemm_tc.e4m3_to_f32(a) ** 2)) <= {0.0, 112.0**2, 224.0**2, 448.0**2}
    got = gpu.gemm(gemm_tc.default_entry(m, n, gpu.ctx.sm_count), a, sa, b, sb)
    assert_exact(got, a, sa, b, sb)


# ---------------------------------------------------------------- bf16 entries (the tied head)

def bf16_grid_case(m: int, n: int, k: int, seed: int):
    """bf16 a and b from {0, +-1/2, +-1, +-2}: every product and partial sum is exact in float32,
    so d must equal the reference bit for bit whatever the order of the sums."""
    rng = np.random.default_rng(seed)
    grid = np.float32([0, 0.5, -0.5, 1, -1, 2, -2]).astype(ml_dtypes.bfloat16)
    return grid[rng.integers(0, 7, (m, k))], grid[rng.integers(0, 7, (n, k))]


def gemm_bf16(gpu: Gpu, entry: str, a, b) -> np.ndarray:
    ones_m, ones_n = np.ones(a.shape[0], np.float32), np.ones(b.shape[0], np.float32)
    return gpu.gemm(entry, a, ones_m, b, ones_n)


def test_bf16_reference_and_default_entries() -> None:
    rng = np.random.default_rng(4)
    a = rng.normal(size=(5, 48)).astype(ml_dtypes.bfloat16)
    b = rng.normal(size=(24, 48)).astype(ml_dtypes.bfloat16)
    want = a.astype(np.float64) @ b.astype(np.float64).T
    got = gemm_tc.reference_bf16(a, b)
    assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float32))
    assert gemm_tc.default_entry(32, 262144, 132, "bfloat16") == "gemm_bf16_tc_64x256"
    assert gemm_tc.default_entry(256, 262144, 132, "bfloat16") == "gemm_bf16_tc_128x256"
    assert gemm_tc.default_entry(32, 262144, 132) == "gemm_fp8_tc_64x256"  # e4m3 by default
    with pytest.raises(ValueError, match="element"):
        gemm_tc.default_entry(32, 262144, 132, "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("entry", BF16)
@pytest.mark.parametrize("m,n,k", TINY)
def test_bf16_gemm_tiny_is_exact(gpu: Gpu, entry: str, m: int, n: int, k: int) -> None:
    a, b = bf16_grid_case(m, n, k, seed=m * 7919 + n * 31 + k)
    got = gemm_bf16(gpu, entry, a, b)
    want = gemm_tc.reference_bf16(a, b)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"{(got != want).sum()} of {got.size} differ"


HEAD = [(5, 262144, 5376), (8, 262144, 5376), (32, 262144, 5376), (256, 262144, 5376),
        (32, 262144, 2560), (9, 8192, 128)]  # the 31B and E4B heads, the default model's


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", HEAD)
def test_bf16_head_shapes_within_float32_summation(gpu: Gpu, m: int, n: int, k: int) -> None:
    """Normal bf16 data at the heads' shapes, every row, a sample of columns (the first and last
    tiles' among them): |d - exact| within K float32 roundings of sum_k |a b|, the bound of any
    float32 summation order."""
    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((m, k), np.float32).astype(ml_dtypes.bfloat16)
    # a random block of 4096 table rows, repeated: the kernel reads all N rows as it would a
    # table's, and making 2.8 GB of random numbers would take longer than the test
    block = (rng.standard_normal((min(n, 4096), k), np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    b = np.tile(block, (-(-n // block.shape[0]), 1))[:n]
    got = gemm_bf16(gpu, gemm_tc.default_entry(m, n, gpu.ctx.sm_count, "bfloat16"), a, b)
    cols = np.unique(np.r_[0:256, n - 256:n, rng.integers(0, n, 2048)])
    af, bf = a.astype(np.float64), b[cols].astype(np.float64)
    exact, magnitude = af @ bf.T, np.abs(af) @ np.abs(bf).T
    err = np.abs(got[:, cols].astype(np.float64) - exact) / magnitude
    print(f"\n[measured] bf16 head M={m} N={n} K={k}: error {err.max():.3g} of sum |a b|")
    assert err.max() <= k * 2.0 ** -24
