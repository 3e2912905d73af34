"""The XLA MoE lowering's two paths against the MOE op's numpy reference: gathered experts when
a call has no more (token, expert) pairs than experts (decode), sorted pairs and grouped
matmuls otherwise (prefill). Float32 and int8 experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rvcompile.ir import ops
from rvcompile.targets.xla import lower

E, K, H, IM = 8, 2, 32, 16


def _case(tokens: int, int8: bool, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (1, tokens, H)).astype(np.float32)
    logits = rng.normal(0, 1, (1, tokens, E)).astype(np.float32)
    per_expert = rng.uniform(0.5, 1.5, E).astype(np.float32)
    gate_up = rng.normal(0, H**-0.5, (E, 2 * IM, H)).astype(np.float32)
    down = rng.normal(0, IM**-0.5, (E, H, IM)).astype(np.float32)
    if not int8:
        return x, logits, per_expert, gate_up, down
    scales = []
    quantized = []
    for w in (gate_up, down):
        s = np.abs(w).max(-1) / 127
        quantized.append(np.round(w / s[..., None]).astype(np.int8))
        scales.append(s.astype(np.float32))
    return x, logits, per_expert, *quantized, *scales


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("tokens", [1, 4, 16])  # pairs 2, 8 (= E): gathered; 32: grouped
def test_moe_paths_match_the_reference(tokens, int8):
    args = _case(tokens, int8, seed=tokens + 10 * int8)
    attrs = ops.MoEAttrs(K, quantized=int8)
    want = ops.ref_moe(attrs, *args)
    got = np.asarray(jax.jit(lambda *a: lower.moe(attrs, *a))(*map(jnp.asarray, args)))
    # measured: at most 4.3e-7 of the largest output (both round activations to bf16 alike)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
