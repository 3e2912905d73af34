"""The tensor-core GEMMs (kernels/gemm_tc.cu, CUTLASS SM90 TMA + wgmma) and the per-token
activation quantization that feeds the FP8 ones (kernels/quant_fp8_rows.cu): numpy references,
shape checks, the tile configuration for an M x N output, and the build-time probe of the
kernel's parameter block.

FP8 entries (gemm_fp8_tc_*, the linears):

    a_scale[m] = max_k |x[m, k]| / 448,  a[m, k] = e4m3(x[m, k] * 448 / max_k |x[m, k]|)
    d[m, n] = (sum_k a[m, k] * b[n, k]) * b_scale[n] * a_scale[m]

a: e4m3 [M, K] activations, b: e4m3 [N, K] weights with one float32 scale per row (channel), d:
float32 [M, N], as the GEMVs write a linear's output (the kernels reading it take float32; a
bf16 d would need a bf16-input entry of each).

bf16 entries (gemm_bf16_tc_*, the tied head over many rows): a bf16 [M, K] (the normed hidden
rows as the head's GEMV reads them), b bf16 [N, K] (the embedding table), the same epilogue with
both scale vectors all ones, so d[m, n] = sum_k a[m, k] * b[n, k] in float32. The GEMV
(gemv_bf16) reads the table once per 4 rows; this reads it once for all of them.

Limits: M >= 1, K % 16 == 0, N % 8 == 0 (16-byte TMA row strides); every buffer 16-byte aligned.

Numerics: Hopper's FP8 tensor cores add products into an accumulator with about 13 mantissa
bits, truncating (others measured "FP22"); fast-accumulation entries keep all of K there, the
promoted entry adds each 128-deep k tile's partial sum into float32 registers. Sums that fit
those bits (e.g. products on a 1/4 grid with partial sums below 2^11) come out exact, and then d
equals the reference bit for bit; otherwise d differs from it by that accumulation error. bf16
products are exact in float32 and accumulate in float32 (in another order than numpy's).

The GEMM takes CUTLASS's `Params` struct by value. params_template runs the module's probe (the
source compiled for the host, nvcc.compile_host_probe) for one (entry, M, N, K) and returns a
kernel_params.ParamsTemplate: the struct with its addresses zeroed, the places of the pointers
and TMA descriptors by role ("a", "b", "d", "a_scale", "b_scale") and the launch geometry. The
runtime completes it for real addresses (runtime/executors/tma.py). Its results are cached per
process (one lowering asks for the same shapes in many layers and entries).
"""

from __future__ import annotations

import functools
import json
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from rvcompile.artifacts.kernel_params import (
    DESCRIPTOR_BYTES,
    DescriptorSlot,
    ParamsTemplate,
    PointerSlot,
)
from rvcompile.targets.h100 import gemv_fp8
from rvcompile.targets.h100.contract import Call, Entry, Param, i32, ptr

SOURCE = "gemm_tc.cu"
QUANT_SOURCE = "quant_fp8_rows.cu"
PROBE_DEFINE = "GEMM_TC_PROBE"
E4M3_MAX = 448.0
ROLES = ("a", "b", "d", "a_scale", "b_scale")
QUANT_THREADS = 256  # must match quant_fp8_rows.cu
QUANT_ENTRIES = {"bfloat16": "quant_fp8_rows_bf16", "float32": "quant_fp8_rows_f32"}
QUANT_ITEMSIZE = {"bfloat16": 2, "float32": 4}
MAX_SMEM = 227 * 1024  # H100: dynamic shared memory one block may opt into


@dataclass(frozen=True)
class TileConfig:
    """One entry of gemm_tc.cu (its name and template arguments must match)."""

    entry: str
    element: str  # of a and b: "e4m3" (the linears) or "bfloat16" (the tied head)
    tile: tuple[int, int, int]  # CTA tile M x N x K
    cluster: tuple[int, int]  # CTAs per cluster along M and N (TMA multicast)
    schedule: str  # "pingpong" (a warpgroup per tile) or "cooperative" (two on one tile)
    fast_accum: bool  # all of K in the wgmma accumulator; else promoted into float32
    # TFLOP/s per SM in full waves of this tile (benchmarks/h100_gemm_tc.py --sweep, H100 SXM,
    # 31B gate_up at M = 2048); 0: never picked by default_entry
    sm_tflops: float


