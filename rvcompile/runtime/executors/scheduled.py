"""The host side of a kernel-schedule artifact (H100 target): the executor of
runtime/executor_api.py over a KernelSchedule. It picks the entry point for a call, fills the io
fields (tokens, positions, one block-table row per token row and KV kind, sampling parameters)
and reads the results back. The device it drives only offers `write(offset, bytes)`,
`read(offset, nbytes)` and `run(entry)`: the CUDA device (h100.py) or the CPU reference
(targets/h100/reference_executor.py; tests compose the two).

The engine owns the block ids; the pools hold the device's `kv_blocks[kind]` blocks per kind,
chosen when the device was made (h100.py: at load, from free memory or as asked).
Padding rows get position -1 (no cache write) and see one key, so they stay finite.

The decode loop (`decode_many`, executor_api's "Decode loop") is driven from here: the io is
built once, then each step replays the decode entry of the call's width, reads the tokens back
and moves each lane on in the io (its token, position, length and RNG step) with a few numpy
writes, so a step costs the device one io copy, one graph launch and one token read on top of
the kernels, not an engine step. A lane that samples a stop id or reaches its budget turns
into a padding row (position -1) for the rest of the call, which ends when every lane has.
Each step is a decode call of the call's lanes at the call's width: a finished lane's row
stays, as padding, so the others keep the width they started with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.runtime.executor_api import KvKind, LoopLane, SeqChunk, Verified

DECODE_LOOP_STEPS = 32  # most steps of one decode_many call (the XLA targets' default too)
DECODE_LOOP_STOPS = 64  # most stop ids per lane (a host-side check: any number would do)


def schedule_kinds(schedule: KernelSchedule, blocks: dict[str, int]) -> dict[str, KvKind]:
    """The schedule's KV kinds as the engine sees them, with blocks[kind] blocks each."""
    return {k.name: KvKind(k.name, k.table_width, k.ring, k.window or None, blocks[k.name])
            for k in schedule.kv.kinds}


