"""The sampler's extras (issue 16) on the default model's xla-f32 artifact, on the CPU:
log-probabilities equal log_softmax of the `logits` entry at the same positions; penalties and
token masks against their numpy references (ir/ops.py), in the jax lowering and end to end
through the engine; n samples share one prefill and differ; stop token ids end a sample;
grammar constraints (regex, Lark, JSON schema) through the engine beside free sequences, and
grammars llguidance cannot compile refused at the door; an executor without the extras (h100)
refuses them naming why.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.ir.ops import ref_penalize, ref_token_mask
from rvcompile.runtime.constraints import Constraint
from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Penalties, Sampling
from rvcompile.runtime.request_limits import RequestError
from rvcompile.targets.xla import sampler

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("extras") / "tiny.rvp"
    build_artifact(str(MODEL_DIR), out,
                   BuildOptions("xla-f32", max_context=256, prefill_buckets=(16, 64),
                                max_seqs=4, platforms=("cpu",), decode_loop_steps=8),
                   progress=False, log=lambda *a: None)
    return runtime.load(out)


def run(m, request: Request) -> dict[int, list]:
    """The engine's outputs of one request, by sample index."""
    eng = m.engine
    eng.add(request)
    outs: dict[int, list] = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.index, []).append(o)
    return outs


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_penalize_and_mask_match_their_references():
    rng = np.random.default_rng(0)
    b, v, p = 3, 100, 12
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    ids = np.stack([rng.permutation(v)[:p] for _ in range(b)]).astype(np.int32)
    ids[1, 5:] = -1
    ids[2] = -1
    counts = rng.integers(0, 4, size=(b, p)).astype(np.int32)
    presence = np.array([0.5, -1.0, 2.0], np.float32)
    frequency = np.array([0.25, 1.5, 0.0], np.float32)
    repetition = np.array([1.3, 0.8, 1.0], np.float32)
    got = np.asarray(sampler.penalize(jnp.asarray(logits), ids, counts, presence, frequency,
                                      repetition))
    want = ref_penalize(logits, ids, counts, presence, frequency, repetition)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[2], logits[2])  # no ids: untouched, bit for bit
    mask = rng.integers(-2**31, 2**31, size=(b, sampler.mask_words(v)), dtype=np.int64)
    mask = mask.astype(np.int32)
    got = np.asarray(sampler.apply_mask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, ref_token_mask(logits, mask))
    full = np.full((b, sampler.mask_words(v)), -1, np.int32)
    np.testing.assert_array_equal(np.asarray(sampler.apply_mask(jnp.asarray(logits), full)),
                                  logits)


