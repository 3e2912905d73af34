"""The engine's pipelined grammar masks (engine.py, constraints.Grammars.start) on the CPU
without a model: test_engine's fake executor, given a sampler that applies the token mask (it
picks the token from the allowed ones by a hash of the history, seed and step), over the
default model's tokenizer and llguidance. The reference runs each request alone, one token at
a time, with its masks computed synchronously by a fresh matcher; so a mask that is stale (not
yet advanced by the last token), belongs to another lane, or is missing changes the tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from test_engine import EOS, FakeExecutor, assert_pools_whole, drain, text_of, tokens_of

from rvcompile.runtime.constraints import Constraint, Grammars
from rvcompile.runtime.engine import Engine, Request
from rvcompile.runtime.executor_api import Sampled, SampleExtras, Sampling, SeqChunk

pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")

TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny" / "tokenizer.json"
VOCAB = 8192
GRAMMARS = (Constraint.regex(r"[0-9]{3}"),
            Constraint.lark('start: "call(" NAME ")"\nNAME: /[a-z]{1,5}/'),
            Constraint.json_schema({"enum": ["yes", "no", 7]}),
            Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"], "additionalProperties": False}),
            Constraint.json_schema({"type": "string", "minLength": 30, "maxLength": 40}))


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(tokenizers.Tokenizer.from_file(str(TOKENIZER)), VOCAB, frozenset([EOS]))


def allowed(mask: np.ndarray | None) -> np.ndarray:
    """The token ids a mask allows (every id past EOS without one)."""
    if mask is None:
        return np.arange(2, VOCAB)
    bits = (mask.astype(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.flatnonzero(bits.reshape(-1)[:VOCAB])


def pick(history: list[int], sampling: Sampling, step: int, mask: np.ndarray | None) -> int:
    """The fake sampler: a token the mask allows, chosen by the history (and, sampling, the
    seed and step)."""
    key = repr((history, sampling.seed, step) if sampling.temperature > 0 else history)
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
    ids = allowed(mask)
    return int(ids[h % len(ids)])


class MaskingExecutor(FakeExecutor):
    """FakeExecutor (its KV checks) with a sampler that takes SampleExtras' token mask."""

    top_logprobs = 1

    def __init__(self, *args, ignore_mask_seed: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.ignore_mask_seed = ignore_mask_seed  # a lane of this seed samples unmasked

    def _sample(self, chunk: SeqChunk) -> Sampled:
        self._run(chunk)  # writes the chunk's KV and checks the tables' history
        full = self.kinds["full"]
        end = chunk.start + len(chunk.tokens)
        history = [self.slots["full"][self._slot(full, chunk.tables["full"], p)][1]
                   for p in range(end)]
        extras = chunk.extras or SampleExtras()
        mask = None if chunk.sampling.seed == self.ignore_mask_seed else extras.mask
        return Sampled(pick(history, chunk.sampling, chunk.step, mask))

    def prefill_sampled(self, chunk: SeqChunk) -> Sampled:
        assert chunk.rows in self.prefill_buckets and 0 < len(chunk.tokens) <= chunk.rows
        self.calls.append(("prefill", chunk.start, len(chunk.tokens)))
        return self._sample(chunk)

    def decode_sampled(self, lanes) -> list[Sampled]:
        assert 0 < len(lanes) <= self.max_seqs
        self.calls.append(("decode", len(lanes), 0))
        return [self._sample(c) for c in lanes]

    def prefill(self, chunk: SeqChunk) -> int:
        return self.prefill_sampled(chunk).token

    def decode(self, lanes) -> list[int]:
        return [s.token for s in self.decode_sampled(lanes)]


class LateMaskExecutor(MaskingExecutor):
    """MaskingExecutor that also takes late masks (executor_api's "Late masks"): a decode call
    records "forward" (its forward pass launched), then asks for the masks, then samples each
    lane under them. `on_forward` (a test's) runs when the forward pass is launched;
    `fail_sampler`: the call raises after the masks were given (the device's sampler failed)."""

    late_masks = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.events: list[str] = []
        self.on_forward = None
        self.fail_sampler = False

    def decode_late_masks(self, lanes, masks) -> list[Sampled]:
        assert 0 < len(lanes) <= self.max_seqs
        self.events.append("forward")
        if self.on_forward is not None:
            self.on_forward()
        got = masks()
        self.events.append("masks")
        assert len(got) == len(lanes)
        if self.fail_sampler:
            raise RuntimeError("the sampler broke")
        lanes = [dataclasses.replace(c, extras=dataclasses.replace(
            c.extras or SampleExtras(), mask=m)) for c, m in zip(lanes, got, strict=True)]
        return self.decode_sampled(lanes)


class MaskedLoopExecutor(LateMaskExecutor):
    """LateMaskExecutor with a masked decode loop (executor_api's "Masked decode loop") run as
    the device runs it: a step samples every lane with budget left (a lane that sampled a stop
    id runs on), each under the mask masks() gave for it after the step before ("forward",
    then "masks", then "progress" in events); progress returning False stops the loop after
    the step already launched. Its plain loop is the masked one without masks."""

    decode_loop_steps = 6
    decode_loop_stops = 4
    loop_progress = True
    masked_loop = True

    def decode_many(self, lanes, progress=None, group=0):
        return self.decode_many_masked(lanes, lambda new: [None] * len(lanes), progress)

    def decode_many_masked(self, lanes, masks, progress=None):
        assert 0 < len(lanes) <= self.max_seqs
        self.calls.append(("masked loop", len(lanes), 0))
        steps = max(lane.budget for lane in lanes)
        chunks = [lane.chunk for lane in lanes]
        given = [c.extras.mask if c.extras else None for c in chunks]
        out, ended = [[] for _ in lanes], [False] * len(lanes)
        step, go_on = 0, True
        while True:
            self.events.append("forward")
            new = []
            for i, lane in enumerate(lanes):
                tokens = []
                if step < lane.budget:
                    c = chunks[i]
                    token = self._sample(dataclasses.replace(c, extras=dataclasses.replace(
                        c.extras or SampleExtras(), mask=given[i]))).token
                    chunks[i] = dataclasses.replace(c, tokens=[token], start=c.start + 1,
                                                    step=c.step + 1)
                    if not ended[i]:
                        tokens = [token]
                out[i] += tokens
                ended[i] = ended[i] or len(out[i]) == lane.budget or bool(
                    tokens and tokens[-1] in lane.stop_ids)
                new.append(tokens)
            given = list(masks(new))
            self.events.append("masks")
            assert len(given) == len(lanes)
            step += 1
            launched = go_on and step < steps and not all(ended)
            self.events.append("progress")
            if progress is not None and not progress(new):
                go_on = False
            if not launched:
                return out


EXECUTORS = {"masks before": MaskingExecutor, "late masks": LateMaskExecutor,
             "masked loop": MaskedLoopExecutor}


def engine(grammars: Grammars, ex: MaskingExecutor) -> Engine:
    return Engine(ex, text_of, frozenset([EOS]), vocab_size=VOCAB, grammars=grammars)


def reference(grammars: Grammars, r: Request) -> list[int]:
    """r's tokens alone, one at a time, each sampled under its grammar's mask computed then."""
    matcher = grammars.matcher(grammars.check(r.constraint)) if r.constraint else None
    history, out = list(r.prompt_ids), []
    while len(out) < r.max_tokens:
        mask = grammars.fill([matcher])[0] if matcher else None
        token = pick(history, r.sampling, len(out), mask)
        if token == EOS:
            break
        out.append(token)
        history.append(token)
        if matcher:
            matcher.consume(token)
            if matcher.done:
                break
    return out


def test_a_mask_job_gives_fill_s_rows_from_the_worker(grammars):
    """Grammars.start: the rows fill gives for the same matchers, computed on the worker."""
    ms = [grammars.matcher(grammars.check(c)) for c in GRAMMARS]
    ms[1].consume(int(allowed(grammars.fill([ms[1]])[0])[0]))
    job = grammars.start(ms)
    rows, seconds = job.result()
    np.testing.assert_array_equal(rows, grammars.fill(ms))
    assert rows.shape == (len(GRAMMARS), VOCAB // 32) and seconds > 0
    assert grammars.start([]).result()[0].shape == (0, VOCAB // 32)


def random_request(rng: random.Random, i: int) -> Request:
    prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 20))]
    sampling = Sampling(1.0, 0, 1.0, rng.randrange(1000)) if rng.random() < 0.7 else Sampling()
    constraint = rng.choice(GRAMMARS) if rng.random() < 0.6 else None
    return Request(f"r{i}", prompt, rng.randrange(1, 40), sampling, constraint=constraint)


