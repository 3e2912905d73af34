"""The engine: a one-way loop schedule -> execute -> update over any executor (executor_api),
shared by Model.generate and `rvrun serve`.

Requests come in through `add` and `abort` (thread-safe). `add` checks every field once
(request_limits, and a grammar constraint through constraints.Grammars): a request the engine
cannot run is refused there, never in a step. A request of n samples runs as n sequences (its
outputs carry their index) that share the prompt's whole KV blocks, prefilled once. Sequences
asking for log-probabilities, penalties or a grammar constraint pass SampleExtras with their
sampling calls and run single decode steps (those with a grammar alone: the masked decode loop,
below). Each `step()` takes them in, asks the scheduler
for work, runs it on the executor (prefill chunks, several sequences' to a call where the
executor packs them, then one decode call) and turns the sampled
tokens into RequestOutputs: text deltas, stop strings, EOS and max_tokens. When every running
sequence decodes past its recomputed tokens and nobody waits to join, the step is one
decode_many call instead (where the executor offers it): up to decode_loop_steps tokens per
sequence, the same tokens. A finished or aborted request's blocks go back to the pool in the
same step. Where the executor has mixed calls (executor_api, "Mixed calls"), a step's last
prefill pack runs in its decode call, so prompts ride along the lanes' read of the weights;
neither call's tokens change.

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

Grammar masks (a constraint's allowed next tokens, computed on the host by llguidance and
applied by the device sampler) are pipelined. A mask depends on every token sampled before it,
so the mask of a sequence's next token can only start once its last token is back from the
device. As soon as a step's calls have returned, the step advances the grammar of each
constrained sequence by its token (`_consume`) and starts the masks of their next tokens, all
in one batch, on the grammars' worker thread (constraints.Grammars.start), then goes on: the
step's outputs (detokenizing, stop strings), the caller's handling of them, the next step's
intake and schedule and its prefill calls all run while llguidance computes, outside the GIL.
The next step waits for the masks only where a call needs them (`_masks`: the decode call, or
a prefill that samples a pipelined sequence). Where the executor takes late masks
(executor_api's "Late masks": the H100 executor runs a sampled entry in two parts), the decode
call does not wait before it starts: the executor launches the forward pass, then asks for the
lanes' masks (`_late_masks`: the job joined, any it does not hold computed), so the wait
overlaps the device's forward pass; `mask_late_wait_s` counts it. A lane whose mask failed
there samples unmasked; its token is dropped and its request ends after the call (`_end_late`,
which leaves alone the lanes a failed call has ended). Where the executor has a masked decode loop
(executor_api's "Masked decode loop"), sequences whose only extra is a grammar keep the device
loop (_masked_loop): their first masks made before the call, then each step's tokens consumed
by their grammars and the next step's masks computed (`masks`) while the device runs the next
step's forward pass, the outputs made after (`progress`), as in the progressive loop; the last
step's masks are those of the next call's first step. A request's first mask is its
grammar's at its start, the same for every request of that grammar: the engine keeps those of
the last FIRST_MASKS grammars, so a new request of a known grammar needs none computed;
otherwise a sequence the pipeline did not cover gets its mask computed in the step, after the
worker's job.
Ownership: while a job runs, its matchers (those of the lives whose `mask` is None) are the
worker's; this thread waits for it (`_join_masks`, `_late_masks`) before it consumes a token or
reads one of them; `mask_wait_s` counts the time it waited outside the device's forward pass,
the part of the mask time not hidden.

Streaming: while any running request streams (Request.stream), a streamed request gets its
tokens every ~stream_interval_s rather than in bursts of decode_loop_steps. Where the executor's
loop is progressive (executor_api's "Progressive decode loop") and the caller takes outputs
while a call runs (Engine.step's `deliver`; or nobody streams), a decode_many call runs each
lane's whole budget and hands its tokens over in groups: of as many steps as fit in half of
`stream_interval_s` at the measured seconds per loop step (at least one) while someone streams,
else the executor's own. Each group's tokens go through advance/_emit and out to the caller
(`deliver`, else the step's outputs) while the device runs the next group, so that work keeps
no device idle. The call ends early (after the group already queued) once a request arrives or
an abort waits, so they wait at most about two groups: the interval, as before. A lane whose
request ends during the call keeps its blocks until the call returns (the device may still
write into them); its later tokens are dropped. Otherwise (no progressive loop, or a streamed
request and no `deliver`, as in Model.generate_stream) a decode_many call runs at most as many
steps as fit in the interval (with nobody streaming, its full length) and hands its tokens over
after it. The per-step time is an exponential mean (weight 1/2 to the newest) over earlier
calls' wall time over the steps they ran, host overhead included; before the first measurement
a group (or a call) runs one step.

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from rvcompile.runtime.constraints import Constraint, Grammars, MaskJob, Matcher
from rvcompile.runtime.executor_api import (
    DeviceError,
    DraftLane,
    Executor,
    KvKind,
    LoopLane,
    Penalties,
    Sampled,
    SampleExtras,
    Sampling,
    SeqChunk,
    Verified,
    decode_loop_steps,
    has_drafter,
    loop_progress,
    masked_loop,
    max_draft_tokens,
    mixes_decode,
    packs_prefill,
    packs_sampled,
    takes_late_masks,
    top_logprobs,
)
from rvcompile.runtime.kv_blocks import PagedKv
from rvcompile.runtime.request_limits import NO_EXTRAS, SEED_MASK, RequestError, RequestLimits
from rvcompile.runtime.scheduler import Schedule, Scheduler, Seq, Work
from rvcompile.runtime.speculative import Speculation, ngram_drafts
from rvcompile.runtime.textstream import TextStream

log = logging.getLogger(__name__)
T = TypeVar("T")
FIRST_MASKS = 64  # grammars whose first mask the engine keeps (Engine._first_masks)


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # strings that end the text (checked on decoded text, excluded)
    ignore_eos: bool = False
    stream: bool = False  # someone watches tokens arrive: bound decode loops (Engine docstring)
    n: int = 1  # samples: sample i samples with seed + i; they share the prompt's whole blocks
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest
    penalties: Penalties = field(default_factory=Penalties)
    stop_token_ids: tuple[int, ...] = ()  # sampling one ends the sample (excluded, like EOS)
    constraint: Constraint | None = None  # a grammar the output must follow (constraints.py)
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
    index: int = 0  # which of the request's n samples
    logprobs: tuple[Sampled, ...] = ()  # with Request.logprobs: one per token of token_ids
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
    packed_prefills: int = 0  # prefill calls that ran several sequences' chunks
    mixed_calls: int = 0  # calls that ran prompt chunks and decode lanes together
    mask_s: float = 0.0  # host seconds spent computing grammar masks (on the worker or not)
    mask_rows: int = 0  # masks computed (about one per constrained sequence per sampling step)
    mask_wait_s: float = 0.0  # of the steps' time, seconds spent waiting for masks (not hidden)
    mask_late_wait_s: float = 0.0  # seconds spent waiting for masks inside decode calls (so in
    # executor_s), while their forward pass ran on the device (hidden as far as it lasted)
    step_s: float = 0.0  # wall seconds inside step()
    executor_s: float = 0.0  # of them, inside executor calls (the device's share, host included)


@dataclass(eq=False)
class _Live:
    request: Request
    seq: Seq
    text: TextStream
    index: int = 0  # sample index
    out_counts: np.ndarray | None = None  # int32 [V]: times each token was generated (penalties)
    in_prompt: np.ndarray | None = None  # bool [V]: the prompt's tokens (repetition penalty)
    matcher: Matcher | None = None  # with a constraint: where its grammar stands
    mask: np.ndarray | None = None  # int32 [words]: the mask of its next token, computed since
    # the matcher last consumed; None: not yet (or being computed by the pending job)
    state: object = None  # drafting with the assistant: the last verify's state to draft from

    @property
    def extras(self) -> bool:
        """Its sampling steps need the sampler's extras (and so single decode steps, or a
        masked decode loop for masks_only)."""
        r = self.request
        return r.logprobs is not None or r.penalties.active or r.constraint is not None

    @property
    def masks_only(self) -> bool:
        """Its only extra is a grammar's mask (a masked decode loop can run it)."""
        r = self.request
        return r.logprobs is None and not r.penalties.active and r.constraint is not None


