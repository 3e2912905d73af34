"""Per-tensor weight encodings named by ParamSpec.derive; the build applies them while streaming
checkpoint tensors, one at a time."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def quantize_int8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over the last (input) axis: one float32 scale per output row, amax / 127.
    All-zero rows get scale 1 so they decode to zeros."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-1)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -127, 127).astype(np.int8)
    return q, scale


def encode(derive: str, w: np.ndarray) -> np.ndarray:
    """The stored array for ParamSpec.derive given the float32 checkpoint tensor."""
    if derive == "copy":
        return np.ascontiguousarray(w, np.float32)
    if derive == "bf16":
        return np.ascontiguousarray(w, np.float32).astype(ml_dtypes.bfloat16)
    if derive == "int8_values":
        return quantize_int8_per_channel(w)[0]
    if derive == "int8_scales":
        return quantize_int8_per_channel(w)[1]
    raise ValueError(f"unknown weight derivation {derive!r}")