CONFIGS = {c.entry: c for c in (
    # Twice the CTAs of 64 x 128 on a narrow output at few rows, where the GEMM streams the
    # weights: at 16-64 rows on an H200 (benchmarks/h100_gemm_tc.py --sweep, 2026-11-29) the 31B's
    # o and down (N = 5376: 84 tiles against 42) took 15-18% less time, every wider output
    # 5-15% more (each 64-column tile re-reads the activation rows as it reads weight rows). Its
    # rate is fit to that sweep, not measured at 2048 rows: any value in 2.8 .. 4.3 picks it
    # exactly where it is fastest there (the picks' sum within 0.1% of the best tile per shape
    # over 16-256 rows on the 31B and E4B: 31B 1,477 -> 1,431 us, E4B 348 -> 310).
    TileConfig("gemm_fp8_tc_64x64", "e4m3", (64, 64, 128), (1, 1), "pingpong", True, 3.5),
    TileConfig("gemm_fp8_tc_64x128", "e4m3", (64, 128, 128), (1, 1), "pingpong", True, 5.57),
    TileConfig("gemm_fp8_tc_64x256", "e4m3", (64, 256, 128), (1, 1), "pingpong", True, 7.34),
    TileConfig("gemm_fp8_tc_128x128", "e4m3", (128, 128, 128), (1, 1), "cooperative", True,
               8.76),
    TileConfig("gemm_fp8_tc_128x256", "e4m3", (128, 256, 128), (1, 1), "cooperative", True,
               9.34),
    # promotion needs a second accumulator: at 128 x 256 it spills, at 128 x 128 it fits
    TileConfig("gemm_fp8_tc_128x128_promoted", "e4m3", (128, 128, 128), (1, 1), "cooperative",
               False, 0),
    # bf16 runs at half FP8's rate on the tensor cores; the rates are that estimate, not yet
    # measured (the head is bound by reading the table, not by the tiles' rate)
    TileConfig("gemm_bf16_tc_64x256", "bfloat16", (64, 256, 64), (1, 1), "pingpong", True,
               3.67),
    TileConfig("gemm_bf16_tc_128x256", "bfloat16", (128, 256, 64), (1, 1), "cooperative",
               True, 4.67),
)}
ELEMENTS = ("e4m3", "bfloat16")
RASTERS = {"heuristic": 0, "along_m": 1, "along_n": 2}  # CUTLASS's RasterOrderOptions
SWIZZLES = (1, 2, 4, 8)


def check_shape(m: int, n: int, k: int) -> None:
    if not fits(m, n, k):
        raise ValueError(f"gemm_tc needs M >= 1, N a positive multiple of 8 and K a positive "
                         f"multiple of 16 (M={m}, N={n}, K={k})")


def fits(m: int, n: int, k: int) -> bool:
    """Whether an [m, k] x [n, k]^T product meets check_shape's limits."""
    return m >= 1 and n >= 8 and k >= 16 and n % 8 == 0 and k % 16 == 0


