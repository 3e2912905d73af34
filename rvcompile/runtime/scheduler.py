"""The scheduler: which sequences run in the next step, and in which KV blocks. Pure Python, no
arrays; the engine executes what it returns and reports back through `advance`.

One step is a decode call over every running sequence past its prompt (one token each), a
verify call over every speculating one (its last token and room for drafts, see below), plus
prefill chunks (one sequence each, oldest first) up to a budget of tokens, so a long prompt is
cut into chunks between decode steps and never stalls the running streams. Waiting sequences are
admitted oldest first, reusing their longest cached prefix (PagedKv.match), while the running
set is below its cap and the pools can hold their first chunk. When a running sequence needs a
block and none is free, the newest running sequence is preempted: its blocks go back to the pool
and it waits to be recomputed, through the prefix cache where its blocks are still there.

Every sequence is computed the same way whatever else runs (executor_api, "Reproducibility"):
its prompt in chunks aligned to multiples of max_chunk, each run with the rows of its aligned
chunk even when a prefix hit starts it part-way; every later token as one decode lane, also when
a preempted sequence is recomputed. Block hashes carry this recipe, so a prefix hit holds
exactly what the sequence would have computed itself.

Speculating sequences (`Seq.verify_rows` > 0, runtime/speculative.py) run every token past
their prompt through verify calls instead (the artifact's one verify shape), never decode, so
their recipe is fixed too: after the prompt, "verify rows". Each verify reserves blocks for the
last token and as many drafts as fit (`piece`); the engine fills in the drafts, and `verified`
records the rows it keeps. Rows of rejected drafts are never counted as cached, so their blocks
are neither hashed nor shared (later writes overwrite them). A preempted speculating sequence
recomputes its generated tokens but the last as verify rows too, up to verify_rows at a time;
its last token then starts the round it would have run (with its drafts: a sampled assistant
request's tokens depend on them).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rvcompile.runtime.executor_api import Sampling, SeqChunk
from rvcompile.runtime.kv_blocks import PagedKv, SeqBlocks
from rvcompile.runtime.speculative import accepted


@dataclass(eq=False)
class Seq:
    """One request's sequence, as the scheduler tracks it."""

    id: str
    prompt: list[int]
    sampling: Sampling
    order: int  # arrival order: lower runs first and is preempted last
    output: list[int] = field(default_factory=list)  # tokens generated so far
    cached: int = 0  # tokens whose KV are in the sequence's blocks
    blocks: SeqBlocks | None = None  # None while waiting
    preemptions: int = 0
    cached_prompt: int = 0  # prompt tokens the prefix cache supplied at first admission
    verify_rows: int = 0  # speculating: rows per verify (1 + its drafts); 0: decode lanes
    max_len: int = 0  # prompt + max_tokens: no verify reaches past it (with verify_rows)
    drafted: int = 0  # drafts verified so far
    accepted: int = 0  # of them, accepted
    fed: int = 0  # the first `fed` tokens of output are the request's prompt tail, run as
    # decode lanes (a sample of an n > 1 request: its prompt's whole blocks are shared)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens), without building them (the engine asks every step for every lane)."""
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end], copying only those."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p:end - p]
        return self.prompt[start:end] + (self.output[:end - p] if end > p else [])

    @property
    def recomputing(self) -> bool:
        """Past its prompt with generated tokens still to run again (after a preemption)."""
        return not self.in_prompt and self.cached + 1 < self.num_tokens

    @property
    def in_prompt(self) -> bool:
        """Still running its prompt (prefill chunks); afterwards it runs as a decode lane."""
        return self.cached < len(self.prompt)


@dataclass(frozen=True)
class TokenView:
    """A Seq's tokens as PagedKv.commit reads them (len, and slices of whole blocks), without
    building the list: commit runs for every lane at every token and reads a block's tokens
    only when one completes."""

    seq: Seq

    def __len__(self) -> int:
        return self.seq.num_tokens

    def __getitem__(self, s: slice) -> list[int]:
        return self.seq.token_slice(s.start, s.stop)


