"""The engine: a one-way loop schedule -> execute -> update over any executor (executor_api),
shared by Model.generate and `rvrun serve`.

Requests come in through `add` and `abort` (thread-safe). `add` checks every field once
(request_limits): a request the engine cannot run is refused there, never in a step. Each
`step()` takes them in, asks the scheduler for work, runs it on the executor (prefill chunks,
then one decode call) and turns the sampled tokens into RequestOutputs: text deltas, stop
strings, EOS and max_tokens. When every running sequence decodes past its recomputed tokens
and nobody waits to join, the step is one decode_many call instead (where the executor offers
it): up to decode_loop_steps tokens per sequence, the same tokens. A finished or aborted
request's blocks go back to the pool in the same step.

Speculative decoding (a request's `speculation`, runtime/speculative.py; executor_api's
speculative contract): a speculating sequence runs every token past its prompt through the
executor's verify call, never decode, so it is computed the same way under any load. Each step,
after the prefill and decode calls: one draft call for the sequences drafting with the
assistant (those with a state from their previous verify: a just prefilled one verifies its
last token alone first), n-gram lookup for the others, then one verify call for every
speculating sequence; the scheduler keeps the matching drafts (`Scheduler.verified`). Sequences
with and without drafting share a step, in separate calls (a decode lane and a verify row are
different call shapes, and a row's bits may depend on its call's shape). Speculation runs
outside the device-side decode loop: while any speculating sequence runs, steps are single
decode / verify calls, each of up to 1 + num_draft_tokens tokens per speculating sequence.

Failures: an executor call that raises ends the requests it ran (finish_reason "error", blocks
freed) and the step goes on; so does a failure turning one sequence's token into output. Only a
DeviceError (the device is unusable) leaves step(). `EngineThread` runs steps in the background
and hands each output to its request's sink; after a DeviceError, or a failure it cannot clean
up, it ends every request, refuses new ones and says why in `error` (the server's /health) and
in the log.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from rvcompile.runtime.executor_api import (
    DeviceError,
    DraftLane,
    Executor,
    KvKind,
    LoopLane,
    Sampling,
    SeqChunk,
    Verified,
    decode_loop_steps,
    has_drafter,
    max_draft_tokens,
)
from rvcompile.runtime.kv_blocks import PagedKv
from rvcompile.runtime.request_limits import RequestLimits
from rvcompile.runtime.scheduler import Schedule, Scheduler, Seq, Work
from rvcompile.runtime.speculative import Speculation, ngram_drafts
from rvcompile.runtime.textstream import TextStream

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # strings that end the text (checked on decoded text, excluded)
    ignore_eos: bool = False
    speculation: Speculation | None = None  # speculative decoding; None: plain decoding


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    id: str
    token_ids: list[int]  # new tokens (a stop string's tokens included, EOS excluded)
    text: str  # newly final text
    finished: bool
    finish_reason: str | None  # once finished: "stop", "length", "abort" or "error"
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far, EOS included
    cached_tokens: int  # prompt tokens served by the prefix cache
    error: str = ""  # with finish_reason "error"
    drafted_tokens: int = 0  # speculative decoding: drafts verified so far
    accepted_tokens: int = 0  # of them, accepted


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_used: dict[str, int]  # kind -> blocks held by sequences
    kv_total: dict[str, int]  # kind -> blocks in the pool
    prefix_queried: int  # prompt tokens admitted
    prefix_hit: int  # of them, served from the prefix cache
    preemptions: int
    steps: int
    drafted: int = 0  # speculative decoding: drafts verified
    accepted: int = 0  # of them, accepted
    verify_calls: int = 0  # verify calls run


@dataclass(eq=False)
class _Live:
    request: Request
    seq: Seq
    text: TextStream
    state: object = None  # drafting with the assistant: the last verify's state to draft from


def engine_limits(kinds: dict[str, KvKind], block_size: int, max_seqs: int,
                  max_context: int, max_num_seqs: int | None,
                  max_model_len: int | None) -> tuple[int, int]:
    """(max_num_seqs, max_model_len) with the executor's as defaults. Raises ValueError for
    limits the executor cannot meet, or pools that cannot hold one longest sequence (which
    could then never finish)."""
    max_num_seqs = max_num_seqs or max_seqs
    max_model_len = max_model_len or max_context
    if not 1 <= max_num_seqs <= max_seqs:
        raise ValueError(f"max_num_seqs {max_num_seqs}: the artifact decodes 1 to "
                         f"{max_seqs} sequences per step")
    if not 1 <= max_model_len <= max_context:
        raise ValueError(f"max_model_len {max_model_len}: the artifact's context is "
                         f"{max_context} tokens")
    for kind in kinds.values():
        need = min(kind.table_width, -(-max_model_len // block_size))
        if kind.num_blocks < need:
            raise ValueError(f"{kind.num_blocks} {kind.name} KV blocks cannot hold one "
                             f"sequence of {max_model_len} tokens; need {need}")
    return max_num_seqs, max_model_len


class QueueFull(RuntimeError):
    """More requests wait than the caller allows (Engine.add's max_waiting)."""


class Engine:
    def __init__(self, executor: Executor, decode: Callable[[list[int]], str],
                 eos_ids: frozenset[int], *, vocab_size: int, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, prefill_budget: int | None = None):
        self.executor, self._decode, self.eos_ids = executor, decode, eos_ids
        self.max_num_seqs, self.max_model_len = engine_limits(
            executor.kinds, executor.block_size, executor.max_seqs, executor.max_context,
            max_num_seqs, max_model_len)
        self.limits = RequestLimits(vocab_size, self.max_model_len,
                                    max_draft_tokens(executor), has_drafter(executor))
        self.kv = PagedKv(executor.kinds, executor.block_size)
        self.scheduler = Scheduler(self.kv, max_num_seqs=self.max_num_seqs,
                                   prefill_buckets=tuple(executor.prefill_buckets),
                                   prefill_budget=prefill_budget or executor.max_chunk)
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._live: dict[str, _Live] = {}
        self._order = itertools.count()
        self.steps = self.preemptions = 0
        self.drafted = self.accepted = self.verify_calls = 0

    # ------------------------------------------------------------------ requests (any thread)

    def add(self, request: Request, max_waiting: int | None = None) -> None:
        """Queue a request, its fields checked (request_limits: raises RequestError, a
        ValueError). With max_waiting, raises QueueFull while that many requests wait."""
        request = self.limits.check(request)
        with self._lock:
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if max_waiting is not None and waiting >= max_waiting:
                raise QueueFull(f"the queue is full ({waiting} waiting requests)")
            self._inbox.append(request)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the start of the next step."""
        with self._lock:
            self._aborts.append(request_id)

    def has_work(self) -> bool:
        with self._lock:
            if self._inbox or self._aborts:
                return True
        return bool(self._live)

    def num_waiting(self) -> int:
        with self._lock:
            return len(self._inbox) + len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting),
                           {k: self.kv.num_used(k) for k in self.kv.pools},
                           {k: len(p.blocks) for k, p in self.kv.pools.items()},
                           s.prefix.queried, s.prefix.hit, self.preemptions, self.steps,
                           self.drafted, self.accepted, self.verify_calls)

    # ------------------------------------------------------------------ the loop (one thread)

    def step(self) -> list[RequestOutput]:
        with self._lock:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        outputs: list[RequestOutput] = []
        for r in inbox:
            seq = Seq(r.id, list(r.prompt_ids), r.sampling, next(self._order))
            if r.speculation is not None:
                seq.verify_rows = 1 + r.speculation.num_draft_tokens
                seq.max_len = len(r.prompt_ids) + r.max_tokens
            self._live[r.id] = _Live(r, seq, TextStream(self._decode, r.stop))
            self.scheduler.add(seq)
        for rid in aborts:
            if rid in self._live:
                outputs.append(self._finish(self._live[rid], "abort", []))
        sched = self.scheduler.schedule()
        self.preemptions += len(sched.preempted)
        for seq in sched.preempted:  # its drafting state went with its blocks
            self._live[seq.id].state = None
        lanes = self._loop_lanes(sched) if not inbox else None
        if lanes is not None:
            self._decode_loop(sched.decodes, lanes, outputs)
        else:
            self._run(sched, outputs)
        self.steps += 1
        return outputs

    def _run(self, sched: Schedule, outputs: list[RequestOutput]) -> None:
        """The schedule's prefill calls, then its decode call; each token through advance."""
        done: list[tuple[Work, int]] = []
        for w in sched.prefills:
            token = self._guarded("prefill", [w], outputs, self.executor.prefill, w.chunk)
            if token is not None:
                done.append((w, token))
        if sched.decodes:
            tokens = self._guarded("decode", sched.decodes, outputs, _pairs, sched.decodes,
                                   self.executor.decode, [w.chunk for w in sched.decodes])
            done += tokens or []
        for work, token in done:
            out = self._guarded("output", [work], outputs, self._advance, work, token)
            if out is not None:
                outputs.append(out)
        if sched.verifies:
            self._speculate(sched.verifies, outputs)

    def _speculate(self, works: list[Work], outputs: list[RequestOutput]) -> None:
        """One speculative round of every speculating sequence past its prompt: drafts (one
        draft call for the assistant's, n-gram lookup for the rest), one verify call, then
        each sequence's accepted tokens through advance/_emit (one RequestOutput each)."""
        drafts: dict[str, list[int]] = {}
        assisted: list[tuple[Work, int]] = []
        for w in works:
            room = self._draft_room(w)
            method = self._live[w.seq.id].request.speculation.method
            if room and method == "ngram":
                drafts[w.seq.id] = ngram_drafts(w.seq.tokens, room)
            elif room and self._live[w.seq.id].state is not None:
                assisted.append((w, room))
        if assisted:
            lanes = [DraftLane(w.chunk, self._live[w.seq.id].state) for w, _ in assisted]
            n = max(room for _, room in assisted)
            made = self._guarded("draft", [w for w, _ in assisted], outputs, _pairs, assisted,
                                 lambda ls: self.executor.draft(ls, n), lanes)
            for (w, room), d in made or []:
                drafts[w.seq.id] = list(d.tokens[:room])
        works = [w for w in works if w.seq.id in self._live]  # a failed draft ended some
        if not works:
            return
        plan = [(w, drafts.get(w.seq.id, [])) for w in works]
        lanes = [dataclasses.replace(w.chunk, tokens=[*w.chunk.tokens, *d]) for w, d in plan]
        self.verify_calls += 1
        results = self._guarded("verify", works, outputs, _pairs, plan, self.executor.verify,
                                lanes)
        for (w, d), verified in results or []:
            out = self._guarded("output", [w], outputs, self._advance_verified, w, d, verified)
            if out is not None:
                outputs.append(out)

    def _draft_room(self, w: Work) -> int:
        """Drafts w's verify can take: the rows the scheduler reserved past its last token;
        0 while it recomputes known tokens."""
        if w.seq.recomputing or len(w.chunk.tokens) != 1:
            return 0
        return self.scheduler.piece(w.seq)[0] - 1

    def _advance_verified(self, w: Work, drafts: list[int],
                          verified: Verified) -> RequestOutput | None:
        seq, live = w.seq, self._live[w.seq.id]
        drafted, accepted = seq.drafted, seq.accepted
        new = self.scheduler.verified(w, drafts, list(verified.tokens))
        self.drafted += seq.drafted - drafted
        self.accepted += seq.accepted - accepted
        if verified.states and live.request.speculation.method == "assistant":
            live.state = verified.states[seq.cached - w.chunk.start - 1]  # its last kept row's
        # The new tokens join the output one at a time, as from decode steps, so a request
        # that ends part-way (EOS, a stop string) counts only the tokens up to there.
        del seq.output[len(seq.output) - len(new):]
        parts = []
        for token in new:
            seq.output.append(token)
            parts.append(self._emit(live, token))
            if parts[-1].finished:
                break
        return _merge(parts) if parts else None

    def _advance(self, work: Work, token: int) -> RequestOutput | None:
        new = self.scheduler.advance(work, token)
        return None if new is None else self._emit(self._live[work.seq.id], new)

    def _guarded(self, what: str, works: Sequence[Work], outputs: list[RequestOutput],
                 fn: Callable[..., T], *args) -> T | None:
        """fn(*args), the `what` of the requests of `works`. If it raises (a DeviceError excepted),
        they end with finish_reason "error" in `outputs`, their blocks freed, and None is
        returned: the rest of the step goes on."""
        lives = [self._live[w.seq.id] for w in works]
        try:
            return fn(*args)
        except DeviceError:
            raise
        except Exception as e:
            error = f"the engine failed to run this request: {type(e).__name__}: {e}"
            log.error("engine: %s failed; ending request(s) %s", what,
                      ", ".join(live.request.id for live in lives), exc_info=e)
            outputs += [self._fail(live, error) for live in lives]
            return None

    def _loop_lanes(self, sched: Schedule) -> list[LoopLane] | None:
        """This step's decodes as decode_many lanes, or None to run one decode step: when the
        executor has no loop, someone else runs or waits to join, a sequence is recomputing
        tokens it generated before a preemption (each must be fed, not sampled), or the pools
        cannot hold every lane's budget (the rest of its max_tokens, at most one call's
        steps), allocated here ahead of the call (blocks a lane got before another's failed
        stay with it)."""
        steps = decode_loop_steps(self.executor)
        if (steps == 0 or not sched.decodes or sched.prefills or sched.preempted
                or sched.verifies
                or self.scheduler.waiting or len(sched.decodes) != len(self.scheduler.running)
                or len(self.eos_ids) > self.executor.decode_loop_stops
                or any(w.seq.cached + 1 < len(w.seq.tokens) for w in sched.decodes)):
            return None
        lanes = []
        for w in sched.decodes:
            live = self._live[w.seq.id]
            budget = min(steps, live.request.max_tokens - len(w.seq.output))
            if not self.kv.ensure(w.seq.blocks, w.seq.cached, w.seq.cached + budget):
                return None
            stops = frozenset() if live.request.ignore_eos else self.eos_ids
            chunk = dataclasses.replace(w.chunk, tables=self.kv.tables(w.seq.blocks))
            lanes.append(LoopLane(chunk, budget, stops))
        return lanes

    def _decode_loop(self, decodes: list[Work], lanes: list[LoopLane],
                     outputs: list[RequestOutput]) -> None:
        """Run the lanes in one decode_many call. Their tokens go through advance/_emit one by
        one, as if from single decode steps; each request gets one RequestOutput for the call."""
        results = self._guarded("decode_many", decodes, outputs, _pairs,
                                list(zip(decodes, lanes, strict=True)),
                                self.executor.decode_many, lanes)
        for (w, lane), tokens in results or []:
            out = self._guarded("output", [w], outputs, self._advance_lane, w, lane, tokens)
            if out is not None:
                outputs.append(out)

    def _advance_lane(self, w: Work, lane: LoopLane, tokens: list[int]) -> RequestOutput:
        if not 0 < len(tokens) <= lane.budget:
            raise RuntimeError(f"decode_many returned {len(tokens)} tokens for a lane of "
                               f"budget {lane.budget}")
        live, parts = self._live[w.seq.id], []
        for k, token in enumerate(tokens):
            chunk = dataclasses.replace(lane.chunk, tokens=[w.seq.tokens[-1]],
                                        start=lane.chunk.start + k, step=lane.chunk.step + k)
            # A lane never recomputes (_loop_lanes), so each token is the sequence's next.
            parts.append(self._emit(live, self.scheduler.advance(Work(w.seq, chunk), token)))
            if parts[-1].finished:
                break
        return _merge(parts)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with finish_reason "error". Raises RuntimeError if KV blocks are
        still held afterwards (the engine's state is lost)."""
        with self._lock:
            inbox, self._inbox, self._aborts = self._inbox, [], []
        outputs = [RequestOutput(r.id, [], "", True, "error", len(r.prompt_ids), 0, 0, error)
                   for r in inbox]
        outputs += [self._fail(live, error) for live in list(self._live.values())]
        held = {k: n for k, n in self.stats().kv_used.items() if n}
        if held or self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError(f"KV blocks {held} and {len(self.scheduler.running)} running, "
                               f"{len(self.scheduler.waiting)} waiting sequences remain after "
                               "ending every request")
        return outputs

    def _emit(self, live: _Live, token: int) -> RequestOutput:
        r = live.request
        if token in self.eos_ids and not r.ignore_eos:
            return self._finish(live, "stop", [])
        text, hit = live.text.add(token)
        if hit:
            return self._finish(live, "stop", [token], text)
        if len(live.text.token_ids) >= r.max_tokens:
            return self._finish(live, "length", [token], text)
        return self._output(live, [token], text, None)

    def _finish(self, live: _Live, reason: str, token_ids: list[int],
                text: str = "") -> RequestOutput:
        self.scheduler.remove(live.seq)
        del self._live[live.request.id]
        if reason in ("stop", "length"):
            text += live.text.finish()
        return self._output(live, token_ids, text, reason)

    def _fail(self, live: _Live, error: str) -> RequestOutput:
        """End live's request with finish_reason "error", whatever state a failure left it in
        (its sequence running, waiting, or already removed)."""
        self.scheduler.remove(live.seq)
        self._live.pop(live.request.id, None)
        return self._output(live, [], "", "error", error)

    @staticmethod
    def _output(live: _Live, token_ids: list[int], text: str, reason: str | None,
                error: str = "") -> RequestOutput:
        seq = live.seq
        return RequestOutput(live.request.id, token_ids, text, reason is not None, reason,
                             len(seq.prompt), len(seq.output), seq.cached_prompt, error,
                             drafted_tokens=seq.drafted, accepted_tokens=seq.accepted)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [T, vocab] of every position, chunk by chunk (call it only while
        no step runs)."""
        ids = self.limits.token_ids(token_ids, "token_ids")
        blocks = self.kv.empty()
        rows = []
        try:
            for s in range(0, len(ids), self.executor.max_chunk):
                e = min(len(ids), s + self.executor.max_chunk)
                if not self.kv.ensure(blocks, s, e):
                    raise RuntimeError("the KV pools are full: logits runs only while the "
                                       "engine is idle")
                rows.append(self.executor.logits(SeqChunk(ids[s:e], s, self.kv.tables(blocks))))
                self.kv.commit(blocks, ids, e, None)  # logits rows come from another program
        finally:
            self.kv.free(blocks)
        return np.concatenate(rows, axis=0)


def _pairs(items: Sequence, call: Callable[[Sequence], Sequence], arg: Sequence) -> list[tuple]:
    """items paired with call(arg)'s results, one each (raises if the counts differ)."""
    return list(zip(items, call(arg), strict=True))


def _merge(parts: list[RequestOutput]) -> RequestOutput:
    """One request's consecutive outputs as one."""
    last = parts[-1]
    return dataclasses.replace(last, token_ids=[t for p in parts for t in p.token_ids],
                               text="".join(p.text for p in parts))


class EngineThread:
    """Runs engine steps in a background thread while there is work, handing each output to the
    sink its request was submitted with (sinks run on the engine thread: keep them short).

    A step that raises ends every request with an error. After a DeviceError, or when ending
    them does not give every KV block back, the engine is lost: `error` says why (and the log),
    and submit refuses new requests. After anything else (an engine bug) it keeps serving."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._stopped = False
        self.error = ""  # why the engine cannot run requests any more; "" while it can
        self._thread = threading.Thread(target=self._run, name="rvrun-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, sink: Callable[[RequestOutput], None],
               max_waiting: int | None = None) -> None:
        """Queue a request (Engine.add: raises RequestError for a bad one, QueueFull; raises
        RuntimeError once the engine is lost)."""
        with self._cv:
            if self.error:
                raise RuntimeError(self.error)
            if request.id in self._sinks:
                raise ValueError(f"request id {request.id!r} is already running")
            self.engine.add(request, max_waiting)
            self._sinks[request.id] = sink
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._sinks:
                self.engine.abort(request_id)
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self.engine.has_work())
                if self._stopped:
                    return
            try:
                outputs = self.engine.step()
            except Exception as e:
                outputs = self._recover(e)
            with self._cv:
                sinks = [(self._sinks.pop(o.id) if o.finished else self._sinks[o.id], o)
                         for o in outputs if o.id in self._sinks]
            for sink, out in sinks:
                try:
                    sink(out)
                except Exception as e:  # its consumer is gone: stop generating for it
                    log.error("engine: the sink of request %s failed; aborting it", out.id,
                              exc_info=e)
                    self.abort(out.id)
            if self.error:
                return

    def _recover(self, e: Exception) -> list[RequestOutput]:
        """An error output for every request after a step raised e. Marks the engine lost
        after a DeviceError, or when ending the requests does not leave it clean."""
        if isinstance(e, DeviceError):
            self.error = f"the device failed: {e}"
            log.error("engine: %s; refusing every request from now on", self.error)
        else:
            log.error("engine: a step failed; ending every request", exc_info=e)
        message = self.error or f"engine step failed: {type(e).__name__}: {e}"
        with self._cv:  # no submit meanwhile
            try:
                outputs = self.engine.fail_all(message)
            except Exception as lost:
                self.error = self.error or f"the engine's state is lost after a failed step: {lost}"
                log.error("engine: %s; refusing every request from now on", self.error,
                          exc_info=lost)
                outputs = []
            # Requests the failed step had already finished lost their outputs with it.
            ended = {o.id for o in outputs}
            return outputs + [RequestOutput(rid, [], "", True, "error", 0, 0, 0,
                                            self.error or message)
                              for rid in self._sinks if rid not in ended]
