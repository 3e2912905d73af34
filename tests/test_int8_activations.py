"""benchmarks/int8_activations_ppl.py (issue 19 item 2's measurement): its int8-activation
linear is int8 x int8 -> int32 with one scale per activation row, exactly, and the lowering it
patches in for one export is put back afterwards, even when the build fails."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from rvcompile.ir.ops import Op
from rvcompile.targets.xla import lower

_spec = importlib.util.spec_from_file_location(
    "int8_activations_ppl", Path(__file__).resolve().parents[1] / "benchmarks"
    / "int8_activations_ppl.py")
a8 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(a8)


def test_linear_a8_is_integer_arithmetic_per_row():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 256)).astype(np.float32)
    x[1] = 0  # an all-zero row stays zero
    w = rng.integers(-127, 128, size=(64, 256)).astype(np.int8)
    s = rng.uniform(1e-3, 1e-2, 64).astype(np.float32)
    got = np.asarray(a8.linear_a8(None, jnp.asarray(x), jnp.asarray(w), jnp.asarray(s)))
    row = np.abs(x).max(-1, keepdims=True) / 127
    q = np.clip(np.round(x / np.where(row > 0, row, 1)), -127, 127).astype(np.int64)
    want = (q @ w.T.astype(np.int64)) * row * s
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert not got[1].any()
    # float weights keep lower.linear
    wf = w.astype(np.float32)
    assert np.array_equal(np.asarray(a8.linear_a8(None, jnp.asarray(x), jnp.asarray(wf))),
                          np.asarray(lower.linear(None, jnp.asarray(x), jnp.asarray(wf))))


def test_patch_is_undone_after_a_failed_build(monkeypatch, tmp_path):
    def fail(*args, **kwargs):
        assert lower.linear is a8.linear_a8 and lower.LOWERINGS[Op.LINEAR] is a8.linear_a8
        raise RuntimeError("build failed")

    monkeypatch.setattr(a8, "build_artifact", fail)
    with pytest.raises(RuntimeError, match="build failed"):
        a8.build("tpu-int8", tmp_path / "x.rvp", 256, a8=True)
    assert lower.linear is a8.PLAIN_LINEAR
    assert lower.LOWERINGS[Op.LINEAR] is lower.BLOCKWISE_LOWERINGS[Op.LINEAR] is a8.PLAIN_LINEAR
