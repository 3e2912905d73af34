"""The engine: a one-way loop schedule -> execute -> update over any executor (executor_api),
shared by Model.generate and `rvrun serve`.

Requests come in through `add` and `abort` (thread-safe). Each `step()` takes them in, asks the
scheduler for work, runs it on the executor (prefill chunks, then one decode call) and turns the
sampled tokens into RequestOutputs: text deltas, stop strings, EOS and max_tokens. When every
running sequence decodes and nobody waits to join, the step is one decode_many call instead
(where the executor offers it): up to decode_loop_steps tokens per sequence, the same tokens.
A finished or aborted request's blocks go back to the pool in the same step. `EngineThread`
runs steps in the background and hands each output to its request's sink.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rvcompile.runtime.executor_api import (
    Executor,
    KvKind,
    LoopLane,
    Sampling,
    SeqChunk,
    decode_loop_steps,
)
from rvcompile.runtime.kv_blocks import PagedKv
from rvcompile.runtime.scheduler import Schedule, Scheduler, Seq, Work
from rvcompile.runtime.textstream import TextStream


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # strings that end the text (checked on decoded text, excluded)
    ignore_eos: bool = False


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


@dataclass(eq=False)
class _Live:
    request: Request
    seq: Seq
    text: TextStream


def engine_limits(kinds: dict[str, KvKind], block_size: int, decode_width: int,
                  max_context: int, max_num_seqs: int | None,
                  max_model_len: int | None) -> tuple[int, int]:
    """(max_num_seqs, max_model_len) with the executor's as defaults. Raises ValueError for
    limits the executor cannot meet, or pools that cannot hold one longest sequence (which
    could then never finish)."""
    max_num_seqs = max_num_seqs or decode_width
    max_model_len = max_model_len or max_context
    if not 1 <= max_num_seqs <= decode_width:
        raise ValueError(f"max_num_seqs {max_num_seqs}: the artifact decodes 1 to "
                         f"{decode_width} sequences per step")
    if not 1 <= max_model_len <= max_context:
        raise ValueError(f"max_model_len {max_model_len}: the artifact's context is "
                         f"{max_context} tokens")
    for kind in kinds.values():
        need = min(kind.table_width, -(-max_model_len // block_size))
        if kind.num_blocks < need:
            raise ValueError(f"{kind.num_blocks} {kind.name} KV blocks cannot hold one "
                             f"sequence of {max_model_len} tokens; need {need}")
    return max_num_seqs, max_model_len


class Engine:
    def __init__(self, executor: Executor, decode: Callable[[list[int]], str],
                 eos_ids: frozenset[int], *, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, prefill_budget: int | None = None):
        self.executor, self._decode, self.eos_ids = executor, decode, eos_ids
        self.max_num_seqs, self.max_model_len = engine_limits(
            executor.kinds, executor.block_size, executor.decode_width, executor.max_context,
            max_num_seqs, max_model_len)
        self.kv = PagedKv(executor.kinds, executor.block_size)
        self.scheduler = Scheduler(self.kv, max_running=self.max_num_seqs,
                                   prefill_buckets=tuple(executor.prefill_buckets),
                                   prefill_budget=prefill_budget or executor.max_chunk)
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._live: dict[str, _Live] = {}
        self._order = itertools.count()
        self.steps = self.preemptions = 0

    # ------------------------------------------------------------------ requests (any thread)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError, naming the numbers, for a request this engine cannot run."""
        if prompt_len == 0:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens")

    def add(self, request: Request) -> None:
        self.check(len(request.prompt_ids), request.max_tokens)
        with self._lock:
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
                           s.prefix.queried, s.prefix.hit, self.preemptions, self.steps)

    # ------------------------------------------------------------------ the loop (one thread)

    def step(self) -> list[RequestOutput]:
        with self._lock:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        outputs: list[RequestOutput] = []
        for r in inbox:
            seq = Seq(r.id, list(r.prompt_ids), r.sampling, next(self._order))
            self._live[r.id] = _Live(r, seq, TextStream(self._decode, r.stop))
            self.scheduler.add(seq)
        for rid in aborts:
            if rid in self._live:
                outputs.append(self._finish(self._live[rid], "abort", []))
        sched = self.scheduler.schedule()
        self.preemptions += len(sched.preempted)
        lanes = self._loop_lanes(sched) if not inbox else None
        if lanes is not None:
            outputs += self._decode_loop(sched.decodes, lanes)
            self.steps += 1
            return outputs
        done: list[tuple[Work, int]] = [(w, self.executor.prefill(w.chunk))
                                        for w in sched.prefills]
        if sched.decodes:
            tokens = self.executor.decode([w.chunk for w in sched.decodes])
            done += zip(sched.decodes, tokens, strict=True)
        for work, token in done:
            new = self.scheduler.advance(work, token)
            if new is not None:
                outputs.append(self._emit(self._live[work.seq.id], new))
        self.steps += 1
        return outputs

    def _loop_lanes(self, sched: Schedule) -> list[LoopLane] | None:
        """This step's decodes as decode_many lanes, or None to run one decode step: when the
        executor has no loop, someone else runs or waits to join, or the pools cannot hold
        every lane's budget (the rest of its max_tokens, at most one call's steps), allocated
        here ahead of the call (blocks a lane got before another's failed stay with it)."""
        steps = decode_loop_steps(self.executor)
        if (steps == 0 or not sched.decodes or sched.prefills or sched.preempted
                or self.scheduler.waiting or len(sched.decodes) != len(self.scheduler.running)
                or len(self.eos_ids) > self.executor.decode_loop_stops):
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

    def _decode_loop(self, decodes: list[Work], lanes: list[LoopLane]) -> list[RequestOutput]:
        """Run the lanes in one decode_many call. Their tokens go through advance/_emit one by
        one, as if from single decode steps; each request gets one RequestOutput for the call."""
        outputs = []
        for w, lane, tokens in zip(decodes, lanes, self.executor.decode_many(lanes),
                                   strict=True):
            live, parts = self._live[w.seq.id], []
            for k, token in enumerate(tokens):
                chunk = dataclasses.replace(lane.chunk, tokens=[w.seq.tokens[-1]],
                                            start=lane.chunk.start + k, step=lane.chunk.step + k)
                parts.append(self._emit(live, self.scheduler.advance(Work(w.seq, chunk), token)))
                if parts[-1].finished:
                    break
            outputs.append(_merge(parts))
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with finish_reason "error" (the executor failed)."""
        with self._lock:
            inbox, self._inbox, self._aborts = self._inbox, [], []
        outputs = [RequestOutput(r.id, [], "", True, "error", len(r.prompt_ids), 0, 0, error)
                   for r in inbox]
        for live in list(self._live.values()):
            outputs.append(self._finish(live, "error", [], error=error))
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

    def _finish(self, live: _Live, reason: str, token_ids: list[int], text: str = "",
                error: str = "") -> RequestOutput:
        self.scheduler.remove(live.seq)
        del self._live[live.request.id]
        if reason in ("stop", "length"):
            text += live.text.finish()
        return self._output(live, token_ids, text, reason, error)

    @staticmethod
    def _output(live: _Live, token_ids: list[int], text: str, reason: str | None,
                error: str = "") -> RequestOutput:
        seq = live.seq
        return RequestOutput(live.request.id, token_ids, text, reason is not None, reason,
                             len(seq.prompt), len(seq.output), seq.cached_prompt, error)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits [T, vocab] of every position, chunk by chunk (call it only while
        no step runs)."""
        ids = [int(t) for t in token_ids]
        if not 0 < len(ids) <= self.max_model_len:
            raise ValueError(f"{len(ids)} tokens; logits takes 1 to {self.max_model_len}")
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


