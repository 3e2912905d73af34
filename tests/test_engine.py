"""The engine and scheduler on the CPU without a model: a fake executor keeps a simulated paged KV
(each block slot holds the token written at its position), checks on every call that the block
tables show the sequence's true history (all of it for the full kind, the window for the sliding
kind), and returns a token hashed from that history, its sampling seed and step. So a request's
tokens come out right only if the engine fed it the right blocks: through batching, chunked
prefill, prefix hits, preemption and aborts.
"""

from __future__ import annotations

import hashlib
import random
import time

import numpy as np
import pytest

from rvcompile.runtime.engine import Engine, Request
from rvcompile.runtime.executor_api import DeviceError, KvKind, Sampling, SeqChunk
from rvcompile.runtime.request_limits import RequestError

BS, WINDOW, CONTEXT, VOCAB = 4, 6, 64, 500
EOS = 1


class FakeExecutor:
    prefill_buckets = (4, 8)
    max_chunk = 8
    max_context = CONTEXT
    max_seqs = 4
    block_size = BS

    def __init__(self, full_blocks: int = 64, sliding_blocks: int = 16):
        self.kinds = {"full": KvKind("full", CONTEXT // BS, False, None, full_blocks),
                      "sliding": KvKind("sliding", 4, True, WINDOW, sliding_blocks)}
        self.slots = {name: {} for name in self.kinds}  # kind -> (block, offset) -> (pos, tok)
        self.calls: list[tuple[str, int, int]] = []  # (entry, start, tokens)

    def _slot(self, kind: KvKind, table, pos: int) -> tuple[int, int]:
        s = pos % (kind.table_width * BS) if kind.ring else pos
        return table[s // BS], s % BS

    def _run(self, chunk: SeqChunk) -> int:
        for i, tok in enumerate(chunk.tokens):
            p = chunk.start + i
            for name, kind in self.kinds.items():
                self.slots[name][self._slot(kind, chunk.tables[name], p)] = (p, tok)
        end = chunk.start + len(chunk.tokens)
        full = self.kinds["full"]
        history = []
        for p in range(end):
            entry = self.slots["full"].get(self._slot(full, chunk.tables["full"], p))
            assert entry is not None and entry[0] == p, f"full KV at {p}: {entry}"
            history.append(entry[1])
        sliding = self.kinds["sliding"]
        for q in range(chunk.start, end):  # every query's window
            for p in range(max(0, q - WINDOW + 1), q + 1):
                entry = self.slots["sliding"].get(self._slot(sliding, chunk.tables["sliding"],
                                                             p))
                assert entry == (p, history[p]), f"sliding KV at {p} for {q}: {entry}"
        return next_token(history, chunk.sampling, chunk.step)

    def prefill(self, chunk: SeqChunk) -> int:
        assert chunk.rows in self.prefill_buckets and 0 < len(chunk.tokens) <= chunk.rows
        self.calls.append(("prefill", chunk.start, len(chunk.tokens)))
        return self._run(chunk)

    def decode(self, lanes) -> list[int]:
        assert 0 < len(lanes) <= self.max_seqs
        assert all(len(c.tokens) == 1 and c.rows == 0 for c in lanes)
        self.calls.append(("decode", len(lanes), 0))
        return [self._run(c) for c in lanes]

    def logits(self, chunk: SeqChunk) -> np.ndarray:
        raise NotImplementedError


def next_token(history, sampling: Sampling, step: int) -> int:
    key = repr((history, sampling.seed, step) if sampling.temperature > 0 else history)
    return 2 + int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % (VOCAB - 2)


GREEDY = Sampling()


def reference(prompt: list[int], max_tokens: int, sampling: Sampling = GREEDY) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(next_token(tokens, sampling, len(out)))
        tokens.append(out[-1])
    return out


def text_of(ids) -> str:
    return " ".join(map(str, ids))


def engine(ex: FakeExecutor, **kw) -> Engine:
    return Engine(ex, text_of, frozenset([EOS]), vocab_size=VOCAB, **kw)


def drain(eng: Engine, max_steps: int = 5000) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not eng.has_work():
            return outs
        for o in eng.step():
            outs.setdefault(o.id, []).append(o)
    raise AssertionError("the engine did not finish")


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def assert_pools_whole(eng: Engine) -> None:
    s = eng.stats()
    assert s.running == s.waiting == 0
    assert s.kv_used == {"full": 0, "sliding": 0}
    for pool in eng.kv.pools.values():
        assert all(b.ref_count == 0 for b in pool.blocks)


def random_prompt(rng, shared, n) -> list[int]:
    body = [rng.randrange(2, VOCAB) for _ in range(n)]
    return (shared + body) if rng.random() < 0.5 else body or [7]


@pytest.mark.parametrize("full,sliding", [(64, 16), (16, 6), (20, 16), (64, 5)])
def test_random_traffic_matches_the_reference(full, sliding):
    """Requests arrive between steps with shared prefixes and mixed sampling; tight pools force
    preemption. Every request gets exactly its reference tokens; the pools end whole."""
    rng = random.Random(full * 100 + sliding)
    ex = FakeExecutor(full, sliding)
    eng = engine(ex)
    shared = [rng.randrange(2, VOCAB) for _ in range(13)]
    expected, outs = {}, {}
    for i in range(40):
        prompt = random_prompt(rng, shared, rng.randrange(0, 30))
        sampling = Sampling(0.8, 0, 1.0, rng.randrange(100)) if i % 3 == 0 else Sampling()
        max_tokens = rng.randrange(1, CONTEXT - len(prompt))
        eng.add(Request(str(i), prompt, max_tokens, sampling, (), True))
        expected[str(i)] = reference(prompt, max_tokens, sampling)
        for _ in range(rng.randrange(3)):
            for o in eng.step():
                outs.setdefault(o.id, []).append(o)
    for rid, more in drain(eng).items():
        outs.setdefault(rid, []).extend(more)
    for rid, want in expected.items():
        assert tokens_of(outs[rid]) == want, rid
        last = outs[rid][-1]
        assert last.finished and last.finish_reason == "length"
        assert last.completion_tokens == len(want)
        assert not any(o.finished for o in outs[rid][:-1])
    s = eng.stats()
    assert s.prefix_hit > 0
    if (full, sliding) == (64, 16):
        assert s.preemptions == 0
    else:  # tight pools: sequences were preempted and recomputed
        assert s.preemptions > 0
    assert_pools_whole(eng)


def test_shared_prefix_is_prefilled_once():
    ex = FakeExecutor()
    eng = engine(ex)
    system = list(range(100, 124))  # 24 tokens: 6 blocks
    eng.add(Request("a", system + [5, 6], 3, ignore_eos=True))
    drain(eng)
    ex.calls.clear()
    eng.add(Request("b", system + [7, 8, 9], 3, ignore_eos=True))
    outs = drain(eng)
    prefilled = sum(n for entry, _, n in ex.calls if entry == "prefill")
    assert outs["b"][-1].cached_tokens == 24 and prefilled == 3
    assert tokens_of(outs["b"]) == reference(system + [7, 8, 9], 3)


@pytest.mark.parametrize("budget,per_step", [(None, 1), (24, 3)])
def test_prefill_budget_sets_the_prompts_admitted_per_step(budget, per_step):
    ex = FakeExecutor()
    eng = engine(ex, prefill_budget=budget)
    prompts = [[10 + i] * 8 for i in range(3)]  # one 8-token chunk each (max_chunk 8)
    for i, p in enumerate(prompts):
        eng.add(Request(f"r{i}", p, 2, ignore_eos=True))
    outs: dict[str, list] = {}
    for o in eng.step():
        outs.setdefault(o.id, []).append(o)
    assert sum(entry == "prefill" for entry, _, _ in ex.calls) == per_step
    for rid, more in drain(eng).items():
        outs.setdefault(rid, []).extend(more)
    for i, p in enumerate(prompts):  # the same tokens whatever the budget
        assert tokens_of(outs[f"r{i}"]) == reference(p, 2)


def test_step_time_splits_into_executor_calls_and_host_work(monkeypatch):
    ex = FakeExecutor()
    slow_decode = ex.decode

    def decode(lanes):
        time.sleep(0.02)
        return slow_decode(lanes)

    monkeypatch.setattr(ex, "decode", decode)
    eng = engine(ex)
    eng.add(Request("a", [5, 6, 7], 4, ignore_eos=True))
    drain(eng)
    s = eng.stats()
    decodes = sum(entry == "decode" for entry, _, _ in ex.calls)
    assert decodes == 3  # the prefill samples the first token
    assert 0.02 * decodes <= s.executor_s <= s.step_s
    assert s.step_s - s.executor_s < 0.02 * decodes  # the engine's own work is small here


def test_long_prompt_does_not_stall_running_streams():
    ex = FakeExecutor()
    eng = engine(ex)
    eng.add(Request("stream", [3, 4, 5], 40, ignore_eos=True))
    drain_steps = 0
    while not any(e == "decode" for e, *_ in ex.calls):
        eng.step()
        drain_steps += 1
    eng.add(Request("long", list(range(200, 250)), 4, ignore_eos=True))  # 7 chunks of 8
    per_step = []
    for _ in range(7):
        outs = eng.step()
        per_step.append([o.id for o in outs])
    assert all("stream" in ids for ids in per_step)  # a token every step meanwhile
    assert sum(e == "prefill" and s >= 0 and n > 0 for e, s, n in ex.calls) >= 7


def test_stop_strings_eos_and_max_tokens():
    prompt = [3, 4, 5]
    ids = reference(prompt, 10)
    # Stop at " <4th token> ": found once the 5th token's text follows; the text ends before
    # it, and the tokens generated up to then are all reported.
    stop = f" {ids[3]} "
    eng = engine(FakeExecutor())
    eng.add(Request("s", prompt, 10, stop=(stop,), ignore_eos=True))
    eng.add(Request("m", prompt, 5, ignore_eos=True))
    outs = drain(eng)
    text = "".join(o.text for o in outs["s"])
    assert text == text_of(ids[:3])
    assert outs["s"][-1].finish_reason == "stop"
    assert tokens_of(outs["s"]) == ids[:5]
    assert outs["m"][-1].finish_reason == "length" and tokens_of(outs["m"]) == ids[:5]
    # EOS ends a request (excluded from its tokens, counted in its usage) unless ignored.
    ex = FakeExecutor()
    eng = engine(ex)
    eng.eos_ids = frozenset([ids[2]])
    eng.add(Request("e", prompt, 10))
    outs = drain(eng)
    assert tokens_of(outs["e"]) == ids[:2]
    assert outs["e"][-1].finish_reason == "stop" and outs["e"][-1].completion_tokens == 3
    assert_pools_whole(eng)


def test_abort_frees_blocks_at_the_next_step():
    eng = engine(FakeExecutor())
    eng.add(Request("a", list(range(2, 30)), 30, ignore_eos=True))
    eng.add(Request("w", [5, 6], 30, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert eng.stats().kv_used["full"] > 0
    eng.abort("a")
    eng.abort("w")
    eng.abort("unknown")  # ignored
    outs = eng.step()
    assert {o.id: o.finish_reason for o in outs} == {"a": "abort", "w": "abort"}
    assert_pools_whole(eng)


def test_sliding_layers_hold_only_their_window():
    ex = FakeExecutor()
    eng = engine(ex)
    eng.add(Request("long", [3, 4], CONTEXT - 2, ignore_eos=True))
    most = 0
    while eng.has_work():
        eng.step()
        most = max(most, eng.stats().kv_used["sliding"])
    # the window (6 tokens) behind the next token spans at most 3 blocks of 4
    assert most <= 3


def test_requests_that_cannot_run_are_refused():
    eng = engine(FakeExecutor())
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        eng.add(Request("x", list(range(2, 40)), 30))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add(Request("x", [], 3))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine(FakeExecutor(), max_num_seqs=5)
    with pytest.raises(ValueError, match="max_model_len"):
        engine(FakeExecutor(), max_model_len=CONTEXT + 1)
    with pytest.raises(ValueError, match="15 full KV blocks cannot hold one sequence"):
        engine(FakeExecutor(full_blocks=15))
    engine(FakeExecutor(full_blocks=8), max_model_len=32)  # a shorter limit needs fewer


def _two_requests_through_a_thread(ex, events: list[tuple[str, int]], max_tokens: int):
    """Requests "a" and "b" (`max_tokens` each) through an EngineThread over `ex`, its sinks and
    after_outputs recording ("out", tokens) and ("flush", 0) in `events`; the thread, stopped
    once "b" finished and the last flush came."""
    import threading

    from rvcompile.runtime.engine import EngineThread

    done = threading.Event()

    def sink(out):
        events.append(("out", len(out.token_ids)))
        if out.finished and out.id == "b":
            done.set()

    thread = EngineThread(engine(ex), lambda: events.append(("flush", 0)))
    try:
        thread.submit(Request("a", [3, 4, 5], max_tokens, ignore_eos=True), sink)
        thread.submit(Request("b", [6, 7], max_tokens, ignore_eos=True), sink)
        assert done.wait(10)
        for _ in range(100):  # the last flush follows the last step's sinks
            if events[-1][0] == "flush":
                break
            threading.Event().wait(0.01)
    finally:
        thread.stop()
    return thread


def test_engine_thread_hands_over_each_steps_outputs_once():
    """after_outputs runs once after each step that gave outputs, after that step's sinks (the
    server hands a step's outputs to its event loop there, in one wake-up)."""
    events: list[tuple[str, int]] = []
    thread = _two_requests_through_a_thread(FakeExecutor(), events, 4)
    kinds = "".join("f" if k == "flush" else "o" for k, _ in events)
    runs = kinds.split("f")[:-1]  # the outputs before each flush
    assert kinds.startswith("o") and kinds.endswith("f") and "ff" not in kinds
    assert len(runs) <= thread.engine.steps
    assert max(map(len, runs)) == 2  # both requests' outputs of a step, then one flush


class HandoffExecutor(FakeExecutor):
    """FakeExecutor with executor_api's "Handoff": each call calls while_running (once) right
    after its launch; events record launches, their ends and the engine thread's flushes."""

    while_running = None

    def __init__(self, events: list[tuple[str, int]]):
        super().__init__()
        self.events = events

    def _launched(self) -> None:
        self.events.append(("launch", 0))
        if self.while_running is not None:
            handoff, self.while_running = self.while_running, None
            handoff()

    def prefill(self, chunk: SeqChunk) -> int:
        self._launched()
        token = super().prefill(chunk)
        self.events.append(("done", 0))
        return token

    def decode(self, lanes) -> list[int]:
        self._launched()
        tokens = super().decode(lanes)
        self.events.append(("done", 0))
        return tokens


def test_engine_thread_hands_outputs_over_while_the_next_call_runs():
    """With an executor that offers the handoff, a step's after_outputs runs inside the next
    step's first call, right after its launch (the event loop's work overlaps the device), and
    after the last step at once: every output is handed over, each step's once."""
    events: list[tuple[str, int]] = []
    _two_requests_through_a_thread(HandoffExecutor(events), events, 5)
    kinds = [k for k, _ in events]
    flushes = [i for i, k in enumerate(kinds) if k == "flush"]
    assert kinds[-1] == "flush" and len(flushes) >= 3
    assert all(kinds[i - 1] == "launch" for i in flushes[:-1])  # inside the next call
    outs = [i for i, k in enumerate(kinds) if k == "out"]
    assert all(any(f > i for f in flushes) for i in outs)  # every output handed over
    # one flush per step that gave outputs: none twice for the same outputs
    between = "".join("f" if k == "flush" else "o" if k == "out" else "" for k in kinds)
    assert "ff" not in between and between.startswith("o")


def test_engine_thread_delivers_outputs_aborts_and_fails_cleanly():
    import threading

    from rvcompile.runtime.engine import EngineThread

    thread = EngineThread(engine(FakeExecutor()))
    got: dict[str, list] = {"a": [], "b": []}
    done = {k: threading.Event() for k in got}

    def sink(out):
        got[out.id].append(out)
        if out.id == "b" and len(got["b"]) == 2:
            thread.abort("b")  # from the engine thread itself, mid-stream
        if out.finished:
            done[out.id].set()

    try:
        thread.submit(Request("a", [3, 4, 5], 6, ignore_eos=True), sink)
        thread.submit(Request("b", [6, 7], 50, ignore_eos=True), sink)
        assert done["a"].wait(10) and done["b"].wait(10)
        assert tokens_of(got["a"]) == reference([3, 4, 5], 6)
        assert got["b"][-1].finish_reason == "abort" and len(got["b"]) < 6
        with pytest.raises(ValueError):
            thread.submit(Request("c", [], 3), sink)
        # An executor failure ends the requests of its call with "error"; the engine serves on.
        decode = thread.engine.executor.decode
        thread.engine.executor.decode = lambda lanes: 1 / 0
        got["d"], done["d"] = [], threading.Event()
        thread.submit(Request("d", [3], 5, ignore_eos=True), sink)
        assert done["d"].wait(10)
        assert got["d"][-1].finish_reason == "error" and "ZeroDivisionError" in got["d"][-1].error
        assert thread.error == ""
        assert_pools_whole(thread.engine)
        thread.engine.executor.decode = decode
        got["e"], done["e"] = [], threading.Event()
        thread.submit(Request("e", [3, 4], 5, ignore_eos=True), sink)
        assert done["e"].wait(10) and tokens_of(got["e"]) == reference([3, 4], 5)
        # A device error loses the engine: every request ends, new ones are refused, and
        # `error` says why.
        thread.engine.executor.decode = _raise(DeviceError("CUDA_ERROR_ILLEGAL_ADDRESS"))
        got["f"], done["f"] = [], threading.Event()
        thread.submit(Request("f", [3], 5, ignore_eos=True), sink)
        assert done["f"].wait(10) and got["f"][-1].finish_reason == "error"
        assert "ILLEGAL_ADDRESS" in got["f"][-1].error and "ILLEGAL_ADDRESS" in thread.error
        with pytest.raises(RuntimeError, match="ILLEGAL_ADDRESS"):
            thread.submit(Request("g", [3], 5), sink)
        assert_pools_whole(thread.engine)
    finally:
        thread.stop()


def _raise(error: Exception):
    def call(*_):
        raise error

    return call


POISON, BAD_TEXT = 13, 17


class FailingExecutor(FakeExecutor):
    """Raises in the calls that run the token POISON."""

    def prefill(self, chunk: SeqChunk) -> int:
        if POISON in chunk.tokens:
            raise RuntimeError("prefill exploded")
        return super().prefill(chunk)

    def decode(self, lanes) -> list[int]:
        if any(POISON in c.tokens for c in lanes):
            raise RuntimeError("decode exploded")
        return super().decode(lanes)


def _prompt_for_first_token(token: int) -> list[int]:
    """A prompt whose greedy first generated token is `token` (searched)."""
    for a in range(2, VOCAB):
        for b in range(2, VOCAB):
            if reference([a, b], 1) == [token]:
                return [a, b]
    raise AssertionError("no such prompt")


def test_a_failed_call_fails_only_its_sequences_and_the_engine_serves_on():
    """A prefill that raises ends its request; a decode that raises ends the requests of that
    call, not those prefilling in the same step; a detokenizer that raises ends its one
    request. Each gets finish_reason "error" with the reason, its blocks go back, and every
    other request, running meanwhile or sent after, gets exactly its reference tokens."""
    ex = FailingExecutor()

    def text(ids):  # a detokenizer that cannot take BAD_TEXT
        if BAD_TEXT in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
        return text_of(ids)

    eng = engine(ex)
    eng._decode = text
    long = list(range(20, 40))  # three prefill chunks

    def run(bad: Request, good: Request, reason: str) -> None:
        eng.add(bad)
        eng.add(good)
        outs = drain(eng)
        assert outs[bad.id][-1].finish_reason == "error" and reason in outs[bad.id][-1].error
        assert outs[bad.id][-1].token_ids == [] and len(outs[bad.id]) <= 2
        assert tokens_of(outs[good.id]) == reference(good.prompt_ids, good.max_tokens)
        assert outs[good.id][-1].finish_reason == "length"
        assert_pools_whole(eng)

    run(Request("bad-prefill", [2, POISON, 4], 12, ignore_eos=True),
        Request("ok1", [3, 4, 5], 12, ignore_eos=True), "prefill exploded")
    # Its first generated token is POISON: its first decode call raises while the long
    # prompt's chunks prefill in the same steps.
    run(Request("bad-decode", _prompt_for_first_token(POISON), 12, ignore_eos=True),
        Request("ok2", long, 12, ignore_eos=True), "decode exploded")
    assert BAD_TEXT not in reference([6, 7], 12)
    run(Request("bad-text", _prompt_for_first_token(BAD_TEXT), 12, ignore_eos=True),
        Request("ok3", [6, 7], 12, ignore_eos=True), "UnicodeDecodeError")
    # The decode call's other lanes go with it.
    eng.add(Request("ok4", [8, 9], 12, ignore_eos=True))
    eng.step()
    eng.step()  # ok4 decodes
    eng.add(Request("bad-decode-2", _prompt_for_first_token(POISON), 12, ignore_eos=True))
    outs = drain(eng)
    assert {rid: o[-1].finish_reason for rid, o in outs.items()} == {"ok4": "error",
                                                                   "bad-decode-2": "error"}
    assert_pools_whole(eng)
    eng.add(Request("ok5", long, 12, ignore_eos=True))
    assert tokens_of(drain(eng)["ok5"]) == reference(long, 12)


def test_device_error_leaves_the_step():
    """Only a DeviceError escapes step(): the caller (EngineThread) then stops the engine."""
    ex = FakeExecutor()
    eng = engine(ex)
    eng.add(Request("a", [3, 4], 5, ignore_eos=True))
    ex.prefill = _raise(DeviceError("lost"))
    with pytest.raises(DeviceError):
        eng.step()
    outs = eng.fail_all("the device failed: lost")
    assert [(o.id, o.finish_reason) for o in outs] == [("a", "error")]
    assert_pools_whole(eng)


def test_bad_requests_are_refused_at_add_and_never_reach_a_step():
    eng = engine(FakeExecutor())
    eng.add(Request("ok", [3, 4], 4, ignore_eos=True))
    for bad, param in ((Request("x", [3], 4, Sampling(top_k=2**31)), "top_k"),
                       (Request("x", [3], 4, Sampling(top_k=VOCAB + 1)), "top_k"),
                       (Request("x", [3], 4, Sampling(temperature=float("nan"))), "temperature"),
                       (Request("x", [3], 4, Sampling(temperature=float("inf"))), "temperature"),
                       (Request("x", [3], 4, Sampling(seed=2**64)), "seed"),
                       (Request("x", [3, VOCAB], 4), "prompt"),
                       (Request("x", [3], 4, stop=("",)), "stop"),
                       (Request("x", [3], 4, ignore_eos="yes"), "ignore_eos")):
        with pytest.raises(RequestError) as e:
            eng.add(bad)
        assert e.value.param == param
    assert tokens_of(drain(eng)["ok"]) == reference([3, 4], 4)
    assert_pools_whole(eng)
