"""artifacts/stream.py's Sink for a range of device memory: a section streamed to the GPU.

Each worker thread of the stream has two pinned staging buffers of CHUNK_BYTES, which it
allocates itself when it first asks for each (`staging`): the workers pin their buffers at once,
each while the others read and hash, instead of the loader pinning all of them (16 workers: 512
MiB) before the first read. A delivery is an async host-to-device copy of one buffer on one of
`streams` non-blocking streams (worker w uses stream w % streams), followed by an event on that
stream; `reusable` waits for the event, so a buffer is refilled only once its copy has read it.
Several streams keep the copy engines busy while workers wait; non-blocking streams never wait
on the legacy stream, so the main thread may load modules and capture graphs (thread-local
capture mode) while the copies run. `finish` synchronizes every stream. `close` (always, success
or not) waits for the copies in flight, then frees the buffers, events and streams.

The driver wants its context bound to each calling thread; the workers bind it on first use.
"""

from __future__ import annotations

import threading

import numpy as np

from rvcompile.runtime.executors.cuda_driver import CudaContext

CHUNK_BYTES = 16 << 20  # per copy: large enough for the copy engines' full rate
STREAMS = 4


class CudaUploadSink:
    """Delivers a section to device address `dst` (its byte 0) for `workers` stream workers."""

    def __init__(self, ctx: CudaContext, dst: int, workers: int, *,
                 chunk_bytes: int | None = None, streams: int | None = None):
        """`chunk_bytes`, `streams`: default CHUNK_BYTES, STREAMS (read when called)."""
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        streams = streams or STREAMS
        self.ctx, self.dst, self.chunk_bytes = ctx, dst, chunk_bytes
        self._bound = threading.local()
        self._streams: list = []
        # worker w's buffer k and its event, None until w first asks for buffer k; each row is
        # written only by its worker's thread, read by `close` once the workers stopped
        self._host: list[list[np.ndarray | None]] = [[None, None] for _ in range(workers)]
        self._events: list[list] = [[None, None] for _ in range(workers)]
        try:
            self._streams = [ctx.stream(non_blocking=True) for _ in range(max(1, streams))]
        except BaseException:
            self.close()
            raise

    @property
    def pinned_bytes(self) -> int:
        """Pinned bytes the workers hold now."""
        return sum(h.nbytes for row in self._host for h in row if h is not None)

    def _bind(self) -> None:
        if not getattr(self._bound, "done", False):
            self.ctx.make_current()
            self._bound.done = True

    def staging(self, worker: int, k: int) -> memoryview:
        if self._host[worker][k] is None:  # first use: pinned here, on the worker's thread
            self._bind()
            self._events[worker][k] = self.ctx.event_without_timing()
            self._host[worker][k] = self.ctx.alloc_pinned(self.chunk_bytes)
        return memoryview(self._host[worker][k])

    def reusable(self, worker: int, k: int) -> None:
        self._bind()
        self.ctx.event_synchronize(self._events[worker][k])

    def deliver(self, worker: int, k: int, offset: int, size: int) -> None:
        self._bind()
        stream = self._streams[worker % len(self._streams)]
        self.ctx.copy_to_device(self.dst + offset, self._host[worker][k][:size], stream)
        self.ctx.record(self._events[worker][k], stream)

    def finish(self) -> None:
        self._bind()
        for s in self._streams:
            self.ctx.stream_synchronize(s)

    def close(self) -> None:
        """Waits for the copies in flight, then frees everything (also after a failure)."""
        self.ctx.make_current()
        try:
            for s in self._streams:
                self.ctx.stream_synchronize(s)
        finally:
            for row in self._host:
                for h in row:
                    if h is not None:
                        self.ctx.free_pinned(h)
            for row in self._events:
                for ev in row:
                    if ev is not None:
                        self.ctx.destroy_event(ev)
            for s in self._streams:
                self.ctx.destroy_stream(s)
            self._host, self._events, self._streams = [], [], []
