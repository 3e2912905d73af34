"""Speculative decoding in the engine and scheduler on the CPU without a model (see test_engine's
fake executor): a fake that also verifies (every row's next token from the history its KV slots
hold, row i at RNG step step + i) and drafts (the target's token, or a wrong one, by a coin
hashed from the history; it checks that the state it starts from is the one the verify of the
row before its token returned). So a request's tokens come out right only if the engine keeps
exactly the accepted rows as cached, never reads a rejected row's KV, steps the RNG right and
keeps the right drafting state: through batching with plain sequences, preemption, recompute
and prefix hits.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from test_engine import (
    EOS,
    VOCAB,
    WINDOW,
    FakeExecutor,
    assert_pools_whole,
    drain,
    engine,
    next_token,
    random_prompt,
    reference,
    tokens_of,
)

from rvcompile.runtime.engine import Request
from rvcompile.runtime.executor_api import Drafted, Sampling, SeqChunk, Verified
from rvcompile.runtime.request_limits import RequestError
from rvcompile.runtime.speculative import Speculation, accepted, ngram_drafts

K = 3  # the fake's verify rows - 1


class SpecExecutor(FakeExecutor):
    """FakeExecutor with verify and (with a drafter) draft. `target` gives the token after a
    history: test_engine's hash by default, or a periodic rule (repetitive text)."""

    max_draft_tokens = K

    def __init__(self, full_blocks: int = 64, sliding_blocks: int = 16, *,
                 drafter: bool = True, period: int = 0, hit_rate: float = 0.7):
        super().__init__(full_blocks, sliding_blocks)
        self.has_drafter, self.period, self.hit_rate = drafter, period, hit_rate
        self.log: list[tuple[str, ...]] = []  # per call: the entry, then its lanes' rows
        self.lanes_drafted = self.lanes_with_probs = 0  # draft lanes; verify lanes with q
        self.calls_by_step: list[set[str]] = []  # entries called, per engine step (mixed())

    def target(self, history, sampling: Sampling, step: int) -> int:
        if self.period and len(history) > self.period:
            return history[-self.period]
        return next_token(history, sampling, step)

    def _history(self, chunk: SeqChunk) -> list[int]:
        """Write chunk's rows, then read back (and check) the whole history they attend."""
        for i, tok in enumerate(chunk.tokens):
            p = chunk.start + i
            for name, kind in self.kinds.items():
                self.slots[name][self._slot(kind, chunk.tables[name], p)] = (p, tok)
        end = chunk.start + len(chunk.tokens)
        return self._read(chunk, end, range(chunk.start, end))

    def _read(self, chunk: SeqChunk, end: int, queries: range) -> list[int]:
        """Positions [0, end) from the full KV, and the sliding window of each query (its
        keys before `end`), checked against them."""
        full, sliding = self.kinds["full"], self.kinds["sliding"]
        history = []
        for p in range(end):
            entry = self.slots["full"].get(self._slot(full, chunk.tables["full"], p))
            assert entry is not None and entry[0] == p, f"full KV at {p}: {entry}"
            history.append(entry[1])
        for q in queries:
            for p in range(max(0, q - WINDOW + 1), min(q + 1, end)):
                entry = self.slots["sliding"].get(self._slot(sliding, chunk.tables["sliding"],
                                                             p))
                assert entry == (p, history[p]), f"sliding KV at {p} for {q}: {entry}"
        return history

    def _run(self, chunk: SeqChunk) -> int:
        return self.target(self._history(chunk), chunk.sampling, chunk.step)

    def _called(self, *entry: str) -> None:
        self.log.append(entry)
        if self.calls_by_step:
            self.calls_by_step[-1].add(entry[0])

    def counting_steps(self, eng):
        """eng, its steps counted into calls_by_step."""
        step = eng.step

        def counted():
            self.calls_by_step.append(set())
            return step()

        eng.step = counted
        return eng

    def decode(self, lanes) -> list[int]:
        self._called("decode")
        return super().decode(lanes)

    def verify(self, lanes) -> list[Verified]:
        assert 0 < len(lanes) <= self.max_seqs
        assert all(1 <= len(c.tokens) <= K + 1 and c.rows == 0 for c in lanes)
        self._called("verify", *(str(len(c.tokens)) for c in lanes))
        out = []
        for c in lanes:
            if c.draft_probs is not None:  # its own draft's, for its drafts (a prefix of them)
                self.lanes_with_probs += 1
                assert c.draft_probs[0] == c.start and len(c.tokens) > 1
                assert tuple(c.tokens[1:]) == c.draft_probs[1][:len(c.tokens) - 1]
            history = self._history(c)
            n = c.start + 1
            tokens = [self.target(history[:n + i], c.sampling, c.step + i)
                      for i in range(len(c.tokens))]
            states = tuple(tuple(history[:n + i]) for i in range(len(c.tokens)))
            out.append(Verified(tokens, states if self.has_drafter else ()))
        return out

    def draft(self, lanes, n: int) -> list[Drafted]:
        assert self.has_drafter and 0 < len(lanes) <= self.max_seqs and 1 <= n <= K
        self._called("draft", str(n))
        self.lanes_drafted += len(lanes)
        out = []
        for lane in lanes:
            c = lane.chunk
            assert len(c.tokens) == 1
            history = self._read(c, c.start, range(c.start, c.start + 1))
            assert lane.state == tuple(history), "drafting from another row's state"
            history.append(c.tokens[0])
            drafts = []
            for i in range(n):
                right = self.target(history, c.sampling, c.step + i)
                coin = hashlib.sha256(repr(history).encode()).digest()[0] / 256
                drafts.append(right if coin < self.hit_rate else 2 + (right + 1) % (VOCAB - 2))
                history.append(drafts[-1])
            out.append(Drafted(drafts, None, None, (c.start, tuple(drafts))))
        return out


