"""Speculative decoding's host-side pieces (numpy at most, no device): what a request asks for
(`Speculation`), n-gram (prompt lookup) drafting, and acceptance.

A round of one sequence (executor_api, "Speculative decoding"): the engine drafts up to k tokens
(with the artifact's assistant, `Executor.draft`, or here by n-gram lookup), the target runs the
sequence's last token and the drafts as k + 1 rows of one `verify` call, which samples the
target's token after every row (row i at RNG step step + i: the token plain decoding would
sample there), and the engine keeps the longest prefix of drafts equal to those tokens plus the
target's token after it (`accepted`).

Why exact match is the rejection rule. The standard rule (Leviathan et al. 2023; Chen et al.
2023) accepts a draft d proposed with probability q(d) with probability min(1, p(d) / q(d)) and
otherwise samples from max(0, p - q), renormalised. Verification here treats each draft as a
given proposal (q the point mass on d, as for n-gram lookup): the rule then accepts d with
probability p(d) and otherwise samples p conditioned on "not d", which is exactly what comparing
d with a token sampled from p does. So the output distribution is the target's, for greedy
(p one-hot) and sampling alike. It is more: since row i samples at the RNG step plain decoding
would use there, a seeded request gives the very tokens it gives without speculation. The cost,
against the full ratio rule, is acceptance when an assistant samples its drafts at temperature
> 0 from a q close to p: the ratio rule would accept d with probability min(1, p(d)/q(d)),
this one with p(d) given d. (The drafter samples with the same (seed, step) as the verify row:
one uniform through both sorted distributions, so where q is close to p the two draws mostly
agree.) The ratio rule needs the target's probabilities at every verify row, which the verify
entry point does not return.
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
    is the target's token after the row before draft i."""
    m = 0
    while m < len(drafts) and drafts[m] == target[m]:
        m += 1
    return m
