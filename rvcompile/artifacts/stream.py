"""Reading a section ONCE while checking it: the bytes that are hashed are the bytes delivered.

`stream_section(art, name, sink)` reads section `name` of an open artifact on a pool of worker
threads, in runs of consecutive pieces (the pieces whose sha256 the digest table records): as
many whole pieces as one chunk of `sink.chunk_bytes` holds, or one piece when a piece is larger
(an h100 artifact's 1 MiB pieces go sixteen to a 16 MiB chunk, the default 256 MiB ones are read
in sixteen chunks each). Each worker takes the next run in file order and reads it in chunks
into one of its two staging buffers (`sink.staging(worker, k)`, k = 0 or 1: while one is being
delivered the other is filled), feeds every piece's bytes to that piece's sha256, and hands the
chunk to `sink.deliver(worker, k, offset, size)` (for the CUDA sink: an async copy to the
device, on a stream of its own). Before it refills a buffer it calls `sink.reusable(worker, k)`,
which returns once the previous delivery from that buffer is done with it.

When a piece's last chunk is read, its digest is compared with the recorded one. Chunks are
delivered before their piece is checked (so the reads, hashes and copies all overlap), but
`sink.finish()`, which is what makes the delivered bytes count, is called only after every
piece checked out and every worker stopped: a caller runs nothing on what was delivered before
`stream_section` returns. A mismatch stops every worker at its next chunk, `finish` is never
called, and the lowest corrupt piece found raises the container's one-line ArtifactError (the
caller frees what it allocated). `check=False` delivers without hashing: rvrun --no-verify, or
a caller that checks the delivered bytes itself (the h100 runtime, on the GPU:
runtime/executors/device_hash.py).
The caller's `stop` (runtime.load's checks that run alongside failed) stops the workers the
same way at their next chunk.

Reads are `os.preadv` into the staging buffer: it releases the GIL (so N workers read N chunks
at once), copies straight from the page cache into the (pinned) buffer, and reads the file
once; a memcpy from the mmap would fault the mapping in 4 KiB pages first. hashlib releases the
GIL too, so the pool scales with cores. No CUDA here: the sink is whatever the caller passes
(runtime/executors/cuda_upload.py for the H100; tests use a recording one).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from rvcompile.artifacts.container import (
    Artifact,
    corrupt_piece_error,
    piece_runs,
    section_pieces,
)
from rvcompile.artifacts.format import ArtifactError

BUFFERS_PER_WORKER = 2  # one filling while the other is delivered


class Sink(Protocol):
    """Where `stream_section` delivers a section. Every method but `finish` is called from the
    worker threads, each worker only with its own index and buffers."""

    chunk_bytes: int  # bytes of each staging buffer (the most one delivery moves)

    def staging(self, worker: int, k: int) -> memoryview:
        """Worker `worker`'s staging buffer `k` (0 or 1): writable, `chunk_bytes` long (a sink
        may allocate it on this first call, on the worker's thread)."""
        ...

    def reusable(self, worker: int, k: int) -> None:
        """Blocks until the last delivery from buffer `k` of `worker` no longer needs it."""
        ...

    def deliver(self, worker: int, k: int, offset: int, size: int) -> None:
        """Starts moving `staging(worker, k)[:size]` to byte `offset` of the section."""
        ...

    def finish(self) -> None:
        """Every piece checked out: block until everything delivered has arrived."""
        ...


@dataclass(frozen=True)
class StreamStats:
    """What one stream cost. Reads and hashes overlap one another and the deliveries, so their
    seconds are summed over the workers (busy time), not wall time."""

    bytes: int  # of the section
    pieces: int
    workers: int
    checked: bool  # every piece's sha256 compared (False: check=False)
    wall_s: float  # first read to finish() returned
    read_s: float  # summed over workers: in preadv
    hash_s: float  # summed over workers: in sha256
    wait_s: float  # summed over workers: waiting for a buffer to be reusable (delivery-bound)
    # or to be allocated (a sink may allocate a buffer when it is first asked for it)

    @property
    def gb_s(self) -> float:
        """Bytes per second of wall time, in GB/s (1e9)."""
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0


class StreamStopped(ArtifactError):
    """`stop()` said to stop before the section was read (its caller's load failed elsewhere:
    the caller raises that failure instead)."""