def test_mask_in_rows_of_128_is_the_reference_bit_for_bit():
    """One lane over a vocabulary of 128 n ids takes apply_mask's dot form (one fusion on
    TPU): the reference's logits bit for bit, -0.0 and every bit of every word included."""
    rng = np.random.default_rng(1)
    b, v = 1, 4096
    logits = rng.normal(size=(b, v)).astype(np.float32)
    logits[0, :64] = -0.0
    mask = rng.integers(-2**31, 2**31, size=(b, v // 32), dtype=np.int64).astype(np.int32)
    mask[0, :8] = [-1, 0, -2**31, 2**31 - 1, 1, 255, 256, -256]
    got = np.asarray(jax.jit(sampler.apply_mask)(jnp.asarray(logits), jnp.asarray(mask)))
    assert got.tobytes() == ref_token_mask(logits, mask).tobytes()
    full = np.full((b, v // 32), -1, np.int32)
    assert np.asarray(sampler.apply_mask(jnp.asarray(logits), full)).tobytes() == \
        logits.tobytes()


def test_logprobs_are_the_log_softmax_of_the_logits(tiny):
    prompt = tiny.encode("In the beginning God created")
    outs = run(tiny, Request("lp", prompt, 12, Sampling(1.0, 0, 1.0, 7), logprobs=5))[0]
    tokens = [t for o in outs for t in o.token_ids]
    lps = [x for o in outs for x in o.logprobs]
    assert len(tokens) == len(lps) == 12
    ref = log_softmax(tiny.engine.logits(prompt + tokens[:-1]))[len(prompt) - 1:]
    for i, (tok, s) in enumerate(zip(tokens, lps, strict=True)):
        assert s.token == tok
        assert abs(s.logprob - ref[i, tok]) < 1e-4
        assert len(s.top) == 5
        ids = [t for t, _ in s.top]
        assert ids == list(np.argsort(-ref[i], kind="stable")[:5])
        np.testing.assert_allclose([lp for _, lp in s.top], ref[i, ids], atol=1e-4)


def test_penalties_follow_the_reference_greedily(tiny):
    prompt = tiny.encode("And the LORD said unto Moses, And the LORD said")
    pen = Penalties(presence=0.4, frequency=0.7, repetition=1.3)
    outs = run(tiny, Request("pen", prompt, 10, penalties=pen))[0]
    tokens = [t for o in outs for t in o.token_ids]
    plain = [t for o in run(tiny, Request("plain", prompt, 10))[0] for t in o.token_ids]
    assert tokens != plain  # the penalties changed something
    logits = tiny.engine.logits(prompt + tokens[:-1])[len(prompt) - 1:]
    for k, tok in enumerate(tokens):
        counts = np.bincount(tokens[:k], minlength=logits.shape[-1])
        ids = np.flatnonzero((counts > 0) | np.isin(np.arange(logits.shape[-1]), prompt))
        row = ref_penalize(logits[k:k + 1], ids[None].astype(np.int32),
                           counts[ids][None].astype(np.int32), [pen.presence],
                           [pen.frequency], [pen.repetition])
        assert int(np.argmax(row[0])) == tok, k


def test_n_samples_share_one_prefill_and_differ(tiny):
    ex = tiny.engine.executor
    calls = []
    call_all = ex._call_all
    ex._call_all = lambda name, *a: calls.append(name) or call_all(name, *a)
    try:
        prompt = tiny.encode("In the beginning God created the heaven and the earth. And the "
                             "earth was without form, and void; and darkness was upon the face")
        assert len(prompt) > ex.block_size  # whole blocks to share
        outs = run(tiny, Request("n4", prompt, 8, Sampling(1.0, 0, 1.0, 3), n=4))
    finally:
        del ex._call_all
    assert [c for c in calls if c.startswith("prefill")] == ["prefill_16"]
    samples = {i: tuple(t for o in outs[i] for t in o.token_ids) for i in range(4)}
    assert len(set(samples.values())) == 4
    last = [o[-1] for o in outs.values()]
    assert all(o.finished and o.prompt_tokens == len(prompt) for o in last)
    assert all(o.completion_tokens == len(samples[o.index]) for o in last)
    assert sum(o.cached_tokens > 0 for o in last) == 3  # the shared blocks, from the cache
    again = run(tiny, Request("n4b", prompt, 8, Sampling(1.0, 0, 1.0, 3), n=4))
    assert {i: tuple(t for o in again[i] for t in o.token_ids) for i in range(4)} == samples


def test_stop_token_ids_end_a_sample(tiny):
    prompt = tiny.encode("In the beginning")
    free = [t for o in run(tiny, Request("a", prompt, 8))[0] for t in o.token_ids]
    outs = run(tiny, Request("b", prompt, 8, stop_token_ids=(free[3],)))[0]
    stop = free.index(free[3])
    assert [t for o in outs for t in o.token_ids] == free[:stop]
    assert outs[-1].finish_reason == "stop"


@pytest.mark.parametrize("kw,param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"n": 0}, "n"),
    ({"n": 17}, "n"), ({"penalties": Penalties(presence=2.5)}, "presence_penalty"),
    ({"penalties": Penalties(frequency=float("nan"))}, "frequency_penalty"),
    ({"penalties": Penalties(repetition=0.0)}, "repetition_penalty"),
    ({"stop_token_ids": (9999,)}, "stop_token_ids"), ({"stop_token_ids": "x"}, "stop_token_ids"),
])
def test_bad_extras_are_refused_at_the_door(tiny, kw, param):
    with pytest.raises(RequestError) as e:
        tiny.engine.add(Request("bad", [1, 2, 3], 4, **kw))
    assert e.value.param == param


def test_grammar_constraints_through_the_engine(tiny):
    """The engine-level constraint API (what structured outputs and forced tool calls use):
    a regex, a Lark grammar and a JSON schema, constrained and free sequences in one batch."""
    prompt = tiny.encode("The number is")
    reqs = [Request("re", prompt, 8, Sampling(1.0, 0, 1.0, 1),
                    constraint=Constraint.regex(r"[0-9]{3}")),
            Request("lark", prompt, 16, Sampling(1.0, 0, 1.0, 2),
                    constraint=Constraint.lark('start: "call(" NAME ")"\nNAME: /[a-z]{1,5}/')),
            Request("js", prompt, 24, Sampling(1.0, 0, 1.0, 3), n=2,
                    constraint=Constraint.json_schema({"enum": ["yes", "no", 7]})),
            Request("free", prompt, 8, Sampling(1.0, 0, 1.0, 4))]
    eng = tiny.engine
    masks = eng.mask_rows
    for r in reqs:
        eng.add(r)
    outs: dict[tuple[str, int], list] = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault((o.id, o.index), []).append(o)
    text = {k: "".join(o.text for o in v) for k, v in outs.items()}
    assert re.fullmatch(r"[0-9]{3}", text["re", 0]) and outs["re", 0][-1].finish_reason == "stop"
    assert re.fullmatch(r"call\([a-z]{1,5}\)", text["lark", 0])
    assert json.loads(text["js", 0]) in ("yes", "no", 7)
    assert json.loads(text["js", 1]) in ("yes", "no", 7)
    assert sum(len(o.token_ids) for o in outs["free", 0]) == 8
    assert eng.mask_rows > masks


def test_constrained_and_free_sequences_in_one_batch_give_their_tokens_alone(tiny):
    """Sampled (seeded, temperature 1) requests, constrained and free, decode in one batch with
    the grammar masks pipelined; each gets exactly the tokens it gets alone (a free one alone
    runs in the decode loop, a constrained one alone in single steps)."""
    prompt = tiny.encode("The answer is")
    reqs = [Request("js", prompt, 40, Sampling(1.0, 0, 1.0, 11),
                    constraint=Constraint.json_schema({"type": "object", "properties": {
                        "a": {"type": "integer"}}, "required": ["a"]})),
            Request("free", prompt, 20, Sampling(1.0, 0, 1.0, 12), ignore_eos=True),
            Request("re", prompt, 24, Sampling(1.0, 0, 1.0, 13),
                    constraint=Constraint.regex(r"[a-z ]{4,20}\.")),
            Request("free2", tiny.encode("Once"), 16, Sampling(1.0, 0, 1.0, 14),
                    ignore_eos=True)]
    eng = tiny.engine
    for r in reqs:
        eng.add(r)
    together: dict[str, list] = {}
    while eng.has_work():
        for o in eng.step():
            together.setdefault(o.id, []).append(o)
    for r in reqs:
        alone = [t for o in run(tiny, r)[0] for t in o.token_ids]
        assert [t for o in together[r.id] for t in o.token_ids] == alone, r.id
    text = {rid: "".join(o.text for o in outs) for rid, outs in together.items()}
    assert together["re"][-1].finish_reason == "stop"
    assert re.fullmatch(r"[a-z ]{4,20}\.", text["re"])
    if together["js"][-1].finish_reason == "stop":
        assert isinstance(json.loads(text["js"])["a"], int)
    else:
        assert text["js"].startswith('{"a":')


@pytest.mark.parametrize("constraint,needle", [
    (Constraint.json_schema({"type": "foo"}), "foo"),
    (Constraint.json_schema({"$ref": "#/definitions/missing"}), "missing"),
    (Constraint.lark("start: undefined_rule"), "undefined_rule"),
    (Constraint.regex("(unclosed"), ""),
])
def test_grammars_llguidance_cannot_compile_are_refused_at_the_door(tiny, constraint, needle):
    with pytest.raises(RequestError) as e:
        tiny.engine.add(Request("bad", [1, 2, 3], 4, constraint=constraint))
    assert e.value.param == constraint.param
    assert "cannot compile" in e.value.problem and needle in e.value.problem


def test_an_executor_without_sampler_extras_refuses_them():
    """An h100 artifact's sampler returns a token only: logprobs, penalties and constraints
    are refused at the door, naming why."""
    from test_engine import VOCAB, FakeExecutor, text_of

    from rvcompile.runtime.constraints import Grammars
    from rvcompile.runtime.engine import Engine

    eng = Engine(FakeExecutor(), text_of, frozenset([1]), vocab_size=VOCAB,
                 grammars=Grammars(None, VOCAB, frozenset([1])))
    for kw, param in (({"logprobs": 0}, "logprobs"),
                      ({"penalties": Penalties(repetition=1.1)}, "repetition_penalty"),
                      ({"constraint": Constraint.json_object()}, "response_format")):
        with pytest.raises(RequestError) as e:
            eng.add(Request("x", [2, 3], 4, **kw))
        assert e.value.param == param and "h100" in e.value.problem
    eng.add(Request("ok", [2, 3], 4, n=2, stop_token_ids=(5,)))  # no extras needed


@pytest.mark.parametrize("prompt_len", [3, 17, 40])
def test_n_samples_read_the_true_history_from_shared_blocks(prompt_len):
    """Through test_engine's fake executor, which checks on every call that the block tables
    hold the sequence's true history: n samples share the prompt's whole blocks (one prefill
    of them, none when there are none), and each gets the tokens of its own seed, its RNG steps
    counting the prompt tail it ran as decode lanes."""
    from test_engine import (
        BS,
        EOS,
        FakeExecutor,
        assert_pools_whole,
        drain,
        engine,
        next_token,
    )

    ex = FakeExecutor()
    eng = engine(ex)
    prompt = list(range(10, 10 + prompt_len))
    sampling = Sampling(1.0, 0, 1.0, 11)
    eng.add(Request("r", prompt, 6, sampling, n=3))
    outs = drain(eng)["r"]
    shared = (prompt_len - 1) // BS * BS
    for i in range(3):
        got = [t for o in outs if o.index == i for t in o.token_ids]
        s = Sampling(1.0, 0, 1.0, 11 + i)
        history, want = list(prompt), []
        while len(want) < 6:
            want.append(next_token(history, s, prompt_len - shared + len(want)))
            history.append(want[-1])
        if EOS in want:  # a sample ends at EOS (not returned)
            want = want[:want.index(EOS)]
        assert got == want, i
    prefilled = sum(n for kind, _, n in ex.calls if kind == "prefill")
    assert prefilled == shared  # once, by the first sample
    assert_pools_whole(eng)


def test_constraints_without_llguidance_are_refused_naming_the_extra(tiny, monkeypatch):
    """llguidance comes with the serve extra; the runtime imports it only for a constraint."""
    from rvcompile.runtime.constraints import Grammars

    monkeypatch.setitem(sys.modules, "llguidance", None)  # its import fails
    g = Grammars(tiny.tokenizer, tiny.vocab_size, tiny.eos_ids)
    with pytest.raises(RequestError) as e:
        g.check(Constraint.json_object())
    assert e.value.param == "response_format" and "rvcompile[serve]" in e.value.problem
