"""The engine over a progressive decode loop (executor_api's "Progressive decode loop", issue 14):
decode_many hands each group's tokens over while the next group runs, and the engine turns them
into outputs at once. On the CPU with a fake executor whose loop runs group g + 1 before it hands
group g over (as the device does), and checks at every hand-over that no lane's blocks went back
to the pools during the call. Against the same engine over a loop that hands everything over at
its end: every request's tokens, text, finish reason and counts are the same; outputs reach the
caller while the call runs; a request that ends mid-call (stop string, EOS, length, abort) keeps
its blocks until the call returns; an arrival or an abort ends the call after the queued group.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import deque

import pytest
import test_engine as fake
from test_engine_streaming import STEP_S, Clock
from test_xla_decode_loop import LoopFake

from rvcompile.runtime.engine import EngineThread, Request
from rvcompile.runtime.executor_api import Sampling


class ProgressiveLoop(LoopFake):
    """LoopFake's loop, run in groups: group g + 1 is computed (its KV written) before group g's
    tokens go to progress, and a lane that sampled a stop id runs on to its budget, as on the
    device. `engine` (set by the test) is watched: its pools must keep every lane's blocks
    until the call returns. Each step moves `clock` (if any) on by STEP_S."""

    decode_loop_steps = 8
    loop_progress = True

    def __init__(self, *args, clock: Clock | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.clock, self.engine = clock, None
        self.groups: list[list[int]] = []  # per call: the steps of each group handed over
        self.in_call = False

    def decode_many(self, lanes, progress=None, group=0):
        assert 0 < len(lanes) <= self.max_seqs and group >= 0
        self.calls.append(("loop", len(lanes), 0))
        progress = progress or (lambda new: True)
        steps = max(lane.budget for lane in lanes)
        group = group or steps
        chunks = [lane.chunk for lane in lanes]
        out, ended = [[] for _ in lanes], [False] * len(lanes)
        sizes: list[int] = []
        self.groups.append(sizes)
        launched, queued = 0, deque()

        def launch() -> None:
            nonlocal launched
            n = min(group, steps - launched)
            rows = [[] for _ in lanes]
            for _ in range(n):
                for i, lane in enumerate(lanes):
                    if launched < lane.budget:  # a lane runs on to its budget
                        rows[i].append(self._run(chunks[i]))
                        chunks[i] = dataclasses.replace(
                            chunks[i], tokens=[rows[i][-1]], start=chunks[i].start + 1,
                            step=chunks[i].step + 1)
                launched += 1
                if self.clock is not None:
                    self.clock.t += STEP_S
            queued.append((n, rows))

        held = self._held(lanes)
        self.in_call = True
        try:
            launch()
            go_on = True
            while queued:
                if go_on and launched < steps:
                    launch()
                n, rows = queued.popleft()
                sizes.append(n)
                new = []
                for i, lane in enumerate(lanes):
                    tokens = []
                    for t in rows[i]:
                        if ended[i]:
                            break
                        tokens.append(t)
                        ended[i] = (len(out[i]) + len(tokens) == lane.budget
                                    or t in lane.stop_ids)
                    out[i] += tokens
                    new.append(tokens)
                go_on = go_on and not all(ended)
                if not progress(new):
                    go_on = False
                assert self._held(lanes) >= held, "a lane's blocks went back during the call"
        finally:
            self.in_call = False
        return out

    def _held(self, lanes) -> set[int]:
        """The full-attention blocks in the lanes' tables that the engine's pools hold: a
        sequence keeps them all until it is removed (sliding blocks that left every later
        token's window go back as the tokens come in, rightly: the device no longer reads them,
        nor writes them)."""
        if self.engine is None:
            return set()
        pool = self.engine.kv.pools["full"]
        return {int(b) for lane in lanes
                for b in lane.chunk.tables["full"][:-(-(lane.chunk.start + lane.budget) // fake.BS)]
                if pool.blocks[b].ref_count > 0}


def _traffic(ex, seed: int, deliver: bool):
    """Requests arriving between steps (streamed or not, greedy or seeded, with stop strings,
    EOS honoured or not); each request's outputs, and those delivered while a call ran."""
    rng = random.Random(seed)
    eng = fake.engine(ex, stream_interval_s=0.02, clock=getattr(ex, "clock", None) or Clock())
    ex.engine = eng
    outs: dict[str, list] = {}
    during: list = []

    def take(made):
        assert ex.in_call
        during.extend(made)
        for o in made:
            outs.setdefault(o.id, []).append(o)

    for i in range(16):
        prompt = [rng.randrange(2, fake.VOCAB) for _ in range(rng.randrange(1, 12))]
        sampling = Sampling(0.8, 0, 1.0, rng.randrange(100)) if i % 3 == 0 else Sampling()
        want = fake.reference(prompt, 30, sampling)
        stop = (str(want[rng.randrange(2, 20)]),) if i % 4 == 1 else ()
        eng.add(Request(str(i), prompt, rng.randrange(1, 30), sampling, stop,
                        ignore_eos=i % 2 == 0, stream=i % 5 != 0))
        for _ in range(rng.randrange(4)):
            for o in eng.step(deliver=take if deliver else None):
                outs.setdefault(o.id, []).append(o)
    while eng.has_work():
        for o in eng.step(deliver=take if deliver else None):
            outs.setdefault(o.id, []).append(o)
    fake.assert_pools_whole(eng)
    return outs, during


