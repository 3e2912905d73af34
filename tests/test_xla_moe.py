"""The XLA MoE lowering's two paths against the MOE op's numpy reference: each pair's expert
sliced when a call has no more (token, expert) pairs than experts (decode), sorted pairs and
grouped matmuls otherwise (prefill). Float32 and int8 experts; and tensor parallelism's shares
of every expert's intermediate dimension add up to the whole."""

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


def _view(args):
    """The MOE op's arguments with gate_up [E, 2I, H] (and its scales) in the XLA layout's view,
    [E, 2, I, H], as the programs pass it to lower.moe (program.layout_shape)."""
    x, logits, per_expert, gate_up, down, *scales = args
    if scales:
        scales[0] = scales[0].reshape(E, 2, IM)
    return (x, logits, per_expert, gate_up.reshape(E, 2, IM, H), down, *scales)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("tokens", [1, 4, 16])  # pairs 2, 8 (= E): gathered; 32: grouped
def test_moe_paths_match_the_reference(tokens, int8):
    args = _case(tokens, int8, seed=tokens + 10 * int8)
    attrs = ops.MoEAttrs(K, quantized=int8)
    want = ops.ref_moe(attrs, *args)
    got = np.asarray(jax.jit(lambda *a: lower.moe(attrs, *a))(*map(jnp.asarray, _view(args))))
    # measured: at most 4.3e-7 of the largest output (both round activations to bf16 alike)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("tokens", [1, 16])
def test_moe_shares_of_the_intermediate_dimension_add_up(tokens):
    """Tensor parallelism's split (targets/xla/sharding.py): every expert's intermediate rows I
    in shares, gate/up in the layout's [E, 2, I, H] view, down by its columns, the per-row
    scales with them (down's whole). lower.moe over each share, summed (what its psum does
    under a mesh), is the whole MoE; here the 4 shares run one after another on one device."""
    args = _case(tokens, True, seed=7)
    attrs = ops.MoEAttrs(K, quantized=True)
    want = ops.ref_moe(attrs, *args)
    x, logits, pes, view, down, scale_view, down_scale = _view(args)
    got = 0
    for d in range(4):
        share = slice(d * IM // 4, (d + 1) * IM // 4)
        got = got + np.asarray(lower.moe(attrs, *map(jnp.asarray, (
            x, logits, pes, view[:, :, share], down[:, :, share], scale_view[:, :, share],
            down_scale))))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_moe_refuses_gate_up_outside_the_layouts_view():
    x, logits, pes, gate_up, down = _case(1, False, seed=1)
    with pytest.raises(ValueError, match=r"^moe: gate_up \(8, 32, 32\), expected the layout's "
                                         r"\[E, 2, I, H\]$"):
        lower.moe(ops.MoEAttrs(K), *map(jnp.asarray, (x, logits, pes, gate_up, down)))
