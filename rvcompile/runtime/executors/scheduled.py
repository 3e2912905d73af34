"""The host side of a kernel-schedule artifact (H100 target): the executor of
runtime/executor_api.py over a KernelSchedule. It picks the entry point for a call, fills the io
fields (tokens, positions, one block-table row per token row and KV kind, sampling parameters)
and reads the results back. The device it drives only offers `write(offset, bytes)`,
`read(offset, nbytes)` and `run(entry)`: the CUDA device (h100.py) or the CPU reference
(targets/h100/reference_executor.py; tests compose the two).

The engine owns the block ids; the pools hold the device's `kv_blocks[kind]` blocks per kind,
chosen when the device was made (h100.py: at load, from free memory or as asked).
Padding rows get position -1 (no cache write) and see one key, so they stay finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from rvcompile.artifacts.kernel_schedule import KernelSchedule
from rvcompile.runtime.executor_api import KvKind, SeqChunk


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

    def decode(self, lanes: Sequence[SeqChunk]) -> list[int]:
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
        io = self._io(b, lanes, toks, pos, chunk_of_row)
        got = self._call(f"decode_{b}", io, "out_tokens", b, np.int32)
        return [int(x) for x in got[:len(lanes)]]

    def logits(self, chunk: SeqChunk) -> np.ndarray:
        t = self.max_chunk
        toks, pos = self._chunk_rows(chunk, t)
        io = self._io(t, [chunk], toks, pos, np.zeros(t, np.int64))
        n, v = len(chunk.tokens), self.schedule.vocab_size
        return self._call(f"logits_{t}", io, "logits", n * v, np.float32).reshape(n, v)
