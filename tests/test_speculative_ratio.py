"""The speculative ratio rule on the device (targets/xla/rejection.py), on small synthetic
vocabularies, without a model:

- lower.filtered_probs is the distribution SAMPLE draws from (numpy reference, and a chi-square
  goodness of fit of SAMPLE's tokens against it);
- ratio_rule gives, token for token, the textbook rule run lane by lane in numpy with the same
  uniforms and the same p and q;
- the tokens it produces are distributed as the target's: the first two tokens of a sequence
  whose target rows depend on the drafts before them (k = 2 drafts sampled from q the way the
  drafter samples, with the sampler's own uniform), chi-square against the exact joint
  p0(x1) p1(x2 | x1);
- on the same drafts, it accepts more per round than exact match against the target's sample.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rvcompile.ir.ops import sampling_uniform
from rvcompile.targets.xla import lower, rejection
from rvcompile.targets.xla.rejection import ACCEPT, RESIDUAL

# jitted as the programs run them (op by op they would take seconds to dispatch)
filtered_probs = jax.jit(lower.filtered_probs)
sample = jax.jit(functools.partial(lower.sample, None))
ratio_rule = jax.jit(rejection.ratio_rule)


def ref_filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 [V]: softmax(logits / temperature) cut to top_k and top_p (the sampler's rule,
    ir/ops.py sample_sorted), renormalised."""
    order = np.argsort(-logits, kind="stable")
    sv = logits[order].astype(np.float64) / temperature
    keep = np.arange(len(sv)) < top_k if top_k > 0 else np.ones(len(sv), bool)
    sv = np.where(keep, sv, -np.inf)
    probs = np.exp(sv - sv[0])
    probs /= probs.sum()
    keep &= np.cumsum(probs) - probs < top_p
    probs = np.where(keep, probs, 0)
    out = np.zeros(len(sv))
    out[order] = probs / probs.sum()
    return out


