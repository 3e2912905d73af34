"""Checks of an artifact that run on a thread of their own while the executor loads it.

`runtime.load` checks first, on its own thread, everything that decides where the weights go
(the manifest, the kernel schedule) and the cubins the executor will load; the rest of the small
sections' parsing (the tokenizer and its vocabulary, the generation config, the chat template:
artifacts/contents.py), which decides nothing about the device, runs here alongside the
executor's load (context, arena, the weights' upload). The contract, for every executor
(LoadOptions.checks):
- `wait()` blocks until the checks are done and raises their ArtifactError if one failed; an
  executor calls it before anything runs on the device (a kernel launch, a graph replay or
  upload, a program run) and before it returns;
- `failed()` says, without blocking, that a check has already failed, so a long upload stops at
  its next chunk instead of running to its end (the caller then frees what it allocated);
- `error()` (runtime.load, after any failure of the load) waits for the checks and returns what
  they raised, or None: their error is the load's error, as it was when they ran first.

Seconds: `seconds` is the checks' own wall time on their thread; `waited_s` the time callers
spent blocked in `wait`/`error`/`result`, i.e. what the checks added to the load's wall time.
Their thread holds Python's GIL for most of that time (the `tokenizers` parser does not release
it), so the time they ran alongside is hidden only where the other threads were in driver calls,
reads or hashes, which release it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class PendingChecks:
    """The checks of one load; `PendingChecks()` is one with nothing pending (already passed)."""

    def __init__(self) -> None:
        self._future: Future | None = None
        self.seconds = 0.0  # the checks' wall time on their thread
        self.ended_at = 0.0  # time.perf_counter() when they ended (0.0: nothing pending)
        self.waited_s = 0.0  # callers' time blocked on them

    @classmethod
    def start(cls, check: Callable[..., Any], *args: Any) -> PendingChecks:
        """`check(*args)` on a new thread, now; its return value is `result()`'s."""
        pending = cls()

        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                return check(*args)
            finally:  # before the future completes: set once anyone sees it done
                pending.ended_at = time.perf_counter()
                pending.seconds = pending.ended_at - t0

        pool = ThreadPoolExecutor(1, thread_name_prefix="rvrun-check")
        pending._future = pool.submit(timed)
        pool.shutdown(wait=False)  # its one thread ends with the check
        return pending

    def done(self) -> bool:
        """True once the checks finished, passed or not (never blocks)."""
        return self._future is None or self._future.done()

    def failed(self) -> bool:
        """True once a check has failed (never blocks)."""
        f = self._future
        return f is not None and f.done() and f.exception() is not None

    def wait(self) -> None:
        """Blocks until the checks are done; raises their error if one failed."""
        self.result()

    def result(self) -> Any:
        """The check's return value (None when nothing was pending), once done; raises its
        error."""
        if self._future is None:
            return None
        t0 = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self.waited_s += time.perf_counter() - t0

    def error(self) -> BaseException | None:
        """Waits for the checks; what they raised, or None."""
        if self._future is None:
            return None
        t0 = time.perf_counter()
        try:
            return self._future.exception()
        finally:
            self.waited_s += time.perf_counter() - t0
