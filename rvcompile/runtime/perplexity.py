"""Teacher-forced perplexity with sliding windows (`rvrun ppl`).

The text's tokens t_0 .. t_{M-1} (no BOS) are scored in windows. Each window is BOS followed by
up to `window - 1` consecutive text tokens; window k starts at text token k * stride. A window
scores only the tokens that no earlier window scored, so every token is scored exactly once:
window 0 scores all of its tokens (t_0 from BOS alone, as at the start of any text), and a later
window scores its last tokens, each with at least `window - 1 - stride` real tokens of left
context before it (hence 1 <= stride <= window - 2).

`score(logits_fn, ...)` takes any `token ids [T] -> logits [T, vocab]` function (a runtime
`Model.logits`, or a reference), so the same plan scores an artifact and its oracle alike. Log
probabilities are computed in float64 from the returned float32 logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Window:
    begin: int  # first text token in the window (it follows the BOS)
    end: int  # one past the last text token in the window
    score_from: int  # text tokens [score_from, end) are scored here


@dataclass(frozen=True)
class Scores:
    nll: np.ndarray  # [M] float64: -log p(t_j | BOS, context) for every text token j
    top1: np.ndarray  # [M] int32: the argmax prediction at token j's position
    windows: int

    @property
    def tokens(self) -> int:
        return int(self.nll.size)

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def check_window(window: int, stride: int) -> None:
    """ValueError unless every token after the first window keeps real left context."""
    if window < 3 or not 1 <= stride <= window - 2:
        raise ValueError(f"need window >= 3 and 1 <= stride <= window - 2 (got window {window}, "
                         f"stride {stride})")


def plan_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows that score `n_tokens` text tokens, each exactly once (module docstring)."""
    check_window(window, stride)
    if n_tokens < 1:
        raise ValueError("the text has no tokens")
    plan, scored = [], 0
    begin = 0
    while scored < n_tokens:
        end = min(begin + window - 1, n_tokens)
        plan.append(Window(begin, end, scored))
        scored = end
        begin += stride
    return plan


def score(logits_fn: Callable[[Sequence[int]], np.ndarray], token_ids: Sequence[int], *,
          bos_id: int, window: int, stride: int,
          on_window: Callable[[int, int, float], None] | None = None) -> Scores:
    """Score the text tokens `token_ids` (without BOS) window by window; `on_window(done,
    windows, perplexity so far)` after each."""
    ids = np.asarray(token_ids, np.int64)
    nll = np.empty(ids.size, np.float64)
    top1 = np.empty(ids.size, np.int32)
    plan = plan_windows(ids.size, window, stride)
    for i, w in enumerate(plan):
        inputs = np.concatenate([[bos_id], ids[w.begin:w.end]])
        logits = np.asarray(logits_fn(inputs), np.float64)  # [1 + end - begin, vocab]
        # text token j sits at input j - begin + 1 and is predicted by row j - begin
        rows = logits[w.score_from - w.begin:w.end - w.begin]
        targets = ids[w.score_from:w.end]
        peak = rows.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(rows - peak).sum(axis=-1)) + peak[:, 0]
        nll[w.score_from:w.end] = log_z - rows[np.arange(targets.size), targets]
        top1[w.score_from:w.end] = rows.argmax(axis=-1)
        if on_window is not None:
            on_window(i + 1, len(plan), math.exp(nll[:w.end].mean()))
    return Scores(nll=nll, top1=top1, windows=len(plan))


def text_perplexity(model, text: str, *, window: int, stride: int,
                    on_window: Callable[[int, int, float], None] | None = None) -> Scores:
    """Score `text` with a loaded runtime `Model` (its tokenizer, BOS id and logits)."""
    if window > model.max_context:
        raise ValueError(f"window {window} exceeds the artifact's context of "
                         f"{model.max_context} tokens")
    return score(model.logits, model.encode(text, add_bos=False), bos_id=model.bos_id,
                 window=window, stride=stride, on_window=on_window)
