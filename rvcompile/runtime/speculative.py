"""Speculative decoding's host-side pieces (numpy at most, no device): what a request asks for
(`Speculation`), n-gram (prompt lookup) drafting, and acceptance.

A round of one sequence (executor_api, "Speculative decoding"): the engine drafts up to k tokens
(with the artifact's assistant, `Executor.draft`, or here by n-gram lookup), the target runs the
sequence's last token and the drafts as k + 1 rows of one `verify` call, which decides the
token after each row, and the engine keeps the longest prefix of drafts equal to those tokens
plus the token after it (`accepted`).

The rejection rule. The standard rule (Leviathan et al. 2023; Chen et al. 2023) accepts a
draft d proposed with probability q(d) with probability min(1, p(d) / q(d)), p the target's
sampling distribution there (after temperature, top_k and top_p), and at the first rejection
samples max(0, p - q), renormalised; when every draft is accepted, the token after the last
comes from p. The output distribution is then the target's, and a draft is accepted with
probability sum_x min(p(x), q(x)). Verify applies it in two forms:
- Drafts the assistant sampled at temperature > 0 carry q (Drafted.draft_probs, kept on the
  device) into verify, which runs the rule itself (targets/xla/rejection.py) and returns the
  accepted drafts, the new token, then -1, so `accepted` reads the count off them.
- Every other draft is a given proposal, q the point mass on d: n-gram drafts, and greedy
  ones (p is one-hot, and the assistant drafts its argmax). The rule then accepts d with
  probability p(d) and otherwise samples p conditioned on "not d", which is exactly what
  comparing d with a token sampled from p does; verify samples row i at the RNG step plain
  decoding would use there, so a seeded request gives the very tokens it gives without
  speculation, and `accepted` compares.
Against exact match on a sample of p (the rule before), the ratio rule accepts more of an
assistant's sampled drafts: exact match keeps d only where the target's own draw lands on it
(the drafter drew with the same uniform, so where p and q rank tokens alike the two draws often
agree, and otherwise seldom); the ratio rule keeps d with probability min(1, p(d)/q(d)).
The price: such a request's tokens depend on its drafts, so a seeded one gives the same tokens
on every run and under any load (with the same num_draft_tokens), but not the ones it gives
without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

METHODS = ("assistant", "ngram")


@dataclass(frozen=True)
class Speculation:
    """What a request asks of speculative decoding (request_limits.check_speculation checks it
    against the artifact)."""

    method: str  # "assistant" (the artifact's drafter) or "ngram" (prompt lookup, no weights)
    num_draft_tokens: int | None = None  # drafts per round; None: the artifact's most


def ngram_drafts(tokens: Sequence[int], k: int) -> list[int]:
    """Up to k drafts for what follows `tokens`: find the longest suffix of `tokens` that also
    ends earlier in them (its most recent such occurrence) and propose the k tokens that
    followed it there (fewer where the sequence ends first). [] when the last token never
    occurred before. One vectorised pass per suffix length that still matches."""
    n = len(tokens)
    if n < 2 or k < 1:
        return []
    seq = np.asarray(tokens, np.int64)
    ends = np.flatnonzero(seq[:-1] == seq[-1]) + 1  # exclusive ends of earlier matches
    length = 1
    while ends.size and length < n - 1:
        ends_ok = ends[ends - length - 1 >= 0]
        longer = ends_ok[seq[ends_ok - length - 1] == seq[n - length - 1]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    if not ends.size:
        return []
    e = int(ends[-1])
    return [int(t) for t in seq[e:e + k]]


def accepted(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many drafts to keep: the longest prefix with drafts[i] == target[i], where target[i]
    is verify's token after the row before draft i (by exact match or the ratio rule)."""
    m = 0
    while m < len(drafts) and drafts[m] == target[m]:
        m += 1
    return m
