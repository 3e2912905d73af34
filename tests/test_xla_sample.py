"""lower.sample, the XLA SAMPLE: the same tokens as the IR's numpy reference (ir.ops.ref_sample)
in each of its branches (every row greedy; every sampled row with 0 < top_k <= SAMPLE_TOP_K,
drawn from lax.top_k's candidates; anything else, through the full-vocabulary sort), and the
top-k branch reads no sorted vocabulary."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from rvcompile.ir.ops import ref_sample
from rvcompile.targets.xla import lower

V = 1000
sample = jax.jit(functools.partial(lower.sample, None))


def _rows(rng, b):
    logits = rng.standard_normal((b, V)).astype(np.float32) * 3
    logits[:, rng.integers(0, V, 4)] = logits[:, :1]  # ties: the lower id ranks first
    return logits


@pytest.mark.parametrize("top_ks, greedy_rows", [
    ((1, 5, 40, lower.SAMPLE_TOP_K), False),  # branch 1 (top_k rows only)
    ((3, lower.SAMPLE_TOP_K), True),  # branch 1 with greedy rows among them
    ((0, 7, lower.SAMPLE_TOP_K + 1, 500), False),  # branch 2: some row needs the sort
    ((0,), True),  # branch 0 when every row is greedy
])
def test_sample_is_the_reference(top_ks, greedy_rows):
    rng = np.random.default_rng(len(top_ks) + greedy_rows)
    b = 64
    for trial in range(8):
        logits = _rows(rng, b)
        temperature = rng.choice([0.5, 1.0, 2.0], b).astype(np.float32)
        if greedy_rows:
            temperature[rng.random(b) < 0.4] = 0
        if top_ks == (0,):
            temperature[:] = 0
        top_k = rng.choice(top_ks, b).astype(np.int32)
        top_p = rng.choice([1.0, 0.9, 0.5], b).astype(np.float32)
        seed = rng.integers(0, 2**31, b).astype(np.int32)
        step = np.full(b, trial, np.int32)
        args = (logits, temperature, top_k, top_p, seed, step)
        got = np.asarray(sample(*map(jnp.asarray, args)))
        want = ref_sample(None, *args)
        np.testing.assert_array_equal(got, want)


def _primitives(jaxpr) -> set[str]:
    out = set()
    for e in jaxpr.eqns:
        out.add(e.primitive.name)
        for sub in jaxprs_in_params(e.params):
            out |= _primitives(sub)
    return out


def test_top_k_rows_read_no_sorted_vocabulary():
    """The branch a step of top-k rows takes has lax.top_k and no sort: a full-vocabulary sort
    there reads and writes [B, V] three times over (2.6 GiB a step for the 31B at B = 64)."""
    args = (jnp.zeros((4, V)), jnp.ones(4), jnp.full(4, 8, jnp.int32), jnp.ones(4),
            jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32))
    jaxpr = jax.make_jaxpr(functools.partial(lower.sample, None))(*args).jaxpr
    (switch,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    names = [_primitives(br.jaxpr) for br in switch.params["branches"]]
    assert len(names) == 3
    assert "top_k" in names[1] and "sort" not in names[1]
    assert "sort" in names[2] and "sort" not in names[0]


def test_sorted_probs_sorts_once_and_gathers_no_values():
    """The sort branch carries the logits through its one sort instead of gathering them after
    (the 26B-A4B's sampler at B = 1 on v6e: 23 -> 7 MiB for the sort and the values): the same
    order and bit-identical values as jnp.argsort and take_along_axis, ties and signed zeros
    included, and no [B, V] gather in the branch."""
    rng = np.random.default_rng(7)
    logits = _rows(rng, 16)
    logits[:, 10:14] = [0.0, -0.0, 0.0, -0.0]
    logits[3, :] = logits[3, 0]  # one row all ties
    x = jnp.asarray(logits)
    ones, zeros = jnp.ones(16), jnp.zeros(16, jnp.int32)
    order, probs, keep = jax.jit(lower.sorted_probs)(x, ones, zeros, ones)
    want = jnp.argsort(-x, axis=-1, stable=True)
    np.testing.assert_array_equal(np.asarray(order), np.asarray(want))
    values = jnp.take_along_axis(x, want, axis=-1)
    got_values = jax.jit(lambda x: -jax.lax.sort(
        (-x, jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)), num_keys=1, is_stable=True)[0])(x)
    assert np.asarray(got_values).tobytes() == np.asarray(values).tobytes()

    args = (jnp.zeros((4, V)), jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.ones(4),
            jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32))
    jaxpr = jax.make_jaxpr(functools.partial(lower.sample, None))(*args).jaxpr
    (switch,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert not [e for e in _eqns(switch.params["branches"][2].jaxpr)
                if e.primitive.name == "gather" and e.outvars[0].aval.shape[-1] == V]


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jaxprs_in_params(e.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("v, k, width", [(1000, 8, 8), (1024, 16, 16), (4096, 64, 16)])
def test_top_k_binned_is_lax_top_k(v, k, width):
    """lower.top_k_binned gives lax.top_k's values and ids bit for bit: ties (within a bin,
    across bins and at the k-th place), signed zeros, -inf, a padded last bin."""
    rng = np.random.default_rng(v + k)
    x = rng.standard_normal((6, v)).astype(np.float32)
    x[0, rng.integers(0, v, 40)] = x[0, 5]  # ties with a large value
    x[1, :] = np.round(x[1, :] * 2) / 2  # many ties everywhere
    x[2, :] = 0.0
    x[2, rng.integers(0, v, v // 2)] = -0.0
    x[3, :] = -np.inf
    x[3, rng.integers(0, v, k // 2)] = 1.0
    x[4, :] = np.sort(x[4, :])  # the largest in the last (padded) bins
    xs = jnp.asarray(x)
    got = jax.jit(functools.partial(lower.top_k_binned, k=k, width=width))(xs)
    want = jax.lax.top_k(xs, k)
    for g, w in zip(got, want, strict=True):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def test_sample_with_binned_top_k_is_the_reference(monkeypatch):
    """Branch 1 of one row through the binned top-k (the tests' V = 1000 in bins of 4; the
    real vocabulary takes it with TOP_K_BIN): ref_sample's tokens."""
    monkeypatch.setattr(lower, "TOP_K_BIN", 4)
    binned, calls = lower.top_k_binned, []
    monkeypatch.setattr(lower, "top_k_binned", lambda x, k: calls.append(x.shape) or binned(x, k))
    rng = np.random.default_rng(11)
    one = jax.jit(functools.partial(lower.sample, None))
    for trial in range(32):
        logits = _rows(rng, 1)
        temperature = rng.choice([0.5, 1.0, 2.0], 1).astype(np.float32)
        top_k = rng.choice((1, 5, 40, lower.SAMPLE_TOP_K), 1).astype(np.int32)
        top_p = rng.choice([1.0, 0.9, 0.5], 1).astype(np.float32)
        seed = rng.integers(0, 2**31, 1).astype(np.int32)
        args = (logits, temperature, top_k, top_p, seed, np.full(1, trial, np.int32))
        np.testing.assert_array_equal(np.asarray(one(*map(jnp.asarray, args))),
                                      ref_sample(None, *args))
    assert calls == [(1, V)]  # traced once, through the binned top-k
