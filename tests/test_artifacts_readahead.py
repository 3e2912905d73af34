"""Sections asked of the disk ahead of their readers (artifacts/readahead.py): the walk advises
the sections' bytes in the order given, each from its first byte, chunk after chunk, on its own
duplicate descriptor; stop() ends it; runtime.load starts one right after the file opens, the
small sections first and the weights last, and stops it when the load ends, whether it
succeeded or failed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rvcompile.artifacts import Artifact, ArtifactError, ArtifactHeader, ArtifactWriter
from rvcompile.artifacts import readahead as readahead_mod
from rvcompile.artifacts.readahead import Readahead

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")

HEADER = ArtifactHeader("0.1.0", "xla", ("cpu",))


def _artifact(path: Path, size: int) -> Path:
    with ArtifactWriter(path, HEADER, piece_size=1 << 20) as w:
        w.add("program", b"program bytes")
        w.add("weights", np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8))
        w.commit({"model": "readahead-test"})
    return path


def _advice(monkeypatch, gate: threading.Event | None = None) -> list[tuple[int, int, int]]:
    """Records every (offset, length, advice) the walk gives; with `gate`, each call waits
    for it first."""
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if gate is not None:
            gate.wait()
        calls.append((offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(readahead_mod.os, "posix_fadvise", fadvise)
    return calls


def _until(predicate, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_walk_advises_the_sections_in_the_order_given(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(readahead_mod, "CHUNK_BYTES", 1 << 20)
    calls = _advice(monkeypatch)
    size = 5 * (1 << 20) + 4096 + 17  # a short last chunk
    with Artifact.open(_artifact(tmp_path / "a.rvp", size)) as art:
        weights, program = art.sections["weights"], art.sections["program"]
        walk = Readahead.start(art, ["program", "no such section", "weights"])
        assert walk is not None and walk.fd != art.fileno()
        total = program.size + size
        _until(lambda: walk.advised == total)
        assert walk.stop() == total
    want, at = [(program.offset, program.size, os.POSIX_FADV_WILLNEED)], weights.offset
    while at < weights.offset + size:
        n = min(1 << 20, weights.offset + size - at)
        want.append((at, n, os.POSIX_FADV_WILLNEED))
        at += n
    assert calls == want
    with pytest.raises(OSError):
        os.fstat(walk.fd)  # its own descriptor, closed when the walk ended


def test_stop_ends_the_walk_early_and_closing_the_artifact_does_not_race_it(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(readahead_mod, "CHUNK_BYTES", 1 << 20)
    gate = threading.Event()
    calls = _advice(monkeypatch, gate)
    art = Artifact.open(_artifact(tmp_path / "a.rvp", 8 << 20))
    walk = Readahead.start(art, ["weights"])
    art.close()  # the walk advises its own duplicate of the descriptor
    stopper = threading.Thread(target=walk.stop)
    stopper.start()
    _until(lambda: walk._stop.is_set())
    gate.set()  # the call under way finishes, then the walk sees the stop
    stopper.join(10)
    assert not stopper.is_alive()
    assert len(calls) == 1 and walk.advised == 1 << 20


def test_no_walk_without_the_sections(tmp_path) -> None:
    with Artifact.open(_artifact(tmp_path / "a.rvp", 1000)) as art:
        assert Readahead.start(art, ["no such section"]) is None


def _walks() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rvrun-readahead"]


def test_load_starts_the_walk_on_the_weights_and_ends_it(tmp_path, monkeypatch) -> None:
    """Whether the load fails (here: the manifest is not a model's, found at once) or not, it
    returns with no walk left running, which advised the small sections first and then, as
    far as it went before the failure stopped it, the weights in order."""
    calls = _advice(monkeypatch)
    from rvcompile import runtime

    path = _artifact(tmp_path / "a.rvp", 3 << 20)
    with pytest.raises(ArtifactError):
        runtime.load(path)
    assert not _walks()
    with Artifact.open(path) as art:
        program, weights = art.sections["program"], art.sections["weights"]
    assert calls[0][:2] == (program.offset, program.size)
    rest = [offset for offset, _, _ in calls[1:]]
    assert rest == sorted(rest) and all(o >= weights.offset for o in rest)
    assert not rest or rest[0] == weights.offset
