"""Asking the kernel to read an artifact's sections into the page cache ahead of their readers.

`Readahead.start(art, names)` walks sections `names` of an open artifact, in that order, each
from its first byte, on a thread of its own, advising the kernel chunk by chunk
(`posix_fadvise(WILLNEED)`: the kernel queues the reads and returns; a full device queue paces
the walk at the disk's rate) until the last ends or `stop()` is called. runtime.load starts it
as soon as the file is open on the small sections, which its checks read at once, then on the
weights, so that on a cold disk the first gigabytes are read while the manifest is checked and
the GPU's context opens, before any reader wants them; the readers (artifacts/stream.py) take
the pieces in file order too, find them cached, and catch up with the walk, whose later advice
then costs nothing. On a warm page cache every call finds its pages cached. The small sections
go first because a check's read waits behind whatever the walk has queued: advising the weights
alone made the cold checks of an E4B artifact 1.2 s slower on an H200 host (docs/BENCHMARKS.md).

Advice only: nothing is read into this process, no byte is trusted for it (the readers hash
what they read), and an error of the advice (an OS without posix_fadvise: `start` returns None;
a failed call) ends the walk and nothing else. The walk holds its own duplicate of the file's
descriptor, closed when it ends, so closing the artifact never races it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from rvcompile.artifacts.container import Artifact

CHUNK_BYTES = 32 << 20  # per call: a few dozen calls a GB


@dataclass
class Readahead:
    """One walk over `ranges` ((offset, size) in file order of advice); `advised` bytes so far
    (read it after stop())."""

    ranges: tuple[tuple[int, int], ...]
    fd: int
    advised: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, art: Artifact, names: Sequence[str]) -> Readahead | None:
        """The walk of the sections `names` the artifact has, in that order, begun; None where
        the OS has no posix_fadvise or the artifact none of them."""
        ranges = tuple((art.sections[n].offset, art.sections[n].size)
                       for n in names if n in art.sections and art.sections[n].size)
        if not hasattr(os, "posix_fadvise") or not ranges:
            return None
        walk = cls(ranges, os.dup(art.fileno()))
        walk._thread = threading.Thread(target=walk._run, name="rvrun-readahead", daemon=True)
        walk._thread.start()
        return walk

    def _run(self) -> None:
        try:
            # the first chunk whatever happens: a reader wants it first
            for offset, size in self.ranges:
                done = 0
                while done < size:
                    n = min(CHUNK_BYTES, size - done)
                    os.posix_fadvise(self.fd, offset + done, n, os.POSIX_FADV_WILLNEED)
                    done += n
                    self.advised += n
                    if self._stop.is_set():
                        return
        except OSError:
            pass  # advice only: the readers read the file themselves either way
        finally:
            os.close(self.fd)

    def stop(self) -> int:
        """Ends the walk (after its current call; the first is always made) and returns the
        bytes advised."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.advised
