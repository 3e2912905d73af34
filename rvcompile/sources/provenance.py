"""Where a build's weights came from, as the artifact records it (manifest field `source`,
artifacts/manifest.py) and `rvcompile inspect` shows it.

A checkpoint is named by its directory and a digest of its files: the sha256 of every top-level
`*.safetensors`, `*.json` and `*.jinja` file (weights, index, config, tokenizer, generation
config, chat template: everything a build may read from it), and one digest over the list of
`NAME SHA256` lines, sorted by name. A file's sha256 is what the Hugging Face Hub shows as its
LFS object id, so each can be checked against the release. Random weights are named by their
seed (and range rule, when not the default).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHECKPOINT_PATTERNS = ("*.safetensors", "*.json", "*.jinja")
CHUNK = 8 << 20


def weights_directory(model: str, weights: Path | None, random_weights: bool) -> Path | None:
    """The directory the build reads weights from (checkpoint.load_model_source's rule), or
    None for random weights."""
    if random_weights:
        return None
    return Path(weights) if weights is not None else Path(model)


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted({p for pat in CHECKPOINT_PATTERNS for p in directory.glob(pat) if p.is_file()})


def checkpoint_record(directory: Path, on_bytes: Callable[[int], None] = lambda n: None
                      ) -> dict[str, Any]:
    """{"kind": "checkpoint", "path", "files": {name: sha256}, "digest"}; `on_bytes(n)` after
    each n bytes hashed."""
    files = {}
    for path in checkpoint_files(directory):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                on_bytes(len(chunk))
        files[path.name] = h.hexdigest()
    return {"kind": "checkpoint", "path": str(directory.resolve()), "files": files,
            "digest": files_digest(files)}


def files_digest(files: dict[str, str]) -> str:
    lines = "".join(f"{name} {sha}\n" for name, sha in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def random_record(seed: int, ranges: str | None) -> dict[str, Any]:
    return {"kind": "random", "seed": seed, **({"ranges": ranges} if ranges else {})}
