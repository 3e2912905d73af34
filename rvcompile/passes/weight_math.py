"""Per-tensor weight encodings named by ParamSpec.derive; the build applies them while streaming
checkpoint tensors, one at a time."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def quantize_int8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over the last (input) axis: one float32 scale per output row, amax / 127.
    All-zero rows get scale 1 so they decode to zeros. Works in row blocks so a 9 GB table needs
    only its int8 copy beside it."""
    w = np.asarray(w, np.float32)
    flat = w.reshape(-1, w.shape[-1])
    q = np.empty(flat.shape, np.int8)
    scale = np.empty(flat.shape[0], np.float32)
    rows = max(1, (64 << 20) // (4 * flat.shape[1]))  # ~64 MiB of temporaries at a time
    for r in range(0, flat.shape[0], rows):
        block = flat[r:r + rows]
        amax = np.max(np.abs(block), axis=-1)
        s = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
        q[r:r + rows] = np.clip(np.rint(block / s[:, None]), -127, 127)
        scale[r:r + rows] = s
    return q.reshape(w.shape), scale.reshape(w.shape[:-1])


FP8_E4M3_MAX = 448.0


def quantize_fp8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP8 e4m3 over the last (input) axis: one float32 scale per output row, amax / 448.
    Returns the e4m3 bit patterns as uint8 and the scales; row blocks as above."""
    w = np.asarray(w, np.float32)
    flat = w.reshape(-1, w.shape[-1])
    q = np.empty(flat.shape, np.uint8)
    scale = np.empty(flat.shape[0], np.float32)
    rows = max(1, (64 << 20) // (4 * flat.shape[1]))
    for r in range(0, flat.shape[0], rows):
        block = flat[r:r + rows]
        amax = np.max(np.abs(block), axis=-1)
        s = np.where(amax > 0, amax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)
        scaled = np.clip(block / s[:, None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
        q[r:r + rows] = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        scale[r:r + rows] = s
    return q.reshape(w.shape), scale.reshape(w.shape[:-1])


def encode(derive: str, w: np.ndarray) -> np.ndarray:
    """The stored array for ParamSpec.derive given the float32 checkpoint tensor."""
    return encode_all({"": derive}, w)[""]


def encode_all(derives: dict[str, str], w: np.ndarray) -> dict[str, np.ndarray]:
    """name -> stored array for each ParamSpec.derive made from one checkpoint tensor; a
    format's values and scales come from a single quantization."""
    out, quantized = {}, {}
    for name, derive in derives.items():
        fmt, _, part = derive.partition("_")
        if derive == "copy":
            out[name] = np.ascontiguousarray(w, np.float32)
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
