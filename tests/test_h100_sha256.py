"""The piece hash (targets/h100/sha256.py, kernels/sha256.cu): SHA-256 of many pieces of device
memory, a thread each, against hashlib.sha256 per piece.

On the CPU: the reference is hashlib's, piece by piece (an empty and a short last piece
included), and the cubin declares the kernel with the parameters and block size the runtime
launches (artifacts/piece_hash.py). On an H100 (marked gpu): random bytes in pieces of every
padding case (55, 56, 63, 64, 65 bytes: one padding block or two), short and empty last pieces,
pieces that start unaligned (the byte-load path) and a base that does, the piece counts of a real
load (~30K threads), and the rate over a 31B-sized section.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil

import numpy as np
import pytest
from h100_helpers import h100_context

from rvcompile.artifacts.cubin import kernels
from rvcompile.artifacts.piece_hash import DEVICE_PIECE_SIZE, PARAM_BYTES, THREADS, grid
from rvcompile.targets.h100 import sha256


def _want(data: bytes, piece: int, count: int) -> np.ndarray:
    return np.array([np.frombuffer(hashlib.sha256(data[i * piece:(i + 1) * piece]).digest(),
                                   np.uint8) for i in range(count)])


def test_reference_is_hashlib_per_piece() -> None:
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    for piece, count in ((64, 16), (55, 19), (1000, 1), (300, 4)):
        got = sha256.reference(data, piece, count)
        assert np.array_equal(got, _want(data.tobytes(), piece, count))
    assert sha256.reference(b"", 64, 1)[0].tobytes() == hashlib.sha256(b"").digest()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cubin_declares_what_the_runtime_launches(tmp_path) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    k = kernels(compile_cubin(sha256.SOURCE, cache_dir=tmp_path))[sha256.ENTRY]
    assert k.param_sizes == PARAM_BYTES and k.max_threads == THREADS


def _run(ctx, fn, data: np.ndarray, offset: int, piece: int, total: int, count: int):
    """The kernel over `total` bytes from byte `offset` of `data` uploaded; digests [count, 32].
    The digests' buffer starts as 0xff, so a thread that writes nothing shows."""
    buf = ctx.upload(data)
    out = ctx.alloc(32 * count)
    try:
        ctx.memset(out, 0xFF)
        ctx.launch(fn, grid(count), (THREADS, 1, 1), 0,
                   [ctypes.c_uint64(buf.ptr + offset), ctypes.c_int64(piece),
                    ctypes.c_int64(total), ctypes.c_int32(count), ctypes.c_uint64(out.ptr)])
        ctx.synchronize()
        return ctx.download(out, np.uint8, (count, 32))
    finally:
        ctx.free(buf)
        ctx.free(out)


CASES = [  # (piece size, offset of the first piece from an aligned base, total bytes)
    (64, 0, 0),  # one empty piece
    (64, 0, 55), (64, 0, 56), (64, 0, 63), (64, 0, 64), (128, 0, 65),  # the padding's cases
    (55, 0, 55 * 9), (56, 0, 56 * 9 + 1), (63, 0, 63 * 5 + 62), (65, 0, 65 * 40),
    (4096, 0, 4096 * 33 + 17),  # a short last piece
    (4096, 1, 4096 * 7 + 100),  # every piece unaligned: byte loads
    (1000, 0, 1000 * 50 + 3),  # aligned base, pieces at 8-byte steps: some unaligned
    (DEVICE_PIECE_SIZE, 0, 5 * DEVICE_PIECE_SIZE + 12345),  # the build's pieces
    (DEVICE_PIECE_SIZE, 16, 3 * DEVICE_PIECE_SIZE),  # aligned, not at the allocation's start
]


@pytest.mark.gpu
@pytest.mark.parametrize("piece,offset,total", CASES)
def test_gpu_pieces_match_hashlib(piece: int, offset: int, total: int) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    fn = ctx.load_function(compile_cubin(sha256.SOURCE), sha256.ENTRY)
    rng = np.random.default_rng(piece * 7919 + offset + total)
    data = rng.integers(0, 256, offset + total + 64, dtype=np.uint8)  # bytes past the end too
    count = max(1, -(-total // piece))
    got = _run(ctx, fn, data, offset, piece, total, count)
    assert np.array_equal(got, _want(data[offset:offset + total].tobytes(), piece, count))


@pytest.mark.gpu
def test_gpu_real_piece_counts() -> None:
    """32768 pieces (a 31B's weights in 1 MiB pieces are ~30K threads), of 4 KiB here."""
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    fn = ctx.load_function(compile_cubin(sha256.SOURCE), sha256.ENTRY)
    piece, count = 4096, 32768
    total = piece * count - 999
    data = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    got = _run(ctx, fn, data, 0, piece, total, count)
    assert np.array_equal(got, _want(data.tobytes(), piece, count))


@pytest.mark.gpu
def test_gpu_rate_at_31b_scale() -> None:
    """The rate over ~30 GiB of 1 MiB pieces (the 31B's weights; less where the GPU has less
    free): every piece the same bytes, so each digest is checked against one hashlib."""
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    fn = ctx.load_function(compile_cubin(sha256.SOURCE), sha256.ENTRY)
    free, _ = ctx.mem_info()
    count = min(30 * 1024, (free // 2) // DEVICE_PIECE_SIZE)
    total = count * DEVICE_PIECE_SIZE
    buf, out = ctx.alloc(total), ctx.alloc(32 * count)
    start, end = ctx.event(), ctx.event()
    try:
        ctx.memset(buf, 0x5A)
        args = [ctypes.c_uint64(buf.ptr), ctypes.c_int64(DEVICE_PIECE_SIZE),
                ctypes.c_int64(total), ctypes.c_int32(count), ctypes.c_uint64(out.ptr)]
        ctx.launch(fn, grid(count), (THREADS, 1, 1), 0, args)  # warm-up
        ctx.record(start)
        ctx.launch(fn, grid(count), (THREADS, 1, 1), 0, args)
        ctx.record(end)
        ms = ctx.elapsed_ms(start, end)
        got = ctx.download(out, np.uint8, (count, 32))
    finally:
        ctx.free(buf)
        ctx.free(out)
    want = np.frombuffer(hashlib.sha256(b"\x5a" * DEVICE_PIECE_SIZE).digest(), np.uint8)
    assert (got == want).all()
    print(f"\n[measured] sha256_pieces: {count} pieces of 1 MiB ({total / 1e9:.1f} GB) in "
          f"{ms:.1f} ms = {total / ms / 1e6:.0f} GB/s")
