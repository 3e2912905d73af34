"""A section uploaded to the GPU checked on the GPU: the artifact's piece hash
(artifacts/piece_hash.py, a sha256 kernel from its cubins) over the section's pieces in device
memory, the digests copied back and compared with the artifact's digest table.

It replaces the CPU's hashing of the weights as they stream (artifacts/stream.py), which on a
31B model held the upload to ~10 GB/s (~0.95 GB/s a thread): the stream then only reads and
copies, and the GPU hashes ~30K 1 MiB pieces, a thread each, in tens of milliseconds. The bytes
hashed are the bytes on the device, the ones the kernels will read. A mismatch raises the
container's one-line corrupt-piece error naming the lowest corrupt piece; the caller runs
nothing on the section before `check_on_device` returned, and frees what it allocated
otherwise.

The CUDA calls are the ones a `CudaContext` makes (cuda_driver.py); the context must be current
on the calling thread.
"""

from __future__ import annotations

import ctypes

import numpy as np

from rvcompile.artifacts.container import corrupt_piece_error, section_pieces
from rvcompile.artifacts.format import DIGEST_SIZE, SectionInfo
from rvcompile.artifacts.piece_hash import MAX_DEVICE_PIECE_SIZE, THREADS, grid
from rvcompile.runtime.executors.cuda_driver import CudaContext, DeviceBuffer


def hashes_on_device(section: SectionInfo) -> bool:
    """Whether `section`'s pieces are small enough (and many enough: a thread each) to hash on
    the GPU; above MAX_DEVICE_PIECE_SIZE the CPU hashes them as they stream."""
    return section.piece_size <= MAX_DEVICE_PIECE_SIZE


def digest_bytes(section: SectionInfo) -> int:
    """Bytes of device memory the digests of `section` take (check_on_device's `digests`)."""
    return DIGEST_SIZE * len(section.piece_sha256)


def check_on_device(ctx: CudaContext, kernel, section: SectionInfo, base: int,
                    digests: DeviceBuffer, stream, fname: str) -> None:
    """Hash `section`, uploaded at device address `base`, with the piece hash `kernel` into
    `digests` (digest_bytes long) on `stream`, wait, and compare every digest with the
    recorded one; ArtifactError (corrupt_piece_error) on the first that differs."""
    count = len(section.piece_sha256)
    if count == 0:
        return
    ctx.launch(kernel, grid(count), (THREADS, 1, 1), 0,
               [ctypes.c_uint64(base), ctypes.c_int64(section.piece_size),
                ctypes.c_int64(section.size), ctypes.c_int32(count),
                ctypes.c_uint64(digests.ptr)], stream)
    host = np.empty(DIGEST_SIZE * count, np.uint8)
    ctx.copy_to_host(host, digests.ptr, stream)
    ctx.stream_synchronize(stream)
    got = host.tobytes()
    if got == b"".join(section.piece_sha256):
        return
    bad = next(i for i, want in enumerate(section.piece_sha256)
               if got[DIGEST_SIZE * i:DIGEST_SIZE * (i + 1)] != want)
    raise corrupt_piece_error(fname, section_pieces(section)[bad],
                              got[DIGEST_SIZE * bad:DIGEST_SIZE * (bad + 1)],
                              section.piece_sha256[bad])
