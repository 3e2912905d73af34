"""The one request check (runtime/request_limits): each field's range and type, refused with a
RequestError naming it, and the normalized request the engine runs."""

from __future__ import annotations

import numpy as np
import pytest

from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Sampling
from rvcompile.runtime.request_limits import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    RequestError,
    RequestLimits,
    check_sampling,
)

LIMITS = RequestLimits(vocab_size=1000, max_model_len=64)


def refused(request: Request, param: str, needle: str = "") -> RequestError:
    with pytest.raises(RequestError) as e:
        LIMITS.check(request)
    assert e.value.param == param, e.value
    assert str(e.value).startswith(f"{param}: ") and "\n" not in str(e.value)
    assert needle in str(e.value), e.value
    return e.value


def with_sampling(**kw) -> Request:
    return Request("r", [5, 6], 4, Sampling(**kw))


def test_a_good_request_is_normalized():
    r = LIMITS.check(Request("r", np.array([5, 6, 7]), np.int64(4),
                             Sampling(temperature=1, top_k=-1, top_p=np.float32(0.5),
                                      seed=-1), stop="END", ignore_eos=np.bool_(True)))
    assert r.prompt_ids == [5, 6, 7] and type(r.prompt_ids[0]) is int
    assert r.max_tokens == 4 and type(r.max_tokens) is int
    assert r.sampling == Sampling(1.0, 0, 0.5, 2**31 - 1)  # -1 -> no cut; the seed's 31 bits
    assert r.stop == ("END",) and r.ignore_eos is True
    assert LIMITS.check(Request("r", [5], 63)).max_tokens == 63  # fills the context exactly
    assert LIMITS.check(with_sampling(top_k=1000)).sampling.top_k == 1000


@pytest.mark.parametrize("kw,param,needle", [
    ({"top_k": 2**31}, "top_k", "1000 (the vocabulary size)"),
    ({"top_k": 1001}, "top_k", "got 1001"),
    ({"top_k": -2}, "top_k", ""),
    ({"top_k": 2.0}, "top_k", "expected an integer"),
    ({"top_k": True}, "top_k", "bool"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"temperature": -0.5}, "temperature", "float32"),
    ({"temperature": 1e39}, "temperature", "float32"),
    ({"temperature": 10**400}, "temperature", "float32"),
    ({"temperature": "0.7"}, "temperature", "expected a number"),
    ({"temperature": 0.5 + 1j}, "temperature", "expected a number"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", ""),
    ({"top_p": 1e-50}, "top_p", ""),  # 0 as a float32
    ({"top_p": float("nan")}, "top_p", "finite"),
    ({"seed": 2**63}, "seed", "64-bit"),
    ({"seed": -(2**63) - 1}, "seed", "64-bit"),
    ({"seed": 1.5}, "seed", "expected an integer"),
])
def test_sampling_out_of_range(kw, param, needle):
    refused(with_sampling(**kw), param, needle)


def test_lengths_and_token_ids():
    e = refused(Request("r", list(range(10, 74)), 1), "prompt", "maximum context length")
    assert e.code == "context_length_exceeded"
    e = refused(Request("r", [5] * 60, 5), "max_tokens", "you requested 65 (60 in the prompt")
    assert e.code == "context_length_exceeded"
    refused(Request("r", [5] * 100, 5), "prompt", "100 tokens")
    refused(Request("r", [], 5), "prompt", "empty prompt")
    refused(Request("r", [5, 1000], 5), "prompt", "token id 1000 is outside the vocabulary")
    refused(Request("r", [5, -1], 5), "prompt", "token id -1")
    refused(Request("r", [5, 2**40], 5), "prompt", "outside the vocabulary")
    refused(Request("r", [5, 6.0], 5), "prompt", "expected a token id")
    refused(Request("r", [5, True], 5), "prompt", "bool")
    refused(Request("r", "hello", 5), "prompt", "list of token ids")
    refused(Request("r", None, 5), "prompt", "list of token ids")
    refused(Request("r", [5], 0), "max_tokens", "at least 1")
    refused(Request("r", [5], 2**31), "max_tokens", "maximum context length")
    refused(Request("r", [5], "3"), "max_tokens", "expected an integer")


def test_stop_strings_and_ignore_eos():
    assert LIMITS.check(Request("r", [5], 2, stop=["a", "b"])).stop == ("a", "b")
    assert LIMITS.check(Request("r", [5], 2, stop=None)).stop == ()
    refused(Request("r", [5], 2, stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop", "at most 16")
    refused(Request("r", [5], 2, stop=["x" * (MAX_STOP_CHARS + 1)]), "stop", "1 to 256")
    refused(Request("r", [5], 2, stop=[""]), "stop", "1 to 256")
    refused(Request("r", [5], 2, stop=["a", 3]), "stop", "a string or a list of strings")
    refused(Request("r", [5], 2, stop=5), "stop", "")
    refused(Request("r", [5], 2, ignore_eos=1), "ignore_eos", "expected a bool")


def test_sampling_before_the_vocabulary_is_known():
    """What `rvrun` checks before it loads an artifact: int32 is top_k's bound."""
    assert check_sampling(Sampling(top_k=2**31 - 1), vocab_size=None).top_k == 2**31 - 1
    with pytest.raises(RequestError, match="top_k: .*2147483647 \\(int32's largest\\)"):
        check_sampling(Sampling(top_k=2**31), vocab_size=None)
