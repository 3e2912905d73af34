"""Artifact sha256 verification speed: writes a synthetic .rvp of N GiB with ArtifactWriter (its
commit hashes every piece, timed too), then times `Artifact.verify` at each thread count, in GB/s
of file bytes. Verification is on by default at load, so this is the bulk of cold start.

By default the file is in the page cache (just written, plus one untimed pass), which measures
hashing; `--cold` evicts the file's pages before every timed pass (posix_fadvise DONTNEED, no
root needed), which measures the disk too. `--artifact` times an existing file instead.

    python benchmarks/artifact_verify.py [--gib 4] [--threads 1,2] [--piece-mib 256] [--cold]
    python benchmarks/artifact_verify.py --artifact g31-h100.rvp --threads 1,8,16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from rvcompile.artifacts import Artifact, ArtifactHeader, ArtifactWriter

CHUNK = 64 << 20  # bytes per write of the synthetic weights


def cores() -> int:
    return len(os.sched_getaffinity(0))


def write_synthetic(path: Path, gib: float, piece_size: int, threads: int) -> None:
    """`gib` GiB of weights (a repeated random chunk, its first 8 bytes a counter so no two
    chunks are alike) and a small programs section; prints write and commit times."""
    size = int(gib * (1 << 30))
    chunk = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    header = ArtifactHeader("bench", "synthetic", ("cpu",))
    t0 = time.perf_counter()
    with ArtifactWriter(path, header, piece_size=piece_size, threads=threads) as w:
        w.add("programs", b"synthetic programs")
        w.reserve("weights", size)
        for i, offset in enumerate(range(0, size, CHUNK)):
            chunk[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            w.write("weights", offset, chunk[: min(CHUNK, size - offset)])
        t1 = time.perf_counter()
        w.commit({"model": "synthetic"})
    t2 = time.perf_counter()
    print(f"wrote {path} ({size / 1e9:.2f} GB) in {t1 - t0:.1f} s; commit (hash {threads} "
          f"threads, fsync, rename) {t2 - t1:.2f} s = {size / 1e9 / (t2 - t1):.2f} GB/s")


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def time_verify(path: Path, threads: int, cold: bool) -> tuple[float, float]:
    """Wall seconds of one verify, and this process's CPU seconds (all threads) during it: their
    ratio shows how many cores the threads kept busy, even on a machine shared with other work."""
    if cold:
        evict(path)
    with Artifact.open(path) as art:
        t0, c0 = time.perf_counter(), time.process_time()
        art.verify(threads=threads)
        return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="size of the synthetic weights")
    p.add_argument("--threads", default=f"1,{cores()}",
                   help="comma-separated thread counts to time (default: 1 and every core)")
    p.add_argument("--piece-mib", type=int, default=256, help="piece size of the synthetic file")
    p.add_argument("--repeat", type=int, default=3, help="timed passes per thread count")
    p.add_argument("--cold", action="store_true", help="evict the file from the page cache "
                                                       "before each timed pass")
    p.add_argument("--dir", type=Path, default=None, help="where to write the synthetic file")
    p.add_argument("--artifact", type=Path, default=None,
                   help="time this existing artifact instead of writing one")
    a = p.parse_args()
    thread_counts = [int(t) for t in a.threads.split(",")]
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = a.artifact
        if path is None:
            path = Path(tmp) / "synthetic.rvp"
            write_synthetic(path, a.gib, a.piece_mib << 20, max(thread_counts))
        size = path.stat().st_size
        with Artifact.open(path) as art:
            pieces = sum(len(s.piece_sha256) for s in art.sections.values())
            print(f"{path.name}: {size / 1e9:.2f} GB, {len(art.sections)} sections, {pieces} "
                  f"pieces of {art.piece_size >> 20} MiB; {cores()} cores; page cache "
                  f"{'cold (evicted before each pass)' if a.cold else 'warm'}")
        if not a.cold:
            time_verify(path, max(thread_counts), cold=False)  # untimed: fills the page cache
        for threads in thread_counts:
            runs = [time_verify(path, threads, a.cold) for _ in range(a.repeat)]
            times = [wall for wall, _ in runs]
            best, median = min(times), statistics.median(times)
            busy = sum(cpu for _, cpu in runs) / sum(times)
            print(f"verify threads={threads:3}: best {best:6.2f} s = {size / 1e9 / best:6.2f} "
                  f"GB/s, median {median:6.2f} s = {size / 1e9 / median:6.2f} GB/s, "
                  f"{busy:.2f} cores busy ({a.repeat} passes)")


if __name__ == "__main__":
    main()
