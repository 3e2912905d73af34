"""SHA-256 of many pieces on the device (kernels/sha256.cu): the hashlib reference and launch
geometry of the kernel the runtime checks uploaded sections with (artifacts/piece_hash.py; the
build puts its cubin in every h100 artifact, the runtime loads it: runtime/executors/h100.py).

Entry `sha256_pieces(data bytes [total], piece_size, total, count, digests bytes [count, 32])`:
digests[i] = sha256(data[i * piece_size : min((i + 1) * piece_size, total)]) for i < count (FIPS
180-4 with the standard padding; an empty piece hashes as b""). One thread a piece; the runtime
launches it (artifacts/piece_hash.py: THREADS, grid).
"""

from __future__ import annotations

import hashlib

import numpy as np

from rvcompile.targets.h100.contract import Call, Entry, i32, i64, ptr

SOURCE = "sha256.cu"
ENTRY = "sha256_pieces"


def reference(data: bytes | np.ndarray, piece_size: int, count: int) -> np.ndarray:
    """uint8 [count, 32]: hashlib.sha256 of each piece of `data` (the kernel's output)."""
    data = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else np.ascontiguousarray(
        data, np.uint8)
    out = np.empty((count, 32), np.uint8)
    for i in range(count):
        out[i] = np.frombuffer(hashlib.sha256(data[i * piece_size:(i + 1) * piece_size]).digest(),
                               np.uint8)
    return out


def _call(c: Call) -> None:
    count = c["count"]
    c.array("digests", (count, 32))[:] = reference(c.array("data", (c["total"],)),
                                                   c["piece_size"], count)


ENTRIES = (Entry(ENTRY, SOURCE, (ptr("data", "bytes"), i64("piece_size"), i64("total"),
                                 i32("count"), ptr("digests", "bytes", "out")), _call),)
