"""Shared fixtures. `oracle_dir(case, seed=0)` gives a cached transformers oracle checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


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
