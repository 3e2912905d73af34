"""Deterministic random weights with realistic magnitudes, for `--random-weights --seed S`.

Every tensor is a function of (seed, name) alone, so tensors can be generated in any order, in
parallel, or one at a time while streaming. Values are uniform (cheap to make from raw random
bits) with the spread a trained Gemma 4 has:

    linear weights / experts      std 1/sqrt(fan_in), fan_in = last dim
    embed_tokens(_per_layer)      std 0.03
    RMSNorm weights               [0.5, 1.5]  (Gemma 4 scales by w, not 1 + w)
    layer_scalar                  [0.5, 1.0]
    router.scale                  [0.8, 1.2]
    router.per_expert_scale       [0.5, 1.5]

A tensor is cut into CHUNK-value pieces; piece k comes from its own SFC64 stream seeded with
(seed, hash(name), k), so the result does not depend on how many threads fill it, and a range
of rows (`random_rows`, how the build streams a large tensor) is made without the rest. Each raw
64-bit word gives four int16 samples, mapped to float32 with one multiply (and one add for
ranges not centred on zero).

An assistant's tensors ("assistant.*") are drawn the same way, by their name without the prefix
(its embedding std 0.03, ...), and its masked head's token_ordering is a random permutation of
the vocabulary, also a function of (seed, name).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rvcompile.model.assistant import TENSOR_PREFIX, AssistantConfig
from rvcompile.model.config import Gemma4Config
from rvcompile.sources.model_source import (
    TOKEN_ORDERING,
    CheckpointError,
    TensorRef,
    expected_assistant_tensors,
    expected_tensors,
)

CHUNK = 1 << 20  # values per independently seeded stream; changing it changes every tensor
EMBED_STD = 0.03
SQRT3 = math.sqrt(3.0)  # a uniform on [-a, a] has std a / sqrt(3)
RangeRule = Callable[[str, tuple[int, ...]], tuple[float, float]]  # (name, shape) -> (low, high)


def init_range(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """The uniform [low, high] that tensor `name` (canonical, no "model.") is drawn from."""
    parts = name.split(".")
    module = parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]
    if parts[-1] == "layer_scalar":
        return 0.5, 1.0
    if parts[-2:] == ["router", "per_expert_scale"]:
        return 0.5, 1.5
    if parts[-2:] == ["router", "scale"]:
        return 0.8, 1.2
    if "norm" in module:
        return 0.5, 1.5
    if parts[0] in ("embed_tokens", "embed_tokens_per_layer"):
        a = EMBED_STD * SQRT3
        return -a, a
    a = SQRT3 / math.sqrt(shape[-1])
    return -a, a


def near_identity_init_range(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """Ranges for build-against-build comparisons at full depth; not what `--random-weights`
    draws. As drawn by `init_range`, every layer replaces most of the residual stream with
    unit-RMS functions of it, and a 60-layer network is chaotic: two builds' rounding
    differences grow by a constant factor per layer (benchmarks/depth_drift.py). Here each
    layer updates the stream a little, as a trained model's do, and q/k norms near 1/4 keep
    attention scores off a near one-hot softmax that any rounding flips:

        q_norm / k_norm weights                   [0.125, 0.375]
        post_attention / post_feedforward norms   [0.05, 0.15]
        layer_scalar                              [0.95, 1.0]
        everything else                           as init_range

    Pass it as `ranges` (build_artifact's `random_ranges`), as tests/h100_vs_xla_run.py does.
    """
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 0.125, 0.375
    if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
        return 0.05, 0.15
    if name.endswith("layer_scalar"):
        return 0.95, 1.0
    return init_range(name, shape)


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    try:
        workers = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        workers = os.cpu_count() or 1
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rvcompile-random")


def _name_key(name: str) -> list[int]:
    digest = hashlib.blake2b(name.encode(), digest_size=16).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


def random_array(seed: int, name: str, shape: tuple[int, ...],
                 ranges: RangeRule = init_range) -> np.ndarray:
    """float32 C-contiguous [shape], a pure function of (seed, name, shape), uniform on
    ranges(name, shape)."""
    return _random_values(seed, name, shape, ranges, 0, math.prod(shape)).reshape(shape)


def random_rows(seed: int, name: str, shape: tuple[int, ...], ranges: RangeRule, first: int,
                stop: int) -> np.ndarray:
    """Rows [first, stop) of random_array(seed, name, shape, ranges) seen as
    [prod(shape[:-1]), shape[-1]], made without the rest (a TensorRef's `rows`)."""
    width = shape[-1] if shape else 1
    return _random_values(seed, name, shape, ranges, first * width,
                          stop * width).reshape(stop - first, width)


def _random_values(seed: int, name: str, shape: tuple[int, ...], ranges: RangeRule, start: int,
                   stop: int) -> np.ndarray:
    """Flat values [start, stop) of the tensor: the CHUNK-value pieces that cover them, cut."""
    low, high = ranges(name, shape)
    scale = np.float32((high - low) / 65536.0)
    mid = (high + low) / 2.0
    offset = np.float32(mid + float(scale) / 2.0) if mid else None  # int16 -32768.. -> low..
    key = [seed, *_name_key(name)]
    n = math.prod(shape)
    out = np.empty(stop - start, np.float32)

    def fill(k: int) -> None:
        begin, end = k * CHUNK, min(n, (k + 1) * CHUNK)
        lo, hi = max(start, begin), min(stop, end)
        bits = np.random.SFC64(np.random.SeedSequence([*key, k]))
        samples = bits.random_raw((end - begin + 3) // 4).view(np.int16)[lo - begin:hi - begin]
        piece = out[lo - start:hi - start]
        np.multiply(samples, scale, out=piece)
        if offset is not None:
            piece += offset

    chunks = range(start // CHUNK, (stop + CHUNK - 1) // CHUNK)
    if len(chunks) <= 2:
        for k in chunks:
            fill(k)
    else:
        for _ in _pool().map(fill, chunks):
            pass
    return out


def random_tensors(cfg: Gemma4Config, seed: int,
                   ranges: RangeRule = init_range) -> tuple[TensorRef, ...]:
    """One TensorRef per expected_tensors(cfg) entry, in that order, generated on load()."""
    if seed < 0:
        raise CheckpointError(f"--seed must be >= 0 (got {seed})")
    origin = (f"random(seed={seed})" if ranges is init_range
              else f"random(seed={seed}, ranges={ranges.__name__})")
    return tuple(
        TensorRef(name=name, shape=shape, source_dtype="float32", origin=origin,
                  reader=functools.partial(random_array, seed, name, shape, ranges),
                  rows=functools.partial(random_rows, seed, name, shape, ranges))
        for name, shape in expected_tensors(cfg).items()
    )


def _drafter_range(ranges: RangeRule, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """`ranges` of an assistant tensor, by its name without "assistant."."""
    return ranges(name.removeprefix(TENSOR_PREFIX), shape)


def random_permutation(seed: int, name: str, n: int) -> np.ndarray:
    """int32 [n]: a permutation of [0, n), a pure function of (seed, name, n)."""
    rng = np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, *_name_key(name)])))
    return rng.permutation(n).astype(np.int32)


def random_assistant_tensors(a: AssistantConfig, seed: int,
                             ranges: RangeRule = init_range) -> tuple[TensorRef, ...]:
    """One TensorRef per expected_assistant_tensors(a) entry, generated on load()."""
    if seed < 0:
        raise CheckpointError(f"--seed must be >= 0 (got {seed})")
    origin = (f"random(seed={seed})" if ranges is init_range
              else f"random(seed={seed}, ranges={ranges.__name__})")
    rule = functools.partial(_drafter_range, ranges)
    refs = []
    for name, shape in expected_assistant_tensors(a).items():
        if name == TOKEN_ORDERING:
            refs.append(TensorRef(name=name, shape=shape, source_dtype="int32", origin=origin,
                                  reader=functools.partial(random_permutation, seed, name,
                                                           shape[0])))
        else:
            refs.append(TensorRef(name=name, shape=shape, source_dtype="float32", origin=origin,
                                  reader=functools.partial(random_array, seed, name, shape, rule),
                                  rows=functools.partial(random_rows, seed, name, shape, rule)))
    return tuple(refs)