def stream_section(art: Artifact, name: str, sink: Sink, *, workers: int,
                   check: bool = True, stop: Callable[[], bool] | None = None) -> StreamStats:
    """Reads section `name` of `art` once into `sink` on `workers` threads (the sink has two
    staging buffers per worker), hashing every piece when `check`; see the module docstring.
    `stop`: polled before every chunk; once it returns True the workers stop there, `finish`
    is not called and StreamStopped is raised (unless a corrupt piece was found first)."""
    fname = art.path.name
    if workers < 1:
        raise ArtifactError(f"{fname}: stream workers must be at least 1, not {workers}")
    if sink.chunk_bytes < 1:
        raise ArtifactError(f"{fname}: stream chunk_bytes must be at least 1")
    section = art.sections.get(name)
    if section is None:
        raise ArtifactError(f"{fname}: no section '{name}' (has: {', '.join(art.sections)})")
    pieces = section_pieces(section)
    chunk = sink.chunk_bytes
    runs = piece_runs(pieces, chunk)  # what one worker reads, hashes and delivers at a time
    fd = art.fileno()
    workers = max(1, min(workers, len(runs)))
    lock = threading.Lock()
    queue = iter(runs)
    halt = threading.Event()  # a corrupt piece or a failed worker: the others stop

    def stopping() -> bool:
        return halt.is_set() or (stop is not None and stop())
    failures: dict[int, ArtifactError] = {}  # piece index -> its error
    busy = [[0.0, 0.0, 0.0] for _ in range(workers)]  # read, hash, wait seconds per worker

    def next_run():
        with lock:
            return next(queue, None)

    def hash_into(run: list, at: int, buf: memoryview, hashes: list) -> None:
        """Feeds `buf`, bytes [at, at + len(buf)) of `run`, to its pieces' sha256 (`hashes`,
        one a piece of the run); a piece whose last byte it holds is compared now."""
        first = run[0].start
        for j, piece in enumerate(run):
            lo = max(at, piece.start - first)
            hi = min(at + len(buf), piece.start - first + piece.size)
            if lo >= hi:
                continue
            hashes[j].update(buf[lo - at:hi - at])
            if hi == piece.start - first + piece.size:
                got = hashes[j].digest()
                if got != section.piece_sha256[piece.index]:
                    with lock:
                        failures[piece.index] = corrupt_piece_error(
                            fname, piece, got, section.piece_sha256[piece.index])
                    halt.set()

    def work(w: int) -> None:
        times = busy[w]
        uses = 0  # deliveries so far: buffer k = uses % 2 was used before when uses >= 2
        clock = time.perf_counter
        while not stopping() and (run := next_run()) is not None:
            start, offset = run[0].start, run[0].offset
            run_size = run[-1].start + run[-1].size - start
            hashes = [hashlib.sha256() for _ in run] if check else []
            done = 0
            while done < run_size:
                if stopping():
                    return
                k = uses % BUFFERS_PER_WORKER
                t0 = clock()
                if uses >= BUFFERS_PER_WORKER:
                    sink.reusable(w, k)
                size = min(chunk, run_size - done)
                buf = sink.staging(w, k)[:size]
                t1 = clock()
                got = 0
                while got < size:
                    where = start + done + got
                    try:
                        n = os.preadv(fd, [buf[got:]], offset + done + got)
                    except OSError as e:
                        raise ArtifactError(f"{fname}: section '{name}' piece "
                                            f"{where // section.piece_size}: cannot read: "
                                            f"{e.strerror or e}") from None
                    if n == 0:
                        raise ArtifactError(f"{fname}: section '{name}' piece "
                                            f"{where // section.piece_size}: file ended while "
                                            "reading it")
                    got += n
                t2 = clock()
                if check:
                    hash_into(run, done, buf, hashes)
                    times[1] += clock() - t2
                sink.deliver(w, k, start + done, size)
                uses += 1
                done += size
                times[0] += t2 - t1
                times[2] += t1 - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers, thread_name_prefix="rvp-stream") as pool:
        futures = [pool.submit(work, w) for w in range(workers)]
        errors = []
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # stop the others at their next chunk, then raise
                halt.set()
                errors.append(e)
    if failures:
        raise failures[min(failures)]
    if errors:
        raise errors[0]
    if stop is not None and stop():
        raise StreamStopped(f"{fname}: section '{name}': stream stopped: the load failed elsewhere")
    sink.finish()
    read_s, hash_s, wait_s = (sum(t[j] for t in busy) for j in range(3))
    return StreamStats(section.size, len(pieces), workers, check, time.perf_counter() - t0,
                       read_s, hash_s, wait_s)
