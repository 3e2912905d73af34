"""The host side of a kernel-schedule artifact (H100 target): the executor of
runtime/executor_api.py over a KernelSchedule. It picks the entry point for a call, fills the io
fields (tokens, positions, one block-table row per token row and KV kind, sampling parameters)
and reads the results back. The device it drives only offers `write(offset, bytes)`,
`read(offset, nbytes)` and `run(entry)`: the CUDA device (h100.py) or the CPU reference
(targets/h100/reference_executor.py; tests compose the two).

The engine owns the block ids; the pools hold the device's `kv_blocks[kind]` blocks per kind,
chosen when the device was made (h100.py: at load, from free memory or as asked).
Padding rows get position -1 (no cache write) and see one key, so they stay finite.

The decode loop (`decode_many`, executor_api's "Decode loop"): every decode entry ends with
decode_advance (targets/h100/rows.py), which moves each lane with budget left on to its next
step in the io fields (its sampled token as input, position, length and RNG step one on) and
logs the step's tokens in io `loop_tokens` ([L, B] for B rows). So the io is written once with each
lane's budget, and the entry replays back to back, LOOP_GROUP steps between token reads (all
of them when no lane has a stop id): no host work between steps. A lane that reaches its
budget turns into a padding row (position -1); one that samples a stop id runs on to its
budget (its later tokens are dropped here; it writes KV only into the blocks its budget
owns), and the call ends at the first read where every lane has ended. Each step is a decode
call of the call's lanes at the call's width (an ended lane's row stays, as padding).
Artifacts built before decode_advance (no `loop_tokens` io field) offer no decode loop.
The loop is progressive (executor_api's "Progressive decode loop"): the steps are launched in
groups (LOOP_GROUP, or as the caller asks), and group g's rows of `loop_tokens` are read while
group g + 1 runs, through the device's `read_later` (an asynchronous copy and an event) where
it has one; a device without it (the CPU reference) has run each group by the time it returns
from run, so a plain read serves.

The sampler's extras (schedule version 7, `top_logprobs` > 0): prefill_sampled and
decode_sampled run the sampled entries, writing the lanes' SampleExtras into the sample_io
region (kernel_schedule.SamplerIo) with the io in one copy, and read the token, its
log-probability and the top ones back in one read. An older schedule has none (top_logprobs
0: the engine refuses requests that need them, request_limits.NO_EXTRAS).

Late masks (executor_api's "Late masks"): decode_late_masks and prefill_late_masks run a sampled
entry in two parts where the device offers run_part: the io written and the part before the
sampler launched (forward pass and head, which read no sample_io: KernelSchedule.sampler_split),
then the caller's masks() while the device runs it, then sample_io written with those masks and
the sampler part run. The tokens are the one-part entry's, bit for bit (the same launches in the
same order).

The masked decode loop (executor_api's "Masked decode loop"): sampled_decode_{B} entries end
with decode_advance too (in their sampler part), so decode_many_masked replays a sampled entry
in its two parts step after step, the io written once: step s + 1's forward part is queued
behind step s's sampler, then step s's tokens read (`read_later`), the caller's masks for step
s + 1 taken and written into sample_io (the read waited for the copy of the step before's) and
step s + 1's sampler launched. Artifacts whose sampled entries lack decode_advance do not offer
it.

Speculative decoding (executor_api's "Speculative decoding"): `verify` runs a lane's token and
drafts as rows of a decode-like entry; with an assistant drafter (schedule version 9) it also
returns each row's state and `draft` runs the draft entries; from version 10 sampled drafts
carry draft_probs and verify accepts them by the ratio rule on the device (the section below
says how).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

import numpy as np

from rvcompile.artifacts.kernel_schedule import (
    ADVANCE_KERNEL,
    RATIO_LANES_FIELD,
    SAMPLED,
    KernelSchedule,
)
from rvcompile.runtime.executor_api import (
    Drafted,
    DraftLane,
    KvKind,
    LoopLane,
    Sampled,
    SampleExtras,
    Sampling,
    SeqChunk,
    Verified,
)

DECODE_LOOP_STOPS = 64  # most stop ids per lane (checked on the host: any number would do)
LOOP_GROUP = 8  # decode_many's steps between token reads while a lane may stop early


def schedule_kinds(schedule: KernelSchedule, blocks: dict[str, int]) -> dict[str, KvKind]:
    """The schedule's KV kinds as the engine sees them, with blocks[kind] blocks each."""
    return {k.name: KvKind(k.name, k.table_width, k.ring, k.window or None, blocks[k.name])
            for k in schedule.kv.kinds}


class ScheduleDevice(Protocol):
    kv_blocks: dict[str, int]  # each KV kind's pool blocks, as the device was made

    def write(self, offset: int, data: bytes) -> None: ...

    def read(self, offset: int, nbytes: int) -> bytes: ...

    def run(self, entry: str) -> None: ...

    # Optional (progressive decode loop): read_later(offset, nbytes) queues a copy of those
    # bytes behind everything run so far and returns a function that waits for it and returns
    # them; at most two may be outstanding, each fetched before the next but one is made.

    # Optional (late masks): run_part(entry, part) runs one part of a sampled entry,
    # "forward" then "sampler" (KernelSchedule.part). run and run_part may return before the
    # device is done; read waits for everything run before it.


