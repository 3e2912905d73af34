"""Streaming a section once while checking it (artifacts/stream.py), through a sink that records
what it is given: the bytes delivered are the file's, every byte read and delivered exactly once,
a staging buffer never refilled before its delivery is done, and a corrupt piece fails the
stream before `finish` (the commit) with the container's one-line error."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from rvcompile.artifacts import Artifact, ArtifactError, ArtifactHeader, ArtifactWriter
from rvcompile.artifacts import stream as stream_mod
from rvcompile.artifacts.stream import stream_section

HEADER = ArtifactHeader("0.1.0", "xla", ("cpu",))
PIECE = 1000  # bytes per hashed piece: not a multiple of the chunk, so chunks straddle nothing
SIZE = 10 * PIECE + 123  # a short last piece


class RecordingSink:
    """Deliveries land only when the buffer is next reused or at finish, as an async copy would:
    a streamer that refilled a buffer too early would deliver the wrong bytes."""

    def __init__(self, size: int, workers: int, chunk: int):
        self.chunk_bytes = chunk
        self.buffers = [[bytearray(chunk) for _ in range(2)] for _ in range(workers)]
        self.out = bytearray(size)
        self.times_delivered = np.zeros(size, np.int32)
        self.pending: dict[tuple[int, int], tuple[int, int]] = {}
        self.finished = False
        self.lock = threading.Lock()

    def staging(self, worker: int, k: int) -> memoryview:
        return memoryview(self.buffers[worker][k])

    def _land(self, worker: int, k: int) -> None:
        offset, size = self.pending.pop((worker, k))
        self.out[offset:offset + size] = self.buffers[worker][k][:size]
        with self.lock:
            self.times_delivered[offset:offset + size] += 1

    def reusable(self, worker: int, k: int) -> None:
        self._land(worker, k)

    def deliver(self, worker: int, k: int, offset: int, size: int) -> None:
        assert (worker, k) not in self.pending, "buffer refilled before its delivery was done"
        self.pending[(worker, k)] = (offset, size)

    def finish(self) -> None:
        for key in list(self.pending):
            self._land(*key)
        self.finished = True


@pytest.fixture
def artifact(tmp_path) -> Path:
    path = tmp_path / "s.rvp"
    rng = np.random.default_rng(0)
    with ArtifactWriter(path, HEADER, piece_size=PIECE) as w:
        w.add("program", b"program bytes")
        w.add("weights", rng.integers(0, 256, SIZE, dtype=np.uint8))
        w.commit({"model": "stream-test"})
    return path


def _reads(monkeypatch) -> list[tuple[int, int]]:
    """Records every (offset, length) os.preadv reads in stream.py."""
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        n = real(fd, buffers, offset)
        reads.append((offset, n))
        return n

    monkeypatch.setattr(stream_mod.os, "preadv", preadv)
    return reads


@pytest.mark.parametrize("workers,chunk", [(1, 4096), (3, 300), (4, 1000), (16, 64)])
def test_delivers_the_section_reading_each_byte_once(artifact, monkeypatch, workers, chunk):
    reads = _reads(monkeypatch)
    with Artifact.open(artifact) as art:
        sink = RecordingSink(SIZE, workers, chunk)
        stats = stream_section(art, "weights", sink, workers=workers)
        assert sink.finished
        assert bytes(sink.out) == bytes(art.buffer("weights"))
        assert (sink.times_delivered == 1).all()
        start = art.sections["weights"].offset
    read_count = np.zeros(SIZE, np.int32)
    for offset, n in reads:
        read_count[offset - start:offset - start + n] += 1
    assert (read_count == 1).all()  # the file read once, nothing outside the section
    assert (stats.bytes, stats.pieces, stats.checked) == (SIZE, 11, True)
    assert stats.workers == min(workers, 11) and stats.wall_s > 0


@pytest.mark.parametrize("chunk", [256, 4000])  # a piece in chunks; four pieces a chunk
def test_a_corrupt_piece_fails_before_finish(artifact, chunk):
    with Artifact.open(artifact) as art:
        offset = art.sections["weights"].offset + 7 * PIECE + 5
    data = bytearray(artifact.read_bytes())
    data[offset] ^= 1
    artifact.write_bytes(bytes(data))
    with Artifact.open(artifact) as art:  # the header and tables are intact: open accepts it
        for workers in (1, 4):
            sink = RecordingSink(SIZE, workers, chunk)
            with pytest.raises(ArtifactError) as e:
                stream_section(art, "weights", sink, workers=workers)
            assert not sink.finished
            line = str(e.value)
            assert "\n" not in line
            assert line.startswith("s.rvp: section 'weights' is corrupt: piece 7 of 11 (bytes "
                                   "[7000, 8000)) has sha256 ")
            with pytest.raises(ArtifactError) as v:  # the same line verify gives
                art.verify(["weights"])
            assert str(v.value) == line
        # --no-verify: delivered as it is, nothing compared
        sink = RecordingSink(SIZE, 2, 256)
        stats = stream_section(art, "weights", sink, workers=2, check=False)
        assert sink.finished and not stats.checked
        assert bytes(sink.out) == bytes(art.buffer("weights"))


def test_small_pieces_stream_several_to_a_chunk(artifact):
    """Pieces smaller than a chunk are read, hashed and delivered as many to a chunk as fit
    whole (an h100 artifact's 1 MiB pieces, sixteen to a 16 MiB copy), checked or not."""
    with Artifact.open(artifact) as art:
        for check in (True, False):
            class Counting(RecordingSink):
                sizes: list[int] = []

                def deliver(self, worker, k, offset, size):
                    self.sizes.append(size)
                    super().deliver(worker, k, offset, size)

            sink = Counting(SIZE, 2, 4000)
            Counting.sizes = []
            stats = stream_section(art, "weights", sink, workers=2, check=check)
            assert bytes(sink.out) == bytes(art.buffer("weights"))
            assert sorted(sink.sizes) == [2 * PIECE + 123, 4 * PIECE, 4 * PIECE]
            assert (stats.pieces, stats.workers, stats.checked) == (11, 2, check)


def test_a_failing_sink_stops_the_stream(artifact):
    class Broken(RecordingSink):
        def deliver(self, worker, k, offset, size):
            if offset >= 4 * PIECE:
                raise RuntimeError("copy failed")
            super().deliver(worker, k, offset, size)

    with Artifact.open(artifact) as art:
        sink = Broken(SIZE, 3, 500)
        with pytest.raises(RuntimeError, match="copy failed"):
            stream_section(art, "weights", sink, workers=3)
        assert not sink.finished


def test_stop_halts_every_worker_at_its_next_chunk(artifact):
    """The caller's load failed elsewhere (runtime.load's text check): once `stop()` says so,
    no worker reads another chunk, `finish` is never called, and StreamStopped is raised."""
    from rvcompile.artifacts.stream import StreamStopped

    class Counting(RecordingSink):
        def __init__(self, *args):
            super().__init__(*args)
            self.delivered = 0

        def deliver(self, worker, k, offset, size):
            super().deliver(worker, k, offset, size)
            with self.lock:
                self.delivered += 1

    for workers in (1, 3):
        with Artifact.open(artifact) as art:
            sink = Counting(SIZE, workers, 100)  # 110 chunks
            with pytest.raises(StreamStopped) as e:
                stream_section(art, "weights", sink, workers=workers,
                               stop=lambda s=sink: s.delivered >= 5)
        assert not sink.finished
        assert 5 <= sink.delivered < 5 + workers  # each worker stops at its next chunk
        assert str(e.value) == "s.rvp: section 'weights': stream stopped: the load failed elsewhere"
        assert isinstance(e.value, ArtifactError)


def test_refusals(artifact):
    with Artifact.open(artifact) as art:
        with pytest.raises(ArtifactError, match="no section 'nope'"):
            stream_section(art, "nope", RecordingSink(1, 1, 8), workers=1)
        with pytest.raises(ArtifactError, match="workers must be at least 1"):
            stream_section(art, "weights", RecordingSink(1, 1, 8), workers=0)
    with pytest.raises(ArtifactError, match="closed"):
        stream_section(art, "weights", RecordingSink(SIZE, 1, 8), workers=1)