def lanes(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    return (jnp.full(n, temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
            jnp.full(n, top_p, jnp.float32))


def chi_square_fit(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of counts against a known distribution (cells expected under 5 pooled)."""
    from scipy.stats import chisquare

    expected = expected_probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_filtered_probs_is_what_sample_draws():
    rng = np.random.default_rng(0)
    v, n = 12, 8000
    logits = rng.normal(0, 2, v).astype(np.float32)
    for t, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.0, 0, 1.0)]:
        got = np.asarray(filtered_probs(jnp.asarray(logits[None]), *lanes(1, t, k, p)))[0]
        want = (np.eye(v)[np.argmax(logits)] if t == 0 else ref_filtered(logits, t, k, p))
        np.testing.assert_allclose(got, want, atol=1e-6)
        toks = np.asarray(sample(jnp.asarray(np.tile(logits, (n, 1))), *lanes(n, t, k, p),
                                 jnp.arange(n, dtype=jnp.int32), jnp.full(n, 3, jnp.int32)))
        assert set(toks.tolist()) <= set(np.flatnonzero(got).tolist())
        if t > 0:
            pv = chi_square_fit(np.bincount(toks, minlength=v), got.astype(np.float64))
            print(f"\n[measured] SAMPLE vs filtered_probs (T {t}, top_k {k}, top_p {p}): "
                  f"chi-square p = {pv:.3f}")
            assert pv > 1e-3


def ref_ratio_rule(p, plain, tokens, n_new, q, seed, step) -> np.ndarray:
    """The textbook rule, lane by lane: accept d(i+1) where u q(d) < p(d) (or the residual is
    empty); at the first rejection the inverse CDF of max(0, p - q) in vocabulary order; all
    accepted: the plain sample after the last row. Tokens past the new one -1."""
    b, r, _ = p.shape
    out = np.full((b, r), -1, np.int32)
    for j in range(b):
        n = max(int(n_new[j]) - 1, 0)
        for i in range(n):
            d = tokens[j, i + 1]
            res = np.maximum(p[j, i] - q[j, i], np.float32(0))
            u = sampling_uniform(seed[j], step[j] + i, ACCEPT)
            if u * q[j, i, d] < p[j, i, d] or res.sum() <= 0:
                out[j, i] = d
                continue
            w = sampling_uniform(seed[j], step[j] + i, RESIDUAL)
            cum = np.cumsum(res)
            out[j, i] = min(int(np.sum(cum <= w * cum[-1])), int(np.flatnonzero(res)[-1]))
            break
        else:
            out[j, n] = plain[j, n]
    return out


def test_ratio_rule_is_the_textbook_rule():
    """Random rows, drafts and q (some with mass where p has none, some lanes idle or without
    drafts, temperatures and cuts mixed): the device's tokens are the reference's."""
    rng = np.random.default_rng(1)
    b, r, v = 96, 4, 16
    logits = rng.normal(0, 2, (b, r, v)).astype(np.float32)
    q = rng.dirichlet(np.full(v, 0.5), (b, r - 1)).astype(np.float32)
    q[::3, :, ::2] = 0  # q without mass on half the tokens
    q /= q.sum(-1, keepdims=True)
    tokens = rng.integers(0, v, (b, r)).astype(np.int32)
    n_new = rng.integers(0, r + 1, b).astype(np.int32)
    temperature = rng.choice([0.5, 1.0, 2.0], b).astype(np.float32)
    top_k = rng.choice([0, 3, 8], b).astype(np.int32)
    top_p = rng.choice([1.0, 0.9], b).astype(np.float32)
    seed = rng.integers(0, 2**31, b).astype(np.int32)
    step = rng.integers(0, 1000, b).astype(np.int32)
    # drafts the rule accepts often: half the lanes propose p's likeliest tokens
    tokens[::2, 1:] = np.argmax(logits[::2, :-1], -1)
    plain = rng.integers(0, v, (b, r)).astype(np.int32)
    got = np.asarray(ratio_rule(jnp.asarray(logits), jnp.asarray(plain), jnp.asarray(tokens),
                                jnp.asarray(n_new), jnp.asarray(q), jnp.asarray(temperature),
                                jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(seed),
                                jnp.asarray(step)))
    p = np.asarray(filtered_probs(jnp.asarray(logits.reshape(b * r, v)),
                                  *(jnp.asarray(np.repeat(x, r)) for x in (temperature, top_k,
                                                                           top_p))))
    want = ref_ratio_rule(p.reshape(b, r, v), plain, tokens, n_new, q, seed, step)
    np.testing.assert_array_equal(got, want)
    m = [int(np.sum(np.cumprod(got[j, :-1] == tokens[j, 1:]))) for j in range(b)]
    assert 0 < sum(m) < sum(max(n - 1, 0) for n in n_new)  # some accepted, some rejected


V, N = 6, 30000
T = 1.0


@pytest.fixture(scope="module")
def chain():
    """A synthetic target and drafter over V tokens whose rows depend on the tokens before them
    (row 1 on d1, row 2 on d1 d2), the drafter's logits the target's plus noise, k = 2 drafts
    per lane sampled the way the drafter samples (SAMPLE with the lane's seed at step + i);
    N lanes, one ratio_rule call."""
    rng = np.random.default_rng(2)
    l0 = rng.normal(0, 1.5, V).astype(np.float32)
    l1 = rng.normal(0, 1.5, (V, V)).astype(np.float32)  # row 1's logits given d1
    l2 = rng.normal(0, 1.5, (V, V, V)).astype(np.float32)  # row 2's given d1, d2
    noise = 0.6
    g0 = l0 + rng.normal(0, noise, V).astype(np.float32)  # the drafter's
    g1 = l1 + rng.normal(0, noise, (V, V)).astype(np.float32)
    seed = jnp.arange(N, dtype=jnp.int32)
    step = jnp.full(N, 5, jnp.int32)
    t, k, p = lanes(N, T)

    def draw(logits, s):
        return np.asarray(sample(jnp.asarray(logits), t, k, p, seed, s))

    d1 = draw(np.tile(g0, (N, 1)), step)
    d2 = draw(g1[d1], step + 1)
    logits = np.stack([np.tile(l0, (N, 1)), l1[d1], l2[d1, d2]], axis=1)  # [N, 3, V]
    q = np.asarray(filtered_probs(jnp.asarray(np.stack([np.tile(g0, (N, 1)), g1[d1]], 1)
                                              .reshape(2 * N, V)),
                                  *lanes(2 * N, T))).reshape(N, 2, V)
    tokens = np.stack([np.zeros(N, np.int32), d1, d2], axis=1)
    plain = np.stack([draw(logits[:, i], step + i) for i in range(3)], axis=1)
    out = np.asarray(ratio_rule(jnp.asarray(logits), jnp.asarray(plain), jnp.asarray(tokens),
                                jnp.full(N, 3, jnp.int32), jnp.asarray(q), t, k, p, seed, step))
    return l0, l1, tokens, plain, out


def accepted_per_round(drafts: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per lane, the longest prefix of drafts equal to the target's tokens."""
    return np.cumprod(drafts == target[:, :drafts.shape[1]], axis=1).sum(axis=1)


def test_ratio_rule_keeps_the_target_distribution(chain):
    """The first two tokens: x1 from this round; x2 from it when d1 was accepted, else from the
    next round (a plain sample of p1(. | x1), drawn here)."""
    l0, l1, tokens, _, out = chain
    m = accepted_per_round(tokens[:, 1:], out)
    rng = np.random.default_rng(3)
    p0 = ref_filtered(l0, T, 0, 1.0)
    p1 = np.stack([ref_filtered(l1[x], T, 0, 1.0) for x in range(V)])
    x1 = out[:, 0]
    next_round = np.minimum((np.cumsum(p1[x1], -1) < rng.random(N)[:, None]).sum(-1), V - 1)
    x2 = np.where(m >= 1, out[:, 1], next_round)
    counts = np.bincount(x1 * V + x2, minlength=V * V)
    pv = chi_square_fit(counts, (p0[:, None] * p1).reshape(-1))
    print(f"\n[measured] ratio rule, first two tokens over {V}x{V} cells, {N} lanes: "
          f"chi-square p = {pv:.3f}")
    assert pv > 1e-3


def test_ratio_rule_accepts_more_than_exact_match(chain):
    """The same drafts, the same target: exact match keeps a draft where the target's own
    sample (same seed and step as the drafter's draw) equals it."""
    _, _, tokens, plain, out = chain
    ratio = accepted_per_round(tokens[:, 1:], out).mean()
    exact = accepted_per_round(tokens[:, 1:], plain).mean()
    print(f"\n[measured] mean drafts accepted per round of 2 (drafter = target + noise): "
          f"ratio rule {ratio:.3f}, exact match {exact:.3f}")
    assert ratio > exact + 0.1
