"""The XLA target's device-side decode loop (decode_loop_{B}, Executor.decode_many) on the CPU: it
must give bit for bit what decode_{B} called once per token gives (tokens and KV pools), greedy
and with seeded sampling, ending lanes at their budgets and stop ids; and the engine, which uses
it when nothing waits to join the batch, must give the same generations as without it. First,
on test_engine's fake executor (which checks every step's block tables against the true
history): the blocks the engine allocates ahead of a loop call, under tight pools too.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest
import test_engine as fake

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.engine import Engine, Request
from rvcompile.runtime.executor_api import LoopLane, Sampling, SeqChunk, decode_loop_steps
from rvcompile.runtime.executors.xla import BACKEND_PLATFORM
from rvcompile.runtime.model import Model

CONTEXT = 128
STEPS = 16  # decode steps per decode_many call


class LoopFake(fake.FakeExecutor):
    """FakeExecutor with a decode loop: every step of every lane checked as a decode lane."""

    decode_loop_steps = 5
    decode_loop_stops = 4

    def decode_many(self, lanes) -> list[list[int]]:
        assert 0 < len(lanes) <= self.max_seqs
        self.calls.append(("loop", len(lanes), 0))
        out = []
        for lane in lanes:
            assert 1 <= lane.budget <= self.decode_loop_steps
            chunk, tokens = lane.chunk, []
            while len(tokens) < lane.budget and not (tokens and tokens[-1] in lane.stop_ids):
                tokens.append(self._run(chunk))
                chunk = dataclasses.replace(chunk, tokens=[tokens[-1]], start=chunk.start + 1,
                                            step=chunk.step + 1)
            out.append(tokens)
        return out


@pytest.mark.parametrize("full,sliding", [(64, 16), (16, 6), (64, 5)])
def test_engine_loop_on_the_fake_executor(full, sliding):
    """Requests arrive in bursts; between them the engine runs loop calls. Every request gets
    its reference tokens, the pools end whole, and loop calls ran."""
    rng = random.Random(full + sliding)
    ex = LoopFake(full, sliding)
    eng = fake.engine(ex)
    shared = [rng.randrange(2, fake.VOCAB) for _ in range(13)]
    expected, outs = {}, {}
    for i in range(24):
        prompt = fake.random_prompt(rng, shared, rng.randrange(0, 30))
        sampling = Sampling(0.8, 0, 1.0, rng.randrange(100)) if i % 3 == 0 else Sampling()
        max_tokens = rng.randrange(1, fake.CONTEXT - len(prompt))
        eng.add(Request(str(i), prompt, max_tokens, sampling, (), True))
        expected[str(i)] = fake.reference(prompt, max_tokens, sampling)
        for _ in range(rng.randrange(12)):
            for o in eng.step():
                outs.setdefault(o.id, []).append(o)
    for rid, more in fake.drain(eng).items():
        outs.setdefault(rid, []).extend(more)
    for rid, want in expected.items():
        assert fake.tokens_of(outs[rid]) == want, rid
        assert outs[rid][-1].finish_reason == "length"
    assert any(entry == "loop" for entry, *_ in ex.calls)
    fake.assert_pools_whole(eng)


@pytest.mark.parametrize("full,sliding", [(16, 6), (20, 16), (16, 16)])
def test_engine_loop_recomputes_preempted_sequences(full, sliding):
    """All at once into tight pools: sequences are preempted and recomputed while others run
    loop calls. A recomputed sequence's generated tokens are fed one decode step at a time,
    never sampled in a loop lane, so every request still gets its reference tokens (once the
    engine handed the loop's None for them to the detokenizer, which killed the server)."""
    rng = random.Random(full)
    ex = LoopFake(full, sliding)
    eng = fake.engine(ex)
    expected = {}
    for i in range(20):
        prompt = [rng.randrange(2, fake.VOCAB) for _ in range(rng.randrange(1, 30))]
        max_tokens = rng.randrange(1, fake.CONTEXT - len(prompt))
        eng.add(Request(str(i), prompt, max_tokens, ignore_eos=True))
        expected[str(i)] = fake.reference(prompt, max_tokens)
    outs = fake.drain(eng)
    for rid, want in expected.items():
        assert fake.tokens_of(outs[rid]) == want, rid
        assert outs[rid][-1].finish_reason == "length"
    assert eng.stats().preemptions > 0
    assert any(entry == "loop" for entry, *_ in ex.calls)
    fake.assert_pools_whole(eng)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    """Exported for the backend the tests run on: on a GPU machine the loop is checked there."""
    out = tmp_path_factory.mktemp("loop") / "tiny.rvp"
    platform = BACKEND_PLATFORM[jax.default_backend()]
    build_artifact("gemma-4-tiny-dense", out, BuildOptions(
        "tpu-bf16", max_context=CONTEXT, prefill_buckets=(16,), max_seqs=2, platforms=(platform,),
        decode_loop_steps=STEPS),
                   random_weights=True, progress=False, log=lambda *a: None)
    return runtime.load(str(out), verify=False)


def _tables(ex, lane: int) -> dict[str, list[int]]:
    """Lane `lane` owns blocks [lane * width, (lane + 1) * width) of every kind: enough for a
    whole sequence (the default pools hold slots * width)."""
    return {k.name: list(range(lane * k.table_width, (lane + 1) * k.table_width))
            for k in ex.kinds.values()}


def _prefill(ex, prompts, samplings) -> list[SeqChunk]:
    """Prefill each prompt; return each lane's first decode chunk."""
    chunks = []
    for i, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
        first = ex.prefill(SeqChunk(prompt, 0, _tables(ex, i), sampling, step=0))
        chunks.append(SeqChunk([first], len(prompt), _tables(ex, i), sampling, step=1))
    return chunks


def _pools(ex) -> dict[str, np.ndarray]:
    return {k: np.asarray(v).copy() for k, v in ex.caches.items()}


def _restore(ex, pools) -> None:
    ex.caches = {k: jax.device_put(v) for k, v in pools.items()}


def _per_step(ex, chunks: list[SeqChunk], budgets: list[int]) -> list[list[int]]:
    """decode_{B} once per token, each lane for its budget (ended lanes leave the batch)."""
    out = [[] for _ in chunks]
    chunks = list(chunks)
    for _ in range(max(budgets)):
        live = [i for i, b in enumerate(budgets) if len(out[i]) < b]
        tokens = ex.decode([chunks[i] for i in live])
        for i, t in zip(live, tokens, strict=True):
            out[i].append(t)
            c = chunks[i]
            chunks[i] = dataclasses.replace(c, tokens=[t], start=c.start + 1, step=c.step + 1)
    return out


def _looped(ex, chunks: list[SeqChunk], budgets: list[int],
            stops=frozenset()) -> list[list[int]]:
    """decode_many in calls of at most decode_loop_steps tokens per lane."""
    out = [[] for _ in chunks]
    chunks = list(chunks)
    while True:
        live = [i for i, b in enumerate(budgets)
                if len(out[i]) < b and not (out[i] and out[i][-1] in stops)]
        if not live:
            return out
        lanes = [LoopLane(chunks[i], min(ex.decode_loop_steps, budgets[i] - len(out[i])), stops)
                 for i in live]
        for i, lane, tokens in zip(live, lanes, ex.decode_many(lanes), strict=True):
            assert 0 < len(tokens) <= lane.budget
            out[i] += tokens
            c = chunks[i]
            chunks[i] = dataclasses.replace(c, tokens=[tokens[-1]], start=c.start + len(tokens),
                                            step=c.step + len(tokens))


def test_loop_equals_per_step_decode_bit_for_bit(model):
    ex = model.executor
    assert decode_loop_steps(ex) == STEPS
    rng = np.random.default_rng(0)
    prompts = [[2, *rng.integers(4, 1024, 15).tolist()], [2, *rng.integers(4, 1024, 10).tolist()]]
    samplings = [Sampling(), Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=1234)]
    chunks = _prefill(ex, prompts, samplings)
    start = _pools(ex)
    # 40 and 25 tokens: three calls for lane 0, lane 1 ends inside the second; both run past
    # the 48-slot sliding ring.
    budgets = [40, 25]
    want = _per_step(ex, chunks, budgets)
    want_pools = _pools(ex)
    _restore(ex, start)
    got = _looped(ex, chunks, budgets)
    assert got == want
    got_pools = _pools(ex)
    for key in want_pools:
        np.testing.assert_array_equal(got_pools[key], want_pools[key], err_msg=key)

    # A stop id ends its lane at the first time it is sampled, the stop id included; the other
    # lane runs on.
    stop = want[0][25]
    k = want[0].index(stop)
    assert stop not in want[1]
    _restore(ex, start)
    got = _looped(ex, chunks, budgets, frozenset({stop}))
    assert got == [want[0][:k + 1], want[1]]
    with pytest.raises(ValueError, match="lane budget 17: decode_many runs 1 to 16 steps"):
        ex.decode_many([LoopLane(chunks[0], STEPS + 1, frozenset())])