@dataclass(eq=False)
class _PendingMasks:
    """A mask job on the grammars' worker: the masks of `lives`' next tokens, in order."""

    job: MaskJob
    lives: list[_Live]


@dataclass(eq=False)
class _Late:
    """What a decode call that took its masks late (Engine._late_masks) leaves to end after it."""

    joined: tuple[_PendingMasks, Exception] | None = None  # the pending job, which raised
    failed: list[tuple[_Live, str]] = field(default_factory=list)  # lanes left without a
    # mask (their grammar failed, or computing it raised), and why


@dataclass(eq=False)
class _Held:
    """Samples of an n > 1 request waiting for the first to have prefilled the shared blocks."""

    first: Seq
    shared: int  # prompt tokens in whole blocks, prefilled once
    rest: list[Seq]


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
                 max_model_len: int | None = None, prefill_budget: int | None = None,
                 stream_interval_s: float = 0.1,
                 clock: Callable[[], float] = time.perf_counter,
                 grammars: Grammars | None = None):
        """`stream_interval_s`: the longest a decode loop call should take while a request
        streams (> 0); `clock`: seconds, for measuring those calls; `grammars`: constraints
        over the model's tokenizer (None: constraints refused)."""
        if not stream_interval_s > 0:
            raise ValueError(f"stream_interval_s {stream_interval_s}: expected > 0")
        self.executor, self._decode, self.eos_ids = executor, decode, eos_ids
        self.stream_interval_s, self._clock = stream_interval_s, clock
        self._loop_step_s: float | None = None  # measured seconds per decode-loop step
        self.grammars = grammars
        self.mask_s, self.mask_rows, self.mask_wait_s = 0.0, 0, 0.0
        self.mask_late_wait_s = 0.0
        self._pending: _PendingMasks | None = None  # masks computing on the worker (docstring)
        # grammar -> its first mask (the same for every request of it), the FIRST_MASKS newest
        self._first_masks: dict[str, np.ndarray] = {}
        self.max_num_seqs, self.max_model_len = engine_limits(
            executor.kinds, executor.block_size, executor.max_seqs, executor.max_context,
            max_num_seqs, max_model_len)
        self.limits = RequestLimits(vocab_size, self.max_model_len, top_logprobs(executor),
                                    max_draft_tokens(executor), has_drafter(executor))
        self.vocab_size = vocab_size
        self.kv = PagedKv(executor.kinds, executor.block_size)
        self.scheduler = Scheduler(self.kv, max_num_seqs=self.max_num_seqs,
                                   prefill_buckets=tuple(executor.prefill_buckets),
                                   prefill_budget=prefill_budget or executor.max_chunk)
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._live: dict[str, _Live] = {}  # by Seq id
        self._held: list[_Held] = []
        self._order = itertools.count()
        self.steps = self.preemptions = 0
        self.drafted = self.accepted = self.verify_calls = self.packed_prefills = 0
        self.mixed_calls = 0
        # Where a step's time goes (EngineStats): step_s - executor_s is the engine's own host
        # work, which keeps the device idle unless the executor call is still running.
        self.step_s = self.executor_s = 0.0
        # the step's caller's, for outputs made while a call runs (step's `deliver`)
        self._deliver: Callable[[list[RequestOutput]], None] | None = None
        # while a progressive decode loop runs: sequences ended meanwhile, whose blocks go
        # back once it returns (_remove)
        self._held_removals: list[Seq] | None = None

    # ------------------------------------------------------------------ requests (any thread)

    def add(self, request: Request, max_waiting: int | None = None) -> Request:
        """Queue a request, its fields checked (request_limits: raises RequestError, a
        ValueError), and return it as checked. With max_waiting, raises QueueFull while that
        many requests wait."""
        request = self.limits.check(request)
        if request.constraint is not None:
            if self.grammars is None or not self.limits.top_logprobs:
                raise RequestError(getattr(request.constraint, "param", "response_format"),
                                   "this engine takes no grammar constraints" if
                                   self.grammars is None else NO_EXTRAS)
            request = dataclasses.replace(request,
                                          constraint=self.grammars.check(request.constraint))
        with self._lock:
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if max_waiting is not None and waiting >= max_waiting:
                raise QueueFull(f"the queue is full ({waiting} waiting requests)")
            self._inbox.append(request)
        return request

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
                           drafted=self.drafted, accepted=self.accepted,
                           verify_calls=self.verify_calls,
                           packed_prefills=self.packed_prefills,
                           mixed_calls=self.mixed_calls, mask_s=self.mask_s,
                           mask_rows=self.mask_rows, mask_wait_s=self.mask_wait_s,
                           mask_late_wait_s=self.mask_late_wait_s,
                           step_s=self.step_s, executor_s=self.executor_s)

    # ------------------------------------------------------------------ the loop (one thread)

    def step(self, handoff: Callable[[], None] | None = None,
             deliver: Callable[[list[RequestOutput]], None] | None = None
             ) -> list[RequestOutput]:
        """One step; `handoff` (the caller's, e.g. handing the last step's outputs over) runs
        exactly once: while the step's first device call runs where the executor offers that
        (executor_api, "Handoff"), else before the step. `deliver` takes the outputs a
        progressive decode loop makes while it runs (the module docstring, "Streaming"), as
        soon as they are made; without it they join the returned outputs. Either way a
        request's outputs come in order, the returned ones after the delivered ones."""
        t0 = time.perf_counter()
        self._deliver = deliver
        takes = handoff is not None and hasattr(self.executor, "while_running")
        if takes:
            self.executor.while_running = handoff
        elif handoff is not None:
            handoff()
        try:
            return self._step()
        finally:
            self._deliver = None
            if takes and self.executor.while_running is handoff:  # no call launched: now
                self.executor.while_running = None
                handoff()
            self.step_s += time.perf_counter() - t0

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            inbox, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        outputs: list[RequestOutput] = []
        for r in inbox:
            try:
                self._start(r)
            except Exception as e:  # nothing of it was kept: it ends alone
                log.error("engine: starting request %s failed", r.id, exc_info=e)
                error = f"the engine failed to start this request: {type(e).__name__}: {e}"
                outputs += [RequestOutput(r.id, [], "", True, "error", len(r.prompt_ids), 0, 0,
                                          error, i) for i in range(r.n)]
        for rid in aborts:
            for live in [v for v in self._live.values() if v.request.id == rid]:
                outputs.append(self._finish(live, "abort", []))
        self._release_held()
        sched = self.scheduler.schedule()
        self.preemptions += len(sched.preempted)
        lanes = self._loop_lanes(sched) if not inbox else None
        if lanes is not None:
            self._decode_loop(sched.decodes, lanes, outputs)
        else:
            self._run(sched, outputs)
        self.steps += 1
        return outputs

    def _start(self, r: Request) -> None:
        """r's sequences into the scheduler: one, or n samples. The samples share the prompt's
        whole blocks: the first prefills them, the others join once it has (through the prefix
        cache), and every sample runs the rest of the prompt as decode lanes (Seq.fed)."""
        extras = r.penalties.active
        if r.n == 1:
            seqs = [Seq(r.id, list(r.prompt_ids), r.sampling, next(self._order))]
            if r.speculation is not None:  # request_limits: never with n > 1 or extras
                seqs[0].verify_rows = 1 + r.speculation.num_draft_tokens
                seqs[0].max_len = len(r.prompt_ids) + r.max_tokens
        else:
            shared = (len(r.prompt_ids) - 1) // self.kv.block_size * self.kv.block_size
            seqs = [Seq(f"{r.id}/{i}", list(r.prompt_ids[:shared]),
                        dataclasses.replace(r.sampling, seed=(r.sampling.seed + i) & SEED_MASK),
                        next(self._order), output=list(r.prompt_ids[shared:]),
                        fed=len(r.prompt_ids) - shared) for i in range(r.n)]
        in_prompt = None
        if extras:
            in_prompt = np.zeros(self.vocab_size, bool)
            in_prompt[r.prompt_ids] = True
        matchers = [self.grammars.matcher(r.constraint) if r.constraint else None
                    for _ in seqs]  # first: the one step of _start that may fail
        first = self._first_masks.get(r.constraint.grammar) if r.constraint else None
        for i, (seq, matcher) in enumerate(zip(seqs, matchers, strict=True)):
            counts = np.zeros(self.vocab_size, np.int32) if extras else None
            self._live[seq.id] = _Live(r, seq, TextStream(self._decode, r.stop), i, counts,
                                       in_prompt, matcher, first)
        self.scheduler.add(seqs[0])
        if len(seqs) > 1 and seqs[0].prompt:
            self._held.append(_Held(seqs[0], len(seqs[0].prompt), seqs[1:]))
        else:
            for seq in seqs[1:]:
                self.scheduler.add(seq)

    def _release_held(self) -> None:
        """Held samples into the scheduler once their first sample has prefilled the shared
        blocks (or has ended)."""
        keep = []
        for h in self._held:
            if h.first.cached >= h.shared or h.first.id not in self._live:
                for seq in h.rest:
                    if seq.id in self._live:  # not aborted meanwhile
                        self.scheduler.add(seq)
            else:
                keep.append(h)
        self._held = keep

    def _samples(self, work: Work) -> bool:
        """work's call samples its sequence's next token (it is no prompt chunk or recomputed
        token before the last)."""
        return work.chunk.start + len(work.chunk.tokens) == len(work.seq.tokens)

    def _masks(self, works: list[Work], late: bool = False) -> dict[str, str]:
        """Give every one of `works` (constrained sequences whose calls sample, none in the
        pending job) the mask of its next token where it has none, all in one go on
        llguidance's threads (`late`: while a call's forward pass runs, _late_masks). Returns
        the sequences whose grammar failed, with why."""
        lives = [self._live[w.seq.id] for w in works]
        need = [live for live in lives if live.mask is None]
        if need:
            t0 = time.perf_counter()
            rows = self.grammars.fill([live.matcher for live in need])
            took = time.perf_counter() - t0
            self.mask_s += took
            if late:
                self.mask_late_wait_s += took
            else:
                self.mask_wait_s += took
            self.mask_rows += len(need)
            for live, row in zip(need, rows, strict=True):
                self._set_mask(live, row)
        return {live.seq.id: live.matcher.error for live in lives if live.matcher.error}

    def _join_masks(self, outputs: list[RequestOutput]) -> None:
        """Wait for the pending mask job, if any, and hand its rows to its lives (one that
        ended meanwhile keeps its unused row). If the job raised, its lives that still run
        end with finish_reason "error" (in `outputs`)."""
        t0 = time.perf_counter()
        joined = self._wait_masks()
        self.mask_wait_s += time.perf_counter() - t0
        if joined is not None:
            self._take_masks(*joined, outputs)

    def _wait_masks(self) -> tuple[_PendingMasks, tuple | Exception] | None:
        """Wait for the pending mask job, if any: (the job, its result or what it raised);
        none is pending afterwards."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending, pending.job.result()
        except Exception as e:
            return pending, e

    def _take_masks(self, pending: _PendingMasks, result: tuple | Exception,
                    outputs: list[RequestOutput]) -> None:
        """A joined job's rows to its lives; if it raised, its lives that still run end with
        finish_reason "error" (in `outputs`)."""
        if isinstance(result, Exception):
            alive = [v for v in pending.lives if self._live.get(v.seq.id) is v]
            log.error("engine: grammar masks failed; ending request(s) %s",
                      ", ".join(v.request.id for v in alive), exc_info=result)
            error = f"the engine failed to run this request: {type(result).__name__}: {result}"
            outputs += [self._fail(v, error) for v in alive]
            return
        rows, took = result
        self.mask_s += took
        self.mask_rows += len(pending.lives)
        for live, row in zip(pending.lives, rows, strict=True):
            self._set_mask(live, row)

    def _set_mask(self, live: _Live, row: np.ndarray) -> None:
        """live's next mask is row; a grammar's first one is kept for its later requests."""
        live.mask = row
        if live.matcher.consumed == 0 and not live.matcher.error:
            grammar = live.request.constraint.grammar
            if grammar not in self._first_masks and len(self._first_masks) >= FIRST_MASKS:
                del self._first_masks[next(iter(self._first_masks))]  # the oldest
            self._first_masks[grammar] = row.copy()

    def _consume(self, done: list[tuple[Work, Sampled]],
                 outputs: list[RequestOutput]) -> list[tuple[Work, Sampled]]:
        """Advance each constrained sequence's grammar by the new token its call sampled (every
        token _emit will take: not EOS or a stop id), then start the masks of the next tokens
        of every constrained sequence that will sample again and has none, on the grammars'
        worker. A token its grammar refuses ends its request (in `outputs`); returns the rest
        of `done`."""
        self._join_masks(outputs)  # the worker lets go of the matchers
        kept = []
        for work, sampled in done:
            live = self._live.get(work.seq.id)
            if live is None:  # the pending job failed and ended it
                continue
            if (live.matcher is not None and self._samples(work)
                    and not self._stops(live, sampled.token)):
                live.mask = None
                if not self._guarded("grammar", [work], outputs, self._take, live.matcher,
                                     sampled.token):
                    continue
            kept.append((work, sampled))
        new = {id(live) for live in (self._live[w.seq.id] for w, _ in kept)}
        lives = [live for live in self._live.values()
                 if live.matcher is not None and live.mask is None and not live.matcher.done
                 and live.request.max_tokens - len(live.text.token_ids)
                 - (id(live) in new) > 0]  # a sequence ending on its length samples no more
        if lives:
            t0 = time.perf_counter()  # start hands the GIL to the worker: a wait for masks too
            self._pending = _PendingMasks(self.grammars.start([v.matcher for v in lives]), lives)
            self.mask_wait_s += time.perf_counter() - t0
        return kept

    @staticmethod
    def _take(matcher: Matcher, token: int) -> bool:
        matcher.consume(token)
        return True

    def _stops(self, live: _Live, token: int) -> bool:
        """token ends live's sample unseen (EOS, unless ignored, or one of its stop ids)."""
        r = live.request
        return (token in self.eos_ids and not r.ignore_eos) or token in r.stop_token_ids

    def _ready(self, works: list[Work], outputs: list[RequestOutput],
               late: _Late | None = None) -> list[Work]:
        """works with their sampler extras (_with_extras), their grammar masks made first
        (waiting for the pending job if it holds one of them); a constrained sequence whose
        mask could not be made, or whose grammar failed, ends (in `outputs`) and is left out.
        With `late` (their call takes its masks late: _late_masks) nothing is waited for:
        a mask not made yet is None in its extras."""
        if late is not None:
            return [self._with_extras(w) for w in works]
        need = [w for w in works
                if self._samples(w) and self._live[w.seq.id].matcher is not None]
        if any(self._live[w.seq.id].mask is None for w in need):
            self._join_masks(outputs)  # it may hold them; and one llguidance job at a time
            works = [w for w in works if w.seq.id in self._live]
            need = [w for w in need if w.seq.id in self._live]
        failed = self._guarded("grammar masks", need, outputs, self._masks, need) if need else {}
        if failed is None:  # computing them raised: their requests ended
            failed = {w.seq.id: "" for w in need}
        else:
            for sid, error in failed.items():
                outputs.append(self._fail(self._live[sid], error))
        return [self._with_extras(w) for w in works if w.seq.id not in failed]

    def _with_extras(self, work: Work) -> Work:
        """work with its sequence's sampler extras when its call samples a new token."""
        live = self._live[work.seq.id]
        seq = work.seq
        if not live.extras or not self._samples(work):
            return work
        r = live.request
        pen_ids = pen_counts = None
        if r.penalties.active:
            touched = live.out_counts > 0
            if r.penalties.repetition != 1.0:
                touched |= live.in_prompt
            pen_ids = np.flatnonzero(touched).astype(np.int32)
            pen_counts = live.out_counts[pen_ids]
        extras = SampleExtras(-1 if r.logprobs is None else r.logprobs, r.penalties, pen_ids,
                              pen_counts, live.mask)
        return Work(seq, dataclasses.replace(work.chunk, extras=extras))

    def _prefill(self, chunk: SeqChunk) -> Sampled:
        if chunk.extras is None:
            return Sampled(self.executor.prefill(chunk))
        return self.executor.prefill_sampled(chunk)

    def _prefill_packed(self, chunks: list[SeqChunk]) -> list[Sampled]:
        self.packed_prefills += 1
        if any(c.extras is not None for c in chunks):
            return self.executor.prefill_packed_sampled(chunks)
        return [Sampled(t) for t in self.executor.prefill_packed(chunks)]

    def _packs(self, works: list[Work]) -> list[list[Work]]:
        """The step's prefill works in calls, in order: consecutive chunks packed while they
        fit the largest prefill entry (executor_api, "Packed prefill"), those with extras only
        where the executor packs them (packs_sampled); every other chunk alone."""
        if not packs_prefill(self.executor):
            return [[w] for w in works]
        packs: list[list[Work]] = []
        for w in works:
            if packs and self._packable([*packs[-1], w]):
                packs[-1].append(w)
            else:
                packs.append([w])
        return packs

    def _packable(self, works: list[Work]) -> bool:
        if (any(w.chunk.extras is not None for w in works)
                and not packs_sampled(self.executor)):
            return False
        try:
            rows = self.executor.packed_rows([w.chunk for w in works])
        except ValueError:  # too many, or a chunk of a small entry: it runs alone
            return False
        return rows <= self.executor.prefill_buckets[-1]

    def _decode_lanes(self, works: list[Work], late: _Late | None = None) -> list[Sampled]:
        chunks = [w.chunk for w in works]
        if all(c.extras is None for c in chunks):
            return [Sampled(t) for t in self.executor.decode(chunks)]
        if late is not None:
            return self.executor.decode_late_masks(chunks,
                                                   lambda: self._late_masks(works, late))
        return self.executor.decode_sampled(chunks)

    def _takes_late(self, works: list[Work]) -> _Late | None:
        """A _Late for the decode call of `works` when it takes its grammar masks late
        (executor_api's "Late masks"): the executor offers it and some constrained lane has
        no mask yet (the pending job is computing it); else None (masks made before)."""
        if self.grammars is None or not takes_late_masks(self.executor):
            return None
        for w in works:
            live = self._live[w.seq.id]
            if self._samples(w) and live.matcher is not None and live.mask is None:
                return _Late()
        return None

    def _late_masks(self, works: list[Work], late: _Late) -> list[np.ndarray | None]:
        """The decode call's masks, one per lane of `works` (None: unconstrained), asked for
        by the executor once the call's forward pass runs on the device: the pending job's,
        waited for here, and those it does not hold, computed now. A lane whose mask could not
        be made (its job or grammar failed) samples unmasked and goes into `late`, to end
        after the call (_end_late), not here: a call that then fails ends every lane once."""
        t0 = time.perf_counter()
        joined = self._wait_masks()
        self.mask_late_wait_s += time.perf_counter() - t0
        failed: set[int] = set()  # ids of lives without a mask
        if joined is not None and isinstance(joined[1], Exception):
            late.joined = joined
            failed |= {id(v) for v in joined[0].lives}
        elif joined is not None:
            self._take_masks(*joined, [])  # it succeeded: no output
        need = [w for w in works if self._samples(w) and id(self._live[w.seq.id]) not in failed
                and self._live[w.seq.id].matcher is not None]
        try:
            late.failed += [(self._live[sid], error)
                            for sid, error in self._masks(need, late=True).items()]
        except Exception as e:
            log.error("engine: grammar masks failed", exc_info=e)
            error = f"the engine failed to run this request: {type(e).__name__}: {e}"
            late.failed += [(self._live[w.seq.id], error) for w in need
                            if self._live[w.seq.id].mask is None]
        failed |= {id(live) for live, _ in late.failed}
        masked = {w.seq.id for w in need}
        masks = []
        for w in works:
            live = self._live[w.seq.id]
            masks.append(live.mask if w.seq.id in masked and id(live) not in failed else None)
        return masks

    def _end_late(self, late: _Late, outputs: list[RequestOutput]) -> None:
        """End (in `outputs`) the lanes of a late-mask call whose masks failed, unless the call
        ended them already."""
        if late.joined is not None:
            self._take_masks(*late.joined, outputs)
        for live, error in late.failed:
            if self._live.get(live.seq.id) is live:
                outputs.append(self._fail(live, error))

    def _mixable(self, packs: list[list[Work]], decodes: list[Work]) -> bool:
        """Whether the last prefill pack rides along the decode call (executor_api, "Mixed
        calls"): neither has extras and the executor has a call for them."""
        return bool(packs and decodes and mixes_decode(self.executor)
                    and not any(self._live[w.seq.id].extras for w in decodes)
                    and all(w.chunk.extras is None for w in packs[-1])
                    and self.executor.mixes([w.chunk for w in packs[-1]], len(decodes)))

    def _prefill_decode(self, parts: tuple[list[Work], list[Work]]) -> list[Sampled]:
        pack, decodes = parts
        self.mixed_calls += 1
        tokens = self.executor.prefill_decode([w.chunk for w in pack],
                                              [w.chunk for w in decodes])
        return [Sampled(t) for t in (*tokens[0], *tokens[1])]

    def _run(self, sched: Schedule, outputs: list[RequestOutput]) -> None:
        """The schedule's prefill calls, then its decode call; each token through advance.
        Where the executor mixes, the last prefill pack runs in the decode call."""
        done: list[tuple[Work, Sampled]] = []
        packs = self._packs(self._ready(sched.prefills, outputs))
        mixed = packs.pop() if self._mixable(packs, sched.decodes) else None
        for pack in packs:
            if len(pack) > 1:
                done += self._guarded("prefill", pack, outputs, _pairs, pack,
                                      self._timed(self._prefill_packed),
                                      [w.chunk for w in pack]) or []
                continue
            w = pack[0]
            token = self._guarded("prefill", [w], outputs, self._timed(self._prefill), w.chunk)
            if token is not None:
                done.append((w, token))
        late = self._takes_late(sched.decodes)
        decodes = self._ready(sched.decodes, outputs, late)
        if mixed is not None:  # without extras, _ready has ended none of them (nor is late)
            works = [*mixed, *decodes]
            done += self._guarded("prefill and decode", works, outputs, _pairs, works,
                                  self._timed(self._prefill_decode), (mixed, decodes)) or []
        elif decodes:
            tokens = self._guarded("decode", decodes, outputs, _pairs, decodes,
                                   self._timed(lambda ws: self._decode_lanes(ws, late)), decodes)
            done += tokens or []
        if late is not None:
            self._end_late(late, outputs)
        if self.grammars is not None:
            done = self._consume(done, outputs)
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
        probs: dict[str, object] = {}  # the assistant's Drafted.draft_probs, for the ratio rule
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
                                 self._timed(lambda ls: self.executor.draft(ls, n)), lanes)
            for (w, room), d in made or []:
                drafts[w.seq.id] = list(d.tokens[:room])
                probs[w.seq.id] = d.draft_probs
        works = [w for w in works if w.seq.id in self._live]  # a failed draft ended some
        if not works:
            return
        plan = [(w, drafts.get(w.seq.id, [])) for w in works]
        lanes = [dataclasses.replace(w.chunk, tokens=[*w.chunk.tokens, *d],
                                     draft_probs=probs.get(w.seq.id)) for w, d in plan]
        self.verify_calls += 1
        results = self._guarded("verify", works, outputs, _pairs, plan,
                                self._timed(self.executor.verify), lanes)
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
        # Its last kept row's state, once tokens follow: while it recomputes known tokens after a
        # preemption it keeps the state it had (so its next round drafts what it would have).
        if new and verified.states and live.request.speculation.method == "assistant":
            live.state = verified.states[seq.cached - w.chunk.start - 1]
        # The new tokens join the output one at a time, as from decode steps, so a request
        # that ends part-way (EOS, a stop string) counts only the tokens up to there.
        del seq.output[len(seq.output) - len(new):]
        parts = []
        for token in new:
            seq.output.append(token)
            parts.append(self._emit(live, Sampled(token)))
            if parts[-1].finished:
                break
        return _merge(parts) if parts else None

    def _advance(self, work: Work, sampled: Sampled) -> RequestOutput | None:
        new = self.scheduler.advance(work, sampled.token)
        return None if new is None else self._emit(self._live[work.seq.id], sampled)

    def _timed(self, call: Callable[..., T]) -> Callable[..., T]:
        """`call` (an executor call), its wall time added to executor_s."""
        def timed(*args):
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.executor_s += time.perf_counter() - t0
        return timed

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
            # those that ended meanwhile (a progressive loop's finished lanes) have ended
            lives = [live for live in lives if self._live.get(live.seq.id) is live]
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
                or self._held
                or any(w.seq.cached + 1 < w.seq.num_tokens or self._live[w.seq.id].extras
                       and not (self._live[w.seq.id].masks_only and masked_loop(self.executor))
                       for w in sched.decodes)):
            return None
        stream = any(self._live[w.seq.id].request.stream for w in sched.decodes)
        if stream and not self._progressive(stream):
            steps = self._streaming_steps(steps)
        lanes = []
        for w in sched.decodes:
            live = self._live[w.seq.id]
            stops = ((frozenset() if live.request.ignore_eos else self.eos_ids)
                     | frozenset(live.request.stop_token_ids))
            if len(stops) > self.executor.decode_loop_stops:
                return None
            budget = min(steps, live.request.max_tokens - (len(w.seq.output) - w.seq.fed))
            if not self.kv.ensure(w.seq.blocks, w.seq.cached, w.seq.cached + budget):
                return None
            chunk = dataclasses.replace(w.chunk, tables=self.kv.tables(w.seq.blocks))
            lanes.append(LoopLane(chunk, budget, stops))
        return lanes

    def _streaming_steps(self, steps: int, interval: float | None = None) -> int:
        """Loop steps that fit in `interval` (default stream_interval_s): 1 to `steps`, 1
        before any measurement."""
        if self._loop_step_s is None:
            return 1
        if self._loop_step_s <= 0:  # a clock too coarse to see a step: every step fits
            return steps
        interval = self.stream_interval_s if interval is None else interval
        fit = int(interval / self._loop_step_s + 1e-6)  # 0.03 / 0.01 is 2.99..
        return max(1, min(steps, fit))

    def _decode_loop(self, decodes: list[Work], lanes: list[LoopLane],
                     outputs: list[RequestOutput]) -> None:
        """Run the lanes in one decode_many call. Their tokens go through advance/_emit one by
        one, as if from single decode steps: group by group while the call runs where the loop
        is progressive (_progressive_loop), else after it, one RequestOutput per request."""
        t0 = self._clock()
        if any(self._live[w.seq.id].matcher is not None for w in decodes):
            results = self._masked_loop(decodes, lanes, outputs)
        elif self._progressive(any(self._live[w.seq.id].request.stream for w in decodes)):
            results = self._progressive_loop(decodes, lanes, outputs)
        else:
            results = self._guarded("decode_many", decodes, outputs, _pairs,
                                    list(zip(decodes, lanes, strict=True)),
                                    self._timed(self.executor.decode_many), lanes)
            for (w, lane), tokens in results or []:
                out = self._guarded("output", [w], outputs, self._advance_lane, w, lane, tokens)
                if out is not None:
                    outputs.append(out)
        ran = max((len(tokens) for _, tokens in results or []), default=0)
        if ran:  # the loop ends when its longest lane does
            per_step = (self._clock() - t0) / ran
            self._loop_step_s = per_step if self._loop_step_s is None else (
                0.5 * self._loop_step_s + 0.5 * per_step)

    def _progressive(self, stream: bool) -> bool:
        """Whether this step's decode loop runs progressively: the executor offers it, and a
        streamed request's outputs can reach its consumer while the call runs (a `deliver`);
        without one (Model.generate_stream) streamed calls are cut to the interval instead,
        since their outputs could only leave at the step's end."""
        return loop_progress(self.executor) and (self._deliver is not None or not stream)

    def _progressive_loop(self, decodes: list[Work], lanes: list[LoopLane],
                          outputs: list[RequestOutput]) -> list[tuple] | None:
        """decode_many with progress: each group's tokens through advance/_emit while the next
        group runs, their outputs delivered at once (step's `deliver`); the call stops early
        once a request or an abort waits, or every lane's request has ended. Requests that end
        meanwhile keep their sequences' blocks until the call returns (_remove). Returns
        decode_many's (work, lane) and tokens, or None if it failed."""
        stream = any(self._live[w.seq.id].request.stream for w in decodes)
        # half the interval: an arrival waits for the group it was seen in and the one queued
        group = self._streaming_steps(max(lane.budget for lane in lanes),
                                      self.stream_interval_s / 2) if stream else 0
        progress = self._loop_progress(decodes, lanes, outputs)
        return self._holding_blocks(lambda: self._guarded(
            "decode_many", decodes, outputs, _pairs, list(zip(decodes, lanes, strict=True)),
            self._timed(lambda ls: self.executor.decode_many(ls, progress, group)), lanes))

    def _masked_loop(self, decodes: list[Work], lanes: list[LoopLane],
                     outputs: list[RequestOutput]) -> list[tuple] | None:
        """decode_many_masked (executor_api's "Masked decode loop") for lanes some of which
        follow a grammar: their first masks made before the call (a lane whose mask fails
        ends and is left out), each later one in `masks` from the token before it, which the
        lane's grammar consumes there (_consume's work, step by step); the tokens then go
        through advance/_emit in `progress`, as in _progressive_loop."""
        self._join_masks(outputs)  # the worker lets go of the matchers masks() consumes into
        # (a job that failed ended its lanes)
        ready = {w.seq.id: w for w in self._ready(
            [w for w in decodes if w.seq.id in self._live], outputs)}
        pairs = [(ready[w.seq.id], dataclasses.replace(lane, chunk=dataclasses.replace(
                     lane.chunk, extras=ready[w.seq.id].chunk.extras)))
                 for w, lane in zip(decodes, lanes, strict=True) if w.seq.id in ready]
        if not pairs:
            return None
        decodes, lanes = [w for w, _ in pairs], [lane for _, lane in pairs]
        lives = [self._live[w.seq.id] for w in decodes]

        def masks(new: list[list[int]]) -> list[np.ndarray | None]:
            made: list[RequestOutput] = []
            took = []  # the works whose grammar consumed a token now
            for w, live, tokens in zip(decodes, lives, new, strict=True):
                if (tokens and live.matcher is not None and self._live.get(w.seq.id) is live
                        and not self._stops(live, tokens[-1])):
                    live.mask = None
                    if self._guarded("grammar", [w], made, self._take, live.matcher,
                                     tokens[-1]):
                        took.append(w)
            # every token its request will take samples under a mask: none past max_tokens
            need = [w for w in took if not self._live[w.seq.id].matcher.done
                    and self._live[w.seq.id].matcher.consumed
                    < self._live[w.seq.id].request.max_tokens]
            failed = self._guarded("grammar masks", need, made, self._masks, need, True)
            for sid, error in (failed or {}).items():
                made.append(self._fail(self._live[sid], error))
            self._hand(made, outputs)
            return [live.mask if live.matcher is not None and self._live.get(w.seq.id) is live
                    else None for w, live in zip(decodes, lives, strict=True)]

        progress = self._loop_progress(decodes, lanes, outputs)
        return self._holding_blocks(lambda: self._guarded(
            "decode_many", decodes, outputs, _pairs, pairs,
            self._timed(lambda ls: self.executor.decode_many_masked(ls, masks, progress)),
            lanes))

    def _loop_progress(self, decodes: list[Work], lanes: list[LoopLane],
                       outputs: list[RequestOutput]) -> Callable[[list[list[int]]], bool]:
        """A decode loop's progress: each lane's new tokens through advance/_emit, the outputs
        handed on at once (_hand); whether to go on (no arrival or abort waits and some lane's
        request still runs)."""
        lives = [self._live[w.seq.id] for w in decodes]
        got = [0] * len(lanes)  # tokens each lane has had

        def progress(new: list[list[int]]) -> bool:
            made: list[RequestOutput] = []
            for i, tokens in enumerate(new):
                w = decodes[i]
                if not tokens or self._live.get(w.seq.id) is not lives[i]:  # ended: dropped
                    continue
                out = self._guarded("output", [w], made, self._advance_lane, w, lanes[i],
                                    tokens, got[i])
                got[i] += len(tokens)
                if out is not None:
                    made.append(out)
            self._hand(made, outputs)
            with self._lock:
                if self._inbox or self._aborts:
                    return False
            return any(self._live.get(w.seq.id) is live
                       for w, live in zip(decodes, lives, strict=True))

        return progress

    def _hand(self, made: list[RequestOutput], outputs: list[RequestOutput]) -> None:
        """Outputs made while a call runs: to the step's `deliver`, else with the step's."""
        if not made:
            return
        if self._deliver is not None:
            self._deliver(made)
        else:
            outputs.extend(made)

    def _holding_blocks(self, call: Callable[[], T]) -> T:
        """call() (a progressive loop), the blocks of sequences ended meanwhile given back once
        it returns (_remove)."""
        self._held_removals = []
        try:
            return call()
        finally:
            held, self._held_removals = self._held_removals, None
            for seq in held:
                self.scheduler.remove(seq)

    def _advance_lane(self, w: Work, lane: LoopLane, tokens: list[int],
                      before: int = 0) -> RequestOutput:
        """A lane's tokens after the `before` it already had, through advance/_emit."""
        if not 0 < len(tokens) <= lane.budget - before:
            raise RuntimeError(f"decode_many returned {before + len(tokens)} tokens for a lane "
                               f"of budget {lane.budget}")
        live, parts = self._live[w.seq.id], []
        for token in tokens:
            # A lane never recomputes (_loop_lanes), so each token is the sequence's next.
            self.scheduler.advance_by(w.seq, 1, token)
            parts.append(self._emit(live, Sampled(token)))
            if parts[-1].finished:
                break
        return _merge(parts)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with finish_reason "error". Raises RuntimeError if KV blocks are
        still held afterwards (the engine's state is lost)."""
        with self._lock:
            inbox, self._inbox, self._aborts = self._inbox, [], []
        outputs = [RequestOutput(r.id, [], "", True, "error", len(r.prompt_ids), 0, 0, error, i)
                   for r in inbox for i in range(r.n)]
        outputs += [self._fail(live, error) for live in list(self._live.values())]
        self._held = []
        held = {k: n for k, n in self.stats().kv_used.items() if n}
        if held or self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError(f"KV blocks {held} and {len(self.scheduler.running)} running, "
                               f"{len(self.scheduler.waiting)} waiting sequences remain after "
                               "ending every request")
        return outputs

    def _emit(self, live: _Live, sampled: Sampled) -> RequestOutput:
        r, token = live.request, sampled.token
        if self._stops(live, token):
            return self._finish(live, "stop", [])
        if live.out_counts is not None:
            live.out_counts[token] += 1
        lps = (sampled,) if r.logprobs is not None else ()
        text, hit = live.text.add(token)
        if live.matcher is not None:  # _consume (or a masked loop's masks) gave it the token
            if live.matcher.consumed != len(live.text.token_ids):
                raise RuntimeError(f"token {token} bypassed its sequence's grammar")
            hit = hit or live.matcher.done  # the grammar is complete: only EOS could follow
        if hit:
            return self._finish(live, "stop", [token], text, lps)
        if len(live.text.token_ids) >= r.max_tokens:
            return self._finish(live, "length", [token], text, lps)
        return self._output(live, [token], text, None, logprobs=lps)

    def _finish(self, live: _Live, reason: str, token_ids: list[int], text: str = "",
                logprobs: tuple[Sampled, ...] = ()) -> RequestOutput:
        self._remove(live.seq)
        del self._live[live.seq.id]
        if reason in ("stop", "length"):
            text += live.text.finish()
        return self._output(live, token_ids, text, reason, logprobs=logprobs)

    def _fail(self, live: _Live, error: str) -> RequestOutput:
        """End live's request with finish_reason "error", whatever state a failure left it in
        (its sequence running, waiting, or already removed)."""
        self._remove(live.seq)
        self._live.pop(live.seq.id, None)
        return self._output(live, [], "", "error", error)

    def _remove(self, seq: Seq) -> None:
        """seq out of the scheduler, its blocks back to the pools: at once, or while a
        progressive decode loop runs, once it returns (the device may still write them)."""
        if self._held_removals is not None:
            self._held_removals.append(seq)
        else:
            self.scheduler.remove(seq)

    @staticmethod
    def _output(live: _Live, token_ids: list[int], text: str, reason: str | None,
                error: str = "", logprobs: tuple[Sampled, ...] = ()) -> RequestOutput:
        seq = live.seq
        return RequestOutput(live.request.id, token_ids, text, reason is not None, reason,
                             len(seq.prompt) + seq.fed, len(seq.output) - seq.fed,
                             seq.cached_prompt, error, live.index, logprobs,
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
                               text="".join(p.text for p in parts),
                               logprobs=tuple(x for p in parts for x in p.logprobs))


class EngineThread:
    """Runs engine steps in a background thread while there is work, handing each output to the
    sink its request was submitted with (sinks run on the engine thread: keep them short), then
    calling `after_outputs` once (a consumer that batches what its sinks were given hands it
    over there: one wake-up of an event loop per step rather than one per output): while the
    next step's first device call runs (Engine.step's handoff), or at once when no step follows.
    Outputs a step makes while its progressive decode loop runs (Engine.step's deliver) go to
    their sinks at once, and `after_outputs` follows each batch of them: the device is busy then.

    A step that raises ends every request with an error. After a DeviceError, or when ending
    them does not give every KV block back, the engine is lost: `error` says why (and the log),
    and submit refuses new requests. After anything else (an engine bug) it keeps serving."""

    def __init__(self, engine: Engine, after_outputs: Callable[[], None] | None = None):
        self.engine = engine
        self._after_outputs = after_outputs
        self._cv = threading.Condition()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._left: dict[str, int] = {}  # request id -> its samples not finished yet
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
            checked = self.engine.add(request, max_waiting)
            self._sinks[request.id] = sink
            self._left[request.id] = checked.n
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
        # after_outputs of the last step's outputs, not yet called: the next step calls it
        # while its first device call runs (Engine.step's handoff), so the consumer's work on
        # them (an event loop writing streams) overlaps the device rather than this thread's
        # host work; with no step to come it is called before waiting
        pending = False
        while True:
            if pending and not self.engine.has_work():
                self._hand_over()
                pending = False
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self.engine.has_work())
                stopped = self._stopped
            if stopped:
                if pending:
                    self._hand_over()
                return
            try:
                outputs = self.engine.step(self._hand_over if pending else None,
                                           self._deliver)
            except Exception as e:
                outputs = self._recover(e)
            pending = self._dispatch(outputs) and self._after_outputs is not None
            if self.error:
                if pending:
                    self._hand_over()
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> bool:
        """Each output to its request's sink; whether any went to one."""
        with self._cv:
            sinks = [(self._route(o), o) for o in outputs if o.id in self._sinks]
        for sink, out in sinks:
            try:
                sink(out)
            except Exception as e:  # its consumer is gone: stop generating for it
                log.error("engine: the sink of request %s failed; aborting it", out.id,
                          exc_info=e)
                self.abort(out.id)
        return bool(sinks)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs made while a call runs: to their sinks, and handed over, now."""
        if self._dispatch(outputs) and self._after_outputs is not None:
            self._hand_over()

    def _hand_over(self) -> None:
        try:
            self._after_outputs()
        except Exception as e:  # the consumer is gone (its loop closed)
            log.error("engine: handing over a step's outputs failed", exc_info=e)

    def _route(self, out: RequestOutput) -> Callable[[RequestOutput], None]:
        """out's sink (under _cv), dropped once every sample of its request has finished, or
        at its first error (the request's other samples are aborted: it failed)."""
        sink = self._sinks[out.id]
        if out.finished:
            self._left[out.id] -= 1
            if self._left[out.id] <= 0 or out.finish_reason == "error":
                del self._sinks[out.id], self._left[out.id]
                if out.finish_reason == "error":
                    self.engine.abort(out.id)
        return sink

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