def tiles(entry: str, m: int, n: int) -> int:
    tm, tn, _ = CONFIGS[entry].tile
    return -(-m // tm) * -(-n // tn)


def default_entry(m: int, n: int, sm_count: int, element: str = "e4m3") -> str:
    """The tile configuration of `element` for an M x N output: the least estimated time, one
    tile's work
    over its measured rate times the waves of tiles over the SMs (the persistent grid runs one
    CTA per SM). Small M picks 64-row tiles, large M 128 x 256, and wave quantization moves
    the choice between them (e.g. 128 x 128 where 128 x 256 would leave most SMs idle)."""
    def estimate(c: TileConfig) -> float:
        waves = -(-tiles(c.entry, m, n) // sm_count)
        return waves * c.tile[0] * c.tile[1] / c.sm_tflops

    if element not in ELEMENTS:
        raise ValueError(f"gemm_tc: element {element!r} not one of {ELEMENTS}")
    return min((c for c in CONFIGS.values() if c.sm_tflops and c.element == element),
               key=estimate).entry


# ---------------------------------------------------------------- numpy references

def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    return gemv_fp8.e4m3_to_f32(np.asarray(bits, np.uint8))


def reference(a: np.ndarray, a_scale: np.ndarray, b: np.ndarray,
              b_scale: np.ndarray) -> np.ndarray:
    """d (float32 [M, N]) of e4m3 bit patterns a [M, K] and b [N, K]: the dot products in
    float64 (each product of two e4m3 is exact there, and so is any sum the tests compare bit for
    bit), rounded to float32, times b_scale[n], times a_scale[m] (float32 multiplies, as the
    kernel's epilogue)."""
    acc = (e4m3_to_f32(a).astype(np.float64) @ e4m3_to_f32(b).astype(np.float64).T)
    acc = acc.astype(np.float32)
    return (acc * np.asarray(b_scale, np.float32)[None, :]) * np.asarray(a_scale,
                                                                         np.float32)[:, None]


def quantize_rows_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 bits uint8 [M, K], float32 scale [M]) of bf16 or float32 rows x [M, K], as
    quant_fp8_rows.cu computes them: scale = amax / 448; q = e4m3(x * (448 / amax)) rounded to
    nearest even and clamped to +-448; q = 0 and scale = 0 for an all-zero row."""
    x32 = np.asarray(x).astype(np.float32)
    amax = np.abs(x32).max(axis=1)
    scale = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(E4M3_MAX) / amax, np.float32(0)).astype(np.float32)
    y = np.clip(x32 * inv[:, None], -E4M3_MAX, E4M3_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale


def _quantize_rows_call(c: Call) -> None:
    m, k = c["M"], c["K"]
    bits, scale = quantize_rows_reference(c.array("x", (m, k)))
    c.array("q", (m, k)).view(np.uint8)[:] = bits
    c.array("scale", (m,))[:] = scale


def reference_bf16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """d (float32 [M, N]) of bf16 a [M, K] and b [N, K]: the products exact, summed in float64,
    rounded to float32 (the scale vectors of the bf16 entries are all ones)."""
    return (np.asarray(a).astype(np.float64) @ np.asarray(b).astype(np.float64).T).astype(
        np.float32)


def _gemm_call(element: str, c: Call) -> None:
    """d = (a @ b^T) * b_scale * a_scale over the parameter block's roles (the GEMM entries take
    CUTLASS's Params by value: the roles' addresses and the problem shape live in that struct),
    the shapes as the kernel reads them: from the block's TMA descriptors, a [K, M] and b [K, N]
    innermost first."""
    block = c["params"]
    at = dict(block.roles)
    dims = {d.role: d.dims for d in block.template.descriptors}
    (k, m), n = dims["a"][:2], dims["b"][1]
    a_scale = c.region(at["a_scale"], "float32", (m,))
    b_scale = c.region(at["b_scale"], "float32", (n,))
    if element == "e4m3":
        d = reference(c.region(at["a"], "bytes", (m, k)), a_scale,
                      c.region(at["b"], "bytes", (n, k)), b_scale)
    else:
        d = (reference_bf16(c.region(at["a"], "bfloat16", (m, k)),
                            c.region(at["b"], "bfloat16", (n, k)))
             * np.asarray(b_scale, np.float32)[None, :]) * np.asarray(a_scale, np.float32)[:, None]
    c.region(at["d"], "float32", (m, n), writable=True)[:] = d


ENTRIES = (
    *(Entry(name, SOURCE, (Param("params", "params"),),
            functools.partial(_gemm_call, c.element)) for name, c in CONFIGS.items()),
    *(Entry(name, QUANT_SOURCE, (ptr("x", dtype), ptr("q", "float8_e4m3fn", "out"),
                                 ptr("scale", "float32", "out"), i32("M"), i32("K")),
            _quantize_rows_call) for dtype, name in QUANT_ENTRIES.items()),
)


@dataclass(frozen=True)
class QuantLaunch:
    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


def quant_launch(m: int, k: int, dtype: str) -> QuantLaunch:
    """One 256-thread CTA per row, the row staged in shared memory; `dtype` of x: "bfloat16" or
    "float32"."""
    if dtype not in QUANT_ENTRIES:
        raise ValueError(f"quant_fp8_rows: x dtype {dtype!r} not one of {sorted(QUANT_ENTRIES)}")
    smem = k * QUANT_ITEMSIZE[dtype]
    if m < 1 or k < 16 or k % 16 or smem > MAX_SMEM:
        raise ValueError(f"quant_fp8_rows needs M >= 1, K a positive multiple of 16 and a row of "
                         f"at most {MAX_SMEM} bytes (M={m}, K={k}, {dtype})")
    return QuantLaunch(QUANT_ENTRIES[dtype], (m, 1, 1), (QUANT_THREADS, 1, 1), smem)


# ---------------------------------------------------------------- the parameter block probe

@functools.cache
def params_template(entry: str, m: int, n: int, k: int, sm_count: int,
                    raster: str = "heuristic", swizzle: int = 1,
                    cache_dir: Path | None = None) -> ParamsTemplate:
    """The parameter template of `entry` for an [m, k] x [n, k]^T product on a GPU with
    `sm_count` SMs (the persistent grid's size), from the module's host probe. `raster` and
    `swizzle` set the persistent scheduler's tile order (CUTLASS's raster order and maximum
    swizzle size)."""
    from rvcompile.targets.h100.nvcc import NvccError, compile_host_probe

    check_shape(m, n, k)
    if entry not in CONFIGS:
        raise ValueError(f"gemm_tc: unknown entry {entry!r}")
    if raster not in RASTERS or swizzle not in SWIZZLES:
        raise ValueError(f"gemm_tc: raster {raster!r} / swizzle {swizzle} not one of "
                         f"{sorted(RASTERS)} / {SWIZZLES}")
    probe = compile_host_probe(SOURCE, PROBE_DEFINE, cache_dir)
    reports = []
    for _ in range(2):  # two processes: stack addresses left in padding differ between them
        p = subprocess.run([str(probe), entry, str(m), str(n), str(k), str(sm_count),
                            str(RASTERS[raster]), str(swizzle)], capture_output=True, text=True)
        if p.returncode != 0:
            raise NvccError(f"{SOURCE} probe ({entry}, M={m}, N={n}, K={k}) failed: "
                            f"{p.stderr.strip()}")
        reports.append(json.loads(p.stdout))
    return parse_probe(entry, reports)


def parse_probe(entry: str, reports: list[dict]) -> ParamsTemplate:
    """The template from the probe's reports. Each holds the struct built twice ("bytes" over
    memory filled with 0x00, "bytes_alt" with 0xff), with a sentinel address per role and a
    marker (descriptor_mark | call << 8 | word) in every word of the i-th encoded descriptor.
    Bytes that differ between the images are padding or never set: zeroed. Each descriptor is
    found by its marker (and must sit where the probe's offsetof says), each 8-byte word whose
    upper half is a role sentinel's is a pointer of that role; all of them are zeroed too."""
    out = reports[0]
    for r in reports[1:]:
        if {k: v for k, v in r.items() if not k.startswith("bytes")} != {
                k: v for k, v in out.items() if not k.startswith("bytes")}:
            raise ValueError(f"{entry} probe: two runs disagree beyond the struct's bytes")
    images = np.stack([np.frombuffer(bytes.fromhex(r[key]), np.uint8)
                       for r in reports for key in ("bytes", "bytes_alt")
                       if len(r[key]) == 2 * out["size"]] or [np.zeros((0,), np.uint8)])
    if images.shape != (2 * len(reports), out["size"]):
        raise ValueError(f"{entry} probe: the images are not all {out['size']} bytes")
    raw = bytearray(np.where((images == images[0]).all(axis=0), images[0], 0).tobytes())
    bases = {role: int(out["roles"][role]) for role in ROLES}

    def role_of(address: int) -> tuple[str, int]:
        for role, base in bases.items():
            if address >> 32 == base >> 32:
                return role, address - base
        raise ValueError(f"{entry} probe: address {address:#x} is no role's")

    descriptors = []
    for i, e in enumerate(out["encodes"]):
        mark = b"".join(struct.pack("<Q", out["descriptor_mark"] | i << 8 | w)
                        for w in range(DESCRIPTOR_BYTES // 8))
        at = _occurrences(raw, mark)
        if len(at) != 1:
            raise ValueError(f"{entry} probe: descriptor {i} found {len(at)} times in Params")
        role, delta = role_of(e["address"])
        raw[at[0]:at[0] + DESCRIPTOR_BYTES] = bytes(DESCRIPTOR_BYTES)
        descriptors.append(DescriptorSlot(
            offset=at[0], role=role, delta=delta, dtype=e["dtype"], rank=e["rank"],
            dims=tuple(e["dims"]), strides=tuple(e["strides"]), box=tuple(e["box"]),
            elem_strides=tuple(e["elem_strides"]), interleave=e["interleave"],
            swizzle=e["swizzle"], l2_promotion=e["l2_promotion"], oob_fill=e["oob_fill"]))
    found = {d.role: d.offset for d in descriptors}
    if found != out["known_descriptors"]:
        raise ValueError(f"{entry} probe: descriptors at {found}, the struct's fields at "
                         f"{out['known_descriptors']}")

    highs = {base >> 32 for base in bases.values()}
    pointers = []
    for off in range(0, len(raw) - 7, 4):
        word = int.from_bytes(raw[off:off + 8], "little")
        if word >> 32 not in highs:
            continue
        if off % 8:
            raise ValueError(f"{entry} probe: a role address at unaligned offset {off}")
        role, delta = role_of(word)
        pointers.append(PointerSlot(off, role, delta))
        raw[off:off + 8] = bytes(8)
    for role in ("a_scale", "b_scale"):
        if role not in {p.role for p in pointers}:
            raise ValueError(f"{entry} probe: no {role} pointer in Params")
    return ParamsTemplate(kernel=entry, grid=tuple(out["grid"]), block=tuple(out["block"]),
                          smem=out["smem"], template=bytes(raw), roles=ROLES,
                          pointers=tuple(pointers), descriptors=tuple(descriptors))


def _occurrences(data: bytearray, pattern: bytes) -> list[int]:
    out, at = [], data.find(pattern)
    while at >= 0:
        out.append(at)
        at = data.find(pattern, at + 1)
    return out