class _PerStep:
    """The executor without its decode loop: the engine must fall back to decode()."""

    def __init__(self, ex):
        self._ex = ex

    def __getattr__(self, name):
        if name in ("decode_many", "decode_loop_steps", "decode_loop_stops"):
            raise AttributeError(name)
        return getattr(self._ex, name)


def test_engine_generations_equal_with_and_without_the_loop(model):
    ex = model.executor
    rng = np.random.default_rng(1)
    requests = [
        Request("greedy", [2, *rng.integers(4, 1024, 12).tolist()], 40, ignore_eos=True),
        Request("seeded", [2, *rng.integers(4, 1024, 30).tolist()], 30,
                Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=7), ignore_eos=True),
        Request("eos", [2, *rng.integers(4, 1024, 5).tolist()], 60,
                Sampling(temperature=1.5, seed=3)),
    ]

    def run(executor, eos_ids, together: bool) -> dict[str, tuple]:
        engine = Engine(executor, model.decode, eos_ids, vocab_size=model.vocab_size)
        got: dict[str, tuple] = {}
        for batch in ([requests] if together else [[r] for r in requests]):
            for r in batch:
                engine.add(r)
            while engine.has_work():
                for out in engine.step():
                    ids, text, _ = got.get(out.id, ([], "", None))
                    got[out.id] = (ids + out.token_ids, text + out.text, out.finish_reason)
        return got

    # An EOS id the "eos" request samples part-way: its lane ends on the device mid-call.
    free = run(_PerStep(ex), model.eos_ids, together=False)
    eos_at = 20
    eos_ids = model.eos_ids | {free["eos"][0][eos_at]}
    want = run(_PerStep(ex), eos_ids, together=False)
    assert want["eos"][2] == "stop" and len(want["eos"][0]) <= eos_at
    assert [(len(want[r][0]), want[r][2]) for r in ("greedy", "seeded")] == [(40, "length"),
                                                                            (30, "length")]
    calls = []
    decode_many = ex.decode_many

    def counting(lanes):
        calls.append(len(lanes))
        return decode_many(lanes)

    ex.decode_many = counting
    try:
        assert run(ex, eos_ids, together=False) == want
        assert calls and max(calls) == 1
        calls.clear()
        assert run(ex, eos_ids, together=True) == want  # two lanes fit decode_2: one waits
        assert 2 in calls
    finally:
        del ex.decode_many


def test_generate_stream_gets_tokens_a_chunk_at_a_time(model):
    pieces = list(model.generate_stream([2, 5, 6, 7], max_tokens=40, ignore_eos=True))
    assert model.last_result.finish_reason == "length"
    assert len(model.last_result.token_ids) == 40
    assert len(pieces) >= 3  # the prefill's token, then calls of at most STEPS
    assert "".join(pieces) == model.last_result.text