@dataclass(frozen=True)
class Work:
    seq: Seq
    chunk: SeqChunk


@dataclass
class Schedule:
    prefills: list[Work]  # one executor prefill call each
    decodes: list[Work]  # one executor decode call for all
    verifies: list[Work]  # speculating sequences: one verify call for all (known tokens only)
    preempted: list[Seq]  # sent back to waiting by this schedule


@dataclass
class PrefixStats:
    queried: int = 0  # prompt tokens admitted (first admissions only)
    hit: int = 0  # of them, served from the prefix cache


class Scheduler:
    def __init__(self, kv: PagedKv, *, max_num_seqs: int, prefill_buckets: tuple[int, ...],
                 prefill_budget: int):
        self.kv = kv
        self.max_num_seqs, self.buckets = max_num_seqs, prefill_buckets
        self.max_chunk = prefill_buckets[-1]
        self.prefill_budget = prefill_budget
        self.waiting: list[Seq] = []  # by order
        self.running: list[Seq] = []  # by order
        self.prefix = PrefixStats()

    def add(self, seq: Seq) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def remove(self, seq: Seq) -> None:
        """Drop a finished or aborted sequence and give back its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.blocks is not None:
            self.kv.free(seq.blocks)
            seq.blocks = None

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> Schedule:
        preempted: list[Seq] = []
        self._admit()
        decodes: list[Seq] = []
        for seq in list(self.running):
            if seq in self.running and not seq.in_prompt and self._reserve(
                    seq, self.piece(seq)[0], preempted, decodes, allow_self=True):
                decodes.append(seq)
        prefills: list[Seq] = []
        budget = self.prefill_budget
        for seq in list(self.running):
            if seq not in self.running or not seq.in_prompt:
                continue
            n, _ = self.piece(seq)
            if n > budget and prefills or not self._reserve(seq, n, preempted, decodes,
                                                            allow_self=False):
                break
            prefills.append(seq)
            budget -= n
        return Schedule([self._work(s) for s in prefills],
                        [self._work(s) for s in decodes if not s.verify_rows],
                        [self._work(s) for s in decodes if s.verify_rows], preempted)

    def piece(self, seq: Seq) -> tuple[int, int]:
        """(tokens, rows) of seq's next call: the rest of its prompt's aligned chunk, in that
        chunk's rows; past the prompt, one token (rows 0: a decode lane), or for a speculating
        sequence the positions its verify may write: its known tokens to recompute, else its
        last token and the drafts that fit before max_len (rows 0)."""
        if not seq.in_prompt:
            if not seq.verify_rows:
                return 1, 0
            if seq.recomputing:  # up to its last token, which its next round runs
                return min(seq.verify_rows, seq.num_tokens - 1 - seq.cached), 0
            return max(1, min(seq.verify_rows, seq.max_len - seq.num_tokens)), 0
        start = seq.cached // self.max_chunk * self.max_chunk
        end = min(start + self.max_chunk, len(seq.prompt))
        return end - seq.cached, self._rows(end - start)

    def _rows(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def recipe(self, seq: Seq) -> Callable[[int], bytes]:
        """recipe(j): how seq computes block j, as (rows, row count) runs: its prompt chunks'
        rows, 0 for decode lanes, -1 for verify rows."""
        bs, chunk, prompt = self.kv.block_size, self.max_chunk, len(seq.prompt)
        generated = -1 if seq.verify_rows else 0

        def recipe(j: int) -> bytes:
            runs, r, end = [], j * bs, (j + 1) * bs
            while r < end:
                if r >= prompt:
                    runs += [generated, end - r]
                    break
                start = r // chunk * chunk
                stop = min(start + chunk, prompt, end)
                runs += [self._rows(min(start + chunk, prompt) - start), stop - r]
                r = stop
            return np.asarray(runs, np.int32).tobytes()

        return recipe

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.blocks, seq.cached = self.kv.match(seq.tokens, self.recipe(seq))
            first, _ = self.piece(seq)
            # Room for the first chunk, and after it a block per kind for every running
            # sequence's next step, so admitting does not at once preempt someone.
            reserve = len(self.running)
            if not self.kv.ensure(seq.blocks, seq.cached, seq.cached + first) or any(
                    pool.num_free < reserve for pool in self.kv.pools.values()):
                self.kv.free(seq.blocks)
                seq.blocks, seq.cached = None, 0
                return
            if seq.preemptions == 0:
                self.prefix.queried += len(seq.prompt)
                self.prefix.hit += seq.cached
                seq.cached_prompt = seq.cached
            self.waiting.pop(0)
            bisect.insort(self.running, seq, key=lambda s: s.order)

    def _reserve(self, seq: Seq, n: int, preempted: list[Seq], scheduled: list[Seq],
                 allow_self: bool) -> bool:
        """Blocks for seq's next n tokens, preempting newer sequences while the pools are
        short. False if seq cannot run this step (preempted itself when allow_self)."""
        while not self.kv.ensure(seq.blocks, seq.cached, seq.cached + n):
            victim = self.running[-1]
            if victim is seq and not allow_self:
                return False
            self._preempt(victim)
            preempted.append(victim)
            if victim in scheduled:
                scheduled.remove(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.kv.free(seq.blocks)
        seq.blocks, seq.cached = None, 0
        seq.preemptions += 1
        self.add(seq)

    def _work(self, seq: Seq) -> Work:
        n, rows = self.piece(seq)
        end = seq.cached + n
        if seq.verify_rows and not seq.in_prompt:  # known tokens only; step: row 0's sample
            end = min(end, seq.num_tokens)
            step = seq.cached + 1 - len(seq.prompt)
        else:
            step = end - len(seq.prompt)
        return Work(seq, SeqChunk(seq.token_slice(seq.cached, end), seq.cached,
                                  self.kv.tables(seq.blocks), seq.sampling, step, rows))

    # ------------------------------------------------------------------ results

    def advance(self, work: Work, token: int) -> int | None:
        """Record that work's chunk ran and sampled `token`. Returns the token if it is the
        sequence's next one (its last token ran), else None."""
        return self.advance_by(work.seq, len(work.chunk.tokens), token)

    def advance_by(self, seq: Seq, n: int, token: int) -> int | None:
        """advance, for a chunk of seq's next n tokens (a decode loop's steps, one by one)."""
        seq.cached += n
        new = None
        if seq.cached == seq.num_tokens:
            seq.output.append(token)
            new = token
        self.kv.commit(seq.blocks, TokenView(seq), seq.cached, self.recipe(seq))
        return new

    def verified(self, work: Work, drafts: list[int], target: list[int]) -> list[int]:
        """Record that work's verify ran its known tokens then `drafts`, and that `target[i]`
        is the target's token after row i. Keeps the known rows and the drafts that match
        (speculative.accepted); returns the sequence's new tokens: those drafts and the
        target's token after them, or none while it recomputes known tokens."""
        seq, known = work.seq, len(work.chunk.tokens)
        if len(target) != known + len(drafts):
            raise RuntimeError(f"verify returned {len(target)} tokens for {known} + "
                               f"{len(drafts)} rows")
        m = accepted(drafts, target[known - 1:]) if drafts else 0
        seq.cached += known + m
        new: list[int] = []
        if seq.cached == seq.num_tokens + m:  # the last known token ran: new tokens follow
            new = [*drafts[:m], target[known - 1 + m]]
            seq.output += new
            seq.drafted += len(drafts)
            seq.accepted += m
        self.kv.commit(seq.blocks, TokenView(seq), seq.cached, self.recipe(seq))
        return new
