"""The piece hash on the device: what an h100 build and the runtime agree on, so that the runtime
checks a section's pieces on the GPU without importing compiler code.

An h100 artifact's manifest may name (h100.piece_hash, format v7 since 2026-11-29) a kernel of one
of its cubins that computes, one thread per piece, the sha256 of every piece of a section in
device memory (targets/h100/kernels/sha256.cu): parameters (data, piece_size, total, count,
digests) of PARAM_BYTES bytes, launched in blocks of THREADS threads, digest i (32 bytes, as
hashlib gives it) written at digests + 32 i. The build cuts an h100 artifact's sections into
pieces of DEVICE_PIECE_SIZE, so a 32 GB weights section is ~30K pieces, ~30K GPU threads; the
runtime hashes on the GPU only pieces of at most MAX_DEVICE_PIECE_SIZE (fewer, longer pieces
leave the GPU's cores idle: one thread hashes at a few hundred MB/s), and on the CPU otherwise
(an artifact built with the default 256 MiB pieces, or without the kernel).
"""

from __future__ import annotations

PARAM_BYTES = (8, 8, 8, 4, 8)  # data*, long long piece_size, long long total, int count, digests*
THREADS = 64  # a block's threads; the kernel's __launch_bounds__
DEVICE_PIECE_SIZE = 1 << 20  # what h100 builds hash in (format.PIECE_SIZE elsewhere)
MAX_DEVICE_PIECE_SIZE = 4 << 20  # the runtime's limit for hashing on the GPU


def grid(count: int) -> tuple[int, int, int]:
    """The launch grid over `count` >= 1 pieces, a thread each."""
    return (-(-count // THREADS), 1, 1)