class ScheduledExecutor:
    """Executor (runtime/executor_api.py) over a KernelSchedule and a ScheduleDevice."""

    def __init__(self, schedule: KernelSchedule, device: ScheduleDevice):
        self.schedule, self.device = schedule, device
        s = schedule
        self.max_context, self.max_chunk = s.max_context, s.max_chunk
        self.block_size = s.kv.block_size
        self.kinds = schedule_kinds(s, device.kv_blocks)
        self._io_field = {k.name: k.io_field for k in s.kv.kinds}
        self.prefill_buckets = tuple(sorted(e.rows for e in s.entries.values()
                                            if e.name.startswith("prefill_")))
        self.decode_buckets = tuple(sorted(e.rows for e in s.entries.values()
                                           if e.name.startswith("decode_")))
        self.max_seqs = self.decode_buckets[-1]
        # row counts a verify call may run in: the decode entries', then the verify entries'
        self._verify_widths = tuple(sorted({*self.decode_buckets, *(
            e.rows for e in s.entries.values() if e.name.startswith("verify_"))}))
        # steps decode_advance can log; a call never runs more than max_chunk steps (the
        # sliding rings' room ahead)
        history = s.io.get("loop_tokens")
        self.decode_loop_steps = 0 if history is None else min(history.shape[0], self.max_chunk)
        self.decode_loop_stops = DECODE_LOOP_STOPS
        self.loop_progress = True  # executor_api's "Progressive decode loop"
        # the io bytes every call writes: all but the draft entries' fields, which come last and
        # only draft calls write
        self._io_bytes = (s.io["draft_state"].offset - s.io_offset if s.has_drafter
                          else s.io_bytes)
        self._runs = 0  # entries run so far: a DeviceRows reads only until the next one
        self.prefill_packing = s.prefill_packing  # None: one sequence per prefill call
        self.prefill_seqs = s.prefill_seqs
        # executor_api's "Handoff": called once right after the next entry is launched
        self.while_running: Callable[[], None] | None = None
        self.mixed_shapes = s.mixed_shapes  # (P, B) of the mixed entries (prefill_decode)
        # the ratio region (version 10) holds the last draft call's distributions: a
        # ScheduleDraftProbs is good until the next draft call
        self.has_ratio = s.ratio is not None
        self._draft_calls = 0

    # -- io

    def _io(self, rows: int, chunks: Sequence[SeqChunk], tokens, positions, chunk_of_row,
            last_rows=(0,), seq_len=None, io_bytes: int | None = None,
            sample_of_row=None) -> bytes:
        """The io region's first `io_bytes` (default: all but the draft fields) for a call of
        `rows` rows; seq_len defaults to each row's position + 1 (1 for padding); the sampling
        fields' row i is chunk sample_of_row[i]'s (default: chunk_of_row)."""
        s = self.schedule
        io = bytearray(io_bytes or self._io_bytes)

        def put(name: str, values) -> None:
            f = s.io[name]
            arr = np.asarray(values, np.dtype(f.dtype))
            start = f.offset - s.io_offset
            io[start:start + arr.nbytes] = arr.tobytes()

        positions = np.asarray(positions, np.int32)
        put("tokens", tokens)
        put("positions", positions)
        put("seq_len", np.where(positions >= 0, positions + 1, 1) if seq_len is None
            else seq_len)
        put("last_row", last_rows)
        for kind in self.kinds.values():
            try:  # one copy of every lane's table (kv_blocks keeps them as int32 arrays)
                tables = np.asarray([c.tables[kind.name] for c in chunks], np.int32)
            except ValueError:  # tables of different lengths
                tables = np.zeros((0, 0), np.int32)
            if (tables.shape != (len(chunks), kind.table_width) or tables.min() < 0
                    or tables.max() >= kind.num_blocks):
                raise ValueError(f"block table for {kind.name!r} must hold "
                                 f"{kind.table_width} ids in [0, {kind.num_blocks})")
            put(self._io_field[kind.name], tables[chunk_of_row])
        sample_of_row = chunk_of_row if sample_of_row is None else sample_of_row
        samp = [chunks[i].sampling for i in sample_of_row]
        for x in samp:
            if not (np.isfinite(x.temperature) and x.temperature >= 0 and x.top_k >= 0
                    and 0 < x.top_p <= 1):
                raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and top_p in "
                                 f"(0, 1], not {x}")
        put("temperature", [x.temperature for x in samp])
        put("top_k", [x.top_k for x in samp])
        put("top_p", [x.top_p for x in samp])
        put("seed", [x.seed for x in samp])
        put("step", [chunks[i].step for i in sample_of_row])
        return bytes(io)

    def _call(self, entry: str, io: bytes, output: str, count: int, dtype) -> np.ndarray:
        self.device.write(self.schedule.io_offset, io)
        self._run(entry)
        return self._read(f"{entry}.{output}", count, dtype)

    def _run(self, entry: str) -> None:
        self._runs += 1
        self.device.run(entry)
        if self.while_running is not None:  # executor_api's "Handoff": once, then cleared
            handoff, self.while_running = self.while_running, None
            handoff()

    def _read(self, output: str, count: int, dtype) -> np.ndarray:
        """The first `count` values of an output of the entry just run."""
        f = self.schedule.outputs[output]
        nbytes = count * np.dtype(dtype).itemsize
        return np.frombuffer(self.device.read(f.offset, nbytes), dtype).copy()

    def _chunk_rows(self, chunk: SeqChunk, rows: int):
        n = len(chunk.tokens)
        if not 0 < n <= rows:
            raise ValueError(f"chunk of {n} tokens for an entry of {rows} rows")
        if chunk.start + n > self.max_context:
            raise ValueError(f"positions up to {chunk.start + n} exceed the context "
                             f"{self.max_context}")
        toks = np.zeros(rows, np.int32)
        toks[:n] = chunk.tokens
        pos = np.full(rows, -1, np.int32)
        pos[:n] = chunk.start + np.arange(n)
        return toks, pos

    # -- entry points

    def _entry_rows(self, chunk: SeqChunk) -> int:
        """The prefill entry a chunk runs in alone: its SeqChunk.rows, else the smallest
        holding it."""
        n = len(chunk.tokens)
        t = chunk.rows or next((b for b in self.prefill_buckets if b >= n), None)
        if t is None or t not in self.prefill_buckets:
            raise ValueError(f"no prefill entry of {t or n} rows (buckets: "
                             f"{', '.join(map(str, self.prefill_buckets))})")
        return t

    def _prefill_io(self, chunk: SeqChunk) -> tuple[int, bytes]:
        """(the rows, the io) of a prefill call of this chunk."""
        t = self._entry_rows(chunk)
        toks, pos = self._chunk_rows(chunk, t)
        n = len(chunk.tokens)
        last = np.full(self.prefill_seqs, -1, np.int32)
        last[0] = n - 1
        return t, self._io(t, [chunk], toks, pos, np.zeros(t, np.int64), last_rows=last,
                           sample_of_row=np.zeros(t, np.int64))

    def prefill(self, chunk: SeqChunk) -> int:
        t, io = self._prefill_io(chunk)
        return int(self._call(f"prefill_{t}", io, "out_tokens", 1, np.int32)[0])

    def packed_rows(self, chunks: Sequence[SeqChunk]) -> int:
        """The rows a prefill_packed call of these chunks needs (each chunk from a multiple of
        the packing's align); ValueError where they cannot share a call."""
        p = self.prefill_packing
        if p is None:
            raise ValueError("this artifact's prefill entries run one sequence a call")
        if not 0 < len(chunks) <= p.seqs:
            raise ValueError(f"{len(chunks)} chunks; a packed prefill takes 1..{p.seqs}")
        rows = 0
        for c in chunks:
            if self._entry_rows(c) < p.min_rows:
                raise ValueError(f"a chunk of a {self._entry_rows(c)}-row prefill entry; packed "
                                 f"chunks run in entries of at least {p.min_rows} rows")
            rows = -(-rows // p.align) * p.align + len(c.tokens)
        return rows

    def prefill_packed(self, chunks: Sequence[SeqChunk]) -> list[int]:
        """Several sequences' prompt chunks in one prefill call (executor_api, "Packed
        prefill"): each chunk's rows from a multiple of the packing's align, in the smallest
        prefill entry of at least min_rows holding them all; each chunk's sampled token."""
        t, io = self._packed_io(chunks)
        got = self._call(f"prefill_{t}", io, "out_tokens", len(chunks), np.int32)
        return [int(x) for x in got]

    @property
    def packs_sampled(self) -> bool:
        """prefill_packed_sampled is offered: the schedule packs and has sampled entries."""
        return self.prefill_packing is not None and self.schedule.sampler is not None

    def prefill_packed_sampled(self, chunks: Sequence[SeqChunk]) -> list[Sampled]:
        """prefill_packed through sampled_prefill_{T}, each chunk's extras applied to its
        sampled row (row i: chunk i's, as prefill_sampled applies one chunk's to row 0)."""
        if not self.packs_sampled:
            raise ValueError("this artifact packs no sampled prefill (no packing, or no "
                             "sampled entries)")
        t, io = self._packed_io(chunks)
        return self._call_sampled(f"sampled_prefill_{t}", io, chunks,
                                  self.prefill_seqs)[:len(chunks)]

    def _packed_io(self, chunks: Sequence[SeqChunk]) -> tuple[int, bytes]:
        """(the rows, the io) of a packed prefill call of these chunks."""
        need = self.packed_rows(chunks)
        p = self.prefill_packing
        t = next((b for b in self.prefill_buckets if b >= max(need, p.min_rows)), None)
        if t is None:
            raise ValueError(f"packed chunks need {need} rows; the largest prefill entry has "
                             f"{self.prefill_buckets[-1]}")
        toks, pos, chunk_of_row, last = self._packed_rows_io(chunks, t)
        sample_of_row = np.minimum(np.arange(t), len(chunks) - 1)
        return t, self._io(t, chunks, toks, pos, chunk_of_row, last_rows=last,
                           sample_of_row=sample_of_row)

    def mixed_entry(self, chunks: Sequence[SeqChunk], lanes: int) -> tuple[int, int] | None:
        """(P, B) of the smallest mixed entry taking the chunks packed and `lanes` lanes (the
        decode width decode would run them at), or None."""
        b = next((x for x in self.decode_buckets if x >= lanes), None)
        try:
            need = self.packed_rows(chunks)
        except ValueError:  # too many chunks, or a chunk of a small entry
            return None
        return next(((p, w) for p, w in self.mixed_shapes
                     if w == b and p >= need and lanes > 0), None)

    def mixes(self, chunks: Sequence[SeqChunk], lanes: int) -> bool:
        return self.mixed_entry(chunks, lanes) is not None

    def prefill_decode(self, chunks: Sequence[SeqChunk],
                       lanes: Sequence[SeqChunk]) -> tuple[list[int], list[int]]:
        """Packed prompt chunks (rows 0..P-1, laid out as prefill_packed lays them) and decode
        lanes (rows P..P+B-1, as decode lays them) in one mixed_{P}_{B} call (executor_api,
        "Mixed calls")."""
        shape = self.mixed_entry(chunks, len(lanes))
        if shape is None:
            raise ValueError(f"no mixed entry takes {len(chunks)} chunks of "
                             f"{[len(c.tokens) for c in chunks]} tokens and {len(lanes)} lanes")
        p, b = shape
        s = self.prefill_seqs
        toks, pos, chunk_of_row, last = self._packed_rows_io(chunks, p)
        lane_toks, lane_pos = self._lane_rows(lanes, b)
        n = len(chunks)
        lane_of_row = n + np.minimum(np.arange(b), len(lanes) - 1)
        io = self._io(p + b, [*chunks, *lanes], np.concatenate([toks, lane_toks]),
                      np.concatenate([pos, lane_pos]),
                      np.concatenate([chunk_of_row, lane_of_row]),
                      last_rows=np.concatenate([last, p + np.arange(b, dtype=np.int32)]),
                      sample_of_row=np.concatenate([np.minimum(np.arange(s), n - 1),
                                                    lane_of_row]))
        got = self._call(f"mixed_{p}_{b}", io, "out_tokens", s + b, np.int32)
        return [int(x) for x in got[:n]], [int(x) for x in got[s:s + len(lanes)]]

    def _lane_rows(self, lanes: Sequence[SeqChunk], b: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and positions of `b` decode rows holding these lanes (padding: -1)."""
        if any(len(lane.tokens) != 1 for lane in lanes):
            raise ValueError("a decode lane runs exactly one token")
        toks = np.zeros(b, np.int32)
        pos = np.full(b, -1, np.int32)
        # one conversion each rather than an item assignment per lane (256 lanes a step)
        toks[:len(lanes)] = [lane.tokens[0] for lane in lanes]
        pos[:len(lanes)] = [lane.start for lane in lanes]
        return toks, pos

    def _packed_rows_io(self, chunks: Sequence[SeqChunk], t: int):
        """Tokens, positions, chunk of each row and io last_row [S] of `t` rows holding the
        chunks packed (each from a multiple of the packing's align)."""
        p = self.prefill_packing
        toks = np.zeros(t, np.int32)
        pos = np.full(t, -1, np.int32)
        chunk_of_row = np.zeros(t, np.int64)
        last = np.full(p.seqs, -1, np.int32)
        row = 0
        for i, c in enumerate(chunks):
            row = -(-row // p.align) * p.align
            ctoks, cpos = self._chunk_rows(c, len(c.tokens))
            n = len(c.tokens)
            toks[row:row + n], pos[row:row + n] = ctoks, cpos
            chunk_of_row[row:] = i
            last[i] = row + n - 1
            row += n
        return toks, pos, chunk_of_row, last

    def _decode_io(self, lanes: Sequence[SeqChunk]) -> tuple[int, bytes]:
        """(the width, the io) of a decode call of these lanes."""
        if not 0 < len(lanes) <= self.max_seqs:
            raise ValueError(f"{len(lanes)} decode lanes; the schedule takes 1.."
                             f"{self.max_seqs}")
        b = next(x for x in self.decode_buckets if x >= len(lanes))
        toks, pos = self._lane_rows(lanes, b)
        chunk_of_row = np.minimum(np.arange(b), len(lanes) - 1)
        return b, self._io(b, lanes, toks, pos, chunk_of_row)

    def decode(self, lanes: Sequence[SeqChunk]) -> list[int]:
        b, io = self._decode_io(lanes)
        got = self._call(f"decode_{b}", io, "out_tokens", b, np.int32)
        return [int(x) for x in got[:len(lanes)]]

    def decode_many(self, lanes: Sequence[LoopLane],
                    progress: Callable[[list[list[int]]], bool] | None = None,
                    group: int = 0) -> list[list[int]]:
        self._check_loop(lanes, group)
        b, io = self._decode_io([lane.chunk for lane in lanes])
        s = self.schedule
        io = bytearray(io)
        budget = s.io["loop_budget"].offset - s.io_offset
        io[budget:budget + 4 * len(lanes)] = np.asarray([x.budget for x in lanes],
                                                        np.int32).tobytes()
        self.device.write(s.io_offset, bytes(io))
        entry, history = f"decode_{b}", s.io["loop_tokens"]
        steps = max(x.budget for x in lanes)
        group = group or (LOOP_GROUP if any(x.stop_ids for x in lanes) else steps)
        read_later = getattr(self.device, "read_later", None) or self._read_now
        out: list[list[int]] = [[] for _ in lanes]
        ended = [False] * len(lanes)
        launched, pending = 0, deque()  # steps launched; (steps, fetch) of groups to read

        def launch() -> None:
            nonlocal launched
            n = min(group, steps - launched)
            for _ in range(n):
                self._run(entry)
            pending.append((n, read_later(history.offset + launched * b * 4, n * b * 4)))
            launched += n

        launch()
        go_on = True
        while pending:
            if go_on and launched < steps:
                launch()  # the next group queued before this one's tokens are waited for
            n, fetch = pending.popleft()
            new = _take_rows(np.frombuffer(fetch(), np.int32).reshape(n, b), lanes, out, ended)
            go_on = go_on and not all(ended)
            if progress is not None and not progress(new):
                go_on = False
        return out

    # -- the masked decode loop (executor_api's "Masked decode loop")

    @cached_property
    def masked_loop(self) -> bool:
        """decode_many_masked is offered: late masks, a decode loop, and every sampled decode
        entry ends with decode_advance (in schedules built since it does)."""
        return self.late_masks and self.decode_loop_steps > 0 and all(
            e.launches and getattr(e.launches[-1], "kernel", None) == ADVANCE_KERNEL
            for name, e in self.schedule.entries.items()
            if name.startswith(SAMPLED + "decode_"))

    def decode_many_masked(self, lanes: Sequence[LoopLane],
                           masks: Callable[[list[list[int]]], Sequence[np.ndarray | None]],
                           progress: Callable[[list[list[int]]], bool] | None = None
                           ) -> list[list[int]]:
        """decode_many over sampled_decode_{B}, a step at a time, each lane sampled under its
        token mask: step 0's from its chunk's extras, step s's from masks(step s - 1's
        tokens), asked for while step s's forward part runs; then progress(those tokens),
        once step s's sampler and step s + 1's forward part are queued."""
        if not self.masked_loop:
            raise ValueError("this executor offers no masked decode loop (its sampled decode "
                             "entries lack decode_advance, or it takes no late masks): rebuild "
                             "the artifact")
        self._check_loop(lanes, 0)
        for lane in lanes:
            e = lane.chunk.extras
            if e is not None and (e.top_logprobs >= 0 or e.penalties.active
                                  or e.pen_ids is not None):
                raise ValueError("a masked decode loop's lanes take a token mask only (no "
                                 "log-probabilities or penalties)")
        chunks = [lane.chunk for lane in lanes]
        b, io = self._decode_io(chunks)
        s, entry = self.schedule, f"sampled_decode_{b}"
        io = bytearray(io.ljust(s.io_bytes, b"\0"))
        at = s.io["loop_budget"].offset - s.io_offset
        io[at:at + 4 * len(lanes)] = np.asarray([x.budget for x in lanes], np.int32).tobytes()
        self.device.write(s.io_offset, bytes(io) + self._sample_io(chunks))
        history = s.io["loop_tokens"]
        steps = max(x.budget for x in lanes)
        read_later = getattr(self.device, "read_later", None) or self._read_now
        out: list[list[int]] = [[] for _ in lanes]
        ended = [False] * len(lanes)

        def forward() -> None:
            self._runs += 1
            self.device.run_part(entry, "forward")

        def sample(step: int) -> Callable[[], bytes]:
            self.device.run_part(entry, "sampler")
            return read_later(history.offset + step * b * 4, b * 4)

        forward()
        fetch, step, go_on = sample(0), 0, True
        forwards = 1  # forward parts launched: step s's is, once forwards > s
        if steps > 1:
            forward()  # queued behind step 0's sampler: the device runs on meanwhile
            forwards += 1
        while fetch is not None:
            try:
                new = _take_rows(np.frombuffer(fetch(), np.int32).reshape(1, b), lanes, out,
                                 ended)
                got = list(masks(new))
                if len(got) != len(lanes):
                    raise ValueError(f"{len(got)} masks for {len(lanes)} lanes")
                fetch = None
                if forwards > step + 1 and not all(ended):  # (else it runs unsampled)
                    step += 1
                    self.device.write(s.sampler.offset, self._sample_io(
                        [_with_mask(c, m) for c, m in zip(chunks, got, strict=True)]))
                    fetch = sample(step)
                    if go_on and forwards < steps:
                        forward()
                        forwards += 1
            except BaseException:
                # the device may still run what was launched; the next call's io must not be
                # staged before that is done (a read waits for it)
                self.device.read(s.outputs[f"{entry}.out_tokens"].offset, 4)
                raise
            if progress is not None and not progress(new):
                go_on = False
        return out

    def _check_loop(self, lanes: Sequence[LoopLane], group: int) -> None:
        """ValueError for lanes or a group size decode_many cannot run."""
        if not self.decode_loop_steps:
            raise ValueError("this artifact was built before the decode loop (its decode "
                             "entries lack decode_advance): rebuild it")
        for lane in lanes:
            if not 1 <= lane.budget <= self.decode_loop_steps:
                raise ValueError(f"lane budget {lane.budget}: decode_many runs 1 to "
                                 f"{self.decode_loop_steps} steps")
            if len(lane.stop_ids) > self.decode_loop_stops:
                raise ValueError(f"{len(lane.stop_ids)} stop token ids; decode_many takes at "
                                 f"most {self.decode_loop_stops}")
        if group < 0:
            raise ValueError(f"group {group}: decode_many runs groups of at least one step")

    def _read_now(self, offset: int, nbytes: int) -> Callable[[], bytes]:
        """read_later for a device without it: read at once (what it ran has finished)."""
        data = self.device.read(offset, nbytes)
        return lambda: data

    def logits(self, chunk: SeqChunk) -> np.ndarray:
        t = self.max_chunk
        toks, pos = self._chunk_rows(chunk, t)
        io = self._io(t, [chunk], toks, pos, np.zeros(t, np.int64))
        n, v = len(chunk.tokens), self.schedule.vocab_size
        return self._call(f"logits_{t}", io, "logits", n * v, np.float32).reshape(n, v)

    # -- speculative decoding (executor_api, "Speculative decoding")
    #
    # A verify call is a decode call: a decode entry runs each row at its own position with its
    # own block-table row and sampling step, writing every row's KV before any attention reads
    # the cache (targets/h100/lower.py), so a lane's token and drafts at positions p..p+k are
    # k + 1 rows of it, row i sampled at step + i as `decode` would sample it. The rows of all
    # lanes, padded to the narrowest entry holding them: decode_{B}, or beyond the widest one
    # the schedule's verify_{R} (built with --num-draft-tokens K). With an assistant drafter
    # (schedule version 9) those entries also output each row's state (the target's
    # final-normed hidden state), which verify reads back with the tokens (a ScheduleState:
    # float32 [H] on the host), and `draft` runs draft_{B} (targets/h100/draft.py): K drafter
    # steps from each lane's token and state, written into the io with the call's other
    # inputs. From schedule version 10 a draft call also leaves, in the ratio region, the
    # logits each draft was sampled from and its sampling record (targets/h100/ratio.py), and
    # returns for each sampled lane a ScheduleDraftProbs naming its rows there; verify writes
    # the lanes that bring one into io ratio_lanes ({first row, drafts, lane, draft width}),
    # and the entry's spec_ratio rewrites their tokens by the ratio rule (the accepted drafts,
    # the new token, -1) after the pick. Other lanes, and every lane of a version 9 schedule
    # (draft returns no draft_probs there), are checked by exact match.

    @property
    def max_draft_tokens(self) -> int:
        """K: most drafts one verify lane takes (the schedule's draft_tokens; 0: no verify)."""
        return self.schedule.draft_tokens

    @property
    def has_drafter(self) -> bool:
        """`draft` is offered: the schedule has an assistant drafter's entries."""
        return self.schedule.has_drafter

    def verify(self, lanes: Sequence[SeqChunk]) -> list[Verified]:
        k = self.max_draft_tokens
        if not k:
            raise ValueError("the artifact was built without speculative entry points "
                             "(rvcompile build --num-draft-tokens K)")
        if not 0 < len(lanes) <= self.max_seqs:
            raise ValueError(f"{len(lanes)} verify lanes; the schedule takes 1..{self.max_seqs}")
        rows: list[SeqChunk] = []  # one per row: its lane, its own sampling step
        toks, pos = [], []
        by_ratio = []  # io ratio_lanes rows: {first row, drafts, draft lane, draft width}
        for lane in lanes:
            n = len(lane.tokens)
            if not 1 <= n <= k + 1:
                raise ValueError(f"verify lane of {n} tokens: a token and 0 to {k} drafts")
            d = self._draft_probs(lane)
            if d is not None and n > 1 and lane.sampling.temperature > 0:
                by_ratio.append((len(rows), n - 1, d.lane, d.width))
            if lane.start + n > self.max_context:
                raise ValueError(f"positions up to {lane.start + n} exceed the context "
                                 f"{self.max_context}")
            rows += [replace(lane, step=lane.step + i) for i in range(n)]
            toks += list(lane.tokens)
            pos += range(lane.start, lane.start + n)
        width = next(b for b in self._verify_widths if b >= len(rows))
        pad = width - len(rows)
        io = self._io(width, rows, np.asarray(toks + [0] * pad, np.int32),
                      np.asarray(pos + [-1] * pad, np.int32),
                      np.minimum(np.arange(width), len(rows) - 1))
        if by_ratio:
            f = self.schedule.io[RATIO_LANES_FIELD]
            at = f.offset - self.schedule.io_offset
            words = np.asarray(by_ratio, np.int32).tobytes()
            io = io[:at] + words + io[at + len(words):]
        entry = f"decode_{width}" if width in self.decode_buckets else f"verify_{width}"
        if self.has_drafter:  # [states | out_tokens] side by side: one read
            h = self.schedule.io["draft_state"].shape[1]
            raw = self._call(entry, io, "states", width * (h + 1), np.float32)
            got = raw[width * h:].view(np.int32).tolist()
            states = [ScheduleState(x) for x in raw[:len(rows) * h].reshape(len(rows), h)]
        else:
            got = self._call(entry, io, "out_tokens", width, np.int32).tolist()
        out, at = [], 0
        for lane in lanes:
            n = len(lane.tokens)
            out.append(Verified(got[at:at + n], tuple(states[at:at + n])
                                if self.has_drafter else ()))
            at += n
        return out

    def _draft_probs(self, lane: SeqChunk) -> ScheduleDraftProbs | None:
        """A verify lane's draft_probs, checked: from this executor's last draft call, for
        the drafts that call made with the lane's sampling parameters."""
        d = lane.draft_probs
        if d is None:
            return None
        if not self.has_ratio:
            raise ValueError("draft_probs (the ratio rule) are not taken by this executor: it "
                             "accepts drafts by exact match (its schedule has no ratio region: "
                             "no drafter, or built before version 10)")
        if not isinstance(d, ScheduleDraftProbs) or d.owner is not self:
            raise ValueError("a verify lane's draft_probs come from this executor's draft")
        if d.call != self._draft_calls:
            raise ValueError("a verify lane's draft_probs are from an earlier draft call; the "
                             "device keeps only the last one's")
        drafts = tuple(lane.tokens[1:])
        if drafts != d.tokens[:len(drafts)]:
            raise ValueError(f"a verify lane's drafts {list(drafts)} are not the ones its "
                             f"draft_probs came with ({list(d.tokens)})")
        if lane.sampling != d.sampling:
            raise ValueError("a verify lane's sampling parameters differ from its drafts' "
                             "(draft_probs)")
        return d

    def draft(self, lanes: Sequence[DraftLane], n: int) -> list[Drafted]:
        """n (1..K) drafts per lane from draft_{B} (B the narrowest decode width holding the
        lanes), which always runs K steps; the first n are returned. Drafted.logits and
        .states read the entry's outputs from the device when asked, until the next call."""
        if not self.has_drafter:
            raise ValueError("the artifact has no assistant drafter (rvcompile build "
                             "--assistant)")
        k = self.max_draft_tokens
        if not 1 <= n <= k:
            raise ValueError(f"{n} drafts: draft makes 1 to {k}")
        if not 0 < len(lanes) <= self.max_seqs:
            raise ValueError(f"{len(lanes)} draft lanes; the schedule takes 1..{self.max_seqs}")
        s = self.schedule
        state_field, h = s.io["draft_state"], s.io["draft_state"].shape[1]
        b = next(x for x in self.decode_buckets if x >= len(lanes))
        toks = np.zeros(b, np.int32)
        pos = np.full(b, -1, np.int32)
        states = np.zeros((s.max_seqs, h), np.float32)
        steps = np.zeros((k, s.max_seqs), np.int32)
        for i, lane in enumerate(lanes):
            c = lane.chunk
            if len(c.tokens) != 1 or not isinstance(lane.state, ScheduleState) \
                    or lane.state.values.shape != (h,):
                raise ValueError("a draft lane is one token and a state from this executor's "
                                 "verify")
            if not 1 <= c.start < self.max_context:
                raise ValueError(f"a draft lane's position {c.start} is outside [1, "
                                 f"{self.max_context})")
            toks[i], pos[i] = c.tokens[0], c.start
            states[i] = lane.state.values
            steps[:, i] = c.step + np.arange(k)
        chunks = [lane.chunk for lane in lanes]
        # a drafter query at q sees the target's keys [.., q - 1]: seq_len q
        io = bytearray(self._io(b, chunks, toks, pos, np.minimum(np.arange(b), len(lanes) - 1),
                                seq_len=np.where(pos >= 0, pos, 1), io_bytes=s.io_bytes))
        for f, arr in ((state_field, states), (s.io["draft_step"], steps)):
            at = f.offset - s.io_offset
            io[at:at + arr.nbytes] = arr.tobytes()
        entry = f"draft_{b}"
        got = self._call(entry, bytes(io), "tokens", k * b, np.int32).reshape(k, b)
        runs, v = self._runs, s.vocab_size
        self._draft_calls += 1
        out = []
        for i, c in enumerate(chunks):
            tokens = got[:n, i].tolist()
            probs = (ScheduleDraftProbs(self, self._draft_calls, i, b, tuple(tokens),
                                        c.sampling)
                     if self.has_ratio and c.sampling.temperature > 0 else None)
            out.append(Drafted(tokens, DeviceRows(self, runs, f"{entry}.logits", (k, b, v), i, n),
                               DeviceRows(self, runs, f"{entry}.states", (k, b, h), i, n),
                               probs))
        return out

    # -- the sampler's extras (sampled entries; module docstring)

    @property
    def top_logprobs(self) -> int:
        """K (executor_api.top_logprobs): 0 when the schedule has no sampled entries."""
        return self.schedule.sampler.top_logprobs if self.schedule.sampler else 0

    def prefill_sampled(self, chunk: SeqChunk) -> Sampled:
        """prefill, with chunk.extras applied (sampled_prefill_{T})."""
        t, io = self._prefill_io(chunk)
        return self._call_sampled(f"sampled_prefill_{t}", io, [chunk], self.prefill_seqs)[0]

    def decode_sampled(self, lanes: Sequence[SeqChunk]) -> list[Sampled]:
        """decode, with each lane's extras applied (sampled_decode_{B}); padding rows neutral."""
        b, io = self._decode_io(lanes)
        return self._call_sampled(f"sampled_decode_{b}", io, lanes, b)[:len(lanes)]

    def _call_sampled(self, entry: str, io: bytes, lanes: Sequence[SeqChunk],
                      rows: int) -> list[Sampled]:
        """Write io and the lanes' extras with one copy, run `entry`, read its `rows` results
        (out_tokens, logprob, top_ids, top_logprobs lie side by side: one read)."""
        if self.schedule.sampler is None:
            raise ValueError("this artifact's schedule has no sampled entry points (built "
                             "before them); rebuild it")
        extras = self._sample_io(lanes)
        # sample_io starts where the whole io region ends (past the draft fields, if any)
        io = io.ljust(self.schedule.io_bytes, b"\0")
        self.device.write(self.schedule.io_offset, io + extras)
        self._run(entry)
        return self._read_sampled(entry, lanes, rows)

    def _read_sampled(self, entry: str, lanes: Sequence[SeqChunk], rows: int) -> list[Sampled]:
        """The `rows` results of sampled entry `entry` just run, as the lanes' extras ask."""
        sampler = self.schedule.sampler
        outs = self.schedule.outputs
        first, last = outs[f"{entry}.out_tokens"], outs[f"{entry}.top_logprobs"]
        want = [c.extras.top_logprobs if c.extras else -1 for c in lanes]
        if max(want) < 0:  # tokens only
            raw = self.device.read(first.offset, 4 * rows)
            return [Sampled(int(t)) for t in np.frombuffer(raw, np.int32)]
        raw = self.device.read(first.offset, last.offset + last.nbytes - first.offset)
        k = sampler.top_logprobs
        tok = np.frombuffer(raw, np.int32, rows)
        lp = np.frombuffer(raw, np.float32, rows, 4 * rows)
        ids = np.frombuffer(raw, np.int32, rows * k, 8 * rows).reshape(rows, k)
        vals = np.frombuffer(raw, np.float32, rows * k, 8 * rows + 4 * rows * k).reshape(rows, k)
        return [Sampled(int(tok[i])) if n < 0 else
                Sampled(int(tok[i]), float(lp[i]),
                        tuple(zip(ids[i, :n].tolist(), vals[i, :n].tolist(), strict=True)))
                for i, n in enumerate(want)]

    # -- late masks (executor_api's "Late masks")

    @cached_property
    def late_masks(self) -> bool:
        """decode_late_masks and prefill_late_masks are offered: the device runs an entry's
        parts (run_part) and every sampled entry splits (KernelSchedule.sampler_split)."""
        s = self.schedule
        return (s.sampler is not None and hasattr(self.device, "run_part")
                and all(s.sampler_split(name) is not None for name in s.entries
                        if name.startswith(SAMPLED)))

    def decode_late_masks(self, lanes: Sequence[SeqChunk],
                          masks: Callable[[], Sequence[np.ndarray | None]]) -> list[Sampled]:
        """decode_sampled, the lanes' token masks given by masks() while the forward part of
        sampled_decode_{B} runs."""
        b, io = self._decode_io(lanes)
        return self._call_late(f"sampled_decode_{b}", io, lanes, b, masks)[:len(lanes)]

    def prefill_late_masks(self, chunk: SeqChunk,
                           masks: Callable[[], Sequence[np.ndarray | None]]) -> Sampled:
        """prefill_sampled, the chunk's token mask given by masks() (one) while the forward
        part of sampled_prefill_{T} runs."""
        t, io = self._prefill_io(chunk)
        return self._call_late(f"sampled_prefill_{t}", io, [chunk], self.prefill_seqs,
                               masks)[0]

    def _call_late(self, entry: str, io: bytes, lanes: Sequence[SeqChunk], rows: int,
                   masks: Callable[[], Sequence[np.ndarray | None]]) -> list[Sampled]:
        """_call_sampled in two parts: io written and the entry's forward part launched, which
        the device runs while masks() runs here; then the lanes' extras, each with its mask
        from masks(), written and the sampler part run."""
        if not self.late_masks:
            raise ValueError("this executor takes no late masks (its device runs no entry "
                             "parts, or its schedule has no sampled entries that split)")
        self.device.write(self.schedule.io_offset, io)
        self._runs += 1
        self.device.run_part(entry, "forward")
        try:
            got = list(masks())
            if len(got) != len(lanes):
                raise ValueError(f"{len(got)} late masks for {len(lanes)} lanes")
            lanes = [_with_mask(c, m) for c, m in zip(lanes, got, strict=True)]
            extras = self._sample_io(lanes)
        except BaseException:
            # a read waits for the device: the next call's io must not be staged while the
            # copy of this one may still be pending
            self.device.read(self.schedule.outputs[f"{entry}.out_tokens"].offset, 4)
            raise
        self.device.write(self.schedule.sampler.offset, extras)
        self.device.run_part(entry, "sampler")
        return self._read_sampled(entry, lanes, rows)

    def _sample_io(self, lanes: Sequence[SeqChunk]) -> bytes:
        """The sample_io region's bytes up to the pool's used words, for decode rows 0..: each
        lane's extras (lanes without, and rows past the lanes, neutral). ValueError for
        extras the kernels cannot take (kernel_schedule.SamplerIo)."""
        s = self.schedule.sampler
        n = self.max_seqs
        values = {"presence": np.zeros(n, np.float32), "frequency": np.zeros(n, np.float32),
                  "repetition": np.ones(n, np.float32), "n_top": np.full(n, -1, np.int32),
                  "mask_at": np.full(n, -1, np.int32), "pen_at": np.zeros(n, np.int32),
                  "pen_n": np.zeros(n, np.int32)}
        pool: list[np.ndarray] = []
        used = 0
        for i, c in enumerate(lanes):
            e = c.extras
            if e is None:
                continue
            for part in self._lane_extras(e):
                if part[0] == "mask":
                    values["mask_at"][i] = used
                else:
                    values["pen_at"][i], values["pen_n"][i] = used, part[1].size // 2
                pool.append(part[1])
                used += part[1].size
            p = e.penalties
            values["presence"][i], values["frequency"][i] = p.presence, p.frequency
            values["repetition"][i] = p.repetition
            values["n_top"][i] = e.top_logprobs
        pool_at = s.fields["pool"].offset - s.offset
        region = bytearray(pool_at + 4 * used)
        for name, arr in values.items():
            start = s.fields[name].offset - s.offset
            region[start:start + arr.nbytes] = arr.tobytes()
        if pool:
            region[pool_at:] = np.concatenate(pool).astype(np.int32).tobytes()
        return bytes(region)

    def _lane_extras(self, e: SampleExtras) -> list[tuple[str, np.ndarray]]:
        """A lane's pool parts: ("mask", its words) and ("pairs", (id, count) interleaved),
        each checked."""
        s, v = self.schedule.sampler, self.schedule.vocab_size
        if not -1 <= e.top_logprobs <= s.top_logprobs:
            raise ValueError(f"top_logprobs must be -1 to {s.top_logprobs}, not "
                             f"{e.top_logprobs}")
        p = e.penalties
        if not (np.isfinite([p.presence, p.frequency, p.repetition]).all()
                and p.repetition > 0):
            raise ValueError(f"penalties must be finite with repetition > 0, not {p}")
        parts = []
        if e.mask is not None:
            mask = np.asarray(e.mask)
            if mask.dtype != np.int32 or mask.shape != (s.mask_words,):
                raise ValueError(f"a token mask is int32 [{s.mask_words}], not {mask.dtype} "
                                 f"{list(mask.shape)}")
            if not mask.any():
                raise ValueError("the token mask allows no token")
            parts.append(("mask", mask))
        if e.pen_ids is not None:
            ids, counts = np.asarray(e.pen_ids), np.asarray(e.pen_counts)
            if ids.ndim != 1 or ids.shape != counts.shape or ids.size > s.penalty_ids:
                raise ValueError(f"penalty ids and counts are two [n <= {s.penalty_ids}] "
                                 f"arrays, not {list(ids.shape)} and {list(counts.shape)}")
            if ids.size:
                if ids.min() < 0 or ids.max() >= v or np.unique(ids).size != ids.size \
                        or counts.min() < 0 or counts.max() > np.iinfo(np.int32).max:
                    raise ValueError(f"penalty ids must be distinct ids in [0, {v}) with "
                                     "counts >= 0")
                parts.append(("pairs", np.stack([ids, counts], 1).astype(np.int32).ravel()))
        return parts


@dataclass(frozen=True, eq=False)
class ScheduleState:
    """A Verified.states entry: the target's final-normed hidden state after a verify row,
    float32 [H] on the host (what draft_{B} starts from, through io draft_state)."""

    values: np.ndarray


@dataclass(frozen=True, eq=False)
class ScheduleDraftProbs:
    """A Drafted.draft_probs entry (schedule version 10): lane `lane` of draft call number
    `call` of executor `owner`, whose draft_{width} left each draft's logits and sampling
    record in the ratio region (row i * width + lane for draft i) until the next draft call;
    the drafts it made and the sampling they were drawn with, which verify checks."""

    owner: ScheduledExecutor
    call: int
    lane: int
    width: int
    tokens: tuple[int, ...]
    sampling: Sampling


class DeviceRows:
    """Drafted.logits or .states: one lane's first n steps of a draft entry's output [K, B, X],
    read from the device by np.asarray, which only works until the executor's next call
    (the arena's activations are reused)."""

    def __init__(self, ex: ScheduledExecutor, runs: int, output: str,
                 shape: tuple[int, int, int], lane: int, n: int):
        self._ex, self._runs, self._output = ex, runs, output
        self._shape, self._lane, self._n = shape, lane, n

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self._ex._runs != self._runs:
            raise ValueError(f"{self._output} was overwritten by a later call: read a draft's "
                             "logits and states before the executor's next call")
        k, b, x = self._shape
        rows = self._ex._read(self._output, k * b * x, np.float32).reshape(k, b, x)
        out = rows[:self._n, self._lane]
        return out if dtype is None else out.astype(dtype)


def _with_mask(chunk: SeqChunk, mask: np.ndarray | None) -> SeqChunk:
    """chunk, its extras' token mask `mask` (None: none)."""
    if mask is None and (chunk.extras is None or chunk.extras.mask is None):
        return chunk
    return replace(chunk, extras=replace(chunk.extras or SampleExtras(), mask=mask))


def _take_rows(rows: np.ndarray, lanes: Sequence[LoopLane], out: list[list[int]],
               ended: list[bool]) -> list[list[int]]:
    """Each lane's new tokens in `rows` (decode_advance's history [n, B] of the steps read),
    appended to out[i]; ended[i] set once lane i reached its budget or a stop id. Returns the
    new tokens per lane ([] for a lane that had ended)."""
    new = [[] if ended[i] else _lane_tokens(rows[:, i], lane, len(out[i]))
           for i, lane in enumerate(lanes)]
    for i, (tokens, lane) in enumerate(zip(new, lanes, strict=True)):
        out[i] += tokens
        ended[i] = ended[i] or len(out[i]) == lane.budget or bool(
            tokens and tokens[-1] in lane.stop_ids)
    return new


def _lane_tokens(column: np.ndarray, lane: LoopLane, before: int = 0) -> list[int]:
    """A lane's tokens from its column of decode_advance's history (of the steps after the
    `before` tokens it has): up to its budget (the first -1) and its first stop id, included."""
    out = []
    for token in column[:lane.budget - before].tolist():
        if token < 0:
            break
        out.append(token)
        if token in lane.stop_ids:
            break
    return out