def _summary(outs):
    return {rid: (fake.tokens_of(o), "".join(x.text for x in o), o[-1].finish_reason,
                  o[-1].completion_tokens, [x.finished for x in o].count(True))
            for rid, o in outs.items()}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_progressive_loop_gives_what_the_plain_loop_gives(seed):
    plain, _ = _traffic(LoopFake(), seed, deliver=False)
    ex = ProgressiveLoop(clock=Clock())
    got, during = _traffic(ex, seed, deliver=True)
    assert _summary(got) == _summary(plain)
    assert during and any(len(sizes) > 1 for sizes in ex.groups)  # handed over mid-call
    assert all(s[-1] == 1 for s in _summary(got).values())  # each request finished once
    # without `deliver` the outputs join the step's return, the same again
    again, none = _traffic(ProgressiveLoop(clock=Clock()), seed, deliver=False)
    assert _summary(again) == _summary(plain) and not none


def _one_call(ex, requests, on_first=None, interval: float = 0.02):
    """Run `requests` through one engine until done; `on_first(eng)` runs at the first output
    delivered while a call ran. Returns the engine and each request's outputs."""
    eng = fake.engine(ex, stream_interval_s=interval, clock=ex.clock)
    ex.engine = eng
    outs: dict[str, list] = {}
    fired = []

    def take(made):
        for o in made:
            outs.setdefault(o.id, []).append(o)
        if made and not fired and on_first is not None:
            fired.append(True)
            on_first(eng)

    for r in requests:
        eng.add(r)
    while eng.has_work():
        for o in eng.step(deliver=take):
            outs.setdefault(o.id, []).append(o)
    fake.assert_pools_whole(eng)
    return eng, outs


def test_streamed_tokens_come_group_by_group_within_one_call():
    """Streamed at 0.04 s with steps of 0.01 s: after one measured call the groups are of 2
    steps (half the interval), all within calls of the lane's whole budget (8 steps)."""
    ex = ProgressiveLoop(clock=Clock())
    prompt = [5, 6, 7]
    _, outs = _one_call(ex, [Request("a", prompt, 20, ignore_eos=True, stream=True)],
                        interval=0.04)
    assert fake.tokens_of(outs["a"]) == fake.reference(prompt, 20)
    assert ex.groups[0] == [1] * 8  # before any measurement: one step a group
    assert ex.groups[1] == [2, 2, 2, 2]
    assert [len(o.token_ids) for o in outs["a"]] == [1] + [1] * 8 + [2] * 5 + [1]


def test_an_arrival_ends_the_call_after_the_queued_group():
    ex = ProgressiveLoop(clock=Clock())
    late = Request("b", [9, 9, 9], 6, ignore_eos=True)
    _, outs = _one_call(ex, [Request("a", [5, 6], 20, ignore_eos=True)],
                        on_first=lambda eng: eng.add(late))
    assert ex.groups[0] == [8]  # not streamed: the executor's groups (all 8 steps)
    assert fake.tokens_of(outs["a"]) == fake.reference([5, 6], 20)
    assert fake.tokens_of(outs["b"]) == fake.reference([9, 9, 9], 6)

    ex = ProgressiveLoop(clock=Clock())
    _, outs = _one_call(ex, [Request("a", [5, 6], 20, ignore_eos=True, stream=True)],
                        on_first=lambda eng: eng.add(late))
    assert ex.groups[0] == [1, 1]  # the group it was handed and the one queued behind it
    assert fake.tokens_of(outs["b"]) == fake.reference([9, 9, 9], 6)