@pytest.mark.parametrize("kind", sorted(EXECUTORS))
@pytest.mark.parametrize("full,sliding", [(64, 16), (16, 6)])
def test_constrained_and_free_lanes_in_one_batch_give_their_reference_tokens(grammars, full,
                                                                              sliding, kind):
    """Requests join between steps, constrained (five grammars) and free side by side in the
    decode batch; tight pools preempt and recompute some. Each request's tokens are exactly
    those it gives alone with synchronous masks, and the masks were pipelined (and, where the
    executor takes them late, handed over in the decode calls)."""
    rng = random.Random(full)
    ex = EXECUTORS[kind](full, sliding)
    eng = engine(grammars, ex)
    pending = [random_request(rng, i) for i in range(24)]
    outs: dict[str, list] = {}
    while pending or eng.has_work():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                eng.add(pending.pop(0))
        for o in eng.step():
            outs.setdefault(o.id, []).append(o)
    rng = random.Random(full)
    for r in [random_request(rng, i) for i in range(24)]:
        assert tokens_of(outs[r.id]) == reference(grammars, r), r.id
        assert outs[r.id][-1].finish_reason in ("stop", "length")
    assert eng.mask_rows > 0
    assert_pools_whole(eng)
    if full == 16:
        assert eng.preemptions > 0
    if kind != "masks before":
        assert ex.events.count("masks") > 10 and eng.stats().mask_late_wait_s > 0
    if kind == "masked loop":  # constrained lanes kept the loop
        assert any(c[0] == "masked loop" for c in ex.calls)