class ScheduleDevice(Protocol):
    kv_blocks: dict[str, int]  # each KV kind's pool blocks, as the device was made

    def write(self, offset: int, data: bytes) -> None: ...

    def read(self, offset: int, nbytes: int) -> bytes: ...

    def run(self, entry: str) -> None: ...


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
        # a call never runs more than max_chunk steps (the sliding rings' room ahead)
        self.decode_loop_steps = min(DECODE_LOOP_STEPS, self.max_chunk)
        self.decode_loop_stops = DECODE_LOOP_STOPS

    # -- io

    def _io(self, rows: int, chunks: Sequence[SeqChunk], tokens, positions, chunk_of_row,
            last_row: int = 0) -> bytes:
        s = self.schedule
        io = bytearray(s.io_bytes)

        def put(name: str, values) -> None:
            f = s.io[name]
            arr = np.asarray(values, np.dtype(f.dtype))
            start = f.offset - s.io_offset
            io[start:start + arr.nbytes] = arr.tobytes()

        positions = np.asarray(positions, np.int32)
        put("tokens", tokens)
        put("positions", positions)
        put("seq_len", np.where(positions >= 0, positions + 1, 1))
        put("last_row", [last_row])
        for kind in self.kinds.values():
            tables = []
            for c in chunks:
                t = np.asarray(c.tables[kind.name], np.int32)
                if t.shape != (kind.table_width,) or t.min() < 0 or t.max() >= kind.num_blocks:
                    raise ValueError(f"block table for {kind.name!r} must hold "
                                     f"{kind.table_width} ids in [0, {kind.num_blocks})")
                tables.append(t)
            put(self._io_field[kind.name], np.stack(tables)[chunk_of_row])
        samp = [chunks[i].sampling for i in chunk_of_row]
        for x in samp:
            if not (np.isfinite(x.temperature) and x.temperature >= 0 and x.top_k >= 0
                    and 0 < x.top_p <= 1):
                raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and top_p in "
                                 f"(0, 1], not {x}")
        put("temperature", [x.temperature for x in samp])
        put("top_k", [x.top_k for x in samp])
        put("top_p", [x.top_p for x in samp])
        put("seed", [x.seed for x in samp])
        put("step", [chunks[i].step for i in chunk_of_row])
        return bytes(io)

    def _call(self, entry: str, io: bytes, output: str, count: int, dtype) -> np.ndarray:
        self.device.write(self.schedule.io_offset, io)
        self.device.run(entry)
        f = self.schedule.outputs[f"{entry}.{output}"]
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

    def prefill(self, chunk: SeqChunk) -> int:
        n = len(chunk.tokens)
        t = chunk.rows or next((b for b in self.prefill_buckets if b >= n), None)
        if t is None or t not in self.prefill_buckets:
            raise ValueError(f"no prefill entry of {t or n} rows (buckets: "
                             f"{', '.join(map(str, self.prefill_buckets))})")
        toks, pos = self._chunk_rows(chunk, t)
        io = self._io(t, [chunk], toks, pos, np.zeros(t, np.int64), last_row=n - 1)
        return int(self._call(f"prefill_{t}", io, "out_tokens", 1, np.int32)[0])

    def _decode_io(self, lanes: Sequence[SeqChunk]) -> tuple[int, bytes]:
        """(the width, the io) of a decode call of these lanes."""
        if not 0 < len(lanes) <= self.max_seqs:
            raise ValueError(f"{len(lanes)} decode lanes; the schedule takes 1.."
                             f"{self.max_seqs}")
        b = next(x for x in self.decode_buckets if x >= len(lanes))
        toks = np.zeros(b, np.int32)
        pos = np.full(b, -1, np.int32)
        for i, lane in enumerate(lanes):
            if len(lane.tokens) != 1:
                raise ValueError("a decode lane runs exactly one token")
            toks[i], pos[i] = lane.tokens[0], lane.start
        chunk_of_row = np.minimum(np.arange(b), len(lanes) - 1)
        return b, self._io(b, lanes, toks, pos, chunk_of_row)

    def decode(self, lanes: Sequence[SeqChunk]) -> list[int]:
        b, io = self._decode_io(lanes)
        got = self._call(f"decode_{b}", io, "out_tokens", b, np.int32)
        return [int(x) for x in got[:len(lanes)]]

    def decode_many(self, lanes: Sequence[LoopLane]) -> list[list[int]]:
        for lane in lanes:
            if not 1 <= lane.budget <= self.decode_loop_steps:
                raise ValueError(f"lane budget {lane.budget}: decode_many runs 1 to "
                                 f"{self.decode_loop_steps} steps")
            if len(lane.stop_ids) > self.decode_loop_stops:
                raise ValueError(f"{len(lane.stop_ids)} stop token ids; decode_many takes at "
                                 f"most {self.decode_loop_stops}")
        b, io_bytes = self._decode_io([lane.chunk for lane in lanes])
        io = np.frombuffer(bytearray(io_bytes), np.uint8)
        s = self.schedule

        def field(name: str) -> np.ndarray:  # the first b values of an io field, in place
            f = s.io[name]
            start = f.offset - s.io_offset
            return io[start:start + 4 * b].view(np.dtype(f.dtype))

        tokens, positions, seq_len, step = (field(n) for n in ("tokens", "positions",
                                                               "seq_len", "step"))
        out: list[list[int]] = [[] for _ in lanes]
        live = list(range(len(lanes)))
        while live:
            got = self._call(f"decode_{b}", io.tobytes(), "out_tokens", b, np.int32)
            going = []
            for i in live:
                token = int(got[i])
                out[i].append(token)
                if token in lanes[i].stop_ids or len(out[i]) == lanes[i].budget:
                    positions[i], seq_len[i] = -1, 1  # a padding row from now on
                else:
                    tokens[i] = token
                    positions[i] += 1
                    seq_len[i] += 1
                    step[i] += 1
                    going.append(i)
            live = going
        return out

    def logits(self, chunk: SeqChunk) -> np.ndarray:
        t = self.max_chunk
        toks, pos = self._chunk_rows(chunk, t)
        io = self._io(t, [chunk], toks, pos, np.zeros(t, np.int64))
        n, v = len(chunk.tokens), self.schedule.vocab_size
        return self._call(f"logits_{t}", io, "logits", n * v, np.float32).reshape(n, v)

    # -- speculative decoding (executor_api, "Speculative decoding"): n-gram drafts only
    #
    # A verify call is a decode call: a decode entry runs each row at its own position with its
    # own block-table row and sampling step, writing every row's KV before any attention reads
    # the cache (targets/h100/lower.py), so a lane's token and drafts at positions p..p+k are
    # k + 1 rows of it, row i sampled at step + i as `decode` would sample it. The rows of all
    # lanes, padded to the narrowest entry holding them: decode_{B}, or beyond the widest one
    # the schedule's verify_{R} (built with --num-draft-tokens K). No drafter: `draft` is not
    # offered and Verified.states is empty.

    has_drafter = False

    @property
    def max_draft_tokens(self) -> int:
        """K: most drafts one verify lane takes (the schedule's draft_tokens; 0: no verify)."""
        return self.schedule.draft_tokens

    def verify(self, lanes: Sequence[SeqChunk]) -> list[Verified]:
        k = self.max_draft_tokens
        if not k:
            raise ValueError("the artifact was built without speculative entry points "
                             "(rvcompile build --num-draft-tokens K)")
        if not 0 < len(lanes) <= self.max_seqs:
            raise ValueError(f"{len(lanes)} verify lanes; the schedule takes 1..{self.max_seqs}")
        rows: list[SeqChunk] = []  # one per row: its lane, its own sampling step
        toks, pos = [], []
        for lane in lanes:
            n = len(lane.tokens)
            if not 1 <= n <= k + 1:
                raise ValueError(f"verify lane of {n} tokens: a token and 0 to {k} drafts")
            if lane.draft_probs is not None:
                raise ValueError("draft_probs come from an assistant's draft; this artifact "
                                 "has no drafter")
            if lane.start + n > self.max_context:
                raise ValueError(f"positions up to {lane.start + n} exceed the context "
                                 f"{self.max_context}")
            rows += [replace(lane, step=lane.step + i) for i in range(n)]
            toks += list(lane.tokens)
            pos += range(lane.start, lane.start + n)
        width = next(b for b in self._verify_widths() if b >= len(rows))
        pad = width - len(rows)
        io = self._io(width, rows, np.asarray(toks + [0] * pad, np.int32),
                      np.asarray(pos + [-1] * pad, np.int32),
                      np.minimum(np.arange(width), len(rows) - 1))
        entry = f"decode_{width}" if width in self.decode_buckets else f"verify_{width}"
        got = self._call(entry, io, "out_tokens", width, np.int32).tolist()
        out, at = [], 0
        for lane in lanes:
            out.append(Verified(got[at:at + len(lane.tokens)], ()))
            at += len(lane.tokens)
        return out

    def _verify_widths(self) -> tuple[int, ...]:
        """Row counts a verify call may run in: the decode entries', then the verify entries'."""
        verify = (e.rows for e in self.schedule.entries.values() if e.name.startswith("verify_"))
        return tuple(sorted({*self.decode_buckets, *verify}))
