"""safetensors files, parsed here directly (numpy has no bfloat16): header checks and one tensor's
read.

Layout: an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}}, then the data section; offsets are relative to its start.
`read_safetensors_header` checks everything the header claims before any tensor is read;
`read_tensor` and `read_fp8_tensor` read one tensor each (values checked there: NaN/Inf), and
`read_rows` / `read_fp8_rows` a range of its rows (the tensor as [prod(shape[:-1]), shape[-1]]),
so the build can stream a 10 GB embedding table in blocks of a few hundred MB.
Every error is a one-line CheckpointError naming the file and tensor.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from rvcompile.sources.model_source import CheckpointError, Fp8Tensor

# safetensors dtype -> (source_dtype, numpy dtype of the stored bits); anything else is refused.
SUPPORTED_DTYPES = {
    "BF16": ("bfloat16", np.dtype("<u2")),
    "F16": ("float16", np.dtype("<f2")),
    "F32": ("float32", np.dtype("<f4")),
}
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a checked header states it."""

    raw_name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a name given twice would silently lose one of its tensors."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"tensor {key} appears twice")
        out[key] = value
    return out


def read_safetensors_header(path: Path) -> list[HeaderEntry]:
    """Parse and validate a safetensors header; entries sorted by data offset.

    Checked: the header length fits the file and the library's limit, the header is a JSON
    object without repeated names, every entry has a known dtype, a shape of non-negative
    integers and two integer data_offsets whose span is exactly shape * itemsize bytes inside
    the data section, and no two tensors' bytes overlap."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, too short)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header: header length {n} is above the "
                    f"{_MAX_HEADER}-byte limit (not a safetensors file?)"
                )
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: corrupt safetensors header: header length {n} runs past the end "
                    f"of the {size}-byte file (truncated or not a safetensors file?)"
                )
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        what = f"{path}: corrupt safetensors header: tensor {name}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{what}: entry is not a JSON object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ITEMSIZE:
            raise CheckpointError(f"{what}: unknown dtype {json.dumps(dtype)}")
        if not isinstance(shape, list) or not all(_is_count(x) for x in shape):
            raise CheckpointError(
                f"{what}: shape {json.dumps(shape)} is not a list of integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(x) for x in offsets)):
            raise CheckpointError(
                f"{what}: data_offsets {json.dumps(offsets)} is not two integers >= 0")
        begin, end = offsets
        if begin > end:
            raise CheckpointError(f"{what}: data_offsets [{begin}, {end}] end before they begin")
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name} data ends at byte {end} but the data section has only "
                f"{data_len} bytes (truncated file?)"
            )
        need = math.prod(shape) * _ITEMSIZE[dtype]
        if end - begin != need:
            raise CheckpointError(
                f"{what}: has {end - begin} bytes but {dtype}{shape} needs {need}"
            )
        entries.append(HeaderEntry(name, dtype, tuple(shape), data_start + begin, end - begin))
    entries.sort(key=lambda e: (e.start, e.nbytes))
    for before, after in itertools.pairwise(entries):
        if after.start < before.start + before.nbytes:
            raise CheckpointError(
                f"{path}: corrupt safetensors header: tensors {before.raw_name} and "
                f"{after.raw_name} overlap (data_offsets [{before.start - data_start}, "
                f"{before.start - data_start + before.nbytes}] and [{after.start - data_start}, "
                f"{after.start - data_start + after.nbytes}])"
            )
    return entries


def _is_count(x: Any) -> bool:
    """A JSON integer >= 0 (true/false are not sizes)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_stored(path: str, raw_name: str, start: int, nbytes: int,
                 stored: np.dtype) -> np.ndarray:
    """One tensor's bytes as a flat array of `stored`; CheckpointError on a short read."""
    buf = np.empty(nbytes // stored.itemsize, stored)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            got = f.readinto(buf.view(np.uint8))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tensor {raw_name}: {e.strerror or e}") from None
    if got != nbytes:
        raise CheckpointError(
            f"{path}: tensor {raw_name}: read {got} of {nbytes} bytes (file truncated?)"
        )
    return buf


def read_tensor(path: str, raw_name: str, start: int, dtype: str,
                shape: tuple[int, ...]) -> np.ndarray:
    """Read one tensor as float32 [shape]; CheckpointError on a short read or NaN/Inf."""
    rows = num_rows(shape)
    return read_rows(path, raw_name, start, dtype, shape, 0, rows).reshape(shape)


def num_rows(shape: tuple[int, ...]) -> int:
    """Rows of the tensor as [prod(shape[:-1]), shape[-1]] (a vector is one row)."""
    return math.prod(shape[:-1])


def read_rows(path: str, raw_name: str, start: int, dtype: str, shape: tuple[int, ...],
              first: int, stop: int) -> np.ndarray:
    """Rows [first, stop) of a BF16/F16/F32 tensor as float32 [stop - first, shape[-1]];
    CheckpointError on a short read or NaN/Inf (its index given in the whole tensor)."""
    stored = SUPPORTED_DTYPES[dtype][1]
    width = shape[-1] if shape else 1
    row_bytes = width * stored.itemsize
    buf = read_stored(path, raw_name, start + first * row_bytes, (stop - first) * row_bytes,
                      stored)
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        bits = np.empty(buf.shape, np.uint32)
        np.left_shift(buf, np.uint32(16), out=bits, dtype=np.uint32)
        out = bits.view(np.float32)
    else:
        out = buf.astype(np.float32, copy=False)
    _check_finite(out, f"{path}: tensor {raw_name}", shape, first * width)
    return out.reshape(stop - first, width)


def read_fp8_tensor(path: str, weight: HeaderEntry, scale_path: str,
                    scale: HeaderEntry) -> Fp8Tensor:
    """An F8_E4M3 weight [N, K] and its weight_scale ([N, 1], [N], [1] or [], expanded to [N]),
    as stored; CheckpointError on a short read, a NaN value or a NaN/Inf scale."""
    return read_fp8_rows(path, weight, scale_path, scale, 0, weight.shape[0])


def read_fp8_rows(path: str, weight: HeaderEntry, scale_path: str, scale: HeaderEntry,
                  first: int, stop: int) -> Fp8Tensor:
    """Rows [first, stop) of an F8_E4M3 weight [N, K] and their scales (read_fp8_tensor)."""
    width = weight.shape[-1]
    codes = read_stored(path, weight.raw_name, weight.start + first * width,
                        (stop - first) * width, np.dtype(np.uint8))
    _check_e4m3(codes, weight.shape, f"{path}: tensor {weight.raw_name}", first * width)
    s = read_tensor(scale_path, scale.raw_name, scale.start, scale.dtype, scale.shape)
    scales = np.broadcast_to(s.reshape(-1), weight.shape[:1])[first:stop]
    return Fp8Tensor(codes.view(ml_dtypes.float8_e4m3fn).reshape(stop - first, width),
                     np.ascontiguousarray(scales, np.float32))


def dequantized(read_fp8: Callable[[], Fp8Tensor]) -> np.ndarray:
    """float32: what `read_fp8` reads, dequantized (a TensorRef reader, picklable as a partial)."""
    return read_fp8().dequantize()


def _check_e4m3(codes: np.ndarray, shape: tuple[int, ...], what: str, base: int = 0,
                step: int = 1 << 24) -> None:
    """e4m3fn has no Inf; S.1111.111 is its NaN. `codes` start at flat index `base` of `shape`."""
    for i in range(0, codes.size, step):
        nan = np.flatnonzero((codes[i:i + step] & 0x7F) == 0x7F)
        if nan.size:
            index = tuple(int(x) for x in np.unravel_index(base + i + int(nan[0]), shape))
            raise CheckpointError(f"{what} has a NaN at index {list(index)}")


def _check_finite(flat: np.ndarray, what: str, shape: tuple[int, ...], base: int = 0,
                  step: int = 1 << 24) -> None:
    """`flat` (1-D) holds the values from flat index `base` of a tensor of `shape`."""
    for i in range(0, flat.size, step):
        piece = flat[i:i + step]
        # A sum is finite unless a value is NaN/Inf (or it overflows: then look closer).
        if not np.isfinite(piece.sum()) and not np.isfinite(piece).all():
            j = i + int(np.flatnonzero(~np.isfinite(piece))[0])
            kind = "a NaN" if np.isnan(flat[j]) else "an Inf"
            index = tuple(int(x) for x in np.unravel_index(base + j, shape))
            raise CheckpointError(f"{what} has {kind} at index {list(index)}")
