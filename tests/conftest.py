"""Shared fixtures. `oracle_dir(case, seed=0)` gives a cached transformers oracle checkpoint."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# libtpu takes a one-process lockfile (/tmp/libtpu_lockfile) when it loads, even only to compile
# for a topology; the TPU-topology tests run in several pytest workers (and the rvcompile
# processes they start inherit this), so they would fail on each other's lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@pytest.fixture(scope="session")
def oracle_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Any, Path]]:
    """A function `(case, seed=0) -> (model, dir)`: the oracle model of `case` (see
    tests/oracle.py) and its saved checkpoint directory, built once per session. Tests share the
    model: never modify it."""
    cache: dict[tuple[str, int], tuple[Any, Path]] = {}

    def get(case: str, seed: int = 0) -> tuple[Any, Path]:
        if (case, seed) not in cache:
            from oracle import make_oracle_model, save_oracle_checkpoint  # torch only when used

            model = make_oracle_model(case, seed)
            path = save_oracle_checkpoint(model, tmp_path_factory.mktemp(f"oracle-{case}-{seed}"))
            cache[(case, seed)] = (model, path)
        return cache[(case, seed)]

    return get


@pytest.fixture
def break_mask_jobs(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A function that, once called, makes grammar mask jobs raise on the grammars' worker
    thread ("llguidance broke"); masks computed on any other thread (the engine's) still work.
    `monkeypatch.undo()` mends them."""
    import threading

    from rvcompile.runtime.constraints import Grammars

    fill_call = Grammars._fill_call

    def broken_on_the_worker(self, matchers):
        out, compute = fill_call(self, matchers)

        def run():
            if threading.current_thread().name.startswith("rvrun-masks"):
                raise RuntimeError("llguidance broke")
            compute()
        return out, run

    return lambda: monkeypatch.setattr(Grammars, "_fill_call", broken_on_the_worker)


def once_across_workers(tmp_path_factory: pytest.TempPathFactory, name: str,
                        compute: Callable[[Path], Any]) -> Any:
    """compute(a fresh directory)'s JSON-able result, computed once per test session even under
    pytest-xdist (the workers share their base temp's parent: the first to take the lock
    computes, the others wait and read its result), for module fixtures too costly to run on
    every worker."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            work = root / name
            work.mkdir(exist_ok=True)
            done.write_text(json.dumps(compute(work)))
    return json.loads(done.read_text())

