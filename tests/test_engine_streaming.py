"""Streaming that streams (issue 17): while a running request streams, the engine bounds each
decode-loop call to the steps that fit in its stream_interval_s at the measured time per step;
otherwise loop calls run their full length. Timed with a fake clock the fake executor advances,
so the chunk sizes are exact."""

from __future__ import annotations

import random

import pytest
import test_engine as fake
from test_xla_decode_loop import LoopFake

from rvcompile.runtime.engine import Request

STEP_S = 0.01  # fake seconds per loop step


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedLoop(LoopFake):
    """A loop of up to max_chunk steps, each STEP_S on the clock (+ `overhead_s` per call)."""

    decode_loop_steps = 8

    def __init__(self, clock: Clock, overhead_s: float = 0.0) -> None:
        super().__init__()
        self.clock, self.overhead_s = clock, overhead_s

    def decode_many(self, lanes):
        out = super().decode_many(lanes)
        self.clock.t += self.overhead_s + STEP_S * max(len(t) for t in out)
        return out




def _run(stream: list[bool], interval: float, overhead_s: float = 0.0, max_tokens: int = 40):
    clock = Clock()
    ex = TimedLoop(clock, overhead_s)
    eng = fake.engine(ex, stream_interval_s=interval, clock=clock)
    rng = random.Random(0)
    expected = {}
    for i, s in enumerate(stream):
        prompt = [rng.randrange(2, fake.VOCAB) for _ in range(5)]
        eng.add(Request(str(i), prompt, max_tokens, ignore_eos=True, stream=s))
        expected[str(i)] = fake.reference(prompt, max_tokens)
    outs = fake.drain(eng)
    for rid, want in expected.items():
        assert fake.tokens_of(outs[rid]) == want, rid  # bounding never changes the tokens
    fake.assert_pools_whole(eng)
    return {rid: [len(o.token_ids) for o in o_] for rid, o_ in outs.items()}


def test_unstreamed_loops_run_their_full_length():
    sizes = _run([False], interval=0.03)["0"]
    assert sizes == [1, 8, 8, 8, 8, 7]


def test_streamed_loops_fit_the_interval():
    """The first loop call (nothing measured yet) runs one step; then 0.03 s / 0.01 s = 3."""
    sizes = _run([True], interval=0.03)["0"]
    assert sizes[:2] == [1, 1] and set(sizes[2:-1]) == {3} and sum(sizes) == 40


def test_call_overhead_counts_in_the_interval():
    """A call costs 0.01 s + 0.01 s per step, the overhead measured as part of each step:
    calls grow from one step and settle at 3 (0.04 s; 4 would take the whole 0.05 s)."""
    sizes = _run([True], interval=0.05, overhead_s=0.01, max_tokens=55)["0"]
    assert sizes[:4] == [1, 1, 2, 2] and set(sizes[4:-1]) == {3}


def test_one_streamed_request_bounds_the_others():
    sizes = _run([False, True], interval=0.02)
    for rid in ("0", "1"):
        assert max(sizes[rid][2:]) == 2


@pytest.mark.parametrize("interval", [0.0, -1.0])
def test_interval_must_be_positive(interval):
    with pytest.raises(ValueError, match="stream_interval_s"):
        fake.engine(fake.FakeExecutor(), stream_interval_s=interval)
