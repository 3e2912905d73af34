"""The host side of a kernel-schedule artifact (H100 target): picks the entry point for a call,
fills the io fields (tokens, positions, block tables, sampling parameters) and reads the
results back. The device it drives only offers `write(offset, bytes)`, `read(offset, nbytes)`
and `run(entry)`: the CUDA device (h100_executor) or the CPU reference (targets/h100).

KV blocks are assigned statically: sequence slot s owns blocks [s * F, (s + 1) * F) of every
full-attention pool and [s * R, (s + 1) * R) of every sliding ring (F, R: the table widths).
Padding rows get position -1 (no cache write) and see one key, so they stay finite.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from rvcompile.artifacts.kernel_schedule import KernelSchedule


class ScheduleDevice(Protocol):
    def write(self, offset: int, data: bytes) -> None: ...

    def read(self, offset: int, nbytes: int) -> bytes: ...

    def run(self, entry: str) -> None: ...


def sampling_arrays(n: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0):
    """Per-row sampling parameters, in the order every executor takes them."""
    return (np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
            np.full(n, top_p, np.float32), np.full(n, seed, np.int32),
            np.full(n, step, np.int32))


class ScheduledExecutor:
    """Executor API (see runtime/model.py) over a KernelSchedule and a ScheduleDevice."""

    def __init__(self, schedule: KernelSchedule, device: ScheduleDevice):
        self.schedule, self.device = schedule, device
        s = schedule
        self.slots, self.max_context, self.max_chunk = s.slots, s.max_context, s.max_chunk
        self.buckets = tuple(sorted(e.rows for e in s.entries.values()
                                    if e.name.startswith("prefill_")))
        self.decode_buckets = tuple(sorted(e.rows for e in s.entries.values()
                                           if e.name.startswith("decode_")))
        self.greedy_only = not any(x.kernel.startswith("sample") for e in s.entries.values()
                                   for x in e.launches)

    _sampling = staticmethod(sampling_arrays)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"chunk of {n} tokens exceeds the largest prefill bucket")

    # -- io

    def _io(self, rows: int, slots_of_rows, tokens, positions, sampling, last_row=0) -> bytes:
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
        slots_of_rows = np.asarray(slots_of_rows, np.int64)[:, None]
        full, ring = s.kv.full_blocks, s.kv.ring_blocks
        put("table_full", slots_of_rows * full + np.arange(full)[None, :])
        put("table_ring", slots_of_rows * ring + np.arange(ring)[None, :])
        temperature, top_k, top_p, seed, step = (np.asarray(a) for a in sampling)
        if self.greedy_only and np.any(temperature[:rows] > 0):
            raise ValueError("this H100 artifact samples greedily only (temperature 0)")
        for name, values in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                             ("seed", seed), ("step", step)):
            put(name, np.resize(values, rows))
        return bytes(io)

    def _call(self, entry: str, io: bytes, output: str, count: int, dtype) -> np.ndarray:
        self.device.write(self.schedule.io_offset, io)
        self.device.run(entry)
        f = self.schedule.outputs[f"{entry}.{output}"]
        nbytes = count * np.dtype(dtype).itemsize
        return np.frombuffer(self.device.read(f.offset, nbytes), dtype).copy()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")

    # -- entry points

    def prefill(self, slot: int, tokens: np.ndarray, start: int, sampling) -> int:
        self._check_slot(slot)
        n = len(tokens)
        t = self.bucket(n)
        toks = np.zeros(t, np.int32)
        toks[:n] = tokens
        pos = np.full(t, -1, np.int32)
        pos[:n] = start + np.arange(n)
        io = self._io(t, np.full(t, slot), toks, pos, sampling, last_row=n - 1)
        return int(self._call(f"prefill_{t}", io, "out_tokens", 1, np.int32)[0])

    def decode(self, tokens: np.ndarray, start: np.ndarray, active: np.ndarray,
               sampling) -> np.ndarray:
        live = np.flatnonzero(np.asarray(active))
        out = np.zeros(self.slots, np.int32)
        if live.size == 0:
            return out
        b = next(x for x in self.decode_buckets if x >= live.size)
        rows_slot = np.zeros(b, np.int64)
        rows_slot[:live.size] = live
        toks = np.zeros(b, np.int32)
        toks[:live.size] = np.asarray(tokens).reshape(-1)[live]
        pos = np.full(b, -1, np.int32)
        pos[:live.size] = np.asarray(start)[live]
        row_sampling = tuple(np.asarray(a)[rows_slot] for a in sampling)
        io = self._io(b, rows_slot, toks, pos, row_sampling)
        got = self._call(f"decode_{b}", io, "out_tokens", b, np.int32)
        out[live] = got[:live.size]
        return out

    def logits(self, slot: int, tokens: np.ndarray, start: int) -> np.ndarray:
        self._check_slot(slot)
        n, t = len(tokens), self.max_chunk
        toks = np.zeros(t, np.int32)
        toks[:n] = tokens
        pos = np.full(t, -1, np.int32)
        pos[:n] = start + np.arange(n)
        io = self._io(t, np.full(t, slot), toks, pos, sampling_arrays(t))
        v = self.schedule.vocab_size
        return self._call(f"logits_{t}", io, "logits", n * v, np.float32).reshape(n, v)
