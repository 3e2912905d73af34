"""The standard speculative rejection rule (Leviathan et al. 2023; Chen et al. 2023) on the
device: what verify_{B}x{R} (program.py) applies, in an artifact with an assistant, to the lanes
whose drafts the assistant sampled at temperature > 0 from a distribution q it returned
(draft_{B}'s draft_probs).

A lane runs its last token x and drafts d1..dn as rows 0..n (n = n_new - 1). Row i's target
distribution p_i is the sampler's (lower.filtered_probs: the lane's temperature, top_k and
top_p), q_i the one d(i+1) was drawn from. Down the rows, d(i+1) is accepted with probability
min(1, p_i(d) / q_i(d)): u q_i(d) < p_i(d) for a uniform u of stream ACCEPT at RNG step
step + i. At the first rejection, at row m, the lane's next token is drawn from
max(0, p_m - q_m), renormalised (stream RESIDUAL at step + m), and the rows after m are not
used; when all n are accepted, it is the sampler's token after row n (stream 0 at step + n, as
decode would draw it). Every token so produced is distributed as p, whatever q is, and a draft
is accepted with probability sum_x min(p(x), q(x)), the most any rule that keeps p can.

The lane's result, as verify's tokens [R]: rows i < m hold the accepted drafts d(i+1), row m
the new token, rows past m -1. So the caller's comparison (runtime/speculative.accepted: the
longest prefix of drafts equal to the tokens) reads off m: a rejected draft never comes back as
the residual's token, since a rejection means p(d) < q(d), where the residual is 0. Where the
residual has no mass at all (p <= q everywhere: p == q up to float rounding, so acceptance is
certain) the draft is accepted.
"""

from __future__ import annotations

import jax.numpy as jnp

from rvcompile.targets.xla.lower import filtered_probs, uniform

ACCEPT, RESIDUAL = 1, 2  # lower.uniform streams of the two draws (0 is the sampler's)


def ratio_rule(logits, plain, tokens, n_new, draft_probs, temperature, top_k, top_p, seed,
               step):
    """logits [B, R, V]: the target's rows; plain [B, R]: the sampler's token after each row
    (row i at RNG step step + i); tokens [B, R]: the rows' tokens, drafts at rows 1..n_new - 1;
    draft_probs [B, R - 1, V]: q of each draft; sampling [B]. Returns tokens [B, R] as the
    module docstring says (meaningful for lanes with at least one draft)."""
    b, r, v = logits.shape
    per_row = [jnp.repeat(x, r) for x in (temperature, top_k, top_p)]
    p = filtered_probs(logits.reshape(b * r, v), *per_row).reshape(b, r, v)
    drafts = tokens[:, 1:]  # [B, R - 1]: d(i+1), checked at row i
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    rows = jnp.arange(r - 1, dtype=jnp.int32)[None, :]
    steps = step[:, None] + rows  # [B, R - 1]
    u = uniform(jnp.repeat(seed, r - 1), steps.reshape(-1), ACCEPT).reshape(b, r - 1)
    residual = jnp.maximum(p[:, :-1] - draft_probs, 0.0)  # [B, R - 1, V]
    ok = (u * q_d < p_d) | (jnp.sum(residual, axis=-1) <= 0)
    ok &= rows < (n_new - 1)[:, None]
    m = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # drafts accepted [B]
    at = jnp.minimum(m, r - 2)[:, None, None]
    res = jnp.take_along_axis(residual, at, axis=1)[:, 0]  # [B, V]: row m's residual
    cum = jnp.cumsum(res, axis=-1)
    w = uniform(seed, step + m, RESIDUAL)
    i = jnp.sum(cum <= w[:, None] * cum[:, -1:], axis=-1)
    last = v - 1 - jnp.argmax(res[:, ::-1] > 0, axis=-1)  # the last token with mass
    drawn = jnp.minimum(i, last).astype(jnp.int32)
    bonus = jnp.take_along_axis(plain, m[:, None], axis=1)[:, 0]
    new = jnp.where(m < n_new - 1, drawn, bonus)
    shifted = jnp.concatenate([drafts, jnp.full((b, 1), -1, tokens.dtype)], axis=1)
    cols = jnp.arange(r, dtype=jnp.int32)[None, :]
    return jnp.where(cols < m[:, None], shifted,
                     jnp.where(cols == m[:, None], new[:, None], -1)).astype(jnp.int32)