def test_an_abort_mid_call_ends_the_request_and_its_blocks_wait_for_the_call():
    ex = ProgressiveLoop(clock=Clock())
    reqs = [Request(r, [5, i], 20, ignore_eos=True, stream=True) for i, r in enumerate("ab")]
    eng, outs = _one_call(ex, reqs, on_first=lambda eng: eng.abort("b"))
    assert outs["b"][-1].finish_reason == "abort"
    assert fake.tokens_of(outs["a"]) == fake.reference([5, 0], 20)
    want = fake.reference([5, 1], 20)
    assert fake.tokens_of(outs["b"]) == want[:len(fake.tokens_of(outs["b"]))]
    assert eng.stats().kv_used == {"full": 0, "sliding": 0}


def test_a_stop_string_mid_call_ends_its_request_alone():
    """The stop string shows in the 4th token: that request ends in the first full call (its
    lane runs on, its later tokens dropped, its blocks kept until the call returns); the
    other lane goes on."""
    ex = ProgressiveLoop(clock=Clock())
    want = fake.reference([3, 4], 20)
    stop = fake.text_of(want[3:4])
    assert stop not in fake.text_of(want[:3])
    reqs = [Request("s", [3, 4], 20, stop=(stop,), ignore_eos=True, stream=True),
            Request("o", [8, 9], 20, ignore_eos=True, stream=True)]
    _, outs = _one_call(ex, reqs)
    assert outs["s"][-1].finish_reason == "stop"
    assert fake.tokens_of(outs["s"]) == want[:4]
    assert outs["s"][-1].completion_tokens == 4
    assert stop not in "".join(o.text for o in outs["s"])
    assert fake.tokens_of(outs["o"]) == fake.reference([8, 9], 20)


def test_the_engine_thread_hands_outputs_over_while_the_call_runs():
    """Sinks get a loop's outputs during the call, and after_outputs follows each batch."""
    ex = ProgressiveLoop(clock=Clock())
    eng = fake.engine(ex, stream_interval_s=0.02, clock=ex.clock)
    ex.engine = eng
    seen, handed = [], []
    done = threading.Event()

    def sink(out):
        seen.append((ex.in_call, out))
        if out.finished:
            done.set()

    thread = EngineThread(eng, lambda: handed.append(ex.in_call))
    try:
        thread.submit(Request("a", [5, 6], 20, ignore_eos=True, stream=True), sink)
        assert done.wait(10)
    finally:
        thread.stop()
    assert fake.tokens_of([o for _, o in seen]) == fake.reference([5, 6], 20)
    assert sum(in_call for in_call, _ in seen) >= 8  # most tokens went out mid-call
    assert sum(handed) >= 8  # and were handed over then, batch by batch


def test_without_deliver_streamed_calls_are_cut_to_the_interval():
    """Model.generate_stream's case: outputs can only leave at the step's end, so a streamed
    request's loop calls run the steps that fit in the interval (0.03 s / 0.01 s = 3), as
    without a progressive loop; unstreamed ones run their whole budget in one call."""
    ex = ProgressiveLoop(clock=Clock())
    eng = fake.engine(ex, stream_interval_s=0.03, clock=ex.clock)
    eng.add(Request("a", [5, 6], 20, ignore_eos=True, stream=True))
    outs = fake.drain(eng)
    assert fake.tokens_of(outs["a"]) == fake.reference([5, 6], 20)
    assert [sum(g) for g in ex.groups][:3] == [1, 3, 3]
    ex = ProgressiveLoop(clock=Clock())
    eng = fake.engine(ex, stream_interval_s=0.03, clock=ex.clock)
    eng.add(Request("b", [5, 6], 20, ignore_eos=True))
    fake.drain(eng)
    assert [sum(g) for g in ex.groups] == [8, 8, 3]

