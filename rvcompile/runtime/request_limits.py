"""The one check of a generation request's fields. Every request enters the engine through
`Engine.add`, which runs `RequestLimits.check`, so the Python API (Model.generate), `rvrun
--prompt` and `rvrun serve` refuse the same things in the same words; `rvrun` also runs the
checks that need no artifact before it loads one.

The limits are what the device takes, so nothing a request holds can fail a step:
- prompt: 1 to max_model_len - 1 token ids (ints, not bools), each in [0, vocab_size);
- max_tokens: an int >= 1 with prompt + max_tokens <= max_model_len (so every position and RNG
  step fits int32);
- temperature: a finite number, 0 (greedy) to the largest float32;
- top_k: an int, -1 or 0 (no cut) to vocab_size (to int32's largest before the vocabulary is
  known); -1 becomes 0;
- top_p: a number in (0, 1] that stays above 0 as a float32;
- seed: an int64 (what OpenAI clients send); the device samples from its low 31 bits, so seeds
  that agree there sample alike;
- stop: a string or a list of at most MAX_STOP_STRINGS strings of 1 to MAX_STOP_CHARS
  characters each (the text is searched for each of them after every token);
- ignore_eos: a bool;
- n: an int, 1 to MAX_N samples;
- logprobs: None, or an int 0 to the executor's top log-probabilities (20 on XLA artifacts and
  h100 ones with sampled entry points); refused where the sampler returns none (h100 artifacts
  built before those: their sample kernels return a token);
- penalties: presence and frequency in [-2, 2] (OpenAI's range), repetition in (0, 100]; any
  but neutral refused where the sampler takes no extras, as logprobs;
- stop_token_ids: at most MAX_STOP_STRINGS token ids in the vocabulary.
- speculation (speculative decoding, runtime/speculative.py): None, or a method the artifact
  offers ("ngram" needs its verify entry point, `rvcompile build --num-draft-tokens K`;
  "assistant" also its drafter, `--assistant`) and num_draft_tokens an int in [1, K] (None: K).

A refusal is a RequestError: a ValueError whose `param` names the field (callers map it to their
spelling: `--top-k`, `max_completion_tokens`, `messages`) and whose message is one line.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rvcompile.runtime.executor_api import Penalties, Sampling
from rvcompile.runtime.speculative import METHODS, Speculation

if TYPE_CHECKING:
    from rvcompile.runtime.engine import Request

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
SEED_MASK = 0x7FFFFFFF  # the device's seeds are 31-bit
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_N = 16  # samples per request
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range [-2, 2]
MAX_REPETITION = 100.0
NO_EXTRAS = ("this artifact's sampler returns a token only (an h100 artifact built before its "
             "sampled entry points, kernel schedule version 7); rebuild it")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the OpenAI error code


class RequestError(ValueError):
    """A request field out of range: `param` names it, `problem` says what is wrong."""

    def __init__(self, param: str, problem: str, code: str | None = None):
        super().__init__(f"{param}: {problem}")
        self.param, self.problem, self.code = param, problem, code


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can run: the model's vocabulary and the engine's longest sequence."""

    vocab_size: int
    max_model_len: int
    top_logprobs: int = 0  # the executor's sampler's top log-probabilities; 0: it takes no
    # extras (no log-probabilities or penalties)
    max_draft_tokens: int = 0  # drafts one verify call checks (0: no speculative decoding)
    has_drafter: bool = False  # the artifact carries an assistant drafter

    def check(self, request: Request) -> Request:
        """The request with every field checked and normalized (ids as ints, top_k -1 as 0,
        the seed as the device's 31 bits, stop as a tuple); raises RequestError."""
        ids = self.token_ids(request.prompt_ids, "prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError("prompt", f"the prompt is {len(ids)} tokens; this model's "
                                         f"maximum context length is {self.max_model_len} "
                                         "tokens, with at least 1 to generate",
                               CONTEXT_LENGTH_EXCEEDED)
        max_tokens = check_max_tokens(request.max_tokens)
        if len(ids) + max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"this model's maximum context length is "
                                             f"{self.max_model_len} tokens; you requested "
                                             f"{len(ids) + max_tokens} ({len(ids)} in the "
                                             f"prompt, {max_tokens} to generate)",
                               CONTEXT_LENGTH_EXCEEDED)
        n = _int("n", request.n)
        if not 1 <= n <= MAX_N:
            raise RequestError("n", f"must be 1 to {MAX_N}, got {n}")
        return dataclasses.replace(
            request, prompt_ids=ids, max_tokens=max_tokens,
            sampling=check_sampling(request.sampling, self.vocab_size),
            stop=check_stop(request.stop), ignore_eos=_bool("ignore_eos", request.ignore_eos),
            n=n, logprobs=self.check_logprobs(request.logprobs),
            penalties=self.check_penalties(request.penalties),
            stop_token_ids=self.stop_token_ids(request.stop_token_ids),
            speculation=self.speculation(request.speculation, request))

    def speculation(self, spec: object, request: Request | None = None) -> Speculation | None:
        """spec checked against what the artifact offers, num_draft_tokens filled in; with
        `request`, also that it asks for nothing the verify entry point's sampler lacks (n > 1,
        log-probabilities, penalties, a grammar)."""
        if spec is None:
            return None
        uses = () if request is None else (
            ("n", request.n != 1), ("logprobs", request.logprobs is not None),
            ("penalties", request.penalties.active),
            ("response_format", request.constraint is not None))
        for param, used in uses:
            if used:
                raise RequestError("speculative", f"speculative decoding does not combine "
                                                  f"with {param} yet")
        if not isinstance(spec, Speculation):
            raise RequestError("speculative", f"expected a Speculation, got {_kind(spec)}")
        method = check_method(spec.method)
        if not self.max_draft_tokens:
            raise RequestError("speculative", f"{method}: the artifact has no verify entry "
                                              "point (an XLA target built with "
                                              "--num-draft-tokens K has one)")
        if method == "assistant" and not self.has_drafter:
            raise RequestError("speculative", "assistant: the artifact has no assistant "
                                              "drafter (build it with --assistant)")
        k = self.max_draft_tokens if spec.num_draft_tokens is None else _int(
            "num_draft_tokens", spec.num_draft_tokens)
        if not 1 <= k <= self.max_draft_tokens:
            raise RequestError("num_draft_tokens", f"must be 1 to {self.max_draft_tokens} (the "
                                                   f"artifact's verify rows - 1), got {k}")
        return Speculation(method, k)

    def check_logprobs(self, value: object) -> int | None:
        if value is None:
            return None
        k = _int("logprobs", value)
        if not self.top_logprobs:
            raise RequestError("logprobs", NO_EXTRAS)
        if not 0 <= k <= self.top_logprobs:
            raise RequestError("logprobs", f"must be 0 to {self.top_logprobs}, got {k}")
        return k

    def check_penalties(self, p: Penalties) -> Penalties:
        out = check_penalties(p)
        if out.active and not self.top_logprobs:
            param = "repetition_penalty" if out.repetition != 1.0 else (
                "presence_penalty" if out.presence else "frequency_penalty")
            raise RequestError(param, NO_EXTRAS)
        return out

    def stop_token_ids(self, ids: object) -> tuple[int, ...]:
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
            raise RequestError("stop_token_ids", f"expected a list of token ids, got "
                                                 f"{_kind(ids)}")
        out = tuple(_int("stop_token_ids", t, "a token id") for t in ids)
        if len(out) > MAX_STOP_STRINGS:
            raise RequestError("stop_token_ids", f"at most {MAX_STOP_STRINGS} ids, got "
                                                 f"{len(out)}")
        bad = next((t for t in out if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError("stop_token_ids", f"token id {bad} is outside the vocabulary "
                                                 f"[0, {self.vocab_size})")
        return out

    def token_ids(self, ids: object, param: str) -> list[int]:
        """ids as a list of ints in [0, vocab_size), 1 to max_model_len of them."""
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
            raise RequestError(param, f"expected a list of token ids, got {_kind(ids)}")
        if all(type(t) is int for t in ids):  # the common case, without a call per id
            out = list(ids)
        else:
            out = [_int(param, t, "a token id") for t in ids]
        if not out:
            raise RequestError(param, "empty prompt")
        if len(out) > self.max_model_len:
            raise RequestError(param, f"{len(out)} tokens; this model's maximum context length "
                                      f"is {self.max_model_len} tokens", CONTEXT_LENGTH_EXCEEDED)
        bad = next((t for t in out if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(param, f"token id {bad} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        return out


def check_max_tokens(value: object) -> int:
    n = _int("max_tokens", value)
    if n < 1:
        raise RequestError("max_tokens", f"must be at least 1, got {n}")
    return n


def check_sampling(s: Sampling, vocab_size: int | None) -> Sampling:
    """s checked and normalized; vocab_size None (not known yet) bounds top_k by int32."""
    temperature = _number("temperature", s.temperature)
    if not 0 <= temperature <= FLOAT32_MAX:
        raise RequestError("temperature", f"must be 0 to {FLOAT32_MAX:.4g} (a float32), got "
                                          f"{temperature}")
    top_k = _int("top_k", s.top_k)
    most = INT32_MAX if vocab_size is None else vocab_size
    if not -1 <= top_k <= most:
        what = "int32's largest" if vocab_size is None else "the vocabulary size"
        raise RequestError("top_k", f"must be -1 or 0 (no cut) to {most} ({what}), got {top_k}")
    top_p = _number("top_p", s.top_p)
    if not (0 < top_p <= 1 and np.float32(top_p) > 0):
        raise RequestError("top_p", f"must be in (0, 1], got {top_p}")
    seed = _int("seed", s.seed)
    if not INT64_MIN <= seed <= INT64_MAX:
        raise RequestError("seed", f"must be a 64-bit integer, got {seed}")
    return Sampling(temperature, max(top_k, 0), top_p, seed & SEED_MASK)


def check_penalties(p: Penalties) -> Penalties:
    """p checked: presence and frequency in [-2, 2], repetition in (0, MAX_REPETITION]."""
    presence = _number("presence_penalty", p.presence)
    frequency = _number("frequency_penalty", p.frequency)
    repetition = _number("repetition_penalty", p.repetition)
    for param, x in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -MAX_PENALTY <= x <= MAX_PENALTY:
            raise RequestError(param, f"must be -{MAX_PENALTY:g} to {MAX_PENALTY:g}, got {x}")
    if not 0 < repetition <= MAX_REPETITION:
        raise RequestError("repetition_penalty", f"must be in (0, {MAX_REPETITION:g}], got "
                                                 f"{repetition}")
    return Penalties(presence, frequency, repetition)


def speculation_of(method: object, num_draft_tokens: object) -> Speculation | None:
    """The Speculation a caller's two arguments ask for (method None: none; then
    num_draft_tokens must be None too). RequestLimits.speculation checks the rest."""
    if method is None:
        if num_draft_tokens is not None:
            raise RequestError("num_draft_tokens", "only with speculative (assistant or ngram)")
        return None
    return Speculation(check_method(method), num_draft_tokens)


def check_method(method: object) -> str:
    """A speculative decoding method's name: one of speculative.METHODS."""
    if method not in METHODS:
        raise RequestError("speculative", f"expected one of {', '.join(METHODS)}, got "
                                          f"{_kind(method)}")
    return method


def check_stop(stop: object) -> tuple[str, ...]:
    """Stop strings as a tuple: None, one string or a list of strings."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop", f"expected a string or a list of strings, got {_kind(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise RequestError("stop", f"each string must have 1 to {MAX_STOP_CHARS} "
                                       f"characters, got {len(s)}")
    return tuple(stops)


def _int(param: str, value: object, what: str = "an integer") -> int:
    if isinstance(value, bool | np.bool_):
        raise RequestError(param, f"expected {what}, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise RequestError(param, f"expected {what}, got {_kind(value)}") from None


def _number(param: str, value: object) -> float:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer
                                                              | np.floating):
        raise RequestError(param, f"expected a number, got {_kind(value)}")
    if isinstance(value, int) and abs(value) > FLOAT32_MAX:
        raise RequestError(param, f"{value} does not fit a float32")
    x = float(value)
    if not math.isfinite(x):
        raise RequestError(param, f"must be finite, got {x}")
    return x


def _bool(param: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise RequestError(param, f"expected a bool, got {_kind(value)}")
    return bool(value)


def _kind(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