def periodic_reference(prompt: list[int], max_tokens: int, period: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_tokens:
        tokens.append(tokens[-period])
    return tokens[len(prompt):]


SPECS = [None, Speculation("ngram"), Speculation("assistant"), Speculation("assistant", 1)]


@pytest.mark.parametrize("full,sliding", [(64, 16), (16, 6), (64, 5)])
def test_mixed_speculative_traffic_matches_the_reference(full, sliding):
    """Plain, n-gram and assistant requests, greedy and sampled, arrive between steps with shared
    prefixes; tight pools force preemption. Every request gets exactly its reference tokens
    (speculation changes no token, sampled ones included), steps mix decode and verify calls,
    drafts are accepted and rejected, and the pools end whole."""
    rng = random.Random(full * 100 + sliding)
    ex = SpecExecutor(full, sliding)
    eng = ex.counting_steps(engine(ex))
    shared = [rng.randrange(2, VOCAB) for _ in range(13)]
    expected, outs, specs = {}, {}, {}
    for i in range(40):
        prompt = random_prompt(rng, shared, rng.randrange(0, 30))
        sampling = Sampling(0.8, 0, 1.0, rng.randrange(100)) if i % 3 == 0 else Sampling()
        max_tokens = rng.randrange(1, 64 - len(prompt))
        specs[str(i)] = SPECS[i % len(SPECS)]
        eng.add(Request(str(i), prompt, max_tokens, sampling, (), True,
                        speculation=specs[str(i)]))
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
        if specs[rid] is None:
            assert last.drafted_tokens == 0
    s = eng.stats()
    assert 0 < s.accepted < s.drafted and s.verify_calls > 0
    assert sum({"decode", "draft", "verify"} <= calls for calls in ex.calls_by_step) > 0
    assert (s.preemptions > 0) == ((full, sliding) != (64, 16))
    # every assistant draft reached its verify with its draft_probs; nothing else has any
    assert ex.lanes_with_probs == ex.lanes_drafted > 0
    assert_pools_whole(eng)


def test_assistant_round_structure():
    """Prefill, one verify without drafts (it yields the first state), then each round one
    draft call and one verify of the token and its K drafts; K stops short of max_tokens."""
    ex = SpecExecutor(hit_rate=1.0)
    eng = engine(ex)
    eng.add(Request("a", [3, 4, 5], 10, ignore_eos=True, speculation=Speculation("assistant")))
    outs = drain(eng)["a"]
    assert tokens_of(outs) == reference([3, 4, 5], 10)
    # 1 from prefill, 1 from the plain verify, then 4 per round: 4 + 4 = 10 (the last round's
    # verify has room for 3 drafts: 10 - 6 - 1)
    assert ex.log == [("verify", "1"), ("draft", "3"), ("verify", "4"), ("draft", "3"),
                      ("verify", "4")]
    assert (outs[-1].drafted_tokens, outs[-1].accepted_tokens) == (6, 6)
    assert [len(o.token_ids) for o in outs] == [1, 1, 4, 4]


def test_ngram_on_repetitive_text_accepts_every_draft():
    period = 5
    ex = SpecExecutor(period=period, drafter=False)
    eng = engine(ex)
    prompt = [2 + i % period * 7 for i in range(12)]
    eng.add(Request("r", prompt, 30, ignore_eos=True, speculation=Speculation("ngram")))
    outs = drain(eng)["r"]
    assert tokens_of(outs) == periodic_reference(prompt, 30, period)
    last = outs[-1]
    assert last.drafted_tokens == last.accepted_tokens > 0
    assert len([e for e in ex.log if e[0] == "verify"]) == 8  # 29 tokens, 4 a verify


def test_a_stop_inside_accepted_drafts_counts_only_tokens_up_to_it():
    """EOS among the accepted drafts ends the request there: its tokens, text and count are
    the plain run's."""
    period = 4
    prompt = [9, 8, EOS, 7] * 3
    runs = {}
    for spec in (None, Speculation("ngram")):
        eng = engine(SpecExecutor(period=period, drafter=False))
        eng.add(Request("r", prompt, 20, speculation=spec))
        runs[spec] = drain(eng)["r"]
        assert_pools_whole(eng)
    plain, spec = runs[None], runs[Speculation("ngram")]
    assert tokens_of(spec) == tokens_of(plain) == [9, 8]
    assert spec[-1].finish_reason == plain[-1].finish_reason == "stop"
    assert spec[-1].completion_tokens == plain[-1].completion_tokens == 3


def test_preempted_assistant_sequences_recompute_through_verify():
    """Tight full pool: sequences are preempted mid-generation; they come back, recompute their
    generated tokens but the last as verify rows (known tokens, no drafts), and draft on from
    their last token with the state they kept (the fake checks it is that row's): the round
    they would have run."""
    ex = SpecExecutor(full_blocks=16)
    eng = engine(ex)
    prompts = [[3 + i, 4, 5, 6, 7] for i in range(4)]
    for i, p in enumerate(prompts):
        eng.add(Request(str(i), p, 40, ignore_eos=True, speculation=Speculation("assistant")))
    outs = drain(eng)
    for i, p in enumerate(prompts):
        assert tokens_of(outs[str(i)]) == reference(p, 40)
    assert eng.stats().preemptions > 0
    recomputed = [e for e in ex.log if e[0] == "verify" and int(max(e[1:])) > 1]
    assert recomputed
    assert_pools_whole(eng)


def test_generated_blocks_are_not_shared_with_plain_sequences():
    """A speculating sequence's generated blocks are hashed as verify rows: a plain request
    whose prompt runs into them never hits them, and another verify sequence's recompute would."""
    ex = SpecExecutor(drafter=False, period=3)
    eng = engine(ex)
    prompt = [5, 6, 7] * 3
    eng.add(Request("s", prompt, 20, ignore_eos=True, speculation=Speculation("ngram")))
    drain(eng)
    recipe_plain = eng.scheduler.recipe(_seq(prompt, 0))
    recipe_spec = eng.scheduler.recipe(_seq(prompt, K + 1))
    assert recipe_plain(0) == recipe_spec(0)  # prompt blocks: the same recipe
    assert recipe_plain(3) != recipe_spec(3)  # generated ones: not
    assert_pools_whole(eng)


def _seq(prompt, verify_rows):
    from rvcompile.runtime.scheduler import Seq

    seq = Seq("x", list(prompt), Sampling(), 0, verify_rows=verify_rows)
    seq.output = [1] * 30
    return seq


def test_speculation_is_checked_at_add():
    plain = engine(FakeExecutor())
    with pytest.raises(RequestError, match="speculative: ngram: the artifact has no verify"):
        plain.add(Request("a", [3], 4, speculation=Speculation("ngram")))
    no_drafter = engine(SpecExecutor(drafter=False))
    with pytest.raises(RequestError, match="assistant: the artifact has no assistant drafter"):
        no_drafter.add(Request("a", [3], 4, speculation=Speculation("assistant")))
    eng = engine(SpecExecutor())
    for spec, needle in [(Speculation("medusa"), "speculative: expected one of assistant, ngram"),
                         (Speculation("ngram", 0), "num_draft_tokens: must be 1 to 3"),
                         (Speculation("ngram", 4), "num_draft_tokens: must be 1 to 3"),
                         (Speculation("ngram", True), "num_draft_tokens: expected an integer"),
                         ("ngram", "speculative: expected a Speculation")]:
        with pytest.raises(RequestError, match=needle):
            eng.add(Request("a", [3], 4, speculation=spec))
    assert eng.num_waiting() == 0


@pytest.mark.parametrize("tokens,k,want", [
    ([], 3, []),
    ([5], 3, []),
    ([1, 2, 3, 4], 3, []),  # the last token never occurred before
    ([1, 2, 3, 1], 3, [2, 3, 1]),
    ([1, 2, 9, 2, 3, 1, 2], 2, [9, 2]),  # "1 2" beats the more recent "2"
    ([7, 7, 7], 5, [7]),  # the longest earlier match "7 7" ends at 2: one token follows
    ([1, 2, 1, 2, 1, 2], 4, [1, 2]),
])
def test_ngram_drafts(tokens, k, want):
    assert ngram_drafts(tokens, k) == want


def test_accepted():
    assert accepted([4, 5, 6], [4, 5, 7, 8]) == 2
    assert accepted([4, 5, 6], [1, 5, 6, 8]) == 0
    assert accepted([], [3]) == 0
    assert accepted([4], [4, 9]) == 1