def test_masks_of_decoding_sequences_come_from_the_worker(grammars, monkeypatch):
    """A constrained sequence's first mask is computed in the step that needs it; every later
    one on the grammars' worker thread, started when the step before got its token."""
    threads: list[str] = []
    fill_call = Grammars._fill_call

    def spy(self, matchers):
        out, compute = fill_call(self, matchers)

        def traced():
            threads.append(threading.current_thread().name)
            compute()
        return out, traced

    monkeypatch.setattr(Grammars, "_fill_call", spy)
    eng = engine(grammars, MaskingExecutor())
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}},
              "required": ["s"]}
    for i in range(3):
        eng.add(Request(f"j{i}", [5 + i, 6], 20, Sampling(1.0, 0, 1.0, i),
                        constraint=Constraint.json_schema(schema)))
    outs = drain(eng)
    assert all(len(tokens_of(outs[f"j{i}"])) == 20 for i in range(3))
    assert threads[0] == threading.current_thread().name  # the first masks, in the step
    assert len(threads) > 10 and all(t.startswith("rvrun-masks") for t in threads[1:])


def test_a_known_grammar_s_first_mask_is_not_computed_again(grammars, monkeypatch):
    """The engine keeps each grammar's first mask: a later request of a grammar it has seen
    starts without one computed, and gets its reference tokens."""
    eng = engine(grammars, MaskingExecutor())
    seen = Request("seen", [5, 6], 6, Sampling(1.0, 0, 1.0, 1), constraint=GRAMMARS[4])
    eng.add(seen)
    outs = drain(eng)
    computed: list[int] = []  # matchers per fill in the engine's thread
    fill = Grammars.fill

    def spy(self, matchers):
        computed.append(len(matchers))
        return fill(self, matchers)

    monkeypatch.setattr(Grammars, "fill", spy)
    again = Request("again", [7, 8], 6, Sampling(1.0, 0, 1.0, 2), constraint=GRAMMARS[4])
    new = Request("new", [7, 9], 6, Sampling(1.0, 0, 1.0, 3), constraint=GRAMMARS[0])
    eng.add(again)
    eng.add(new)
    outs.update(drain(eng))
    assert computed == [1]  # "new"'s first mask; every later one on the worker
    for r in (seen, again, new):
        assert tokens_of(outs[r.id]) == reference(grammars, r), r.id
    assert_pools_whole(eng)


@pytest.mark.parametrize("kind", sorted(EXECUTORS))
def test_a_failed_mask_job_ends_only_its_sequences(grammars, monkeypatch, break_mask_jobs, kind):
    """A mask job that raises on the worker ends the constrained requests it was computing
    for; the free one in the same batch goes on, and a later constrained request runs. With
    late masks the job fails inside the decode call, between its forward pass and its sampler:
    the failed lane's token is dropped and its request ends once."""
    break_mask_jobs()
    ex = EXECUTORS[kind]()
    eng = engine(grammars, ex)
    free = Request("free", [7, 8, 9], 12, Sampling(1.0, 0, 1.0, 3))
    eng.add(free)
    eng.add(Request("c", [7, 8], 12, Sampling(1.0, 0, 1.0, 4), constraint=GRAMMARS[3]))
    outs = drain(eng)
    assert outs["c"][-1].finish_reason == "error" and "llguidance broke" in outs["c"][-1].error
    assert len(tokens_of(outs["c"])) == 1  # its first token's mask was made in the step
    assert [o.finished for o in outs["c"]] == [False, True]
    if kind == "late masks":
        assert ex.events[:2] == ["forward", "masks"]  # it failed inside the first decode call
    assert tokens_of(outs["free"]) == reference(grammars, free)
    monkeypatch.undo()
    r = Request("after", [3, 4], 10, Sampling(1.0, 0, 1.0, 5), constraint=GRAMMARS[3])
    eng.add(r)
    assert tokens_of(drain(eng)["after"]) == reference(grammars, r)
    assert_pools_whole(eng)


