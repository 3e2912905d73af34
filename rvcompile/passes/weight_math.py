"""Per-tensor weight encodings named by ParamSpec.derive; the build applies them while streaming
checkpoint tensors, one at a time."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from rvcompile.sources.model_source import Fp8Tensor


def _per_row_blocks(w: np.ndarray, dtype, encode_block) -> tuple[np.ndarray, np.ndarray]:
    """Apply `encode_block(rows f32 [r, K]) -> (codes [r, K], scales [r])` to ~64 MiB row blocks
    of w over its last axis, on all cores (numpy releases the GIL in these loops), so a 9 GB
    table needs only its encoded copy beside it and a 31B build is not one core's work."""
    w = np.asarray(w, np.float32)
    flat = w.reshape(-1, w.shape[-1])
    q = np.empty(flat.shape, dtype)
    scale = np.empty(flat.shape[0], np.float32)
    rows = max(1, (64 << 20) // (4 * flat.shape[1]))

    def run(r: int) -> None:
        q[r:r + rows], scale[r:r + rows] = encode_block(flat[r:r + rows])

    starts = range(0, flat.shape[0], rows)
    if len(starts) == 1:
        run(0)
    else:
        list(_pool().map(run, starts))
    return q.reshape(w.shape), scale.reshape(w.shape[:-1])


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)),
                              thread_name_prefix="rvcompile-quantize")


def quantize_int8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over the last (input) axis: one float32 scale per output row, amax / 127.
    All-zero rows get scale 1 so they decode to zeros."""

    def block(b: np.ndarray):
        amax = np.max(np.abs(b), axis=-1)
        s = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
        return np.clip(np.rint(b / s[:, None]), -127, 127), s

    return _per_row_blocks(w, np.int8, block)


FP8_E4M3_MAX = 448.0


def quantize_fp8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP8 e4m3 over the last (input) axis: one float32 scale per output row, amax / 448.
    Returns the e4m3 bit patterns as uint8 and the scales."""

    def block(b: np.ndarray):
        amax = np.max(np.abs(b), axis=-1)
        s = np.where(amax > 0, amax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)
        scaled = np.clip(b / s[:, None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
        return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), s

    return _per_row_blocks(w, np.uint8, block)


def encode(derive: str, w: np.ndarray | Fp8Tensor) -> np.ndarray:
    """The stored array for ParamSpec.derive given the checkpoint tensor (see encode_all)."""
    return encode_all({"": derive}, w)[""]


def encode_all(derives: dict[str, str], w: np.ndarray | Fp8Tensor) -> dict[str, np.ndarray]:
    """name -> stored array for each ParamSpec.derive made from one checkpoint tensor (float32,
    or a pre-quantized Fp8Tensor); a format's values and scales come from a single quantization.
    An Fp8Tensor's own values and scales are fp8_values / fp8_scales, byte for byte: quantizing
    its dequantization again would not give them back (other scales than amax/448, per-tensor
    scales). Every other derivation starts from that float32 dequantization."""
    out, quantized = {}, {}
    if isinstance(w, Fp8Tensor):
        quantized["fp8"] = (w.values, w.scales)
        w = w.dequantize() if any(not d.startswith("fp8_") for d in derives.values()) else None
    for name, derive in derives.items():
        fmt, _, part = derive.partition("_")
        if derive == "copy":
            out[name] = np.ascontiguousarray(w, np.float32)
        elif derive == "int32":  # token ids (the assistant's token_ordering), stored as read
            out[name] = np.ascontiguousarray(w, np.int32)
        elif derive == "bf16":
            out[name] = np.ascontiguousarray(w, np.float32).astype(ml_dtypes.bfloat16)
        elif fmt in QUANTIZERS and part in ("values", "scales"):
            if fmt not in quantized:
                quantized[fmt] = QUANTIZERS[fmt](w)
            out[name] = quantized[fmt][0 if part == "values" else 1]
        else:
            raise ValueError(f"unknown weight derivation {derive!r}")
    return out


def _fp8_stored(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, s = quantize_fp8_per_channel(w)
    return q.view(ml_dtypes.float8_e4m3fn), s


# ParamSpec.derive "<format>_values" / "<format>_scales" -> (values, scales) as stored.
QUANTIZERS = {"int8": quantize_int8_per_channel, "fp8": _fp8_stored}
