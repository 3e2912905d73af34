"""Dtype names as stored in IR params and artifact manifests, to numpy dtypes. Shared by the
compiler and the runtime (it imports nothing of either)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def numpy_dtype(name: str) -> np.dtype:
    """np.dtype for "float32", "bfloat16", "int8", "int32", ..."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
