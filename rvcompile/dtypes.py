"""Dtype names as stored in IR params and artifact manifests, to numpy dtypes. Shared by the
compiler and the runtime: a leaf that imports nothing of either (tests/test_layering.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def numpy_dtype(name: str) -> np.dtype:
    """np.dtype for "float32", "bfloat16", "int8", "int32", ..."""
    special = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
    return np.dtype(special.get(name, name))