def _merge(parts: list[RequestOutput]) -> RequestOutput:
    """One request's consecutive outputs as one."""
    last = parts[-1]
    return dataclasses.replace(last, token_ids=[t for p in parts for t in p.token_ids],
                               text="".join(p.text for p in parts))


class EngineThread:
    """Runs engine steps in a background thread while there is work, handing each output to the
    sink its request was submitted with (sinks run on the engine thread: keep them short)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._stopped = False
        self.error = ""  # set when the executor failed; every later step would fail too
        self._thread = threading.Thread(target=self._run, name="rvrun-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, sink: Callable[[RequestOutput], None]) -> None:
        """Queue a request (raises ValueError for one the engine cannot run, RuntimeError once
        the executor has failed)."""
        with self._cv:
            if self.error:
                raise RuntimeError(self.error)
            self._sinks[request.id] = sink
            try:
                self.engine.add(request)
            except ValueError:
                del self._sinks[request.id]
                raise
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
            except Exception as e:  # the executor failed: end every request, take no more
                self.error = f"engine step failed: {type(e).__name__}: {e}"
                outputs = self.engine.fail_all(self.error)
            with self._cv:
                sinks = [(self._sinks.pop(o.id) if o.finished else self._sinks[o.id], o)
                         for o in outputs]
            for sink, out in sinks:
                sink(out)