def test_a_token_the_grammar_refuses_ends_only_its_request(grammars):
    """A sampler that ignored one lane's mask: its token is refused by the grammar before any
    output, that request ends with an error, the others in the batch get their tokens."""
    eng = engine(grammars, MaskingExecutor(ignore_mask_seed=66))
    bad = Request("bad", [9, 9], 10, Sampling(1.0, 0, 1.0, 66), constraint=GRAMMARS[0])
    good = [Request(f"g{i}", [9, 9 + i], 10, Sampling(1.0, 0, 1.0, i),
                    constraint=GRAMMARS[i % 4] if i % 2 else None) for i in range(3)]
    for r in (bad, *good):
        eng.add(r)
    outs = drain(eng)
    assert outs["bad"][-1].finish_reason == "error" and "refused" in outs["bad"][-1].error
    assert tokens_of(outs["bad"]) == []
    for r in good:
        assert tokens_of(outs[r.id]) == reference(grammars, r), r.id
    assert_pools_whole(eng)


def test_an_abort_while_its_masks_compute_leaves_the_rest_whole(grammars):
    eng = engine(grammars, MaskingExecutor())
    reqs = [Request(f"a{i}", [4, 4 + i], 16, Sampling(1.0, 0, 1.0, 10 + i),
                    constraint=GRAMMARS[3]) for i in range(3)]
    for r in reqs:
        eng.add(r)
    outs: dict[str, list] = {}
    for _ in range(2):
        for o in eng.step():
            outs.setdefault(o.id, []).append(o)
    assert eng._pending is not None and any(v.request.id == "a1" for v in eng._pending.lives)
    eng.abort("a1")
    for rid, got in drain(eng).items():
        outs.setdefault(rid, []).extend(got)
    assert outs["a1"][-1].finish_reason == "abort"
    for r in (reqs[0], reqs[2]):
        assert tokens_of(outs[r.id]) == reference(grammars, r), r.id
    assert_pools_whole(eng)


def test_a_decode_call_starts_before_its_masks_are_waited_for(grammars, monkeypatch):
    """With late masks, every mask job that a decode call needs is still held back on the
    worker (until the fake's forward pass releases it) when that call starts: an engine that
    waited for the masks before the call would wait for nothing to release them (here: the
    hold times out, and the test fails)."""
    fill_call = Grammars._fill_call
    release = threading.Event()
    held: list[bool] = []  # per job on the worker: released by a forward pass (not timed out)

    def held_back(self, matchers):
        out, compute = fill_call(self, matchers)

        def run():
            if threading.current_thread().name.startswith("rvrun-masks"):
                held.append(release.wait(timeout=2.0))
                release.clear()
            compute()
        return out, run

    monkeypatch.setattr(Grammars, "_fill_call", held_back)
    ex = LateMaskExecutor()
    ex.on_forward = release.set
    eng = engine(grammars, ex)
    reqs = [Request(f"h{i}", [6, 7 + i], 8, Sampling(1.0, 0, 1.0, 20 + i),
                    constraint=GRAMMARS[3 + i % 2]) for i in range(3)]
    reqs.append(Request("free", [6, 5], 8, Sampling(1.0, 0, 1.0, 30)))
    for r in reqs:
        eng.add(r)
    outs = drain(eng)
    for r in reqs:
        assert tokens_of(outs[r.id]) == reference(grammars, r), r.id
    assert len(held) > 3 and all(held)
    assert ex.events[:2] == ["forward", "masks"] and "masks" not in ex.events[::2]
    assert_pools_whole(eng)


def test_a_decode_call_failing_after_its_masks_failed_ends_each_request_once(
        grammars, monkeypatch, break_mask_jobs):
    """The mask job fails inside a late-mask decode call, and the call then fails too: every
    request in the call ends with exactly one error output, and the engine serves on."""
    break_mask_jobs()
    ex = LateMaskExecutor()
    ex.fail_sampler = True
    eng = engine(grammars, ex)
    eng.add(Request("free", [7, 8, 9], 12, Sampling(1.0, 0, 1.0, 3)))
    eng.add(Request("c", [7, 8], 12, Sampling(1.0, 0, 1.0, 4), constraint=GRAMMARS[3]))
    outs = drain(eng)
    for rid in ("free", "c"):
        assert [o.finished for o in outs[rid]] == [False, True], rid
        assert outs[rid][-1].finish_reason == "error"
    assert "the sampler broke" in outs["free"][-1].error
    monkeypatch.undo()
    ex.fail_sampler = False
    r = Request("after", [3, 4], 10, Sampling(1.0, 0, 1.0, 5), constraint=GRAMMARS[3])
    eng.add(r)
    assert tokens_of(drain(eng)["after"]) == reference(grammars, r)
    assert_pools_whole(eng)
